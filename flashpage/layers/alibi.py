"""ALiBi slopes per family, held once per model for its attention layers.

Each query head h gets a slope m_h; attention adds m_h * (j - i) to the score of key j from
query i (kernels/alibi.py). The slopes are a geometric sequence over the heads:

- Bloom, Falcon-RW (transformers' build_alibi_tensor): for n heads with p the largest power
  of two <= n, m_h = 2 ** (-8 (h + 1) / p) for h < p; the n - p heads left take every other
  term of the 2p-head sequence, 2 ** (-4 (2k + 1) / p) for k = 0, 1, ...;
- MPT (build_mpt_alibi_tensor): with P the smallest power of two >= n,
  m_h = 2 ** (-alibi_bias_max (h + 1) / P) (alibi_bias_max 8: Bloom's for a power of two),
  and for n < P the odd terms then the even ones, the first n of them.

Falcon scales its biases with the scores (transformers: (q.k + alibi) / sqrt(head_dim)) and
builds them in bf16: its slopes are rounded to bf16 and divided by sqrt(head_dim) here
(transformers also rounds slope x position to bf16, which for positions past 256 differs
from the exact product by up to a half unit in bf16; not reproduced).

``AlibiSlopes`` keeps them as one fp32 buffer (through ``model.to(dtype)`` too) that every
attention layer of a model shares: the Triton backend plans one kernel call per step for
them (keyed by the buffer's address) and CUDA graphs read it at one address.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.fp32 import KeepFp32


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """transformers' Bloom / Falcon slopes for ``num_heads`` heads, fp32 [num_heads] (the same
    expression, so the values match bit for bit)."""
    p = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(p) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + p, dtype=torch.int32))
    if p != num_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * p) - 3))), dtype=torch.float32)
        left = min(p, num_heads - p)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * left, 2, dtype=torch.int32))])
    return slopes


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's slopes for ``num_heads`` heads and ``alibi_bias_max``, fp32 [num_heads]."""
    p = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, p + 1, dtype=torch.int64).float() * (alibi_bias_max / p)
    slopes = 1.0 / torch.pow(2, base)
    if p != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def alibi_slopes(config: ModelConfig) -> torch.Tensor:
    """The slopes ``config``'s family uses (fp32 [num_attention_heads], on the CPU)."""
    n = config.num_attention_heads
    if config.alibi_bias_max is not None:  # MPT
        return mpt_slopes(n, config.alibi_bias_max)
    slopes = bloom_slopes(n)
    if config.architecture == "FalconForCausalLM":
        # transformers: (q.k + bf16(slope) * j) / sqrt(head_dim)
        slopes = slopes.bfloat16().float() / math.sqrt(config.head_dim)
    return slopes


class AlibiSlopes(KeepFp32, nn.Module):
    """A model's ALiBi slopes: ``slopes`` fp32 [num_heads], a non-persistent buffer (no
    checkpoint holds it) that moves with the model. One instance is handed to every
    attention layer (layers/attention.Attention)."""

    slopes: torch.Tensor

    def __init__(self, slopes: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("slopes", slopes.detach().to(torch.float32).contiguous().clone(),
                             persistent=False)

    @classmethod
    def for_config(cls, config: ModelConfig) -> AlibiSlopes | None:
        """The model's slopes module, or None where ``config.alibi`` is off."""
        return cls(alibi_slopes(config)) if config.alibi else None
