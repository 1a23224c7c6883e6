"""Fused MoE experts over block-scaled fp8 weights (DeepSeek-V3's, Qwen3-*-FP8's routed
experts, kept as stored: models/fp8_checkpoint.py, layers/moe.FusedExperts.hold_fp8)::

    gate_up        float8_e4m3fn [E, 2I, H]        gate rows first, then up
    gate_up_scale  fp32 [E, 2I / 128, H / 128]     W[e, n, k] = scale[e, n // 128, k // 128] * q[e, n, k]
    down           float8_e4m3fn [E, H, I]
    down_scale     fp32 [E, H / 128, I / 128]

(128 x 128 blocks, every published checkpoint's ``weight_block_size``; H and I whole
blocks.) The routing and alignment are kernels/fused_moe.py's (moe_align: (token, slot)
pairs sorted by expert, each expert's run padded to block_m rows; a program per
(N tile, block) reads only its own expert's tiles); one byte a weight is read instead of
two. Two ways to the tensor cores (``FusedMoEFp8Config.w8a8``):

- W8A8 (vLLM's and SGLang's way for these checkpoints): x is quantized per token per
  128-column group (kernels/fp8_block_gemm.quantize_per_token_group: e4m3 values and an
  fp32 scale per (token, group)), each 128-wide K tile runs as an e4m3 ``tl.dot`` into fp32
  and takes both scales on its partial sum, one FFMA per accumulator element a K tile::

      acc[r, n] += dot(xq[tok(r), tile g], q[e, n, tile g]) * (xs[tok(r), g] * ws[e, n // 128, g])

  (an N tile never straddles a weight block: block_n divides 128). The activation between
  the two GEMMs is quantized the same way, by quantize_per_token_group on the 16-bit
  activation, or, where gate_up's N tile is one group (128 columns), in the gate_up
  kernel's epilogue (each row's amax over its tile: no launch, but it spills, below).
  Needs e4m3 tensor cores (sm_89+) or the interpreter.
- weight-only (W8A16): x stays in its dtype; each weight tile is widened to it in registers
  (exact: e4m3 values are fp16 and bf16 values) and its block scale multiplies the
  tile's fp32 partial sum: ``acc += dot(x[tile g], q[tile g]) * ws[e, n // 128, g]``. Any
  GPU Triton converts e4m3 on, and fp32 activations (its dots in IEEE fp32).

Rounding: as kernels/fused_moe.py's contract, each projection's fp32 sum is rounded to x's
dtype, silu(gate) rounded, times up rounded, the expert output times its fp32 routing
weight rounded, the K slots summed by torch; W8A8 quantizes x and that rounded activation
(the same bits as kernels/fp8_block_ref.quantize_per_token_group_ref). The same math in
torch, one expert at a time over the block-fp8 references: :func:`fused_moe_fp8_ref`
(equal to the kernel within fp32 accumulation order: each K tile's scaled partial sum).

The swapped W8A8 form (``FusedMoEFp8Config.swap``, decode sizes): warpgroup MMAs need 64
rows an M tile, and at 16 token rows Triton 3.6 widens both e4m3 operands to fp16 for
mma.sync (HMMA). The swapped tile computes the output transposed, the weights' output
features the MMA's M and the rows its N, both operands K-major (the weight rows as stored,
the token rows read K-contiguous)::

    acc_t[n, r] += dot(q[e, n, tile g], xq[tok(r), tile g]^T) * (xs[tok(r), g] * ws[e, n // 128, g])
                   [BLOCK_N features, 128] @ [128, BLOCK_M rows]

then transposed back for the same epilogue. block_n (and gate_up_block_n) 64 or 128: the
wgmma's M, 64 a warpgroup. What the wgmma dots (``swap_mma``): "f16" (the default) widens
both e4m3 tiles to fp16 in registers (exact) for fp16 wgmmas (HGMMA.64 x rows x 16, fp32
accumulate): the 16-bit products exact and summed as the unswapped tile's HMMAs sum them,
16 K a step in the same order, so the same fp32 sums (run 208, H200: to the bit at 1 and 8
tokens, not at 32 and 64; and 7-40% slower than the unswapped tile at 1-128 tokens, run
207). "e4m3" dots them as they are (QGMMA.64
x rows x 32, nothing widened), but Hopper's e4m3 MMA keeps 13 fraction bits in its fp32
accumulator, cut toward zero (the DeepSeek-V3 report's "~14 bits"; Triton does not promote
on sm_90 unless max_num_imprecise_acc asks), at each of a K tile's four 32-wide steps: each
tile sum off by up to ~2^-13 of its products' magnitudes, which moves a projection's bf16
rounding now and then, and with it the activation's e4m3 code or its group's scale: the
output 0.45-0.62% (in norm) from the reference on the H200 (runs 202, 204), as a torch
replay of the cut reproduces (tests/kernels/test_fused_moe_fp8_swap.py; run 208's one-wgmma
probe found the 13 bits on the H200). The unswapped tile
at 64 rows runs QGMMAs too and is held to the same 1% only.

``default_config`` chooses by what the kernels compile to for sm_90 (tests/kernels/
test_fused_moe_fp8.py reads the SASS, each tile compiled with the stride hints a launch
specializes; benchmarks/fused_moe.py --fp8 times every mode beside the bf16 kernel):
where e4m3 dots run and x is 16-bit, W8A8 unswapped: 16 rows a block up to a mean of 8
pairs an expert (fp16 HMMAs, both e4m3 operands widened), 64 past it (QGMMA.64x64x32).
Run 197 (H200) timed the unswapped W8A8 tile at 16 rows: 1.27x the bf16 kernel's speed at
8 tokens, 1.6x at 32-128. The swapped form at 16 and 32 rows (HGMMA.64x16x16 / 64x32x16
with "f16", QGMMA.64x16x32 / 64x32x32 E4M3.E4M3 with "e4m3"; no HMMA, no spill; at 8 rows
Triton falls back to widened HMMAs, at 64 the swapped gate_up spills) is a config: on
e4m3 wgmmas 1-6% faster than the unswapped tile at 1-128 tokens (run 202), on fp16 ones
not yet timed. Weight-only
(rows per block near the mean) for fp32 x or where e4m3 dots do not run. W8A8's gate_up
tile is 64 wide, the activation quantized by a launch after it: the 128-wide tile that
quantizes in its epilogue holds two 64 x 128 fp32 accumulators and spills (368 B a thread
at 64 rows, 4 warps); it stays a config (``gate_up_block_n=128``) for the benchmark to
weigh (swapped at 16 rows it spills on fp16 wgmmas, 160 B a thread, the widened 128 x 128
weight tiles in registers, and not on e4m3 ones). Each default compiles with no spills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels.fp8_block_ref import (  # noqa: F401  (dequantize_experts_fp8: re-exported)
    EXPERT_BLOCK,
    FP8_MAX,
    MIN_SCALE,
    dequantize_experts_fp8,
    w8a8_block_linear_ref,
    w8a16_block_linear_ref,
)
from flashpage.kernels.fused_moe import moe_align
from flashpage.kernels.tiles import moe_block

FP8_BLOCK = EXPERT_BLOCK  # the weight blocks' side, and the activations' quantization group
# the activation quantizer's constants (fp8_block_ref's), as the kernels may read globals
_Q_MAX = tl.constexpr(FP8_MAX)
_Q_MIN_SCALE = tl.constexpr(MIN_SCALE)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class FusedMoEFp8Config:
    block_m: int = 16  # rows (token, slot pairs) per block; tl.dot needs >= 16
    block_n: int = 64  # down's N tile, and gate_up's for weight-only (divides 128)
    # W8A8 only: gate_up's N tile; 128 (one activation group) quantizes the activation in
    # its epilogue (spills on sm_90: the module docstring), 64 or less leaves that to one
    # quantize_per_token_group launch
    gate_up_block_n: int = 64
    w8a8: bool = True
    num_warps: int = 4
    num_stages: int = 3
    # W8A8 only: the swapped form (decode sizes): out^T = W tile [N tile, 128] @ x tile^T
    # [128, block_m], the weights' output features the wgmma's M (64 a warpgroup), the rows
    # its N, so Hopper's warpgroup MMAs run at 16 and 32 rows a block (at 8 Triton 3.6
    # falls back to fp16 HMMAs: block_m stays >= 16)
    swap: bool = False
    # swap only: what the wgmma dots. "f16": the e4m3 operands widened to fp16 in registers
    # (exact) for fp16 wgmma (HGMMA), fp32 sums as the unswapped tile's HMMAs make them;
    # "e4m3": e4m3 wgmma (QGMMA), whose accumulator keeps 13 fraction bits, cut toward zero
    # (the module docstring): its outputs ~0.5% (in norm) from the reference
    swap_mma: str = "f16"

    def __post_init__(self) -> None:
        for name in ("block_n", "gate_up_block_n"):
            v = getattr(self, name)
            if v < 16 or FP8_BLOCK % v:
                raise ValueError(f"{name} must divide {FP8_BLOCK} (an N tile inside one weight "
                                 f"block) and be 16 at least, got {v}")
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")
        if self.swap and not self.w8a8:
            raise ValueError("swap is a W8A8 form (e4m3 activations): set w8a8=True")
        if self.swap_mma not in ("f16", "e4m3"):
            raise ValueError(f"swap_mma must be 'f16' or 'e4m3', got {self.swap_mma!r}")
        if self.swap and (self.block_n % 64 or self.gate_up_block_n % 64):
            raise ValueError(f"swap: block_n and gate_up_block_n are the wgmma's M (64 rows a "
                             f"warpgroup): 64 or 128; got {self.block_n}, {self.gate_up_block_n}")

    @property
    def name(self) -> str:
        mode = f"w8a8 gu{self.gate_up_block_n}" if self.w8a8 else "w8a16"
        mode = f"{mode} swap" + (" e4m3" if self.swap_mma == "e4m3" else "") if self.swap else mode
        return (f"{mode} m{self.block_m} n{self.block_n} w{self.num_warps} "
                f"s{self.num_stages}")


def e4m3_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` dots e4m3 operands: sm_89+ on CUDA, or Triton's interpreter."""
    if device.type != "cuda":
        return True  # the interpreter (the CPU runs these kernels there only)
    return torch.cuda.get_device_capability(device) >= (8, 9)


