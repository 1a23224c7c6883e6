"""CUDA graphs of prompt steps: short prompt-only steps whole (engine/cuda_graph.PrefillGraphs),
the other steps of up to 1024 tokens in pieces around attention (PiecewiseGraphs).

The CPU runs the graphs' padded static-buffer steps eagerly (``capture=False``) under the
Triton interpreter: the padding (rows past the step's tokens, request slots past its
requests, stale buffer contents from larger steps) must leave every token as the plain
step gives it. The GPU test captures and replays them."""

from __future__ import annotations

import os

import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.engine.cuda_graph import PiecewiseGraphs, PrefillGraphs, prefill_buckets
from tests.conftest import random_prompts, record_prompt_graph_keys

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_prefill_buckets_and_keys():
    assert prefill_buckets(8192) == [4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert prefill_buckets(300) == [4, 8, 16, 32, 64, 96, 128, 192, 256, 300]
    assert prefill_buckets(8) == [4, 8]
    assert prefill_buckets(6) == [4, 6]
    pg = PrefillGraphs(torch.nn.Identity(), lambda md: md, 300, 4, 16, torch.device("cpu"))
    assert pg.key(1, 1) == (1, 4)
    assert pg.key(1, 5) == (1, 8)
    assert pg.key(1, 9) == (1, 16)
    assert pg.key(1, 17) == (1, 32)
    # one logits row per slot; with speculative decoding 1 + k, capped by the token bucket
    assert pg.rows((4, 300)) == 4
    spec = PrefillGraphs(torch.nn.Identity(), lambda md: md, 300, 4, 16, torch.device("cpu"), rows_per_seq=5)
    assert spec.rows((1, 4)) == 4 and spec.rows((1, 8)) == 5 and spec.rows((4, 16)) == 16
    assert spec.rows((4, 32)) == 20 and spec.logits_indices.shape == (20,)
    assert pg.key(2, 300) == (4, 300)
    assert pg.key(4, 97) == (4, 128)
    assert pg.key(5, 20) is None  # more requests than slots: eager
    assert pg.key(1, 301) is None  # more tokens than the largest bucket: eager


class _Recorder(torch.nn.Module):
    """A model that returns each row's input id as its hidden state and records what the
    padded step showed it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids, positions, md):
        self.seen.append(dict(tokens=input_ids.shape[0], qsl=md.query_start_loc.tolist(),
                              slots=md.slot_mapping.tolist(), seq_lens=md.seq_lens.tolist(),
                              max_q=md.max_query_len))
        return input_ids.float()[:, None]

    def compute_logits(self, hidden):
        return hidden


def _step_md(q_lens, ctx_lens, first_slot):
    from flashpage.attention.backend import AttentionMetadata

    n = sum(q_lens)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=n, num_seqs=len(q_lens), query_start_loc=qsl,
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        block_tables=torch.arange(len(q_lens) * 2, dtype=torch.int32).view(-1, 2),
        slot_mapping=torch.arange(first_slot, first_slot + n), max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens), num_decodes=0, num_decode_tokens=0)


def test_padding_after_a_larger_step():
    """A small step after a large one: its padding rows write no slot, its padding request
    slots have no queries (a stale offset past the bucket would send a kernel out of its
    rows), the logits rows it does not sample point at row 0, whatever the larger step
    left in the buffers."""
    model = _Recorder()
    pg = PrefillGraphs(model, lambda md: md, 64, 4, 16, torch.device("cpu"))
    ids = torch.arange(100, 164)
    big = _step_md([20, 20, 20, 4], [20, 20, 20, 4], 0)
    logits = pg.run(ids, torch.arange(64), big, torch.tensor([19, 39, 59, 63]))
    assert logits[:, 0].tolist() == [119, 139, 159, 163]
    assert model.seen[-1]["tokens"] == 64 and model.seen[-1]["qsl"] == [0, 20, 40, 60, 64]
    small = _step_md([6, 4], [6, 10], 200)
    logits = pg.run(ids[:10], torch.arange(10), small, torch.tensor([5]))  # one of two sampled
    seen = model.seen[-1]
    assert seen["tokens"] == 16 and seen["max_q"] == 16
    assert seen["qsl"] == [0, 6, 10, 10, 10]
    assert seen["slots"] == list(range(200, 210)) + [-1] * 6
    assert seen["seq_lens"][:2] == [6, 10]
    assert logits[:, 0].tolist() == [105]
    assert pg.logits_indices.tolist() == [5, 0, 0, 0]


def _steps(llm, batches):
    """Each batch of prompts generated in turn (so each starts with a prompt-only step)."""
    out = []
    for prompts in batches:
        out += [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return out


def _batches():
    short = random_prompts(3, 3, 14, seed=21)
    long_ = random_prompts(1, 40, 40, seed=22)  # chunked by the 32-token budget
    return [
        long_,  # 32 tokens (no sample: a middle chunk), then 8 over the cached 32
        short,  # three requests in one step: 4 slots, one padding
        [long_[0][:33] + [5, 6]],  # a prefix hit: 32 cached, 3 new
        random_prompts(6, 2, 5, seed=23),  # six requests: more than 4, eager
        random_prompts(1, 2, 2, seed=24),  # 2 tokens, a step after larger ones (stale buffers)
        # 5 + 27 tokens, then the 40-token prompt's last 13 beside the first one's decode
        random_prompts(1, 5, 5, seed=25) + random_prompts(1, 40, 40, seed=26),
    ]


_CPU_REF: dict[str, list[list[int]]] = {}


def _cpu_reference(tiny_checkpoint):
    """The tiny model's path, the engine's arguments and its plain (eager, unpadded) tokens
    for ``_batches()`` on the CPU: computed once for both CPU tests (interpreted: ~25 s)."""
    path = str(tiny_checkpoint("head64_gqa"))
    kw = dict(dtype="float32", device="cpu", attention_backend="triton", block_size=16,
              max_num_batched_tokens=32)
    if path not in _CPU_REF:
        _CPU_REF[path] = _steps(LLM(path, **kw), _batches())
    return path, kw, _CPU_REF[path]


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_padded_prompt_steps_give_the_plain_steps_tokens(tiny_checkpoint, monkeypatch):
    pytest.importorskip("triton")
    path, kw, ref = _cpu_reference(tiny_checkpoint)

    llm = LLM(path, **kw)
    runner = llm.engine.runner
    runner.capture_prefill_graphs(32, llm.engine.max_model_len, capture=False)
    pg = runner.prefill_graphs
    assert pg is not None and pg.token_buckets == [4, 8, 16, 32]
    keys = record_prompt_graph_keys(monkeypatch)
    got = _steps(llm, _batches())
    assert got == ref
    # the middle chunk (no sample), its last 8 tokens, three prompts in 4 slots, the prefix
    # hit's 3 new tokens, the 2-token prompt; the 6-request step ran eagerly
    assert keys == [((1, 32), 0), ((1, 8), 1), ((4, 32), 3), ((1, 4), 1), ((1, 4), 1),
                    ((4, 32), 1)], keys
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_piecewise_steps_give_the_plain_steps_tokens(tiny_checkpoint, monkeypatch):
    """Every step but the whole-graph ones through the pieces (run eagerly here): prompts
    alone and in sixes, decodes beside a prompt chunk, decodes alone (the decode graphs
    are not captured on the CPU), with the attention over each step's own metadata."""
    pytest.importorskip("triton")
    path, kw, ref = _cpu_reference(tiny_checkpoint)
    llm = LLM(path, **kw)
    llm.engine.runner.capture_piecewise_graphs(32, capture=False)
    steps = []
    real = PiecewiseGraphs.run

    def spy(self, input_ids, positions, md):
        steps.append((md.num_decodes, md.num_seqs, md.num_actual_tokens))
        return real(self, input_ids, positions, md)

    monkeypatch.setattr(PiecewiseGraphs, "run", spy)
    assert _steps(llm, _batches()) == ref
    assert (1, 2, 14) in steps, steps  # the mixed step: 1 decode + the last 13 prompt tokens
    assert (0, 6, sum(map(len, _batches()[3]))) in steps, steps  # six prompts in one step
    assert any(d == s > 1 for d, s, _ in steps), steps  # decodes alone
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prompt_graphs_captured_and_replayed_gpu(tiny_checkpoint, monkeypatch):
    """fp32 on the GPU: replayed prompt graphs, whole and in pieces, give the eager engine's
    tokens (the same kernels; only the padded rows differ)."""
    path = str(tiny_checkpoint("head64_gqa"))
    kw = dict(dtype="float32", device="cuda", attention_backend="triton", block_size=16,
              max_num_batched_tokens=32)
    monkeypatch.setenv("FLASHPAGE_PREFILL_GRAPHS", "0")
    monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", "0")
    eager = LLM(path, **kw)
    assert eager.engine.runner.prefill_graphs is None and eager.engine.runner.piecewise is None
    ref = _steps(eager, _batches())
    del eager
    monkeypatch.setenv("FLASHPAGE_PREFILL_GRAPHS", "1")
    monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", "1")
    llm = LLM(path, **kw)
    pg, pw = llm.engine.runner.prefill_graphs, llm.engine.runner.piecewise
    assert pg is not None and set(pg.graphs) == {(s, t) for s in (1, 4) for t in (4, 8, 16, 32)}
    assert pw is not None and set(pw.pieces) == {4, 8, 16, 32}
    assert all(len(p) == 3 for p in pw.pieces.values())  # 2 layers: 3 pieces around 2 attentions
    replays = []
    real = torch.cuda.CUDAGraph.replay
    whole = set(pg.graphs.values())
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay",
                        lambda g: (replays.append("whole" if g in whole else g), real(g))[1])
    assert _steps(llm, _batches()) == ref
    assert replays.count("whole") == 6, replays  # the six prompt-only steps the CPU test names
    pieces = {id(p) for ps in pw.pieces.values() for p in ps}
    assert sum(id(g) in pieces for g in replays if g != "whole") >= 2 * 3  # the six-prompt and mixed steps
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_piecewise_alone_gpu(tiny_checkpoint, monkeypatch):
    """Piecewise graphs without the whole-step ones take every non-decode step (prompts of
    one request too) and still give the eager engine's fp32 tokens."""
    path = str(tiny_checkpoint("head64_gqa"))
    kw = dict(dtype="float32", device="cuda", attention_backend="triton", block_size=16,
              max_num_batched_tokens=32)
    monkeypatch.setenv("FLASHPAGE_PREFILL_GRAPHS", "0")
    monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", "0")
    ref = _steps(LLM(path, **kw), _batches())
    monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", "1")
    llm = LLM(path, **kw)
    assert llm.engine.runner.prefill_graphs is None and llm.engine.runner.piecewise is not None
    runs = []
    real = PiecewiseGraphs.run
    monkeypatch.setattr(PiecewiseGraphs, "run", lambda self, *a: (runs.append(a[2].num_seqs), real(self, *a))[1])
    assert _steps(llm, _batches()) == ref
    assert len(runs) >= 8, runs
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_prompt_logprobs_through_the_pieces(tiny_checkpoint):
    """A request with prompt_logprobs never takes a whole-step graph (its logits rows are
    the prompt's); through the pieces (run eagerly) its prompt logprobs equal the plain
    engine's, chunked over a 16-token budget."""
    path = str(tiny_checkpoint("head64_gqa"))
    kw = dict(dtype="float32", device="cpu", attention_backend="triton", block_size=16,
              max_num_batched_tokens=16)
    prompt = random_prompts(1, 20, 20, seed=51)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    ref = LLM(path, **kw).generate([prompt], params, use_tqdm=False)[0]
    llm = LLM(path, **kw)
    llm.engine.runner.capture_prefill_graphs(16, llm.engine.max_model_len, capture=False)
    llm.engine.runner.capture_piecewise_graphs(16, capture=False)
    whole = []
    real = PrefillGraphs.run
    PrefillGraphs.run = lambda self, *a: (whole.append(1), real(self, *a))[1]  # type: ignore[method-assign]
    try:
        got = llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        PrefillGraphs.run = real  # type: ignore[method-assign]
    assert not whole
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(got.prompt_logprobs) == len(prompt) == len(ref.prompt_logprobs)
    for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-5 and a.top[0][0] == b.top[0][0]


