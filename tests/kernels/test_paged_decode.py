"""paged_decode against its pure-torch reference.

CPU (Triton interpreter): fp32 and fp16, small shapes. GPU: bf16, a larger grid, a pool
past 2^31 elements, CUDA-graph capture. Unused cache slots and padded block-table
entries hold NaN, so any read past a sequence's context shows up in the output.
"""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels.paged_decode import (
    CANDIDATE_CONFIGS,
    DecodeConfig,
    _launch,
    choose_num_splits,
    config_name,
    paged_decode,
    paged_decode_ref,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")

# ||out - ref|| / ||ref||: the kernel rounds the probabilities to the input dtype before P @ V.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def make_case(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, *,
              device=DEVICE, extra_blocks=3, seed=0):
    """A paged cache holding random K/V for each sequence at random blocks; everything else NaN."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    nblocks = [-(-int(n) // block_size) for n in seq_lens]
    num_blocks = sum(nblocks) + extra_blocks
    max_blocks = max(nblocks) + 1  # one padded column: never read
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((len(seq_lens), max_blocks), num_blocks - 1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for b, n in enumerate(seq_lens):
        ids = perm[used : used + nblocks[b]]
        used += nblocks[b]
        block_tables[b, : nblocks[b]] = ids
        for p in range(0, n, block_size):
            rows = min(block_size, n - p)
            blk = int(ids[p // block_size])
            key_cache[blk, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=g).to(dtype)
            value_cache[blk, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=g).to(dtype)
    # The padded column points at a never-used block, full of NaN.
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=g).to(dtype)
    to = dict(device=device)
    return (q.to(**to), key_cache.to(**to), value_cache.to(**to), block_tables.to(**to), lens.to(**to))


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "NaN in the output: unwritten rows or keys read past the context"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < REL_TOL[dtype], f"relative error {err:.2e} >= {REL_TOL[dtype]:.0e}"


def run_and_check(seq_lens, hq, hkv, d, bs, dtype, *, num_splits=None, window_size=None, seed=0,
                  device=DEVICE, config=None, softcap=None):
    q, kc, vc, bt, lens = make_case(seq_lens, hq, hkv, d, bs, dtype, seed=seed, device=device)
    if softcap is not None:
        q = q * 4  # scores of a few units, well into the cap's bend
    out = torch.full_like(q, float("nan"))  # every element must be written
    _launch(q, kc, vc, bt, lens, sm_scale=None, out=out, num_splits=num_splits, window_size=window_size,
            config=config, softcap=softcap)
    ref = paged_decode_ref(q, kc, vc, bt, lens, window_size=window_size, softcap=softcap)
    check(out, ref, dtype)
    if softcap is not None:  # the cap changes the result: the check above could fail
        uncapped = paged_decode_ref(q, kc, vc, bt, lens, window_size=window_size)
        assert ((uncapped.float() - ref.float()).norm() / ref.float().norm()).item() > 0.05


# (seq_lens, q heads, kv heads, head_dim, block_size, num_splits, window)
CPU_CASES = [
    ([1, 17, 40], 4, 4, 64, 16, None, None),  # MHA; context of 1; not multiples of 16
    ([33, 64, 5], 8, 2, 64, 16, 1, None),  # GQA 4, one split
    ([100, 1], 8, 1, 64, 32, 3, None),  # all query heads on one KV head, 3 splits
    ([70, 129], 16, 2, 64, 16, 8, None),  # GQA 8, more splits than key tiles (empty splits)
    ([300], 4, 1, 128, 256, 2, None),  # block 256: one page spans several key tiles
    ([45, 90], 4, 2, 256, 64, None, None),  # head_dim 256
    ([97, 3, 64], 8, 2, 64, 16, 2, 20),  # sliding window, across block boundaries
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefetch_v_matches_reference(dtype):
    """V one tile ahead in registers (DecodeConfig.prefetch_v), K pipelined: ragged contexts
    (1, one tile, several), splits and a window."""
    for splits, window in ((1, None), (3, None), (2, 30)):
        q, kc, vc, bt, lens = make_case([1, 32, 100], 8, 2, 64, 16, dtype, seed=7)
        out = torch.full_like(q, float("nan"))
        _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=window, out=out, num_splits=splits,
                config=DecodeConfig(32, 4, 3, prefetch_v=True))
        check(out, paged_decode_ref(q, kc, vc, bt, lens, window_size=window), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}-bs{c[4]}-s{c[5]}-w{c[6]}")
def test_paged_decode_matches_reference(case, dtype):
    seq_lens, hq, hkv, d, bs, splits, window = case
    run_and_check(seq_lens, hq, hkv, d, bs, dtype, num_splits=splits, window_size=window)


# (seq_lens, q heads, kv heads, head_dim, block_size, num_splits, window, config): Gemma 2's
# attention logit softcap on the main loop, with splits, a window, V prefetched, and asked of
# the warp-split loop and the row kernel (which step aside for it)
SOFTCAP_CASES = [
    ([1, 17, 40], 4, 4, 64, 16, None, None, None),
    ([97, 3, 64], 8, 2, 64, 16, 3, 20, None),
    ([1, 32, 100], 8, 2, 64, 16, 2, None, DecodeConfig(32, 4, 3, prefetch_v=True)),
    ([33, 70], 8, 2, 64, 16, 1, None, DecodeConfig(64, 4, 3, warp_split=True)),
    ([33, 70], 8, 4, 64, 16, 2, None, DecodeConfig(32, 4, 3, heads_per_program=2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: f"{c[0]}-s{c[5]}-w{c[6]}-{c[7]}")
def test_softcap_matches_reference(case, dtype):
    seq_lens, hq, hkv, d, bs, splits, window, config = case
    run_and_check(seq_lens, hq, hkv, d, bs, dtype, num_splits=splits, window_size=window,
                  config=config, softcap=2.5)


def test_splits_agree_with_one_split():
    q, kc, vc, bt, lens = make_case([150, 61], 8, 2, 64, 16, torch.float32, seed=3)
    one = paged_decode(q, kc, vc, bt, lens, num_splits=1)
    for splits in (2, 5):
        torch.testing.assert_close(paged_decode(q, kc, vc, bt, lens, num_splits=splits), one,
                                   atol=1e-6, rtol=1e-5)


def test_head_major_cache_view():
    """A cache laid out [blocks, Hkv, BS, D] in memory (each head's page contiguous), passed
    as its permuted [blocks, BS, Hkv, D] view: the kernel follows the strides, and the
    result equals the one over the same values in the usual order, bit for bit."""
    q, kc, vc, bt, lens = make_case([70, 9, 33], 8, 2, 64, 16, torch.float32, seed=5)
    hnd_k = kc.transpose(1, 2).contiguous().transpose(1, 2)
    hnd_v = vc.transpose(1, 2).contiguous().transpose(1, 2)
    assert hnd_k.stride(2) == 16 * 64 and torch.equal(hnd_k.nan_to_num(), kc.nan_to_num())
    for splits in (1, 3):
        out = paged_decode(q, hnd_k, hnd_v, bt, lens, num_splits=splits)
        assert torch.equal(out, paged_decode(q, kc, vc, bt, lens, num_splits=splits))


# (seq_lens, q heads, kv heads, head_dim, block_size, keys per tile, warps, num_splits)
WARP_SPLIT_CASES = [
    ([1, 17, 64, 200], 8, 2, 64, 16, 64, 4, None),  # ragged: one key, a partial tile, full tiles
    ([100, 33], 8, 2, 64, 16, 64, 4, 3),  # splits
    ([300, 5], 4, 1, 64, 64, 32, 2, 2),  # a page holds two tiles
    ([70, 129], 16, 2, 64, 32, 64, 4, 8),  # empty splits
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", WARP_SPLIT_CASES, ids=lambda c: f"{c[0]}-bs{c[4]}-n{c[5]}w{c[6]}-s{c[7]}")
def test_warp_split_matches_reference(case, dtype):
    """Each warp its own 16-key piece of a tile with its own softmax state
    (DecodeConfig.warp_split), merged at the end; the partial last tile 16 keys at a time.
    Every slot past a context holds NaN, so a read past it would show."""
    seq_lens, hq, hkv, d, bs, bn, warps, splits = case
    q, kc, vc, bt, lens = make_case(seq_lens, hq, hkv, d, bs, dtype, seed=13)
    out = torch.full_like(q, float("nan"))
    _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=out, num_splits=splits,
            config=DecodeConfig(bn, warps, 3, warp_split=True))
    check(out, paged_decode_ref(q, kc, vc, bt, lens), dtype)


@pytest.mark.parametrize("splits", [1, 2])
def test_warp_split_heads_fastest(splits):
    """The warp-split loop under the (Hkv, batch, splits) grid order (the fp8 default from
    64 programs), with and without the in-kernel merge."""
    q, kc, vc, bt, lens = make_case([1, 100, 250, 37], 8, 2, 64, 16, torch.float32, seed=19)
    out = torch.full_like(q, float("nan"))
    _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=out, num_splits=splits,
            config=DecodeConfig(64, 4, 3, warp_split=True, heads_fastest=True, fused_merge=splits > 1))
    check(out, paged_decode_ref(q, kc, vc, bt, lens), torch.float32)


def test_warp_split_with_fused_merge():
    """The warp-split loop's merged state feeds the in-kernel split merge as the plain loop's does."""
    q, kc, vc, bt, lens = make_case([1, 100, 250], 8, 2, 64, 16, torch.float32, seed=17)
    ref = paged_decode_ref(q, kc, vc, bt, lens)
    for _ in range(2):  # the counters are left at 0 for the next call
        out = torch.full_like(q, float("nan"))
        _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=out, num_splits=3,
                config=DecodeConfig(64, 4, 3, warp_split=True, fused_merge=True))
        check(out, ref, torch.float32)


def test_custom_scale():
    q, kc, vc, bt, lens = make_case([40, 9], 4, 2, 64, 16, torch.float32, seed=4)
    out = paged_decode(q, kc, vc, bt, lens, sm_scale=0.3, num_splits=2)
    check(out, paged_decode_ref(q, kc, vc, bt, lens, sm_scale=0.3), torch.float32)


def test_choose_num_splits():
    # One wave of programs_per_sm * SMs programs, no more.
    assert choose_num_splits(128, 8, 2048, 132) == 1  # the batch fills the GPU
    assert choose_num_splits(32, 8, 4096, 132) == 2  # 4 per SM: 512 of 528 slots
    assert choose_num_splits(32, 8, 4096, 132, programs_per_sm=2) == 1
    assert choose_num_splits(4, 8, 65536, 132, programs_per_sm=2) == 8  # 256 of 264
    assert choose_num_splits(1, 8, 65536, 132, programs_per_sm=2) == 33
    assert choose_num_splits(1, 8, 4096, 132) == 64  # 64 keys each
    assert choose_num_splits(1, 1, 1 << 20, 132) == 128  # at most 128 splits
    assert choose_num_splits(1, 8, 100, 132) == 1  # short contexts are not split


def test_default_config_by_generation(monkeypatch):
    """Hopper with head_dim 128: 3 stages (two K/V tiles in flight; then splits up to 2
    programs per SM) for grids of <= 2 programs per SM, 2 stages with heads adjacent
    above; an fp8 cache 64-key tiles, 3 stages, 4 programs per SM; elsewhere one config."""
    from flashpage.kernels import paged_decode as mod

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(mod._SM_COUNT, 0, 132)
    monkeypatch.setattr(mod, "cuda_capability", lambda device: (9, 0))
    small, large = mod.default_config(cuda, 128, 264), mod.default_config(cuda, 128, 265)
    assert (small.num_stages, small.programs_per_sm, small.heads_fastest) == (3, 2, False)
    assert small.num_warps == 8 and mod.default_config(cuda, 128, 132).num_warps == 4  # split below
    assert (large.num_stages, large.programs_per_sm, large.heads_fastest) == (2, 4, True)
    small8, large8 = mod.default_config(cuda, 128, 264, fp8=True), mod.default_config(cuda, 128, 265, fp8=True)
    assert small8 == large8 == mod.default_config(cuda, 128, 64, fp8=True)
    assert (small8.block_n, small8.num_stages, small8.programs_per_sm, small8.warp_split) == (64, 3, 3, True)
    assert small8.heads_fastest  # a sequence's heads together: longest decodes first over the GPU
    assert small8.gluon  # the Gluon kernel where it covers the call
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON", "0")
    assert not mod.default_config(cuda, 128, 264, fp8=True).gluon
    monkeypatch.delenv("FLASHPAGE_DECODE_GLUON")
    few8 = mod.default_config(cuda, 128, 63, fp8=True)  # under 64 programs: the shared-state loop
    assert (few8.block_n, few8.num_stages, few8.programs_per_sm, few8.warp_split) == (64, 3, 4, False)
    assert not few8.gluon  # fp8: at >= 64 programs only
    assert small.gluon and large.gluon  # 16-bit unsplit grids: the Gluon bf16 kernel where it covers the call
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON_BF16", "0")
    assert not mod.default_config(cuda, 128, 264).gluon and not mod.default_config(cuda, 128, 265).gluon
    monkeypatch.delenv("FLASHPAGE_DECODE_GLUON_BF16")
    monkeypatch.setenv("FLASHPAGE_DECODE_WARP_SPLIT", "0")
    assert mod.default_config(cuda, 128, 264, fp8=True) == few8
    monkeypatch.delenv("FLASHPAGE_DECODE_WARP_SPLIT")
    assert not small.fused_merge and not large.fused_merge
    monkeypatch.delenv("FLASHPAGE_FUSED_MERGE", raising=False)
    assert not mod.default_config(cuda, 128, 8).fused_merge  # split: the merge kernel
    monkeypatch.setenv("FLASHPAGE_FUSED_MERGE", "1")
    assert mod.default_config(cuda, 128, 8).fused_merge
    assert mod.default_config(cuda, 128, 8, fp8=True).fused_merge
    monkeypatch.delenv("FLASHPAGE_FUSED_MERGE")
    assert mod.default_config(cuda, 128) == large
    assert mod.default_config(cuda, 64, 8) == DecodeConfig(64, 4, 3)  # not measured: generic
    monkeypatch.setattr(mod, "cuda_capability", lambda device: (8, 0))
    assert mod.default_config(cuda, 128, 8) == DecodeConfig(64, 4, 3)
    assert mod.default_config(cuda, 256, 8) == DecodeConfig(32, 4, 3)
    assert mod.default_config(torch.device("cpu"), 128, 8) == DecodeConfig(64, 4, 3)


def test_gluon_unsupported_names_each_reason():
    """What the Gluon kernel covers (fp8 cache on sm_90, block 16, head_dim 128, <= 16 query
    heads per KV head, unsplit, no window): each condition broken alone gives its reason."""
    from flashpage.kernels.paged_decode import gluon_unsupported

    fp8 = torch.float8_e4m3fn
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    kc = torch.zeros(8, 16, 8, 128).to(fp8)
    assert gluon_unsupported(q, kc, kc, None, 1, capability=(9, 0)) == []
    assert gluon_unsupported(q.half(), kc, kc, None, 1, capability=(9, 0)) == []

    def only(reasons, word):
        assert len(reasons) == 1 and word in reasons[0], reasons

    only(gluon_unsupported(q, kc, kc, None, 1, capability=(8, 0)), "sm_90")
    only(gluon_unsupported(q, kc, kc, None, 1), "sm_90")  # a CPU tensor
    only(gluon_unsupported(q, kc.bfloat16(), kc.bfloat16(), None, 1, capability=(9, 0)), "float8")
    only(gluon_unsupported(q.float(), kc, kc, None, 1, capability=(9, 0)), "query")
    kc32 = torch.zeros(8, 32, 8, 128).to(fp8)
    only(gluon_unsupported(q, kc32, kc32, None, 1, capability=(9, 0)), "block_size 16")
    kc64 = torch.zeros(8, 16, 8, 64).to(fp8)
    only(gluon_unsupported(q[..., :64], kc64, kc64, None, 1, capability=(9, 0)), "head_dim 128")
    wide = torch.zeros(8, 16, 8, 256).to(fp8)[..., :128]
    only(gluon_unsupported(q, wide, wide, None, 1, capability=(9, 0)), "contiguous")
    kc1 = torch.zeros(8, 16, 1, 128).to(fp8)
    only(gluon_unsupported(q, kc1, kc1, None, 1, capability=(9, 0)), "16 query heads")
    only(gluon_unsupported(q, kc, kc, 4096, 1, capability=(9, 0)), "window")
    only(gluon_unsupported(q, kc, kc, None, 2, capability=(9, 0)), "split")


# The loop shapes the GPU benchmark sweeps: Triton's pipeliner or the hand prefetch, and
# either grid order (heads of one sequence adjacent or sequences adjacent).
@pytest.mark.parametrize("config", [DecodeConfig(32, 4, 3), DecodeConfig(64, 4, 1, prefetch=True),
                                    DecodeConfig(32, 4, 1, prefetch=True, heads_fastest=True),
                                    DecodeConfig(64, 4, 3, heads_fastest=True),
                                    DecodeConfig(32, 4, 3, fused_merge=True),
                                    DecodeConfig(64, 4, 3, heads_fastest=True, fused_merge=True),
                                    DecodeConfig(32, 4, 2, max_regs=168)], ids=str)
def test_tile_configs(config):
    q, kc, vc, bt, lens = make_case([77, 1, 200], 8, 2, 64, 16, torch.float16, seed=5)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=out, num_splits=splits,
                config=config)
        check(out, paged_decode_ref(q, kc, vc, bt, lens), torch.float16)


# (seq_lens, q heads, kv heads, head_dim, splits): GQA 1 / 4 / all on one KV head (merge
# rows of 1, 4 and 8), empty splits, a split count that is not a power of two, an empty
# sequence, and 32 non-empty splits of 8 heads x 64 dims (chunks of 16: the running max
# rescales the first chunk).
@pytest.mark.parametrize("case", [([150, 61], 4, 4, 64, 5), ([300, 1, 20], 8, 2, 64, 9),
                                  ([200], 8, 1, 64, 24), ([0, 77], 4, 2, 64, 3),
                                  ([2000], 8, 1, 64, 40)], ids=str)
def test_fused_merge_matches_merge_kernel(case, monkeypatch):
    """The in-kernel merge (last split of each group) against the merge kernel and the
    reference; run twice, so a counter not reset to 0 would show in the second call."""
    from flashpage.kernels import paged_decode as mod

    seq_lens, hq, hkv, d, splits = case
    q, kc, vc, bt, lens = make_case(seq_lens, hq, hkv, d, 16, torch.float32, seed=7)
    kw = dict(sm_scale=None, window_size=None, num_splits=splits)
    two = _launch(q, kc, vc, bt, lens, out=None, config=DecodeConfig(32, 4, 3), **kw)
    monkeypatch.setattr(mod, "_MERGE_LAUNCH", None)  # the fused path must not launch the merge
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        _launch(q, kc, vc, bt, lens, out=out, config=DecodeConfig(32, 4, 3, fused_merge=True), **kw)
        torch.testing.assert_close(out, two, atol=1e-6, rtol=1e-5)
    if min(seq_lens) > 0:
        check(out, paged_decode_ref(q, kc, vc, bt, lens), torch.float32)
    else:
        assert torch.equal(out[0], torch.zeros_like(out[0]))  # no keys: zeros, as the merge kernel


# Several KV heads per program (paged_decode_rows.py): GQA 4 with 2 and 4 heads a program
# (8 and 16 rows), MHA with 4 (4 rows padded to 16), all 8 heads of GQA 2 at once,
# splits with empty ones, a sliding window, block sizes under and over the key tile.
@pytest.mark.parametrize("case", [
    ([77, 1, 200], 16, 4, 64, 16, 2, 1, None), ([150, 61], 16, 4, 64, 16, 4, 3, None),
    ([90, 33], 4, 4, 32, 32, 4, 2, None), ([300], 16, 8, 32, 64, 8, 5, 100),
    ([129, 5], 8, 2, 64, 8, 2, 9, None),
], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_heads_per_program(case, dtype):
    seq_lens, hq, hkv, d, bs, hpb, splits, window = case
    q, kc, vc, bt, lens = make_case(seq_lens, hq, hkv, d, bs, dtype, seed=9)
    out = torch.full_like(q, float("nan"))
    _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=window, out=out, num_splits=splits,
            config=DecodeConfig(32, 4, 3, heads_per_program=hpb))
    check(out, paged_decode_ref(q, kc, vc, bt, lens, window_size=window), dtype)


def test_heads_per_program_falls_back():
    """A head count the program's heads do not divide: one head per program, same result."""
    q, kc, vc, bt, lens = make_case([50, 20], 6, 3, 64, 16, torch.float32, seed=10)
    out = _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=None, num_splits=2,
                  config=DecodeConfig(32, 4, 3, heads_per_program=2))
    check(out, paged_decode_ref(q, kc, vc, bt, lens), torch.float32)


