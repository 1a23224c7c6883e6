"""The persistent Gluon MLA decode (kernels/mla_decode_gluon.py) beside the Triton default
(kernels/mla_decode.py, its merge kernel included: what the engine calls), at 16 heads, bf16
latents, page 64 (``--page``), on the issue-4 shapes. GB/s of latent bytes read (% of the
copy rate measured in the same run), us per call, relative error against an fp32 reference
on the first rotation (``e``), and against the Triton output (``t``). Each figure is the
median of CUDA-graph replays over calls that rotate over >= 1 GiB of independent latents
(benchmarks/mla_decode.py's ``Case``; ``--rot-mb``), so small shapes are not timed out of L2
and a replay's launch gap is amortized (``--rot-mb 256``: the form before session 13, where a
302 MB shape was one call a graph and its ~5 us launch gap counted in it). One failing
variant prints its error in its cell and the others go on.

    python benchmarks/mla_decode_gluon.py --out $OUT          # ~3 min on an H200 (6 variants)
    python benchmarks/mla_decode_gluon.py --variants gluon gluon_s4 --shapes 8x32768
    python benchmarks/mla_decode_gluon.py --variants triton gluon_all --shapes 8x32768 --splits 0 8 16 33 66

``--splits``: each Gluon variant once per key-split count (0: the launcher's pick_splits; a
column ``NAME@S`` per count), to find where 8-16 sequences of 16-32k keys should split.

Variants: ``triton``, ``gluon`` (the Gluon default), ``gluon_fused`` (every split count merged
in the kernel), ``gluon_peel`` (peel: an item's last tile out of the loop), ``gluon_peel_fused``,
``gluon_peel_f1`` (peel, the merge kernel from 2 splits) and ``gluon_all`` (peel, lean, lazy) by
default; ``gluon_lean`` / ``gluon_lazy``, ``gluon_peel_f8``, ``gluon_s4`` (4 ring slots),
``gluon_p1sm`` (one program an SM), ``gluon_fb`` (fewer_barriers: 4 CTA barriers a tile, not
8), ``gluon_all_fb`` (peel, lean, lazy and fewer_barriers) and ``gluon_all_pdl`` (peel, lean,
lazy, the merge kernel launched with PDL) on request.

Writes $OUT/mla_decode_gluon.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mla_decode as mla_bench
import torch
from gpu_timing import copy_bandwidth
from mla_decode import RANK, Case, time_graph

from flashpage.kernels.mla_decode import mla_decode
from flashpage.kernels.mla_decode_gluon import _launch as gluon_launch
from flashpage.kernels.mla_decode_wgmma import mla_decode_wgmma

SHAPES = [(8, 32768), (16, 16384), (32, 4096), (64, 8192), (128, 4096), (8, 4096)]
# name -> (entry, keyword arguments); "triton" is the default path the engine runs today.
VARIANTS = {
    "triton": (mla_decode, {}),
    "gluon": (gluon_launch, {}),
    # the tile-loop knobs (kernels/mla_decode_gluon.py's module doc), alone and together
    "gluon_peel": (gluon_launch, {"peel": True}),
    "gluon_lean": (gluon_launch, {"lean": True}),
    "gluon_lazy": (gluon_launch, {"lazy": True}),
    "gluon_all": (gluon_launch, {"peel": True, "lean": True, "lazy": True}),
    # fewer CTA barriers a tile (8 -> 4 BAR.SYNC), alone and with the three
    "gluon_fb": (gluon_launch, {"fewer_barriers": True}),
    "gluon_all_fb": (gluon_launch, {"peel": True, "lean": True, "lazy": True, "fewer_barriers": True}),
    # the merge kernel (past FUSE_MAX_SPLITS splits) launched with PDL, under this kernel's tail
    "gluon_all_pdl": (gluon_launch, {"peel": True, "lean": True, "lazy": True, "pdl_merge": True}),
    # warpgroup MMAs with the keys as M: a producer warpgroup and two consumers, one program an
    # SM (kernels/mla_decode_wgmma.py; "wgmma_ws2" is its name in session 13's runs, where the
    # forms it replaced were "wgmma" (one warpgroup) and "wgmma_ws" (one consumer): commit 0d3b918)
    "wgmma": (mla_decode_wgmma, {}),
    "wgmma_ws2": (mla_decode_wgmma, {}),
    "wgmma_ws2_18": (mla_decode_wgmma, {"slots": 18}),  # a ring of 18 slabs (2 whole tiles), not 23
    # shorter or longer key splits (the default keeps >= 64 keys a split; 512 until run 108)
    "wgmma_ws2_m512": (mla_decode_wgmma, {"min_split_keys": 512}),
    "wgmma_ws2_m256": (mla_decode_wgmma, {"min_split_keys": 256}),
    "gluon_s4": (gluon_launch, {"stages": 4}),
    # every split count merged inside the kernel (the default merges > FUSE_MAX_SPLITS with
    # mla_decode's merge kernel; run 85 measured this form as "gluon")
    "gluon_fused": (gluon_launch, {"fuse_max_splits": 1 << 20}),
    "gluon_peel_fused": (gluon_launch, {"peel": True, "fuse_max_splits": 1 << 20}),
    "gluon_peel_f8": (gluon_launch, {"peel": True, "fuse_max_splits": 8}),
    "gluon_peel_f1": (gluon_launch, {"peel": True, "fuse_max_splits": 1}),
    "gluon_p1sm": (gluon_launch, {"programs": -1}),  # one program an SM (-1: resolved below)
}
DEFAULT_VARIANTS = ["triton", "gluon", "gluon_fused", "gluon_peel", "gluon_peel_fused", "gluon_peel_f1",
                    "gluon_all"]


def _kw(kw: dict) -> dict:
    if kw.get("programs") == -1:
        return {**kw, "programs": torch.cuda.get_device_properties(0).multi_processor_count}
    return kw


def _columns(variants: list[str], splits: list[int] | None) -> list[tuple[str, str, dict]]:
    """(column, variant, keyword arguments): every variant once, or with ``splits`` each Gluon
    variant once per split count (``NAME@S``; 0 keeps the launcher's pick)."""
    cols = []
    for name in variants:
        fn, kw = VARIANTS[name]
        if splits is None or fn is not gluon_launch:
            cols.append((name, name, kw))
        else:
            cols += [(f"{name}@{s}", name, {**kw, "num_splits": s} if s else kw) for s in splits]
    return cols


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--shapes", nargs="+", default=[f"{b}x{c}" for b, c in SHAPES])
    ap.add_argument("--splits", nargs="+", type=int, default=None,
                    help="key-split counts for the Gluon variants (0: the launcher's choice)")
    ap.add_argument("--rot-mb", type=int, default=mla_bench.ROT_BYTES >> 20,
                    help="each CUDA graph's calls read >= this many MiB of independent latents")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the columns of a shape this many times in turn, the median kept")
    args = ap.parse_args()
    mla_bench.ROT_BYTES = args.rot_mb << 20
    columns = _columns(args.variants, args.splits)
    t0 = time.time()
    copy = copy_bandwidth()
    rows = []
    for shape in args.shapes:
        batch, ctx = (int(x) for x in shape.split("x"))
        case = Case(batch, ctx, args.heads, args.page)
        lat0 = case.contiguous(0)
        s = torch.bmm(case.q[0].float(), lat0.float().transpose(1, 2)) * case.scale
        ref = torch.bmm(torch.softmax(s, -1), lat0[..., :RANK].float())
        del s, lat0
        row: dict = {"shape": shape}
        tri = None
        timed = {}  # name -> (the rotating call, error vs reference, vs triton)
        for name, variant, kw in columns:
            fn = VARIANTS[variant][0]
            kw = _kw(kw)
            try:
                def call(i, fn=fn, kw=kw, case=case):
                    fn(case.q[i], case.pool, case.tables[i], case.lens, kv_lora_rank=RANK, sm_scale=case.scale,
                       out=case.out, **kw)

                case.out.fill_(float("nan"))
                call(0)
                torch.cuda.synchronize()
                got = case.out.float().clone()
                err = float((got - ref).norm() / ref.norm())
                if tri is None:
                    tri = got
                terr = float((got - tri).norm() / tri.norm())

                def rot(call=call, n=case.rot):
                    for i in range(n):
                        call(i)

                timed[name] = (rot, err, terr)
            except Exception as ex:  # one failing variant must not hide the rest
                row[name] = f"n/a {type(ex).__name__}: {str(ex)[:200]}"
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # the columns in turn each round: drift hits them alike
            for name, (rot, _, _) in timed.items():
                try:
                    times.setdefault(name, []).append(time_graph(rot) / case.rot)
                except Exception as ex:
                    row[name] = f"n/a {type(ex).__name__}: {str(ex)[:200]}"
        for name, ts in times.items():
            if name in row:
                continue
            t = statistics.median(ts)
            g = case.bytes / t / 1e9
            err, terr = timed[name][1], timed[name][2]
            row[name] = f"{g:.0f} ({100 * g / copy:.0f}%) {t * 1e6:.1f}us e{err:.0e} t{terr:.0e}"
        if args.rounds > 1:
            row["rounds_us"] = {k: [round(t * 1e6, 1) for t in ts] for k, ts in times.items()}
        print(json.dumps(row), f"{time.time() - t0:.0f}s", flush=True)
        rows.append(row)
        del case, ref
        torch.cuda.empty_cache()
    print(f"copy {copy:.0f} GB/s, {torch.cuda.get_device_name()}, page {args.page}, {args.heads} heads, graphs >= {args.rot_mb} MiB, "
          f"{time.time() - t0:.0f} s")
    print("GB/s of latent bytes (% of copy), us per call, rel. error vs fp32 reference (e) and vs triton (t)")
    names = [c[0] for c in columns]
    print("| batch x context | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for r in rows:
        print(f"| {r['shape']} | " + " | ".join(r.get(k, "") for k in names) + " |")
    with open(os.path.join(args.out, "mla_decode_gluon.json"), "w") as f:
        json.dump(dict(copy_gbps=round(copy), page=args.page, heads=args.heads, rot_mb=args.rot_mb, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
