"""LLMEngine.warm_up (run at start-up on CUDA so kernels compile before the first user
request) leaves no trace: no blocks, no cached prefix, no counts, same outputs after."""

from __future__ import annotations

import pytest

from flashpage import SamplingParams
from flashpage.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from tests.conftest import random_prompts


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_leaves_no_trace(tiny_checkpoint, async_scheduling):
    path = tiny_checkpoint("head64_gqa")
    cfg = dict(model=str(path), dtype="float32", device="cpu", block_size=8,
               max_num_batched_tokens=64, async_scheduling=async_scheduling)
    warmed, fresh = LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg))
    steps = []
    schedule = warmed.scheduler.schedule

    def spy():
        out = schedule()
        steps.append(sorted(n for _, n in out.scheduled))
        return out

    warmed.scheduler.schedule = spy
    warmed.warm_up()
    warmed.scheduler.schedule = schedule
    assert any(len(s) > 1 and s[0] == 1 and s[-1] > 1 for s in steps)  # a chunk beside decodes
    assert [64] in steps  # a prompt step of the whole token budget (max_num_batched_tokens)
    assert [61] in steps, str(steps)  # and one of the other residue mod 16, past the chunk sizes
    kv = warmed.kv_manager.stats()
    assert kv.blocks_used == 0 and kv.blocks_cached_free == 0 and kv.prefix_queries == 0
    assert warmed.scheduler.num_steps == 0 and not warmed.has_unfinished_requests()

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name, eng in (("warmed", warmed), ("fresh", fresh)):
        for i, p in enumerate(random_prompts(3, 4, 30, seed=4)):
            eng.add_request(str(i), p, params)
        got = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        outs[name] = got
        assert eng.kv_manager.stats().prefix_hits == 0
    assert outs["warmed"] == outs["fresh"]


def test_block_table_width_is_a_multiple_of_16(tiny_checkpoint):
    """Every step's block tables are padded to a multiple of 16 columns (their row stride,
    which the decode kernels specialize on: another width would compile them again after
    the warm-up)."""
    path = tiny_checkpoint("head64_gqa")
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=8,
                                 max_num_batched_tokens=256))
    seen = []
    prepare = eng.runner.prepare

    def spy(out):
        step = prepare(out)
        seen.append(step.metadata.block_tables.shape[1])
        return step

    eng.runner.prepare = spy
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [list(range(3, 8)), list(range(3, 200))]  # 1 and 25 blocks of 8
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    while eng.has_unfinished_requests():
        eng.step()
    assert seen and all(w % 16 == 0 for w in seen), seen
    assert 32 in seen  # 25 blocks -> 32 columns
