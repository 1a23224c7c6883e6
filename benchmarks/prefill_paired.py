"""Issue 5's ratio, paged / contiguous Gluon prefill, timed in pairs: the two kernels' CUDA graphs
replayed back to back (A B, then B A: order cancels), hundreds of times, each pair's ratio kept,
and the median and quartiles of those ratios reported. Why: the compute-bound Gluon prefill's
rounds spread by up to 10% in prefill_gluon.py (runs 95-97: one kernel's median moved 250 -> 283
TFLOP/s between rounds), so a ratio of two medians taken minutes apart says little; a pair is
timed within a few milliseconds, under one clock state.

    python benchmarks/prefill_paired.py --out $OUT                       # ~1 min on an H200
    python benchmarks/prefill_paired.py --shapes 8x1024 --pairs 400 --paged tma1:2,tma1:3

``--paged``: the paged forms, PRODUCER:STAGES (paged_prefill_gluon's producer and num_stages;
"engine" = flash_prefill_gluon.engine_options(16), what the engine runs at block 16). Writes
$OUT/prefill_paired.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_timing import capture_graph, time_replay  # noqa: E402
from prefill_gluon import HEADS, PAGE, D, _paged  # noqa: E402


def measure(shape: str, forms: list[str], pairs: int) -> dict:
    """One causal shape: the contiguous kernel's graph against each paged form's, ``pairs`` pairs."""
    from flashpage.kernels.flash_prefill_gluon import (
        engine_options,
        flash_prefill_gluon,
        paged_prefill_gluon,
    )

    b, s = (int(x) for x in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b * s, HEADS, D, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    kc, vc, tables = _paged(k, v, b, s, PAGE)  # prefill_gluon.py's shuffled block-16 cache
    flops = 4 * b * HEADS * D * s * s / 2
    contiguous = flash_prefill_gluon(q, k, v, cu, s, causal=True).float()
    calls = max(1, round(2e-3 / (flops / 500e12)))  # ~2 ms a replay
    g_c = capture_graph(lambda: flash_prefill_gluon(q, k, v, cu, s, causal=True), calls)
    row: dict = dict(shape=shape, causal=True, page=PAGE, calls_per_graph=calls, pairs=pairs)
    for form in forms:
        kw = engine_options(PAGE) if form == "engine" else \
            {"producer": form.split(":")[0], "num_stages": int(form.split(":")[1])}

        def paged(kw=kw):
            return paged_prefill_gluon(q, kc, vc, tables, cu, lens, s, s, causal=True, **kw)

        err = float((paged().float() - contiguous).norm() / contiguous.norm())
        g_p = capture_graph(paged, calls)
        ratios, tc, tp = [], [], []
        for i in range(pairs):
            if i % 2:
                a, c = time_replay(g_p), time_replay(g_c)
            else:
                c, a = time_replay(g_c), time_replay(g_p)
            ratios.append(c / a)  # paged throughput / contiguous throughput
            tc.append(c / calls)
            tp.append(a / calls)
        q1, med, q3 = statistics.quantiles(ratios, n=4)
        row[form] = dict(kwargs=kw, rel_err_vs_contiguous=err, ratio_median=round(med, 4),
                         ratio_q1=round(q1, 4), ratio_q3=round(q3, 4),
                         contiguous_tflops=round(flops / statistics.median(tc) / 1e12, 1),
                         paged_tflops=round(flops / statistics.median(tp) / 1e12, 1))
        print(shape, form, json.dumps(row[form]), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="2x4096,1x16384,8x1024", help="comma-separated BxS, causal")
    ap.add_argument("--paged", default="engine,tma1:2,tma1:3", help="comma-separated PRODUCER:STAGES or engine")
    ap.add_argument("--pairs", type=int, default=200)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        rows.append(measure(shape, args.paged.split(","), args.pairs))
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "prefill_paired.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
