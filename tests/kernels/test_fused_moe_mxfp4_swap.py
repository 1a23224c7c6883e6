"""The MXFP4 fused MoE kernel's "swap" forms (kernels/fused_moe.py: the weight tile as the
MMA's first operand, out^T = W . x^T, so a decode batch's few rows per expert are the MMA's
N): "swap" (its own e2m1 decode, the e8m0 scale on each 32-K group's fp32 partial sums) and
"swap_scaled" (tl.dot_scaled, bf16).

CPU: the decode's bit arithmetic (the inline PTX's, mirrored in torch) for every byte in
bf16 and fp16, and the interpreter's decode in fp32 / fp16, equal dequantize_mxfp4's values;
the "swap" kernel against the reference (dequantize, then fused_moe_ref) and the "tile" form
in fp32 / fp16 within accumulation order (ragged routing, an expert over several blocks,
unused experts with inf weights, biases, the clamped SwiGLU binding, several N / K tiles);
errors; the kernels compiled for sm_90a (no GPU): the inline PTX assembles, the dots run on
wgmma, nothing spills, and the K loop's SASS per weight is under "tile"'s.
GPU (marked gpu): the inline PTX decode of every byte, gpt-oss-20b's shape in bf16 and fp16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from test_fused_moe_mxfp4 import SWIGLU, mxfp4_experts, routing  # tests/kernels

from flashpage.kernels import fused_moe as fm
from flashpage.kernels.fused_moe import (
    ClampedSwiGLU,
    FusedMoEConfig,
    dequantize_kernel_mxfp4,
    fused_moe,
    fused_moe_mxfp4,
    fused_moe_mxfp4_ref,
)
from flashpage.models.mxfp4 import dequantize_mxfp4

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
cpu_only = pytest.mark.skipif(GPU, reason="the CPU variant (interpreter)")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 e2m1 values of nibble codes 0-15 (the OCP table)."""
    mag = torch.tensor(E2M1)[(codes & 7).long()]
    return torch.where(codes >= 8, -mag, mag)


def ptx_bits(byte: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The inline PTX's arithmetic (fm._E2M1_BF16_PTX / _E2M1_F16_PTX), one 16-bit lane at a
    time in torch: (low nibble, high nibble) values of each byte in ``dtype``."""
    b = byte.to(torch.int32)
    if dtype == torch.bfloat16:
        lo = ((b & 0xF) * 0x1040) & 0x81C0
        hi = ((b & 0xF0) * 0x104) & 0x81C0
        mul = 2.0 ** 126
    else:
        lo = (((b << 9) & 0x0E00) | ((b << 12) & 0x8000))
        hi = (((b << 5) & 0x0E00) | ((b << 8) & 0x8000))
        mul = 2.0 ** 14

    def as_float(bits: torch.Tensor) -> torch.Tensor:  # int16 holds 0x8000 as -32768
        return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)

    return as_float(lo) * mul, as_float(hi) * mul


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ptx_bit_arithmetic_every_byte(dtype):
    """The decode's bit placement, for all 256 bytes: the e2m1 value exactly (0.5 through the
    dtype's subnormal times the power of two; -0 for code 8), in bf16 and fp16 (torch's
    16-bit multiply is exact here: a power of two)."""
    byte = torch.arange(256, dtype=torch.uint8)
    lo, hi = ptx_bits(byte, dtype)
    want_lo, want_hi = e2m1_values(byte.int() & 0xF), e2m1_values(byte.int() >> 4)
    assert torch.equal(lo.float(), want_lo) and torch.equal(hi.float(), want_hi)
    assert torch.equal(lo.float().signbit(), (byte.int() & 8) > 0)  # -0 too
    # the same as models/mxfp4's dequantization at scale 127 (2 ** 0)
    deq = dequantize_mxfp4(byte.view(16, 1, 16), torch.full((16, 1), 127, dtype=torch.uint8),
                           dtype).view(256, 2)
    assert torch.equal(deq[:, 0], lo) and torch.equal(deq[:, 1], hi)


@triton.jit
def _bytes_kernel(b_ptr, lo_ptr, hi_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    """lo, hi [n, 16] = fm._e2m1_bytes of bytes [n, 16] (BLOCK rows a program)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = rows[:, None] * 16 + tl.arange(0, 16)[None, :]
    mask = rows[:, None] < n
    byte = tl.load(b_ptr + offs, mask=mask, other=0)
    lo, hi = fm._e2m1_bytes(byte, lo_ptr.dtype.element_ty, ASM)
    tl.store(lo_ptr + offs, lo, mask=mask)
    tl.store(hi_ptr + offs, hi, mask=mask)


