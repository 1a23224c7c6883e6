"""The gated MLP of Llama-family layers, DeepSeek's dense layers and shared experts
(SiLU) and Gemma's (GELU-tanh): down(act(gate(x)) * up(x)), with gate and up merged into
one linear; and the plain one (``MLP``: Starcoder2's c_fc -> GELU -> c_proj, with biases;
OPT's fc1 -> ReLU -> fc2)."""

from __future__ import annotations

import torch
from torch import nn

from flashpage.layers.activation import GeluTanhAndMul, PlainActivation, SiluAndMul
from flashpage.layers.linear import ColumnParallelLinear, PendingNorm, RowParallelLinear


class GatedMLP(nn.Module):
    """``gate_up_proj`` [2I, H] holds HF's gate_proj rows, then up_proj's: one GEMM (or one
    GEMV at a one-row step) instead of two, and SiLU·mul reads its [N, 2I] output without a
    copy (or, at one row, the down projection computes it on the fly).

    A state dict in HF's names (``gate_proj.weight``, ``up_proj.weight``) loads too: the
    two are stacked on load (``_load_from_state_dict``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"GatedMLP: activation {act!r} is not one of silu, gelu_pytorch_tanh")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, 2 * intermediate_size)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        # SiLU only: the GEMVs can compute silu(gate) * up in the down projection's prologue
        self.down_proj.silu_input = act == "silu"
        self.act: SiluAndMul | GeluTanhAndMul = SiluAndMul() if act == "silu" else GeluTanhAndMul()

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        h = self.gate_up_proj(x)
        # one kernel at one-row (or tuned) steps, int4: 1-16 rows
        y = self.down_proj.silu_mul_forward(h) if self.down_proj.silu_input else None
        return y if y is not None else self.down_proj(self.act(h))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        gate, up = f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"
        if gate in state_dict and up in state_dict:
            state_dict[f"{prefix}gate_up_proj.weight"] = torch.cat(
                [state_dict.pop(gate), state_dict.pop(up)], dim=0)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class MLP(nn.Module):
    """The non-gated MLP (Starcoder2, HF's names): ``c_proj(act(c_fc(x)))``, c_fc [I, H] and
    c_proj [H, I], each with a bias unless ``bias`` is False; ``act`` a GELU (or OPT's ReLU)
    by HF's hidden_act name (layers/activation.PLAIN_ACTIVATIONS)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str,
                 bias: bool = True) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.c_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act = PlainActivation(act)

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))
