"""Block tables, slot mapping and prefix sharing for requests (pure Python).

A request's block table maps logical block ``i`` (positions ``[i*B, (i+1)*B)``) to a
physical block id; token ``p`` lives in slot ``table[p // B] * B + p % B``::

    positions  0 .. B-1 | B .. 2B-1 | 2B .. (partial)
    table      [   7    ,     2     ,    9   ]       -> slot of p=B+3 is 2*B + 3

Blocks are allocated only when a step schedules tokens that need them, and returned
when the request finishes, is aborted or preempted. With a sliding window common to every
layer (``sliding_window``: Mistral 7B v0.1, Phi-3-mini-4k, StarCoder2), a block whose
tokens no query of this step or a later one can see (all its positions ``<= q0 - window``,
``q0`` the step's first query) goes back to the pool at once and its table entry points
at the reserved null block 0 (zeros, never written; the kernels skip or mask it), so a
request holds about ``window / B + 1`` blocks however long it runs::

    window 32, B 16, q0 = 70:  table [0, 0, 12, 5, 9]   positions 0..31 released
                               (keys 39..70 are visible to query 70: blocks 2.. stay)

With prefix caching (default), a
block becomes findable by its chained hash as soon as it is allocated for tokens that
fill it in this step: a request admitted later in the SAME step may hit it, which is
safe because the engine writes every new token's K/V of a layer before attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashpage.kv_cache import prefix_cache
from flashpage.kv_cache.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from flashpage.engine.sequence import Request
    from flashpage.kv_cache.host_cache import HostBlock, HostBlockCache, LoadBatch


def validate_block_size(block_size: object) -> int:
    if (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1
            or block_size > 256 or block_size & (block_size - 1)):
        raise ValueError(
            f"block_size must be a power of two from 1 to 256 (1, 2, 4, ..., 256), "
            f"got {block_size!r}"
        )
    return block_size


def slot_mapping_for(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Physical slots of token positions ``[start, end)`` for a request with table ``block_ids``.

    ``slot = block_ids[p // block_size] * block_size + p % block_size``; the table must
    cover position ``end - 1``.
    """
    if end > len(block_ids) * block_size:
        raise ValueError(f"block table of {len(block_ids)} blocks does not cover position {end - 1}")
    B = block_size
    out: list[int] = []
    p = start
    while p < end:
        i, off = divmod(p, B)
        n = min(B - off, end - p)
        base = block_ids[i] * B + off
        out.extend(range(base, base + n))
        p += n
    return out


@dataclass
class KVCacheStats:
    num_blocks: int
    block_size: int
    blocks_used: int  # held by at least one request
    blocks_free: int  # free queue length (includes cached ones)
    blocks_cached_free: int  # free, but still holding a findable prefix
    tokens_stored: int  # distinct token states held (a shared block counts once)
    slots_allocated: int  # blocks_used * block_size
    utilization: float  # tokens_stored / slots_allocated (1.0 when nothing is allocated)
    usage: float  # blocks_used / num_blocks
    prefix_queries: int  # prompt tokens looked up (admissions that succeeded)
    prefix_hits: int  # of which found in the cache (on the GPU or the host tier)
    prefix_hit_rate: float
    num_evictions: int
    # the host tier (kv_cache/host_cache.py; all 0 without one)
    host_hits: int = 0  # of prefix_hits, tokens loaded back from the host
    host_blocks: int = 0  # host blocks in all
    host_blocks_cached: int = 0  # of which holding a prefix block
    host_stores: int = 0  # blocks copied to the host since start
    host_loads: int = 0  # blocks copied back
    host_evictions: int = 0  # host blocks dropped (LRU) to make room