def assert_bytes_decode(dtype: torch.dtype, asm: bool) -> None:
    byte = torch.arange(256, dtype=torch.uint8).view(16, 16).to(DEV)
    lo = torch.full((16, 16), 7.0, dtype=dtype, device=DEV)  # 7: no e2m1 value
    hi = lo.clone()
    _bytes_kernel[(2,)](byte, lo, hi, 16, BLOCK=8, ASM=asm)
    want_lo = e2m1_values(byte.cpu().int() & 0xF).view(16, 16)
    want_hi = e2m1_values(byte.cpu().int() >> 4).view(16, 16)
    assert torch.equal(lo.float().cpu(), want_lo) and torch.equal(hi.float().cpu(), want_hi)
    assert torch.equal(lo.float().cpu().signbit(), (byte.cpu().int() & 8) > 0)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_every_byte_interpreter(dtype):
    """The Triton fallback of the decode (no inline PTX): every byte's two values."""
    assert_bytes_decode(dtype, asm=False)


def experts_case(t, k, e, h, inter, crowd, dtype):
    """MXFP4 experts (scales 127 +- 10; unused experts 255: inf weights, never read; a few
    extreme scales in used ones), routing, x, biases (the first test file's case)."""
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, seed=t, gate_up_scales=(117, 137),
                                         down_scales=(117, 127))
    ids, w = routing(t, k, e, seed=t + 1, crowd=crowd)
    unused = sorted(set(range(e)) - set(ids.unique().tolist()))
    gu_s[unused], d_s[unused] = 255, 255
    used = ids[0].tolist()
    gu_s[used[0], 0, 0], gu_s[used[0], 1, 0], d_s[used[-1], 2, 0] = 1, 140, 1
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(t, h, generator=g) * 2.0 ** -10).to(DEV, dtype)
    kw = dict(gate_up_bias=(torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEV, dtype),
              down_bias=(torch.randn(e, h, generator=g) * 0.5).to(DEV, dtype), activation=SWIGLU)
    return (gu_b, gu_s, d_b, d_s), ids, w, x, kw, used


CASES = [  # t, k, e, hidden, inter, crowd
    (1, 4, 16, 64, 32, 0),      # one token: four blocks of one row
    (37, 4, 16, 96, 64, 20),    # ragged, 20 tokens on experts 0..3 (several blocks)
    (5, 3, 8, 160, 96, 0),      # hidden, inter not multiples of the N tiles
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "k", "e", "h", "inter", "crowd"), CASES)
@pytest.mark.parametrize(("bn", "bk"), [(32, 32), (64, 64)])
def test_swap_matches_the_reference(t, k, e, h, inter, crowd, dtype, bn, bk):
    """"swap" against dequantize + fused_moe_ref and against "tile" (same tiles): equal
    within accumulation order (its sums: per 32-K group, scaled, then added); the scales
    and the clamps move the output (the test could fail)."""
    (gu_b, gu_s, d_b, d_s), ids, w, x, kw, used = experts_case(t, k, e, h, inter, crowd, dtype)
    cfg = FusedMoEConfig(block_m=16, block_n=bn, block_k=bk, mxfp4_form="swap")
    got = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, cfg, **kw)
    want = fused_moe_mxfp4_ref(x, gu_b, gu_s, d_b, d_s, ids, w, **kw)
    tile = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w,
                           dataclasses.replace(cfg, mxfp4_form="tile"), **kw)
    assert got.shape == (t, h) and got.dtype == dtype and torch.isfinite(got).all()
    scale = want.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, scale))
    torch.testing.assert_close(got.float(), tile.float(), rtol=tol, atol=tol * max(1.0, scale))
    d_s2 = d_s.clone()
    d_s2[used[0]] += 1  # one expert's down weights doubled
    moved = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s2, ids, w, cfg, **kw)
    want2 = fused_moe_mxfp4_ref(x, gu_b, gu_s, d_b, d_s2, ids, w, **kw)
    assert not torch.equal(got, moved)
    torch.testing.assert_close(moved.float(), want2.float(), rtol=tol,
                               atol=tol * max(1.0, want2.float().abs().max().item()))


