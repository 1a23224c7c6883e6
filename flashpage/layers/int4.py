"""Linears whose weights stay 4-bit: an AWQ or GPTQ checkpoint's (models/int4_checkpoint.py),
held in our one int4 layout (kernels/int4_gemm.py): ``weight`` int32 [N, K/8] (the name
kept so merged linears load their pieces' rows as any weight), ``w4_scales`` [N, K/G] and
``w4_zeros`` uint8 [N, K/G] beside it (``_ParallelLinear.hold_int4``). A quarter of the
bytes of a bf16 weight, plus 2.5 bytes per group of G values (~0.5 byte per 128-group).

How a call of M rows runs (``int4_linear``):

    CUDA, M <= GEMM_ROWS,      kernels/int4_gemm.w4a16_matmul: nibbles unpacked in
    FLASHPAGE_INT4_KERNEL=1    registers, tl.dot in fp32, each group's scale and zero
                               on the partial sums (K split to fill the GPU); K tiles
                               under 16 wide: as below. Off by default: on the H200 (run
                               165) slower than the path below and wrong in a few elements
    CUDA otherwise             the weight dequantized to x's dtype by one kernel, then
                               cuBLAS: 4-bit memory, but each call writes and reads the
                               16-bit weight (0.3-0.6x the bf16 GEMM's speed at 1-64 rows)
    elsewhere (CPU)            the weight dequantized in torch, then F.linear (correct,
                               rebuilt every call)

The threshold is a first guess, not a measurement: benchmarks/int4_gemm.py times both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpage import envs

# Rows up to which CUDA runs the W4A16 kernel, dequantize + cuBLAS above (not yet tuned)
GEMM_ROWS = 128


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] through the int4 weight (see the module's docstring). The
    kernels' module (and Triton, an optional dependency) is imported at the first call."""
    from flashpage.kernels.int4_gemm import PACK, dequantize_int4_ref

    k = qweight.shape[1] * PACK
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.is_cuda and x2.dtype in (torch.float16, torch.bfloat16, torch.float32):
        from flashpage.kernels.int4_gemm import dequantize_int4, kernel_supports, w4a16_matmul

        if x2.shape[0] <= GEMM_ROWS and envs.int4_kernel() and kernel_supports(k, k // scales.shape[1]):
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