def test_rejects_bad_inputs():
    q, kc, vc, bt, lens = make_case([5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode(q[:, :3], kc, vc, bt, lens)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode(q, kc, vc, bt.long(), lens)
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        paged_decode(q, kc, vc, bt, lens.long())
    with pytest.raises(ValueError, match="dtype mismatch"):
        paged_decode(q.half(), kc, vc, bt, lens)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        paged_decode(q[..., :32], kc, vc, bt, lens)


# ---------------------------------------------------------------- GPU, bf16

# (q heads, kv heads, head_dim, block_size): every head_dim, block size and GQA ratio
# (1, 4, 8, all on one) appears, without the full cross product (each is a compile).
GPU_CASES = [
    (8, 8, 64, 16), (32, 8, 64, 256), (32, 4, 64, 64), (32, 1, 64, 32),
    (8, 8, 128, 256), (32, 8, 128, 16), (32, 4, 128, 128), (32, 1, 128, 64),
    (8, 8, 256, 64), (32, 8, 256, 32), (32, 4, 256, 16), (32, 1, 256, 256),
]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-bs{c[3]}")
def test_paged_decode_gpu_bf16(case):
    hq, hkv, d, bs = case
    g = torch.Generator().manual_seed(sum(case))
    seq_lens = [1, 2047, bs + 1] + torch.randint(1, 3000, (5,), generator=g).tolist()
    for splits in (None, 1, 7):
        run_and_check(seq_lens, hq, hkv, d, bs, torch.bfloat16, num_splits=splits, seed=sum(case))
    run_and_check(seq_lens, hq, hkv, d, bs, torch.bfloat16, window_size=500, seed=sum(case))
    # Gemma 2: a softcap (the default config's Gluon kernels step aside for it)
    run_and_check(seq_lens, hq, hkv, d, bs, torch.bfloat16, window_size=500, seed=sum(case),
                  softcap=50.0 / 8)
    run_and_check(seq_lens, hq, hkv, d, bs, torch.bfloat16, num_splits=7, seed=sum(case), softcap=3.0)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("config", [DecodeConfig(64, 4, 3, programs_per_sm=2, warp_split=True),
                                    DecodeConfig(64, 4, 2, programs_per_sm=2, warp_split=True),
                                    DecodeConfig(32, 2, 3, programs_per_sm=4, warp_split=True)],
                         ids=config_name)
@pytest.mark.parametrize("case", [(32, 8, 128, 16), (32, 4, 128, 64), (8, 8, 64, 256)],
                         ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-bs{c[3]}")
def test_paged_decode_gpu_warp_split(case, config):
    hq, hkv, d, bs = case
    seq_lens = [1, 2047, bs + 1, 15, 16, 17, 4096]
    for splits in (None, 1, 7):
        run_and_check(seq_lens, hq, hkv, d, bs, torch.bfloat16, num_splits=splits, seed=sum(case),
                      config=config)


@pytest.mark.gpu
@gpu_only
def test_paged_decode_gpu_long_context_few_sequences():
    run_and_check([40000, 12345], 32, 8, 128, 16, torch.bfloat16)


@pytest.mark.gpu
@gpu_only
def test_paged_decode_pool_past_2_pow_31_elements():
    """key/value caches of > 2^31 elements (4.3 GB each in bf16); tables point at the last blocks."""
    bs, hkv, d, hq = 16, 8, 128, 32
    num_blocks = (1 << 31) // (bs * hkv * d) + 64
    kc = torch.empty(num_blocks, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.empty_like(kc)
    last = torch.arange(num_blocks - 64, num_blocks, device="cuda")
    kc[last] = torch.randn(64, bs, hkv, d, device="cuda").bfloat16()
    vc[last] = torch.randn(64, bs, hkv, d, device="cuda").bfloat16()
    seq_lens = torch.tensor([500, 333], dtype=torch.int32, device="cuda")
    perm = last[torch.randperm(64, device="cuda")]
    bt = torch.stack([perm[:32], perm[32:]]).int()
    assert int(bt.min()) * bs * hkv * d >= (1 << 31)  # every offset is past int32
    q = torch.randn(2, hq, d, device="cuda").bfloat16()
    for splits in (1, 4):
        out = paged_decode(q, kc, vc, bt, seq_lens, num_splits=splits)
        check(out, paged_decode_ref(q, kc, vc, bt, seq_lens), torch.bfloat16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fused_merge", [False, True])
def test_paged_decode_cuda_graph(fused_merge):
    """Split (24 programs before splitting), captured, replayed with new inputs: with the
    fused merge, each replay must find its counters back at 0."""
    q, kc, vc, bt, lens = make_case([900, 20, 2000], 32, 8, 128, 16, torch.bfloat16)
    out = torch.empty_like(q)
    cfg = DecodeConfig(64, 4, 3, programs_per_sm=2, fused_merge=fused_merge)
    kw = dict(sm_scale=None, window_size=None, out=out, num_splits=None, config=cfg)
    _launch(q, kc, vc, bt, lens, **kw)  # compile (and allocate the counters) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(q, kc, vc, bt, lens, **kw)
    # new lengths within each sequence's filled blocks (900, 20, 2000 tokens): past them
    # the cache holds NaN, and both kernel and reference would read it
    for new_lens in ([850, 20, 1500], [1, 19, 64], [899, 1, 1999]):
        q.copy_(torch.randn_like(q))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        check(out, paged_decode_ref(q, kc, vc, bt, lens), torch.bfloat16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", [(32, 8, 128, 16), (32, 1, 64, 32), (8, 8, 256, 64), (32, 4, 256, 16)],
                         ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-bs{c[3]}")
def test_paged_decode_gpu_fused_merge(case):
    """The in-kernel merge in bf16: GQA 4, all heads on one KV head (merge chunks of 4
    splits), MHA at head_dim 256; split counts of 7 and 33 (empty splits), each twice."""
    hq, hkv, d, bs = case
    q, kc, vc, bt, lens = make_case([1, 2047, bs + 1, 4000, 333], hq, hkv, d, bs, torch.bfloat16, seed=sum(case))
    ref = paged_decode_ref(q, kc, vc, bt, lens)
    for splits in (7, 33, 33):
        out = torch.full_like(q, float("nan"))
        _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=out, num_splits=splits,
                config=DecodeConfig(64, 4, 3, programs_per_sm=2, fused_merge=True))
        check(out, ref, torch.bfloat16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("config", CANDIDATE_CONFIGS, ids=config_name)
def test_paged_decode_gpu_candidate_configs(config):
    """Every config the benchmark sweeps, in bf16 at the benchmark's shape, with splits."""
    q, kc, vc, bt, lens = make_case([1, 700, 3000, 64], 32, 8, 128, 16, torch.bfloat16, seed=11)
    ref = paged_decode_ref(q, kc, vc, bt, lens)
    for splits in (1, 5):
        out = torch.full_like(q, float("nan"))
        _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=out, num_splits=splits,
                config=config)
        check(out, ref, torch.bfloat16)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("config", [DecodeConfig(32, 4, 3, heads_per_program=2),
                                    DecodeConfig(16, 4, 3, heads_per_program=4),
                                    DecodeConfig(16, 8, 3, heads_per_program=8)], ids=config_name)
def test_paged_decode_gpu_heads_per_program(config):
    """The several-heads-per-program configs the benchmark times, bf16 at its shape (GQA
    32/8, head_dim 128, block 16), unsplit and split."""
    q, kc, vc, bt, lens = make_case([1, 700, 3000, 64], 32, 8, 128, 16, torch.bfloat16, seed=12)
    ref = paged_decode_ref(q, kc, vc, bt, lens)
    for splits in (1, 2, 8):
        out = torch.full_like(q, float("nan"))
        _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=out, num_splits=splits,
                config=config)
        check(out, ref, torch.bfloat16)
