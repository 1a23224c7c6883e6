"""The Gluon fp8 paged decode's launch knobs (kernels/paged_decode_gluon.py ``_launch``) beside
the Triton warp-split loop, at the engine's decode shapes (decode_gluon.py's three, plus 256
ragged contexts 101-2048 longest first). GB/s of fp8 KV bytes (% of the copy rate measured in
the same run), us per call, relative error against the Triton kernel.

    python benchmarks/decode_gluon_knobs.py --set persistent   # programs per SM 2/3/4, stages 2/3/4
    python benchmarks/decode_gluon_knobs.py --set stages       # stages; warp-specialized; lazy rescale
    python benchmarks/decode_gluon_knobs.py --set variants     # persistent variants dims_m/keys_m/keys_m2, 3-4 per SM

Each under a minute on an H200; writes $OUT/decode_gluon_knobs_<set>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from decode_gluon import Batch, shapes  # sets FLASHPAGE_DECODE_GLUON=0: "triton" is Triton
from gpu_timing import copy_bandwidth, time_graph

from flashpage.kernels.paged_decode import paged_decode
from flashpage.kernels.paged_decode_gluon import _launch as gl

SETS = {
    "persistent": {"g s3": {"stages": 3},
                   **{f"P{p} s3": {"persistent": True, "programs_per_sm": p, "stages": 3} for p in (2, 3, 4)},
                   **{f"P3 s{s}": {"persistent": True, "programs_per_sm": 3, "stages": s} for s in (2, 4)}},
    "variants": {f"P{p} {v}": {"persistent": True, "programs_per_sm": p, "variant": v}
                 for p in (3, 4) for v in ("default", "dims_m", "keys_m", "keys_m2")},
    "stages": {**{f"g s{s}": {"stages": s} for s in (2, 3, 4)},
               **{f"ws{'L' if lazy else ''} s{s}": {"warp_specialize": True, "stages": s, "lazy": lazy}
                  for s in (3, 4, 6) for lazy in (False, True)}},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=list(SETS), default="persistent")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.time()
    variants = {"triton": (paged_decode, {}), **{k: (gl, kw) for k, kw in SETS[args.set].items()}}
    gen = torch.Generator().manual_seed(2)
    ragged256 = sorted(torch.randint(101, 2049, (256,), generator=gen).tolist(), reverse=True)
    copy = copy_bandwidth()
    rows = []
    for name, lens in shapes() + [("256 x ragged 101-2048, longest first", ragged256)]:
        b = Batch(lens)
        ref = None
        row = {"shape": name}
        for k, (fn, kw) in variants.items():
            try:
                b.fn(fn, **kw)()
                if ref is None:
                    ref = b.out.clone()
                err = ((b.out.float() - ref.float()).norm() / ref.float().norm()).item()
                t = time_graph(b.fn(fn, **kw), b.calls())
                g = b.kv_bytes / t / 1e9
                row[k] = f"{g:.0f} ({100 * g / copy:.0f}%) {t * 1e6:.1f}us e{err:.0e}"
            except Exception as ex:  # one failing variant must not hide the rest
                row[k] = f"n/a {type(ex).__name__}: {str(ex)[:200]}"
        print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
        rows.append(row)
        del b
        torch.cuda.empty_cache()
    print(f"copy {copy:.0f} GB/s, {torch.cuda.get_device_name()}, {time.time() - t0:.0f} s")
    print("GB/s of fp8 KV bytes (% of copy), us per call, rel. error vs triton")
    print("| shape | " + " | ".join(variants) + " |")
    print("| --- |" + " --- |" * len(variants))
    for r in rows:
        print(f"| {r['shape']} | " + " | ".join(r[k] for k in variants) + " |")
    with open(os.path.join(args.out, f"decode_gluon_knobs_{args.set}.json"), "w") as f:
        json.dump(dict(copy_gbps=round(copy), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
