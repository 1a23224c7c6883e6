"""A sliding window common to every layer: blocks behind it go back to the pool as a
request advances (their table entries point at the null block 0), so a request holds about
window / block_size + 1 blocks, and tokens stay transformers'."""

from __future__ import annotations

import os

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.engine.sequence import Request
from flashpage.kv_cache.kv_cache_manager import KVCacheManager, slot_mapping_for
from tests.conftest import (
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    build_tiny_checkpoint,
    hf_greedy,
    random_prompts,
)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64))


def _step(kv: KVCacheManager, r: Request, n: int) -> None:
    """Schedule and 'compute' n tokens of r (appending sampled ones past its prompt)."""
    assert kv.allocate_slots(r, n) is not None
    r.num_computed_tokens += n
    while r.num_computed_tokens >= r.num_tokens:
        r.append_output_token(5)


# ---------------------------------------------------------------- the manager alone
def test_blocks_behind_the_window_go_back_and_point_at_the_null_block():
    kv = KVCacheManager(20, 4, enable_prefix_caching=False, sliding_window=10)
    assert kv.num_usable_blocks == 19 and kv.num_free_blocks == 19
    r = _req("a", list(range(3, 23)))  # 20 prompt tokens
    _step(kv, r, 8)
    _step(kv, r, 12)  # queries 8..19: query 8 sees keys 0..8, nothing released yet
    assert kv.num_released("a") == 0
    ids = kv.get_block_ids("a")
    assert 0 not in ids and len(ids) == 5
    held: list[int] = []
    for _ in range(30):  # decodes: query q sees keys q - 9 .. q
        q0 = r.num_computed_tokens
        _step(kv, r, 1)
        ids = kv.get_block_ids("a")
        released = kv.num_released("a")
        assert released == max(0, q0 - 10 + 1) // 4
        assert ids[:released] == [0] * released and 0 not in ids[released:]
        # every key the step's query sees is in a held block
        assert all(ids[p // 4] != 0 for p in range(max(0, q0 - 9), q0 + 1))
        held.append(len(ids) - released)
        assert kv.num_free_blocks == 19 - held[-1]
    assert max(held) <= kv.max_blocks_held(10**6, 1) == 4  # ceil((10 - 1 + 1) / 4) + 1
    # the slots the kernels write are the held blocks'
    q0 = r.num_computed_tokens
    assert all(s // 4 != 0 for s in slot_mapping_for(kv.get_block_ids("a"), q0, q0 + 1, 4))
    kv.free(r)
    assert kv.num_free_blocks == 19 and kv.stats().blocks_used == 0


def test_window_slack_keeps_keys_behind_the_first_query():
    kv = KVCacheManager(20, 4, enable_prefix_caching=False, sliding_window=8, window_slack=5)
    r = _req("a", list(range(3, 43)))
    _step(kv, r, 40)
    _step(kv, r, 1)  # q0 = 40: keys >= 40 - 8 + 1 - 5 = 28 kept
    assert kv.num_released("a") == 28 // 4


def test_released_blocks_stay_findable_and_hits_behind_the_window_are_not_taken():
    B, W = 4, 6
    kv = KVCacheManager(40, B, sliding_window=W)
    prompt = list(range(10, 42))  # 32 tokens, 8 full blocks
    a = _req("a", prompt)
    _step(kv, a, 32)
    for _ in range(4):
        _step(kv, a, 1)
    assert kv.num_released("a") == (35 - W + 1) // B == 7
    kv.free(a)
    assert kv.stats().blocks_used == 0
    # the same prompt again: the whole chain is still cached (released blocks kept their hash)
    b = _req("b", prompt + [7, 7, 7, 7, 7])  # 37 tokens: 9 full blocks may hit, 8 are cached
    hits, n = kv.get_computed_blocks(b)
    assert n == 32 and len(hits) == 8
    taken = kv.taken_hits(hits)
    assert len(taken) == 8 - (32 - W + 1) // B  # queries from 32 on see keys 27..: blocks 6, 7
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 5, hits) is not None
    b.num_computed_tokens = 32
    ids = kv.get_block_ids("b")
    assert ids[:6] == [0] * 6 and ids[6:8] == [h.block_id for h in hits[6:]]
    assert kv.num_released("b") == 6
    assert kv.num_free_blocks == free_before - 2 - 2  # two hits out of the queue, two fresh
    b.num_computed_tokens += 5
    b.append_output_token(5)
    _step(kv, b, 1)  # block 8 (tokens 32..35) fills and registers, chained after hit 7
    c = _req("c", prompt + [7, 7, 7, 7, 9])
    hits_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 36 and hits_c[-1].block_id == ids[8]
    kv.free(b)
    assert kv.stats().blocks_used == 0


def test_hit_needs_only_the_blocks_the_window_shows():
    """The head of a cached prompt evicted (released blocks go first): a later request with
    that prompt still hits, from the right, the blocks its first query can see."""
    kv = KVCacheManager(12, 4, sliding_window=8)  # 11 usable blocks
    prompt = list(range(10, 50))  # 40 tokens, 10 full blocks
    a = _req("a", prompt)
    _step(kv, a, 40)
    _step(kv, a, 1)  # q0 = 40: blocks 0..7 released (still cached)
    assert kv.num_released("a") == 8
    a_ids = kv.get_block_ids("a")[:]
    kv.free(a)
    filler = _req("f", list(range(100, 116)))
    _step(kv, filler, 16)  # 4 blocks: the uncached one, then the 3 oldest cached (blocks 0..2)
    assert kv.stats().num_evictions == 3
    b = _req("b", prompt + [7, 7, 7])
    hits, n = kv.get_computed_blocks(b)
    assert n == 40 and len(hits) == 10  # left to right it would find none
    assert [h.block_id for h in hits] == [0] * 8 + a_ids[8:10]
    assert kv.allocate_slots(b, 3, hits) is not None
    b.num_computed_tokens = 40
    assert kv.get_block_ids("b")[:10] == [0] * 8 + a_ids[8:10]
    assert kv.num_released("b") == 8
    # registration chains on from the last hit: b's next full block is found again
    b.num_computed_tokens = 43
    b.append_output_token(5)
    _step(kv, b, 1)
    c = _req("c", prompt + [7, 7, 7, 5, 1])
    assert kv.get_computed_blocks(c)[1] == 44
    kv.free(b)
    kv.free(filler)
    assert kv.stats().blocks_used == 0


def test_window_hit_refuses_a_broken_run():
    """A run whose blocks do not chain (here: a cached block's parent replaced) is no hit."""
    kv = KVCacheManager(12, 4, sliding_window=8)
    prompt = list(range(10, 50))
    a = _req("a", prompt)
    _step(kv, a, 40)
    _step(kv, a, 1)
    kv.free(a)
    b = _req("b", prompt + [7, 7, 7])
    hits, _ = kv.get_computed_blocks(b)
    hits[9].parent_cid = -12345  # as if block 9 had been registered after another block 8
    for blk in kv.pool.blocks[1:]:  # force the right-to-left search: block 0's hash gone
        if blk.block_hash is not None and blk.token_ids == tuple(prompt[:4]):
            del kv.pool.cached[blk.block_hash]
            blk.block_hash = None
    b2 = _req("b2", prompt + [7, 7, 7])
    hits2, n2 = kv.get_computed_blocks(b2)
    # k = 10 needs blocks 8, 9 chained: broken; k = 9 needs blocks 7, 8: fine
    assert n2 == 36 and [h.block_id for h in hits2[:7]] == [0] * 7


def test_stats_count_only_the_held_tokens():
    kv = KVCacheManager(20, 4, enable_prefix_caching=False, sliding_window=4)
    r = _req("a", list(range(3, 23)))
    _step(kv, r, 20)
    _step(kv, r, 1)  # q0 = 20: keys 17.. kept, blocks 0..3 released
    s = kv.stats()
    assert kv.num_released("a") == 4
    assert (s.blocks_used, s.tokens_stored, s.num_blocks) == (2, 21 - 16, 19)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_window_refused(bad):
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        KVCacheManager(8, 4, sliding_window=bad)


# ----------------------------------------------------------------- through the engine
PARAMS = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)


def _peak_blocks(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS
                 ) -> tuple[list[list[int]], int]:
    """The greedy tokens, and the most blocks held once a step was allocated; asserts that
    some table entry was released and that every block came back."""
    engine = llm.engine
    kv = engine.kv_manager
    peak = released = 0
    schedule = engine.scheduler.schedule

    def recording_schedule():
        nonlocal peak, released
        out = schedule()
        peak = max(peak, kv.stats().blocks_used)
        released = max([released, *(kv.num_released(r.request_id) for r, _ in out.scheduled)])
        return out

    engine.scheduler.schedule = recording_schedule
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert released > 0, "no block went back behind the window"
    assert kv.stats().blocks_used == 0
    return [o.outputs[0].token_ids for o in outs], peak


def test_engine_releases_blocks_and_keeps_transformers_tokens(tiny_checkpoint):
    path = tiny_checkpoint("mistral_window")  # every layer sliding, window 24
    prompts = random_prompts(2, 40, 60, seed=11)
    expected = hf_greedy(path, prompts, PARAMS.max_tokens)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4,
              attention_backend="torch_native", max_num_batched_tokens=16, max_num_seqs=1)
    assert llm.engine.release_window == 24
    got, peak = _peak_blocks(llm, prompts)
    assert got == expected
    # one request at a time, 16-token chunks: ceil((24 - 1 + 16) / 4) + 1 blocks at most,
    # where the whole run (up to 89 tokens) would take 23
    assert peak <= llm.engine.kv_manager.max_blocks_held(10**6, 16) == 11


