"""The MTP layer's own CUDA graphs (engine/mtp.MTPRunner: DraftRunner's decode graphs for its
single-token forwards and a catch-up of one position a request, its catch-up graphs of up to
1 + k positions a request where its prompt path is sync-free: GLM-4.5's, not DeepSeek-V3's
MLA). The layer reads the previous hidden states from a static buffer of each graph kind.

The CPU runs the graphs' padded static-buffer forwards eagerly (``capture=False``), on the
tiny GLM-4.5 and DeepSeek-V3 checkpoints of tests/engine/test_mtp_draft.py: padding rows
past the batch, the shrinking batches of requests with fewer drafts, the previous hidden
states through the static buffers, must leave every draft the eager layer's and every token
plain decoding's; the capture itself runs on stand-in graphs (the triton backend interpreted).
The GPU tests (marked gpu) capture and replay them."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from flashpage import SamplingParams
from flashpage.engine.mtp import MTPRunner
from tests.conftest import fake_cuda_graphs, random_prompts
from tests.engine.test_mtp_draft import K, _ids, _llm, _no_leak, ckpts, spy_async, spy_drafts

__all__ = ["ckpts"]  # the checkpoints fixture, shared

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _params() -> list[SamplingParams]:
    """max_tokens that end mid-step (not a multiple of 1 + k): fewer drafts for some requests
    (the single-token forwards then run fewer rows), a request finishing while others go on."""
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 7, 14, 3, 18)]


def _prompts() -> list[list[int]]:
    shared = random_prompts(1, 20, 20, seed=9)[0]
    return random_prompts(3, 5, 40, seed=2) + [shared + p for p in random_prompts(2, 3, 9, seed=4)]


def _graphed(llm, max_bs: int = 4) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """``llm``'s MTP layer with decode graphs, and catch-up graphs where the engine captures
    them (not MLA), set up uncaptured (the CPU runs them eagerly); a log of each decode
    graph forward's (rows, bucket), and one of each catch-up graph forward's query lengths."""
    runner = llm.engine.proposer.runner
    assert isinstance(runner, MTPRunner)
    runner.capture_graphs(max_bs, llm.engine.max_model_len, capture=False)
    if runner.model.supports_prefill_graphs:
        runner.capture_catchup_graphs(max_bs, llm.engine.max_model_len, 1 + K, capture=False)
    log: list[tuple[int, int]] = []
    ups: list[list[int]] = []
    graphs, catchup = runner.graphs, runner.catchup
    real = graphs.run

    def spy(input_ids, positions, md, rows):
        log.append((md.num_seqs, graphs.bucket(md.num_seqs)))
        return real(input_ids, positions, md, rows)

    graphs.run = spy
    if catchup is not None:
        real_up = catchup.run

        def spy_up(input_ids, positions, md, rows):
            ups.append(list(md.query_lens_cpu))
            return real_up(input_ids, positions, md, rows)

        catchup.run = spy_up
    return log, ups


@pytest.mark.parametrize("which", ["exact", "random"])
def test_graphed_mtp_drafts_equal_the_eager_ones(ckpts, monkeypatch, which):
    """Batch 5 (ragged prompts, a 20-token prefix shared, max_tokens ending mid-step), then
    batch 1: through the padded graph forwards every draft is the eager layer's (so the
    hidden states fed through the static buffers are the right ones: random weights draft
    from them) and every token plain decoding's; the exact layer has every draft accepted.
    Batches of 3 pad to 4; of 5 (past max_bs 4) run eagerly. GLM-4.5's catch-ups of several
    positions a request take its catch-up graphs (DeepSeek-V3's MLA layer has none)."""
    path = ckpts[which]
    prompts, params = _prompts(), _params()
    want = _ids(_llm(path, mtp=False), prompts, params)
    eager = _llm(path, spec={"backoff": False})
    seen = spy_drafts(monkeypatch)
    assert _ids(eager, prompts, params) == want
    eager_st, eager_seen = eager.engine.stats()["spec_decode"], list(seen)
    seen.clear()
    llm = _llm(path, spec={"backoff": False})
    log, ups = _graphed(llm)
    assert _ids(llm, prompts, params) == want
    assert seen == eager_seen and len(seen) >= 10
    st = llm.engine.stats()["spec_decode"]
    assert st == eager_st, (st, eager_st)
    if which == "exact":
        assert st["acceptance_rate"] == 1.0, st
    assert any(b > n for n, b in log), log  # padding rows
    assert len({n for n, _ in log}) > 2, log  # shrinking batches as requests run out of drafts
    runner = llm.engine.proposer.runner
    assert runner.graph_forwards == len(log) and runner.catchup_forwards == len(ups)
    if ckpts["family"] == "glm4_moe":
        assert all(1 < max(q) <= 1 + K for q in ups), ups
        if which == "exact":  # every draft accepted: 1 + k positions a request
            assert any(q == [1 + K] * len(q) for q in ups), ups
    else:
        assert runner.catchup is None and not ups
    log.clear()
    assert _ids(llm, prompts[:1], params[:1]) == want[:1]
    assert log and all(n == b == 1 for n, b in log), log
    _no_leak(llm)


def test_graphed_mtp_drafts_through_preemption_and_async_scheduling(ckpts, monkeypatch):
    """A cache too small for every request (preemptions: both pools' blocks freed, the
    layer's entries recomputed), then async scheduling with the back-off on (random weights:
    requests back off, positions held for a later step), each through the graph forwards:
    plain decoding's tokens."""
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(ckpts["exact"], mtp=False), prompts, params)
    llm = _llm(ckpts["exact"], block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32)
    log, _ = _graphed(llm, max_bs=8)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert log and llm.engine.stats()["spec_decode"]["acceptance_rate"] == 1.0
    _no_leak(llm)
    want = _ids(_llm(ckpts["random"], mtp=False), prompts, params)
    llm = _llm(ckpts["random"], async_scheduling=True)
    log, _ = _graphed(llm, max_bs=8)
    unresolved, held = spy_async(monkeypatch)
    assert _ids(llm, prompts, params) == want
    assert any(unresolved) and any(held) and log
    _no_leak(llm)


