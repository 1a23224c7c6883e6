from __future__ import annotations

import pytest

from flashpage.config import EngineConfig
from flashpage.engine.sequence import Request
from flashpage.kv_cache.kv_cache_manager import (
    KVCacheManager,
    slot_mapping_for,
    validate_block_size,
)
from flashpage.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def free_ids(kv: KVCacheManager) -> list[int]:
    return kv.pool.free_queue.block_ids()


# ------------------------------------------------------------------ block size
@pytest.mark.parametrize("bs", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_block_size_powers_of_two_accepted(bs):
    kv = KVCacheManager(4, bs)
    assert kv.block_size == bs


@pytest.mark.parametrize("bs", [0, -16, 3, 12, 24, 48, 100, 255, 512, 1024, 16.0, "16", True, None])
def test_block_size_others_refused_with_clear_message(bs):
    with pytest.raises(ValueError, match=r"block_size must be a power of two from 1 to 256.*got"):
        KVCacheManager(4, bs)  # type: ignore[arg-type]


def test_block_size_rule_matches_engine_config():
    for bs in range(-2, 600):
        try:
            EngineConfig(block_size=bs)
            engine_ok = True
        except ValueError:
            engine_ok = False
        try:
            validate_block_size(bs)
            ours = True
        except ValueError:
            ours = False
        assert engine_ok == ours, bs


# ---------------------------------------------------------------- slot mapping
def test_slot_mapping_exact():
    assert slot_mapping_for([7, 2, 9], 0, 10, 4) == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    assert slot_mapping_for([7, 2, 9], 3, 6, 4) == [31, 8, 9]
    assert slot_mapping_for([7, 2, 9], 9, 10, 4) == [37]
    assert slot_mapping_for([5], 0, 1, 1) == [5]
    assert slot_mapping_for([3, 0], 2, 2, 4) == []
    with pytest.raises(ValueError, match="does not cover position 12"):
        slot_mapping_for([7, 2, 9], 10, 13, 4)


# ------------------------------------------------------------------ allocation
def test_allocate_exact_block_ids_and_growth():
    kv = KVCacheManager(6, 4)
    a = req("a", list(range(10)))
    new = kv.allocate_slots(a, 10)
    assert [b.block_id for b in new] == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.num_free_blocks == 3
    a.num_computed_tokens = 10
    a.append_output_token(100)
    a.append_output_token(101)
    assert kv.allocate_slots(a, 1) == []  # position 10 fits block 2
    a.num_computed_tokens = 11
    assert kv.allocate_slots(a, 1) == []  # position 11 too
    a.num_computed_tokens = 12
    a.append_output_token(102)
    assert [b.block_id for b in kv.allocate_slots(a, 1)] == [3]  # position 12: new block
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    assert kv.usage == pytest.approx(4 / 6)


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(4, 4)
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None
    b = req("b", list(range(100, 108)))
    before = (free_ids(kv), kv.get_block_ids("a"), kv.stats())
    assert kv.allocate_slots(b, 8) is None
    assert (free_ids(kv), kv.get_block_ids("a"), kv.stats()) == before
    assert kv.get_block_ids("b") == []
    assert [blk.block_id for blk in kv.allocate_slots(b, 4)] == [3]


def test_free_returns_blocks_and_is_idempotent():
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.get_block_ids("a") == []
    # No hashes without prefix caching: freed blocks go to the head, tail block first out.
    assert free_ids(kv) == [0, 1, 2, 3]
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in kv.pool.blocks)


def test_no_prefix_caching_means_no_hits():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    a = req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    b = req("b", list(range(9)))
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.pool.cached == {}


# -------------------------------------------------------------- prefix sharing
def test_blocks_freed_by_counts_only_blocks_no_one_else_holds():
    kv = KVCacheManager(10, 4)
    a = req("a", list(range(10)))
    kv.allocate_slots(a, 10)  # [0, 1, 2]
    b = req("b", list(range(8)) + [50, 51, 52])
    kv.allocate_slots(b, 3, kv.get_computed_blocks(b)[0])  # [0, 1, 3]: 0 and 1 shared
    c = req("c", [60, 61])
    kv.allocate_slots(c, 2)  # [4]
    assert kv.blocks_freed_by(["a"]) == {2}
    assert kv.blocks_freed_by(["b", "c"]) == {3, 4}
    assert kv.blocks_freed_by(["a", "b"]) == {0, 1, 2, 3}
    assert kv.blocks_freed_by(["nobody"]) == set()
    before = kv.num_free_blocks
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks - before == 4  # as it said


def test_prefix_hit_shares_blocks_with_ref_counts():
    kv = KVCacheManager(10, 4)
    a = req("a", list(range(10)))
    kv.allocate_slots(a, 10)  # [0, 1, 2]; blocks 0 and 1 full -> registered
    b = req("b", list(range(8)) + [50, 51, 52])
    hit, n = kv.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0, 1] and n == 8
    new = kv.allocate_slots(b, 3, hit)
    assert [x.block_id for x in new] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    refs = [blk.ref_cnt for blk in kv.pool.blocks]
    assert refs == [2, 2, 1, 1, 0, 0, 0, 0, 0, 0]
    s = kv.stats()
    assert s.blocks_used == 4 and s.tokens_stored == 8 + 2 + 3 and s.slots_allocated == 16
    assert s.prefix_queries == 11 and s.prefix_hits == 8  # a never looked up
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.pool.blocks][:4] == [1, 1, 0, 1]
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_hit_never_covers_the_whole_sequence():
    kv = KVCacheManager(10, 4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)  # two full blocks, both registered
    b = req("b", list(range(8)))  # identical prompt of exactly two blocks
    hit, n = kv.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0] and n == 4  # the last token must be computed
    kv.allocate_slots(b, 4, hit)
    assert kv.get_block_ids("b") == [0, 2]
    # Block 2 duplicates block 1's content: it is not findable, and freed it goes first.
    assert kv.pool.blocks[2].block_hash is None
    assert kv.pool.blocks[2].content_id == kv.pool.blocks[1].content_id
    kv.free(b)
    assert free_ids(kv)[0] == 2
    # A longer request with the same prefix still chains through the canonical block 1.
    c = req("c", list(range(8)) + [1])
    hit, n = kv.get_computed_blocks(c)
    assert [x.block_id for x in hit] == [0, 1] and n == 8


