"""The draft model's decode graphs (engine/draft_model.py over cuda_graph.DecodeGraphs): its
single-token forwards, and a catch-up of one token a request, replayed at the target's batch
buckets over the draft's own K/V pool.

The CPU runs the graphs' padded static-buffer forwards eagerly (``capture=False``): padding
rows past the batch, the shrinking batches of requests with fewer drafts, the drafts fed
from one forward to the next on the device, must leave every token as plain decoding's and
as the eager draft's. The GPU tests capture and replay them."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from flashpage import SamplingParams
from flashpage.engine.cuda_graph import DecodeGraphs
from flashpage.engine.draft_model import decode_steps
from tests.conftest import build_tiny_checkpoint, random_prompts
from tests.engine.test_draft_model import _ids, _llm, noisy_copy

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def test_decode_steps_run_prefixes_of_the_rows():
    """Rows ordered most drafts first: forward j runs the rows with more than j drafts, each
    at its draft j's position, into the slot its block table gives."""
    tables = [np.array([7, 3, 9, 11]), np.array([5, 6]), np.array([2, 8, 4, 1])]
    rows, pos, slots, table = decode_steps([10, 6, 13], [4, 3, 2], tables, block_size=4)
    assert rows == [3, 2, 1]  # forwards 1, 2, 3 (drafts 2, 3, 4)
    assert pos.tolist() == [[10, 6, 13], [11, 7, 0], [12, 0, 0]]
    # position 10 of row 0: block 10 // 4 = 2 -> id 9, slot 9 * 4 + 2; 6 of row 1: 6 * 4 + 2
    assert slots.tolist() == [[38, 26, 5], [39, 27, 0], [44, 0, 0]]
    assert table.shape == (3, 16) and table[2, :4].tolist() == [2, 8, 4, 1] and table[1, 2:].sum() == 0
    rows, pos, _, _ = decode_steps([5], [1], [np.array([0, 1])], block_size=4)
    assert rows == [] and pos.shape == (0, 1)  # one draft: no single-token forward


def _graphed(llm, max_bs=4):
    """``llm``'s draft with decode graphs set up uncaptured (the CPU runs them eagerly); a
    log of each graph forward's (rows, bucket)."""
    runner = llm.engine.proposer.runner
    runner.capture_graphs(max_bs, llm.engine.max_model_len, capture=False)
    log: list[tuple[int, int]] = []
    graphs = runner.graphs
    real = graphs.run

    def spy(input_ids, positions, md, rows):
        log.append((md.num_seqs, graphs.bucket(md.num_seqs)))
        return real(input_ids, positions, md, rows)

    graphs.run = spy
    return log


def _mixed_params() -> list[SamplingParams]:
    """max_tokens that end mid-step (not a multiple of 1 + k): fewer drafts for some requests
    (the single-token forwards then run fewer rows), a request finishing while others go on."""
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 7, 14, 3, 18)]


@pytest.fixture(scope="module")
def noisy(tmp_path_factory, tiny_checkpoint):
    return noisy_copy(tiny_checkpoint("llama31_gqa"), tmp_path_factory.mktemp("graphs_noisy"))


