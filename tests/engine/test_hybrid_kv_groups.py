"""KV cache groups (kv_cache/hybrid.py): a model whose layers mix one sliding window with full
attention keeps a block table per group over one pool; the windowed groups give back the
blocks behind their window, the full ones keep every block, and tokens stay transformers'."""

from __future__ import annotations

import os

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.engine.cuda_graph import DecodeGraphs
from flashpage.engine.sequence import Request
from flashpage.kv_cache.hybrid import HybridHits, HybridKVCacheManager, group_layers
from tests.conftest import (
    assert_gpu_graphs_match_hf,
    assert_staggered_matches_hf,
    hf_greedy,
    random_prompts,
)

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64))


def _step(kv: HybridKVCacheManager, r: Request, n: int, hits=None) -> None:
    assert kv.allocate_slots(r, n, hits) is not None
    r.num_computed_tokens += n
    while r.num_computed_tokens >= r.num_tokens:
        r.append_output_token(5)


def _held(kv: HybridKVCacheManager, rid: str, g: int) -> int:
    return len(kv.get_block_ids(rid, g)) - kv.num_released(rid, g)


# ---------------------------------------------------------------- layout
def test_groups_of_equal_size_over_slots():
    # Gemma 3 27B: 62 layers, every 6th full -> 10 full (one group), 52 windowed (6 groups)
    lay = group_layers([None if (i + 1) % 6 == 0 else 1024 for i in range(62)])
    assert lay is not None and lay.num_slots == 10
    assert lay.windows == (None, *[1024] * 6)
    assert lay.layer_group[5] == 0 and lay.layer_slot[5] == 0 and lay.layer_slot[11] == 1
    assert lay.layer_group[:5] == (1, 1, 1, 1, 1) and lay.layer_slot[:5] == (0, 1, 2, 3, 4)
    # every (group, slot) pair names one layer: no two layers share a block's memory
    pairs = list(zip(lay.layer_group, lay.layer_slot, strict=True))
    assert len(set(pairs)) == 62
    # Gemma 2 alternates: g = 1 each... of 13 full and 13 windowed -> 13 slots, 2 groups
    lay2 = group_layers([4096, None] * 13)
    assert lay2 is not None and (lay2.num_slots, lay2.windows) == (13, (None, 4096))
    # more full layers than windowed: windowed ones set the group size
    lay3 = group_layers([None, None, None, 8])
    assert lay3 is not None and lay3.num_slots == 1 and lay3.windows == (None, None, None, 8)
    for same in ([None] * 4, [8] * 4, [8, 16, None]):  # one table serves (or two windows)
        assert group_layers(same) is None


# ---------------------------------------------------------------- the manager alone
def test_windowed_group_releases_while_the_full_group_keeps_every_block():
    kv = HybridKVCacheManager(40, 4, False, (None, 10, 10))
    assert kv.num_usable_blocks == 39
    r = _req("a", list(range(3, 23)))
    _step(kv, r, 20)
    for _ in range(30):
        q0 = r.num_computed_tokens
        _step(kv, r, 1)
        n = len(kv.get_block_ids("a", 0))
        assert kv.num_released("a", 0) == 0 and 0 not in kv.get_block_ids("a", 0)
        for g in (1, 2):
            ids = kv.get_block_ids("a", g)
            assert len(ids) == n  # the same logical length in every group
            released = kv.num_released("a", g)
            assert released == max(0, q0 - 10 + 1) // 4
            assert ids[:released] == [0] * released and 0 not in ids[released:]
        assert kv.num_free_blocks == 39 - n - _held(kv, "a", 1) - _held(kv, "a", 2)
    assert _held(kv, "a", 1) <= 4 < len(kv.get_block_ids("a", 0)) == 13
    # no block is in two tables
    held = [b for g in range(3) for b in kv.get_block_ids("a", g) if b]
    assert len(held) == len(set(held))
    kv.free(r)
    assert kv.num_free_blocks == 39 and kv.stats().blocks_used == 0


