"""The attention layer a model composes: heads, scale and cache, with the math in a backend."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from flashpage.attention.backend import AttentionBackend, AttentionMetadata
    from flashpage.layers.alibi import AlibiSlopes
    from flashpage.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Paged attention over ``kv_cache`` (bound by the model runner once the cache exists).

    q [N, Hq*D], k/v [N, Hkv*D] -> [N, Hq*D]. The backend writes this step's K/V to the
    cache first, then attends over the whole context through the block tables.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 layer_idx: int, sliding_window: int | None = None,
                 softcap: float | None = None, alibi: AlibiSlopes | None = None,
                 sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        # this layer's own window (Gemma 2/3 alternate windowed and global layers)
        self.sliding_window = sliding_window
        self.softcap = softcap  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
        # ALiBi (Bloom, MPT, Falcon-RW): scores + slopes[h] * (j - i); the model's one
        # AlibiSlopes module, shared by all its attention layers (layers/alibi.py)
        if alibi is not None and alibi.slopes.shape != (num_heads,):
            raise ValueError(f"ALiBi slopes {tuple(alibi.slopes.shape)} for {num_heads} query heads")
        self.alibi = alibi
        # attention sinks (GPT-OSS): head h's learned logit in its softmax denominator, the
        # owning module's fp32 [num_heads] parameter (kernels/sinks.py); not a submodule
        # here, so the checkpoint's name stays the owner's
        if sinks is not None and sinks.shape != (num_heads,):
            raise ValueError(f"sinks {tuple(sinks.shape)} for {num_heads} query heads")
        self._sinks = [sinks] if sinks is not None else []
        # chunked local attention (Llama 4): a query at p sees keys j <= p with
        # j // chunk_size == p // chunk_size
        self.chunk_size = chunk_size
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.backend: AttentionBackend | None = None
        # its KV cache group (kv_cache/hybrid.py; the model runner sets it): the step's
        # metadata.groups[kv_group] holds its block tables and slot mapping
        self.kv_group = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata, *, positions: torch.Tensor | None = None,
                rotary: RotaryEmbedding | None = None) -> torch.Tensor:
        """With ``rotary``, q and k are rotated here first: by the fused rotary + cache-write
        kernel when the rotary layer runs our kernels (then the backend writes nothing)."""
        if self.kv_cache is None or self.backend is None:
            raise RuntimeError("attention layer used before the model runner bound its KV cache")
        if metadata.groups is not None:
            metadata = metadata.groups[self.kv_group]
        n = q.shape[0]
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        write_kv = True
        if rotary is not None:
            assert positions is not None
            if rotary.fused:
                from flashpage.kernels.rotary import rotary_and_cache_write

                # q and k stay strided views of the fused projection: the kernels take
                # strides, and a copy of each would cost two more kernels per layer.
                key_cache, value_cache = self.kv_cache
                # (M-RoPE's 3-D positions: per-token rows, layers/rotary.MRotaryEmbedding)
                pos, table = rotary.table(positions)
                rotary_and_cache_write(pos, q, k, v, table, key_cache,
                                       value_cache, metadata.slot_mapping[:n], rotary.is_neox)
                write_kv = False
            else:
                q, k = rotary(positions, q, k)
        if metadata.split is not None:  # a piecewise graph's boundary (engine/cuda_graph.py)
            out = metadata.split(functools.partial(self._core, write_kv=write_kv), (q, k, v), tuple(q.shape))
        else:
            out = self._core(metadata, q, k, v, write_kv=write_kv)
        return out.reshape(n, self.num_heads * self.head_dim)

    def _core(self, md: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              write_kv: bool) -> torch.Tensor:
        """The backend's attention (and cache write unless ``write_kv`` is False)."""
        assert self.backend is not None and self.kv_cache is not None
        if md.groups is not None:  # a piecewise graph's replay hands over the step's first
            md = md.groups[self.kv_group]
        out = self.backend.forward(q, k, v, self.kv_cache, md, scale=self.scale,
                                   sliding_window=self.sliding_window, softcap=self.softcap,
                                   alibi_slopes=None if self.alibi is None else self.alibi.slopes,
                                   write_kv=write_kv, sinks=self.sinks,
                                   **({} if self.chunk_size is None else
                                      {"chunk_size": self.chunk_size}))
        if md.bidirectional:  # images attended within both ways (Gemma 3): their rows again
            from flashpage.attention.bidirectional import attend_within_images

            rows = out.view(q.shape[0], self.num_heads, self.head_dim)
            attend_within_images(rows, q, self.kv_cache, md, scale=self.scale,
                                 sliding_window=self.sliding_window, softcap=self.softcap,
                                 sinks=self.sinks)
        return out

    @property
    def sinks(self) -> torch.Tensor | None:
        return self._sinks[0] if self._sinks else None
