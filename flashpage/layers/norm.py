"""RMSNorm (and Gemma's) and LayerNorm, each optionally fused with the residual add that
precedes it."""

from __future__ import annotations

import torch
from torch import nn

from flashpage.layers import ops
from flashpage.layers.fp32 import KeepFp32


class RMSNorm(ops.FusedOpsModule):
    """``forward(x)`` -> rmsnorm(x) * weight; ``forward(x, residual)`` -> (rmsnorm(x + residual) * weight, x + residual).

    Computed in fp32 and cast back before the weight multiply, as HF Llama does, so
    fp32 and bf16 outputs match transformers bit for bit on the torch path.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, self.weight, self.eps, residual, fused=self.fused)


class GemmaRMSNorm(KeepFp32, RMSNorm):
    """Gemma's RMSNorm: ``weight`` holds 1 + w (the checkpoint's w plus one, models/gemma.py)
    and stays fp32 through ``model.to(dtype)``, and the product is taken in fp32 before the
    one rounding to x's dtype, as HF Gemma computes ``norm(x.float()) * (1 + w.float())``.
    (Rounded to bf16, 1 + w keeps ~8 bits of a small w: the tokens part from HF's.)"""


class LayerNorm(ops.FusedOpsModule):
    """LayerNorm over the last dim: ``(x - mean) / sqrt(var + eps) * weight (+ bias)``, with
    ``forward(x, residual)`` -> (norm(x + residual), x + residual) as RMSNorm's.

    Computed in fp32 and rounded once to x's dtype, as transformers' CohereLayerNorm does
    (and torch's CUDA layer_norm for Starcoder2's nn.LayerNorm). ``shape``: the weight's,
    ending in the normalized dim; a leading dim is per head (Command-R+'s q/k norms hold
    [heads, head_dim] and norm each head of [N, heads, head_dim] over its head_dim).
    ``elementwise_affine=False`` (torch's name): no weight and no bias at all, OLMo (1)'s
    non-parametric norm (``shape`` then only says the normalized width).

    ``fused``: our Triton kernel (kernels/layer_norm.py), the residual add and per-head
    weights included. The GEMV norm prologues (``_ParallelLinear.fuses_norm``) compute
    RMSNorm and never take it."""

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5, bias: bool = True,
                 elementwise_affine: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(shape)) if bias and elementwise_affine else None
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return ops.layer_norm(x, self.weight, self.bias, self.eps, residual, fused=self.fused)