def test_chunked_group_releases_the_blocks_before_the_chunk():
    """Llama 4's chunked layers: a query at p sees keys from p // C * C, so a step gives
    back every block before its first query's chunk (C = 8, B = 4: two blocks a chunk)."""
    lay = group_layers([None] * 4, [8, None, 8, None])
    assert lay is not None and lay.windows == (None, None) and lay.chunks == (None, 8)
    kv = HybridKVCacheManager(40, 4, False, lay.windows, lay.chunks)
    r = _req("a", list(range(3, 13)))  # 10 tokens
    _step(kv, r, 10)
    for _ in range(20):
        q0 = r.num_computed_tokens
        _step(kv, r, 1)
        assert kv.num_released("a", 0) == 0
        assert kv.num_released("a", 1) == q0 // 8 * 8 // 4
        ids = kv.get_block_ids("a", 1)
        assert all(ids[p // 4] != 0 for p in range(q0 // 8 * 8, q0 + 1))
    assert kv.groups[1].max_blocks_held(10**6, 1) == 3  # ceil((8 - 1 + 1) / 4) + 1
    kv.free(r)
    assert kv.num_free_blocks == 39


def test_allocation_is_all_groups_or_none():
    kv = HybridKVCacheManager(8, 4, False, (None, 8))  # 7 usable
    a = _req("a", list(range(3, 15)))  # 12 tokens: 3 blocks a group
    assert kv.allocate_slots(a, 12) is not None
    assert kv.num_free_blocks == 1
    b = _req("b", list(range(3, 7)))  # 1 block a group: the full group's fits, not both
    assert kv.allocate_slots(b, 4) is None
    assert kv.get_block_ids("b", 0) == [] and kv.get_block_ids("b", 1) == []
    assert kv.num_free_blocks == 1


def test_prefix_hit_holds_in_every_group_and_skips_what_the_window_passed():
    B, W = 4, 6
    kv = HybridKVCacheManager(60, B, True, (None, W))
    prompt = list(range(10, 42))  # 32 tokens, 8 full blocks
    a = _req("a", prompt)
    _step(kv, a, 32)
    kv.free(a)
    b = _req("b", prompt + [7, 8, 9])
    hits, n = kv.get_computed_blocks(b)
    assert isinstance(hits, HybridHits) and n == 32
    full, win = hits.groups
    assert len(full) == len(win) == 8
    # the windowed group's blocks no query of b's first step sees are not taken
    lo = (32 - W + 1) // B
    assert kv.taken_hits(hits) == full + win[lo:]
    free_before = kv.num_free_blocks
    _step(kv, b, 3, hits)
    assert kv.get_block_ids("b", 0)[:8] == [x.block_id for x in full]
    assert kv.num_released("b", 1) == lo and kv.get_block_ids("b", 1)[:lo] == [0] * lo
    assert kv.num_free_blocks == free_before - 8 - (8 - lo) - 2  # hits taken, one new a group
    assert kv.stats().prefix_hits == 32
    kv.free(b)


def test_hit_is_cut_to_what_every_group_holds():
    """The full group's hit is cut back where the windowed group lost a block its first
    query would see (evicted): one length for all groups."""
    B, W = 4, 6
    kv = HybridKVCacheManager(60, B, True, (None, W))
    prompt = list(range(10, 42))
    a = _req("a", prompt)
    _step(kv, a, 32)
    kv.free(a)
    win_block = kv.groups[1].get_blocks("a")  # gone: look them up by hash instead
    assert win_block == []
    b = _req("b", prompt + [7])
    kv.groups[1].prefix_hit(b, 8)  # the hashes
    key = kv.groups[1]._keys(b.block_hashes, 8)[7]
    evicted = kv.pool.cached.pop(key)  # the windowed group's last block, evicted
    evicted.reset_content()
    hits, n = kv.get_computed_blocks(b)
    assert n < 32 and len(hits.groups[0]) == len(hits.groups[1]) == n // B


# ---------------------------------------------------------------- the engine
def _mixed_checkpoint(tmp_path, head_dim: int = 16, layers: tuple[str, ...] = (
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention")):
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layers),
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, sliding_window=8,
        layer_types=list(layers), max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.2)
    path = tmp_path / f"mixed{head_dim}"
    model.save_pretrained(path)
    return path


def _peak(llm: LLM, prompts, params=PARAMS):
    engine, peak = llm.engine, 0
    kv = engine.kv_manager
    schedule = engine.scheduler.schedule

    def recording():
        nonlocal peak
        out = schedule()
        peak = max(peak, kv.stats().blocks_used)
        return out

    engine.scheduler.schedule = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert kv.stats().blocks_used == 0
    return [o.outputs[0].token_ids for o in outs], peak


def test_engine_groups_give_transformers_tokens_in_fewer_layer_blocks(tmp_path):
    path = _mixed_checkpoint(tmp_path)
    prompts = random_prompts(3, 30, 50, seed=3)
    expected = hf_greedy(path, prompts, PARAMS.max_tokens)
    kw = dict(dtype="float32", device="cpu", block_size=4, attention_backend="torch_native",
              max_num_batched_tokens=16, max_num_seqs=1)
    llm = LLM(str(path), **kw)
    lay = llm.engine.kv_layout
    assert isinstance(llm.engine.kv_manager, HybridKVCacheManager)
    assert lay is not None and lay.windows == (None, 8, 8, 8) and lay.num_slots == 1
    got, peak = _peak(llm, prompts)
    assert got == expected
    one = LLM(str(path), **kw, disable_hybrid_kv_cache_manager=True)
    assert one.engine.kv_layout is None and one.engine.kv_manager.null_block is None
    got1, peak1 = _peak(one, prompts)
    assert got1 == expected
    # layer-blocks held at the peak: a block is 1 layer's slot grouped, all 4 layers' in one
    assert peak * lay.num_slots < 0.7 * peak1 * 4


def test_request_beyond_the_single_table_pool_runs_in_groups(tmp_path):
    """30 blocks of one layer each: one 66-token run needs 17 (full) + 3 x 5 (windows) = 32
    -> refused; 50 blocks run it, where one table for the 4 layers would need 17 blocks of
    4 layers (68 layer-blocks)."""
    path = _mixed_checkpoint(tmp_path)
    prompt = random_prompts(1, 50, 50, seed=5)[0]
    kw = dict(dtype="float32", device="cpu", block_size=4, attention_backend="torch_native",
              max_num_batched_tokens=8, max_model_len=128)
    small = LLM(str(path), num_gpu_blocks=30, **kw)
    out = small.generate([prompt], PARAMS, use_tqdm=False)[0]
    assert out.error is not None and "KV blocks of 4 tokens at once" in out.error
    llm = LLM(str(path), num_gpu_blocks=50, **kw)
    got = llm.generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(path, [prompt], PARAMS.max_tokens)[0]
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_staggered_batch_in_groups_matches_transformers(tmp_path):
    """Chunked prefill, preemption and prefix hits over the groups' tables."""
    assert_staggered_matches_hf(_mixed_checkpoint(tmp_path), attention_backend="torch_native")


def test_llama4_chunked_layers_in_groups_give_transformers_tokens(tmp_path):
    """Llama 4's chunked layers as a group that gives back the blocks before the chunk
    (torch_native: the mask), its NoPE global layers as the full group."""
    import transformers

    config = transformers.Llama4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, no_rope_layer_interval=2, interleave_moe_layer_step=2,
        attention_chunk_size=8, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.2)
    model.save_pretrained(tmp_path / "llama4")
    path = tmp_path / "llama4"
    prompts = random_prompts(2, 30, 45, seed=8)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4,
              attention_backend="torch_native", max_num_batched_tokens=16, max_num_seqs=1)
    lay = llm.engine.kv_layout
    assert lay is not None and lay.chunks == (None, 8)
    kv = llm.engine.kv_manager
    released = 0
    schedule = llm.engine.scheduler.schedule

    def recording():
        nonlocal released
        out = schedule()
        released = max([released, *(kv.num_released(r.request_id, 1) for r, _ in out.scheduled)])
        return out

    llm.engine.scheduler.schedule = recording
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert got == hf_greedy(path, prompts, PARAMS.max_tokens)
    assert released > 0 and kv.stats().blocks_used == 0


