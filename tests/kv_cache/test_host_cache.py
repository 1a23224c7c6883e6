"""The host tier of the prefix cache (kv_cache/host_cache.py) behind a KVCacheManager:
stores on GPU eviction, host hits after a GPU miss, LRU, the collision guard, pins, and
that no block (GPU or host) leaks. Pure Python: exact block ids and copy lists."""

from __future__ import annotations

import hashlib

import pytest

from flashpage.engine.sequence import Request
from flashpage.kv_cache import prefix_cache
from flashpage.kv_cache.host_cache import HostBlockCache
from flashpage.kv_cache.kv_cache_manager import KVCacheManager
from flashpage.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def tiered(gpu_blocks: int, host_blocks: int, block_size: int = 4) -> tuple[KVCacheManager, HostBlockCache]:
    kv = KVCacheManager(gpu_blocks, block_size)
    host = HostBlockCache(host_blocks)
    kv.attach_host(host)
    return kv, host


def admit(kv: KVCacheManager, r: Request) -> int:
    """As the scheduler admits a request whole: its hits taken, the rest allocated; returns
    the tokens hit."""
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = n
    return n


def test_evicted_blocks_are_stored_and_loaded_back():
    kv, host = tiered(4, 4)
    a = req("a", list(range(9)))
    assert admit(kv, a) == 0 and kv.get_block_ids("a") == [0, 1, 2]
    kv.free(a)  # free queue [2 (partial), 3, 1, 0]: the tail block is evicted first
    b = req("b", list(range(100, 109)))
    assert admit(kv, b) == 0 and kv.get_block_ids("b") == [2, 3, 1]
    # block 1 held a's second block (tokens 4..7): stored to host block 0 as it was reused
    assert host.pending_stores == [(1, 0)] and host.num_cached_blocks == 1
    assert host.take_ops() == ([(1, 0)], [])
    kv.free(b)
    # c shares a's 8 tokens: block 0 hits on the GPU, block 1 on the host
    c = req("c", list(range(8)) + [77])
    hits, n = kv.get_computed_blocks(c)
    assert [b.block_id for b in hits] == [0] and n == 8
    # free queue [1 (b's partial), 3, 2]: block 1 is filled from host block 0, block 3
    # (b's second block, stored as it goes) takes token 8
    assert kv.allocate_slots(c, 1, hits) == [kv.pool.blocks[3]]
    assert kv.get_block_ids("c") == [0, 1, 3]
    assert host.pending_loads == [(0, 1)]
    # the loaded block is findable under a's hash, with its content id: the chain goes on
    assert kv.pool.blocks[1].content_id == host.blocks[0].content_id
    assert kv.pool.cached[c.block_hashes[1]] is kv.pool.blocks[1]
    stats = kv.stats()
    assert (stats.host_hits, stats.prefix_hits, stats.host_loads, stats.host_stores) == (4, 8, 1, 2)
    assert c.num_host_cached_tokens == 4
    assert host.take_ops() == ([(3, 1)], [(0, 1)])  # stores first
    kv.free(c)
    assert kv.num_free_blocks == 4 and not host.has_pending
    # a request with a's whole prefix hits both blocks on the GPU now, none on the host
    d = req("d", list(range(8)) + [5])
    hits, n = kv.get_computed_blocks(d)
    assert [b.block_id for b in hits] == [0, 1] and n == 8


def test_a_whole_prefix_from_the_host_and_its_chain_registered():
    kv, host = tiered(4, 8)
    a = req("a", list(range(12)) + [1])
    admit(kv, a)
    kv.free(a)  # free queue [3 (partial), 2, 1, 0]
    x = req("x", list(range(200, 216)))
    admit(kv, x)  # four fresh blocks: a's three full ones stored, its tail block first
    assert host.take_ops() == ([(2, 0), (1, 1), (0, 2)], [])
    kv.free(x)
    b = req("b", list(range(12)) + [9, 9])
    hits, n = kv.get_computed_blocks(b)
    assert hits == [] and n == 12
    kv.allocate_slots(b, 2, hits)
    b.num_computed_tokens = 12
    stores, loads = host.take_ops()
    assert [h for h, _ in loads] == [2, 1, 0]  # a's blocks 0, 1, 2 in table order
    assert [g for _, g in loads] == kv.get_block_ids("b")[:3]
    assert stores and all(g in kv.get_block_ids("b") for g, _ in stores)  # x's, as reused
    # the loaded blocks are registered as a's were: a request with a's prefix hits all
    # three on the GPU
    c = req("c", list(range(12)) + [9, 9, 3])
    hits, n = kv.get_computed_blocks(c)
    assert n == 12 and [x.block_id for x in hits] == kv.get_block_ids("b")[:3]


