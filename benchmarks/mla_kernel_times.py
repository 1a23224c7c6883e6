"""Where one MLA decode call's time goes between its kernels (the main kernel, the merge kernel)
and the gaps between them, at one shape: CUDA-graph replays under torch.profiler
(gpu_timing.graph_kernel_times) beside time_graph's whole-call median.

    python benchmarks/mla_kernel_times.py --shape 8x32768 --variants wgmma triton
"""

from __future__ import annotations

import argparse
import json
import os

from gpu_timing import graph_kernel_times, time_graph
from mla_decode import RANK, Case
from mla_decode_gluon import VARIANTS, _kw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shape", default="8x32768")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=["wgmma"], choices=list(VARIANTS))
    args = ap.parse_args()
    batch, ctx = (int(x) for x in args.shape.split("x"))
    case = Case(batch, ctx, 16, args.page)
    rows = []
    for name in args.variants:
        fn, kw = VARIANTS[name]
        kw = _kw(kw)

        def call(fn=fn, kw=kw):
            fn(case.q[0], case.pool, case.tables[0], case.lens, kv_lora_rank=RANK, sm_scale=case.scale,
               out=case.out, **kw)

        whole = time_graph(call)
        kernels = graph_kernel_times(call)
        row = dict(variant=name, shape=args.shape, call_us=round(whole * 1e6, 1),
                   kernels_us={k[:60]: round(v * 1e6, 1) for k, v in kernels.items()},
                   gaps_us=round((whole - sum(kernels.values())) * 1e6, 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(os.path.join(args.out, "mla_kernel_times.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
