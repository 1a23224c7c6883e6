"""Chained block hashes and the longest-prefix lookup.

Block ``i`` of a request (token positions ``[i*B, (i+1)*B)``), once full, has the hash

    h_i = first 16 bytes of blake2b( h_{i-1} || little-endian int64 ids of block i ),  h_{-1} = ROOT

(128 bits of blake2b-512; the ``digest_size=16`` variant is 2x slower to call in CPython)

so equal prefixes give equal hashes and a block's hash depends on everything before it.
A request with a LoRA adapter starts its chain from ``cache_root(lora_int_id)`` instead
(its own ROOT, and its first block's parent content id ``-lora_int_id``): K/V computed
under one adapter is never found by a request under another, or under none. A request
with a ``cache_salt`` (vLLM's: tenants that must not learn from each other's cache
timing) roots its chain in the salt too (its first block's parent id the pair
``(lora_int_id, salt)``): nothing is shared across salts, or with unsalted requests.
The hash only finds a candidate: a hit is taken only if the cached block's token ids
equal the request's AND its parent content id equals the content id of the block matched
just before (see ``KVCacheBlock.content_id``). By induction a hit block's whole prefix is
equal to the request's, so even a hash collision can never hand over someone else's K/V.

Rows the token ids do not say (a prompt given as embeddings, an image's rows: their
placeholder ids are all alike) splice the digest of those rows into the chain at the block
where they begin (``Splice``: that block's index and the digest, from ``chain``): block k's
parent hash becomes ``splice_hash(h_{k-1}, digest)`` and its parent content id
``splice_cid(cid_{k-1}, digest)``, compared exactly as any parent id. The blocks before k are
the plain text chain, so a system prompt before an image is shared with text-only
requests (vLLM's way: each input's hash in the blocks it overlaps), and everything from k on
only with requests whose rows have the same digest at the same positions. A prompt given as
embeddings splices at block 0.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from flashpage.kv_cache.block_pool import BlockPool, KVCacheBlock

ROOT_HASH = b"flashpage-root-0"


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """16-byte chained hash of one full block (stable across runs and processes)."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b((ROOT_HASH if parent_hash is None else parent_hash) + data).digest()[:16]


_default_hash = hash_block_tokens


# A chain's root parent id: None (the base model), -lora_int_id or (lora_int_id, salt); a
# spliced block's parent id ("splice", the block before's content id or the root's, digest)
RootId = int | tuple[int, str] | tuple[str, object, bytes] | None
# (the block index where rows the ids do not say begin, their digest) or None
Splice = tuple[int, bytes] | None


class _Chained(Protocol):
    """A cached block as a chain sees it (KVCacheBlock, host_cache.HostBlock)."""

    token_ids: tuple[int, ...] | None
    content_id: int | None
    parent_cid: RootId


_Link = TypeVar("_Link", bound=_Chained)


def cache_root(lora_int_id: int, cache_salt: str | None = None) -> tuple[bytes | None, RootId]:
    """(the chain's root hash, the root's parent content id) for requests under a LoRA
    adapter id (0: the base model, whose root is ROOT_HASH and parent None) and a cache
    salt. Content ids are positive, so ``-lora_int_id`` never equals a real block's, nor
    does a (lora_int_id, salt) pair: roots compare exactly, never by hash alone."""
    if cache_salt is None:
        if not lora_int_id:
            return None, None
        return hashlib.blake2b(ROOT_HASH + b"lora" + struct.pack("<q", lora_int_id)).digest()[:16], \
            -lora_int_id
    return hashlib.blake2b(ROOT_HASH + b"lora" + struct.pack("<q", lora_int_id) + b"salt"
                           + cache_salt.encode("utf-8")).digest()[:16], (lora_int_id, cache_salt)


def splice_hash(parent_hash: bytes | None, digest: bytes) -> bytes:
    """The parent hash a spliced block chains from (module docstring)."""
    return hashlib.blake2b((ROOT_HASH if parent_hash is None else parent_hash) + b"splice"
                           + digest).digest()[:16]


