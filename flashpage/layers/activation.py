"""SiLU(gate) * up on a merged [.., 2*I] input."""

from __future__ import annotations

import torch
from torch import nn

from flashpage.layers import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
