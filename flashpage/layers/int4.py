"""Linears whose weights stay 4-bit: an AWQ or GPTQ checkpoint's (models/int4_checkpoint.py),
held in our one int4 layout (kernels/int4_gemm.py): ``weight`` int32 [N, K/8] (the name
kept so merged linears load their pieces' rows as any weight), ``w4_scales`` [N, K/G] and
``w4_zeros`` uint8 [N, K/G] beside it (``_ParallelLinear.hold_int4``). A quarter of the
bytes of a bf16 weight, plus 2.5 bytes per group of G values (~0.5 byte per 128-group).

How a call of M rows runs (``int4_linear``; ``cuda_path`` picks on CUDA):

    CUDA, M <= GEMV_ROWS (64)    kernels/int4_gemv.int4_gemv: a row-wise GEMV, each program
                                 streams its features' packed words along K once for all
                                 M rows, q - z unpacked in registers (inline PTX), tensor
                                 cores with x as the 16- to 64-wide operand, the group
                                 scale on the fp32 sums (one row: the CUDA cores); K split,
                                 K tiles through Triton's cp.async pipeliner (one row:
                                 register prefetch). H200, run 175: 0.73-0.88x the bf16
                                 GEMM's time at 1-16 rows, 0.83-0.95x at 32, 1.04-1.12x at
                                 64 (dequantize + cuBLAS: 1.6-2.7x)
    CUDA, M <= GEMM_MAX_ROWS     kernels/int4_gemm.w4a16_gemm: the swapped GEMM (the weight
    (256)                        tile wgmma's A operand, dequantized in registers to x's
                                 dtype, (q - z) * s rounded once as the reference rounds
                                 it; x^T the B operand from shared memory; 16-256 rows a
                                 tile). H200, run 196: 1.06-1.8x the bf16 GEMM's time at
                                 64-256 rows, where dequantize + cuBLAS takes 1.5-2.6x on
                                 gate_up / down and ties it on qkv / o_proj at 256. Its
                                 default tiles are now the fragment tiles (decoded in
                                 wgmma's A fragment, no shared round trip, x's K
                                 reordered by one copy: kernels/int4_fragment.py), not
                                 yet timed
    CUDA, M <= GEMM_ROWS (128),  kernels/int4_gemm.w4a16_matmul: the older tl.dot kernel (K
    FLASHPAGE_INT4_KERNEL=gemm   tiles of 16 at least, else as below). Opt-in: on the H200
    (or 1)                       (run 165) slower than dequantize + cuBLAS at 1-64 rows
    CUDA otherwise, or           the weight dequantized to x's dtype by one kernel, then
    FLASHPAGE_INT4_KERNEL=       cuBLAS: 4-bit memory, but each call writes and reads the
    dequant (or 0)               16-bit weight (0.3-0.6x the bf16 GEMM's speed at 1-64 rows,
                                 1.3-1.8x its time at 256-1,024, run 165)
    elsewhere (CPU)              the weight dequantized in torch, then F.linear (correct,
                                 rebuilt every call)

An MLP's down projection at one row takes the gate/up output itself (``fuses_silu_mul``;
layers/linear.py ``_silu_mul_base``): the GEMV computes silu(gate) * up per K tile on the
fly, so SiLU·mul's own kernel and its [1, K] round trip are gone (at 8-16 rows the fused
form was slower, run 175). With FLASHPAGE_INT4_FUSED_NORM=1 the RMSNorm before qkv and
gate/up moves into their GEMV's prologue at one row too (``fuses_norm``; models/common.
PreNormDecoderLayer hands the norm over unevaluated), and FLASHPAGE_PDL=all launches the
GEMV with PDL (kernels/pdl.py): both off by default, the pair cost the 8B's batch-1 decode
15% on the H200 (run 179).

The choice reads only shapes and one environment variable (no tensor values, no device
query): cheap per linear per step, and the same at every replay of a captured CUDA graph.
GEMV_ROWS is the most rows the GEMV takes (run 175: still 2x dequantize + cuBLAS's speed at
64; not timed past it); benchmarks/int4_gemv.py times it against the other paths.
GEMM_MAX_ROWS is the most the swapped GEMM takes: run 196's sweep (benchmarks/int4_gemm.py
--sweep, both at 64-2048 rows) had it ahead of dequantize + cuBLAS on all four 8B shapes up
to 256 rows and behind from 512 on qkv / o_proj / gate_up (level on down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpage import envs

# Rows up to which CUDA runs the int4 GEMV by default (the swapped GEMM above)
GEMV_ROWS = 64
# Rows up to which CUDA runs the swapped W4A16 GEMM by default (dequantize + cuBLAS above;
# run 196's sweep)
GEMM_MAX_ROWS = 256
# Rows at which an int4 down projection runs SiLU·mul inside the GEMV
FUSED_SILU_ROWS = 1
# Rows up to which FLASHPAGE_INT4_KERNEL=gemm runs the tl.dot W4A16 kernel (not tuned)
GEMM_ROWS = 128


def cuda_path(m: int, k: int, g: int) -> str:
    """The CUDA path of an M-row call of a K-wide weight in groups of G: "gemv", "swap" (the
    swapped GEMM, w4a16_gemm), "gemm" (the older tl.dot kernel) or "dequant" (dequantize +
    cuBLAS); see the module's docstring."""
    from flashpage.kernels import int4_gemm, int4_gemv

    choice = envs.int4_kernel()
    if choice == "dequant":
        return "dequant"
    if choice == "gemm":
        return "gemm" if m <= GEMM_ROWS and int4_gemm.kernel_supports(k, g) else "dequant"
    if m <= GEMV_ROWS and int4_gemv.supports(m, k, g):
        return "gemv"
    return "swap" if m <= GEMM_MAX_ROWS and int4_gemm.gemm_supports(k, g) else "dequant"


