"""paged_prefill_gluon(producer="gather"): K/V tiles copied by cp.async rows instead of TMA
boxes (kernels/flash_prefill_gluon.py, PAGED_GATHER), and producer="tma1" (the TMA boxes
from a producer of one warp, PRODUCER_WARPS 1) on the same cases, against
flash_prefill.paged_prefill_ref on test_flash_prefill_gluon's NaN-poisoned block pools: block sizes 16-256, cached prefixes
0 to 5000, query counts from 1, GQA 1 / 4 / 8, causal (one program per tile and the static
schedule first, then the dynamic one: a wrong mbarrier count or phase hangs, and the dynamic
schedule is the one that could hang last) and full, every launcher knob with it, the
register split, and the TMA producer's answer. The CPU side (its sm_90 SASS) lives in
test_flash_prefill_gluon's compile test; the bad-knob errors here.

    timeout 300 python -m pytest -q -x -m gpu tests/kernels/test_paged_prefill_gather.py
"""

from __future__ import annotations

import pytest
import torch
from test_flash_prefill_gluon import (  # tests/kernels (on sys.path under pytest)
    HOPPER,
    PAGED_LENGTHS,
    PAGED_OPTIONS,
    STATIC,
    _check_paged,
    _close,
    _paged_case,
    hopper,
)