def test_host_lru_evicts_the_least_recently_used_unpinned_block():
    kv, host = tiered(2, 2, block_size=2)
    # One-block prompts through a 2-block GPU pool: each reuse stores the one before.
    for i, rid in enumerate("abcd"):
        r = req(rid, [10 * i, 10 * i + 1, 0])
        admit(kv, r)
        kv.free(r)
    # a's block went out first (host 0), then b's (host 1), then c's: the host was full,
    # and a's (least recently used) made room
    assert host.num_evictions == 1
    assert [e.token_ids for e in host.cached.values()] == [(10, 11), (20, 21)]
    host.take_ops()
    # b is hit on the host (its load makes it the most recent); the block for b2's last
    # token evicts d's, whose store evicts c's: b was older, but is pinned by its load
    b2 = req("b2", [10, 11, 5])
    assert admit(kv, b2) == 2
    assert [e.token_ids for e in host.cached.values()] == [(10, 11), (30, 31)]
    assert host.num_evictions == 2
    host.take_ops()
    kv.free(b2)
    # b's loaded block evicted again: the host has its content already (no store; it is
    # refreshed, now the most recent)
    e = req("e", [40, 41, 0])
    admit(kv, e)
    stores, _ = host.take_ops()
    assert stores == [] and [x.token_ids for x in host.cached.values()] == [(30, 31), (10, 11)]
    kv.free(e)
    admit(kv, req("f", [50, 51, 0]))  # e's block stored: d's, least recent, makes room
    assert [x.token_ids for x in host.cached.values()] == [(10, 11), (40, 41)]
    assert host.num_evictions == 3 and host.num_free_blocks == 0


def test_pinned_host_blocks_are_not_overwritten_by_stores_of_the_same_step():
    kv, host = tiered(2, 1, block_size=2)
    a = req("a", [1, 2, 0])
    admit(kv, a)
    kv.free(a)
    admit(kv, x := req("x", [5, 6, 7]))  # a's block stored to the one host block
    kv.free(x)
    host.take_ops()
    # b hits a's block on the host; its fresh GPU blocks evict x's block, whose store would
    # need the one host block: it is pinned (b's load reads it), so that store is dropped
    b = req("b", [1, 2, 3])
    hits, n = kv.get_computed_blocks(b)
    assert n == 2
    kv.allocate_slots(b, 1, hits)
    assert host.num_dropped == 1
    stores, loads = host.take_ops()
    assert stores == [] and loads == [(0, kv.get_block_ids("b")[0])]
    assert host.blocks[0].pins == 0 and host.blocks[0].token_ids == (1, 2)


@pytest.mark.parametrize("weak", ["tokens", "parents"])
def test_a_host_block_of_other_content_under_the_same_hash_is_never_used(monkeypatch, weak):
    """Forced collisions: every block hashes the same ("tokens": only the token ids tell
    blocks apart), or a block's hash ignores its tokens ("parents": blocks at the same
    depth collide). A host block is used only when its tokens AND its parent's content id
    are the request's."""
    if weak == "tokens":
        monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, toks: b"\0" * 16)
    else:
        monkeypatch.setattr(prefix_cache, "hash_block_tokens",
                            lambda parent, toks: hashlib.blake2b(parent or b"root", digest_size=16).digest())
    kv, host = tiered(3, 4)
    a = req("a", [1, 2, 3, 4, 9, 9, 9, 9, 0])
    admit(kv, a)
    kv.free(a)
    x = req("x", list(range(50, 62)))
    admit(kv, x)  # a's findable blocks stored as x reuses them
    kv.free(x)
    stored = [e.token_ids for e in host.cached.values()]
    assert stored == ([(9, 9, 9, 9)] if weak == "tokens" else [(9, 9, 9, 9), (1, 2, 3, 4)])
    # c's second block has a's tokens 9999 after x's first block, not a's
    c = req("c", [50, 51, 52, 53, 9, 9, 9, 9, 0])
    hits, n = kv.get_computed_blocks(c)
    # "parents": x's first block hits on the GPU; the host's 9999 follows a's, a miss
    assert n == (0 if weak == "tokens" else 4) and kv.host_hits == 0
    assert "c" not in kv._pending_host
    # a's own tokens: "parents" finds both of a's blocks on the host (the positive check);
    # "tokens" keeps one block under the one hash, a's 9999, never a first block
    d = req("d", [1, 2, 3, 4, 9, 9, 9, 9, 0])
    hits, n = kv.get_computed_blocks(d)
    assert hits == [] and n == (0 if weak == "tokens" else 8)


