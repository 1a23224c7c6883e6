"""The swapped W4A16 GEMM (kernels/int4_gemm.py ``w4a16_gemm``: the weight tile the MMA's A
operand, x^T its B; the int4 path past the GEMV's 64 rows) against ``int4_linear_ref``:
both forms (the tile dequantized per weight; q - z with the scale on the sums), groups of
32 / 64 / 128 and one group per row, K tiles spanning groups or inside one, M and N ragged
against the tiles, several row tiles and bands, split K, bias; fp32 / fp16 on the CPU
under the interpreter, bf16 on the GPU at the 8B shapes. Also: the per-weight form's
weights are ``dequantize_int4_ref``'s bits, the config names round-trip, bad calls are
named errors, and the kernel built for sm_90 on the CPU runs warpgroup MMAs with no spill."""

from __future__ import annotations

import functools

import pytest
import torch
from test_int4_gemm import _as_close_as_the_reference, _weight

from flashpage.kernels.int4_gemm import (
    GEMM_CANDIDATES,
    Int4GemmConfig,
    dequantize_int4_ref,
    fragment_reasons,
    gemm_config,
    gemm_supports,
    int4_linear_ref,
    parse_gemm_config,
    w4a16_gemm,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"

CASES = [
    # m, n, k, g, bias, config
    (70, 96, 256, 128, True, Int4GemmConfig(64, 64, 128)),            # 2 row tiles, N ragged
    (70, 96, 256, 128, False, Int4GemmConfig(64, 64, 128, per_weight=False)),
    (33, 80, 256, 32, True, Int4GemmConfig(32, 64, 128)),             # 4 groups a K tile
    (33, 80, 256, 32, True, Int4GemmConfig(32, 64, 128, per_weight=False)),  # tile = group
    (20, 72, 96, 96, False, Int4GemmConfig(16, 32, 64, split_k=2)),   # G = K, 3 tiles, split
    (20, 72, 96, 96, True, Int4GemmConfig(16, 32, 64, split_k=3, per_weight=False)),
    (100, 40, 128, 64, True, Int4GemmConfig(32, 16, 32, group_m=2)),  # 4 x 3 tiles, bands of 2
    (65, 64, 128, 64, False, None),            # the default for 65 rows (a fragment tile)
    (70, 96, 256, 128, True, Int4GemmConfig(64, 64, 64, 1, tma=True)),  # x by TMA, rows past M
    (100, 40, 128, 32, False, Int4GemmConfig(32, 16, 64, 2, group_m=3, tma=True)),
]


def _case(m, n, k, g, bias, dtype, seed):
    qw, scales, zeros, _ = _weight(n, k, g, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    return x, qw, scales, zeros, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,g,bias,cfg", CASES)
def test_w4a16_gemm_matches_reference(m, n, k, g, bias, cfg, dtype):
    if GPU and dtype == torch.float16:
        dtype = torch.bfloat16
    x, qw, scales, zeros, b = _case(m, n, k, g, bias, dtype, m * 7 + n + k)
    got = w4a16_gemm(x, qw, scales, zeros, b, cfg)
    ref = int4_linear_ref(x, qw, scales, zeros, b)
    assert got.shape == (m, n) and got.dtype == dtype
    if dtype == torch.bfloat16:
        _as_close_as_the_reference(got, ref, x, qw, scales, zeros, b)
    else:
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_per_weight_form_multiplies_the_reference_weights():
    """The per-weight form's tile is (q - z) * s rounded once to x's dtype: with x one-hot
    rows (each output a single weight, no sum to round), y^T is dequantize_int4_ref's fp16
    weight to the bit, groups of 32 and the whole row."""
    for g in (32, 128):
        n, k = 64, 128
        qw, scales, zeros, _ = _weight(n, k, g, g)
        x = torch.eye(k, dtype=torch.float16)[:80].to(DEV)  # 80 rows: 2 row tiles of 64
        got = w4a16_gemm(x, qw, scales, zeros, config=Int4GemmConfig(64, 64, 64, 1))
        want = dequantize_int4_ref(qw, scales, zeros, torch.float16)[:, :80].t()
        assert torch.equal(got, want), g


def test_gemm_config_names_and_choice():
    for cfg in (*GEMM_CANDIDATES, gemm_config(65, 4096, 4096), gemm_config(2048, 4096, 4096)):
        assert parse_gemm_config(cfg.name) == cfg
    assert parse_gemm_config("wm256n64k64s0w4st3g8t").tma
    assert len({c.name for c in GEMM_CANDIDATES}) == len(GEMM_CANDIDATES)
    assert parse_gemm_config("pm128n64k128s0w4st3g8").per_weight is False
    with pytest.raises(ValueError, match="not a config name"):
        parse_gemm_config("m128n64k128")
    assert gemm_config(65, 4096, 4096).block_m >= 64
    assert gemm_supports(4096, 128) and gemm_supports(4096, 4096) and gemm_supports(96, 32)
    assert not gemm_supports(72, 8)  # K = 8 x 9: no K tile of 16


def test_w4a16_gemm_names_bad_calls():
    qw, scales, zeros, _ = _weight(16, 64, 32, 1)
    x = torch.randn(70, 64).to(DEV)
    with pytest.raises(ValueError, match="x .* does not fit"):
        w4a16_gemm(torch.randn(2, 32).to(DEV), qw, scales, zeros)
    with pytest.raises(ValueError, match="bias must be"):
        w4a16_gemm(x, qw, scales, zeros, torch.randn(8).to(DEV))
    with pytest.raises(ValueError, match="x must be fp16, bf16 or fp32"):
        w4a16_gemm(x.double(), qw, scales, zeros)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        w4a16_gemm(x, qw, scales, zeros.int())
    q9, s9, z9, _ = _weight(16, 72, 8, 2)
    with pytest.raises(ValueError, match="K tiles of 16 at least"):
        w4a16_gemm(torch.randn(70, 72).to(DEV), q9, s9, z9)
    assert w4a16_gemm(x[:0], qw, scales, zeros).shape == (0, 16)


def _compile_swap_gemm() -> dict[str, dict]:
    """(In a subprocess with the interpreter off.) The older tiles (run 196's defaults; the
    fragment tiles: test_int4_fragment_gemm.py) compiled for sm_90 as
    an H200 launch of the 8B shapes builds them (bf16 x, fp16 scales, groups of 128, K a
    multiple of 16): name -> the K loop's SASS counts, registers, spills."""
    import collections

    from sm90 import ptxas_usage

    from flashpage.kernels import int4_gemm as m

    out = {}
    # the older tiles (the fragment ones: test_int4_fragment_gemm.py)
    for cfg in {m.Int4GemmConfig(128, 64, 128, 0, 4, 3, tma=True),
                m.Int4GemmConfig(64, 64, 128, 0, 4, 4, per_weight=False),
                m.Int4GemmConfig(128, 64, 128, per_weight=False),
                m.Int4GemmConfig(256, 64, 64, tma=True)}:
        asm_ptx = not cfg.per_weight
        k, log, loop = compile_swap_kernel(
            cfg, "bf16", m._unpack_ptx(torch.bfloat16) if asm_ptx else "", 128.0 if asm_ptx else 0.0)
        mix = collections.Counter(t.split(" ")[0].split(".")[0] for t in loop)
        out[cfg.name] = {"loop": len(loop), "tma": "cp.async.bulk.tensor" in k.asm["ptx"], "weights": cfg.block_n * cfg.block_k,
                         "threads": 32 * cfg.num_warps, "mma_sync": "mma.sync" in k.asm["ptx"],
                         **{op: mix.get(op, 0) for op in ("HGMMA", "HMMA", "I2F", "F2FP")},
                         **ptxas_usage(log)}
    return out


def compile_swap_kernel(cfg, dt: str, ptx: str, offset: float, pw16: bool = False,
                        scale_dt: str = "fp16"):
    """``_w4a16_swap_kernel`` with ``cfg`` compiled for sm_90a as an H200 launch of the 8B
    shapes builds it (x in ``dt``, scales in ``scale_dt``, groups of 128, aligned pointers and strides;
    no GPU): (the compiled kernel, ptxas' log, its K loop's SASS: the shortest backward
    branch around the warpgroup MMAs)."""
    from sm90 import compile_sm90, ptxas_sm90a, sass_instructions, sass_loops

    from flashpage.kernels import int4_gemm as m

    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "K", "stride_qw",
               "stride_xm", "stride_om")
    k = compile_sm90(m._w4a16_swap_kernel, dict(
        G=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, PARTIAL=False, HAS_BIAS=False, PRECISION="tf32",
        PER_WEIGHT=cfg.per_weight, ASM=True, PTX=ptx, OFFSET=offset,
        NUM_STAGES=cfg.num_stages, TMA=cfg.tma, FRAG=cfg.fragment, PW16=pw16,
        **({} if cfg.tma else {"x_desc": None})),
        {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "b_ptr": f"*{dt}", "qw_ptr": "*i32",
         "s_ptr": f"*{scale_dt}", "z_ptr": "*u8", "SPLIT_K": "i32",
         "x_desc": f"tensordesc<{dt}[{cfg.block_m}, {cfg.block_k}]>"},
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=aligned)
    log, sass = ptxas_sm90a(k.asm["ptx"])
    ins, labels = sass_instructions(sass)
    lo, hi = min((p for p in sass_loops(ins, labels)
                  if any(t.startswith("HGMMA") for t in ins[p[0]:p[1] + 1])),
                 key=lambda p: p[1] - p[0])
    return k, log, ins[lo:hi + 1]


def test_swap_gemm_compiles_to_warpgroup_mmas_for_sm90():
    """On the CPU: the K loop of each older tile (the scale-on-the-sums form, a TMA-fed
    tile: its x tiles by cp.async.bulk.tensor) runs
    Hopper's warpgroup MMAs (HGMMA, not mma.sync), converts no nibble by I2F, spills
    nothing, and costs at most 8 SASS instructions a weight a thread whatever the tile's
    rows (6.4-7.8 for these tiles, the dequantizing paid once for 128-256 rows; the old
    tl.dot kernel: ~18 for 64 rows, its 64 x 128 tile's 580)."""
    from sm90 import run_compiled

    got = run_compiled("test_int4_swap_gemm", "_compile_swap_gemm")
    assert len(got) >= 3, got
    for name, v in got.items():
        assert v["HGMMA"] > 0 and v["HMMA"] == 0 and not v["mma_sync"], (name, v)
        assert v["I2F"] <= 4, (name, v)
        assert v["spill_bytes"] == 0, (name, v)
        assert v["tma"] == name.endswith("t"), (name, v)
        per_weight = v["loop"] * v["threads"] / v["weights"]
        assert per_weight <= 8, (name, per_weight, v)
        if name.startswith("w"):
            assert v["F2FP"] * 2 * v["threads"] >= v["weights"], (name, v)  # packed pairs


@functools.lru_cache(maxsize=4)
def _weight_8b(n: int, k: int):
    """An 8B shape's int4 weight (groups of 128), built once for its three row counts."""
    return _weight(n, k, 128, 11)[:3]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [65, 300, 2048])
def test_w4a16_gemm_bf16_8b_shapes_on_the_gpu(n, k, m):
    qw, scales, zeros = _weight_8b(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ref = int4_linear_ref(x, qw, scales, zeros)
    got = w4a16_gemm(x, qw, scales, zeros)
    _as_close_as_the_reference(got, ref, x, qw, scales, zeros)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("cfg", GEMM_CANDIDATES, ids=lambda c: c.name)
def test_w4a16_gemm_bf16_every_candidate_on_the_gpu(cfg):
    """Every tile the sweep may pick, at a ragged size with bias (300 rows, 4160 features,
    groups of 128) and with groups of 32 (K tiles spanning groups or inside one)."""
    for g, m, n, k in ((128, 300, 4160, 4096), (32, 129, 1024, 2048)):
        if cfg.fragment and fragment_reasons(k, g, cfg):
            continue  # a fragment tile with the scale on the sums takes groups of 128 up
        qw, scales, zeros, _ = _weight(n, k, g, 5)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
        got = w4a16_gemm(x, qw, scales, zeros, b, cfg)
        _as_close_as_the_reference(got, int4_linear_ref(x, qw, scales, zeros, b), x, qw,
                                   scales, zeros, b)