def default_config(num_pairs: int, num_experts: int, x: torch.Tensor) -> FusedMoEFp8Config:
    """By shape: where e4m3 dots run and x is 16-bit, W8A8 (the activation quantized by one
    launch between the GEMMs), unswapped: 16 rows a block up to a mean of 8 pairs an expert,
    64 past it. Run 197 (H200, Qwen3-30B-A3B's experts, benchmarks/fused_moe.py --fp8) had
    W8A8 the fastest or within 2% of it at 1-512 tokens, 1.6x the bf16 kernel's speed at
    32-128 tokens (16 rows), 1.36x at 512 (64 rows), where weight-only at 32 rows took 2.1x
    bf16's time. The swapped form (``swap``) is a config: on e4m3 wgmmas
    (``swap_mma="e4m3"``) 1-6% faster at 1-128 tokens in run 202 but 0.45-0.62% (in norm)
    from the reference the unswapped kernel equals exactly (run 204: Hopper's e4m3
    accumulator keeps 13 fraction bits, the module docstring); on fp16 wgmmas (the default
    "f16") the unswapped tile's sums at 1-8 tokens but slower than it (run 207: 36.3 / 97.2 /
    188.4 / 244.5 us at 1 / 8 / 32 / 128 tokens against 31.5 / 91.2 / 166.7 / 220.2; e4m3
    30.0 / 85.6 / 165.3 / 217.7). Else weight-only, rows per block near the mean pairs per expert (N tiles
    of 32 past 16 rows: 64 spill at 32 rows)."""
    mean = triton.cdiv(max(num_pairs, 1), num_experts)
    block_m = min(64, max(16, triton.next_power_of_2(mean)))
    if x.dtype != torch.float32 and e4m3_tensor_cores(x.device):
        return FusedMoEFp8Config(block_m=16 if mean <= 8 else 64, block_n=64, gate_up_block_n=64,
                                 w8a8=True)
    return FusedMoEFp8Config(block_m=block_m, block_n=64 if block_m == 16 else 32, w8a8=False)


