"""Dynamic per-token FP8 quantization of activations, the first half of a W8A8 linear
(layers/quant.scaled_mm_linear): x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]) with

    scale[m] = max(amax_k |x[m, k]| / 448, 1e-12)
    q[m, k]  = e4m3(clamp(x[m, k] / scale[m], -448, 448))     (round to nearest even)

one program per row, in one launch: the same sequence in torch ops is ~7 kernels per linear
(a cast, abs, amax, the scale, the division, clamp, the cast), which at decode batches cost
more than the GEMM after it. The row is read twice (its amax, then its values: the second
read from L2); divisions round as IEEE (``div_rn``), so the result equals the torch
reference bit for bit. No host sync, fixed grid per M: safe in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
MIN_SCALE = 1e-12
BLOCK_K = 2048


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                       FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_row + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def check_activations(x: torch.Tensor) -> None:
    """A quantizer's input: [M, K], fp16 / bf16 / fp32, rows contiguous (else ValueError)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} unsupported (float16, bfloat16, float32)")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous in its last dimension")


def quantize_per_token(x: torch.Tensor, block_k: int = BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp16, bf16 or fp32; rows contiguous) -> (float8_e4m3fn [M, K],
    fp32 [M, 1])."""
    check_activations(x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(block_k, max(16, triton.next_power_of_2(k)))
        _quant_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                 FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK_K=block,
                                 num_warps=4 if block <= 1024 else 8)
    return q, scale


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch (layers/quant.quantize_fp8_per_token is this function)."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)  # IEEE division, as the kernel (layers/quant.py says why)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
