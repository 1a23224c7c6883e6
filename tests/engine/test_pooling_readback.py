"""Pooling outputs read back once per step (pooling.PooledBatch), and pooling prompts that
fill max_model_len (vLLM's rule): on the CPU, async scheduling gives exactly the synchronous
outputs, with embed / classify requests finishing in the same step and in different ones,
beside generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashpage import LLM, PoolingParams, SamplingParams
from flashpage import pooling as pooling_mod
from tests.conftest import random_prompts
from tests.models.test_decoder_classifier import build_classifier

ENGINE = dict(dtype="float32", device="cpu", max_num_batched_tokens=32, block_size=8)


def _spy_batches(monkeypatch) -> list[int]:
    """The size of every PooledBatch made (one per step whose prompts end)."""
    sizes: list[int] = []
    init = pooling_mod.PooledBatch.__init__

    def spy(self, states):
        sizes.append(len(states))
        init(self, states)

    monkeypatch.setattr(pooling_mod.PooledBatch, "__init__", spy)
    return sizes


def _run(eng, requests) -> dict[str, object]:
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    got: dict[str, object] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o
    assert eng.kv_manager.num_free_blocks == eng.num_blocks
    return got


def test_embeddings_read_back_per_step(tiny_checkpoint, monkeypatch):
    """Short prompts end together, a 70-token one (chunked) steps later, generation beside
    them; dimensions / normalize mixed in one step: async == sync, exactly."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(5, 3, 6, seed=3) + random_prompts(1, 70, 70, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    params = [PoolingParams(), PoolingParams(dimensions=5), PoolingParams(normalize=False),
              PoolingParams(dimensions=7, normalize=False), PoolingParams(), PoolingParams()]
    requests = [(f"e{i}", p, pp) for i, (p, pp) in enumerate(zip(prompts, params, strict=True))]
    requests += [(f"g{i}", p, greedy) for i, p in enumerate(prompts[:3])]
    sizes = _spy_batches(monkeypatch)
    runs = {}
    for mode in (False, True):
        llm = LLM(str(path), async_scheduling=mode, **ENGINE)
        assert llm.engine.async_scheduling is mode
        runs[mode] = _run(llm.engine, requests)
    assert max(sizes) > 1 and len(sizes) >= 4  # several in one step, and steps apart
    hidden = llm.engine.model_config.hidden_size
    for rid, o in runs[True].items():
        s = runs[False][rid]
        if rid.startswith("g"):
            assert o.outputs[0].token_ids == s.outputs[0].token_ids
            continue
        assert isinstance(o.embedding, np.ndarray) and o.embedding.dtype == np.float32
        assert np.array_equal(o.embedding, s.embedding)
        pp = params[int(rid[1:])]
        assert o.embedding.shape == (pp.dimensions or hidden,)
    # the same as one request at a time (the one-request reference, PoolingState.embedding),
    # up to fp32 rounding: a batch of other rows changes the matmuls' M, and with it the
    # kernel and summation order the CPU BLAS picks (on an AMX / AVX-512 Xeon an
    # embedding moved by 3.7e-6 absolute, 1.4e-4 relative, against 1e-6 / 1e-5
    # elsewhere); async == sync above stays exact (the same batches)
    for i, p in enumerate(prompts):
        ref = llm.embed([p], params[i], use_tqdm=False)[0].outputs.data
        torch.testing.assert_close(torch.from_numpy(runs[True][f"e{i}"].embedding),
                                   torch.from_numpy(ref), atol=2e-5, rtol=1e-4)


def test_classify_read_back_per_step(tmp_path, monkeypatch):
    path = build_classifier(tmp_path / "cls", "qwen2", 3)
    prompts = [[5, 6, 7], list(range(10, 17)), list(range(40, 56)),
               [(7 * i + 3) % 300 + 4 for i in range(45)]]
    sizes = _spy_batches(monkeypatch)
    runs = {}
    for mode in (False, True):
        llm = LLM(str(path), async_scheduling=mode, **ENGINE)
        runs[mode] = [o.outputs.probs for o in llm.classify(prompts, use_tqdm=False)]
    assert max(sizes) > 1 and len(sizes) >= 4
    assert runs[True] == runs[False]
    for p, probs in zip(prompts, runs[True], strict=True):
        one = llm.classify([p], use_tqdm=False)[0].outputs.probs
        np.testing.assert_allclose(probs, one, atol=1e-6, rtol=1e-5)
        assert abs(sum(probs) - 1) < 1e-5


@pytest.mark.parametrize("mode", [False, True])
def test_embed_prompt_fills_max_model_len(tiny_checkpoint, mode):
    """24 tokens in a 24-token context of exactly 3 blocks: the ignored token takes no slot."""
    path = tiny_checkpoint("head64_gqa")
    llm = LLM(str(path), max_model_len=24, num_gpu_blocks=3, async_scheduling=mode, **ENGINE)
    eng = llm.engine
    full = random_prompts(1, 24, 24, seed=5)[0]
    out = llm.embed([full, full[:10]], use_tqdm=False)
    assert out[0].outputs is not None and out[1].outputs is not None
    assert eng.kv_manager.num_free_blocks == eng.num_blocks == 3
    with pytest.raises(ValueError, match="takes up to 24"):
        eng.add_request("long", full + [5], PoolingParams())
    with pytest.raises(ValueError, match="no room for any output token"):
        eng.add_request("gen", full, SamplingParams(max_tokens=1))
    assert not eng.has_unfinished_requests()
    assert eng.kv_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("mode", [False, True])
def test_classify_prompt_fills_max_model_len(tmp_path, mode):
    path = build_classifier(tmp_path / "cls", "llama", 3)
    llm = LLM(str(path), max_model_len=24, num_gpu_blocks=3, async_scheduling=mode, **ENGINE)
    eng = llm.engine
    full = [(5 * i + 1) % 300 + 4 for i in range(24)]
    got = llm.classify([full], use_tqdm=False)[0]
    assert got.outputs is not None and len(got.outputs.probs) == 3
    ref = LLM(str(path), max_model_len=64, **ENGINE).classify([full], use_tqdm=False)[0]
    np.testing.assert_allclose(got.outputs.probs, ref.outputs.probs, atol=1e-6, rtol=1e-5)
    refused = llm.classify([full + [5]], use_tqdm=False)[0]
    assert refused.outputs is None and "takes up to 24" in refused.error
    assert eng.kv_manager.num_free_blocks == eng.num_blocks == 3