class PoolAccounts:
    """What a cache reads off its pool alone (``KVCacheManager`` and the hybrid manager's
    groups' shared one): free and usable blocks, usage, the prefix-cache reset, stats.
    Needs ``pool``, ``num_blocks``, ``num_reserved``, ``block_size``, ``prefix_queries`` /
    ``prefix_hits`` and ``tokens_stored()``."""

    pool: BlockPool
    num_blocks: int
    num_reserved: int
    block_size: int
    prefix_queries: int
    prefix_hits: int
    host: HostBlockCache | None = None
    host_hits = 0

    def tokens_stored(self) -> int:
        raise NotImplementedError

    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.num_free

    @property
    def num_usable_blocks(self) -> int:
        """The blocks requests can hold (all but the reserved null block)."""
        return self.num_blocks - self.num_reserved

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.free_queue.num_free / self.num_usable_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (only when no block is in use). Returns success."""
        if self.pool.free_queue.num_free != self.num_usable_blocks:
            return False
        if self.host is not None and not self.host.reset():
            return False
        for b in self.pool.blocks:
            b.reset_content()
        self.pool.cached.clear()
        return True

    def stats(self) -> KVCacheStats:
        free = self.pool.free_queue.num_free
        used = self.num_usable_blocks - free
        stored = self.tokens_stored()
        slots = used * self.block_size
        host = self.host
        return KVCacheStats(
            num_blocks=self.num_usable_blocks,
            block_size=self.block_size,
            blocks_used=used,
            blocks_free=free,
            blocks_cached_free=sum(1 for b in self.pool.cached.values() if b.ref_cnt == 0),
            tokens_stored=stored,
            slots_allocated=slots,
            utilization=stored / slots if slots else 1.0,
            usage=used / self.num_usable_blocks,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            prefix_hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            num_evictions=self.pool.num_evictions,
            host_hits=self.host_hits,
            host_blocks=host.num_blocks if host is not None else 0,
            host_blocks_cached=host.num_cached_blocks if host is not None else 0,
            host_stores=host.num_stores if host is not None else 0,
            host_loads=host.num_loads if host is not None else 0,
            host_evictions=host.num_evictions if host is not None else 0,
        )


class KVCacheManager(PoolAccounts):
    """Allocates blocks to requests; shares full blocks of equal prefixes.

    Per request the manager keeps its blocks (``get_block_ids``) and how many tokens
    they will hold after the current step (set by ``allocate_slots``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, window_slack: int = 0, *,
                 pool: BlockPool | None = None, null_block: KVCacheBlock | None = None,
                 group: int = 0, attention_chunk: int | None = None):
        """``pool`` / ``null_block`` / ``group``: one group of a HybridKVCacheManager (its
        layers' tables over a pool every group shares, the null block reserved there; the
        group's prefix-cache keys are its own: ``group`` > 0 appends a byte to each hash).
        ``attention_chunk`` (instead of a window: Llama 4's chunked layers): a query at p
        sees keys from p // chunk * chunk, so the blocks before its chunk go back."""
        self.block_size = validate_block_size(block_size)
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or isinstance(sliding_window, bool) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
        if not isinstance(window_slack, int) or window_slack < 0:
            raise ValueError(f"window_slack must be a non-negative integer, got {window_slack!r}")
        if attention_chunk is not None and (sliding_window is not None or not isinstance(
                attention_chunk, int) or isinstance(attention_chunk, bool) or attention_chunk < 1):
            raise ValueError(f"attention_chunk must be a positive integer (and no sliding_window), "
                             f"got {attention_chunk!r}")
        self.attention_chunk = attention_chunk
        # blocks behind what a step's first query sees go back (a window or a chunk)
        self.releases = sliding_window is not None or attention_chunk is not None
        if self.releases and num_blocks < 2:
            raise ValueError("a sliding-window cache needs at least 2 blocks (block 0 is the null block)")
        self.sliding_window = sliding_window
        # Positions before q0 - window + 1 - window_slack are released: the slack keeps the
        # keys a step may still read behind its first query (a draft model's catch-up).
        self.window_slack = window_slack
        self.group = group
        self._key_suffix = bytes([group]) if group else b""
        if pool is not None:  # a group of a hybrid cache: the null block reserved by it
            self.pool, self.null_block = pool, null_block
            self.num_reserved = 1 if null_block is not None else 0
        else:
            self.pool = BlockPool(num_blocks)
            self.null_block = None
            if self.releases:  # released table entries point here; never allocated
                self.null_block = self.pool.blocks[0]
                self.pool.free_queue.remove(self.null_block)
                self.null_block.ref_cnt = 1
            self.num_reserved = 1 if self.releases else 0
        if self.releases and self.null_block is None:
            raise ValueError("a sliding-window or chunked group needs the pool's null block")
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_stored: dict[str, int] = {}
        self._num_registered: dict[str, int] = {}  # leading full blocks already hashed
        self._tail_cid: dict[str, prefix_cache.RootId] = {}  # content id of the last registered block
        self._num_released: dict[str, int] = {}  # leading entries given back (sliding window)
        self._pending_query: dict[str, tuple[int, int]] = {}
        self._pending_host: dict[str, list[HostBlock]] = {}  # host hits found, not yet taken
        # requests whose blocks are still being loaded from the host (asynchronous loads)
        self._load_waits: dict[str, set[LoadBatch]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    def attach_host(self, host: HostBlockCache) -> None:
        """A host tier behind this cache (kv_cache/host_cache.py): blocks the pool evicts
        are offered to it, and prefix lookups go on there where the GPU misses."""
        if self.releases or self.group or not self.enable_prefix_caching:
            raise ValueError("a host tier needs prefix caching and one full-attention table")
        self.host = host
        self.pool.on_evict = host.offer

    # ------------------------------------------------------------------ queries
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table. The list is live: read it, do not mutate it."""
        return self._block_ids.get(request_id, [])

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self._blocks.get(request_id, [])

    def num_stored_tokens(self, request_id: str) -> int:
        return self._num_stored.get(request_id, 0)

    def num_released(self, request_id: str) -> int:
        """Leading table entries given back to the pool (null block 0; sliding window)."""
        return self._num_released.get(request_id, 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _releasable(self, first_query: int) -> int:
        """How many leading blocks no query at ``first_query`` or later can see."""
        if self.attention_chunk is not None:
            first = first_query // self.attention_chunk * self.attention_chunk
            return max(0, first - self.window_slack) // self.block_size
        assert self.sliding_window is not None
        return max(0, first_query - self.sliding_window + 1 - self.window_slack) // self.block_size

    def blocks_held_after(self, num_computed: int, num_new: int) -> int:
        """Blocks a request holds once a step computing positions ``[num_computed,
        num_computed + num_new)`` is allocated (its released ones not counted)."""
        n = self.blocks_needed(num_computed + num_new)
        if not self.releases:
            return n
        return n - min(self._releasable(num_computed), n)

    def taken_hits(self, hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """The prefix hits an admission takes: behind a sliding window, not those no query
        of its first step can see (their table entries are null)."""
        if not self.releases or not hits:
            return hits
        return hits[min(self._releasable(len(hits) * self.block_size), len(hits)):]

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` positions holds at once, steps
        computing at most ``max_step_tokens`` each (whole, without a sliding window)."""
        n = self.blocks_needed(num_tokens)
        if not self.releases:
            return n
        # a chunk's last query sees chunk - 1 keys behind it, as a window of that size
        span = (self.sliding_window or self.attention_chunk or 0) - 1 + self.window_slack + max_step_tokens
        return min(n, self.blocks_needed(span) + 1)

    # --------------------------------------------------------------- allocation
    def _keys(self, hashes: list[bytes], n: int) -> list[bytes]:
        """The prefix-cache keys of a request's first ``n`` block hashes in this group."""
        if not self._key_suffix:
            return hashes
        return [h + self._key_suffix for h in hashes[:n]]

    def cacheable(self, request: Request) -> bool:
        """Whether the request may take prefix hits at all."""
        return (self.enable_prefix_caching and request.request_id not in self._blocks
                and request.sampling_params.prompt_logprobs is None  # every position's logits
                and not (request.pooling is not None and request.pooling.needs_every_position))

    # ------------------------------------------------------------ host-tier loads
    def must_wait_for_loads(self, request: Request, hit_blocks: list[KVCacheBlock]) -> bool:
        """Whether the request, about to be admitted with these prefix hits (and the host
        hits ``get_computed_blocks`` found), must wait for loads from the host before it
        computes anything: asynchronous loads, and host hits or GPU hits still loading."""
        host = self.host
        if host is None or not host.async_loads:
            return False
        if self._pending_host.get(request.request_id):
            return True
        return bool(hit_blocks) and bool(host.loading([b.block_id for b in hit_blocks]))

    @property
    def has_loads_in_flight(self) -> bool:
        """Some request waits for a load from the host (``is_loading``)."""
        return bool(self._load_waits)

    def is_loading(self, request: Request) -> bool:
        """Whether the request still waits for a load of its blocks from the host."""
        waits = self._load_waits.get(request.request_id)
        if waits is None:
            return False
        if all(b.done() for b in waits):
            del self._load_waits[request.request_id]
            return False
        return True

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks holding the longest prefix of ``request.all_token_ids``.

        Never the whole sequence: at least its last token is recomputed so that the step
        produces logits. Returns ``(blocks, num_tokens_hit)``; nothing is taken yet (pass
        the blocks to ``allocate_slots``).
        """
        self._pending_host.pop(request.request_id, None)
        if not self.cacheable(request):
            return [], 0
        B = self.block_size
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // B
        hits, root_cid = self.prefix_hit(request, max_blocks)
        if self.releases and len(hits) < max_blocks:
            found, run = self.window_runs(request, max_blocks, root_cid)
            hits = next((h for k in range(max_blocks, len(hits), -1)
                         if (h := self.window_hit_at(k, found, run)) is not None), hits)
        num_hit = len(hits)
        if self.host is not None and num_hit < max_blocks:
            # the blocks after the GPU hit, from the host tier: loaded into fresh blocks
            # when allocate_slots takes the hits, and counted as computed as GPU hits are
            more = self.host.match(self._keys(request.block_hashes, max_blocks), tokens, B, num_hit,
                                   max_blocks, hits[-1].content_id if hits else root_cid,
                                   self._chain(request)[2])
            if more:
                self._pending_host[request.request_id] = more
                num_hit += len(more)
        self._pending_query[request.request_id] = (len(tokens), num_hit * B)
        return hits, num_hit * B

    def prefix_hit(self, request: Request, max_blocks: int
                   ) -> tuple[list[KVCacheBlock], prefix_cache.RootId]:
        """The longest plain prefix hit of at most ``max_blocks`` blocks (the request's
        block hashes extended as far), and its chain's root content id."""
        tokens = request.all_token_ids
        root, root_cid, splice = self._chain(request)
        prefix_cache.update_block_hashes(request.block_hashes, tokens, self.block_size, max_blocks, root,
                                         splice)
        keys = self._keys(request.block_hashes, max_blocks)
        return prefix_cache.find_longest_cache_hit(self.pool, keys, tokens, self.block_size,
                                                   max_blocks, root_cid, splice), root_cid

    def _chain(self, request: Request) -> tuple[bytes | None, prefix_cache.RootId, prefix_cache.Splice]:
        """The request's prefix-cache chain: root hash, root content id, splice."""
        return prefix_cache.chain(request.lora_int_id, request.cache_salt, request.embeds_digest,
                                  request.embeds_start, self.block_size)

    def window_runs(self, request: Request, max_blocks: int, root_cid: prefix_cache.RootId
                    ) -> tuple[list[KVCacheBlock | None], list[int]]:
        """Behind a sliding window a hit of k blocks needs only the blocks its first query
        can see, ``[releasable(k*B), k)``, cached (released ones are evicted first: the
        blocks before them need not be). -> (found, run): block i's cached block (its tokens
        the request's) or None, and how many consecutive matching blocks end at block i.
        Within a run each block's parent content id is checked against the block before
        it; the run's first block, whose parent may be gone, is vouched for by its chained
        hash alone (block 0's parent is the root's). ``prefix_hit`` first: the hashes."""
        B = self.block_size
        tokens, cached = request.all_token_ids, self.pool.cached
        keys = self._keys(request.block_hashes, max_blocks)
        splice = self._chain(request)[2]
        expected = prefix_cache.expected_parent
        run = [0] * max_blocks  # run[i]: consecutive matching blocks ending at block i
        found: list[KVCacheBlock | None] = [None] * max_blocks
        for i in range(max_blocks):
            b = cached.get(keys[i])
            if b is None or b.token_ids != tuple(tokens[i * B:(i + 1) * B]):
                continue
            if i == 0 and b.parent_cid != expected(0, root_cid, splice):
                continue
            found[i] = b
            prev = found[i - 1] if i else None
            run[i] = run[i - 1] + 1 if prev is not None and \
                b.parent_cid == expected(i, prev.content_id, splice) else 1
        return found, run

    def window_hit_at(self, k: int, found: list[KVCacheBlock | None], run: list[int]
                      ) -> list[KVCacheBlock] | None:
        """A window hit of exactly ``k`` blocks from ``window_runs``' arrays ->
        ``[null] * releasable + the blocks the first query sees``; None if there is none."""
        null = self.null_block
        assert null is not None
        lo = min(self._releasable(k * self.block_size), k)
        if k == 0 or run[k - 1] < k - lo:
            return None
        return [null] * lo + [b for b in found[lo:k] if b is not None]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        """Make the table cover ``num_computed_tokens + hit + num_new_tokens`` positions.

        ``new_computed_blocks`` (from ``get_computed_blocks``, first admission only) are
        taken with a reference and put at the head of the table. Returns the newly
        allocated blocks (possibly ``[]``), or None if there are not enough free blocks
        -- then nothing has changed.
        """
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks is not None and self.releases:
            self.release_behind_window(request)
        if not new_computed_blocks and self.covers(request, num_new_tokens):
            # Fast path (most decode steps): the table already covers the new tokens.
            self.note_covered(request, num_new_tokens)
            return []
        num_needed, num_evictable_hits = self.blocks_to_take(request, num_new_tokens, new_computed_blocks)
        # Free cached blocks we are about to touch cannot also serve as new blocks.
        if num_needed > self.pool.free_queue.num_free - num_evictable_hits:
            return None
        num_host = len(self._pending_host.get(rid, ())) if blocks is None else 0
        self.take_hits(request, new_computed_blocks)
        return self.grow(request, num_new_tokens, len(new_computed_blocks or ()) + num_host)

    def covers(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's table already holds the step's new tokens (no fresh block
        to take); changes nothing."""
        blocks = self._blocks.get(request.request_id)
        return blocks is not None and request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size

    def note_covered(self, request: Request, num_new_tokens: int) -> None:
        """``allocate_slots`` for a step its table ``covers``: the tokens counted stored and
        the blocks they fill registered."""
        rid, B = request.request_id, self.block_size
        total = request.num_computed_tokens + num_new_tokens
        if total > self._num_stored[rid]:
            self._num_stored[rid] = total
        if self.enable_prefix_caching and total // B > self._num_registered[rid]:
            self._register_full_blocks(request, self._blocks[rid], total // B)

    def release_behind_window(self, request: Request) -> None:
        """Give back the request's blocks its window has passed (sliding window only)."""
        rid = request.request_id
        if self.releases and rid in self._blocks:
            upto = self._releasable(request.num_computed_tokens)
            if upto > self._num_released[rid]:
                self._release(rid, upto)

    def blocks_to_take(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None) -> tuple[int, int]:
        """(fresh blocks ``allocate_slots`` would take from the free queue, prefix hits it
        would take that sit there now); changes nothing."""
        blocks = self._blocks.get(request.request_id)
        num_hit = len(new_computed_blocks) if new_computed_blocks else 0
        if num_hit and (blocks is not None or request.num_computed_tokens):
            raise ValueError(f"request {request.request_id}: prefix-hit blocks are only taken at admission")
        # host-tier hits (admission only) take fresh blocks, counted in num_needed
        num_host = len(self._pending_host.get(request.request_id, ())) if blocks is None else 0
        total = request.num_computed_tokens + (num_hit + num_host) * self.block_size + num_new_tokens
        num_needed = -(-total // self.block_size) - (len(blocks) if blocks is not None else 0) - num_hit
        taken = self.taken_hits(new_computed_blocks) if new_computed_blocks else []
        return max(num_needed, 0), sum(1 for b in taken if b.ref_cnt == 0)

    def take_hits(self, request: Request, new_computed_blocks: list[KVCacheBlock] | None) -> None:
        """Start the request's table (first admission) with its prefix hits, each taken
        with a reference (``blocks_to_take`` checked that the pool can serve the rest)."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks is None:
            blocks = self._blocks[rid] = []
            self._block_ids[rid] = []
            self._num_stored[rid] = 0
            self._num_registered[rid] = 0
            self._tail_cid[rid] = None
            self._num_released[rid] = 0
        ids = self._block_ids[rid]
        if new_computed_blocks:
            taken = self.taken_hits(new_computed_blocks)
            skip = len(new_computed_blocks) - len(taken)
            if skip:
                assert self.null_block is not None
                blocks.extend([self.null_block] * skip)
                ids.extend([self.null_block.block_id] * skip)
                self._num_released[rid] = skip
            self.pool.touch(taken)
            blocks.extend(taken)
            ids.extend(b.block_id for b in taken)
            self._num_registered[rid] = len(new_computed_blocks)
            self._tail_cid[rid] = new_computed_blocks[-1].content_id
        host = self.host
        if host is not None and host.async_loads and new_computed_blocks:
            # GPU hits on blocks another request's load is still filling: wait for it too
            loading = host.loading([b.block_id for b in new_computed_blocks])
            if loading:
                self._load_waits.setdefault(rid, set()).update(loading)
        host_hits = self._pending_host.pop(rid, None)
        if host_hits and host is not None:
            self._take_host_hits(request, host_hits)

    def _take_host_hits(self, request: Request, hits: list[HostBlock]) -> None:
        """After the GPU hits: a fresh block for each host hit, registered with the host
        block's content (findable at once: whoever takes it waits for its load, or the load
        runs before the step's forward), and the load queued (kv_cache/host_cache.py)."""
        host, rid = self.host, request.request_id
        assert host is not None
        if not all(host.is_current(e) for e in hits):
            raise RuntimeError(f"request {rid}: host-tier hits changed between lookup and allocation")
        host.pin(hits)  # before the fresh blocks: their evictions store to the host
        fresh = self.pool.get_new_blocks(len(hits))
        for e, b in zip(hits, fresh, strict=True):
            assert e.block_hash is not None and e.token_ids is not None and e.content_id is not None
            self.pool.register_loaded(b, e.block_hash, e.token_ids, e.parent_cid, e.content_id)
            batch = host.load(e, b.block_id)
        if host.async_loads:  # the request computes once the batch has passed (is_loading)
            self._load_waits.setdefault(rid, set()).add(batch)
        self._blocks[rid].extend(fresh)
        self._block_ids[rid].extend(b.block_id for b in fresh)
        self._num_registered[rid] = len(self._blocks[rid])
        self._tail_cid[rid] = hits[-1].content_id
        n = len(hits) * self.block_size
        self.host_hits += n
        if request.num_cached_tokens < 0:  # first admission: its output's figure
            request.num_host_cached_tokens = n

    def grow(self, request: Request, num_new_tokens: int, num_hit: int) -> list[KVCacheBlock]:
        """After ``take_hits``: fresh blocks to cover ``num_computed_tokens + num_hit * B +
        num_new_tokens`` positions, and the full ones registered; returns the fresh ones."""
        rid, B = request.request_id, self.block_size
        blocks, ids = self._blocks[rid], self._block_ids[rid]
        total = request.num_computed_tokens + num_hit * B + num_new_tokens
        num_needed = -(-total // B) - len(blocks)
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed > 0 else []
        if new_blocks:
            blocks.extend(new_blocks)
            ids.extend(b.block_id for b in new_blocks)
        if total > self._num_stored[rid]:
            self._num_stored[rid] = total
        if rid in self._pending_query:
            queried, hit = self._pending_query.pop(rid)
            self.prefix_queries += queried
            self.prefix_hits += hit
        if self.enable_prefix_caching and total // B > self._num_registered[rid]:
            self._register_full_blocks(request, blocks, total // B)
        return new_blocks

    def _register_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                              num_full: int) -> None:
        rid = request.request_id
        B = self.block_size
        tokens = request.all_token_ids
        # A block holding a token still being sampled on the GPU (async scheduling) is
        # hashed by a later step, once that token is known.
        num_full = min(num_full, (len(tokens) - request.num_unresolved) // B)
        if num_full <= self._num_registered[rid]:
            return
        root, root_cid, splice = self._chain(request)
        hashes = self._keys(prefix_cache.update_block_hashes(request.block_hashes, tokens, B,
                                                             num_full, root, splice), num_full)
        start = self._num_registered[rid]
        parent_cid = self._tail_cid[rid] if start else root_cid
        register = self.pool.register
        expected = prefix_cache.expected_parent
        for i in range(start, num_full):
            b = blocks[i]
            register(b, hashes[i], tuple(tokens[i * B:(i + 1) * B]), expected(i, parent_cid, splice))
            parent_cid = b.content_id
        self._num_registered[rid] = num_full
        self._tail_cid[rid] = parent_cid

    def _release(self, rid: str, upto: int) -> None:
        """Give back the request's blocks ``[released, upto)`` (a sliding window passed
        them); with prefix caching only registered ones (they stay findable, LRU)."""
        if self.enable_prefix_caching:
            upto = min(upto, self._num_registered[rid])
        start = self._num_released[rid]
        if upto <= start:
            return
        blocks, ids, null = self._blocks[rid], self._block_ids[rid], self.null_block
        assert null is not None
        self.pool.free_blocks(blocks[start:upto])
        blocks[start:upto] = [null] * (upto - start)
        ids[start:upto] = [null.block_id] * (upto - start)
        self._num_released[rid] = upto

    def trim(self, request: Request, num_tokens: int | None = None) -> None:
        """The request's stored tokens back to its computed ones (a speculative step's
        rejected drafts), or to ``num_tokens`` (drafts cut after scheduling); its blocks
        stay, to be written again as it grows."""
        rid = request.request_id
        if rid in self._num_stored:
            upto = request.num_computed_tokens if num_tokens is None else num_tokens
            self._num_stored[rid] = min(self._num_stored[rid], upto)

    def free(self, request: Request) -> None:
        """Return the request's blocks (finish, abort or preemption).

        Freed in reverse order, so a request's tail blocks are evicted before its head
        (a shorter prefix is more likely to be shared). Blocks with a hash stay cached.
        """
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._pending_query.pop(rid, None)
        self._pending_host.pop(rid, None)
        waits = self._load_waits.pop(rid, None)
        if waits and self.host is not None:  # blocks freed under a load still in flight
            self.host.orphaned.extend(b for b in waits if not b.done())
        if blocks is None:
            return
        del self._block_ids[rid]
        del self._num_stored[rid]
        del self._num_registered[rid]
        del self._tail_cid[rid]
        released = self._num_released.pop(rid)
        self.pool.free_blocks(reversed(blocks[released:]))

    def blocks_freed_by(self, request_ids: list[str]) -> set[int]:
        """Ids of the blocks that freeing these requests would return to the free queue:
        those no other request holds (the priority scheduler asks before preempting)."""
        held: dict[int, int] = {}
        refs: dict[int, int] = {}
        for rid in request_ids:
            for b in self._blocks.get(rid, [])[self._num_released.get(rid, 0):]:
                held[b.block_id] = held.get(b.block_id, 0) + 1
                refs[b.block_id] = b.ref_cnt
        return {bid for bid, n in held.items() if refs[bid] == n}

    # -------------------------------------------------------------------- stats
    def tokens_stored(self) -> int:
        """Distinct token states in blocks held by requests (a shared block counts once).

        Counts the tokens scheduled in the current step as stored. O(blocks in use) with
        prefix caching (shared blocks must be deduplicated), O(requests) without.
        """
        B = self.block_size
        if not self.enable_prefix_caching:
            return sum(max(0, n - self._num_released[rid] * B) for rid, n in self._num_stored.items())
        fill: dict[int, int] = {}
        for rid, blocks in self._blocks.items():
            n = self._num_stored[rid]
            for i in range(self._num_released[rid], len(blocks)):
                b = blocks[i]
                f = min(B, n - i * B)
                if f > fill.get(b.block_id, 0):
                    fill[b.block_id] = f
        return sum(fill.values())