def test_request_longer_than_the_pool_runs_behind_the_window(tiny_checkpoint):
    """12 blocks of 4 (11 usable): 48 tokens of cache, an 80-token run fits behind the
    window; a model without a window refuses it."""
    path = tiny_checkpoint("mistral_window")
    prompt = random_prompts(1, 50, 50, seed=12)[0]
    expected = hf_greedy(path, [prompt], PARAMS.max_tokens)
    kw = dict(dtype="float32", device="cpu", block_size=4, num_gpu_blocks=12,
              attention_backend="torch_native", max_num_batched_tokens=16, max_model_len=128)
    llm = LLM(str(path), **kw)
    assert [o.outputs[0].token_ids for o in llm.generate([prompt], PARAMS, use_tqdm=False)] \
        == expected
    full = LLM(str(tiny_checkpoint("llama2_mha")), **kw)
    assert full.engine.release_window is None
    out = full.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert out.error is not None and not out.outputs
    assert "need 20 KV blocks of 4 tokens at once" in out.error and "only 12 blocks" in out.error


def test_second_turn_hits_behind_the_window_after_its_head_was_evicted(tiny_checkpoint,
                                                                      monkeypatch):
    """A conversation's first turn, other prompts that evict its head (released first),
    then the next turn: it hits the cached tail the window shows, and its tokens are
    transformers'."""
    path = tiny_checkpoint("mistral_window")
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4, num_gpu_blocks=24,
              attention_backend="torch_native", max_num_batched_tokens=16, max_num_seqs=1)
    kv = llm.engine.kv_manager
    turn1 = random_prompts(1, 60, 60, seed=16)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out1 = llm.generate([turn1], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate(random_prompts(1, 40, 40, seed=17), params, use_tqdm=False)  # evicts the head
    assert kv.stats().num_evictions > 0
    window_hits = []  # (the plain prefix hit's blocks, the hit's)
    plain, computed = KVCacheManager.prefix_hit, KVCacheManager.get_computed_blocks

    def spy_plain(self, request, max_blocks):
        got = plain(self, request, max_blocks)
        window_hits.append((len(got[0]), None))
        return got

    def spy(self, request):
        got = computed(self, request)
        window_hits[-1] = (window_hits[-1][0], len(got[0]))
        return got

    monkeypatch.setattr(KVCacheManager, "prefix_hit", spy_plain)
    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", spy)
    turn2 = turn1 + out1 + random_prompts(1, 5, 5, seed=18)[0]
    hits_before = kv.prefix_hits
    got = llm.generate([turn2], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(path, [turn2], params.max_tokens)[0]
    assert any(n > p for p, n in window_hits), window_hits  # found from the right
    assert kv.prefix_hits - hits_before >= 40
    assert kv.stats().blocks_used == 0


def test_staggered_batch_behind_the_window_matches_transformers(tiny_checkpoint):
    """Chunked prefill, preemption and prefix hits with blocks released behind the window
    (40 blocks, the other models' pool, never run short behind it: the helper gives 20)."""
    assert_staggered_matches_hf(tiny_checkpoint("mistral_window"), attention_backend="torch_native")


def test_mixed_windows_release_nothing_in_one_table(tiny_checkpoint, tmp_path):
    """A model whose layers do not share one window (here: windowed and full layers) keeps
    every block of its one table when KV cache groups are off (test_hybrid_kv_groups.py:
    on), as does a full-attention draft beside a windowed target."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mixed")
    llm = LLM(str(tmp_path / "mixed"), dtype="float32", device="cpu", block_size=4,
              disable_hybrid_kv_cache_manager=True)
    assert llm.engine.release_window is None and llm.engine.kv_manager.null_block is None
    target = tiny_checkpoint("mistral_window")
    spec = LLM(str(target), dtype="float32", device="cpu", block_size=4,
               speculative_config={"model": str(tiny_checkpoint("llama2_mha")),
                                   "num_speculative_tokens": 2})
    assert spec.engine.release_window is None


def test_windowed_draft_beside_windowed_target_keeps_its_slack(tiny_checkpoint):
    path = tiny_checkpoint("mistral_window")
    prompts = random_prompts(2, 30, 50, seed=13)
    expected = hf_greedy(path, prompts, PARAMS.max_tokens)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4,
              attention_backend="torch_native",
              speculative_config={"model": str(path), "num_speculative_tokens": 3})
    assert (llm.engine.release_window, llm.engine.kv_manager.window_slack) == (24, 5)
    got, _ = _peak_blocks(llm, prompts)
    assert got == expected


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/kernels sets it)")
def test_triton_backend_behind_the_window_interpreted(tmp_path):
    """The Triton prefill and decode kernels read released entries' null block (or skip
    them) and give torch_native's tokens."""
    pytest.importorskip("triton")
    path = build_tiny_checkpoint(tmp_path / "w64", "mistral_window", head_dim=64,
                                 hidden_size=128, sliding_window=20)
    prompts = random_prompts(2, 30, 45, seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for backend in ("torch_native", "triton"):
        llm = LLM(str(path), dtype="float32", device="cpu", block_size=16,
                  attention_backend=backend, max_num_batched_tokens=32)
        assert llm.engine.kv_manager.sliding_window == 20
        outs[backend], _ = _peak_blocks(llm, prompts, params)
    assert outs["triton"] == outs["torch_native"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_behind_the_window(tmp_path):
    """On the GPU (fp32, triton backend, decode graphs): released entries' null block in
    the captured tables, transformers' tokens with graphs and eagerly."""
    path = build_tiny_checkpoint(tmp_path / "w64", "mistral_window", head_dim=64,
                                 hidden_size=128, sliding_window=20)
    prompts = random_prompts(6, 30, 90, seed=15)
    llm = assert_gpu_graphs_match_hf(path, prompts)
    assert llm.engine.kv_manager.sliding_window == 20
    got, _ = _peak_blocks(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                       ignore_eos=True))
    assert got == hf_greedy(path, prompts, 24)
