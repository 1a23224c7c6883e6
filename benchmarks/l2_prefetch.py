"""Does a bulk L2 prefetch (kernels/l2_prefetch.py) make a one-row GEMM read from L2?

The decode-step pattern of engine/weight_prefetch.py, isolated: a one-row GEMM over a
projection's weight (cold: 8 weights rotated, 8x the L2) follows a window of other work
(a spin kernel standing in for rotary + attention). Timed as CUDA-graph replays, per
weight shape, four ways:

    gemm            the GEMM alone, cold
    window + gemm   the window, then the GEMM: what the step does today
    window || prefetch, gemm
                    the prefetch on a side stream during the window, then the GEMM
    prefetch, gemm  prefetch then GEMM on one stream, no window (prefetch cost exposed)

Run: python3 benchmarks/l2_prefetch.py --out $OUT/l2_prefetch.md
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--window-us", type=float, nargs="+", default=[5.0, 10.0, 20.0],
                   help="length of the stand-in window before the GEMM")
    p.add_argument("--grids", nargs="+", default=None, metavar="KB:LANES",
                   help="time these prefetch launch shapes (chunk KB per instruction : "
                        "instructions per program) on o_proj only, one 10 µs window")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    from gpu_timing import time_graph

    from flashpage.kernels.l2_prefetch import can_prefetch, prefetch_l2

    dev = torch.device("cuda")
    if not can_prefetch(dev):
        sys.exit("bulk L2 prefetch needs compute capability 9.0 or newer")
    # spin kernel calibration: cycles per microsecond
    cyc_per_us = 200_000 / (time_graph(lambda: torch.cuda._sleep(200_000)) * 1e6)
    side = torch.cuda.Stream()
    shapes = {"o_proj 4096x4096": (4096, 4096), "qkv 6144x4096": (6144, 4096),
              "down 4096x14336": (4096, 14336)}
    lines = [f"# L2 prefetch before a one-row GEMM ({torch.cuda.get_device_name(dev)}, bf16)", "",
             "µs per GEMM (+ window), CUDA-graph replays over 8 weights rotated (cold in L2).", "",
             "| weight | MB | window µs | gemm | window + gemm | window ‖ prefetch, gemm | saved | "
             "prefetch, gemm |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    if args.grids:
        shapes = {"o_proj 4096x4096": shapes["o_proj 4096x4096"]}
        lines[-2] = lines[-2].replace("| weight |", "| weight, prefetch KB:lanes |")
        for grid in args.grids:
            kb, _, lanes = grid.partition(":")
            pf = partial(prefetch_l2, chunk=int(kb) * 1024, lanes=int(lanes))
            n, k = shapes["o_proj 4096x4096"]
            lines += _rows(f"o_proj {grid}", n, k, [10.0], cyc_per_us, side, time_graph, pf)
    else:
        for name, (n, k) in shapes.items():
            lines += _rows(name, n, k, args.window_us, cyc_per_us, side, time_graph, prefetch_l2)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def _rows(name, n, k, windows, cyc_per_us, side, time_graph, prefetch_l2) -> list[str]:
    dev = torch.device("cuda")
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(8)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    mb = n * k * 2 / 2**20

    def gemm_only() -> None:
        for w in ws:
            F.linear(x, w)

    def prefetch_then_gemm() -> None:
        for w in ws:
            prefetch_l2(w)
            F.linear(x, w)

    def window_gemm(cycles: int) -> None:
        for w in ws:
            torch.cuda._sleep(cycles)
            F.linear(x, w)

    def window_prefetch_gemm(cycles: int) -> None:
        for w in ws:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch_l2(w)
            torch.cuda._sleep(cycles)
            F.linear(x, w)
        torch.cuda.current_stream().wait_stream(side)

    t_gemm = time_graph(gemm_only) / 8 * 1e6
    t_pg = time_graph(prefetch_then_gemm) / 8 * 1e6
    out = []
    for win in windows:
        cycles = int(win * cyc_per_us)
        t_wg = time_graph(lambda c=cycles: window_gemm(c)) / 8 * 1e6
        t_wpg = time_graph(lambda c=cycles: window_prefetch_gemm(c)) / 8 * 1e6
        out.append(f"| {name} | {mb:.1f} | {win:g} | {t_gemm:.1f} | {t_wg:.1f} | {t_wpg:.1f} | "
                   f"{t_wg - t_wpg:.1f} | {t_pg:.1f} |")
        print(out[-1], flush=True)
    return out


if __name__ == "__main__":
    main()
