"""`flashpage bench throughput|latency` run end to end on a tiny random shape (CPU), with
transformers on the same prompts, and report consistent figures."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flashpage.cli import main


def test_bench_throughput_with_transformers(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "t.json"
    cfg = tiny_checkpoint("llama2_mha") / "config.json"
    assert main(["bench", "throughput", "--config", str(cfg), "--num-requests", "6",
                 "--input-len", "8", "24", "--output-len", "4", "12", "--hf-batch-size", "3",
                 "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())
    wl, ours, hf = r["workload"], r["flashpage"], r["transformers"]
    assert ours["output_tok_per_s"] > 0 and hf["output_tokens"] == wl["output_tokens"]
    assert abs(r["speedup_vs_transformers"] - ours["output_tok_per_s"] / hf["output_tok_per_s"]) < 1e-9
    assert r["attention_backend"] == "torch_native" and not hf["subset"]
    steps = ours["steps"]  # every step of the run, split by kind, adds up to the run
    assert steps["with_prompt_tokens"]["steps"] >= 1
    assert sum(g["seconds"] for g in steps.values()) <= ours["seconds"] + 1e-3
    assert sum(g["seconds"] for g in steps.values()) >= 0.5 * ours["seconds"]
    assert all("gpu_ms_per_step" not in g for g in steps.values())  # CUDA events only


def test_step_summary_groups_wall_and_gpu_time_per_step():
    """Steps by kind (prompt tokens, decode batch ranges), wall time from one schedule() to
    the next, and with CUDA-event spans (one per step, in order) the GPU's mean per group."""
    from flashpage.bench.throughput import _step_summary

    # (time scheduled, requests, tokens): a prompt step, two decode steps of 40, one of 200,
    # then an empty step (skipped) and the end of the run
    timeline = [(0.0, 4, 900), (0.2, 40, 40), (0.21, 40, 40), (0.222, 200, 200), (0.24, 0, 0),
                (0.25, 0, 0)]
    gpu = [150.0, 7.0, 9.0, 12.0, 0.1]
    s = _step_summary(timeline, gpu)
    assert set(s) == {"with_prompt_tokens", "decode_batch_32_127", "decode_batch_128_1048576"}
    assert s["with_prompt_tokens"] == {"steps": 1, "seconds": 0.2, "ms_per_step": 200.0,
                                       "gpu_ms_per_step": 150.0, "gpu_ms": [150.0]}
    assert s["decode_batch_32_127"]["steps"] == 2 and s["decode_batch_32_127"]["gpu_ms_per_step"] == 8.0
    assert abs(s["decode_batch_32_127"]["ms_per_step"] - 11.0) < 1e-9
    assert s["decode_batch_128_1048576"]["gpu_ms_per_step"] == 12.0
    assert "gpu_ms_per_step" not in _step_summary(timeline)["with_prompt_tokens"]


def test_bench_latency(tiny_checkpoint, tmp_path):
    out = tmp_path / "l.json"
    cfg = tiny_checkpoint("llama2_mha") / "config.json"
    assert main(["bench", "latency", "--config", str(cfg), "--input-len", "8", "--output-len", "6",
                 "--iters", "2", "--no-hf", "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["batch_size"] == 1 and r["flashpage"]["decode_tok_per_s"] > 0
    assert "transformers" not in r


def test_weight_bytes_counts_the_routed_experts_a_step_reads():
    """bench latency's weight-read limit: one token reads top_k of the routed experts, not
    all of them (DeepSeek-V2-Lite had reported 159% of a limit that counted every expert)."""
    import torch

    from flashpage.bench.common import weight_bytes
    from flashpage.config import ModelConfig
    from flashpage.layers.moe import FusedExperts

    cfg = ModelConfig(architecture="DeepseekV2ForCausalLM", model_type="deepseek_v2",
                      vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=4)
    model = torch.nn.Module()
    model.experts = FusedExperts(cfg)
    model.dense = torch.nn.Linear(16, 16, bias=False)
    experts = sum(p.numel() * 4 for p in model.experts.parameters())
    dense = 16 * 16 * 4
    assert weight_bytes(model) == experts + dense
    assert weight_bytes(model, tokens=1) == experts * 2 // 8 + dense
    assert weight_bytes(model, tokens=3) == experts * 6 // 8 + dense
    assert weight_bytes(model, tokens=64) == experts + dense  # every expert at most once
    # MXFP4 experts (buffers: e2m1 blocks and e8m0 scales, 4.25 bits a weight) count too
    mx = torch.nn.Module()
    mx.experts = FusedExperts(dataclasses.replace(cfg, hidden_size=32, moe_intermediate_size=32),
                              mxfp4=True)
    held = 8 * 3 * 32 * 32 * 17 // 32  # E * (2I * H + H * I) weights
    assert not list(mx.experts.parameters()) and weight_bytes(mx) == held
    assert weight_bytes(mx, tokens=1) == held * 2 // 8


def test_jit_recorder_counts_new_specializations_and_restores_the_hook():
    """bench throughput's record of kernels compiled inside the timed run: names counted,
    a hook set before is still called (and its answer passed on), and put back after."""
    triton = pytest.importorskip("triton")
    from types import SimpleNamespace

    from flashpage.bench.throughput import _JitRecorder

    knobs = triton.knobs.runtime
    seen = []

    def prev(*, fn, **kw):
        seen.append(fn.name)
        return None

    old = knobs.jit_cache_hook
    knobs.jit_cache_hook = prev
    try:
        with _JitRecorder() as rec:
            for name in ("_rms_norm_kernel", "_silu_mul_kernel", "_rms_norm_kernel"):
                assert knobs.jit_cache_hook(fn=SimpleNamespace(name=name), key=None) is None
        assert rec.counts() == {"_rms_norm_kernel": 2, "_silu_mul_kernel": 1}
        assert seen == ["_rms_norm_kernel", "_silu_mul_kernel", "_rms_norm_kernel"]
        assert knobs.jit_cache_hook is prev
    finally:
        knobs.jit_cache_hook = old


def test_bench_prompts_leave_out_an_image_models_placeholders(tmp_path):
    """Random prompt ids never hold an image model's placeholders (a prompt with an image
    token and no image is refused): `bench throughput` on a vision-language config runs every
    request. Tiny Qwen2.5-VL: a vocabulary of 256 where 240-243 are its vision tokens."""
    from flashpage.bench.common import make_workload
    from tests.qwen2_vl_checkpoint import build_tiny_qwen2_vl

    wl = make_workload(20, (30, 40), (1, 2), 10, avoid={3, 4, 9})
    ids = [t for p in wl.prompts for t in p]
    assert not {3, 4, 9} & set(ids) and set(ids) <= set(range(10))
    assert [len(p) for p in wl.prompts] == [len(p) for p in make_workload(20, (30, 40), (1, 2), 10).prompts]
    path = build_tiny_qwen2_vl(tmp_path / "q", variant="qwen2_5_vl")
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--config", str(path / "config.json"), "--num-requests", "8",
                 "--input-len", "200", "256", "--output-len", "2", "3", "--no-hf", "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["workload"]["requests"] == 8 and r["flashpage"]["output_tok_per_s"] > 0  # every request ran
