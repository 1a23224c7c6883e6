"""KV cache groups for models whose layers mix a sliding window with full attention.

Gemma 2/3, Cohere2, Ministral, OLMo 3 and GPT-OSS alternate layers that attend within a
window W with layers that attend to everything. One block table for all layers would keep
every token of every layer; instead the layers are split into **groups** of equal size
``g`` (``group_layers``): the full layers in ``ceil(n_full / g)`` groups, the windowed ones
in ``ceil(n_window / g)``, with ``g = min(n_full, n_window)``. Each group has its own block
table per request over ONE pool of block ids, and each layer's cache tensor is its slot's
(``slot = index in its group``): block id ``b`` of slot ``s`` is the same memory whichever
group holds ``b``. A windowed group gives back the blocks behind its window as
``KVCacheManager`` does for a window every layer shares (its table entries point at the
null block 0), a full group keeps them, so a long request holds about ``L / B`` blocks
per full group and ``W / B + 1`` per windowed group instead of ``L / B`` per group::

    Gemma 3 27B: 62 layers, every 6th full -> 10 full layers (1 group), 52 windowed
    (6 groups, the last of 2 layers), g = 10 slots a block. A request of L = 32k tokens,
    W = 1024, B = 16 holds 2048 + 6 * 65 blocks of 10 layers (24k layer-blocks) instead
    of 2048 blocks of all 62 (127k): 5.2x the requests in the same memory.

A prefix hit must hold in every group at one length k: the full groups' longest plain
prefix bounds k; each windowed group needs only the blocks its first query sees cached
(``KVCacheManager.window_hit_at``). Allocation is all or nothing across groups: every
group's prefix hits are taken before any group takes fresh blocks (a fresh block popped
from the free queue could otherwise evict another group's hit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashpage.kv_cache.block_pool import BlockPool, KVCacheBlock
from flashpage.kv_cache.kv_cache_manager import KVCacheManager, PoolAccounts, validate_block_size

if TYPE_CHECKING:
    from flashpage.engine.sequence import Request


@dataclass(frozen=True)
class GroupLayout:
    """Which group and slot each attention layer's cache is in."""

    windows: tuple[int | None, ...]  # each group's window (None: full attention, or chunks)
    layer_group: tuple[int, ...]  # attention layer i -> its group
    layer_slot: tuple[int, ...]  # attention layer i -> its slot (cache tensor)
    num_slots: int  # layers a block holds (g)
    chunks: tuple[int | None, ...] = ()  # each group's attention chunk (Llama 4), if any

    def chunk(self, group: int) -> int | None:
        return self.chunks[group] if self.chunks else None

    def releases(self, group: int) -> bool:
        return self.windows[group] is not None or self.chunk(group) is not None

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def group_layers(layer_windows: list[int | None],
                 layer_chunks: list[int | None] | None = None) -> GroupLayout | None:
    """The groups of a model's attention layers, given each one's window (and chunk: Llama
    4's chunked layers, which release the blocks before a query's chunk as a window does
    those behind it); None when the layers do not mix one window (or one chunk size) with
    full attention (one table serves them all)."""
    chunks = layer_chunks or [None] * len(layer_windows)
    spans = list(zip(layer_windows, chunks, strict=True))
    kinds = set(spans)
    if len(kinds) != 2 or (None, None) not in kinds:
        return None
    full = [i for i, sp in enumerate(spans) if sp == (None, None)]
    windowed = [i for i, sp in enumerate(spans) if sp != (None, None)]
    g = min(len(full), len(windowed))
    n_full = -(-len(full) // g)
    group = [0] * len(layer_windows)
    slot = [0] * len(layer_windows)
    for j, i in enumerate(full):
        group[i], slot[i] = j // g, j % g
    for j, i in enumerate(windowed):
        group[i], slot[i] = n_full + j // g, j % g
    window, chunk = spans[windowed[0]]
    n_win = -(-len(windowed) // g)
    return GroupLayout((None,) * n_full + (window,) * n_win, tuple(group), tuple(slot), g,
                       (None,) * n_full + (chunk,) * n_win if chunk is not None else ())


class HybridHits(list):
    """``get_computed_blocks``' hits: the flat list of every group's blocks (what the
    scheduler counts), with each group's own list in ``groups``."""

    groups: list[list[KVCacheBlock]]


class HybridKVCacheManager(PoolAccounts):
    """``KVCacheManager``'s interface over several groups' tables and one pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 windows: tuple[int | None, ...], chunks: tuple[int | None, ...] = ()) -> None:
        self.block_size = validate_block_size(block_size)
        if num_blocks < 2:
            raise ValueError("a hybrid cache needs at least 2 blocks (block 0 is the null block)")
        chunks = chunks or (None,) * len(windows)
        spans = list(zip(windows, chunks, strict=True))
        if (None, None) not in spans or all(sp == (None, None) for sp in spans):
            raise ValueError(f"a hybrid cache mixes full and windowed (or chunked) groups, got "
                             f"windows {windows}, chunks {chunks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = None  # no window every layer shares
        self.pool = BlockPool(num_blocks)
        self.null_block = self.pool.blocks[0]
        self.pool.free_queue.remove(self.null_block)
        self.null_block.ref_cnt = 1
        self.num_reserved = 1
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, w,
                                      pool=self.pool, null_block=self.null_block, group=i,
                                      attention_chunk=c)
                       for i, (w, c) in enumerate(spans)]
        self.windows, self.chunks = windows, chunks
        self._pending_query: dict[str, tuple[int, int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        return self.groups[group].get_block_ids(request_id)

    def get_blocks(self, request_id: str, group: int = 0) -> list[KVCacheBlock]:
        return self.groups[group].get_blocks(request_id)

    def num_released(self, request_id: str, group: int = 0) -> int:
        return self.groups[group].num_released(request_id)

    def num_stored_tokens(self, request_id: str) -> int:
        return self.groups[0].num_stored_tokens(request_id)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_held_after(self, num_computed: int, num_new: int) -> int:
        return sum(g.blocks_held_after(num_computed, num_new) for g in self.groups)

    def max_blocks_held(self, num_tokens: int, max_step_tokens: int) -> int:
        return sum(g.max_blocks_held(num_tokens, max_step_tokens) for g in self.groups)

    def taken_hits(self, hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        if not hits:
            return []
        assert isinstance(hits, HybridHits)
        return [b for g, h in zip(self.groups, hits.groups, strict=True) for b in g.taken_hits(h)]

    # --------------------------------------------------------------- allocation
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest k blocks that every group can take as a prefix hit (see the module
        docstring); never the whole sequence."""
        first = self.groups[0]
        if not first.cacheable(request):
            return [], 0
        B = self.block_size
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // B
        prefixes: list[list[KVCacheBlock]] = []
        runs: dict[int, tuple[list[KVCacheBlock | None], list[int]]] = {}
        k_max = max_blocks
        for i, g in enumerate(self.groups):
            prefix, root_cid = g.prefix_hit(request, max_blocks)
            prefixes.append(prefix)
            if not g.releases:
                k_max = min(k_max, len(prefix))
            elif len(prefix) < max_blocks:
                runs[i] = g.window_runs(request, max_blocks, root_cid)
        best: HybridHits = HybridHits()
        best.groups = [[] for _ in self.groups]
        for k in range(k_max, 0, -1):
            per: list[list[KVCacheBlock]] = []
            for i, g in enumerate(self.groups):
                if len(prefixes[i]) >= k:
                    per.append(prefixes[i][:k])
                    continue
                hit = g.window_hit_at(k, *runs[i]) if i in runs else None
                if hit is None:
                    break
                per.append(hit)
            else:
                best = HybridHits(b for h in per for b in h)
                best.groups = per
                break
        num_hit = len(best.groups[0]) * B
        self._pending_query[request.request_id] = (len(tokens), num_hit)
        return best, num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        """Every group's table made to cover the step, or none (None: not enough free
        blocks, and nothing changed but blocks behind a window given back)."""
        hits = new_computed_blocks.groups if isinstance(new_computed_blocks, HybridHits) \
            else [new_computed_blocks or [] for _ in self.groups]
        if new_computed_blocks and not isinstance(new_computed_blocks, HybridHits):
            raise ValueError("a hybrid cache takes the hits its get_computed_blocks returned")
        for g in self.groups:
            g.release_behind_window(request)
        if not new_computed_blocks and request.request_id not in self._pending_query \
                and all(g.covers(request, num_new_tokens) for g in self.groups):
            # most decode steps: every group's table already holds the new tokens
            for g in self.groups:
                g.note_covered(request, num_new_tokens)
            return []
        needed = evictable = 0
        for g, h in zip(self.groups, hits, strict=True):
            n, e = g.blocks_to_take(request, num_new_tokens, h)
            needed += n
            evictable += e
        if needed > self.pool.free_queue.num_free - evictable:
            return None
        for g, h in zip(self.groups, hits, strict=True):
            g.take_hits(request, h)
        new: list[KVCacheBlock] = []
        for g, h in zip(self.groups, hits, strict=True):
            new += g.grow(request, num_new_tokens, len(h))
        if request.request_id in self._pending_query:
            queried, hit = self._pending_query.pop(request.request_id)
            self.prefix_queries += queried
            self.prefix_hits += hit
        return new

    def trim(self, request: Request, num_tokens: int | None = None) -> None:
        for g in self.groups:
            g.trim(request, num_tokens)

    def free(self, request: Request) -> None:
        self._pending_query.pop(request.request_id, None)
        for g in reversed(self.groups):
            g.free(request)

    # no host tier behind KV cache groups (LLMEngine._check_offloading): nothing loads
    def must_wait_for_loads(self, request: Request, hit_blocks: list[KVCacheBlock]) -> bool:
        return False

    @property
    def has_loads_in_flight(self) -> bool:
        return False

    def is_loading(self, request: Request) -> bool:
        return False

    def blocks_freed_by(self, request_ids: list[str]) -> set[int]:
        return set().union(*(g.blocks_freed_by(request_ids) for g in self.groups))

    # -------------------------------------------------------------------- stats
    def tokens_stored(self) -> int:
        """Token states held, summed over the groups (a group's token is a block slot)."""
        return sum(g.tokens_stored() for g in self.groups)