# the producers other than the default "tma" that run every case here
PRODUCERS = ["gather", "tma1"]
LENGTHS = {**PAGED_LENGTHS, "prefix_5000": ([300, 64, 1], [5000, 4999, 4096])}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("sched", ["grid", "static"])
@pytest.mark.parametrize("producer", PRODUCERS)
def test_gather_static_gpu(producer, lens, block_size, hq, hkv, sched):
    """Causal, one program per work tile and the static persistent schedule."""
    _check_paged(*lens, hq, hkv, block_size, {"producer": producer, **STATIC[sched]})


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
def test_engine_options_gpu(lens, block_size, hq, hkv):
    """What flash_prefill.paged_prefill runs (engine_options: tma1 3 deep under 128-token
    blocks), causal, dynamic schedule, twice: bit for bit the same."""
    from flashpage.kernels import flash_prefill_gluon as fg

    opts = fg.engine_options(block_size)
    first, _ = _check_paged(*lens, hq, hkv, block_size, opts)
    again, _ = _check_paged(*lens, hq, hkv, block_size, opts)
    assert torch.equal(first, again)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("lens", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (16, 2)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("producer", PRODUCERS)
def test_gather_gpu(producer, lens, block_size, hq, hkv):
    """The default schedule (persistent, dynamic), causal, twice: bit for bit the same, the
    counter back at zero."""
    from flashpage.kernels import flash_prefill_gluon as fg

    first, _ = _check_paged(*lens, hq, hkv, block_size, {"producer": producer})
    again, _ = _check_paged(*lens, hq, hkv, block_size, {"producer": producer})
    assert torch.equal(first, again)
    assert fg._SCHED_BUFFERS[first.device, True][:2].tolist() == [0, 0]


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("lens", [LENGTHS["ragged"], LENGTHS["tile_edges"], LENGTHS["prefix_5000"]],
                         ids=["ragged", "tile_edges", "prefix_5000"])
@pytest.mark.parametrize("producer", PRODUCERS)
def test_gather_full_gpu(producer, block_size, lens):
    """Full attention: every work tile reads the last, partial key tile (its rows past the
    context re-read the last key's slot: finite, masked)."""
    _check_paged(*lens, 8, 2, block_size, {"producer": producer}, causal=False)


GATHER_OPTIONS = {**PAGED_OPTIONS,
                  "regs232": dict(consumer_regs=232),  # the producer at 40 (gather: spills)
                  "regs240": dict(consumer_regs=240),  # the producer at 24
                  "stages3_static": dict(num_stages=3, schedule="static")}


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("opts", list(GATHER_OPTIONS.values()), ids=list(GATHER_OPTIONS))
@pytest.mark.parametrize("producer", PRODUCERS)
def test_gather_options_gpu(producer, opts):
    _check_paged([700, 1, 129, 1024], [300, 5000, 0, 77], 8, 2, 16, {"producer": producer, **opts},
                 seed=1)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("producer", PRODUCERS)
def test_gather_memset_then_dynamic_gpu(producer):
    """The schedules alternating (each keeps its own counter), out starting NaN each time."""
    for schedule in ("dynamic_memset", "dynamic", "dynamic_memset", "dynamic"):
        _check_paged([700, 1, 129, 1024], [300, 5000, 0, 77], 8, 2, 16,
                     {"producer": producer, "schedule": schedule}, seed=1)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("producer", PRODUCERS)
def test_gather_agrees_with_tma_gpu(producer, block_size):
    """The same tiles whatever the producer: the TMA producer's output bit for bit (tma1), or
    within bf16 rounding (gather;
    bitwise equal expected: the same wgmmas over the same bytes, except V rows past the
    context, zero there and finite here, both times P = 0; printed), fp16 with a strided q."""
    from flashpage.kernels.flash_prefill_gluon import paged_prefill_gluon

    for dtype, stride in ((torch.bfloat16, None), (torch.float16, 24)):
        args = _paged_case([333, 1024, 77, 1], [100, 0, 2000, 64], 16, 4, block_size,
                           dtype=dtype, seed=2, q_stride_heads=stride)
        tma = paged_prefill_gluon(*args)
        other = paged_prefill_gluon(*args, producer=producer)
        torch.cuda.synchronize()
        print(f"block {block_size} {dtype} {producer}: bitwise equal {torch.equal(tma, other)}")
        if producer == "tma1":  # the same boxes, stages and wgmmas: the same bits
            assert torch.equal(tma, other)
        _close(other, tma, tol=2e-3)


@pytest.mark.gpu
@hopper
def test_gather_cache_past_int32_gpu():
    """A cache of more than 2**31 elements (4 GiB of K, 4 of V): the sequences' blocks at its
    far end, so their offsets need int64 (the launcher's SLOT64); right, as over the small
    pool."""
    from flashpage.kernels.flash_prefill import paged_prefill_ref
    from flashpage.kernels.flash_prefill_gluon import paged_prefill_gluon

    q, kc, vc, tables, cu_q, seq_lens, mq, mk = _paged_case([300, 1, 129], [1000, 77, 0], 8, 2, 16,
                                                            seed=6)
    pool = kc.shape[0]
    far = 2**31 // kc[0].numel() + 1  # blocks before the pool: its first element past 2**31
    big_k = torch.empty(far + pool, *kc.shape[1:], dtype=kc.dtype, device="cuda")
    big_v = torch.empty_like(big_k)
    big_k[far:] = kc
    big_v[far:] = vc
    assert big_k.numel() >= 2**31
    big_tables = tables + far
    out = paged_prefill_gluon(q, big_k, big_v, big_tables, cu_q, seq_lens, mq, mk, producer="gather")
    torch.cuda.synchronize()
    _close(out, paged_prefill_ref(q, kc, vc, tables, cu_q, seq_lens, mq, mk))
    del big_k, big_v


def test_gather_rejects_bad_knobs():
    from flashpage.kernels.flash_prefill_gluon import paged_prefill_gluon

    dev = "cuda" if HOPPER else "cpu"
    bf = torch.bfloat16
    q = torch.zeros(8, 4, 128, dtype=bf, device=dev)
    kc = torch.zeros(6, 16, 2, 128, dtype=bf, device=dev)
    tables = torch.zeros(1, 4, dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=dev)
    lens = torch.tensor([20], dtype=torch.int32, device=dev)
    args = (q, kc, kc, tables, cu, lens, 8, 20)
    # the knobs are checked before the device: the same errors on a CPU
    with pytest.raises(ValueError, match="producer"):
        paged_prefill_gluon(*args, producer="cp.async")
    for producer in PRODUCERS:
        for regs in (236, 200, 248):
            with pytest.raises(ValueError, match="consumer_regs"):
                paged_prefill_gluon(*args, producer=producer, consumer_regs=regs)
