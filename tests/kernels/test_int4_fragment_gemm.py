"""The swapped W4A16 GEMM's fragment tiles (kernels/int4_fragment.py, ``Int4GemmConfig
.fragment``: the int4 weight tile decoded straight into wgmma's A fragment, x's K reordered
to match) against ``int4_linear_ref``.

CPU: the K order and x's copy; the packed 16-bit PTX's arithmetic (which the interpreter
cannot run) replayed in torch from its constants equals ``dequantize_int4_ref``'s bits for
every nibble and zero point, bf16 and fp16; both decodes (per weight, on the sums) under
the interpreter in fp32 / fp16 (groups of 32 / 64 / 128 / 256 / K, ragged M and N, split K,
bias, x by TMA); the per-weight tile's weights are the reference's to the bit; named errors;
the tiles built for sm_90a (no GPU): wgmma with the weights from registers, no store to
shared memory and no ldmatrix in the K loop (the dequantized tile's round trip of the older
tiles), nothing spilled, fewer SASS instructions a K tile than the older tile of the same
rows and form. GPU (marked gpu): bf16 and fp16 at 64, 100, 128, 256 rows, the 8B shapes.
"""

from __future__ import annotations

import pytest
import torch
from test_int4_gemm import _as_close_as_the_reference, _weight

