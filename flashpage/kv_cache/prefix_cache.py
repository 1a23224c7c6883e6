"""Chained block hashes and the longest-prefix lookup.

Block ``i`` of a request (token positions ``[i*B, (i+1)*B)``), once full, has the hash

    h_i = blake2b-128( h_{i-1} || little-endian int64 token ids of block i ),  h_{-1} = ROOT

so equal prefixes give equal hashes and a block's hash depends on everything before it.
The hash only finds a candidate: a hit is taken only if the cached block's token ids
equal the request's AND its parent content id equals the content id of the block matched
just before (see ``KVCacheBlock.content_id``). By induction a hit block's whole prefix is
equal to the request's, so even a hash collision can never hand over someone else's K/V.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from flashpage.kv_cache.block_pool import BlockPool, KVCacheBlock

ROOT_HASH = b"flashpage-root-0"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """16-byte chained hash of one full block (stable across runs and processes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(ROOT_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def update_block_hashes(block_hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_blocks: int) -> list[bytes]:
    """Extend ``block_hashes`` in place to cover the first ``num_blocks`` full blocks."""
    for i in range(len(block_hashes), num_blocks):
        parent = block_hashes[i - 1] if i else None
        # A module global, looked up at call time: tests monkeypatch it to force collisions.
        block_hashes.append(
            hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        )
    return block_hashes


def find_longest_cache_hit(pool: BlockPool, block_hashes: Sequence[bytes],
                           token_ids: Sequence[int], block_size: int,
                           max_blocks: int) -> list[KVCacheBlock]:
    """The cached blocks holding the longest prefix of ``token_ids`` (at most ``max_blocks``)."""
    hits: list[KVCacheBlock] = []
    parent_cid: int | None = None
    cached = pool.cached
    for i in range(max_blocks):
        b = cached.get(block_hashes[i])
        if b is None or b.parent_cid != parent_cid:
            break
        if b.token_ids != tuple(token_ids[i * block_size:(i + 1) * block_size]):
            break
        hits.append(b)
        parent_cid = b.content_id
    return hits
