"""The host (CPU) tier of the prefix cache: which host block holds which prefix block.

Pure Python, like the GPU pool: a host block is an id into the engine's host tensor
(engine/kv_offload.py); this module only decides what goes where and in which order
the copies run (vLLM's ``--kv-offloading-size`` with the native backend, SGLang's
HiCache).

Write-back on eviction: when the GPU pool hands out a free block that still held a
findable prefix block (``BlockPool.get_new_blocks``), that block is offered here
(``offer``) and, unless the host already holds the same content, copied to a host block
(a *store*). A request whose prefix misses on the GPU looks the following blocks up here
(``match``); a hit gets a fresh GPU block filled from the host (a *load*) before the
step's forward, and counts as computed, as a GPU hit does.

Copies are not run here: ``take_ops`` hands the engine the step's stores and loads,
which it runs right after ``schedule()`` and before the forward, stores first::

    schedule():  evict GPU 7 -> store (7 -> host 3)     hit host 3 -> load (3 -> GPU 9)
    flush:       GPU 7 -> host 3 ...                     then host 3 -> GPU 9
    forward:     writes GPU 7 (reused), reads GPU 9

so a store reads its GPU block before the forward reuses it (engine/kv_offload.py says
which stream runs what). A host block that a load reads is pinned until its load is
handed out, so no store of the same step overwrites it.

Loads are asynchronous by default (vLLM's native connector's way): a step's loads form one
``LoadBatch``, copied on a stream of their own beside the forwards, and only the requests
that read its blocks wait for it -- the one admitted with the host hits, and any that takes
a GPU prefix hit on a block still being loaded (``block_batch``). The scheduler skips them
(``KVCacheManager.is_loading``) until the batch's event has passed; everyone else keeps
decoding. A request freed while its loads are in flight (abort, preemption) hands its
batches to ``orphaned``: the engine makes the compute stream wait for them before any
forward could write the blocks again. With ``async_loads`` off the loads run on the compute
stream before the step's forward and the request computes in the same step.

Safety is the GPU cache's (prefix_cache.py): a host block keeps the content id of the GPU
block it came from (equal content ids => equal K/V) and its parent's; a hit needs the
block's token ids to equal the request's AND its parent content id to equal the content
id of the block matched just before (on the GPU or here), so a hash collision never
hands over other K/V. A loaded block is registered on the GPU with the same ids, so the
chains go on across tiers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flashpage.kv_cache.prefix_cache import chain_hits

if TYPE_CHECKING:
    from flashpage.kv_cache.block_pool import KVCacheBlock
    from flashpage.kv_cache.prefix_cache import RootId, Splice


class HostBlock:
    """One host block; prefix fields as ``KVCacheBlock``'s (None while free)."""

    __slots__ = ("host_id", "block_hash", "token_ids", "content_id", "parent_cid", "pins")

    def __init__(self, host_id: int) -> None:
        self.host_id = host_id
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.content_id: int | None = None
        self.parent_cid: RootId = None
        self.pins = 0  # loads of this step not yet handed out

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"HostBlock({self.host_id}, hash={h}, pins={self.pins})"


class LoadBatch:
    """One step's loads: the GPU blocks they fill and, once queued, the event after them
    (anything with ``query()``; None until the engine has queued the copies)."""

    __slots__ = ("gpu_ids", "event", "finished")

    def __init__(self) -> None:
        self.gpu_ids: list[int] = []
        self.event: object | None = None
        self.finished = False  # known to have passed (synchronous copies: at once)

    def done(self) -> bool:
        if not self.finished and self.event is not None and self.event.query():  # type: ignore[attr-defined]
            self.finished = True
        return self.finished

    def __repr__(self) -> str:
        return f"LoadBatch({len(self.gpu_ids)} blocks, finished={self.finished})"