def test_decode_graph_inputs_after_a_larger_batch():
    """DecodeGraphs.run's loading (the replay stubbed): the step's rows in place, padding rows
    up to the bucket with slot -1, a context of 1 and block 0, whatever a larger batch left."""
    from flashpage.engine.cuda_graph import DecodeGraphs

    class Replay:
        calls = 0

        def replay(self):
            Replay.calls += 1

    g = DecodeGraphs(torch.nn.Identity(), 8, 4, torch.device("cpu"))
    for bs in g.buckets:
        g.graphs[bs] = Replay()  # type: ignore[assignment]
        g.logits[bs] = torch.arange(bs, dtype=torch.float32)[:, None].expand(bs, 5)
    big = _step_md([1] * 8, [9] * 8, 100)
    g.run(torch.arange(8), torch.arange(8), big, 8)
    small = _step_md([1] * 3, [5, 6, 7], 40)
    logits = g.run(torch.tensor([7, 8, 9]), torch.tensor([4, 5, 6]), small, 3)
    assert Replay.calls == 2 and logits.shape == (3, 5) and g.bucket(3) == 4
    assert g.input_ids[:3].tolist() == [7, 8, 9] and g.positions[:3].tolist() == [4, 5, 6]
    assert g.slot_mapping[:4].tolist() == [40, 41, 42, -1]
    assert g.seq_lens[:4].tolist() == [5, 6, 7, 1]
    assert g.block_tables[3].tolist() == [0, 0, 0, 0] and g.block_tables[:3, :2].tolist() == [[0, 1], [2, 3], [4, 5]]


