from __future__ import annotations

import hashlib

import pytest

from flashpage.engine.sequence import Request
from flashpage.kv_cache import prefix_cache
from flashpage.kv_cache.kv_cache_manager import KVCacheManager
from flashpage.kv_cache.prefix_cache import hash_block_tokens, update_block_hashes
from flashpage.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_hash_is_128_bit_stable_and_chained():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes) and len(h0) == 16
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4))  # list or tuple: same bytes
    # Pinned value: the first 16 bytes of blake2b(ROOT || little-endian int64 ids).
    expect = hashlib.blake2b(b"flashpage-root-0" + b"".join(
        t.to_bytes(8, "little") for t in (1, 2, 3, 4))).digest()[:16]
    assert h0 == expect
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    # Same tokens, different parent -> different hash; order of tokens matters.
    assert h1 != hash_block_tokens(None, [5, 6, 7, 8])
    assert h1 != hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 5]), [5, 6, 7, 8])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    # Large ids (vocab > 2^31) are encoded without loss.
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])


def test_equal_prefixes_give_equal_hash_chains():
    a = list(range(10))
    b = list(range(8)) + [99, 98, 97]
    ha = update_block_hashes([], a, 4, 2)
    hb = update_block_hashes([], b, 4, 2)
    assert ha == hb and len(ha) == 2
    assert ha[1] == hash_block_tokens(ha[0], [4, 5, 6, 7])
    # Incremental: extending keeps the existing entries.
    hb3 = update_block_hashes(list(hb), b + [0], 4, 3)
    assert hb3[:2] == hb and hb3[2] == hash_block_tokens(hb[1], [99, 98, 97, 0])
    assert hb3[2] != update_block_hashes([], a + [0, 0], 4, 3)[2]


def test_forced_collision_token_mismatch_is_a_miss(monkeypatch):
    # Every block hashes the same: only the token-id check stands between B and A's K/V.
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, toks: b"\0" * 16)
    kv = KVCacheManager(8, 4)
    a = req("a", [1, 2, 3, 4, 0])
    assert [b.block_id for b in kv.allocate_slots(a, 5)] == [0, 1]
    b = req("b", [5, 6, 7, 8, 0])
    blocks, n = kv.get_computed_blocks(b)
    assert blocks == [] and n == 0
    kv.allocate_slots(b, 5)
    assert kv.get_block_ids("b") == [2, 3]
    # c has a's tokens but the (single) slot of the map now holds b's block: still a miss,
    # and never b's block.
    c = req("c", [1, 2, 3, 4, 0])
    assert kv.get_computed_blocks(c) == ([], 0)
    # d has b's tokens: a genuine hit on b's block.
    d = req("d", [5, 6, 7, 8, 1])
    blocks, n = kv.get_computed_blocks(d)
    assert [x.block_id for x in blocks] == [2] and n == 4


def test_forced_collision_parent_mismatch_is_a_miss(monkeypatch):
    # The hash ignores the tokens: level 0 blocks all collide, as do level 1 blocks.
    def weak(parent, toks):
        return hashlib.blake2b(parent or b"root", digest_size=16).digest()

    monkeypatch.setattr(prefix_cache, "hash_block_tokens", weak)
    kv = KVCacheManager(16, 4)
    a = req("a", [1, 2, 3, 4, 9, 9, 9, 9, 0])
    kv.allocate_slots(a, 9)  # a0 = block 0 (1234), a1 = block 1 (9999 after 1234)
    assert kv.get_block_ids("a") == [0, 1, 2]
    b = req("b", [5, 6, 7, 8, 0])
    assert kv.get_computed_blocks(b) == ([], 0)  # 1234 != 5678
    kv.allocate_slots(b, 5)  # b0 = block 3 (5678) takes the level-0 slot of the map
    assert kv.get_block_ids("b") == [3, 4]
    # c = 5678 9999 ...: level 0 hits b0 (tokens equal). The level-1 candidate is a1:
    # same tokens 9999, same hash, but its K/V was computed after 1234. Must miss.
    c = req("c", [5, 6, 7, 8, 9, 9, 9, 9, 0])
    blocks, n = kv.get_computed_blocks(c)
    assert [x.block_id for x in blocks] == [3] and n == 4
    kv.allocate_slots(c, 5, blocks)
    assert kv.get_block_ids("c") == [3, 5, 6]
    # Now c's block 5 owns the level-1 slot; a request with c's prefix hits both.
    d = req("d", [5, 6, 7, 8, 9, 9, 9, 9, 7, 7])
    blocks, n = kv.get_computed_blocks(d)
    assert [x.block_id for x in blocks] == [3, 5] and n == 8
    # ... and one with a's prefix hits nothing (level 0 slot holds 5678).
    e = req("e", [1, 2, 3, 4, 9, 9, 9, 9, 7])
    assert kv.get_computed_blocks(e) == ([], 0)


def _lora_req(rid: str, tokens: list[int], lora_id: int) -> Request:
    from flashpage.lora.request import LoRARequest

    lora = LoRARequest(f"l{lora_id}", lora_id, "/unused") if lora_id else None
    return Request(rid, tokens, SamplingParams(max_tokens=4), lora_request=lora)


