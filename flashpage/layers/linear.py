"""Linear layers shaped for tensor parallelism (world size 1 today).

A column-parallel layer splits its output features across ranks, a row-parallel one
its input features (followed by an all-reduce). With ``tp_size == 1`` both are plain
linears; the split lives in ``weight_loader`` so checkpoints load unchanged when a
world size > 1 arrives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _ParallelLinear(nn.Module):
    split_dim: int = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        shape = [out_features, in_features]
        if shape[self.split_dim] % tp_size:
            raise ValueError(f"dimension {shape[self.split_dim]} is not divisible by tp_size {tp_size}")
        shape[self.split_dim] //= tp_size
        self.weight = nn.Parameter(torch.empty(shape))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            n = shape[0]
            self.bias = nn.Parameter(torch.empty(n))
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        dim = self.split_dim if param.dim() > 1 or self.split_dim == 0 else None
        if dim is not None and self.tp_size > 1:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_ParallelLinear):
    split_dim = 0


class RowParallelLinear(_ParallelLinear):
    split_dim = 1
    # With tp_size > 1 the forward would all-reduce its partial sums here.


class VocabEmbedding(nn.Module):
    """Token embedding (vocab-parallel later); ``weight`` keeps HF's name."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