def test_no_block_leaks_after_finish_abort_and_preemption():
    kv, host = tiered(6, 3)
    for rnd in range(4):
        held = []
        for i in range(4):
            r = req(f"s{rnd}{i}", [i % 2] * 8 + [rnd % 2, i, 1, 2, 3])
            hits, n = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - n, hits) is None:
                continue
            held.append(r)
            if i % 2:
                host.take_ops()
            if (i + rnd) % 2:  # freed at once (an abort before its step ran), else later
                kv.free(held.pop())
        for r in reversed(held):  # a finish, or a preemption of the latest first
            kv.free(r)
        host.take_ops()
        assert kv.num_free_blocks == 6 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
        assert host.num_free_blocks + host.num_cached_blocks == 3
        assert not host.has_pending and all(e.pins == 0 for e in host.blocks)
    assert kv.host_hits > 0 and host.num_loads > 0
    assert kv.reset_prefix_cache() and host.num_cached_blocks == 0 and host.num_free_blocks == 3


def test_stored_content_is_not_stored_twice_and_reset_waits_for_pending_copies():
    kv, host = tiered(2, 4, block_size=2)
    a = req("a", [1, 2, 0])
    admit(kv, a)
    kv.free(a)
    x = req("x", [5, 6, 7])
    admit(kv, x)  # a's block stored as x reuses it
    assert host.pending_stores == [(0, 0)]
    assert not kv.reset_prefix_cache()  # x holds blocks
    kv.free(x)
    assert not host.reset()  # a store not yet run
    host.take_ops()
    b = req("b", [1, 2, 3])
    assert admit(kv, b) == 2  # a's block loaded back (x's stored as its block is reused)
    assert host.take_ops() == ([(1, 1)], [(0, 0)])
    kv.free(b)
    admit(kv, req("y", [7, 7, 9]))
    # the loaded block evicted again: the host holds that content already, no store
    assert host.take_ops() == ([], []) and host.num_stores == 2


def test_attach_host_needs_prefix_caching_and_one_full_table():
    with pytest.raises(ValueError, match="needs prefix caching"):
        KVCacheManager(4, 4, enable_prefix_caching=False).attach_host(HostBlockCache(2))
    with pytest.raises(ValueError, match="one full-attention table"):
        KVCacheManager(4, 4, sliding_window=8).attach_host(HostBlockCache(2))
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        HostBlockCache(0)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("collide", [False, True])
def test_random_steps_every_hit_block_holds_the_requests_prefix(monkeypatch, seed, collide):
    """A simulated engine: the step's admissions, then the copies the host tier hands out
    (stores, then loads) applied to stand-in GPU and host memories, then the forward, which
    writes each computed block's content (the whole prefix it ends) and checks that every
    block the request took as a hit (GPU or host) holds exactly its prefix; then random
    finishes. ``collide``: a weak hash (4 buckets a depth), so collisions are everywhere."""
    import random

    if collide:
        monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, toks: hashlib.blake2b(
            (parent or b"r") + bytes([sum(toks) % 4]), digest_size=16).digest())
    rng = random.Random(seed)
    B = 2
    kv, host = tiered(12, 8, block_size=B)
    gpu: dict[int, tuple[int, ...]] = {}
    mem: dict[int, tuple[int, ...]] = {}
    stems = [[rng.randrange(3) for _ in range(8)] for _ in range(3)]
    live: list[Request] = []
    n = 0
    for _ in range(150):
        admitted = []
        for _ in range(rng.randrange(1, 3)):
            stem = rng.choice(stems)
            r = req(f"r{n}", stem[:rng.randrange(0, 9)] + [rng.randrange(3) for _ in range(rng.randrange(1, 4))])
            n += 1
            hits, hit = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - hit, hits) is None:
                break
            r.num_computed_tokens = hit
            admitted.append(r)
        stores, loads = host.take_ops()
        for g, h in stores:
            mem[h] = gpu[g]
        for h, g in loads:
            gpu[g] = mem[h]
        for r in admitted:  # the forward
            ids, toks = kv.get_block_ids(r.request_id), r.all_token_ids
            for i in range(r.num_computed_tokens // B):
                assert gpu[ids[i]] == tuple(toks[:(i + 1) * B]), (r.request_id, i)
            for i in range(r.num_computed_tokens // B, len(ids)):
                gpu[ids[i]] = tuple(toks[:min((i + 1) * B, len(toks))])
            live.append(r)
        rng.shuffle(live)
        for _ in range(rng.randrange(0, len(live) + 1)):
            kv.free(live.pop())
    for r in live:
        kv.free(r)
    host.take_ops()
    assert kv.num_free_blocks == 12 and not host.has_pending
    assert host.num_free_blocks + host.num_cached_blocks == 8
    assert host.num_stores > 0 and host.num_loads > 0 and kv.host_hits > 0
