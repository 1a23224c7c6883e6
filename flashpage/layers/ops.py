"""Small ops with two implementations: plain PyTorch, and our fused Triton kernels.

Each layer that uses one carries ``fused`` (False by default); :func:`set_fused_ops`
sets it on every such module of one model (the engine does so when its attention
backend is ``triton``). Nothing is global: two engines in one process keep their own
choice. The torch path follows HF Llama's arithmetic exactly, so fp32 outputs equal
transformers'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedOpsModule(nn.Module):
    """A layer that can run our Triton kernels instead of plain PyTorch."""

    fused: bool = False


def set_fused_ops(model: nn.Module, enabled: bool) -> None:
    """Use the Triton kernels (True) or plain PyTorch (False) in every layer of ``model``."""
    for m in model.modules():
        if isinstance(m, FusedOpsModule):
            m.fused = enabled


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if fused:
        from flashpage.kernels.rms_norm import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps, residual)
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and dtype != torch.float32:
        out = (h * weight).to(dtype)  # an fp32 weight: Gemma's rounding (layers/norm.py)
    else:
        out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None, fused: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim in fp32, rounded once to x's dtype; weight and bias
    [W] or [heads, W] (a row per head of x [..., heads, W]), either may be None."""
    if fused:
        from flashpage.kernels.layer_norm import layer_norm as layer_norm_kernel

        return layer_norm_kernel(x, weight, bias, eps, residual)
    if residual is not None:
        x = x + residual
        residual = x
    h = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    if weight is not None:
        h = h * weight.float()
    if bias is not None:
        h = h + bias.float()
    out = h.to(x.dtype)
    return out if residual is None else (out, residual)


def silu_and_mul(x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    if fused:
        from flashpage.kernels.silu_mul import silu_and_mul as silu_and_mul_kernel

        return silu_and_mul_kernel(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    if fused:
        from flashpage.kernels.silu_mul import gelu_tanh_and_mul as gelu_tanh_and_mul_kernel

        return gelu_tanh_and_mul_kernel(x)
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]