from flashpage.kernels.int4_fragment import (
    DEQUANT16_TYPES,
    dequant16_ptx,
    fragment_k_order,
    fragment_x,
)
from flashpage.kernels.int4_gemm import (
    GEMM_CANDIDATES,
    Int4GemmConfig,
    dequantize_int4_ref,
    fragment_reasons,
    gemm_config,
    int4_linear_ref,
    pack_int4,
    parse_gemm_config,
    w4a16_gemm,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _frag(bm=64, per_weight=True, **kw) -> Int4GemmConfig:
    return Int4GemmConfig(bm, 64, 128, per_weight=per_weight, fragment=True, **kw)


def test_fragment_k_order_is_the_fragment_layout():
    """Within each 128 tile, position k' = 32u + 8r + 2c + h holds natural column
    32c + 8u + 4h + r (thread c of a quad, its word u, nibble r + 4h), and x's copy is x's
    columns in that order."""
    order = fragment_k_order(256)
    assert sorted(order.tolist()) == list(range(256))
    for t in (0, 1):
        for c in range(4):
            for u in range(4):
                for h in range(2):
                    for r in range(4):
                        kp = 128 * t + 32 * u + 8 * r + 2 * c + h
                        assert order[kp] == 128 * t + 32 * c + 8 * u + 4 * h + r
    x = torch.randn(5, 256)
    assert torch.equal(fragment_x(x), x[:, order])
    with pytest.raises(ValueError, match="not a multiple of 128"):
        fragment_x(torch.randn(2, 192))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequant16_ptx_replayed_gives_the_reference_bits(dtype):
    """The packed 16-bit PTX (lop3 (w >> 4i) & 0x000F000F | MAGIC: the pair OFFSET + q[i],
    OFFSET + q[i + 4]; fma by 1 with -(OFFSET + z): q - z, exact; mul.rn by the scale: one
    rounding of the exact product), replayed in torch on its own constants, for every
    nibble value at every position and every zero point 0..16, equals
    dequantize_int4_ref's weights in ``dtype`` to the bit (scales of ``dtype``, spanning
    magnitudes)."""
    magic, offset, one, ty = DEQUANT16_TYPES[dtype]
    ptx = dequant16_ptx(dtype)
    for op in ("lop3.b32", f"fma.rn.{ty}", f"mul.rn.{ty}", "0x000F000F", magic, one):
        assert op in ptx, op
    assert ptx.index("lop3.b32 p") < ptx.index(f"fma.rn.{ty}") < ptx.index(f"mul.rn.{ty}")
    assert torch.tensor([int(one, 16) & 0xFFFF], dtype=torch.int16).view(dtype).item() == 1.0
    assert torch.tensor([int(magic, 16) & 0xFFFF], dtype=torch.int16).view(dtype).item() == offset
    i = torch.arange(16 * 17)
    q = torch.stack([(i + 3 * j) % 16 for j in range(8)], 1).to(torch.int32)  # [272, 8]
    z = (i // 16).to(torch.uint8)[:, None]  # 0..16
    gen = torch.Generator().manual_seed(1)
    s = (torch.rand(272, 1, generator=gen) * 2.0 ** torch.randint(-14, 4, (272, 1), generator=gen)
         ).to(dtype)
    words = pack_int4(q)[:, 0].to(torch.int64) & 0xFFFFFFFF
    nz = (-(z.float() + offset)).to(dtype)
    got = torch.empty(272, 8, dtype=dtype)
    for j in range(4):
        pair = ((words >> (4 * j)) & 0x000F000F) | int(magic, 16)  # lop3 0xEA: a & b | c
        halves = torch.stack([pair & 0xFFFF, pair >> 16], 1).to(torch.int16)  # wraps
        vals = halves.view(dtype).float()  # (OFFSET + q[j], OFFSET + q[j + 4])
        qz = (vals * 1.0 + nz.float()).to(dtype)  # fma, exact
        res = (qz.float() * s.float()).to(dtype)  # mul.rn: the exact product rounded once
        got[:, j], got[:, j + 4] = res[:, 0], res[:, 1]
    want = dequantize_int4_ref(words.to(torch.int32)[:, None], s, z, dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), dtype


CASES = [
    # m, n, k, g, bias, config
    (70, 96, 256, 128, True, _frag(64)),                       # 2 row tiles, N ragged
    (70, 96, 256, 128, False, _frag(64, per_weight=False)),
    (33, 80, 256, 32, True, _frag(32)),                        # 4 groups a K tile, per word
    (33, 64, 384, 64, False, _frag(16, split_k=2)),            # 2 groups a tile, split K
    (20, 72, 384, 384, True, _frag(32, per_weight=False, split_k=3)),  # G = K, 3 splits
    (100, 130, 256, 256, True, _frag(32, per_weight=False, group_m=2)),  # 4 x 3 tiles, bands
    (70, 96, 256, 128, True, _frag(64, tma=True)),             # x by TMA, rows past M
    (70, 64, 512, 128, False, _frag(64, per_weight=False, tma=True, split_k=1)),
    (65, 64, 128, 128, False, None),                           # the default for 65 rows
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,g,bias,cfg", CASES)
def test_fragment_tiles_match_reference(m, n, k, g, bias, cfg, dtype):
    if GPU and dtype == torch.float32:
        dtype = torch.bfloat16
    qw, scales, zeros, _ = _weight(n, k, g, m + n + k)
    gen = torch.Generator(device="cpu").manual_seed(m * 3 + n)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    if cfg is None:  # the 16-bit default tile (bf16's and fp16's)
        cfg = gemm_config(m, n, k, g, torch.bfloat16)
        assert cfg.fragment and gemm_config(m, n, k, g, torch.float16) == cfg
    got = w4a16_gemm(x, qw, scales, zeros, b, cfg)
    ref = int4_linear_ref(x, qw, scales, zeros, b)
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        _as_close_as_the_reference(got, ref, x, qw, scales, zeros, b)


@pytest.mark.parametrize("g", [32, 128])
def test_fragment_per_weight_tile_is_the_reference_weights(g):
    """With x one-hot rows (each output one weight, no sum to round) the per-weight fragment
    tile's y^T is dequantize_int4_ref's fp16 weight to the bit: the K reorder and the rows'
    load order put every weight back where it belongs."""
    n, k = 128, 256
    qw, scales, zeros, _ = _weight(n, k, g, g + 1)
    x = torch.eye(k, dtype=torch.float16)[:100].to(DEV)  # 100 rows: 2 row tiles of 64
    got = w4a16_gemm(x, qw, scales, zeros, config=_frag(64, split_k=1))
    want = dequantize_int4_ref(qw, scales, zeros, torch.float16)[:, :100].t()
    assert torch.equal(got, want)


def test_fragment_config_names_choice_and_errors():
    for cfg in GEMM_CANDIDATES:
        assert parse_gemm_config(cfg.name) == cfg
    assert parse_gemm_config("fpm64n64k128s0w4st4g8").fragment
    assert not parse_gemm_config("pm64n64k128s0w4st4g8").fragment
    assert any(c.fragment for c in GEMM_CANDIDATES) and any(not c.fragment for c in GEMM_CANDIDATES)
    for m in (64, 65, 128, 129, 256):
        cfg = gemm_config(m, 4096, 4096, 128, torch.bfloat16)
        assert cfg.fragment and not cfg.per_weight and not fragment_reasons(4096, 128, cfg), m
        # fp16 x the same tile (right on the GPU in run 206); no dtype: the older tiles
        assert gemm_config(m, 4096, 4096, 128, torch.float16) == cfg
        assert not gemm_config(m, 4096, 4096, 128).fragment
    bf16 = torch.bfloat16
    assert not gemm_config(100, 64, 4104, 8, bf16).fragment  # K not a multiple of 128
    assert not gemm_config(100, 64, 384, 192, bf16).fragment  # groups of 192 cross a K tile
    assert not gemm_config(100, 64, 4096, 32, bf16).fragment  # groups under 128: per weight
    qw, scales, zeros, _ = _weight(64, 384, 192, 1)
    x = torch.randn(70, 384).to(DEV)
    with pytest.raises(ValueError, match="group size 192 neither divides"):
        w4a16_gemm(x, qw, scales, zeros, config=_frag(64))
    with pytest.raises(ValueError, match="group size 192 is not a multiple of 128"):
        w4a16_gemm(x, qw, scales, zeros, config=_frag(64, per_weight=False))
    q2, s2, z2, _ = _weight(64, 192, 64, 1)
    with pytest.raises(ValueError, match="K=192 is not a multiple of 128"):
        w4a16_gemm(torch.randn(70, 192).to(DEV), q2, s2, z2, config=_frag(64))
    bad = Int4GemmConfig(64, 128, 64, num_warps=8, fragment=True)
    with pytest.raises(ValueError, match="block_k 64 is not 128.*block_n 128 is not 64.*num_warps 8"):
        w4a16_gemm(torch.randn(70, 256).to(DEV), *_weight(64, 256, 128, 1)[:3], config=bad)


# ----------------------------------------------------------------- sm_90a SASS (no GPU)
# (config name, x's dtype ("bf16s": bf16 x under bf16 scales, the packed PTX), the older tile
# it replaces: same rows, form and stages)
SASS_CASES = [
    ("fpm64n64k128s0w4st4g8", "bf16", "pm64n64k128s0w4st4g8"),
    ("fpm128n64k128s0w4st3g8t", "bf16", "pm128n64k128s0w4st3g8t"),
    ("fwm128n64k128s0w4st3g8t", "bf16", "wm128n64k128s0w4st3g8t"),
    ("fwm128n64k128s0w4st3g8t", "fp16", "wm128n64k128s0w4st3g8t"),
    ("fwm256n64k128s0w4st3g8t", "bf16", "wm256n64k64s0w4st3g8t"),
    ("fwm256n64k128s0w4st3g8t", "fp16", "wm256n64k64s0w4st3g8t"),
    ("fwm256n64k128s0w4st3g8t", "bf16s", "wm256n64k64s0w4st3g8t"),
]


def _loop(name: str, dt: str) -> dict:
    """One tile compiled for sm_90a as an H200 launch of the 8B shapes builds it (fp16
    scales, bf16 for "bf16s"; groups of 128, aligned pointers and strides): its K loop's
    SASS counts."""
    import collections
    import re

    from sm90 import ptxas_usage, wgmma_a_clobbers
    from test_int4_swap_gemm import compile_swap_kernel

    from flashpage.kernels import int4_gemm as m

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16s": torch.bfloat16}[dt]
    scale_dt = "bf16" if dt == "bf16s" else "fp16"
    cfg = m.parse_gemm_config(name)
    pw16 = cfg.fragment and cfg.per_weight and (dtype == torch.float16 or dt == "bf16s")
    ptx = dequant16_ptx(dtype) if pw16 else (m._unpack_ptx(dtype) if not cfg.per_weight else "")
    k, log, loop = compile_swap_kernel(cfg, dt[:4], ptx, DEQUANT16_TYPES[dtype][1] if ptx else 0.0,
                                       pw16, scale_dt)
    mix = collections.Counter(t.split(" ")[0].split(".")[0] for t in loop)
    return dict(loop=len(loop), per_128k=len(loop) * 128 // cfg.block_k, shared=k.metadata.shared,
                hgmma_reg_a=sum(bool(re.match(r"HGMMA\S* R\d+, R\d+, gdesc", t)) for t in loop),
                **{op: mix.get(op, 0) for op in ("HGMMA", "STS", "LDSM", "LDS", "HMUL2", "FFMA",
                                                 "F2FP")},
                packed_mul=f"mul.rn.{DEQUANT16_TYPES[dtype][3]}" in k.asm["ptx"],
                a_clobbers=len(wgmma_a_clobbers(loop)),
                **ptxas_usage(log))


def _compile_fragment_tiles() -> list[dict]:
    """(In a subprocess with the interpreter off.) SASS_CASES' new and old tiles."""
    return [dict(name=new, dt=dt, old=old, new_stats=_loop(new, dt), old_stats=_loop(old, dt))
            for new, dt, old in SASS_CASES]


def test_fragment_tiles_compile_for_sm90():
    """On the CPU: each fragment tile's K loop runs wgmma with the weights from registers,
    stores nothing to shared memory and reads it by no ldmatrix (the older tile of the same
    rows: 8 STS + 8 LDSM a 128-wide K tile, the decoded tile's round trip; the LDS left are
    the packed words' and the scales'), spills nothing, fits the H200's 227 KB of shared
    memory, and takes fewer SASS instructions a 128-wide K tile than the older tile; per
    weight under x-typed scales it runs the packed multiply (HMUL2, no FFMA); and no
    instruction writes the A registers of a wgmma still in flight (run 206's wrong weights,
    sm90.wgmma_a_clobbers). -s prints the counts."""
    from sm90 import run_compiled

    got = run_compiled("test_int4_fragment_gemm", "_compile_fragment_tiles")
    assert len(got) == len(SASS_CASES)
    for r in got:
        new, old = r["new_stats"], r["old_stats"]
        print(r["name"], r["dt"], new, "| old", r["old"], old)
        key = (r["name"], r["dt"])
        assert new["HGMMA"] > 0 and new["hgmma_reg_a"] == new["HGMMA"], (key, new)
        assert new["STS"] == 0 and new["LDSM"] == 0, (key, new)
        assert old["STS"] > 0 and old["LDSM"] > 0, (key, old)  # what the fragment removes
        assert new["spill_bytes"] == 0 and new["shared"] <= 227 * 1024, (key, new)
        assert new["a_clobbers"] == 0, (key, new)  # no A register rewritten in flight
        assert new["per_128k"] < old["per_128k"], (key, new, old)
        if r["name"].startswith("fw") and r["dt"] in ("fp16", "bf16s"):
            assert new["packed_mul"] and new["HMUL2"] > 0 and new["FFMA"] == 0, (key, new)


# ----------------------------------------------------------------- GPU
# Run 206 (H200, each tile on its own): under fp16 x with fp16 scales the per-weight TMA tiles
# of 3 stages missed (their packed 16-bit PTX). The cause (sm_90a SASS): the last of a tile's
# wgmmas left in flight into the next K tile while the next tile's decode rewrote its A
# registers; with int4_fragment.wgmma_drain after each tile's MMAs every case passes (run 210).
_TILES = ["default", *(c.name for c in GEMM_CANDIDATES if c.fragment)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("m", [64, 100, 128, 256])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", _TILES)
def test_fragment_tiles_on_the_gpu(tile, n, k, m, dtype):
    """gemm_config's tile for ``dtype`` and each fragment candidate on its own (so that a
    failure names its tile) at the 8B's qkv and down shapes (groups of 128, fp16 scales), bf16
    and fp16 activations, with bias."""
    qw, scales, zeros, _ = _weight(n, k, 128, 7)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    b = torch.randn(n, device=DEV, dtype=dtype)
    ref = int4_linear_ref(x, qw, scales, zeros, b)
    assert gemm_config(m, n, k, 128, dtype).fragment
    cfg = gemm_config(m, n, k, 128, dtype) if tile == "default" else parse_gemm_config(tile)
    got = w4a16_gemm(x, qw, scales, zeros, b, cfg)
    _as_close_as_the_reference(got, ref, x, qw, scales, zeros, b)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float16, "x"])
@pytest.mark.parametrize("bm", [128, 256])
def test_fragment_per_weight_bits_on_the_gpu(dtype, scale_dtype, bm):
    """One-hot rows: the per-weight fragment tile (scales of x's type: the packed 16-bit
    PTX; bf16 x under fp16 scales: fp32 FMAs) gives dequantize_int4_ref's weights to the bit
    on the GPU, groups of 32 and 128 (256 rows: wrong at k % 32 in 26, 30 before
    wgmma_drain, runs 201 / 206; right after, run 210)."""
    for g in (32, 128):
        n, k = 192, 512
        qw, scales, zeros, _ = _weight(n, k, g, g, dtype if scale_dtype == "x" else scale_dtype)
        x = torch.eye(k, dtype=dtype, device=DEV)[:256]
        got = w4a16_gemm(x, qw, scales, zeros, config=_frag(bm, split_k=1, tma=True))
        want = dequantize_int4_ref(qw, scales, zeros, dtype)[:, :256].t()
        assert torch.equal(got, want), (g, bm, dtype)
