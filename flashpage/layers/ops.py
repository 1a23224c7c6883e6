"""Small ops with two implementations: plain PyTorch, and our fused Triton kernels.

The model layers call these functions; which implementation runs is decided once,
per process, by :func:`set_fused_ops` (the engine turns the Triton path on when its
attention backend is ``triton`` on a CUDA device). The torch path follows HF Llama's
arithmetic exactly, so fp32 outputs equal transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_use_triton = False


def set_fused_ops(enabled: bool) -> None:
    """Use the Triton kernels for CUDA tensors (True) or plain PyTorch everywhere (False)."""
    global _use_triton
    _use_triton = enabled


def fused_ops_enabled() -> bool:
    return _use_triton


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if _use_triton and x.is_cuda:
        from flashpage.kernels.rms_norm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _use_triton and x.is_cuda:
        from flashpage.kernels.silu_mul import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
