"""Embeddings (flashpage/pooling.py): LLM.embed pools the final-norm hidden states of each
prompt as transformers computes them (last, mean, cls), over chunked prompts, prefix-cache
hits and preemption-free batches beside generation, whose tokens stay unchanged; bad
dimensions named; no blocks left behind."""

from __future__ import annotations

import json

import pytest
import torch

from flashpage import LLM, PoolingParams, SamplingParams
from flashpage.pooling import pooling_type_of
from tests.conftest import random_prompts


def _hf_hidden(path, prompts):
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def _llm(path, **kw):
    return LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=32, block_size=8, **kw)


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_embed_equals_transformers(tiny_checkpoint, kind):
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(4, 3, 30, seed=7) + random_prompts(1, 70, 70, seed=8)  # 70 > 32: chunked
    hidden = _hf_hidden(path, prompts)
    pooled = {"last": [h[-1] for h in hidden], "mean": [h.mean(0) for h in hidden],
              "cls": [h[0] for h in hidden]}[kind]
    llm = _llm(path, pooling_type=kind)
    outs = llm.embed(prompts, use_tqdm=False)
    for o, want, p in zip(outs, pooled, prompts, strict=True):
        got = torch.tensor(o.outputs.embedding)
        assert o.prompt_token_ids == p and got.shape == (llm.engine.model_config.hidden_size,)
        torch.testing.assert_close(got, torch.nn.functional.normalize(want, dim=0), atol=2e-5, rtol=1e-4)
    # the same prompts again: "last" may take prefix-cache hits, mean and cls may not; equal
    again = llm.embed(prompts, use_tqdm=False)
    for a, b in zip(again, outs, strict=True):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding),
                                   atol=2e-5, rtol=1e-4)
    if kind == "last":
        assert llm.engine.kv_manager.stats().prefix_hits > 0
    raw = llm.embed(prompts[:1], PoolingParams(dimensions=5, normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), pooled[0][:5], atol=2e-5, rtol=1e-4)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


def test_embeddings_beside_generation(tiny_checkpoint):
    """Embedding and generation requests in the same steps: the tokens are the plain run's,
    the vectors LLM.embed's; a bad request fails alone."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(6, 5, 40, seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = _llm(path)
    ref_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    ref_vecs = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"g{i}", p, greedy)
        eng.add_request(f"e{i}", p, PoolingParams())
    with pytest.raises(ValueError, match="dimensions must be at most the model's"):
        eng.add_request("bad", prompts[0], PoolingParams(dimensions=10_000))
    got: dict[str, object] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o
    for i in range(len(prompts)):
        assert got[f"g{i}"].outputs[0].token_ids == ref_tokens[i]
        e = got[f"e{i}"]
        assert e.outputs == [] and e.embedding is not None
        torch.testing.assert_close(torch.tensor(e.embedding), torch.tensor(ref_vecs[i]), atol=2e-5, rtol=1e-4)
    assert eng.kv_manager.num_free_blocks == eng.num_blocks
    refused = llm.embed([prompts[0], [10_000]], use_tqdm=False)
    assert refused[0].outputs is not None and refused[1].outputs is None and "vocabulary" in refused[1].error


def test_pooling_type_from_sentence_transformers_files(tmp_path):
    assert pooling_type_of(str(tmp_path)) == "last" and pooling_type_of(None) == "last"
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    for key, kind in (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                      ("pooling_mode_lasttoken", "last")):
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({key: True}))
        assert pooling_type_of(str(tmp_path)) == kind
    with pytest.raises(ValueError, match="pooling_type must be last, mean or cls"):
        LLM(str(tmp_path), pooling_type="max")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["last", "mean"])
def test_embed_on_the_gpu_with_graphs(tiny_checkpoint, kind):
    """fp32 on the GPU with every graph kind captured: the steps that pool skip the graphs
    that return only sampled logits, the piecewise ones hand back the hidden states; the
    vectors are transformers', beside generation."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(6, 3, 30, seed=17) + random_prompts(1, 70, 70, seed=18)
    hidden = _hf_hidden(path, prompts)
    llm = LLM(str(path), dtype="float32", device="cuda", attention_backend="triton", block_size=16,
              max_num_batched_tokens=64, pooling_type=kind)
    assert llm.engine.runner.graphs is not None
    outs = llm.embed(prompts, use_tqdm=False)
    for o, h in zip(outs, hidden, strict=True):
        want = h[-1] if kind == "last" else h.mean(0)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), torch.nn.functional.normalize(want, dim=0),
                                   atol=1e-4, rtol=1e-3)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
