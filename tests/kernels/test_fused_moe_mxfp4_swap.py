"""The MXFP4 fused MoE kernel's "swap" forms (kernels/fused_moe.py: the weight tile as the
MMA's first operand, out^T = W . x^T, so a decode batch's few rows per expert are the MMA's
N): "swap" (our decode of 32-bit words into wgmma's A fragment in registers, K tiles of 128)
and "swap_scaled" (tl.dot_scaled, bf16).

CPU: the bf16 inline PTX's arithmetic (mirrored in torch) for every nibble at every scale,
and the interpreter's word decode in fp32 / fp16 at every scale, equal dequantize_mxfp4's
values; the "swap" kernel against the reference (dequantize, then fused_moe_ref) and the
"tile" form in fp32 / fp16 within accumulation order (ragged routing, an expert over several
blocks, unused experts with inf weights, biases, the clamped SwiGLU binding, K and N not
multiples of the tiles, misaligned blocks); errors; the kernels compiled for sm_90a (no
GPU): the inline PTX assembles, the dots run on wgmma with the weights from registers (no
shared-memory round trip for them), nothing spills, and the K loop's SASS per weight is under
"scaled"'s and "tile"'s.
GPU (marked gpu): the inline PTX decode of every nibble at every scale, gpt-oss-20b's shape
in bf16, fp16 / fp32 at a mid shape.
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
# the word decode's output order: nibbles 0, 4, 1, 5, 2, 6, 3, 7
WORD_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 e2m1 values of nibble codes 0-15 (the OCP table)."""
    mag = torch.tensor(E2M1, device=codes.device)[(codes & 7).long()]
    return torch.where(codes >= 8, -mag, mag)


