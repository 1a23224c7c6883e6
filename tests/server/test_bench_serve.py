"""`flashpage bench serve` against a live server, and with the server it starts itself."""

from __future__ import annotations

import json

import pytest

from flashpage.bench import serve as bench_serve
from flashpage.bench.serve import percentiles


def test_percentiles_nearest_rank():
    xs = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    p = percentiles(xs)
    assert p["p50"] == 50.0 and p["p90"] == 90.0 and p["p99"] == 99.0
    assert p["mean"] == pytest.approx(50.5)


def test_bench_against_live_server(server, tmp_path):
    out = tmp_path / "serve.json"
    rc = bench_serve.main(["--url", server.url, "--num-prompts", "12", "--request-rate", "40",
                           "--input-len", "20", "--output-len", "6", "--range-ratio", "0.5",
                           "--json-out", str(out), "--seed", "1"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["failed"] == 0
    assert res["model"] == server.model
    assert 12 * 3 <= res["total_output_tokens"] <= 12 * 9
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        p = res[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
    assert res["ttft_ms"]["p50"] <= res["e2e_latency_ms"]["p50"]
    assert server.wait_idle()["flashpage:kv_cache_blocks_used"] == 0


def test_bench_starts_its_own_server(tiny_model_dir, tmp_path):
    """No --url: a server subprocess on loopback (random weights of a config, as on the GPU),
    engine flags passed through, then stopped."""
    out = tmp_path / "serve.json"
    rc = bench_serve.main(["--config", str(tiny_model_dir / "config.json"), "--num-prompts", "4",
                           "--input-len", "8", "--output-len", "4", "--warmup-requests", "1",
                           "--json-out", str(out), "--dtype", "float32", "--device", "cpu",
                           "--max-model-len", "64", "--server-timeout", "120"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 4 and res["total_output_tokens"] == 16
    assert res["url"].startswith("http://127.0.0.1:")
