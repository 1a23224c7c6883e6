"""The draft model's graphs (engine/draft_model.py): decode graphs (cuda_graph.DecodeGraphs)
for its single-token forwards and a catch-up of one token a request, replayed at the
target's batch buckets over the draft's own K/V pool; catch-up graphs (cuda_graph.PrefillGraphs
with tokens_per_seq = 1 + k) for its catch-ups of up to 1 + k tokens a request.

The CPU runs the graphs' padded static-buffer forwards eagerly (``capture=False``): padding
rows past the batch, padding request slots, the shrinking batches of requests with fewer
drafts, catch-ups of 1 .. k + 1 tokens side by side, the drafts fed from one forward to the
next on the device, must leave every token as plain decoding's and as the eager draft's,
and a catch-up must write the eager one's K/V slots and no others. The GPU tests capture
and replay them."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from flashpage import SamplingParams
from flashpage.engine.cuda_graph import DecodeGraphs, PrefillGraphs
from flashpage.engine.draft_model import decode_steps
from tests.conftest import build_tiny_checkpoint, fake_cuda_graphs, random_prompts
from tests.engine.test_draft_model import K, _ids, _llm, noisy_copy

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
    """``llm``'s draft with decode and catch-up graphs set up uncaptured (the CPU runs them
    eagerly); a log of each decode graph forward's (rows, bucket), and one of each catch-up
    graph forward's (its requests' token counts, its (slots, tokens) graph)."""
    runner = llm.engine.proposer.runner
    runner.capture_graphs(max_bs, llm.engine.max_model_len, capture=False)
    k = llm.engine.spec_config.num_speculative_tokens
    runner.capture_catchup_graphs(max_bs, llm.engine.max_model_len, 1 + k, capture=False)
    log: list[tuple[int, int]] = []
    ups: list[tuple[list[int], tuple[int, int]]] = []
    graphs, catchup = runner.graphs, runner.catchup
    real, real_up = graphs.run, catchup.run

    def spy(input_ids, positions, md, rows):
        log.append((md.num_seqs, graphs.bucket(md.num_seqs)))
        return real(input_ids, positions, md, rows)

    def spy_up(input_ids, positions, md, rows):
        ups.append((list(md.query_lens_cpu), catchup.key(md.num_seqs, md.num_actual_tokens)))
        return real_up(input_ids, positions, md, rows)

    graphs.run, catchup.run = spy, spy_up
    return log, ups


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
    eagerly. Catch-ups of several tokens a request (accepted drafts and the bonus token) take
    the catch-up graphs: all 1 + k tokens with every draft accepted, 1 .. 1 + k side by side
    where requests accepted different numbers (the noisy draft), padded to the bucket."""
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
    log, ups = _graphed(llm)
    assert _ids(llm, prompts, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert st == eager_st, (st, eager_st)  # the same drafts, drafted alike
    if which == "self":
        assert st["acceptance_rate"] == 1.0, st
        assert [1 + K] * 4 in [q for q, _ in ups], ups  # a batch of 4, every draft accepted
    else:  # catch-ups of different lengths in one forward
        assert any(len(set(q)) > 1 for q, _ in ups), ups
    assert any(b > n for n, b in log), log  # padding rows
    assert len({n for n, _ in log}) > 2, log  # shrinking batches as requests run out of drafts
    assert any(key[0] > len(q) for q, key in ups), ups  # padding request slots
    assert all(max(q) > 1 and max(q) <= 1 + K and key[1] == key[0] * (1 + K) for q, key in ups), ups
    runner = llm.engine.proposer.runner
    assert runner.graph_forwards == len(log) and runner.catchup_forwards == len(ups)
    log.clear()
    ups.clear()
    assert _ids(llm, prompts[:1], params[:1]) == want[:1]
    assert log and all(n == b == 1 for n, b in log), log
    assert ups and all(len(q) == 1 and key == (1, 1 + K) for q, key in ups), ups
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_graphed_drafts_through_preemption(tiny_checkpoint, noisy):
    """A cache too small for every request: preempted requests' blocks freed in both pools and
    recomputed, the draft's graph forwards in between; plain decoding's tokens."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(_llm(path), prompts, params)
    llm = _llm(path, noisy, block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32)
    log, ups = _graphed(llm, max_bs=8)
    assert _ids(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert log and ups and llm.engine.stats()["spec_decode"]["num_draft_tokens"] > 0
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_graphed_sampled_drafts_keep_their_q(tiny_checkpoint):
    """Seeded sampling, the target as its own draft, the graph path: the same tokens alone
    or in a batch, and every draft (drawn from q, checked against it) accepted."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(3, 5, 20, seed=6)
    seeded = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=5)
    other = SamplingParams(temperature=1.0, top_k=20, max_tokens=11, ignore_eos=True)
    llm = _llm(path, path)
    log, ups = _graphed(llm)
    alone = _ids(llm, prompts[:1], seeded)[0]
    assert _ids(llm, prompts, [seeded, other, SamplingParams(temperature=0.0, max_tokens=9)])[0] == alone
    st = llm.engine.stats()["spec_decode"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] > 0.95, st
    assert log and ups
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_draft_graph_capture_failure_leaves_the_draft_eager(tiny_checkpoint, monkeypatch, caplog):
    """LLMEngine._capture_draft_graphs (CUDA-only; stubbed here): the target's batch limit and
    graph pool, then the catch-up graphs (1 + k tokens a request) in the same pool where the
    draft's backend has a sync-free prompt path; a capture that raises leaves the draft eager
    (the catch-up graphs' alone its catch-ups) with a warning, the engine goes on."""
    path = tiny_checkpoint("llama31_gqa")
    llm = _llm(path, path, max_num_seqs=6)
    eng = llm.engine
    runner = eng.proposer.runner
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    asked, ups = [], []

    def decode(*a):
        asked.append(a)
        runner.graphs = "captured"
        return "pool"

    def catchup(*a):
        ups.append(a)
        runner.catchup = "caught up"
        return "pool"

    def broken(*a):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "capture_graphs", decode)
    monkeypatch.setattr(runner, "capture_catchup_graphs", catchup)
    eng._capture_draft_graphs(runner)  # torch_native: no prompt graphs
    assert asked == [(6, eng.max_model_len, None)] and runner.graphs == "captured" and not ups
    monkeypatch.setattr(runner.backend, "supports_prefill_graphs", True)
    eng._capture_draft_graphs(runner)
    assert ups == [(6, eng.max_model_len, 1 + K, "pool")] and runner.catchup == "caught up"
    monkeypatch.setattr(runner, "capture_catchup_graphs", broken)
    with caplog.at_level(logging.WARNING, logger="flashpage"):
        eng._capture_draft_graphs(runner)
    assert runner.graphs == "captured" and runner.catchup is None
    assert "catch-up CUDA graphs off" in caplog.text
    caplog.clear()
    monkeypatch.setattr(runner, "capture_graphs", broken)
    with caplog.at_level(logging.WARNING, logger="flashpage"):
        eng._capture_draft_graphs(runner)
    assert runner.graphs is None and runner.catchup is None
    assert "draft model CUDA graphs off" in caplog.text and "stream is capturing" in caplog.text
    prompts = random_prompts(2, 5, 9, seed=1)
    assert _ids(llm, prompts, GREEDY) == _ids(_llm(path), prompts, GREEDY)