def every_nibble_words() -> torch.Tensor:
    """int32 words [256]: every nibble position holds every code (16 x 16 patterns)."""
    i = torch.arange(256, dtype=torch.int64)
    w = torch.zeros(256, dtype=torch.int64)
    for m in range(8):
        w |= ((i + 5 * m) % 16 if m % 2 else (i // 16 + 3 * m) % 16) << (4 * m)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def nibble(words: torch.Tensor, m: int) -> torch.Tensor:
    return (words.to(torch.int64) & 0xFFFFFFFF) >> (4 * m) & 0xF


def dequantize_each(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_mxfp4 of each e2m1 code (uint8 [n]) alone at its e8m0 scale (uint8 [n])."""
    byte = (codes | (codes << 4)).to(torch.uint8).view(-1, 1, 1).expand(-1, 1, 16)
    return dequantize_mxfp4(byte.contiguous(), scales.view(-1, 1), dtype)[:, 0]


def ptx_word_bf16(words: torch.Tensor, scale: torch.Tensor) -> list[torch.Tensor]:
    """fm._E2M1_WORD_BF16_PTX's arithmetic in torch, lane by lane (int64 for the 32-bit
    ops): the 8 bf16 outputs ($0..$7) of each word at bf16 ``scale``."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    w8 = w >> 8
    outs = []
    for src, mask, mul in ((w, 0x000F000F, 0x1040), (w, 0x00F000F0, 0x104),
                           (w8, 0x000F000F, 0x1040), (w8, 0x00F000F0, 0x104)):
        t = ((src & mask) * mul) & 0x81C081C0 & 0xFFFFFFFF
        for half in (t & 0xFFFF, t >> 16):  # $2r: the low half, $2r + 1: the high one
            bits = torch.where(half >= 0x8000, half - 0x10000, half).to(torch.int16)
            # two bf16 multiplies, each rounded to bf16 (exact here: powers of two)
            outs.append(bits.view(torch.bfloat16) * 2.0 ** 126 * scale)
    return outs


@pytest.mark.parametrize("s", [0, 1, 60, 117, 127, 137, 200, 253, 254, 255])
def test_ptx_word_arithmetic_every_nibble(s):
    """The bf16 PTX's bit placement for every nibble code at every position of a word, at
    scales from 2 ** -127 (a bf16 subnormal itself) to 255 (inf): the e2m1 value times the
    scale, as dequantize_mxfp4 rounds it to bf16 (-0 for code 8; 254 overflows to inf for
    magnitudes past 1.5; 255: inf, zeros NaN)."""
    words = every_nibble_words()
    scale = torch.tensor([2.0 ** (s - 127) if s < 255 else float("inf")]).to(torch.bfloat16)
    outs = ptx_word_bf16(words, scale)
    for j, m in enumerate(WORD_ORDER):
        want = dequantize_each(nibble(words, m).to(torch.uint8),
                               torch.full((256,), s, dtype=torch.uint8), torch.bfloat16)
        torch.testing.assert_close(outs[j], want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(outs[j].signbit() & ~outs[j].isnan(), want.signbit() & ~want.isnan())
    assert outs[0].isfinite().any() or s == 255


@triton.jit
def _word_kernel(w_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr, ASM: tl.constexpr):
    """out [n, 8] = fm._e2m1_word of words [n] at scales [n] (e8m0 bytes)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    word = tl.load(w_ptr + offs, mask=mask, other=0)
    sc = fm._e8m0(tl.load(s_ptr + offs, mask=mask, other=0))
    o0, o1, o2, o3, o4, o5, o6, o7 = fm._e2m1_word(word, sc, out_ptr.dtype.element_ty, ASM)
    store8(out_ptr + offs * 8, mask, o0, o1, o2, o3, o4, o5, o6, o7)


@triton.jit
def store8(out, mask, o0, o1, o2, o3, o4, o5, o6, o7):
    """A word's 8 decoded values at out[0:8] (each of [BLOCK] words' rows of 8)."""
    tl.store(out, o0, mask=mask)
    tl.store(out + 1, o1, mask=mask)
    tl.store(out + 2, o2, mask=mask)
    tl.store(out + 3, o3, mask=mask)
    tl.store(out + 4, o4, mask=mask)
    tl.store(out + 5, o5, mask=mask)
    tl.store(out + 6, o6, mask=mask)
    tl.store(out + 7, o7, mask=mask)


def assert_word_decode(dtype: torch.dtype, asm: bool) -> None:
    """Every nibble at every position (every_nibble_words) at every scale 0-255."""
    words = every_nibble_words().repeat(256)
    scales = torch.arange(256).repeat_interleave(256).to(torch.uint8)
    out = torch.full((words.numel(), 8), 7.0, dtype=dtype, device=DEV)  # 7: no e2m1 value
    _word_kernel[(triton.cdiv(words.numel(), 1024),)](words.to(DEV), scales.to(DEV), out,
                                                       words.numel(), BLOCK=1024, ASM=asm)
    codes = torch.stack([nibble(words, m) for m in WORD_ORDER], 1).to(torch.uint8)  # [n, 8]
    want = dequantize_each(codes.view(-1), scales.repeat_interleave(8), dtype).view(-1, 8)
    got = out.cpu()
    if GPU:  # fp32 subnormals (scale 0, 0.5 at scale 1) may be flushed by the GPU
        tiny = want.float().abs() < 2.0 ** -126
        got = torch.where(tiny & (got == 0), want, got)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.signbit() & ~got.isnan(), want.signbit() & ~want.isnan())


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_word_decode_every_nibble_every_scale_interpreter(dtype):
    """The Triton word decode (no inline PTX): dequantize_mxfp4's values, scales 0-255."""
    assert_word_decode(dtype, asm=False)


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
    (1, 4, 16, 64, 32, 0),      # one token: four blocks of one row; K under one tile of 128
    (37, 4, 16, 96, 160, 20),   # ragged, 20 tokens on experts 0..3 (several blocks)
    (5, 3, 8, 288, 96, 0),      # hidden, inter not multiples of the N / K tiles
]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "k", "e", "h", "inter", "crowd"), CASES)
def test_swap_matches_the_reference(t, k, e, h, inter, crowd, dtype):
    """"swap" (64 rows a tile) against dequantize + fused_moe_ref and against "tile":
    equal within accumulation order; the scales and the clamps move the output (the test
    could fail)."""
    (gu_b, gu_s, d_b, d_s), ids, w, x, kw, used = experts_case(t, k, e, h, inter, crowd, dtype)
    cfg = FusedMoEConfig(block_m=16, block_n=64, block_k=128, mxfp4_form="swap")
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
def test_swap_wide_tiles_silu_misaligned_blocks():
    """Mixtral-style experts (silu, no biases), fp32, 128 rows a tile (two wgmma row
    blocks), blocks that start 1 byte past a 4-byte boundary (copied to aligned words),
    against the reference."""
    t, k, e, h, inter = 9, 2, 8, 256, 192
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, 3, (120, 130), (120, 130))
    ids, w = routing(t, k, e, seed=4)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).to(DEV) * 2.0 ** -4
    cfg = FusedMoEConfig(block_m=16, block_n=128, block_k=128, mxfp4_form="swap")
    want = fused_moe_mxfp4_ref(x, gu_b, gu_s, d_b, d_s, ids, w)
    odd = torch.empty(gu_b.numel() + 1, dtype=torch.uint8, device=DEV)[1:].view(gu_b.shape)
    odd.copy_(gu_b)
    assert odd.data_ptr() % 4
    for blocks in (gu_b, odd):
        got = fused_moe_mxfp4(x, blocks, gu_s, d_b, d_s, ids, w, cfg)
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
    with pytest.raises(ValueError, match="'swap' takes K tiles of 128.*got block_k 64, block_n 64"):
        fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w,
                        FusedMoEConfig(block_n=64, block_k=64, mxfp4_form="swap"))
    with pytest.raises(ValueError, match="block_n a multiple of 64.*block_n 32"):
        fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w,
                        FusedMoEConfig(block_n=32, block_k=128, mxfp4_form="swap"))
    with pytest.raises(ValueError, match="one of tile, scaled, swap, swap_scaled"):
        FusedMoEConfig(mxfp4_form="swapped")


