"""KV cache offloading (--kv-offloading-size, engine/kv_offload.py): a GPU pool too small
to keep a shared prefix between two waves of requests; with a host tier the second wave
loads the prefix back instead of computing it, and its tokens stay those of an engine
without one (and transformers'). Also: MLA and fp8 caches, preemption, aborts, no leaks,
the errors for what it does not cover, and the flags."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.cli import build_parser
from flashpage.config import ConfigError, EngineConfig, ModelConfig
from flashpage.engine.kv_offload import host_block_bytes
from flashpage.engine.llm_engine import LLMEngine
from tests.conftest import hf_greedy, random_prompts, run_staggered, staggered_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SHARED = random_prompts(1, 64, 64, seed=7)[0]
WAVE1 = [SHARED + p for p in random_prompts(2, 3, 9, seed=1)]
FILLER = random_prompts(3, 60, 70, seed=9)  # pushes the shared prefix out of the GPU pool
WAVE2 = [SHARED + p for p in random_prompts(2, 3, 9, seed=2)]


def _engine(path, host_blocks: int = 0, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", device="cpu", block_size=8, num_gpu_blocks=24,
               max_num_batched_tokens=64, max_num_seqs=4, attention_backend="torch_native")
    cfg.update(kw)
    per_block = ModelConfig.from_hf(path).kv_bytes_per_token(
        "fp8" if cfg.get("kv_cache_dtype") == "fp8" else "float32") * cfg["block_size"]
    if host_blocks:  # the GiB that hold exactly host_blocks blocks of this model
        cfg["kv_offloading_size"] = host_blocks * per_block / (1 << 30)
    engine = LLMEngine(EngineConfig(**cfg))
    if engine.offload is not None and "speculative_config" not in kw:
        # a host row: one block of every layer, as the profiler counts
        assert engine.offload.block_bytes == host_block_bytes(engine.runner.kv_caches) == per_block
    return engine


def _waves(engine: LLMEngine, waves=(WAVE1, FILLER, WAVE2), params=GREEDY) -> list[dict]:
    """Each wave run to the end before the next is added: its tokens, cached and host-cached
    tokens per request, and the tokens the engine computed for it."""
    computed = 0
    schedule = engine.scheduler.schedule

    def counting():
        nonlocal computed
        out = schedule()
        computed += out.total_num_scheduled_tokens
        return out

    engine.scheduler.schedule = counting
    out = []
    for wave in waves:
        computed = 0
        ids = [engine.add_request(None, p, params) for p in wave]
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        out.append({"tokens": [done[i].outputs[0].token_ids for i in ids],
                    "cached": [done[i].metrics.num_cached_tokens for i in ids],
                    "host": [done[i].metrics.num_host_cached_tokens for i in ids],
                    "computed": computed})
    return out


def _assert_no_leaks(engine: LLMEngine) -> None:
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    if engine.offload is not None:
        host = engine.offload.host
        assert not host.has_pending and all(e.pins == 0 for e in host.blocks)
        assert host.num_free_blocks + host.num_cached_blocks == host.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_second_wave_is_served_from_the_host_tier(tiny_checkpoint, async_scheduling):
    """Synchronous steps, and asynchronous ones (a step read back after the next is
    scheduled and its copies queued)."""
    path = tiny_checkpoint("llama31_gqa")
    off = _engine(path, host_blocks=64, async_scheduling=async_scheduling)
    assert off.offload is not None and off.offload.num_blocks == 64
    assert not off.offload.memory.is_pinned()  # plain CPU memory without CUDA
    got = _waves(off)
    plain = _waves(_engine(path, async_scheduling=async_scheduling))
    # without the host tier the filler evicted the prefix: the second wave recomputes it
    assert plain[2]["cached"][0] == 0
    # with it: the first request of the wave loads all 8 shared blocks from the host, the
    # second finds them on the GPU again (loaded by the first)
    assert got[2]["host"] == [64, 0] and got[2]["cached"] == [64, 64]
    assert got[2]["computed"] == plain[2]["computed"] - 64
    assert [w["tokens"] for w in got] == [w["tokens"] for w in plain]
    want = hf_greedy(path, WAVE2, GREEDY.max_tokens)
    assert got[2]["tokens"] == want
    stats = off.stats()["kv_cache"]
    assert stats.host_hits == 64 and stats.host_loads == 8 and stats.host_stores > 0
    assert stats.prefix_hits >= 64 + 64 + 64  # wave 1's second request, wave 2's two
    _assert_no_leaks(off)


@pytest.mark.parametrize("async_loads", [True, False])
def test_a_full_host_pool_evicts_its_least_recent_blocks(tiny_checkpoint, monkeypatch, async_loads):
    """A host tier of 4 blocks: the shared prefix's blocks go out of the GPU pool tail
    first (its block 0 last), and the filler's blocks stored after them push all but the
    most recent, block 0, out of the host. The second wave loads that one block, computes
    the rest, and its tokens are unchanged. Loads before the step's forward: the second
    request of the wave, admitted in the same step, hits the 7 blocks the first computes
    there too; asynchronous loads: the first computes nothing in its admission step, so
    the second hits only the block still loading, waits for it too and computes its own."""
    monkeypatch.setenv("FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS", "1" if async_loads else "0")
    path = tiny_checkpoint("llama31_gqa")
    off = _engine(path, host_blocks=4)
    assert off.offload.host.async_loads is async_loads
    got = _waves(off, (WAVE1, FILLER))
    host = off.offload.host
    assert host.num_evictions > 0 and host.num_cached_blocks == 4
    held = [e.token_ids for e in host.cached.values()]
    assert tuple(SHARED[:8]) in held and tuple(SHARED[8:16]) not in held
    got += _waves(off, (WAVE2,))
    # (the 2nd: all on the GPU)
    assert got[2]["host"] == [8, 0] and got[2]["cached"] == ([8, 8] if async_loads else [8, 64])
    assert [w["tokens"] for w in got] == [w["tokens"] for w in _waves(_engine(path))]
    _assert_no_leaks(off)


@pytest.mark.parametrize("kind", ["mla", "fp8"])
def test_mla_and_fp8_caches_travel_as_their_bytes(tiny_checkpoint, tiny_mla_checkpoint, kind):
    if kind == "mla":
        path, kw = tiny_mla_checkpoint("deepseek_v2"), {}
    else:
        path, kw = tiny_checkpoint("head64_gqa"), {"kv_cache_dtype": "fp8"}
    off = _engine(path, host_blocks=64, **kw)
    caches = off.runner.kv_caches
    if kind == "mla":
        assert all(isinstance(c, torch.Tensor) for c in caches)  # one latent tensor a layer
    else:
        assert caches[0][0].dtype == torch.float8_e4m3fn
    got = _waves(off)
    assert got[2]["host"][0] == 64
    assert [w["tokens"] for w in got] == [w["tokens"] for w in _waves(_engine(path, **kw))]
    _assert_no_leaks(off)


def test_preemption_chunks_and_staggered_arrivals_keep_transformers_tokens(tiny_checkpoint):
    """The staggered run of assert_staggered_matches_hf (block 4, 20 GPU blocks: chunked
    prefill, mixed steps, preemption) run twice on one engine: the second time, the shared
    prefix and the prompts evicted by the first run come back from the host tier."""
    path = tiny_checkpoint("llama31_gqa")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = staggered_prompts()
    want = hf_greedy(path, prompts, params.max_tokens)
    off = _engine(path, host_blocks=256, block_size=4, num_gpu_blocks=20,
                  max_num_batched_tokens=24, max_num_seqs=6)
    first = run_staggered(off, prompts, params)
    assert off.scheduler.num_preemptions > 0 and first["chunks"]
    assert first["outputs"] == want
    off.scheduler.schedule = type(off.scheduler).schedule.__get__(off.scheduler)
    second = run_staggered(off, prompts, params)
    assert second["outputs"] == want
    assert off.kv_manager.stats().host_hits > 0
    _assert_no_leaks(off)


def test_an_abort_after_a_host_load_leaks_nothing(tiny_checkpoint):
    path = tiny_checkpoint("llama31_gqa")
    off = _engine(path, host_blocks=64)
    _waves(off, (WAVE1, FILLER))
    off.add_request("gone", WAVE2[0], GREEDY)
    off.step()  # admitted: the prefix loaded from the host, its first chunk computed
    assert off.stats()["kv_cache"].host_hits == 64
    off.abort_request("gone")
    _assert_no_leaks(off)
    # the loaded blocks stay cached and correct: the next request's tokens are unchanged
    got = _waves(off, (WAVE2,))
    plain = _engine(path)
    assert got[0]["tokens"] == _waves(plain, (WAVE1, FILLER, WAVE2))[2]["tokens"]
    assert got[0]["cached"][0] == 64
    _assert_no_leaks(off)


def test_reset_prefix_cache_forgets_the_host_tier_too(tiny_checkpoint):
    off = _engine(tiny_checkpoint("llama31_gqa"), host_blocks=64)
    _waves(off, (WAVE1, FILLER))
    assert off.offload.host.num_cached_blocks > 0
    assert off.reset_prefix_cache()
    assert off.offload.host.num_cached_blocks == 0
    assert _waves(off, (WAVE2,))[0]["host"] == [0, 0]


# ---------------------------------------------------------------- what it does not cover
def test_offloading_needs_prefix_caching():
    with pytest.raises(ConfigError, match=r"second tier of the prefix cache, which is off"):
        EngineConfig(kv_offloading_size=1, enable_prefix_caching=False)


@pytest.mark.parametrize("kw,match", [
    (dict(kv_offloading_size=-1), r"kv_offloading_size must be a number of GiB >= 0"),
    (dict(kv_offloading_size="4"), r"kv_offloading_size must be a number of GiB >= 0"),
    (dict(kv_offloading_size=float("nan")), r"kv_offloading_size must be a number of GiB >= 0"),
    (dict(kv_offloading_backend="lmcache"), r"kv_offloading_backend must be 'native'"),
])
def test_bad_offloading_options_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_a_size_that_holds_no_block_is_named(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"kv_offloading_size 1e-09 GiB holds no KV block: "
                                          r"one block of every layer takes \d+ bytes"):
        _engine(tiny_checkpoint("llama31_gqa"), kv_offloading_size=1e-9)


def test_a_sliding_window_model_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"not supported here: this model \(MistralForCausalLM\) "
                                          r"attends within a sliding window of 24 tokens"):
        _engine(tiny_checkpoint("mistral_window"), kv_offloading_size=0.01)


def test_kv_cache_groups_are_refused_and_one_table_is_not(tmp_path):
    from tests.engine.test_hybrid_kv_groups import _mixed_checkpoint

    path = _mixed_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match=r"mixes sliding-window and full-attention layers "
                                          r"\(KV cache groups\); --disable-hybrid-kv-cache-manager"):
        _engine(path, kv_offloading_size=0.01)
    eng = _engine(path, kv_offloading_size=0.01, disable_hybrid_kv_cache_manager=True)
    assert eng.offload is not None


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculative_decoding_over_the_host_tier(tiny_checkpoint, method):
    """A draft model's K/V pool uses the target's block ids: a host block carries both, so
    the second wave's prefix comes back into both pools. The draft here is the target
    itself, whose greedy drafts are all right exactly when its K/V is (a prefix loaded
    into the target's pool only would leave the draft reading stale blocks); n-gram drafts
    keep no pool."""
    path = tiny_checkpoint("llama31_gqa")
    spec = ({"model": str(path), "num_speculative_tokens": 2} if method == "draft_model" else
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    off = _engine(path, host_blocks=64, speculative_config=spec)
    per_block = ModelConfig.from_hf(path).kv_bytes_per_token("float32") * 8
    assert off.offload.block_bytes == per_block * (2 if method == "draft_model" else 1)
    got = _waves(off)
    assert got[2]["host"][0] == 64
    assert [w["tokens"] for w in got] == [w["tokens"] for w in _waves(_engine(path))]
    if method == "draft_model":
        st = off.stats()["spec_decode"]
        assert st["num_draft_tokens"] > 0 and st["num_accepted_tokens"] == st["num_draft_tokens"], st
    _assert_no_leaks(off)


def test_an_eagle_heads_pool_travels_with_the_targets(tmp_path):
    """An EAGLE head keeps a one-layer pool over the target's block ids: the host rows hold
    it too, and the tokens (greedy: the target's) equal the engine's without a host tier."""
    from tests.conftest import build_tiny_checkpoint
    from tests.engine.test_eagle_draft import _heads_over

    ck = _heads_over(build_tiny_checkpoint(tmp_path / "base", "llama31_gqa"), tmp_path)
    spec = {"method": "eagle", "model": str(ck["eagle"]), "num_speculative_tokens": 2}
    off = _engine(ck["base"], host_blocks=64, speculative_config=spec)
    target = host_block_bytes(off.runner.kv_caches)
    assert off.offload.block_bytes > target  # and the head's layer
    got = _waves(off)
    assert got[2]["host"][0] == 64
    assert [w["tokens"] for w in got] == [w["tokens"] for w in _waves(_engine(ck["base"]))]
    assert off.stats()["spec_decode"]["num_draft_tokens"] > 0
    _assert_no_leaks(off)


# ---------------------------------------------------------------- the flags
def test_flags_reach_the_engine(tiny_checkpoint, monkeypatch):
    import flashpage.cli as cli

    args = build_parser().parse_args(["serve", "--kv-offloading-size", "0.5",
                                      "--kv-offloading-backend", "native"])
    assert (args.kv_offloading_size, args.kv_offloading_backend) == (0.5, "native")
    seen = {}
    monkeypatch.setattr("flashpage.llm.LLM", lambda model, **kw: seen.update(kw))
    cli.build_llm(args)
    assert (seen["kv_offloading_size"], seen["kv_offloading_backend"]) == (0.5, "native")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-offloading-backend", "lmcache"])
    llm = LLM(str(tiny_checkpoint("llama31_gqa")), dtype="float32", device="cpu", block_size=8,
              attention_backend="torch_native", num_gpu_blocks=24, kv_offloading_size=0.001)
    assert llm.engine.config.kv_offloading_size == 0.001 and llm.engine.offload is not None


def test_prometheus_metrics_count_host_hits(tiny_checkpoint):
    pytest.importorskip("prometheus_client")
    from flashpage.server.metrics import ServerMetrics

    off = _engine(tiny_checkpoint("llama31_gqa"), host_blocks=64)
    _waves(off)
    m = ServerMetrics()
    m.set_engine_stats(off.stats())
    text = m.render().decode()
    assert "flashpage:prefix_cache_host_hits_total 64.0" in text
    assert "flashpage:kv_offload_loaded_blocks_total 8.0" in text
    assert "flashpage:kv_offload_blocks_total 64.0" in text
    m.set_engine_stats(_engine(tiny_checkpoint("llama31_gqa")).stats())
    assert "host_hits" not in m.render().decode()  # no host tier: no host series


# ---------------------------------------------------------------- the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_loads", [True, False])
def test_second_wave_from_pinned_host_memory_on_the_gpu(tiny_checkpoint, monkeypatch, async_loads):
    """On CUDA, graphs and async scheduling on: the host tier is pinned, the stores'
    copies run on a side stream, the loads' on a load stream (only the requests reading
    them wait; or on the compute stream before the forward), and the tokens equal the
    engine without one and transformers'."""
    monkeypatch.setenv("FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS", "1" if async_loads else "0")
    path = tiny_checkpoint("head64_gqa")
    kw = dict(device="cuda", attention_backend="triton", block_size=16, num_gpu_blocks=12)
    off = _engine(path, host_blocks=64, **kw)
    assert off.offload.memory.is_pinned() and off.async_scheduling
    assert off.offload.copy_stream is not None  # the stores' copies beside the forward
    assert (off.offload.load_stream is not None) is async_loads
    got = _waves(off)
    plain = _waves(_engine(path, **kw))
    assert got[2]["host"][0] == 64 and got[2]["computed"] < plain[2]["computed"]
    assert [w["tokens"] for w in got] == [w["tokens"] for w in plain]
    assert got[2]["tokens"] == hf_greedy(path, WAVE2, GREEDY.max_tokens)
    _assert_no_leaks(off)


def test_embeds_prompts_through_the_host_tier(tiny_checkpoint):
    """Prompt embeddings (engine/prompt_embeds.py) beside the host tier: their chains are
    rooted in the tensor's digest, and the host tier checks a first block's parent against
    that root, so the same embeddings come back from the host with the same tokens, while
    the token prompt of the very ids those rows embed (a different root) and other
    embeddings get nothing from it."""
    path = tiny_checkpoint("llama31_gqa")
    engine = _engine(path, host_blocks=32, enable_prompt_embeds=True)
    table = engine.model.model.embed_tokens.weight.detach()
    shared = table[torch.tensor(SHARED)].clone()
    other = shared.clone()
    other[0] += 0.5
    first = _waves(engine, waves=([shared], FILLER, [shared], [SHARED], [other]))
    plain = _waves(_engine(path, enable_prompt_embeds=True), waves=([SHARED], [other]))
    assert first[2]["host"] == [56] and first[2]["cached"] == [56]  # 7 of 8 blocks: one row computed
    assert first[2]["tokens"] == first[0]["tokens"] == first[3]["tokens"] == plain[0]["tokens"]
    assert first[3]["cached"] == [0] and first[4]["cached"] == [0]
    assert first[4]["tokens"] == plain[1]["tokens"]
    _assert_no_leaks(engine)
