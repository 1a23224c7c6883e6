"""Physical KV blocks, the free queue (whose order is the eviction order) and ref counts.

Pure Python, no tensors: a block is an id into the cache tensors
``[num_blocks, block_size, ...]``; the engine owns the memory.

Free queue order (head is reused first)::

    head -> [blocks holding nothing reusable] ... [cached blocks, least recently freed first] <- tail

* A freed block with a prefix-cache hash goes to the TAIL (kept as long as possible:
  LRU eviction).
* A freed block without a hash (a partial block, a duplicate, or prefix caching off)
  goes to the HEAD: it holds nothing worth keeping, so it is reused before any cached
  block is evicted.
* A fresh allocation pops the HEAD; if that block held a hash, the hash is evicted.
* Touching a cached free block (a prefix hit, ref 0 -> 1) removes it from the middle of
  the queue in O(1) (doubly linked list).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashpage.kv_cache.prefix_cache import RootId


class KVCacheBlock:
    """One physical block. ``ref_cnt`` = number of requests whose block table holds it.

    Prefix-cache fields (None while the block is not full / not registered):
      block_hash  -- key in the prefix cache map; set iff ``map[block_hash] is self``.
      token_ids   -- the ``block_size`` token ids it holds (checked on every hit).
      content_id  -- identity of the block's whole prefix (its tokens and all before):
                     equal content ids => equal K/V. Never reused after eviction.
      parent_cid  -- content id of the previous block of the prefix (None for block 0).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "content_id",
                 "parent_cid", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.content_id: int | None = None
        self.parent_cid: RootId = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def reset_content(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.content_id = None
        self.parent_cid = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append, appendleft, remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels: no None checks on the hot path.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVCacheBlock:
        b = self._head.next_free
        if b is self._tail or b is None:
            raise IndexError("no free blocks")
        self.remove(b)
        return b

    def append(self, b: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        self.num_free += 1

    def appendleft(self, b: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        first.prev_free = b
        b.next_free = first
        b.prev_free = self._head
        self._head.next_free = b
        self.num_free += 1

    def remove(self, b: KVCacheBlock) -> None:
        prev, nxt = b.prev_free, b.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {b.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def __contains__(self, b: KVCacheBlock) -> bool:
        return b.prev_free is not None

    def block_ids(self) -> list[int]:
        """Ids head to tail (tests and debugging; O(n))."""
        out = []
        b = self._head.next_free
        while b is not None and b is not self._tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class BlockPool:
    """All blocks, the free queue, ref counts and the prefix-cache map ``hash -> block``."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self._next_content_id = 0
        self.num_evictions = 0
        # Called with each findable block get_new_blocks evicts, before it is cleared (the
        # host tier's HostBlockCache.offer: kv_cache/host_cache.py); None: nobody asks.
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def new_content_id(self) -> int:
        self._next_content_id += 1
        return self._next_content_id

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head of the free queue (evicting their hashes), ref 1."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, only {self.free_queue.num_free} free")
        out = []
        q = self.free_queue
        head = q._head
        cached = self.cached
        on_evict = self.on_evict
        for _ in range(n):  # q.popleft(), inlined: this loop is hot in long prefills
            b = head.next_free
            assert b is not None and b.next_free is not None
            nxt = b.next_free
            head.next_free = nxt
            nxt.prev_free = head
            b.prev_free = b.next_free = None
            if b.content_id is not None:
                if b.block_hash is not None:
                    if on_evict is not None:
                        on_evict(b)
                    del cached[b.block_hash]
                    self.num_evictions += 1
                    b.block_hash = None
                b.token_ids = b.content_id = b.parent_cid = None
            b.ref_cnt = 1
            out.append(b)
        q.num_free -= n
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cached) blocks; a free one leaves the free queue."""
        q = self.free_queue
        for b in blocks:
            if b.ref_cnt == 0:
                q.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each, in the given order (the eviction order among them)."""
        q = self.free_queue
        for b in ordered:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"block {b.block_id} freed more often than taken")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is not None:
                    q.append(b)  # cached: evicted last (LRU)
                else:
                    q.appendleft(b)  # nothing reusable: reused first

    def register(self, block: KVCacheBlock, block_hash: bytes, token_ids: tuple[int, ...],
                 parent_cid: RootId) -> None:
        """Record that ``block`` (full, held by a request) holds ``token_ids`` after the
        prefix identified by ``parent_cid``, and make it findable under ``block_hash``.

        If the map already holds a block with the same content (same tokens, same
        parent content id), ``block`` becomes an unregistered duplicate sharing its
        content id, so later blocks of the same prefix still chain to the canonical one.
        If the map holds a block with different content (a hash collision, or a stale
        block whose parent was evicted), the new block takes the slot.
        """
        block.token_ids = token_ids
        block.parent_cid = parent_cid
        other = self.cached.get(block_hash)
        if other is not None and other.token_ids == token_ids and other.parent_cid == parent_cid:
            block.content_id = other.content_id
            return
        if other is not None:
            other.block_hash = None  # it stays a valid block for its holders, just unfindable
        block.content_id = self.new_content_id()
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def register_loaded(self, block: KVCacheBlock, block_hash: bytes, token_ids: tuple[int, ...],
                        parent_cid: RootId, content_id: int) -> None:
        """As ``register``, for a block filled from the host tier: it keeps the content id
        its content had when it was stored (kv_cache/host_cache.py), so chains registered
        before the eviction still go on from it. If the map holds a block of that content
        already, ``block`` becomes its unregistered duplicate."""
        block.token_ids = token_ids
        block.parent_cid = parent_cid
        block.content_id = content_id
        other = self.cached.get(block_hash)
        if other is not None and other.content_id == content_id:
            return
        if other is not None:
            other.block_hash = None
        block.block_hash = block_hash
        self.cached[block_hash] = block