# ----------------------------------------------------------------- sm_90a SASS (no GPU)
def _loop_stats(kernel) -> dict:
    """The K loop (the longest backward-branch span holding an MMA) of a compiled kernel:
    its SASS instruction count, a few opcodes', wgmmas taking their first operand from
    registers, registers, spills, whether the PTX holds "swap"'s packed multiply."""
    import collections
    import re

    from sm90 import ptxas_sm90a, ptxas_usage, sass_instructions, sass_loops

    ptx = kernel.asm["ptx"]
    log, sass = ptxas_sm90a(ptx)
    ins, labels = sass_instructions(sass)
    spans = [ins[lo:hi + 1] for lo, hi in sass_loops(ins, labels)]
    loop = max((b for b in spans if any(t.startswith(("HGMMA", "HMMA")) for t in b)), key=len)
    mix = collections.Counter(t.split(" ")[0].split(".")[0] for t in loop)
    return dict(loop=len(loop), **{op: mix[op] for op in ("HGMMA", "HMMA", "HMUL2", "PRMT", "LOP3",
                                                         "IMAD", "LDS", "LDSM", "STS", "FFMA")},
                hgmma_reg_a=sum(bool(re.match(r"HGMMA\S* R\d+, R\d+, gdesc", t)) for t in loop),
                packed_mul="mul.rn.bf16x2" in ptx, **ptxas_usage(log))


# (kernel, form, block_n, block_k, stages); 16 rows a block, 4 warps, bf16
SASS_CASES = [(kern, form, bn, bk, st) for kern in ("gate_up", "down") for form, bn, bk, st in (
    ("tile", 32, 128, 3), ("scaled", 64, 128, 3), ("swap", 64, 128, 1), ("swap", 64, 128, 3),
    ("swap", 128, 128, 1), ("swap_scaled", 64, 128, 3))]


def _compile_swap_kernels() -> list[dict]:
    """(In a subprocess with the interpreter off.) SASS_CASES compiled for sm_90 as a launch
    specializes them: each K loop's _loop_stats and its SASS instructions per weight and
    thread (loop * 128 threads / weights an iteration: 2 * BN * BK for gate_up)."""
    from sm90 import compile_sm90

    out = []
    for kern, form, bn, bk, st in SASS_CASES:
        fn = fm._gate_up_kernel if kern == "gate_up" else fm._down_kernel
        consts = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, IEEE=False, HAS_BIAS=True,
                      MXFP4=1 + fm.MXFP4_FORMS.index(form), ASM=form == "swap")
        if kern == "gate_up":
            consts["CLAMPED_SWIGLU"] = True
        types = {"w_ptr": "*u8", "s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
                 "alpha": "fp32", "limit": "fp32", "topk_w_ptr": "*fp32"}
        aligned = [a for a in fn.arg_names
                   if a.endswith("_ptr") or a in ("hidden", "inter") or a.startswith("stride_")]
        k = compile_sm90(fn, consts, types, num_warps=4, num_stages=st, aligned=aligned)
        stats = _loop_stats(k)
        weights = (2 if kern == "gate_up" else 1) * bn * bk
        out.append(dict(kernel=kern, form=form, block_n=bn, block_k=bk, stages=st, **stats,
                        per_weight=round(stats["loop"] * 128 / weights, 2)))
    return out


