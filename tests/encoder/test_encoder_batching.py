"""The encoder's batches (flashpage/encoder/batch.py, engine.py): which prompts go together,
their padded inputs built in numpy and on the device, pooling for the whole batch. One
batch of mixed lengths and PoolingParams, and one of equal lengths (no mask: the flash
path), equal transformers prompt by prompt; async scheduling reads each batch back one
step later with the same vectors and drops an aborted one; the outputs are lists where
vLLM's are (EmbeddingOutput.embedding), float32 arrays beneath."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flashpage import LLM, PoolingParams
from flashpage.encoder.batch import pack, pick, to_device, window
from flashpage.pooling import EmbeddingOutput
from tests.encoder_checkpoints import hf_model

TEXTS = ["the quick brown fox", "hello world", "paged cache keys values of every token in fixed size "
         "blocks", "a", "paris is the capital city of france"]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 4096, **kw})


def _spy_masks(llm, monkeypatch) -> list[torch.Tensor | None]:
    masks: list[torch.Tensor | None] = []
    model = llm.engine.model
    real = model.forward

    def spy(ids, types, positions, valid):
        masks.append(valid)
        return real(ids, types, positions, valid)

    monkeypatch.setattr(model, "forward", spy)
    return masks


def test_pick_takes_the_head_and_the_lengths_nearest_it():
    assert pick([5, 5, 5, 5], budget=12, seats=8) == [0, 1]  # equal lengths: queue order
    # head 4: then 4 (index 4), 5, 3 ... while 3 x 5 <= 16; the 30 waits for a batch of its own
    assert pick([4, 30, 5, 3, 4], budget=16, seats=8) == [0, 2, 4]
    assert pick([4, 4, 4], budget=100, seats=2) == [0, 1]
    assert pick([40, 2, 2], budget=16, seats=8) == [0]  # over the budget: alone
    assert pick([30, 2, 29, 31], budget=64, seats=8) == [0, 2]  # 3 x 31 > 64
    assert len(window([10] * 100, budget=20, seats=100)) == 8  # LOOKAHEAD (4) budgets of tokens
    assert len(window([1] * 100, budget=1000, seats=2)) == 8  # ... or of seats
    assert window([500, 1], budget=10, seats=1) == [500]  # at least the head


def test_pack_pads_and_types_and_device_side_masks():
    rows = [np.array([2, 5, 3, 6, 3]), np.array([2, 7, 3])]  # a BERT pair; a single text
    host = pack(rows, pad_id=0, sep_id=3, pairs=[True, False], pin=False)
    assert host.width == 5 and host.padded and host.has_types
    assert host.packed.tolist() == [[2, 5, 3, 6, 3, 0, 0, 0, 1, 1, 5],
                                    [2, 7, 3, 0, 0, 0, 0, 0, 0, 0, 3]]
    x = to_device(host, torch.device("cpu"), pad_id=0, roberta=False)
    assert x.ids.tolist() == [[2, 5, 3, 6, 3], [2, 7, 3, 0, 0]]
    assert x.types.tolist() == [[0, 0, 0, 1, 1], [0] * 5]
    assert x.positions.tolist() == [list(range(5))] * 2
    assert x.valid is not None and x.valid.tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    # RoBERTa (pad 1): positions count non-pad tokens from padding_idx + 1, pads stay 1
    x = to_device(pack([np.array([0, 5, 6, 2]), np.array([0, 7, 2])], 1, None, [False, False], False),
                  torch.device("cpu"), pad_id=1, roberta=True)
    assert x.positions.tolist() == [[2, 3, 4, 5], [2, 3, 4, 1]] and not x.types.any()
    same = pack([np.array([2, 5, 3]), np.array([2, 6, 3])], 0, 3, [False, False], pin=False)
    assert not same.padded and not same.has_types and same.packed.shape == (2, 4)
    assert to_device(same, torch.device("cpu"), 0, roberta=False).valid is None


@pytest.mark.parametrize("name", ["bert", "xlmr"])
def test_one_batch_of_mixed_lengths_and_params_equals_transformers(encoder_checkpoint, monkeypatch, name):
    path = encoder_checkpoint(name)
    llm = _llm(path)
    tok = llm.get_tokenizer()
    model = hf_model(path)
    with torch.no_grad():
        means = [model(**tok(t, return_tensors="pt")).last_hidden_state[0].mean(0) for t in TEXTS]
    params = [PoolingParams(), PoolingParams(dimensions=5), PoolingParams(normalize=False),
              PoolingParams(dimensions=7, normalize=False), PoolingParams()]
    masks = _spy_masks(llm, monkeypatch)
    eng = llm.engine
    for i, (t, p) in enumerate(zip(TEXTS, params, strict=True)):
        eng.add_request(f"r{i}", t, p)
    outs = {}
    while eng.has_unfinished_requests():
        outs.update((o.request_id, o) for o in eng.step())
    assert len(masks) == 1 and masks[0] is not None  # one forward, padded
    for i, (mean, p) in enumerate(zip(means, params, strict=True)):
        want = mean[: p.dimensions] if p.dimensions else mean
        want = torch.nn.functional.normalize(want, dim=0) if p.normalize else want
        got = outs[f"r{i}"].embedding
        assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == want.shape
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1e-5)


def test_equal_lengths_run_without_a_mask(encoder_checkpoint, monkeypatch):
    path = encoder_checkpoint("bert")
    llm = _llm(path)
    prompts = [[2, 5 + i, 9 + 2 * i, 30 - i, 3] for i in range(6)]
    model = hf_model(path)
    with torch.no_grad():
        want = model(input_ids=torch.tensor(prompts)).last_hidden_state.mean(1)
    masks = _spy_masks(llm, monkeypatch)
    outs = llm.embed(prompts, use_tqdm=False)
    assert masks == [None]  # no padding: SDPA without a mask (CUDA: the flash kernel)
    got = torch.from_numpy(np.stack([o.outputs.data for o in outs]))
    torch.testing.assert_close(got, torch.nn.functional.normalize(want, dim=1), atol=1e-5, rtol=1e-5)


def test_async_scheduling_reads_back_one_step_later(encoder_checkpoint):
    path = encoder_checkpoint("bert")
    want = [o.outputs.data for o in _llm(path, max_num_batched_tokens=24).embed(TEXTS, use_tqdm=False)]
    llm = _llm(path, max_num_batched_tokens=24, async_scheduling=True)
    got = [o.outputs.data for o in llm.embed(TEXTS, use_tqdm=False)]
    assert llm.engine.num_forwards > 1
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    eng = _llm(path, max_num_seqs=1, async_scheduling=True).engine
    for rid in "abc":
        eng.add_request(rid, TEXTS[0], PoolingParams())
    assert eng.step() == [] and eng.get_num_unfinished_requests() == 3  # "a" runs
    assert eng.stats()["num_running"] == 1 and eng.stats()["num_waiting"] == 2
    eng.abort_request("a")  # in flight: read back, then dropped
    assert eng.get_num_unfinished_requests() == 2 and eng.has_unfinished_requests()
    eng.add_request("a", TEXTS[1], PoolingParams())  # its id is free again
    assert eng.step() == []  # "b" launched, "a" (aborted) read back
    assert [o.request_id for o in eng.step()] == ["b"]
    assert [o.request_id for o in eng.step()] == ["c"]
    last = eng.step()
    assert [o.request_id for o in last] == ["a"] and not eng.has_unfinished_requests()
    # the new "a": TEXTS[1]'s vector (ran alone here, batched above: on a GPU another batch
    # shape may round differently, H200 run 172: 1e-7 apart)
    np.testing.assert_allclose(last[0].embedding, want[1], rtol=1e-5, atol=1e-6)
    assert eng.step() == []


def test_embedding_outputs_are_lists_over_float32_arrays(encoder_checkpoint):
    llm = _llm(encoder_checkpoint("bert"))
    out = llm.embed(TEXTS[:2], use_tqdm=False)[0].outputs
    assert isinstance(out.data, np.ndarray) and out.data.dtype == np.float32
    vec = out.embedding
    assert type(vec) is list and len(vec) == out.hidden_size == 64 and out.embedding is vec
    assert all(type(x) is float for x in vec) and vec[3] == float(out.data[3]) and vec[-2:] == list(vec)[-2:]
    assert json.loads(json.dumps(vec)) == vec and sum(x * x for x in vec) == pytest.approx(1.0, abs=1e-5)
    assert repr(out) == "EmbeddingOutput(hidden_size=64)"
    mine = EmbeddingOutput([0.5, 0.25])  # built from a list: that list, and its array
    assert mine.embedding == [0.5, 0.25] and mine.data.tolist() == [0.5, 0.25] and mine.hidden_size == 2
    assert mine == EmbeddingOutput(np.array([0.5, 0.25], dtype=np.float32)) and mine != out
    mine.embedding = [1.0]
    assert mine.data.tolist() == [1.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's SDPA kernels")
def test_masks_keep_the_fused_sdpa_kernels(encoder_checkpoint):
    """With only one SDPA kernel allowed, torch raises rather than falling back to the math
    one: equal lengths run on flash (no mask), mixed lengths on the memory-efficient kernel
    with the [B, 1, 1, T] bool key mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    llm = LLM(str(encoder_checkpoint("bert")), dtype="bfloat16", device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        outs = llm.embed([[2, 5 + i, 9, 3] for i in range(4)], use_tqdm=False)
    assert all(o.error is None for o in outs)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        outs = llm.embed(TEXTS, use_tqdm=False)
    assert all(o.error is None for o in outs)