# ------------------------------------------------------------------------- kernels
@triton.jit
def _fp8_gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, act_ptr, acts_ptr, sorted_ptr,
                        block_expert_ptr, num_pairs, top_k, hidden, inter, stride_xt,
                        stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_ar,
                        stride_asr, DT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, W8A8: tl.constexpr, QUANT_ACT: tl.constexpr,
                        PRECISION: tl.constexpr, SWAP: tl.constexpr, SWAP_F16: tl.constexpr):
    """act[r, n tile] = silu(gate) * up for the BLOCK_M rows of one block. W8A8: x_ptr the
    e4m3 tokens [T, H] and xs_ptr their group scales [T, H / 128]; QUANT_ACT (BLOCK_N = 128)
    the activation stored quantized, e4m3 into act_ptr and its row scales into acts_ptr
    [R, I / 128] at group pid_n, else in DT. Weight-only: x_ptr in DT (xs_ptr unread)."""
    BLOCK_K: tl.constexpr = 128
    expert = tl.load(block_expert_ptr + tl.program_id(1))
    if expert < 0:  # a padding block (moe_align)
        return
    pid_n, rows, pair, valid, token = moe_block(sorted_ptr, num_pairs, top_k, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    gate_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_rows = gate_rows + inter.to(tl.int64) * stride_wn
    ws_base = ws_ptr + e64 * stride_wse
    g_ws = ws_base + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn
    u_ws = ws_base + ((inter + pid_n * BLOCK_N) // BLOCK_K) * stride_wsn
    xs_rows = xs_ptr + token * stride_xst
    if SWAP:  # W8A8, transposed: features x tokens, [BLOCK_N, BLOCK_M]
        x_cols = x_ptr + token[None, :] * stride_xt + offs_k[:, None]  # [BK, BM], K-major
        acc_gt = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_ut = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for g in range(0, hidden // BLOCK_K):
            a_t = tl.load(x_cols + g * BLOCK_K, mask=valid[None, :], other=0.0)
            a_s = tl.load(xs_rows + g, mask=valid, other=0.0)
            wg = tl.load(gate_rows + g * BLOCK_K)
            wu = tl.load(up_rows + g * BLOCK_K)
            if SWAP_F16:  # e4m3 is exact in fp16: fp16 wgmma, fp32 sums
                a_t = a_t.to(tl.float16)
                wg = wg.to(tl.float16)
                wu = wu.to(tl.float16)
            acc_gt += tl.dot(wg, a_t) * (a_s * tl.load(g_ws + g))[None, :]
            acc_ut += tl.dot(wu, a_t) * (a_s * tl.load(u_ws + g))[None, :]
        acc_g = tl.trans(acc_gt)
        acc_u = tl.trans(acc_ut)
    else:
        x_rows = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, hidden // BLOCK_K):
            a = tl.load(x_rows + g * BLOCK_K, mask=valid[:, None], other=0.0)
            wg = tl.load(gate_rows + g * BLOCK_K)
            wu = tl.load(up_rows + g * BLOCK_K)
            if W8A8:
                a_s = tl.load(xs_rows + g, mask=valid, other=0.0)
                acc_g += tl.dot(a, tl.trans(wg)) * (a_s * tl.load(g_ws + g))[:, None]
                acc_u += tl.dot(a, tl.trans(wu)) * (a_s * tl.load(u_ws + g))[:, None]
            else:
                acc_g += tl.dot(a, tl.trans(wg.to(DT)), input_precision=PRECISION) * tl.load(g_ws + g)
                acc_u += tl.dot(a, tl.trans(wu.to(DT)), input_precision=PRECISION) * tl.load(u_ws + g)
    gate = acc_g.to(DT).to(tl.float32)  # each projection output in the model dtype
    up = acc_u.to(DT).to(tl.float32)
    act = ((gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up).to(DT).to(tl.float32)
    out = act_ptr + rows[:, None].to(tl.int64) * stride_ar + offs_n[None, :]
    if QUANT_ACT:  # this tile is one 128-column group of each row
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(act), axis=1), _Q_MAX), _Q_MIN_SCALE)
        q = tl.clamp(tl.math.div_rn(act, scale[:, None]), -_Q_MAX, _Q_MAX)
        tl.store(out, q.to(act_ptr.dtype.element_ty), mask=valid[:, None])
        tl.store(acts_ptr + rows.to(tl.int64) * stride_asr + pid_n, scale, mask=valid)
    else:
        tl.store(out, act.to(DT), mask=valid[:, None])


@triton.jit
def _fp8_down_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, topk_w_ptr, ys_ptr, sorted_ptr,
                     block_expert_ptr, num_pairs, inter, stride_ar, stride_asr, stride_we,
                     stride_wn, stride_wse, stride_wsn, stride_yp, DT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W8A8: tl.constexpr,
                     PRECISION: tl.constexpr, SWAP: tl.constexpr, SWAP_F16: tl.constexpr):
    """ys[pair, n tile] = round(topk_weight[pair] * round(act[r] @ down[e].T)). W8A8:
    a_ptr the e4m3 activation [R, I] and as_ptr its group scales [R, I / 128]."""
    BLOCK_K: tl.constexpr = 128
    expert = tl.load(block_expert_ptr + tl.program_id(1))
    if expert < 0:  # a padding block (moe_align)
        return
    pid_n, rows, pair, valid, _ = moe_block(sorted_ptr, num_pairs, 1, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    ws_row = ws_ptr + e64 * stride_wse + ((pid_n * BLOCK_N) // BLOCK_K) * stride_wsn
    as_rows = as_ptr + rows.to(tl.int64) * stride_asr
    if SWAP:  # W8A8, transposed: features x rows, [BLOCK_N, BLOCK_M]
        a_cols = a_ptr + rows[None, :].to(tl.int64) * stride_ar + offs_k[:, None]  # [BK, BM]
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for g in range(0, inter // BLOCK_K):
            a_t = tl.load(a_cols + g * BLOCK_K, mask=valid[None, :], other=0.0)
            a_s = tl.load(as_rows + g, mask=valid, other=0.0)
            w = tl.load(w_rows + g * BLOCK_K)
            if SWAP_F16:
                a_t = a_t.to(tl.float16)
                w = w.to(tl.float16)
            acc_t += tl.dot(w, a_t) * (a_s * tl.load(ws_row + g))[None, :]
        acc = tl.trans(acc_t)
    else:
        a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_ar + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, inter // BLOCK_K):
            a = tl.load(a_rows + g * BLOCK_K, mask=valid[:, None], other=0.0)
            w = tl.load(w_rows + g * BLOCK_K)
            if W8A8:
                a_s = tl.load(as_rows + g, mask=valid, other=0.0)
                acc += tl.dot(a, tl.trans(w)) * (a_s * tl.load(ws_row + g))[:, None]
            else:
                acc += tl.dot(a, tl.trans(w.to(DT)), input_precision=PRECISION) * tl.load(ws_row + g)
    weight = tl.load(topk_w_ptr + pair, mask=valid, other=0.0)
    y = acc.to(DT).to(tl.float32) * weight[:, None]
    out = ys_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_yp + offs_n[None, :]
    tl.store(out, y.to(DT), mask=valid[:, None])


# ------------------------------------------------------------------------- launcher
def _check(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
           down: torch.Tensor, down_scale: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor) -> tuple[int, int, int]:
    """-> (E, I, H) of checked arguments (ValueError naming what is wrong)."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"x must be [T, H], gate_up [E, 2I, H], down [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"x must be fp32, fp16 or bf16, got {x.dtype}")
    if gate_up.dtype != torch.float8_e4m3fn or down.dtype != torch.float8_e4m3fn:
        raise ValueError(f"gate_up and down must be float8_e4m3fn, got {gate_up.dtype}, "
                         f"{down.dtype}")
    e, two_i, h = gate_up.shape
    inter = two_i // 2
    b = FP8_BLOCK
    if h % b or inter % b or x.shape[1] != h or down.shape != (e, h, inter):
        raise ValueError(f"shapes disagree or are not whole {b}-blocks: x {tuple(x.shape)}, "
                         f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} (H and I "
                         f"multiples of {b})")
    want = {"gate_up_scale": (e, two_i // b, h // b), "down_scale": (e, h // b, inter // b)}
    got = {"gate_up_scale": gate_up_scale, "down_scale": down_scale}
    for name, t in got.items():
        if tuple(t.shape) != want[name] or t.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 {list(want[name])} ({b} x {b} blocks), got "
                             f"{t.dtype} {tuple(t.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must be [T, K] with T = {x.shape[0]}; got "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32, got {topk_weights.dtype}")
    return e, inter, h


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_moe_fp8(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                  down: torch.Tensor, down_scale: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor,
                  config: FusedMoEFp8Config | None = None) -> torch.Tensor:
    """x [T, H] (fp32 / fp16 / bf16), the block-fp8 experts (the module docstring's
    layout), topk_ids int [T, K] (0..E-1), topk_weights fp32 [T, K] -> [T, H] in x's dtype
    = sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with silu(gate) * up. No host sync, every
    shape a function of the input shapes: capturable in a CUDA graph."""
    from flashpage.kernels.fp8_block_gemm import quantize_per_token_group

    e, inter, h = _check(x, gate_up, gate_up_scale, down, down_scale, topk_ids, topk_weights)
    t, k = topk_ids.shape
    num_pairs = t * k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_pairs, e, x)
    x, gate_up, down = _contig(x), _contig(gate_up), _contig(down)
    gate_up_scale, down_scale = _contig(gate_up_scale), _contig(down_scale)
    sorted_pairs, block_expert = moe_align(topk_ids, e, cfg.block_m)
    nb = block_expert.shape[0]
    rows = nb * cfg.block_m
    dt = _TL_DTYPES[x.dtype]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(DT=dt, BLOCK_M=cfg.block_m, W8A8=cfg.w8a8, PRECISION=precision, SWAP=cfg.swap,
                  SWAP_F16=cfg.swap and cfg.swap_mma == "f16", num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    if cfg.w8a8:
        a_in, a_scales = quantize_per_token_group(x, FP8_BLOCK)
        gu_n = cfg.gate_up_block_n
    else:
        a_in, a_scales, gu_n = x, x, cfg.block_n  # a_scales never read
    quant_act = cfg.w8a8 and gu_n == FP8_BLOCK
    act = torch.empty(rows, inter, device=x.device,
                      dtype=torch.float8_e4m3fn if quant_act else x.dtype)
    act_s = (torch.empty(rows, inter // FP8_BLOCK, device=x.device, dtype=torch.float32)
             if quant_act else act)
    _fp8_gate_up_kernel[(inter // gu_n, nb)](
        a_in, a_scales, gate_up, gate_up_scale, act, act_s, sorted_pairs, block_expert,
        num_pairs, k, h, inter, a_in.stride(0), a_scales.stride(0), gate_up.stride(0),
        gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), act.stride(0),
        act_s.stride(0), BLOCK_N=gu_n, QUANT_ACT=quant_act, **launch)
    if cfg.w8a8 and not quant_act:
        # padding rows hold whatever torch.empty gave: quantized too, never read
        act, act_s = quantize_per_token_group(act, FP8_BLOCK)
    ys = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
    _fp8_down_kernel[(h // cfg.block_n, nb)](
        act, act_s, down, down_scale, topk_weights.reshape(-1).contiguous(), ys, sorted_pairs,
        block_expert, num_pairs, inter, act.stride(0), act_s.stride(0), down.stride(0),
        down.stride(1), down_scale.stride(0), down_scale.stride(1), ys.stride(0),
        BLOCK_N=cfg.block_n, **launch)
    return ys.view(t, k, h).sum(1)


def fused_moe_fp8_ref(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                      down: torch.Tensor, down_scale: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, w8a8: bool = True) -> torch.Tensor:
    """Pure-torch fused_moe_fp8, one expert at a time: each projection is
    kernels/fp8_block_ref's W8A8 (x and the activation quantized per token per group) or
    weight-only linear, rounded to x's dtype, with the 16-bit kernel's rounding between."""
    e_count, inter, h = _check(x, gate_up, gate_up_scale, down, down_scale, topk_ids,
                               topk_weights)
    del e_count
    linear = w8a8_block_linear_ref if w8a8 else w8a16_block_linear_ref
    block = (FP8_BLOCK, FP8_BLOCK)
    t, k = topk_ids.shape
    ys = torch.zeros(t, k, h, dtype=x.dtype, device=x.device)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        proj = linear(x[tok], gate_up[e], gate_up_scale[e], block)
        act = torch.nn.functional.silu(proj[:, :inter]) * proj[:, inter:]
        y = linear(act, down[e], down_scale[e], block)
        ys[tok, slot] = (y * topk_weights[tok, slot, None]).to(x.dtype)
    return ys.sum(1)


__all__ = ["FP8_BLOCK", "FusedMoEFp8Config", "default_config", "dequantize_experts_fp8",
           "e4m3_tensor_cores", "fused_moe_fp8", "fused_moe_fp8_ref"]
