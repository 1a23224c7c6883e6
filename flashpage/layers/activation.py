"""The gated MLP activations on a merged [.., 2*I] input: act(gate) * up; and the plain
ones of non-gated MLPs (Starcoder2's, GPT-2's c_fc -> act -> c_proj, OPT's fc1 -> ReLU ->
fc2), by HF's ``hidden_act`` name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

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


_GELU_TANH = partial(F.gelu, approximate="tanh")
# HF hidden_act -> the function (transformers' ACT2FN: "gelu" is the exact erf GELU,
# "gelu_pytorch_tanh" torch's tanh approximation; "gelu_new" (Phi) and "gelu_fast"
# (GPT-NeoX-20B) the same tanh formula written out in torch ops, equal up to rounding;
# "relu" OPT's; "relu2" Arcee's ReLU squared, relu(x) ** 2 (transformers' ReLUSquaredActivation)
PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": _GELU_TANH, "gelu": F.gelu, "gelu_new": _GELU_TANH,
    "gelu_fast": _GELU_TANH, "relu": F.relu, "relu2": lambda x: torch.square(F.relu(x))}


class PlainActivation(nn.Module):
    """A non-gated MLP's activation on its own (plain PyTorch: one elementwise kernel,
    nothing to fuse it with)."""

    def __init__(self, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in PLAIN_ACTIVATIONS:
            raise ValueError(f"activation {hidden_act!r} is not one of "
                             f"{', '.join(PLAIN_ACTIVATIONS)}")
        self.hidden_act = hidden_act
        self.fn = PLAIN_ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class XIELU(nn.Module):
    """xIELU (Apertus's MLP activation, arXiv 2411.13010; transformers' XIELUActivation,
    its Python form): learned ``alpha_p`` / ``alpha_n`` (stored before their softplus, [1]
    each) and constant ``beta`` / ``eps`` (buffers the checkpoint holds)::

        x > 0:  softplus(alpha_p) x^2 + beta x
        x <= 0: (expm1(min(x, eps)) - x) (beta + softplus(alpha_n)) + beta x
    """

    beta: torch.Tensor
    eps: torch.Tensor

    def __init__(self, alpha_p: float = 0.8, alpha_n: float = 0.8, beta: float = 0.5,
                 eps: float = -1e-6) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.tensor([alpha_p]).expm1().log())
        self.alpha_n = nn.Parameter(torch.tensor([alpha_n - beta]).expm1().log())
        self.register_buffer("beta", torch.tensor(beta))
        self.register_buffer("eps", torch.tensor(eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)
