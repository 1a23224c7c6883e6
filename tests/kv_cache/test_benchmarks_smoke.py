"""The memory and scheduler benchmarks run (tiny sizes) and their numbers make sense."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def test_memory_efficiency_orders_the_policies(tmp_path):
    from flashpage.bench import memory as me

    results, sharing, wl, _ = me.run(num_requests=150, pool_slots=16384, max_model_len=2048,
                                     shared_len=256, block_sizes=(16, 128))
    by = {r.policy: r for r in results}
    a = by["(a) reserve max_model_len"]
    b = by["(b) reserve prompt + max_tokens"]
    p16, p128 = by["(c) paged, block 16"], by["(c) paged, block 128"]
    assert a.util_alloc < b.util_alloc < p128.util_alloc < p16.util_alloc <= 1.0
    assert p16.util_alloc >= 0.95
    assert a.running_max == 16384 // 2048  # exactly pool / max_model_len reservations fit
    assert p16.running_mean > b.running_mean
    off, on = sharing
    assert on.logical_per_slot > 1.5 > off.logical_per_slot and on.running_mean > off.running_mean
    out = tmp_path / "m.md"
    assert me.main(["--requests", "60", "--pool-slots", "4096", "--max-model-len", "1024",
                    "--shared-prompt-len", "128", "--window", "0", "--out", str(out)]) == 0
    assert "(c) paged, block 16" in out.read_text()


def test_window_release_fits_more_long_requests():
    from flashpage.bench import memory as me

    (kept, released), wl = me.run_window(num_requests=40, pool_slots=32768, window=512)
    assert released.running_mean > 2 * kept.running_mean
    assert released.steps < kept.steps
    assert "blocks behind the 512-token window released" in me.window_markdown(
        [kept, released], wl, 512)


def test_scheduler_overhead_runs(tmp_path):
    so = _load("scheduler_overhead")
    out = tmp_path / "s.md"
    assert so.main(["--requests", "16", "--steps", "20", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| decode | on |" in text and "| mixed | off |" in text