def test_catchup_graph_keys_and_padding():
    """PrefillGraphs(tokens_per_seq=q, logits=False), not captured: one graph per slot bucket
    of slots x q tokens (none past max_tokens); a catch-up pads to the smallest, its padding
    rows write no slot, its padding slots have no queries, the host lengths are the step's
    (padding slots: none); the hidden states of the rows asked for come back."""
    from tests.engine.test_prefill_graphs import _Recorder, _step_md

    class Model(_Recorder):
        def forward(self, input_ids, positions, md):
            out = super().forward(input_ids, positions, md)
            self.seen[-1]["lens"] = (md.query_lens_cpu, md.seq_lens_cpu)
            return out

    model = Model()
    g = PrefillGraphs(model, lambda md: md, 40, 4, 16, torch.device("cpu"), (1, 2, 4, 8, 16),
                      tokens_per_seq=5, logits=False)
    assert g.keys == [(1, 5), (2, 10), (4, 20), (8, 40)]  # 16 x 5 > 40
    assert g.key(1, 2) == (1, 5) and g.key(3, 15) == (4, 20) and g.key(9, 9) is None
    assert g.rows((4, 20)) == 4
    big = _step_md([5] * 8, [30] * 8, 0)
    big.query_lens_cpu, big.seq_lens_cpu = [5] * 8, [30] * 8
    g.run(torch.arange(40), torch.arange(40), big, torch.arange(4, 40, 5))
    md = _step_md([1, 4, 2], [9, 12, 7], 100)
    md.query_lens_cpu, md.seq_lens_cpu = [1, 4, 2], [9, 12, 7]
    out = g.run(torch.arange(50, 57), torch.arange(7), md, torch.tensor([4, 6]))
    assert out[:, 0].tolist() == [54.0, 56.0]  # hidden states (the recorder's: the input ids)
    seen = model.seen[-1]
    assert seen["tokens"] == 20 and seen["max_q"] == 5
    assert seen["qsl"] == [0, 1, 5, 7, 7]
    assert seen["slots"] == list(range(100, 107)) + [-1] * 13
    assert seen["lens"] == ([1, 4, 2, 0], [9, 12, 7, 0])


