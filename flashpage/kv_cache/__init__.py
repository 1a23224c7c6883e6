"""Paged KV cache bookkeeping: blocks, free queue, ref counts, block tables, prefix sharing.

Pure Python; knows nothing of tensors (see docs/architecture.md, "The KV cache").
"""

from flashpage.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from flashpage.kv_cache.kv_cache_manager import (
    KVCacheManager,
    KVCacheStats,
    slot_mapping_for,
    validate_block_size,
)
from flashpage.kv_cache.prefix_cache import hash_block_tokens
from flashpage.kv_cache.spec import KVCacheSpec

__all__ = [
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheStats",
    "hash_block_tokens",
    "slot_mapping_for",
    "validate_block_size",
]
