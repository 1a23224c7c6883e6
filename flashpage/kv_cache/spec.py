"""Per-layer KV cache shape: what one block costs, and how many fit in a memory budget.

MHA / MQA / GQA, one pair of tensors per attention layer::

    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_dim]

MLA (DeepSeek-V2/V3), one tensor per layer (latent c_kv first, then rope'd k_pe)::

    kv_cache : [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashpage.kv_cache.kv_cache_manager import validate_block_size

if TYPE_CHECKING:
    from flashpage.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    num_layers: int
    dtype_bytes: int
    num_kv_heads: int = 0  # MHA/GQA
    head_dim: int = 0  # MHA/GQA
    latent_dim: int = 0  # MLA: kv_lora_rank + qk_rope_head_dim

    def __post_init__(self) -> None:
        validate_block_size(self.block_size)
        if self.num_layers < 1 or self.dtype_bytes < 1:
            raise ValueError("num_layers and dtype_bytes must be >= 1")
        if self.is_mla == bool(self.num_kv_heads and self.head_dim):
            raise ValueError("give either latent_dim (MLA) or num_kv_heads and head_dim")

    @property
    def is_mla(self) -> bool:
        return self.latent_dim > 0

    @staticmethod
    def from_model_config(cfg: ModelConfig, block_size: int, dtype: str) -> KVCacheSpec:
        from flashpage.config import dtype_bytes

        nbytes = dtype_bytes(dtype)
        if cfg.is_mla:
            assert cfg.kv_lora_rank is not None
            return KVCacheSpec(block_size, cfg.num_hidden_layers, nbytes,
                               latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return KVCacheSpec(block_size, cfg.num_hidden_layers, nbytes,
                           num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)

    def layer_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        """Shapes of the tensors of ONE layer: [key, value] or [latent]."""
        if self.is_mla:
            return [(num_blocks, self.block_size, self.latent_dim)]
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [shape, shape]

    @property
    def values_per_token_per_layer(self) -> int:
        return self.latent_dim if self.is_mla else 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """All layers together."""
        return (self.values_per_token_per_layer * self.block_size * self.dtype_bytes
                * self.num_layers)

    def num_blocks_for(self, memory_bytes: int) -> int:
        return max(0, memory_bytes // self.bytes_per_block)