def test_adapters_root_their_own_chains():
    """K/V computed under a LoRA adapter is another model's: equal tokens under another
    adapter (or none) miss, under the same adapter hit, exact block ids."""
    kv = KVCacheManager(16, 4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    kv.allocate_slots(_lora_req("a", tokens, 1), 9)
    assert kv.get_block_ids("a") == [0, 1, 2]
    for rid, lid in (("base", 0), ("other", 2)):
        r = _lora_req(rid, tokens, lid)
        assert kv.get_computed_blocks(r) == ([], 0)
        kv.allocate_slots(r, 9)
    assert kv.get_block_ids("base") == [3, 4, 5] and kv.get_block_ids("other") == [6, 7, 8]
    for rid, lid, want in (("a2", 1, [0, 1]), ("base2", 0, [3, 4]), ("other2", 2, [6, 7])):
        blocks, n = kv.get_computed_blocks(_lora_req(rid, tokens, lid))
        assert [b.block_id for b in blocks] == want and n == 8
    root, cid = prefix_cache.cache_root(1)
    assert prefix_cache.cache_root(0) == (None, None) and cid == -1
    assert update_block_hashes([], tokens, 4, 1, root) != update_block_hashes([], tokens, 4, 1)


def test_cache_salts_share_nothing_across_salts(monkeypatch):
    """vLLM's cache_salt: blocks are found only by requests of the same salt (and adapter);
    an unsalted request finds no salted block. Under a forced hash collision the roots'
    parent ids, (adapter id, salt) pairs compared exactly, still keep them apart."""
    tokens = list(range(1, 10))  # 2 full blocks of 4 + 1

    def salted(rid: str, salt: str | None, lora_id: int = 0) -> Request:
        r = _lora_req(rid, tokens, lora_id)
        r.cache_salt = salt
        return r

    assert prefix_cache.cache_root(0, "a")[1] == (0, "a") and prefix_cache.cache_root(0) == (None, None)
    roots = {prefix_cache.cache_root(lid, salt)[0] for lid in (0, 1) for salt in (None, "a", "b")}
    assert len(roots) == 6  # every (adapter, salt) its own chain
    for collide in (False, True):
        if collide:
            monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, toks: b"\0" * 16)
        kv = KVCacheManager(16, 4)
        kv.allocate_slots(salted("a", "tenant-1"), 9)
        for rid, salt, lid in (("base", None, 0), ("other", "tenant-2", 0), ("lora", "tenant-1", 1)):
            assert kv.get_computed_blocks(salted(rid, salt, lid)) == ([], 0), (rid, collide)
        if not collide:  # (every block under one hash: each takes the last one's place)
            blocks, n = kv.get_computed_blocks(salted("a2", "tenant-1"))
            assert n == 8 and [b.block_id for b in blocks] == kv.get_block_ids("a")[:2]


def test_adapter_roots_hold_under_a_forced_collision(monkeypatch):
    """Every block hashes the same: the root's parent content id (-adapter id) alone keeps
    an adapter's first block from another adapter's request."""
    monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, toks: b"\0" * 16)
    kv = KVCacheManager(8, 4)
    kv.allocate_slots(_lora_req("a", [1, 2, 3, 4, 0], 1), 5)
    assert kv.get_computed_blocks(_lora_req("b", [1, 2, 3, 4, 0], 2)) == ([], 0)
    assert kv.get_computed_blocks(_lora_req("c", [1, 2, 3, 4, 0], 0)) == ([], 0)
    blocks, n = kv.get_computed_blocks(_lora_req("d", [1, 2, 3, 4, 0], 1))
    assert [b.block_id for b in blocks] == [0] and n == 4


def _spliced(rid: str, tokens: list[int], digest: bytes | None, start: int) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=4))
    r.embeds_digest, r.embeds_start = digest, start
    return r


@pytest.mark.parametrize("collide", [False, True])
def test_rows_the_ids_do_not_say_splice_the_chain_where_they_begin(monkeypatch, collide):
    """Rows named by a digest from position 6 (block 1 of 4-token blocks): block 0 is plain
    text, shared with a text-only request and with rows of another digest; blocks 1 on only
    with the same digest at the same place. Under a forced hash collision the spliced
    parent id, compared exactly, still keeps them apart."""
    if collide:
        monkeypatch.setattr(prefix_cache, "hash_block_tokens", lambda parent, toks: b"\0" * 16)
    tokens = list(range(1, 14))  # 3 full blocks of 4 + 1
    kv = KVCacheManager(32, 4)
    kv.allocate_slots(_spliced("a", tokens, b"x" * 32, 6), 13)
    a = kv.get_block_ids("a")
    want = {("same", b"x" * 32, 6): a[:3], ("text", None, 0): a[:1], ("other", b"y" * 32, 6): a[:1],
            ("moved", b"x" * 32, 2): [], ("later", b"x" * 32, 9): a[:1]}
    for (rid, d, start), ids in want.items():
        blocks, n = kv.get_computed_blocks(_spliced(rid, tokens, d, start))
        got = [b.block_id for b in blocks]
        # (collisions: every block under one hash, the last registered in each one's place;
        # a hit may be lost, never a wrong block taken)
        assert (got == ids[:len(got)] if collide else got == ids) and n == 4 * len(got), rid
    if collide:
        return
    # a text request's blocks serve the spliced one before its splice, never after
    kv2 = KVCacheManager(32, 4)
    kv2.allocate_slots(_spliced("t", tokens, None, 0), 13)
    blocks, n = kv2.get_computed_blocks(_spliced("s", tokens, b"x" * 32, 9))
    assert [b.block_id for b in blocks] == kv2.get_block_ids("t")[:2] and n == 8
    assert prefix_cache.update_block_hashes([], tokens, 4, 3, None, (1, b"x" * 32))[:1] == \
        prefix_cache.update_block_hashes([], tokens, 4, 1)
