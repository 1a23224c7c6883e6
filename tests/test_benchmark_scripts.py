"""Every benchmark script at least imports and parses its arguments on a machine without a
GPU, so a broken import is found here, not in the GPU budget of the next session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "gpu_timing.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_imports_and_parses_arguments(script):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-2000:]
    # Either its help, or (GPU-only scripts) a one-line refusal that says why.
    assert r.returncode == 0 or "needs a CUDA GPU" in out, out[-2000:]


def test_fused_moe_gpt_oss_runs_in_the_interpreter(tmp_path):
    """benchmarks/fused_moe.py --model gpt-oss-20b on the CPU (tiny shapes, the Triton
    interpreter): every path, the MXFP4 ones included, runs and agrees with sync-free."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--model",
                        "gpt-oss-20b", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    rows = json.loads((tmp_path / "fused_moe_gpt-oss-20b.json").read_text())["rows"]
    paths = {row["path"].split(" (")[0] for row in rows}
    assert {"fused", "fused mxfp4", "torch grouped, mxfp4 dequantized", "torch grouped"} <= paths
    assert not [row for row in rows if "error" in row]
    assert all(row["max_diff_vs_sync_free"] < 1e-4 for row in rows)
    mx = [row for row in rows if "mxfp4" in row["path"]]
    assert mx and all(row["eager_us"] > 0 for row in mx)
    assert "fused mxfp4" in (tmp_path / "fused_moe_gpt-oss-20b.md").read_text()


def test_fused_moe_fp8_runs_in_the_interpreter(tmp_path):
    """benchmarks/fused_moe.py --fp8 on the CPU (a tiny stand-in for Qwen3-30B-A3B's
    experts, the Triton interpreter): the bf16 kernel, the fp8 kernel's default and each of
    its modes (the swapped W8A8 form among them) run; weight-only equals the bf16 kernel on the dequantized weights to fp32's
    order, W8A8 within e4m3's rounding (coarser here: the interpreter's own fp8 casts)."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--fp8",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    rows = json.loads((tmp_path / "fused_moe_fp8.json").read_text())["rows"]
    assert not [row for row in rows if "error" in row]
    names = [row["path"] for row in rows]
    assert len(names) == 11 and names[0].startswith("bf16 fused")
    # the swapped form's modes: on fp16 wgmmas at 16 and 32 rows, on e4m3 ones at 16 and 32
    # rows and with gate_up quantizing the activation
    assert sum(" swap m" in n for n in names) == 2
    assert sum(" swap e4m3 m" in n for n in names) == 3
    assert all(row["eager_us"] > 0 for row in rows)
    for row in rows[1:]:
        assert row["needed_mb"] < rows[0]["needed_mb"]  # a byte a weight against two
        assert row["rel_diff_vs_bf16"] < (0.3 if "w8a8 gu" in row["path"] else 1e-5), row
    assert "fp8 w8a16" in (tmp_path / "fused_moe_fp8.md").read_text()


def test_fp8_block_sweep_runs_in_the_interpreter(tmp_path):
    """benchmarks/fp8_block_gemm.py --sweep on the CPU (tiny shapes, the Triton interpreter):
    every W8A8 candidate tile and the default are timed at each shape and row count beside
    the baselines, each tile's product within fp32 rounding of the emulation, and the JSON
    names the fastest tile of each."""
    import json

    from flashpage.kernels.fp8_block_gemm import W8A8_CANDIDATES

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "sweep.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8_block_gemm.py"), "--sweep",
                        "--shapes", "o_proj,down", "--rows", "8,70", "--json-out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    res = json.loads(out.read_text())
    assert res["sweep"] and res["seconds"] > 0
    names = {c.name for c in W8A8_CANDIDATES}
    for shape in ("o_proj", "down"):
        for m in (8, 70):
            rows = [row for row in res["rows"] if row["shape"] == shape and row["rows"] == m]
            assert {row["config"] for row in rows} - {None} == names
            assert {"quant", "bf16"} <= {row["kernel"] for row in rows}
            assert all(row["rel_err"] < 1e-5 and row["us"] > 0 for row in rows if row["config"])
            best = res["best"][shape][str(m)]
            assert best["config"] in names
            assert best["us"] == min(row["us"] for row in rows if row["config"])


def test_fused_moe_int4_runs_in_the_interpreter(tmp_path):
    """benchmarks/fused_moe.py --int4 on the CPU (a tiny stand-in for Qwen3-30B-A3B's
    experts, groups of 128, the Triton interpreter): the bf16 kernel, the int4 kernel's
    default and its tiles run, each equal to the bf16 kernel on the dequantized weights to
    fp32's order, each reading fewer bytes."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fused_moe.py"), "--int4",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    rows = json.loads((tmp_path / "fused_moe_int4.json").read_text())["rows"]
    assert not [row for row in rows if "error" in row]
    names = [row["path"] for row in rows]
    assert len(names) >= 4 and names[0].startswith("bf16 fused")
    assert names[1].startswith("int4 fused (default")
    assert all(row["eager_us"] > 0 for row in rows)
    for row in rows[1:]:
        assert row["needed_mb"] < rows[0]["needed_mb"] / 3  # half a byte a weight against two
        assert row["rel_diff_vs_bf16"] < 1e-5, row
    assert "MoE experts in int4" in (tmp_path / "fused_moe_int4.md").read_text()
