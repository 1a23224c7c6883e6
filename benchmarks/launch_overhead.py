"""Host time per call of the prefill entry points (GPU): what a prompt step pays on the CPU for
each layer's attention call, beside the GPU time of the same call.

A call's host time is the wall time of N back-to-back calls divided by N, with the inputs so
small that the GPU finishes each before the next is issued (the CPU is what is timed);
its GPU time is the median of CUDA-event pairs around single calls at the timed shape. Paths:
``engine`` (flash_prefill.paged_prefill as the engine calls it: the Gluon paged kernel on
Hopper), ``gluon_paged`` (paged_prefill_gluon called directly with the engine's options),
``gluon`` (flash_prefill_gluon, contiguous), ``triton_paged`` (paged_prefill with
FLASHPAGE_PREFILL_GLUON=0's route: the Triton kernel), and an empty ``torch.empty`` + add
for scale; host times with FLASHPAGE_FAST_LAUNCH=0 (Triton's JIT dispatch on every call,
``host_us_jit``) and =1 (kernels/fast_launch.py, ``host_us``). ``--profile``: cProfile's top
functions of the engine path over N calls.

    python benchmarks/launch_overhead.py --out $OUT [--profile]

Writes $OUT/launch_overhead.json (and launch_overhead_profile.txt).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_timing import event_us  # noqa: E402

from flashpage.kernels.flash_prefill import default_config, paged_prefill  # noqa: E402

HEADS, HKV, D, PAGE = 32, 8, 128, 16


def inputs(batch: int, seq: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch * seq, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=g)
    nb = -(-seq // PAGE)
    kc = torch.randn(batch * nb, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * nb, device="cuda").view(batch, nb).to(torch.int32)
    cu = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    k = torch.randn(batch * seq, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, kc, vc, tables, cu, lens, k, torch.randn_like(k)


def paths(batch: int, seq: int) -> dict:
    from flashpage.kernels.flash_prefill_gluon import (
        engine_options,
        flash_prefill_gluon,
        paged_prefill_gluon,
    )

    q, kc, vc, tables, cu, lens, k, v = inputs(batch, seq)
    opts = engine_options(PAGE)
    cfg = default_config(q.device, D, q.dtype, True)
    a = torch.randn(1024, device="cuda")
    return {
        "engine": lambda: paged_prefill(q, kc, vc, tables, cu, lens, seq, seq, causal=True),
        "gluon_paged": lambda: paged_prefill_gluon(q, kc, vc, tables, cu, lens, seq, seq, causal=True, **opts),
        "gluon": lambda: flash_prefill_gluon(q, k, v, cu, seq, causal=True),
        "triton_paged": lambda: paged_prefill(q, kc, vc, tables, cu, lens, seq, seq, causal=True, _config=cfg),
        "torch_add": lambda: torch.add(a, 1.0),
    }


def host_us(fn, n: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    small = paths(1, 128)  # GPU work of a few us: the host is what is timed
    rows = {}
    for fast in ("0", "1"):  # Triton's JIT dispatch every call, then kernels/fast_launch.py's path
        os.environ["FLASHPAGE_FAST_LAUNCH"] = fast
        for name, fn in small.items():
            rows.setdefault(name, {})["host_us" if fast == "1" else "host_us_jit"] = round(host_us(fn, args.calls), 1)
    for shape in ((1, 2048), (8, 1024)):  # a prompt chunk's attention, for scale
        for name, fn in paths(*shape).items():
            rows[name][f"gpu_us_{shape[0]}x{shape[1]}"] = round(event_us(fn), 1)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    print(json.dumps(res, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "launch_overhead.json").write_text(json.dumps(res, indent=1))
    if args.profile:
        fn = small["engine"]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        s2 = io.StringIO()
        pstats.Stats(prof, stream=s2).sort_stats("cumulative").print_stats(40)
        text = s.getvalue() + "\n\n" + s2.getvalue()
        Path(args.out, "launch_overhead_profile.txt").write_text(text)
        print(text[:6000])


if __name__ == "__main__":
    main()
