"""FLASHPAGE_PREFILL_GLUON: the triton backend's prefill through the Gluon paged kernel
(kernels/flash_prefill_gluon.paged_prefill_gluon), switched by envs.prefill_gluon() in
flash_prefill.paged_prefill and gated by gluon_prefill_unsupported.

CPU (Triton's interpreter): one mixed engine step (a decode, a prompt chunk over a cached
prefix, a fresh prompt) through TritonBackend.forward, as the model runner calls it:
- switch on: the reasons for the step's prefill call are only "not an sm_90 GPU" (so on an
  H200 the engine's bf16/fp16, head_dim 128, block-16 calls take the Gluon kernel), and the
  Triton kernel answers right;
- switch on, device check passed (the reasons stubbed empty, the kernel stubbed by the
  reference): the Gluon entry gets the step's prefill part as the backend slices it (its
  queries, block_tables[nd:], seq_lens[nd:], offsets from 0, the output rows to fill);
- switch off (the default): the reasons are never asked.
The kernel itself runs in tests/kernels/test_flash_prefill_gluon.py (sm_90).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import step_metadata

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU check under TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")

BLOCK, HQ, HKV, D = 16, 4, 2, 128
DTYPE = torch.float16


def _step(seed=0):
    """One mixed step: a decode (context 20), a 9-token chunk after a 23-token cached
    prefix, a fresh 5-token prompt; K/V of the cached prefixes already in a NaN-poisoned
    cache, this step's written by the backend. -> (q, k, v, cache, metadata)."""
    g = torch.Generator().manual_seed(seed)
    q_lens, seq_lens = [1, 9, 5], [20, 32, 5]
    tables = [[7, 2], [4, 9], [5]]
    cache = (torch.full((12, BLOCK, HKV, D), float("nan"), dtype=DTYPE),
             torch.full((12, BLOCK, HKV, D), float("nan"), dtype=DTYPE))
    for t, n, lq in zip(tables, seq_lens, q_lens, strict=True):
        for p in range(n - lq):  # the cached prefix
            for c in cache:
                c[t[p // BLOCK], p % BLOCK] = torch.randn(HKV, D, generator=g).to(DTYPE)
    md, _ = step_metadata(q_lens, seq_lens, tables, BLOCK, num_decodes=1)
    n = sum(q_lens)
    q, k, v = (torch.randn(n, h, D, generator=g).to(DTYPE) for h in (HQ, HKV, HKV))
    return q, k, v, cache, md


def _forward(q, k, v, cache, md):
    from flashpage.attention.triton import TritonBackend

    backend = TritonBackend(SimpleNamespace(is_mla=False), torch.device("cpu"), DTYPE)
    md = backend.prepare(md)
    return backend.forward(q, k, v, cache, md, scale=D ** -0.5)


def _reference(q, cache, md):
    """The step's prefill rows (decode row excluded) by paged_prefill_ref."""
    from flashpage.kernels.flash_prefill import paged_prefill_ref

    nd = md.num_decodes
    qsl = md.query_start_loc[nd:] - md.num_decode_tokens
    return paged_prefill_ref(q[md.num_decode_tokens:], *cache, md.block_tables[nd:], qsl,
                             md.seq_lens[nd:], max(md.query_lens_cpu[nd:]),
                             max(md.seq_lens_cpu[nd:]), causal=True, sm_scale=D ** -0.5)


def _spy_reasons(monkeypatch, result=None):
    """Record every gluon_prefill_unsupported answer (result: answer that instead)."""
    from flashpage.kernels import flash_prefill

    asked = []
    real = flash_prefill.gluon_prefill_unsupported

    def spy(*a, **kw):
        reasons = real(*a, **kw)
        asked.append(reasons)
        return reasons if result is None else result

    monkeypatch.setattr(flash_prefill, "gluon_prefill_unsupported", spy)
    return asked


def _close(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=2e-3)


def test_switch_on_cpu_names_only_the_device(monkeypatch):
    monkeypatch.setenv("FLASHPAGE_PREFILL_GLUON", "1")
    asked = _spy_reasons(monkeypatch)
    q, k, v, cache, md = _step()
    out = _forward(q, k, v, cache, md)
    assert asked == [["needs a Hopper (sm_90) GPU, not the interpreter"]]
    _close(out[md.num_decode_tokens:], _reference(q, cache, md))


def test_switch_on_sends_the_prefill_part_to_gluon(monkeypatch):
    """The reasons stubbed empty (as on an H200): the Gluon entry (its plan) is called once, with the
    step's prefill part, and what it writes into ``out`` is the backend's output."""
    from flashpage.kernels import flash_prefill_gluon
    from flashpage.kernels.flash_prefill import paged_prefill_ref

    monkeypatch.setenv("FLASHPAGE_PREFILL_GLUON", "1")
    asked = _spy_reasons(monkeypatch, result=[])
    calls = []

    def fake(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
             max_seqlen_k, *, causal, sm_scale, return_lse, out, producer, num_stages, descriptors):
        calls.append(dict(q=q, block_tables=block_tables, cu=cu_seqlens_q, seq_lens=seq_lens,
                          max_q=max_seqlen_q, max_k=max_seqlen_k, causal=causal,
                          sm_scale=sm_scale, return_lse=return_lse, out=out, producer=producer,
                          num_stages=num_stages))

        def launch(q, key_cache, value_cache, out):
            out.copy_(paged_prefill_ref(q, key_cache, value_cache, block_tables, cu_seqlens_q,
                                        seq_lens, max_seqlen_q, max_seqlen_k, causal=causal,
                                        sm_scale=sm_scale))

        return launch

    monkeypatch.setattr(flash_prefill_gluon, "plan_paged", fake)
    q, k, v, cache, md = _step(seed=1)
    out = _forward(q, k, v, cache, md)
    assert len(asked) == 1 and len(calls) == 1
    c = calls[0]
    assert c["q"].shape == (14, HQ, D) and torch.equal(c["q"], q[1:])
    assert c["block_tables"].tolist() == [[4, 9], [5, 0]]
    assert c["seq_lens"].tolist() == [32, 5] and c["cu"].tolist() == [0, 9, 14]
    assert (c["max_q"], c["max_k"], c["causal"], c["return_lse"]) == (9, 32, True, False)
    assert c["sm_scale"] == D ** -0.5
    # flash_prefill_gluon.engine_options: the one-warp TMA producer, 3 deep, under 128-token blocks
    assert (c["producer"], c["num_stages"]) == (("tma1", 3) if BLOCK < 128 else ("tma", 2))
    assert c["out"].data_ptr() == out[1:].data_ptr()  # written in place
    _close(out[1:], _reference(q, cache, md))


def test_switch_on_by_default_and_off_with_0(monkeypatch):
    """Unset: the Gluon kernel is asked (here, on the CPU, it says why it cannot run and the
    Triton kernel does); FLASHPAGE_PREFILL_GLUON=0: never asked."""
    q, k, v, cache, md = _step(seed=2)
    monkeypatch.delenv("FLASHPAGE_PREFILL_GLUON", raising=False)
    asked = _spy_reasons(monkeypatch)
    out = _forward(q, k, v, cache, md)
    assert asked and all(asked)
    _close(out[1:], _reference(q, cache, md))
    monkeypatch.setenv("FLASHPAGE_PREFILL_GLUON", "0")
    asked.clear()
    out = _forward(q, k, v, cache, md)
    assert asked == []
    _close(out[1:], _reference(q, cache, md))


def test_engine_options_and_the_producer_override(monkeypatch):
    """engine_options: the one-warp TMA producer with a 3-deep ring under 128-token blocks, the
    4-warp TMA boxes 2 deep from 128; FLASHPAGE_PREFILL_PRODUCER forces one (its ring follows
    it), and an unknown one is an error naming the variable."""
    from flashpage import envs
    from flashpage.kernels.flash_prefill_gluon import engine_options

    assert engine_options(16) == engine_options(64) == {"producer": "tma1", "num_stages": 3}
    assert engine_options(128) == engine_options(256) == {"producer": "tma", "num_stages": 2}
    assert engine_options(16, "gather") == {"producer": "gather", "num_stages": 2}
    assert engine_options(256, "tma1") == {"producer": "tma1", "num_stages": 3}
    with pytest.raises(ValueError, match="FLASHPAGE_PREFILL_PRODUCER.*'tma2'"):
        engine_options(16, "tma2")
    monkeypatch.setenv("FLASHPAGE_PREFILL_PRODUCER", " gather ")
    assert envs.prefill_producer() == "gather"
    monkeypatch.delenv("FLASHPAGE_PREFILL_PRODUCER")
    assert envs.prefill_producer() == ""