def test_blocks_registered_at_allocation_are_hit_in_the_same_step():
    kv = KVCacheManager(10, 4)
    a = req("a", list(range(12)))
    kv.allocate_slots(a, 8)  # a chunk: positions 0..7 will be written this step
    assert len(kv.pool.cached) == 2
    b = req("b", list(range(12)))
    hit, n = kv.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0, 1] and n == 8
    # A block only partly written this step is NOT registered.
    kv2 = KVCacheManager(10, 4)
    kv2.allocate_slots(req("a", list(range(12))), 6)  # positions 0..5: block 0 full, 1 half
    assert len(kv2.pool.cached) == 1
    hit, n = kv2.get_computed_blocks(req("b", list(range(12))))
    assert [x.block_id for x in hit] == [0] and n == 4


def test_lru_eviction_order():
    kv = KVCacheManager(8, 2)
    reqs = {}
    for rid, base in (("a", 0), ("b", 10), ("c", 20)):
        reqs[rid] = req(rid, [base, base + 1, base + 2, base + 3, base + 4])  # 2 full + 1 partial
        kv.allocate_slots(reqs[rid], 5)
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.get_block_ids("b") == [3, 4, 5]
    assert kv.get_block_ids("c") == []  # not allocated: only 2 blocks were left
    kv.free(reqs["b"])  # partial 5 -> head; 4, 3 -> tail
    kv.free(reqs["a"])  # partial 2 -> head; 1, 0 -> tail
    assert free_ids(kv) == [2, 5, 6, 7, 4, 3, 1, 0]
    assert kv.stats().blocks_cached_free == 4
    # A new request (no hit) takes hashless blocks first, then the least recently freed.
    d = req("d", list(range(100, 111)))  # 11 tokens -> 6 blocks
    got = [x.block_id for x in kv.allocate_slots(d, 11)]
    assert got == [2, 5, 6, 7, 4, 3]
    # b's blocks are gone from the cache, a's are still there.
    assert kv.get_computed_blocks(req("b2", [10, 11, 12, 13, 14])) == ([], 0)
    hit, n = kv.get_computed_blocks(req("a2", [0, 1, 2, 3, 4]))
    assert [x.block_id for x in hit] == [0, 1] and n == 4


def test_touching_cached_free_block_refreshes_it():
    kv = KVCacheManager(4, 2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)  # [0, 1]
    kv.free(a)  # 1 (partial) head, 0 tail
    assert free_ids(kv) == [1, 2, 3, 0]
    b = req("b", [1, 2, 9])
    hit, n = kv.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [0]
    assert kv.allocate_slots(b, 1, hit) is not None
    assert kv.get_block_ids("b") == [0, 1]
    assert free_ids(kv) == [2, 3] and kv.pool.blocks[0].ref_cnt == 1


def test_hit_blocks_count_against_free_blocks():
    kv = KVCacheManager(3, 2)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)  # [0, 1, 2]
    kv.free(a)  # free: 2 | 1 0  (0 and 1 cached)
    b = req("b", [1, 2, 3, 4, 7, 7, 7])  # hits 0, 1; needs 2 more: only block 2 remains
    hit, n = kv.get_computed_blocks(b)
    assert n == 4
    assert kv.allocate_slots(b, 3, hit) is None
    assert free_ids(kv) == [2, 1, 0] and kv.pool.blocks[0].ref_cnt == 0
    assert kv.stats().prefix_queries == 0  # a failed admission is not counted
    assert kv.allocate_slots(b, 1, hit) is not None
    assert kv.get_block_ids("b") == [0, 1, 2]
    assert kv.stats().prefix_queries == 7 and kv.stats().prefix_hits == 4


def test_hit_blocks_only_at_admission():
    kv = KVCacheManager(8, 2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    b = req("b", [1, 2, 3])
    kv.allocate_slots(b, 1)
    with pytest.raises(ValueError, match="only taken at admission"):
        kv.allocate_slots(b, 1, [kv.pool.blocks[0]])


def test_utilization_counts_shared_blocks_once():
    kv = KVCacheManager(16, 4)
    prompt = list(range(16))
    for i in range(3):
        r = req(f"r{i}", prompt + [100 + i])
        hit, _ = kv.get_computed_blocks(r)
        kv.allocate_slots(r, r.num_tokens - len(hit) * 4, hit)
    s = kv.stats()
    # 4 shared full blocks + 3 private blocks holding 1 token each.
    assert s.blocks_used == 7 and s.tokens_stored == 16 + 3
    assert s.utilization == pytest.approx(19 / 28)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [3, 3, 3, 3]


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(4, 2)
    a = req("a", [1, 2, 3])
    kv.allocate_slots(a, 3)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache() and kv.pool.cached == {}
    assert kv.get_computed_blocks(req("b", [1, 2, 3])) == ([], 0)
