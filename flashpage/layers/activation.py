"""SiLU(gate) * up on a merged [.., 2*I] input."""

from __future__ import annotations

import torch

from flashpage.layers import ops


class SiluAndMul(ops.FusedOpsModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x, fused=self.fused)