def test_piecewise_capture_bookkeeping_on_fake_graphs(tiny_checkpoint, monkeypatch):
    """The capture's sequencing, which only a GPU runs for real, on stand-in graphs: per
    bucket one piece more than attention layers, each begun in the pool of the first; every
    layer's call records static inputs (the capture's copies landed in them) and the one
    static output; a replay runs piece, core over the step's metadata, piece, ... in order."""
    from flashpage.engine.cuda_graph import PiecewiseGraphs

    log = []

    class FakeGraph:
        def capture_begin(self, pool=None):
            log.append(("begin", pool))

        def capture_end(self):
            log.append(("end",))

        def pool(self):
            return "pool-0"

        def replay(self):
            log.append(("replay", self))

    class FakeStream:
        def __init__(self, *a):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu",
              max_num_batched_tokens=32)
    layers = llm.engine.model.config.num_hidden_layers
    pg = PiecewiseGraphs(llm.engine.model, 32, torch.device("cpu"))
    pg.input_ids[:32] = torch.arange(5, 37)
    assert pg.capture() == "pool-0"
    assert set(pg.pieces) == {4, 8, 16, 32} and all(len(p) == layers + 1 for p in pg.pieces.values())
    assert log[0] == ("begin", None) and all(e == ("begin", "pool-0") for e in log[1:] if e[0] == "begin")
    assert [e[0] for e in log] == ["begin", "end"] * (4 * (layers + 1))
    q_width = llm.engine.model_config.num_attention_heads * llm.engine.model_config.head_dim
    for tokens, calls in pg.calls.items():
        assert len(calls) == layers
        for run, inputs, out in calls:
            assert callable(run)
            assert [t.shape[0] for t in inputs] == [tokens] * 3  # q, k, v of the bucket's rows
            assert out.shape[0] == tokens and out.numel() == tokens * q_width
            assert out.data_ptr() == pg.out.data_ptr()  # one static output
            assert inputs[0].abs().sum() > 0  # the capture's copy of q landed
    seen = []
    for calls in pg.calls.values():  # each core stands in: it says which layer and what it got
        for i, (_, inputs, out) in enumerate(calls):
            calls[i] = (lambda md, *t, i=i, shape=out.shape: (
                seen.append((i, md.num_actual_tokens, len(t))), torch.full(shape, float(i)))[1],
                inputs, out)
    log.clear()
    md = _step_md([5, 7], [5, 7], 0)
    with torch.inference_mode():  # as the model runner runs steps
        pg.run(torch.arange(12), torch.arange(12), md)
    assert [e[0] for e in log] == ["replay"] * (layers + 1)
    assert seen == [(i, 12, 3) for i in range(layers)]  # in order, the step's own metadata
    assert log[0][1] is pg.pieces[16][0] and log[-1][1] is pg.pieces[16][-1]
    assert pg.out[:12 * q_width].eq(layers - 1).all()  # the last core's rows in the static output


