from __future__ import annotations

import pytest

from flashpage.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def test_free_queue_order_and_o1_ops():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2] not in q and blocks[3] in q
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.appendleft(blocks[0])
    assert q.block_ids() == [0, 1, 3, 4, 2]
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(KVCacheBlock(9))
    for expect in [0, 1, 3, 4, 2]:
        assert q.popleft().block_id == expect
    with pytest.raises(IndexError):
        q.popleft()
    assert len(q) == 0


def test_pool_allocates_from_head_with_ref_one():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)


def test_pool_free_order_hashless_head_cached_tail():
    pool = BlockPool(6)
    a = pool.get_new_blocks(4)  # 0 1 2 3 ; free: 4 5
    pool.register(a[0], b"h0" * 8, (1, 2), None)
    pool.register(a[1], b"h1" * 8, (3, 4), a[0].content_id)
    pool.free_blocks(reversed(a))  # 3, 2 (no hash) -> head ; 1, 0 (hashed) -> tail
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    assert all(b.ref_cnt == 0 for b in a)
    # A fresh allocation takes hashless blocks first; cached ones survive.
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [2, 3, 4, 5]
    assert set(pool.cached) == {b"h0" * 8, b"h1" * 8}
    # Next one evicts the least recently freed cached block: 1 (the tail block of a).
    (b1,) = pool.get_new_blocks(1)
    assert b1.block_id == 1 and b1.block_hash is None and b1.token_ids is None
    assert set(pool.cached) == {b"h0" * 8}
    assert pool.num_evictions == 1


def test_touch_removes_cached_block_from_free_queue_and_counts_refs():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.register(b, b"x" * 16, (7,), None)
    pool.free_blocks([b])
    assert pool.free_queue.block_ids() == [1, 2, 0]
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.free_queue.block_ids() == [1, 2]
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.free_queue.block_ids() == [1, 2, 0]
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.free_queue.block_ids() == [1, 2, 0]


def test_register_duplicate_and_collision():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.register(a, b"k" * 16, (1, 2), None)
    # Same content under the same hash: b is an unfindable duplicate sharing a's content id.
    pool.register(b, b"k" * 16, (1, 2), None)
    assert pool.cached[b"k" * 16] is a and b.block_hash is None and b.content_id == a.content_id
    # Different content under the same hash (a collision): the newer block takes the slot.
    pool.register(c, b"k" * 16, (9, 9), None)
    assert pool.cached[b"k" * 16] is c and a.block_hash is None
    assert c.content_id not in (a.content_id, None)


def test_pool_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