def test_draft_model_keeps_one_table(tmp_path, tiny_checkpoint):
    path = _mixed_checkpoint(tmp_path)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=4,
              speculative_config={"model": str(tiny_checkpoint("llama2_mha")),
                                  "num_speculative_tokens": 2})
    assert llm.engine.kv_layout is None


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/kernels sets it)")
def test_triton_backend_and_padded_graph_steps_in_groups_interpreted(tmp_path):
    """The Triton kernels over each group's tables, and the graphs' padded static-buffer
    steps (decode, prompt, piecewise; run eagerly on the CPU) with each group's static
    tables and slot mappings, give torch_native's tokens."""
    pytest.importorskip("triton")
    path = _mixed_checkpoint(tmp_path, head_dim=32)
    prompts = random_prompts(3, 20, 40, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", device="cpu", block_size=16, max_num_batched_tokens=32)
    ref, _ = _peak(LLM(str(path), attention_backend="torch_native", **kw), prompts, params)
    llm = LLM(str(path), attention_backend="triton", **kw)
    assert llm.engine.kv_layout is not None
    got, _ = _peak(llm, prompts, params)
    assert got == ref
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, 4, 16, runner.device, groups=runner.num_groups)
    runner.capture_prefill_graphs(32, llm.engine.max_model_len, capture=False)
    runner.capture_piecewise_graphs(32, capture=False)
    assert len(runner.graphs.group_tables) == 3
    got, _ = _peak(llm, prompts, params)
    assert got == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_in_groups(tmp_path):
    """On the GPU (fp32, triton, decode / prompt / piecewise graphs captured): each group's
    static tables and slot mappings, transformers' tokens with graphs and eagerly."""
    path = _mixed_checkpoint(tmp_path, head_dim=64)
    prompts = random_prompts(6, 30, 90, seed=15)
    llm = assert_gpu_graphs_match_hf(path, prompts)
    assert llm.engine.kv_layout is not None and llm.engine.runner.graphs is not None
    assert len(llm.engine.runner.graphs.group_tables) == 3