def test_a_failed_prompt_graph_capture_leaves_those_steps_eager(tiny_checkpoint, monkeypatch, caplog):
    """LLMEngine._capture_graphs (CUDA-only; stubbed here): a prompt-only or piecewise capture
    that raises turns that kind off with a warning naming it, the engine goes on; a decode
    capture that raises stops the engine."""
    import logging

    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu")
    eng, runner = llm.engine, llm.engine.runner
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(runner, "capture_decode_graphs", lambda *a, **k: None)
    monkeypatch.setattr(runner, "capture_prefill_graphs",
                        lambda *a, **k: setattr(runner, "prefill_graphs", "whole"))

    def broken(*a, **k):
        runner.piecewise = "half-built"
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "capture_piecewise_graphs", broken)
    with caplog.at_level(logging.WARNING, logger="flashpage"):
        eng._capture_graphs(True)
    assert runner.prefill_graphs == "whole" and runner.piecewise is None
    assert "piecewise (attention eager) CUDA graphs off" in caplog.text and "stream is capturing" in caplog.text
    monkeypatch.setattr(runner, "capture_decode_graphs", broken)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        eng._capture_graphs(True)


def test_piecewise_switch_values(tiny_checkpoint, monkeypatch):
    """FLASHPAGE_PIECEWISE_GRAPHS: on (default) where the model supports the pieces, all also
    where they wait for a GPU run (supports_piecewise_graphs = False), off nowhere; anything
    else names the variable."""
    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu")
    eng, runner = llm.engine, llm.engine.runner
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(runner, "capture_decode_graphs", lambda *a, **k: None)
    monkeypatch.setattr(runner, "capture_prefill_graphs", lambda *a, **k: None)
    asked = []
    monkeypatch.setattr(runner, "capture_piecewise_graphs", lambda n: asked.append(n))
    monkeypatch.setattr(type(eng.model), "supports_piecewise_graphs", False, raising=False)
    monkeypatch.setattr(type(eng.model), "max_graph_tokens", 100, raising=False)
    for value, want in (("on", []), (None, []), ("off", []), ("0", []), ("all", [100])):
        asked.clear()
        if value is None:
            monkeypatch.delenv("FLASHPAGE_PIECEWISE_GRAPHS", raising=False)
        else:
            monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", value)
        eng._capture_graphs(True)
        assert asked == want, value
    monkeypatch.setattr(type(eng.model), "supports_piecewise_graphs", True)
    monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", "1")
    eng._capture_graphs(True)
    assert asked == [100, 100]  # the model's max_graph_tokens caps the buckets
    monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="FLASHPAGE_PIECEWISE_GRAPHS must be on, off or all"):
        eng._capture_graphs(True)
