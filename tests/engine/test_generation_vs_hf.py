"""Greedy generation is token-for-token that of transformers (fp32, CPU)."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams
from tests.conftest import TINY_MODELS, hf_greedy, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_matches_transformers(tiny_checkpoint, name):
    path = tiny_checkpoint(name)
    prompts = random_prompts(3, 5, 40, seed=1)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_staggered_batch_with_chunking_preemption_and_prefix_hits(tiny_checkpoint):
    """10 prompts (4 sharing a 32-token prefix) arrive over several steps into a cache
    too small for all of them; chunked prefill, preemption and prefix hits all happen,
    and every output still equals transformers'."""
    from flashpage.config import EngineConfig
    from flashpage.engine.llm_engine import LLMEngine

    path = tiny_checkpoint("llama31_gqa")
    shared = random_prompts(1, 32, 32, seed=7)[0]
    prompts = random_prompts(6, 3, 60, seed=3) + [shared + p for p in random_prompts(4, 1, 20, seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = hf_greedy(path, prompts, params.max_tokens)

    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=4,
                       num_gpu_blocks=40, max_num_batched_tokens=24, max_num_seqs=6)
    engine = LLMEngine(cfg)
    # Record every prompt chunk that is shorter than what the request still has to compute.
    chunks: list[tuple[str, int, int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        for r, n in out.scheduled:
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining > 1 and n < remaining:
                chunks.append((r.request_id, n, remaining))
        return out

    engine.scheduler.schedule = recording_schedule
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        # Two new requests every other step.
        if step % 2 == 0:
            for _ in range(2):
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(str(i), p, params)
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        step += 1
        assert step < 2000
    assert chunks, "the token budget was meant to force chunked prefill"
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    kv = engine.kv_manager.stats()
    assert kv.prefix_hits > 0, "the shared prefix was meant to hit the cache"
    assert kv.blocks_used == 0
