"""DeepSeek (MLA + MoE) on the triton backend.

CPU (Triton interpreter, fp32): prompt chunks and prefix hits go through the prefill
kernel over the expanded latents (qk dim 24, v dim 16 in the tiny checkpoints) and give
torch_native's tokens. GPU: decode steps replay CUDA graphs (sync-free MoE, MLA decode
kernel) and give the eager run's tokens in fp32; bf16 follows fp32 as closely as eager.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashpage import LLM, SamplingParams
from tests.conftest import random_prompts

NAMES = ["deepseek_v2", "deepseek_v3"]


def _tokens(path, backend, device, dtype, prompts, params, **kw):
    llm = LLM(str(path), dtype=dtype, device=device, attention_backend=backend, block_size=16,
              **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.backend_name == backend
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize("name", NAMES)
def test_mla_prefill_kernel_matches_torch_native_interpreted(tiny_mla_checkpoint, name,
                                                              monkeypatch):
    pytest.importorskip("triton")
    import flashpage.kernels.flash_prefill as fp

    path = tiny_mla_checkpoint(name)
    # A 40-token prompt chunked by the 24-token budget (its second chunk attends over the
    # first chunk's expanded latents), a short one, and a prefix hit on a 16-token block.
    prompts = random_prompts(2, 5, 40, seed=3)
    prompts = [prompts[0] + list(range(40 - len(prompts[0]))), prompts[1]]
    prompts.append(prompts[0][:17] + [9, 8, 7])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    calls: list[tuple[int, int, int, int]] = []  # (queries, keys, qk dim, v dim)
    original = fp._args  # every launch's arguments, planned (VarlenPlan) or not

    def spy(q, k, v, *a, **kw):
        calls.append((q.shape[0], k.shape[0], q.shape[-1], v.shape[-1]))
        return original(q, k, v, *a, **kw)

    monkeypatch.setattr(fp, "_args", spy)
    got, llm = _tokens(path, "triton", "cpu", "float32", prompts, params,
                       max_num_batched_tokens=24)
    cfg = llm.engine.model_config
    assert calls, "MLA prefill never reached the Triton kernel"
    qk, vd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    assert {(c[2], c[3]) for c in calls} == {(qk, vd)}
    assert any(c[1] > c[0] for c in calls), "no chunk attended over a cached prefix"
    assert llm.engine.kv_manager.stats().prefix_hits > 0
    monkeypatch.undo()
    ref, _ = _tokens(path, "torch_native", "cpu", "float32", prompts, params,
                     max_num_batched_tokens=24)
    assert got == ref


# ----------------------------------------------------------------------------- GPU
def _leading_agreement(got: list[list[int]], truth: list[list[int]]) -> int:
    """Tokens each sequence matches the truth for, before its first difference."""
    total = 0
    for g, t in zip(got, truth, strict=True):
        for a, b in zip(g, t, strict=True):
            if a != b:
                break
            total += 1
    return total


def _staggered_params(n: int) -> list[SamplingParams]:
    """Requests finish at different steps, so decode batches shrink through the graph
    buckets (batch 1 takes the gathered-weights MoE variant, larger ones all-experts)."""
    return [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True)
            for i in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_graphs_match_eager_fp32(tiny_mla_checkpoint, name):
    from flashpage.engine.cuda_graph import DecodeGraphs

    path = tiny_mla_checkpoint(name)
    prompts = random_prompts(10, 1, 120, seed=9)
    prompts.append(prompts[3] + [5, 6, 7])  # a prefix hit
    params = _staggered_params(len(prompts))
    replays: list[int] = []
    original = DecodeGraphs.run

    def counting(self, input_ids, *a, **kw):
        replays.append(input_ids.shape[0])
        return original(self, input_ids, *a, **kw)

    DecodeGraphs.run = counting  # type: ignore[method-assign]
    try:
        graphs, llm = _tokens(path, "triton", "cuda", "float32", prompts, params, max_num_seqs=16)
    finally:
        DecodeGraphs.run = original  # type: ignore[method-assign]
    assert llm.engine.runner.graphs is not None, "DeepSeek decode graphs were not captured"
    assert 1 in replays and max(replays) > 2, replays
    eager, llm = _tokens(path, "triton", "cuda", "float32", prompts, params, max_num_seqs=16,
                         enforce_eager=True)
    assert llm.engine.runner.graphs is None
    assert graphs == eager
    native, _ = _tokens(path, "torch_native", "cuda", "float32", prompts, params)
    assert graphs == native


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_graphs_bf16_as_close_to_fp32_as_eager(tiny_mla_checkpoint, name):
    """bf16 greedy paths of a tiny random MoE model part from fp32 at near-ties (expert
    routing flips too); with graphs they must follow the fp32 tokens about as far as the
    eager bf16 run does. Each first token comes from the (uncaptured) prefill, the same
    code in both runs: those must be equal."""
    path = tiny_mla_checkpoint(name)
    prompts = random_prompts(16, 1, 120, seed=11)
    params = _staggered_params(len(prompts))
    truth, _ = _tokens(path, "torch_native", "cuda", "float32", prompts, params)
    eager_toks = _tokens(path, "triton", "cuda", "bfloat16", prompts, params, enforce_eager=True)[0]
    graph_toks = _tokens(path, "triton", "cuda", "bfloat16", prompts, params, max_num_seqs=16)[0]
    assert [t[0] for t in graph_toks] == [t[0] for t in eager_toks]
    eager16, graphs16 = _leading_agreement(eager_toks, truth), _leading_agreement(graph_toks, truth)
    total = sum(len(t) for t in truth)
    assert graphs16 >= eager16 - 0.05 * total, (graphs16, eager16, total)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", NAMES)
def test_piecewise_graphs_match_eager_fp32(tiny_mla_checkpoint, name, monkeypatch):
    """DeepSeek's piecewise graphs captured and replayed (MLA's attend eager between the
    pieces): prompts alone, more than four together and decodes beside a prompt chunk give
    the tokens of the engine without them, in fp32; no blocks left behind."""
    from flashpage.engine.cuda_graph import PiecewiseGraphs

    path = tiny_mla_checkpoint(name)
    prompts = random_prompts(6, 3, 30, seed=21) + random_prompts(2, 70, 90, seed=22)
    params = _staggered_params(len(prompts))
    kw = dict(max_num_seqs=16, max_num_batched_tokens=64)
    monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", "off")
    ref, llm = _tokens(path, "triton", "cuda", "float32", prompts, params, **kw)
    assert llm.engine.runner.piecewise is None
    del llm
    monkeypatch.setenv("FLASHPAGE_PIECEWISE_GRAPHS", "on")
    runs: list[tuple[int, int]] = []
    real = PiecewiseGraphs.run
    monkeypatch.setattr(PiecewiseGraphs, "run", lambda self, ids, pos, md: (
        runs.append((md.num_decodes, md.num_seqs)), real(self, ids, pos, md))[1])
    got, llm = _tokens(path, "triton", "cuda", "float32", prompts, params, **kw)
    pw = llm.engine.runner.piecewise
    assert pw is not None and max(pw.pieces) == 64 and pw.pieces
    assert got == ref
    assert any(0 < d < s for d, s in runs), runs  # a mixed step replayed the pieces
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
