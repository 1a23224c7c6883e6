"""The attention layer a model composes: heads, scale and cache, with the math in a backend."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from flashpage.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged attention over ``kv_cache`` (bound by the model runner once the cache exists).

    q [N, Hq*D], k/v [N, Hkv*D] -> [N, Hq*D]. The backend writes this step's K/V to the
    cache first, then attends over the whole context through the block tables.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 layer_idx: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention layer used before the model runner bound its KV cache")
        n = q.shape[0]
        out = self.backend.forward(
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
            self.kv_cache, metadata, scale=self.scale, sliding_window=self.sliding_window)
        return out.view(n, self.num_heads * self.head_dim)
