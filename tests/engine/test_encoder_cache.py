"""The encoder cache (engine/encoder_cache.py): an image one request brought is not encoded
again for a later request that holds it where the prefix cache cannot share its blocks (other
text before it), nor twice for two requests of one step; the tokens are those of an engine
without the cache; capacity, least-recently-used eviction, the counters, the config check,
and reset_prefix_cache clearing it (sleep and weight writes clear it too). Tiny Qwen2-VL and Qwen3-VL (deepstack features
kept with the rows), fp32 on the CPU."""

from __future__ import annotations

import pytest
import torch

from flashpage import SamplingParams
from flashpage.config import ConfigError
from flashpage.engine.encoder_cache import EncoderCache
from tests.conftest import count_encodes as _spy
from tests.conftest import cpu_llm as _llm
from tests.conftest import ok_tokens as _tokens
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl
from tests.qwen3_vl_checkpoint import build_tiny_qwen3_vl

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    built = {}

    def get(kind: str):
        if kind not in built:
            d = tmp_path_factory.mktemp(kind)
            built[kind] = build_tiny_qwen2_vl(d) if kind == "qwen2_vl" else build_tiny_qwen3_vl(d)
        return built[kind]

    return get


def _prompt(enc, seed: int, image) -> dict:
    """Text of its own (seeded) before the image, so no two prompts share a block."""
    vs, pad, ve = enc.placeholder_ids
    text = torch.randint(3, 200, (11,), generator=torch.Generator().manual_seed(seed)).tolist()
    return {"prompt_token_ids": [1, *text[:9], vs, pad, ve, *text[9:]], "multi_modal_data": {"image": image}}


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_later_request_takes_the_kept_rows(ckpt, monkeypatch, kind):
    path = ckpt(kind)
    a, b = smooth_image(84, 112, seed=1), smooth_image(60, 90, seed=2)
    base = _llm(path, mm_encoder_cache_tokens=0)
    assert base.engine.runner.encoder_cache is None
    prompts = [_prompt(base.engine.mm_encoder, s, im) for s, im in ((0, a), (1, a), (2, b), (3, a))]
    # without the cache, each of the four requests (one at a time) encodes its image
    calls = _spy(monkeypatch, base.engine.mm_encoder)
    want = [_tokens(base.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert calls == [1, 1, 1, 1]

    llm = _llm(path)
    calls = _spy(monkeypatch, llm.engine.mm_encoder)
    got = [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert got == want
    assert calls == [1, 1]  # image a, then b: requests 2 and 4 took a's kept rows
    assert llm.engine.kv_manager.prefix_hits == 0  # the prefix cache shared nothing
    cache = llm.engine.runner.encoder_cache
    assert cache is not None and (cache.queries, cache.hits) == (4, 2) and len(cache) == 2
    stats = llm.engine.stats()["encoder_cache"]
    assert (stats["queries"], stats["hits"], stats["rows"]) == (4, 2, cache.rows)
    from flashpage.server.metrics import _EngineStateCollector

    collector = _EngineStateCollector()
    collector.stats = llm.engine.stats()
    metrics = {m.name: m.samples[0].value for m in collector.collect()}
    assert metrics["flashpage:encoder_cache_queries"] == 4 and metrics["flashpage:encoder_cache_hits"] == 2
    assert metrics["flashpage:encoder_cache_rows"] == cache.rows
    if kind == "qwen3_vl":  # the deepstack features come back with the rows
        rows, deep = next(iter(cache._entries.values()))
        assert deep is not None and deep.shape[0] == rows.shape[0]


def test_one_image_in_two_requests_of_a_step_encoded_once(ckpt, monkeypatch):
    path = ckpt("qwen2_vl")
    a = smooth_image(84, 112, seed=1)
    base = _llm(path, mm_encoder_cache_tokens=0)
    prompts = [_prompt(base.engine.mm_encoder, s, a) for s in range(3)]
    calls = _spy(monkeypatch, base.engine.mm_encoder)
    want = _tokens(base.generate(prompts, GREEDY, use_tqdm=False))
    assert calls == [1]  # shared within the step even without the cache
    llm = _llm(path)
    calls = _spy(monkeypatch, llm.engine.mm_encoder)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert calls == [1]


def test_capacity_evicts_least_recently_used(ckpt, monkeypatch):
    path = ckpt("qwen2_vl")
    ims = [smooth_image(84, 112, seed=s) for s in range(3)]  # 12 rows each
    llm = _llm(path, mm_encoder_cache_tokens=24)  # two of them
    enc = llm.engine.mm_encoder
    rows = enc.num_rows(enc.pixel_values(ims[0]))
    assert rows == 12
    calls = _spy(monkeypatch, enc)
    seed = iter(range(100))

    def run(i: int) -> None:
        _tokens(llm.generate([_prompt(enc, next(seed), ims[i])], GREEDY, use_tqdm=False))

    for i in (0, 1, 0, 2):  # 2 evicts 1 (0 was used after it)
        run(i)
    assert len(calls) == 3
    run(0)
    assert len(calls) == 3  # still kept
    run(1)
    assert len(calls) == 4  # evicted, encoded again
    assert llm.engine.runner.encoder_cache.rows <= 24


def test_input_longer_than_capacity_not_kept():
    cache = EncoderCache(10)
    cache.put((b"a", 11), torch.zeros(11, 4))
    assert len(cache) == 0 and cache.rows == 0
    cache.put((b"b", 6), torch.zeros(6, 4))
    cache.put((b"c", 4), torch.zeros(4, 4))
    assert cache.rows == 10 and cache.get((b"b", 6)) is not None
    cache.put((b"d", 5), torch.zeros(5, 4))  # c (least recently used) goes, then b
    assert cache.get((b"c", 4)) is None and cache.get((b"b", 6)) is None
    assert cache.rows == 5 and (cache.queries, cache.hits) == (3, 1)
    cache.put((b"d", 5), torch.ones(5, 4))  # kept once
    assert cache.rows == 5
    with pytest.raises(ValueError, match="capacity"):
        EncoderCache(-1)


def test_kept_rows_do_not_hold_the_batch(ckpt):
    """Rows split from one encode call's output are copied before they are kept: a view
    would keep the whole batch's output alive."""
    path = ckpt("qwen2_vl")
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    ims = [smooth_image(84, 112, seed=s) for s in range(2)]
    _tokens(llm.generate([_prompt(enc, s, im) for s, im in enumerate(ims)], GREEDY, use_tqdm=False))
    for rows, _ in llm.engine.runner.encoder_cache._entries.values():
        assert rows.untyped_storage().nbytes() == rows.numel() * rows.element_size()


def test_reset_prefix_cache_clears_it(ckpt, monkeypatch):
    path = ckpt("qwen2_vl")
    llm = _llm(path)
    enc = llm.engine.mm_encoder
    a = smooth_image(84, 112, seed=1)
    _tokens(llm.generate([_prompt(enc, 0, a)], GREEDY, use_tqdm=False))
    cache = llm.engine.runner.encoder_cache
    assert len(cache) == 1
    assert llm.engine.reset_prefix_cache()
    assert len(cache) == 0 and cache.rows == 0
    calls = _spy(monkeypatch, enc)
    _tokens(llm.generate([_prompt(enc, 1, a)], GREEDY, use_tqdm=False))
    assert calls == [1]


def test_bad_capacity_named(ckpt):
    with pytest.raises(ConfigError, match="mm_encoder_cache_tokens"):
        _llm(ckpt("qwen2_vl"), mm_encoder_cache_tokens=-3)
    with pytest.raises(ConfigError, match="mm_encoder_cache_tokens"):
        _llm(ckpt("qwen2_vl"), mm_encoder_cache_tokens=1.5)