class HostBlockCache:
    """``num_blocks`` host blocks, the map ``hash -> host block`` in LRU order (first:
    evicted first) and the step's pending copies."""

    def __init__(self, num_blocks: int, async_loads: bool = True) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [HostBlock(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[bytes, HostBlock] = OrderedDict()
        self.pending_stores: list[tuple[int, int]] = []  # (GPU block id, host id), in order
        self.pending_loads: list[tuple[int, int]] = []  # (host id, GPU block id), in order
        self._pinned: list[HostBlock] = []
        # asynchronous loads: requests reading a batch's blocks wait until it has passed
        self.async_loads = async_loads
        self._batch: LoadBatch | None = None  # this step's loads, until take_ops
        self.last_batch: LoadBatch | None = None  # the loads take_ops handed out last
        self.block_batch: dict[int, LoadBatch] = {}  # GPU block id -> its load, not yet passed
        self._in_flight: list[LoadBatch] = []
        self.orphaned: list[LoadBatch] = []  # batches whose readers were freed before they passed
        self.num_stores = 0  # blocks copied to the host
        self.num_loads = 0  # blocks copied back
        self.num_evictions = 0  # host blocks dropped to make room
        self.num_dropped = 0  # offers not stored (every host block pinned)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    # ------------------------------------------------------------------ stores
    def offer(self, block: KVCacheBlock) -> None:
        """The GPU pool is about to reuse ``block``, a findable prefix block: keep its
        content here (a store), unless the host has it already (then it is refreshed in
        the LRU order). Called by ``BlockPool.get_new_blocks`` before it clears the block."""
        h = block.block_hash
        if h is None or block.content_id is None:
            return
        e = self.cached.get(h)
        if e is not None:
            if e.content_id == block.content_id:
                self.cached.move_to_end(h)
                return
            if e.pins:  # a load of this step reads it: keep it, lose the offer
                self.num_dropped += 1
                return
            self._drop(e)  # other content under the hash (a collision, or a stale chain)
        hb = self._take_block()
        if hb is None:
            self.num_dropped += 1
            return
        hb.block_hash, hb.token_ids = h, block.token_ids
        hb.content_id, hb.parent_cid = block.content_id, block.parent_cid
        self.cached[h] = hb
        self.pending_stores.append((block.block_id, hb.host_id))
        self.num_stores += 1

    def _take_block(self) -> HostBlock | None:
        """A free host block, else the least recently used unpinned one (evicted)."""
        if self.free:
            return self.blocks[self.free.popleft()]
        for e in self.cached.values():
            if not e.pins:
                self._drop(e)
                self.num_evictions += 1
                return self.blocks[self.free.popleft()]
        return None

    def _drop(self, e: HostBlock) -> None:
        assert e.block_hash is not None and not e.pins
        del self.cached[e.block_hash]
        e.block_hash = e.token_ids = e.content_id = e.parent_cid = None
        self.free.appendleft(e.host_id)

    # ------------------------------------------------------------------ loads
    def match(self, keys: Sequence[bytes], token_ids: Sequence[int], block_size: int,
              start: int, max_blocks: int, parent_cid: RootId, splice: Splice = None) -> list[HostBlock]:
        """The host blocks holding the request's blocks ``start, start + 1, ...`` (at most
        up to ``max_blocks``), the first one's parent content id ``parent_cid`` (that of
        the request's block ``start - 1`` as matched on the GPU, or its chain's root;
        ``splice``: the chain's, prefix_cache.chain)."""
        return chain_hits(self.cached, keys, token_ids, block_size, start, max_blocks, parent_cid, splice)

    def is_current(self, e: HostBlock) -> bool:
        """Whether ``e`` still holds what ``match`` found it holding."""
        return e.block_hash is not None and self.cached.get(e.block_hash) is e

    def pin(self, hits: Sequence[HostBlock]) -> None:
        """Keep ``hits`` (about to be loaded) from being evicted or overwritten until
        ``take_ops`` hands their loads out."""
        for e in hits:
            e.pins += 1
            self._pinned.append(e)

    def load(self, e: HostBlock, gpu_block_id: int) -> LoadBatch:
        """Queue the copy of pinned host block ``e`` into GPU block ``gpu_block_id``;
        returns the step's batch it joins."""
        if not e.pins:
            raise RuntimeError(f"host block {e.host_id} loaded without being pinned")
        assert e.block_hash is not None
        self.cached.move_to_end(e.block_hash)
        self.pending_loads.append((e.host_id, gpu_block_id))
        self.num_loads += 1
        if self._batch is None:
            self._batch = LoadBatch()
            self._in_flight.append(self._batch)
        self._batch.gpu_ids.append(gpu_block_id)
        self.block_batch[gpu_block_id] = self._batch
        return self._batch

    def loading(self, gpu_block_ids: Sequence[int]) -> list[LoadBatch]:
        """The batches still filling any of these GPU blocks (none once they passed)."""
        if not self._in_flight:
            return []
        self.settle()
        found = {id(b): b for g in gpu_block_ids if (b := self.block_batch.get(g)) is not None}
        return list(found.values())

    def settle(self) -> None:
        """Forget the batches that have passed."""
        if self._in_flight and any(b.done() for b in self._in_flight):
            keep = []
            for b in self._in_flight:
                if b.finished:
                    for g in b.gpu_ids:
                        if self.block_batch.get(g) is b:
                            del self.block_batch[g]
                else:
                    keep.append(b)
            self._in_flight = keep

    def oldest_in_flight(self) -> LoadBatch | None:
        self.settle()
        return self._in_flight[0] if self._in_flight else None

    def unpin(self, hits: Sequence[HostBlock]) -> None:
        """Undo ``pin`` for blocks whose loads were not queued after all."""
        for e in hits:
            e.pins -= 1
            self._pinned.remove(e)

    # ------------------------------------------------------------------ the engine
    def take_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (stores, loads), cleared here; run the stores first, then set the
        loads' batch's (``last_batch``) ``event``, or its ``finished``. The loads' host
        blocks are unpinned: any later store to them must wait for the loads
        (engine/kv_offload.py)."""
        self.settle()  # once a step: batches that passed leave block_batch and the list
        stores, loads = self.pending_stores, self.pending_loads
        self.pending_stores, self.pending_loads = [], []
        self.last_batch, self._batch = self._batch, None
        for e in self._pinned:
            e.pins -= 1
        self._pinned.clear()
        return stores, loads

    def take_orphaned(self) -> list[LoadBatch]:
        """Batches still in flight whose reader was freed: the compute stream must wait for
        them before a forward writes their blocks again."""
        out, self.orphaned = [b for b in self.orphaned if not b.done()], []
        return out

    @property
    def has_pending(self) -> bool:
        return bool(self.pending_stores or self.pending_loads or self._pinned)

    def reset(self) -> bool:
        """Forget every host block (reset_prefix_cache); False while copies are pending."""
        if self.has_pending:
            return False
        for e in self.cached.values():
            e.block_hash = e.token_ids = e.content_id = e.parent_cid = None
        self.cached.clear()
        self.free = deque(range(self.num_blocks))
        return True
