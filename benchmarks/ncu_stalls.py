"""Where a kernel's warps stall, per SASS instruction, from an Nsight Compute source export.

    ncu --import REP.ncu-rep --page source --csv --print-source sass > K.sass.csv
    python3 benchmarks/ncu_stalls.py K.sass.csv [TOP]

prints the stall reasons summed over the kernel (PC sampling: ``stall_*`` columns) and
the TOP instructions with the most samples, in program order, each with its three main
reasons. ``bash benchmarks/gpu_final.sh ncu`` writes the exports (benchmarks/ncu_cases.py).
"""

from __future__ import annotations

import argparse
import collections
import csv


def load(path: str) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[1]  # rows[0] names the kernel
    return header, [dict(zip(header, r, strict=True)) for r in rows[2:] if len(r) == len(header)]


def summary(path: str, top: int = 40) -> None:
    header, data = load(path)
    cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total: collections.Counter[str] = collections.Counter()
    for d in data:
        for c in cols:
            total[c] += int(d[c] or 0)
    n = sum(total.values()) or 1
    print(f"{path}: {n} samples over {len(data)} instructions")
    for c, v in total.most_common(12):
        print(f"  {c:28s} {v:8d} {100 * v / n:5.1f}%")
    samples = [int(d["Warp Stall Sampling (All Samples)"] or 0) for d in data]
    for i in sorted(sorted(range(len(data)), key=lambda i: -samples[i])[:top]):
        d = data[i]
        why = sorted(((int(d[c] or 0), c[6:]) for c in cols), reverse=True)[:3]
        print(f"{i:5d} {samples[i]:6d} {d['Source'].strip()[:60]:60s} "
              + " ".join(f"{name}:{v}" for v, name in why if v))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Stall reasons per SASS instruction (ncu source export).")
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("top", nargs="?", type=int, default=40, help="instructions to list")
    args = ap.parse_args()
    summary(args.csv, args.top)