@pytest.mark.parametrize("which", ["self", "noisy"])
def test_graphed_drafts_give_plain_and_eager_tokens(tiny_checkpoint, noisy, which):
    """Batch 1 and 5 (ragged prompts, a 20-token prefix shared, max_tokens ending mid-step):
    the graph path gives plain decoding's tokens and the eager draft's counts; the target as
    its own draft has every draft accepted. Batches of 3 pad to 4; of 5 (past max_bs) run
    eagerly."""
    path = tiny_checkpoint("llama31_gqa")
    draft = path if which == "self" else noisy
    shared = random_prompts(1, 20, 20, seed=9)[0]
    prompts = random_prompts(3, 5, 40, seed=2) + [shared + p for p in random_prompts(2, 3, 9, seed=4)]
    params = _mixed_params()
    want = _ids(_llm(path), prompts, params)
    eager = _llm(path, draft, spec={"backoff": False})
    assert _ids(eager, prompts, params) == want
    eager_st = eager.engine.stats()["spec_decode"]
    llm = _llm(path, draft, spec={"backoff": False})
    log = _graphed(llm)
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st == eager_st, (st, eager_st)  # the same drafts, drafted alike
    if which == "self":
        assert st["acceptance_rate"] == 1.0, st
    assert any(b > n for n, b in log), log  # padding rows
    assert len({n for n, _ in log}) > 2, log  # shrinking batches as requests run out of drafts
    assert llm.engine.proposer.runner.graph_forwards == len(log)
    log.clear()
    assert _ids(llm, prompts[:1], params[:1]) == want[:1]
    assert log and all(n == b == 1 for n, b in log), log
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_graphed_drafts_through_preemption(tiny_checkpoint, noisy):
    """A cache too small for every request: preempted requests' blocks freed in both pools and
    recomputed, the draft's graph forwards in between; plain decoding's tokens."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(path), prompts, params)
    llm = _llm(path, noisy, block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32)
    log = _graphed(llm, max_bs=8)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert log and llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_graphed_sampled_drafts_keep_their_q(tiny_checkpoint):
    """Seeded sampling, the target as its own draft, the graph path: the same tokens alone
    or in a batch, and every draft (drawn from q, checked against it) accepted."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(3, 5, 20, seed=6)
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=5)
    other = SamplingParams(temperature=1.0, top_k=20, max_tokens=11, ignore_eos=True)
    llm = _llm(path, path)
    log = _graphed(llm)
    alone = _ids(llm, prompts[:1], seeded)[0]
    assert _ids(llm, prompts, [seeded, other, SamplingParams(temperature=0.0, max_tokens=9)])[0] == alone
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] > 0.95, st
    assert log
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_draft_graph_capture_failure_leaves_the_draft_eager(tiny_checkpoint, monkeypatch, caplog):
    """LLMEngine._capture_draft_graphs (CUDA-only; stubbed here): the target's batch limit and
    graph pool; a capture that raises leaves the draft eager with a warning, the engine goes on."""
    path = tiny_checkpoint("llama31_gqa")
    llm = _llm(path, path, max_num_seqs=6)
    eng = llm.engine
    runner = eng.proposer.runner
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    asked = []
    monkeypatch.setattr(runner, "capture_graphs", lambda *a: (
        asked.append(a), setattr(runner, "graphs", "captured")))
    eng._capture_draft_graphs(runner)
    assert asked == [(6, eng.max_model_len, None)] and runner.graphs == "captured"

    def broken(*a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "capture_graphs", broken)
    with caplog.at_level(logging.WARNING, logger="flashpage"):
        eng._capture_draft_graphs(runner)
    assert runner.graphs is None
    assert "draft model CUDA graphs off" in caplog.text and "stream is capturing" in caplog.text
    prompts = random_prompts(2, 5, 9, seed=1)
    assert _ids(llm, prompts, GREEDY) == _ids(_llm(path), prompts, GREEDY)


def test_hidden_state_graphs_after_a_larger_batch():
    """DecodeGraphs(logits=False), not captured: a batch padded to its bucket runs the model
    over the static buffers, and hands back the hidden states of the batch's rows."""

    class Model(torch.nn.Module):
        seen: list = []

        def forward(self, input_ids, positions, md):
            Model.seen.append((input_ids.tolist(), md.seq_lens_cpu, md.slot_mapping.tolist()))
            return input_ids.float()[:, None] * 10

        def compute_logits(self, hidden):
            raise AssertionError("logits=False: the caller computes them")

    from tests.engine.test_prefill_graphs import _step_md

    def decodes(lens, first_slot):
        md = _step_md([1] * len(lens), lens, first_slot)
        md.num_decodes = md.num_decode_tokens = len(lens)
        md.query_lens_cpu, md.seq_lens_cpu = [1] * len(lens), lens
        return md

    g = DecodeGraphs(Model(), 8, 4, torch.device("cpu"), logits=False)
    g.run(torch.arange(1, 6), torch.arange(5), decodes([9] * 5, 100), 5)
    out = g.run(torch.tensor([7, 8, 9]), torch.tensor([4, 5, 6]), decodes([5, 6, 7], 40), 3)
    assert out[:, 0].tolist() == [70.0, 80.0, 90.0]
    # bucket 4: row 3 pads (slot -1, context 1); its stale input id is the larger batch's
    assert Model.seen[-1] == ([7, 8, 9, 4], [5, 6, 7, 1], [40, 41, 42, -1]), Model.seen[-1]


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_graphed_drafts_on_the_triton_backend(tiny_checkpoint):
    """The graphs' padded forwards through the triton backend's kernels (interpreted): the
    decode kernel over the static buffers (tables as wide as the longest context, padding
    rows of context 1 in block 0); plain decoding's tokens, every draft accepted."""
    path = tiny_checkpoint("head64_gqa")
    prompts = [random_prompts(1, 4, 4, seed=8)[0], random_prompts(1, 9, 9, seed=9)[0],
               random_prompts(1, 6, 6, seed=10)[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 3, 5)]
    want = _ids(_llm(path, block_size=16), prompts, params)
    llm = _llm(path, path, attention_backend="triton", block_size=16, spec={"num_speculative_tokens": 2})
    log = _graphed(llm)
    assert _ids(llm, prompts, params) == want
    assert any(b > n for n, b in log), log
    assert llm.engine.stats()["spec_decode"]["acceptance_rate"] == 1.0


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_draft_graph_capture_on_fake_graphs(tiny_checkpoint, monkeypatch):
    """The capture's bookkeeping, which only a GPU runs for real, on stand-in graphs (the
    triton backend, interpreted: a capture has no host lengths): every bucket captured in the
    pool handed over (the target's), each graph's output the hidden states [bucket, hidden];
    a step then replays its bucket's graph."""
    import contextlib

    captured = []

    class FakeGraph:
        def replay(self):
            captured.append(("replay", self))

        def pool(self):
            raise AssertionError("the pool was handed over: not a new one")

    @contextlib.contextmanager
    def graph(g, pool=None):
        captured.append(("capture", pool))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    path = tiny_checkpoint("head64_gqa")
    llm = _llm(path, path, attention_backend="triton", block_size=16, spec={"num_speculative_tokens": 2})
    runner = llm.engine.proposer.runner
    assert runner.capture_graphs(4, llm.engine.max_model_len, "target-pool") == "target-pool"
    g = runner.graphs
    assert captured == [("capture", "target-pool")] * 3 and g.pool == "target-pool"
    hidden = llm.engine.model_config.hidden_size
    assert {b: tuple(t.shape) for b, t in g.logits.items()} == {b: (b, hidden) for b in (1, 2, 4)}
    captured.clear()
    prompts = random_prompts(2, 4, 9, seed=1)
    # replays of fake graphs compute nothing: the tokens are not checked, only the dispatch
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert captured and all(e[0] == "replay" and e[1] in g.graphs.values() for e in captured)
    assert runner.graph_forwards == len(captured)