@cpu_only
def test_swap_silu_without_biases_default_tiles():
    """Mixtral-style experts (silu, no biases) through "swap" at the default config's tiles
    (K tiles of 128: four scale groups a K step), fp32, against the reference."""
    t, k, e, h, inter = 9, 2, 8, 128, 64
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, 3, (120, 130), (120, 130))
    ids, w = routing(t, k, e, seed=4)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).to(DEV) * 2.0 ** -4
    cfg = dataclasses.replace(fm.default_config(t * k, e, torch.float32), mxfp4_form="swap",
                              block_n=64)
    assert cfg.block_k == 128
    got = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, cfg)
    want = fused_moe_mxfp4_ref(x, gu_b, gu_s, d_b, d_s, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_swap_errors():
    e, h, inter = 4, 64, 32
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, 0, (120, 130), (120, 130))
    x = torch.zeros(3, h, device=DEV)
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEV)
    w = torch.zeros(3, 2, device=DEV)
    with pytest.raises(ValueError, match="'swap_scaled'.*bf16 activations, got torch.float32"):
        fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w,
                        FusedMoEConfig(mxfp4_form="swap_scaled"))
    with pytest.raises(ValueError, match="block_k a multiple of 32"):
        fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w,
                        FusedMoEConfig(block_k=48, mxfp4_form="swap"))
    with pytest.raises(ValueError, match="one of tile, scaled, swap, swap_scaled"):
        FusedMoEConfig(mxfp4_form="swapped")


# ----------------------------------------------------------------- sm_90a SASS (no GPU)
def _loop_stats(kernel) -> dict:
    """The K loop (the longest backward-branch span holding an MMA) of a compiled kernel:
    its SASS instruction count, a few opcodes', registers, spills, whether the PTX holds the
    swap form's packed multiply."""
    import collections

    from sm90 import ptxas_sm90a, ptxas_usage, sass_instructions, sass_loops

    ptx = kernel.asm["ptx"]
    log, sass = ptxas_sm90a(ptx)
    ins, labels = sass_instructions(sass)
    bodies = [[t.split(" ")[0].split(".")[0] for t in ins[lo:hi + 1]]
              for lo, hi in sass_loops(ins, labels)]
    body = max((b for b in bodies if {"HGMMA", "HMMA"} & set(b)), key=len)
    mix = collections.Counter(body)
    return dict(loop=len(body), **{op: mix[op] for op in ("HGMMA", "HMMA", "HMUL2", "PRMT",
                                                          "LOP3", "IMAD", "LDS", "FFMA")},
                packed_mul="mul.rn.bf16x2" in ptx or "mul.rn.f16x2" in ptx, **ptxas_usage(log))


# (kernel, form, block_n, block_k, dtype): weights a loop iteration = (2 for gate_up) * BN * BK
SASS_CASES = [("gate_up", "tile", 32, 128, "bf16"), ("gate_up", "scaled", 64, 128, "bf16"),
              ("gate_up", "swap", 64, 32, "bf16"), ("gate_up", "swap", 128, 32, "bf16"),
              ("gate_up", "swap", 64, 128, "bf16"), ("gate_up", "swap_scaled", 64, 128, "bf16"),
              ("gate_up", "swap", 64, 32, "fp16"),
              ("down", "tile", 32, 128, "bf16"), ("down", "scaled", 64, 128, "bf16"),
              ("down", "swap", 64, 32, "bf16"), ("down", "swap", 128, 32, "bf16"),
              ("down", "swap_scaled", 64, 128, "bf16")]


def _compile_swap_kernels() -> list[dict]:
    """(In a subprocess with the interpreter off.) SASS_CASES compiled for sm_90 at 16 rows
    a block, 4 warps, 3 stages, as a launch specializes them: each K loop's _loop_stats and
    its instructions per weight and thread (loop * 4 warps * 32 / weights an iteration)."""
    from sm90 import compile_sm90

    out = []
    for kern, form, bn, bk, dt in SASS_CASES:
        fn = fm._gate_up_kernel if kern == "gate_up" else fm._down_kernel
        consts = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, HAS_BIAS=True,
                      MXFP4=1 + fm.MXFP4_FORMS.index(form), ASM=form == "swap")
        if kern == "gate_up":
            consts["CLAMPED_SWIGLU"] = True
        act = "*" + dt
        types = {"w_ptr": "*u8", "s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                 "alpha": "fp32", "limit": "fp32", "topk_w_ptr": "*fp32", "x_ptr": act,
                 "act_ptr": act, "bias_ptr": act, "ys_ptr": act}
        aligned = [a for a in fn.arg_names
                   if a.endswith("_ptr") or a in ("hidden", "inter") or a.startswith("stride_")]
        k = compile_sm90(fn, consts, types, num_warps=4, num_stages=3, aligned=aligned)
        stats = _loop_stats(k)
        weights = (2 if kern == "gate_up" else 1) * bn * bk
        out.append(dict(kernel=kern, form=form, block_n=bn, block_k=bk, dtype=dt, **stats,
                        per_weight=round(stats["loop"] * 128 / weights, 2)))
    return out