def _catchup_writes(runner, capture: bool):
    """One catch-up forward of 3 requests (1, 5 and 3 tokens, after a larger one left its
    buffers stale) over a draft pool filled with a sentinel, eager and then through the
    catch-up graphs (``capture``: captured, on the GPU): the slots each writes, its K/V and
    its logits at the requests' last tokens."""
    from flashpage.engine.draft_model import _Row

    bs = runner.block_size
    tables = [np.array([3, 7, 1]), np.array([5, 2]), np.array([8, 4, 6])]
    ctx = [9, 4, 14]  # tokens in the pool before the catch-up
    new = [[11], [12, 13, 14, 15, 16], [17, 18, 19]]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 100, (n,), generator=g).tolist() for n in ctx]
    caches = [c for layer in runner.model.attention_layers() for c in layer.kv_cache]

    def run(graphed: bool):
        for c in caches:
            c.fill_(7.0)
        saved = runner.catchup
        runner.catchup = None
        runner.forward([_Row(None, 0, p, t) for p, t in zip(prompts, tables, strict=True)], [])
        before = [c.clone() for c in caches]
        runner.catchup = saved if graphed else None
        if graphed:  # a larger catch-up first: stale buffers past this one's rows
            runner.forward([_Row(None, 0, [1] * 5, np.array([9, 10]))] * 4, [0])
            for c, b in zip(caches, before, strict=True):
                c.copy_(b)
        n0 = runner.catchup_forwards
        logits = runner.forward([_Row(None, c, t, tb) for c, t, tb in zip(ctx, new, tables, strict=True)],
                                [0, 1, 2])
        assert runner.catchup_forwards == n0 + graphed
        runner.catchup = saved
        written = sorted({int(s) for c, b in zip(caches, before, strict=True)
                          for s in ((c != b).flatten(2).any(-1).flatten().nonzero()[:, 0].tolist())})
        return written, [c.clone() for c in caches], logits.float()

    runner.capture_catchup_graphs(4, 64, 5, capture=capture)
    want = sorted(int(t[p // bs]) * bs + p % bs for c, toks, t in zip(ctx, new, tables, strict=True)
                  for p in range(c, c + len(toks)))
    return want, run(False), run(True)


def test_graphed_catchup_writes_the_eager_slots(tiny_checkpoint):
    """The catch-up graphs' padded forward writes the draft's K/V into exactly the slots the
    eager forward writes (padding rows: none), the same values, and gives the same logits."""
    llm = _llm(tiny_checkpoint("llama31_gqa"), tiny_checkpoint("llama31_gqa"))
    want, (slots, kv, logits), (g_slots, g_kv, g_logits) = _catchup_writes(llm.engine.proposer.runner, False)
    assert slots == g_slots == want, (slots, g_slots, want)
    for a, b in zip(kv, g_kv, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(logits, g_logits)


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
@pytest.mark.parametrize("host", ["step", "bucket"])
def test_graphed_drafts_on_the_triton_backend(tiny_checkpoint, monkeypatch, host):
    """The graphs' padded forwards through the triton backend's kernels (interpreted): the
    decode kernel over the static buffers (tables as wide as the longest context, padding
    rows of context 1 in block 0) and the prompt kernel over the catch-up graphs' (padding
    request slots without queries, stale lengths and tables); plain decoding's tokens, every
    draft accepted. ``bucket``: the catch-ups' host lengths a captured graph's (the longest
    query 1 + k, the longest context the tables' capacity), not the step's own."""
    if host == "bucket":
        real = PrefillGraphs.forward
        monkeypatch.setattr(PrefillGraphs, "forward", lambda self, seqs, tokens, lens=None:
                            real(self, seqs, tokens))
    path = tiny_checkpoint("head64_gqa")
    prompts = [random_prompts(1, 4, 4, seed=8)[0], random_prompts(1, 9, 9, seed=9)[0],
               random_prompts(1, 6, 6, seed=10)[0]]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 3, 5)]
    want = _ids(_llm(path, block_size=16), prompts, params)
    llm = _llm(path, path, attention_backend="triton", block_size=16, spec={"num_speculative_tokens": 2})
    log, ups = _graphed(llm)
    assert _ids(llm, prompts, params) == want
    assert any(b > n for n, b in log), log
    assert any(q == [3] * len(q) for q, _ in ups), ups  # 1 + k tokens a request: the prompt kernel
    assert llm.engine.stats()["spec_decode"]["acceptance_rate"] == 1.0


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_draft_graph_capture_on_fake_graphs(tiny_checkpoint, monkeypatch):
    """The capture's bookkeeping, which only a GPU runs for real, on stand-in graphs (the
    triton backend, interpreted: a capture has no host lengths): every bucket captured in the
    pool handed over (the target's), each graph's output the hidden states [bucket, hidden],
    the catch-up graphs' likewise; a step then replays its bucket's graph."""
    captured = fake_cuda_graphs(monkeypatch)
    path = tiny_checkpoint("head64_gqa")
    llm = _llm(path, path, attention_backend="triton", block_size=16, spec={"num_speculative_tokens": 2})
    runner = llm.engine.proposer.runner
    assert runner.capture_graphs(4, llm.engine.max_model_len, "target-pool") == "target-pool"
    g = runner.graphs
    assert captured == [("capture", "target-pool")] * 3 and g.pool == "target-pool"
    hidden = llm.engine.model_config.hidden_size
    assert {b: tuple(t.shape) for b, t in g.logits.items()} == {b: (b, hidden) for b in (1, 2, 4)}
    captured.clear()
    # the catch-up graphs (1 + k = 3 tokens a request): one per bucket, the hidden states of
    # a row per request slot
    assert runner.capture_catchup_graphs(4, llm.engine.max_model_len, 3, "target-pool") == "target-pool"
    up = runner.catchup
    assert captured == [("capture", "target-pool")] * 3 and up.keys == [(1, 3), (2, 6), (4, 12)]
    assert {k: tuple(t.shape) for k, t in up.logits.items()} == {(s, 3 * s): (s, hidden) for s in (1, 2, 4)}
    captured.clear()
    prompts = random_prompts(2, 4, 9, seed=1)
    # replays of fake graphs compute nothing: the tokens are not checked, only the dispatch
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    mine = {*g.graphs.values(), *up.graphs.values()}
    assert captured and all(e[0] == "replay" and e[1] in mine for e in captured)
    assert runner.graph_forwards + runner.catchup_forwards == len(captured)


def _gpu_llms(path, draft, **kw):
    kw = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=128,
              num_gpu_blocks=256, max_num_seqs=16, **kw)
    return _llm(path, **kw), _llm(path, draft, spec={"backoff": False}, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("draft", ["self", "other", "noisy"])
def test_draft_graphs_on_the_gpu(tiny_checkpoint, tmp_path, draft, monkeypatch):
    """fp32, triton backend, both models' decode graphs and the draft's catch-up graphs
    captured: batch 1 and a batch of 5 ragged requests with max_tokens ending mid-step give
    plain decoding's tokens and the eager draft's (the same engine with its draft graphs set
    aside); the draft's graphs are replayed (a replay per single-token forward at least, and
    per catch-up of several tokens a request where drafts were accepted)."""
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
    catchup = runner.catchup
    assert catchup is not None and set(catchup.graphs) == set(catchup.keys) and catchup.keys
    assert catchup.tokens_per_seq == 1 + K and catchup.with_logits is False
    mine, ups = set(graphs.graphs.values()), set(catchup.graphs.values())
    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay",
                        lambda g: (replays.append((g in mine, g in ups)), real(g))[1])
    runner.graph_forwards = runner.catchup_forwards = 0
    got1 = _ids(llm, prompts[:1], params[:1])
    got = _ids(llm, prompts, params)
    st = llm.engine.stats()["spec_decode"]
    used, caught = runner.graph_forwards, runner.catchup_forwards
    runner.graphs = runner.catchup = None  # the same engine, the draft eager
    eager1, eager = _ids(llm, prompts[:1], params[:1]), _ids(llm, prompts, params)
    runner.graphs, runner.catchup = graphs, catchup
    assert got1 == eager1 == want[:1]
    assert got == eager == want
    assert used > 0 and sum(d for d, _ in replays) == used, (used, replays)
    assert sum(u for _, u in replays) == caught, (caught, replays)
    assert st["num_draft_tokens"] > 0
    if draft != "other":  # drafts accepted: catch-ups of several tokens a request
        assert caught > 0, st
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
    assert llm.engine.proposer.runner.catchup_forwards > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_catchup_writes_the_eager_slots_on_the_gpu(tiny_checkpoint):
    """fp32, triton backend, the catch-up graphs captured: a catch-up of 1, 5 and 3 tokens
    (padded to 4 request slots of 5 tokens) replayed writes the draft's K/V into exactly the
    eager forward's slots, the same values, and gives its logits."""
    path = tiny_checkpoint("head64_gqa")
    llm = _llm(path, path, device="cuda", attention_backend="triton", block_size=16,
               num_gpu_blocks=64, max_num_seqs=16)
    runner = llm.engine.proposer.runner
    want, (slots, kv, logits), (g_slots, g_kv, g_logits) = _catchup_writes(runner, True)
    assert runner.catchup is not None and runner.catchup.graphs
    assert slots == g_slots == want, (slots, g_slots, want)
    # fp32 through Triton's tf32 dots, the eager and graphed steps' host lengths (the prompt
    # kernel's choices) apart: close, not equal (a wrong slot would be the sentinel, 7.0)
    for a, b in zip(kv, g_kv, strict=True):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(logits, g_logits, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_enforce_eager_captures_no_draft_graphs(tiny_checkpoint):
    path = tiny_checkpoint("head64_gqa")
    llm = _llm(path, path, device="cuda", attention_backend="triton", block_size=16,
               num_gpu_blocks=64, max_num_seqs=16, enforce_eager=True)
    runner = llm.engine.proposer.runner
    assert llm.engine.runner.graphs is None and runner.graphs is None and runner.catchup is None
    prompts = random_prompts(2, 5, 9, seed=1)
    assert _ids(llm, prompts, GREEDY) and runner.graph_forwards == runner.catchup_forwards == 0