def _gpu_llms(path, draft, **kw):
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=128,
              num_gpu_blocks=256, max_num_seqs=16, **kw)
    return _llm(path, **kw), _llm(path, draft, spec={"backoff": False}, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("draft", ["self", "other", "noisy"])
def test_draft_graphs_on_the_gpu(tiny_checkpoint, tmp_path, draft, monkeypatch):
    """fp32, triton backend, both models' decode graphs captured: batch 1 and a batch of 5
    ragged requests with max_tokens ending mid-step give plain decoding's tokens and the eager
    draft's (the same engine with its draft graphs set aside); the draft's graphs are replayed
    (a replay per single-token forward at least)."""
    path = tiny_checkpoint("head64_gqa")
    drafts = {"self": path, "noisy": noisy_copy(path, tmp_path),
              "other": build_tiny_checkpoint(tmp_path / "d", "head64_gqa", seed=1, num_hidden_layers=1)}
    prompts = random_prompts(5, 5, 40, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 7, 23, 3, 31)]
    plain, llm = _gpu_llms(path, drafts[draft])
    want = _ids(plain, prompts, params)
    runner = llm.engine.proposer.runner
    graphs = runner.graphs
    assert graphs is not None and set(graphs.graphs) == set(graphs.buckets) and graphs.with_logits is False
    assert llm.engine.runner.graphs is not None and graphs.pool is llm.engine.runner.graphs.pool
    mine = set(graphs.graphs.values())
    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay",
                        lambda g: (replays.append(g in mine), real(g))[1])
    runner.graph_forwards = 0
    got1 = _ids(llm, prompts[:1], params[:1])
    got = _ids(llm, prompts, params)
    st = llm.engine.stats()["spec_decode"]
    used = runner.graph_forwards
    runner.graphs = None  # the same engine, the draft eager
    eager1, eager = _ids(llm, prompts[:1], params[:1]), _ids(llm, prompts, params)
    runner.graphs = graphs
    assert got1 == eager1 == want[:1]
    assert got == eager == want
    assert used > 0 and sum(replays) == used, (used, sum(replays))
    assert st["num_draft_tokens"] > 0
    if draft == "self":
        assert st["acceptance_rate"] > 0.95, st
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_draft_graphs_through_preemption_on_the_gpu(tiny_checkpoint):
    """A cache too small for every request (10 blocks of 16): preemptions free both pools'
    blocks; with the draft's graphs replayed the tokens are plain decoding's."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=32,
              max_num_seqs=16)
    want = _ids(_llm(path, num_gpu_blocks=256, **kw), prompts, params)
    llm = _llm(path, path, num_gpu_blocks=10, **kw)
    assert llm.engine.proposer.runner.graphs is not None
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert llm.engine.proposer.runner.graph_forwards > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_enforce_eager_captures_no_draft_graphs(tiny_checkpoint):
    path = tiny_checkpoint("head64_gqa")
    llm = _llm(path, path, device="cuda", attention_backend="triton", block_size=16,
               num_gpu_blocks=64, max_num_seqs=16, enforce_eager=True)
    assert llm.engine.runner.graphs is None and llm.engine.proposer.runner.graphs is None
    prompts = random_prompts(2, 5, 9, seed=1)
    assert _ids(llm, prompts, GREEDY) and llm.engine.proposer.runner.graph_forwards == 0