def splice_cid(parent_cid: RootId, digest: bytes) -> RootId:
    """The parent content id a spliced block hangs off: never a block's (those are ints)
    nor a root's."""
    return ("splice", parent_cid, digest)


def chain(lora_int_id: int, cache_salt: str | None, embeds_digest: bytes | None, embeds_start: int,
          block_size: int) -> tuple[bytes | None, RootId, Splice]:
    """A request's chain: ``cache_root``'s pair and its splice (None without rows the ids
    do not say; ``embeds_start``: the first such row's position)."""
    root, root_cid = cache_root(lora_int_id, cache_salt)
    return root, root_cid, None if embeds_digest is None else (embeds_start // block_size, embeds_digest)


def _pack_le(token_ids: Sequence[int]) -> bytes:
    a = array("q", token_ids)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def update_block_hashes(block_hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_blocks: int, root: bytes | None = None, splice: Splice = None) -> list[bytes]:
    """Extend ``block_hashes`` in place to cover the first ``num_blocks`` full blocks
    (``root``: the chain's root, ``cache_root``'s; None: ROOT_HASH; ``splice``: ``chain``'s)."""
    start = len(block_hashes)
    if start >= num_blocks:
        return block_hashes
    B = block_size
    at, digest = splice if splice is not None else (-1, b"")
    if hash_block_tokens is _default_hash:
        # Same bytes as hash_block_tokens, packed once for all blocks (~4x faster).
        data = _pack_le(token_ids[start * B:num_blocks * B])
        step = 8 * B
        parent = block_hashes[start - 1] if start else (root or ROOT_HASH)
        blake2b = hashlib.blake2b
        for i, off in enumerate(range(0, len(data), step), start):
            if i == at:
                parent = splice_hash(parent, digest)
            parent = blake2b(parent + data[off:off + step]).digest()[:16]
            block_hashes.append(parent)
        return block_hashes
    # A replaced hash function (tests force collisions this way): call it per block.
    for i in range(start, num_blocks):
        parent_hash = block_hashes[i - 1] if i else root
        if i == at:
            parent_hash = splice_hash(parent_hash, digest)
        block_hashes.append(hash_block_tokens(parent_hash, token_ids[i * B:(i + 1) * B]))
    return block_hashes


def find_longest_cache_hit(pool: BlockPool, block_hashes: Sequence[bytes],
                           token_ids: Sequence[int], block_size: int,
                           max_blocks: int, root_cid: RootId = None, splice: Splice = None) -> list[KVCacheBlock]:
    """The cached blocks holding the longest prefix of ``token_ids`` (at most ``max_blocks``;
    ``root_cid``: the first block's parent content id, ``cache_root``'s; ``splice``:
    ``chain``'s)."""
    return chain_hits(pool.cached, block_hashes, token_ids, block_size, 0, max_blocks, root_cid, splice)


def expected_parent(i: int, cid: RootId, splice: Splice) -> RootId:
    """The parent content id block ``i`` must have after a block (or root) of content id
    ``cid``."""
    return splice_cid(cid, splice[1]) if splice is not None and i == splice[0] else cid


def chain_hits(cached: Mapping[bytes, _Link], block_hashes: Sequence[bytes], token_ids: Sequence[int],
               block_size: int, start: int, stop: int, parent_cid: RootId,
               splice: Splice = None) -> list[_Link]:
    """Walk a hash -> block map from block ``start`` (its parent's content id
    ``parent_cid``, before ``splice``) while each next block is there, hangs off the one
    before (its ``parent_cid``) and holds the request's very tokens: the GPU pool's cache
    and the host tier's (kv_cache/host_cache.py) alike."""
    hits: list[_Link] = []
    for i in range(start, stop):
        parent_cid = expected_parent(i, parent_cid, splice)
        b = cached.get(block_hashes[i])
        if b is None or b.parent_cid != parent_cid:
            break
        if b.token_ids != tuple(token_ids[i * block_size:(i + 1) * block_size]):
            break
        hits.append(b)
        parent_cid = b.content_id
    return hits