def test_graphed_sampled_drafts_are_the_eager_ones(ckpts):
    """Seeded sampling through the graph forwards: the eager layer's tokens, and its
    counts (the drafts drawn from the same q)."""
    prompts = random_prompts(3, 5, 20, seed=11)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    eager = _llm(ckpts["exact"])
    want = _ids(eager, prompts, params)
    llm = _llm(ckpts["exact"])
    log, _ = _graphed(llm)
    assert _ids(llm, prompts, params) == want and log
    assert llm.engine.stats()["spec_decode"] == eager.engine.stats()["spec_decode"]
    _no_leak(llm)


def test_mtp_graph_capture_in_the_engine(ckpts, monkeypatch, caplog):
    """LLMEngine._capture_draft_graphs (CUDA-only; the capture itself stubbed to the
    uncaptured graphs here): the MTP layer's decode graphs at the target's batch limit, its
    catch-up graphs where its prompt path is sync-free (GLM-4.5's, not MLA's); the tokens
    then plain decoding's. A capture that raises leaves the layer eager, with a warning
    naming the MTP layer."""
    path = ckpts["exact"]  # drafts accepted: catch-ups of several positions a request
    prompts = random_prompts(3, 5, 20, seed=1)
    want = _ids(_llm(path, mtp=False), prompts, GREEDY)
    llm = _llm(path, max_num_seqs=6, spec={"backoff": False})
    eng = llm.engine
    runner = eng.proposer.runner
    assert isinstance(runner, MTPRunner)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(runner.backend, "supports_prefill_graphs", True)  # as the triton backend
    asked: list[tuple] = []

    def uncaptured(method):
        def capture(*a):
            asked.append((method.__name__, *a))
            return method(runner, *a, capture=False)
        return capture

    monkeypatch.setattr(runner, "capture_graphs", uncaptured(MTPRunner.capture_graphs))
    monkeypatch.setattr(runner, "capture_catchup_graphs", uncaptured(MTPRunner.capture_catchup_graphs))
    eng._capture_draft_graphs(runner, "MTP layer")
    glm = ckpts["family"] == "glm4_moe"
    assert asked[0] == ("capture_graphs", 6, eng.max_model_len, None)
    assert asked[1:] == ([("capture_catchup_graphs", 6, eng.max_model_len, 1 + K, None)] if glm else [])
    assert runner.graphs is not None and (runner.catchup is not None) == glm
    assert set(runner.static_prev) == ({"decode", "catchup"} if glm else {"decode"})
    assert runner.static_prev["decode"].shape == (6, eng.model_config.hidden_size)
    assert _ids(llm, prompts, GREEDY) == want
    assert runner.graph_forwards > 0 and (runner.catchup_forwards > 0) == glm

    def broken(*a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "capture_graphs", broken)
    with caplog.at_level(logging.WARNING, logger="flashpage"):
        eng._capture_draft_graphs(runner, "MTP layer")
    assert runner.graphs is None and "MTP layer CUDA graphs off" in caplog.text
    runner.catchup = None
    assert _ids(llm, prompts, GREEDY) == want
    _no_leak(llm)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_graphed_mtp_drafts_on_the_triton_backend(ckpts):
    """The decode graphs' padded forwards through the triton backend's kernels (interpreted:
    the decode kernel, MLA's for DeepSeek-V3, over the static buffers, padding rows of
    context 1 in block 0): the exact layer has every draft accepted, plain decoding's tokens."""
    prompts = [random_prompts(1, 4, 4, seed=8)[0], random_prompts(1, 9, 9, seed=9)[0],
               random_prompts(1, 6, 6, seed=10)[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (7, 6, 7)]
    want = _ids(_llm(ckpts["exact"], mtp=False, block_size=16), prompts, params)
    llm = _llm(ckpts["exact"], attention_backend="triton", block_size=16,
               spec={"num_speculative_tokens": 2})
    log, _ = _graphed(llm)
    assert _ids(llm, prompts, params) == want
    assert any(b > n for n, b in log), log
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st
    _no_leak(llm)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_mtp_graph_capture_on_fake_graphs(ckpts, monkeypatch):
    """The capture's bookkeeping, which only a GPU runs for real, on stand-in graphs (the
    triton backend, interpreted: a capture has no host lengths): every bucket captured in the
    pool handed over (the target's), the layer reading its static buffer of previous hidden
    states while captured (and not after), each graph's output the hidden states [bucket,
    hidden]; GLM-4.5's catch-up graphs likewise; a step then replays its graphs, the
    previous hidden states copied into the static buffer first."""
    runner_box: list[MTPRunner] = []
    captured = fake_cuda_graphs(monkeypatch,
                                lambda: (runner_box[0].model.prev_hidden.data_ptr(),))
    llm = _llm(ckpts["exact"], attention_backend="triton", block_size=16, spec={"num_speculative_tokens": 2})
    runner = llm.engine.proposer.runner
    assert isinstance(runner, MTPRunner)
    runner_box.append(runner)
    hidden = llm.engine.model_config.hidden_size
    assert runner.capture_graphs(4, llm.engine.max_model_len, "target-pool") == "target-pool"
    g, buf = runner.graphs, runner.static_prev["decode"]
    assert captured == [("capture", "target-pool", buf.data_ptr())] * 3 and g.pool == "target-pool"
    assert buf.shape == (4, hidden) and runner.model.prev_hidden is None
    assert {b: tuple(t.shape) for b, t in g.logits.items()} == {b: (b, hidden) for b in (1, 2, 4)}
    mine = set(g.graphs.values())
    captured.clear()
    if runner.model.supports_prefill_graphs:
        assert runner.capture_catchup_graphs(4, llm.engine.max_model_len, 3, "target-pool") == "target-pool"
        up, ubuf = runner.catchup, runner.static_prev["catchup"]
        assert captured == [("capture", "target-pool", ubuf.data_ptr())] * 3 and ubuf.shape == (12, hidden)
        assert {k: tuple(t.shape) for k, t in up.logits.items()} == {(s, 3 * s): (s, hidden) for s in (1, 2, 4)}
        mine |= set(up.graphs.values())
        captured.clear()
    else:
        assert ckpts["family"] == "deepseek_v3"
    copied: list[bool] = []
    real_copy = torch.Tensor.copy_

    def copy_(t, src, *a, **kw):  # the previous hidden states into a static buffer
        if any(t.data_ptr() == b.data_ptr() for b in runner.static_prev.values()):
            copied.append(True)
        return real_copy(t, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    # replays of fake graphs compute nothing: the tokens are not checked, only the dispatch
    llm.generate(random_prompts(2, 4, 9, seed=1), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert captured and all(e[0] == "replay" and e[1] in mine for e in captured)
    assert runner.graph_forwards + runner.catchup_forwards == len(captured) == len(copied)


def _gpu(path, **kw):
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=128,
              num_gpu_blocks=256, max_num_seqs=16, **kw)
    return _llm(path, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("which", ["exact", "random"])
def test_mtp_graphs_on_the_gpu(ckpts, monkeypatch, which):
    """fp32, triton backend, the target's graphs and the MTP layer's captured (decode graphs
    at every bucket in the target's pool; catch-up graphs for GLM-4.5, none for DeepSeek-V3's
    MLA): batch 1 and a batch of 5 ragged requests give plain decoding's tokens and the same
    drafts as the same engine with the layer's graphs set aside (eager); the layer's graphs
    are replayed; the exact layer has every draft accepted."""
    path = ckpts[which]
    prompts = random_prompts(5, 5, 40, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 7, 23, 3, 31)]
    want = _ids(_gpu(path, mtp=False), prompts, params)
    # no prefix cache: the eager runs after the graphed ones in the same engine would hit
    # blocks whose layer entries an earlier run wrote (drafts then not comparable)
    llm = _gpu(path, spec={"backoff": False}, enable_prefix_caching=False)
    runner = llm.engine.proposer.runner
    assert isinstance(runner, MTPRunner)
    graphs, catchup = runner.graphs, runner.catchup
    assert graphs is not None and set(graphs.graphs) == set(graphs.buckets) and graphs.with_logits is False
    assert llm.engine.runner.graphs is not None and graphs.pool is llm.engine.runner.graphs.pool
    if ckpts["family"] == "glm4_moe":
        assert catchup is not None and set(catchup.graphs) == set(catchup.keys) and catchup.keys
    else:
        assert catchup is None
    mine = set(graphs.graphs.values()) | (set(catchup.graphs.values()) if catchup is not None else set())
    replays: list[bool] = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: (replays.append(g in mine), real(g))[1])
    runner.graph_forwards = runner.catchup_forwards = 0
    seen = spy_drafts(monkeypatch)
    got1, got = _ids(llm, prompts[:1], params[:1]), _ids(llm, prompts, params)
    st = llm.engine.stats()["spec_decode"]
    used = runner.graph_forwards + runner.catchup_forwards
    graphed = list(seen)
    seen.clear()
    runner.graphs = runner.catchup = None  # the same engine, the layer eager
    eager1, eager = _ids(llm, prompts[:1], params[:1]), _ids(llm, prompts, params)
    runner.graphs, runner.catchup = graphs, catchup
    assert got1 == eager1 == want[:1]
    assert got == eager == want
    assert graphed == seen and len(seen) >= 10  # every draft the eager layer's
    assert runner.graph_forwards > 0 and sum(replays) == used, (used, replays)
    if which == "exact":
        assert st["acceptance_rate"] == 1.0, st
        if catchup is not None:
            assert runner.catchup_forwards > 0
    _no_leak(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mtp_graphs_through_preemption_and_async_scheduling_on_the_gpu(ckpts, monkeypatch):
    """A cache too small for every request (10 blocks of 16: preemptions), then async
    scheduling (on by default on CUDA) with the back-off on: the layer's graphs replayed,
    plain decoding's tokens."""
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=32,
              max_num_seqs=16)
    want = _ids(_llm(ckpts["exact"], mtp=False, num_gpu_blocks=256, **kw), prompts, params)
    llm = _llm(ckpts["exact"], num_gpu_blocks=10, **kw)
    assert llm.engine.proposer.runner.graphs is not None
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert llm.engine.proposer.runner.graph_forwards > 0
    _no_leak(llm)
    want = _ids(_llm(ckpts["random"], mtp=False, num_gpu_blocks=256, **kw), prompts, params)
    llm = _llm(ckpts["random"], num_gpu_blocks=256, **kw)
    assert llm.engine.async_scheduling
    unresolved, held = spy_async(monkeypatch)
    assert _ids(llm, prompts, params) == want
    assert any(unresolved) and any(held)
    assert llm.engine.proposer.runner.graph_forwards > 0
    _no_leak(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_enforce_eager_captures_no_mtp_graphs(ckpts):
    llm = _gpu(ckpts["exact"], enforce_eager=True)
    runner = llm.engine.proposer.runner
    assert llm.engine.runner.graphs is None and runner.graphs is None and runner.catchup is None
    assert _ids(llm, random_prompts(2, 5, 9, seed=1), GREEDY)
    assert runner.graph_forwards == runner.catchup_forwards == 0
