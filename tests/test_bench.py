"""`flashpage bench throughput|latency` run end to end on a tiny random shape (CPU), with
transformers on the same prompts, and report consistent figures."""

from __future__ import annotations

import json

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


def test_bench_latency(tiny_checkpoint, tmp_path):
    out = tmp_path / "l.json"
    cfg = tiny_checkpoint("llama2_mha") / "config.json"
    assert main(["bench", "latency", "--config", str(cfg), "--input-len", "8", "--output-len", "6",
                 "--iters", "2", "--no-hf", "--json-out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["batch_size"] == 1 and r["flashpage"]["decode_tok_per_s"] > 0
    assert "transformers" not in r
