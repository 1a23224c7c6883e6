"""The priority scheduling policy end to end (tiny model, CPU): priorities change the
order in which requests are served under memory pressure, never their greedy tokens;
the ``priority`` argument of LLM.generate / chat / embed / score and
LLMEngine.add_request is checked."""

from __future__ import annotations

import pytest

from flashpage import LLM, SamplingParams
from flashpage.config import EngineConfig
from flashpage.engine.llm_engine import LLMEngine
from tests.conftest import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# 18 blocks of 4 tokens: two or three of the 16-token requests (up to 25 tokens each) at a time
KW = dict(dtype="float32", device="cpu", block_size=4, num_gpu_blocks=18,
          max_num_batched_tokens=32, max_num_seqs=8)


def _engine(path, policy: str, async_scheduling: bool = False) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), scheduling_policy=policy,
                                  async_scheduling=async_scheduling, **KW))


def _run(engine: LLMEngine, arrivals: list[tuple[int, list[int], int]]
         ) -> tuple[dict[str, list[int]], list[str], dict[str, int]]:
    """Add (step, prompt, priority) requests at their steps (ids: their index), step until
    all finish; the tokens by id, the order they finished in and the step each first ran."""
    tokens: dict[str, list[int]] = {}
    order: list[str] = []
    first_ran: dict[str, int] = {}
    step = 0
    while len(tokens) < len(arrivals):
        for i, (at, prompt, prio) in enumerate(arrivals):
            if at == step:
                engine.add_request(str(i), prompt, GREEDY, priority=prio)
        outs = engine.step()
        for r in engine.scheduler.running:
            first_ran.setdefault(r.request_id, step)
        for out in outs:
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
                order.append(out.request_id)
        step += 1
        assert step < 1000
    assert engine.kv_manager.stats().blocks_used == 0
    return tokens, order, first_ran


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """fcfs, every priority 0: each prompt's tokens (the engine's, checked against
    transformers elsewhere) and the order they finish in."""
    path = tiny_checkpoint("llama2_mha")
    prompts = random_prompts(6, 16, 16, seed=11)
    tokens, order, _ = _run(_engine(path, "fcfs"), [(0, p, 0) for p in prompts])
    assert order == [str(i) for i in range(6)]  # first come, first served
    return path, prompts, tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_priorities_change_the_order_not_the_tokens(reference, async_scheduling):
    path, prompts, expected = reference
    priorities = [3, 0, 2, 0, 1, 5]
    engine = _engine(path, "priority", async_scheduling)
    tokens, order, _ = _run(engine, [(0, p, prio) for p, prio in zip(prompts, priorities, strict=True)])
    assert tokens == expected
    # one after another by (priority, arrival): the cache holds two or three at a time
    assert order == ["1", "3", "4", "2", "0", "5"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_late_high_priority_request_preempts_and_goes_first(reference, async_scheduling):
    """Five priority-5 requests fill the cache (0, 1 and 2 run); one of priority 0 comes
    at step 4: it runs at once (2 is preempted for its blocks) and finishes right after 0
    and 1, which were further along. Under fcfs it waits for everyone."""
    path, prompts, expected = reference
    arrivals = [(0, p, 5) for p in prompts[:5]] + [(4, prompts[5], 0)]
    engine = _engine(path, "priority", async_scheduling)
    tokens, order, first_ran = _run(engine, arrivals)
    assert tokens == expected
    assert first_ran["5"] == 4 and order == ["0", "1", "5", "2", "3", "4"]
    fcfs = _engine(path, "fcfs", async_scheduling)
    tokens, order, first_ran = _run(fcfs, [(at, p, 0) for at, p, _ in arrivals])
    assert tokens == expected
    assert first_ran["5"] > 4 and order == ["0", "1", "2", "3", "4", "5"]


def test_llm_generate_priority_argument(reference, byte_model_dir):
    path, prompts, expected = reference
    llm = LLM(str(path), scheduling_policy="priority", **KW)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[3, 0, 2, 0, 1, 5])
    assert [o.outputs[0].token_ids for o in outs] == [expected[str(i)] for i in range(6)]
    with pytest.raises(ValueError, match="got 2 priorities for 6 prompts"):
        llm.generate(prompts, GREEDY, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match=r"priority must be an integer, got 1\.5"):
        llm.generate(prompts[:2], GREEDY, use_tqdm=False, priority=[0, 1.5])
    with pytest.raises(ValueError, match="priority must be an integer, got True"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, priority=[True])
    with pytest.raises(ValueError, match="one integer per prompt, got 3"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, priority=3)
    assert not llm.engine.has_unfinished_requests()  # checked before anything was added
    # fcfs takes priority 0 only (vLLM's "Got priority ... but priority scheduling is not enabled")
    chat = LLM(str(byte_model_dir), dtype="float32", device="cpu")
    msgs = [{"role": "user", "content": "hi"}]
    assert chat.chat(msgs, SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])[0].finished
    with pytest.raises(ValueError, match="Got priority 2 but priority scheduling is not enabled"):
        chat.chat(msgs, SamplingParams(max_tokens=2), use_tqdm=False, priority=[2])
    with pytest.raises(ValueError, match="Got priority -1 but priority scheduling is not enabled"):
        chat.engine.add_request("x", [5, 6], SamplingParams(max_tokens=2), priority=-1)
    assert not chat.engine.has_unfinished_requests()