def fuses_silu_mul(shape: tuple[int, ...], dtype: torch.dtype, cuda: bool, k: int,
                   g: int) -> bool:
    """Whether an int4 down projection (K-wide weight, groups of G) takes the MLP's gate/up
    output h (``shape`` [M, 2K], ``dtype``, on CUDA or not) itself: the int4 GEMV with its
    SiLU·mul prologue, one kernel where the unfused path runs SiLU·mul and then the GEMV;
    at one row only (H200, run 175: 8-16 rows fused took 1.1-1.5x the unfused pair).
    Where ``int4_linear`` would run the GEMV (CUDA, M <= GEMV_ROWS, FLASHPAGE_INT4_KERNEL
    not gemm / dequant); like ``cuda_path``, no tensor values and no device query."""
    return (cuda and len(shape) == 2 and shape[0] == FUSED_SILU_ROWS and shape[1] == 2 * k
            and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and cuda_path(shape[0], k, g) == "gemv")


def fuses_norm(shape: tuple[int, ...], dtype: torch.dtype, cuda: bool, k: int, g: int) -> bool:
    """Whether an int4 linear (K-wide weight, groups of G) computes the RMSNorm before it
    in its GEMV's prologue at a ``shape`` [1, K] step (kernels/int4_gemv ``norm=``, the
    one-row chain form; layers/linear.py ``fuses_norm``): one row on CUDA where
    ``int4_linear`` would run the GEMV, and FLASHPAGE_INT4_FUSED_NORM=1 (off by default: see
    envs.int4_fused_norm); like ``cuda_path``, no tensor values."""
    return (cuda and len(shape) == 2 and shape[0] == 1 and shape[1] == k
            and dtype in (torch.float16, torch.bfloat16, torch.float32)
            and envs.int4_fused_norm() and cuda_path(1, k, g) == "gemv")


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] through the int4 weight (see the module's docstring). The
    kernels' module (and Triton, an optional dependency) is imported at the first call."""
    from flashpage.kernels.int4_gemm import PACK, dequantize_int4_ref

    k = qweight.shape[1] * PACK
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.is_cuda and x2.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from flashpage.kernels.int4_gemm import dequantize_int4, w4a16_gemm, w4a16_matmul
        from flashpage.kernels.int4_gemv import int4_gemv

        path = cuda_path(x2.shape[0], k, k // scales.shape[1])
        if path == "gemv":
            y = int4_gemv(x2, qweight, scales, zeros, bias)
        elif path == "swap":
            y = w4a16_gemm(x2, qweight, scales, zeros, bias)
        elif path == "gemm":
            y = w4a16_matmul(x2, qweight, scales, zeros, bias)
        else:
            y = F.linear(x2, dequantize_int4(qweight, scales, zeros, x2.dtype), bias)
    else:
        y = F.linear(x2, dequantize_int4_ref(qweight, scales, zeros, x2.dtype), bias)
    return y.view(*lead, qweight.shape[0])


def int4_linears(model: nn.Module) -> list[str]:
    """Names of the linears of ``model`` that hold int4 weights (tests, reports)."""
    return [name for name, m in model.named_modules()
            if getattr(m, "w4_scales", None) is not None]