def test_swap_kernels_compile_for_sm90():
    """On the CPU: "swap" builds for an H200 (the inline PTX assembles, its packed
    multiplies are in the loop), every wgmma takes the weights from registers, and
    unpipelined (1 stage) nothing of them passes through shared memory (one LDS a weight
    tile in the loop, the scale bytes' relayout; 16 KB of weights would take 8 LDS.128 a
    thread: the word load's layout is wgmma's A fragment's, so the decoded values never move
    between threads); nothing spills; its K loop's SASS per weight and thread is under 3/4 of
    "scaled"'s and 1/3 of "tile"'s (the figures: -s prints them)."""
    from sm90 import run_compiled

    got = {(r["kernel"], r["form"], r["block_n"], r["stages"]): r
           for r in run_compiled("test_fused_moe_mxfp4_swap", "_compile_swap_kernels")}
    for key, r in got.items():
        print(key, {k: v for k, v in r.items() if k not in ("kernel", "form", "block_n", "stages")})
    assert all(r["spill_bytes"] == 0 for r in got.values()), got
    for (kern, form, bn, st), r in got.items():
        if form != "swap":
            continue
        assert r["packed_mul"] and r["HMUL2"] > 0, (kern, bn, st, r)
        assert r["HGMMA"] > 0 and r["hgmma_reg_a"] == r["HGMMA"], (kern, bn, st, r)
        if st == 1:  # one shared-memory read a weight tile: its scales' (4 bytes a row)
            assert r["LDS"] + r["LDSM"] <= (2 if kern == "gate_up" else 1), (kern, bn, st, r)
        assert r["per_weight"] < 0.75 * got[(kern, "scaled", 64, 3)]["per_weight"], (kern, bn, st)
        assert r["per_weight"] < got[(kern, "tile", 32, 3)]["per_weight"] / 3, (kern, bn, st)


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "asm"), [(torch.bfloat16, True), (torch.bfloat16, False),
                                            (torch.float16, False), (torch.float32, False)])
def test_word_decode_every_nibble_every_scale_gpu(dtype, asm):
    """The inline PTX (which nibble lands in which output, the halves of its registers) and
    the Triton decode compiled for the GPU, every nibble at every scale: dequantize_mxfp4's
    values (but where an fp32 subnormal may be flushed to zero: below 2 ** -126)."""
    assert_word_decode(dtype, asm)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("form", "bn", "bk", "stages"), [
    ("swap", 64, 128, 1), ("swap", 64, 128, 3), ("swap", 128, 128, 1),
    ("swap_scaled", 64, 128, 3), ("swap_scaled", 128, 64, 3)])
@pytest.mark.parametrize(("t", "crowd"), [(1, 0), (8, 0), (64, 40), (300, 0)])
def test_swap_gpu_bf16_gpt_oss_20b(t, crowd, form, bn, bk, stages):
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
    cfg = FusedMoEConfig(block_m=16, block_n=bn, block_k=bk, num_stages=stages, mxfp4_form=form)
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
    """fp16 and fp32 (the Triton decode; IEEE dots for fp32) at a mid shape against the
    reference."""
    (gu_b, gu_s, d_b, d_s), ids, w, x, kw, _ = experts_case(40, 4, 16, 512, 256, 10, dtype)
    cfg = FusedMoEConfig(block_m=16, block_n=64, block_k=128, mxfp4_form="swap")
    got = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, cfg, **kw)
    want = fused_moe_mxfp4_ref(x, gu_b, gu_s, d_b, d_s, ids, w, **kw)
    scale = want.float().abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, scale))
