"""The gated MLP activations on a merged [.., 2*I] input: act(gate) * up; and the plain
ones of non-gated MLPs (Starcoder2's, GPT-2's c_fc -> act -> c_proj), by HF's ``hidden_act`` name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.layers import ops


class SiluAndMul(ops.FusedOpsModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x, fused=self.fused)


class GeluTanhAndMul(ops.FusedOpsModule):
    """gelu_pytorch_tanh(gate) * up (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gelu_tanh_and_mul(x, fused=self.fused)


# HF hidden_act -> F.gelu's approximate= (transformers' ACT2FN: "gelu" is the exact erf
# GELU, "gelu_pytorch_tanh" torch's tanh approximation; "gelu_new" (Phi) and "gelu_fast"
# (GPT-NeoX-20B) the same tanh formula written out in torch ops, equal up to rounding)
PLAIN_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none", "gelu_new": "tanh",
                     "gelu_fast": "tanh"}


class Gelu(nn.Module):
    """GELU on its own (plain PyTorch: one elementwise kernel, nothing to fuse it with)."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in PLAIN_ACTIVATIONS:
            raise ValueError(f"activation {hidden_act!r} is not one of "
                             f"{', '.join(PLAIN_ACTIVATIONS)}")
        self.approximate = PLAIN_ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate=self.approximate)
