"""The Gluon fp8 paged decode's launch knobs (kernels/paged_decode_gluon.py ``_launch``) beside
the Triton warp-split loop, at the engine's decode shapes (decode_gluon.py's three, plus 256
ragged contexts 101-2048 longest first). GB/s of fp8 KV bytes (% of the copy rate measured in
the same run), us per call, relative error against the Triton kernel.

    python benchmarks/decode_gluon_knobs.py --set persistent   # default variant: programs per SM 2/3/4, stages 2/3/4
    python benchmarks/decode_gluon_knobs.py --set variants     # the variants default/keys_m, 3-4 per SM
    python benchmarks/decode_gluon_knobs.py --set bf16         # 16-bit cache: the Gluon keys_m kernel
                                                               # (paged_decode_gluon_bf16.py) vs Triton and cuDNN

Each under a minute on an H200; writes $OUT/decode_gluon_knobs_<set>.json.

``--set bf16``: a bf16 cache at issue 6's shapes (32 x 4096, 64 x 4096, 128 x 2048, 128 x 8192, 256 x
1024, then 256 ragged 101-2048 longest first, where cuDNN has no cell): "triton" is paged_decode's
default (FLASHPAGE_DECODE_GLUON_BF16 unset), "cudnn" SDPA cuDNN on the same K/V gathered into a
contiguous [B, Hkv, ctx, D] cache, "P{p} s{s}" the persistent Gluon kernel at p programs an SM
of s stages (32 KB each); each cell also gives its ratio to cuDNN (x) in the same run.
``--ordered``: each sequence's blocks consecutive in the cache (the default shuffles them over it);
``--runs 4``: shuffled in runs of 4 consecutive blocks (the places a block-64 cache's blocks take).
``--kv-heads 1``: the same bytes and items as one KV head (4 query heads) of 8x the batch, so
that each item's page piece is 4 KB contiguous (what an HND page would give every head).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from decode_gluon import FP8, Batch, shapes  # sets FLASHPAGE_DECODE_GLUON=0: "triton" is Triton
from gpu_timing import copy_bandwidth, time_graph

from flashpage.kernels.paged_decode import paged_decode
from flashpage.kernels.paged_decode_gluon import _launch as gl
from flashpage.kernels.paged_decode_gluon_bf16 import _launch as gl16

SETS = {
    "persistent": {**{f"P{p} s3": {"programs_per_sm": p, "stages": 3} for p in (2, 3, 4)},
                   **{f"P3 s{s}": {"programs_per_sm": 3, "stages": s} for s in (2, 4)}},
    "variants": {f"P{p} {v}": {"programs_per_sm": p, "variant": v}
                 for p in (3, 4) for v in ("default", "keys_m")},
}
# The 16-bit kernel's knobs (programs an SM x 32 KB stages that fit in shared memory).
BF16_FORMS = {f"P{p} s{s}": {"programs_per_sm": p, "stages": s} for p, s in ((3, 2), (2, 3), (2, 2), (1, 4), (1, 6))}
# the same with balanced_grid: every program the same number of items (session 11, not yet timed)
BF16_FORMS.update({f"P{p} s{s} bal": {"programs_per_sm": p, "stages": s, "balance": True} for p, s in ((3, 2), (2, 2))})
# the engine form with each program's first length and block ids in one round trip (session 37)
BF16_FORMS["P2 s2 bal first"] = {"programs_per_sm": 2, "stages": 2, "balance": True, "first_together": True}
SETS["bf16"] = BF16_FORMS


def bf16_shapes() -> list[tuple[str, list[int]]]:
    gen = torch.Generator().manual_seed(2)
    ragged256 = sorted(torch.randint(101, 2049, (256,), generator=gen).tolist(), reverse=True)
    return [(f"{b} x {c}", [c] * b) for b, c in ((32, 4096), (64, 4096), (128, 2048), (128, 8192), (256, 1024))] + [
        ("256 x ragged 101-2048, longest first", ragged256)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=list(SETS), default="persistent")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every variant of a shape this many times in turn, the median kept (the "
                         "forms differ by about the runs' spread: session 12)")
    ap.add_argument("--variants", nargs="*", default=None,
                    help="only these columns (triton and cudnn are always timed)")
    ap.add_argument("--ordered", action="store_true",
                    help="each sequence's blocks consecutive in the cache (not shuffled): what the page "
                         "scatter costs, against cuDNN's contiguous K/V")
    ap.add_argument("--runs", type=int, default=1,
                    help="blocks shuffled in runs of this many consecutive ones (4: a block-64 cache's places)")
    ap.add_argument("--kv-heads", type=int, default=8,
                    help="KV heads (query heads 4x); the batch scaled by 8 / this, so that a shape's items "
                         "and bytes stay those it names: at 1 a page piece of one head is 4 KB contiguous, "
                         "at 8 its 16 rows of 256 bytes lie 2 KB apart")
    args = ap.parse_args()
    t0 = time.time()
    bf16 = args.set == "bf16"
    gluon = gl16 if bf16 else gl
    variants = {"triton": (paged_decode, {}), **({"cudnn": (None, {})} if bf16 else {}),
                **{k: (gluon, kw) for k, kw in SETS[args.set].items()
                   if args.variants is None or k in args.variants}}
    gen = torch.Generator().manual_seed(2)
    ragged256 = sorted(torch.randint(101, 2049, (256,), generator=gen).tolist(), reverse=True)
    copy = copy_bandwidth()
    rows = []
    runs = 0 if args.ordered else args.runs
    tag = ("_ordered" if runs == 0 else f"_runs{runs}" if runs > 1 else "") + (
        f"_hkv{args.kv_heads}" if args.kv_heads != 8 else "")
    path = os.path.join(args.out, f"decode_gluon_knobs_{args.set}{tag}.json")
    all_shapes = bf16_shapes() if bf16 else shapes() + [("256 x ragged 101-2048, longest first", ragged256)]
    for name, lens in all_shapes:
        b = Batch(lens * (8 // args.kv_heads), torch.bfloat16 if bf16 else FP8, runs=runs,
                  hq=4 * args.kv_heads, hkv=args.kv_heads)
        ref = None
        row = {"shape": name}
        gbps = {}
        calls, times, errs = {}, {}, {}
        for k, (fn, kw) in variants.items():
            try:
                call = b.sdpa_cudnn() if fn is None else b.fn(fn, **kw)
                b.i = b.copies - 1  # the check call on copy 0, as every kernel's
                call()
                got = b.sdpa_out.squeeze(2) if fn is None else b.out
                if ref is None:
                    ref = got.clone()
                errs[k] = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                calls[k] = call
            except Exception as ex:  # one failing variant must not hide the rest
                row[k] = f"n/a {type(ex).__name__}: {str(ex)[:200]}"
        for _ in range(args.rounds):  # the variants in turn each round: drift hits them alike
            for k, call in calls.items():
                times.setdefault(k, []).append(time_graph(call, b.calls()))
        for k, ts in times.items():
            t = statistics.median(ts)
            g = gbps[k] = b.kv_bytes / t / 1e9
            row[k] = f"{g:.0f} ({100 * g / copy:.0f}%) {t * 1e6:.1f}us e{errs[k]:.0e}"
        if args.rounds > 1:
            row["rounds_us"] = {k: [round(t * 1e6, 1) for t in ts] for k, ts in times.items()}
        if "cudnn" in gbps:  # each cell's ratio to cuDNN, same run
            for k, g in gbps.items():
                row[k] += f" x{g / gbps['cudnn']:.3f}"
        print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
        rows.append(row)
        with open(path, "w") as f:  # after every shape: a timeout keeps what was measured
            json.dump(dict(copy_gbps=round(copy), rows=rows), f, indent=1)
        del b
        torch.cuda.empty_cache()
    print(f"copy {copy:.0f} GB/s, {torch.cuda.get_device_name()}, {time.time() - t0:.0f} s")
    print(f"GB/s of {'bf16' if bf16 else 'fp8'} KV bytes (% of copy), us per call, rel. error vs triton"
          + (", x: / cuDNN" if bf16 else ""))
    print("| shape | " + " | ".join(variants) + " |")
    print("| --- |" + " --- |" * len(variants))
    for r in rows:
        print(f"| {r['shape']} | " + " | ".join(r[k] for k in variants) + " |")


if __name__ == "__main__":
    main()