def test_scheduling_policy_is_checked():
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority, got 'sjf'"):
        EngineConfig(scheduling_policy="sjf")


def test_cli_passes_scheduling_policy_to_the_engine(monkeypatch, capsys):
    """``--scheduling-policy`` on every command that takes engine flags (generate, chat,
    serve, bench: add_engine_arguments), fcfs by default, other names refused."""
    import argparse

    import flashpage.llm
    from flashpage import cli

    seen: dict = {}
    monkeypatch.setattr(flashpage.llm, "LLM", lambda *a, **kw: seen.update(kw))
    p = argparse.ArgumentParser()
    cli.add_engine_arguments(p)
    cli.build_llm(p.parse_args(["--scheduling-policy", "priority"]))
    assert seen["scheduling_policy"] == "priority"
    cli.build_llm(p.parse_args([]))
    assert seen["scheduling_policy"] == "fcfs"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--scheduling-policy", "lifo"])
    assert "invalid choice: 'lifo'" in capsys.readouterr().err


def test_spec_decoding_and_n_samples_under_priority(reference):
    """n-gram drafts (repetitive prompts), n = 2 children sharing their prompt's blocks and
    chunked prompts, in a cache that forces preemption: every sample's greedy tokens equal
    fcfs's, whatever the priorities."""
    path = reference[0]
    prompts = [(p * 4)[:24] for p in random_prompts(5, 4, 8, seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    kw = {**KW, "num_gpu_blocks": 16, "max_num_batched_tokens": 20}
    fcfs = LLM(str(path), speculative_config=spec, **kw)
    want = [[o.token_ids for o in out.outputs] for out in fcfs.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), speculative_config=spec, scheduling_policy="priority", **kw)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[4, 1, 3, 0, 2])
    assert [[o.token_ids for o in out.outputs] for out in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"
    assert llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0, "drafts were meant to run"
    assert llm.engine.kv_manager.stats().blocks_used == 0


def _spy_finish_order(engine: LLMEngine, order: list[str]) -> None:
    """Record the ids of the requests as they finish (LLM._run's steps), in order."""
    step = engine.step

    def spy(*args, **kw):
        outs = step(*args, **kw)
        order.extend(o.request_id for o in outs if o.finished)
        return outs

    engine.step = spy  # type: ignore[method-assign]


def test_llm_embed_and_score_priority_argument(reference):
    """LLM.embed and LLM.score take ``priority`` as generate does: checked the same way, it
    reaches each request and changes the order they are served in (one 16-token prompt a
    step: the batch budget is 20 tokens), never the vectors or scores."""
    import torch

    path, prompts, _ = reference
    kw = {**KW, "max_num_batched_tokens": 20, "enable_prefix_caching": False}
    fcfs = LLM(str(path), **kw)
    want = [o.outputs.embedding for o in fcfs.embed(prompts, use_tqdm=False)]
    llm = LLM(str(path), scheduling_policy="priority", **kw)
    order: list[str] = []
    _spy_finish_order(llm.engine, order)
    outs = llm.embed(prompts, use_tqdm=False, priority=[3, 0, 2, 0, 1, 5])
    for o, w in zip(outs, want, strict=True):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), torch.tensor(w), atol=1e-6, rtol=1e-5)
    ids = [o.request_id for o in outs]
    assert order == [ids[i] for i in (1, 3, 4, 2, 0, 5)]
    # score: one priority per pair; the query, in every pair, goes at the most urgent of them
    seen: dict[int, int] = {}
    add = llm.engine.add_request
    llm.engine.add_request = lambda rid, p, *a, **k: (seen.setdefault(len(p), k["priority"]),  # type: ignore[method-assign]
                                                      add(rid, p, *a, **k))[1]
    query, docs = prompts[0][:5], [prompts[1][:6], prompts[2][:7], prompts[3][:8]]
    got = llm.score(query, docs, use_tqdm=False, priority=[4, 2, 6])
    assert seen == {5: 2, 6: 4, 7: 2, 8: 6}
    ref = fcfs.score(query, docs, use_tqdm=False)
    assert [s.outputs.score for s in got] == pytest.approx([s.outputs.score for s in ref], abs=1e-6)
    del llm.engine.add_request
    with pytest.raises(ValueError, match="got 2 priorities for 6 prompts"):
        llm.embed(prompts, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="priority must be an integer, got True"):
        llm.embed(prompts[:1], use_tqdm=False, priority=[True])
    with pytest.raises(ValueError, match="one integer per prompt, got 3"):
        llm.embed(prompts[:1], use_tqdm=False, priority=3)
    with pytest.raises(ValueError, match="got 2 priorities for 3 pairs"):
        llm.score(query, docs, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match=r"one integer per pair, got 1\.5"):
        llm.score(query, docs, use_tqdm=False, priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Got priority 1 but priority scheduling is not enabled"):
        fcfs.score(query, docs, use_tqdm=False, priority=[0, 1, 0])
    with pytest.raises(ValueError, match="Got priority -3 but priority scheduling is not enabled"):
        fcfs.embed(prompts[:2], use_tqdm=False, priority=[0, -3])
    assert fcfs.embed(prompts[:2], use_tqdm=False, priority=[0, 0])[0].outputs is not None
    for e in (llm.engine, fcfs.engine):
        assert not e.has_unfinished_requests() and e.kv_manager.stats().blocks_used == 0
