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