def test_swap_kernels_compile_for_sm90():
    """On the CPU: "swap" builds for an H200 in bf16 and fp16 (the inline PTX assembles,
    its packed multiply is there), its dots on wgmma (HGMMA: the weight tile the first
    operand from registers), nothing spilled, and its K loop's SASS per weight (and thread)
    under "tile"'s, at BN 128 under "scaled"'s too (the figures: the report's table)."""
    from sm90 import run_compiled

    got = {(r["kernel"], r["form"], r["block_n"], r["block_k"], r["dtype"]): r
           for r in run_compiled("test_fused_moe_mxfp4_swap", "_compile_swap_kernels")}
    for key, r in got.items():
        print(key, {k: v for k, v in r.items() if k not in ("kernel", "form", "block_n",
                                                             "block_k", "dtype")})
    assert all(r["spill_bytes"] == 0 for r in got.values()), got
    for (kern, form, bn, bk, dt), r in got.items():
        if form == "swap":
            assert r["packed_mul"] and r["HMUL2"] > 0 and r["HGMMA"] > 0, (kern, bn, bk, dt, r)
            assert r["per_weight"] < got[(kern, "tile", 32, 128, "bf16")]["per_weight"], r
    for kern in ("gate_up", "down"):
        assert (got[(kern, "swap", 128, 32, "bf16")]["per_weight"]
                < got[(kern, "scaled", 64, 128, "bf16")]["per_weight"]), got


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("asm", [True, False])
def test_decode_every_byte_gpu(dtype, asm):
    """The inline PTX (pack=4: which byte's value lands in which half) and the fallback
    compiled for the GPU: every byte's two values exactly."""
    assert_bytes_decode(dtype, asm)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["swap", "swap_scaled"])
@pytest.mark.parametrize(("bn", "bk"), [(64, 32), (128, 32), (64, 128)])
@pytest.mark.parametrize(("t", "crowd"), [(1, 0), (8, 0), (64, 40)])
def test_swap_gpu_bf16_gpt_oss_20b(t, crowd, bn, bk, form):
    """gpt-oss-20b's expert shape (E 32, top-4, hidden = I = 2880), its clamped SwiGLU and
    biases, scales around its weights': "swap" / "swap_scaled" against dequantize + the bf16
    kernel (bf16 outputs: equal but where fp32 sums in other orders round apart)."""
    k, e, h, inter = 4, 32, 2880, 2880
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, seed=t, gate_up_scales=(116, 124),
                                         down_scales=(116, 124))
    g = torch.Generator().manual_seed(t)
    kw = dict(gate_up_bias=(torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEV, torch.bfloat16),
              down_bias=(torch.randn(e, h, generator=g) * 0.5).to(DEV, torch.bfloat16),
              activation=ClampedSwiGLU(1.702, 7.0))
    ids, w = routing(t, k, e, seed=t + 2, crowd=crowd)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    cfg = FusedMoEConfig(block_m=16, block_n=bn, block_k=bk, mxfp4_form=form)
    got = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, cfg, **kw)
    want = fused_moe(x, dequantize_kernel_mxfp4(gu_b, gu_s, torch.bfloat16),
                     dequantize_kernel_mxfp4(d_b, d_s, torch.bfloat16), ids, w,
                     fm.default_config(t * k, e), **kw)
    assert torch.isfinite(got).all()
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * max(1.0, scale))
    assert (got == want).float().mean().item() >= 0.95


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swap_gpu_fp16_fp32(dtype):
    """fp16 (the f16x2 PTX) and fp32 (the Triton decode, IEEE dots) at a mid shape against
    the reference."""
    (gu_b, gu_s, d_b, d_s), ids, w, x, kw, _ = experts_case(40, 4, 16, 512, 256, 10, dtype)
    cfg = FusedMoEConfig(block_m=16, block_n=64, block_k=64, mxfp4_form="swap")
    got = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, cfg, **kw)
    want = fused_moe_mxfp4_ref(x, gu_b, gu_s, d_b, d_s, ids, w, **kw)
    scale = want.float().abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, scale))
