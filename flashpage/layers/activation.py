"""The gated MLP activations on a merged [.., 2*I] input: act(gate) * up."""

from __future__ import annotations

import torch

from flashpage.layers import ops


class SiluAndMul(ops.FusedOpsModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x, fused=self.fused)


class GeluTanhAndMul(ops.FusedOpsModule):
    """gelu_pytorch_tanh(gate) * up (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu_tanh_and_mul(x, fused=self.fused)
