"""The int4 GEMV (kernels/int4_gemv.py) at decode sizes on the GPU: its default tile and a
sweep of tiles, beside the tl.dot W4A16 kernel, dequantize + cuBLAS and the bf16 GEMM.

Llama-3-8B shapes, bf16 activations, int4 weights in groups of 128: qkv 4096 -> 6144,
o_proj 4096 -> 4096, gate_up 4096 -> 28672, down 14336 -> 4096; rows 1, 2, 4, 8, 16. Each
timed call streams its weight from HBM: a CUDA graph cycles through enough distinct copies
of the weight to be far past the L2 (50 MB). Per shape and row count:

    gemv            int4_gemv at default_config (what the engine runs: layers/int4.py)
    gemv:<cfg>      each --configs tile (Int4GemvConfig.name: f/d/a = FMAs / tensor cores
                    / tensor cores with the inline-PTX unpacking, n block_n, k block_k,
                    s split_k (0: auto), w warps, st stages, p tiles prefetched in
                    registers; p0: the K loop left to Triton's pipeliner, st - 1 in flight)
    w4a16           int4_gemm.w4a16_matmul at its default tile (FLASHPAGE_INT4_KERNEL=gemm)
    deq+cublas      int4_gemm.dequantize_int4, then F.linear
    bf16            F.linear over a bf16 weight of the same shape (cuBLAS)

At the down projection (rows 1, 8, 16 of those asked), from the MLP's gate/up output
h [M, 28672] (bf16):

    silu+gemv       kernels/silu_mul.silu_and_mul, then int4_gemv at default_config (the
                    unfused path)
    fused           int4_gemv(h, ..., silu_mul=True) at default_config (what the engine
                    runs: layers/int4.fuses_silu_mul)
    fused:<cfg>     the same at the best GEMV tile of that row count (the plain sweep's)

Printed and written (--json-out): us per call, GB/s of the weight bytes each reads (int4:
qweight + fp16 scales + uint8 zeros; bf16: two bytes a value), and at the end the best
GEMV tile per shape and row count (to set default_config from one run), and the best
pipelined (p0) tile beside the best register-prefetch one. Each GEMV tile is
first checked against the dequantizing reference (max |err| printed beside its time; bf16
outputs of up to ~|reference| x 2^-8 apart are rounding, see tests/kernels/test_int4_gemv.py).

    python benchmarks/int4_gemv.py --json-out $OUT/int4_gemv.json
    python benchmarks/int4_gemv.py --shapes down --rows 1,16 --configs fn64k128s0w4st3p0,an64k128s0w4st4p0
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from int4_gemm import SHAPES, weight_copies  # noqa: E402 (the shapes and weights of both)


def _variants(x: torch.Tensor, ws: list, bf16: list, sweep: list) -> dict:
    """label -> a call of every weight copy (the timed unit)."""
    from flashpage.kernels.int4_gemm import dequantize_int4, w4a16_matmul
    from flashpage.kernels.int4_gemv import PAD_ROWS, int4_gemv

    out = {"gemv": lambda: [int4_gemv(x, *w) for w in ws]}
    for c in sweep:
        if x.shape[0] > PAD_ROWS and not c.dot:
            continue  # past 16 rows the tensor cores only
        out[f"gemv:{c.name}"] = lambda c=c: [int4_gemv(x, *w, config=c) for w in ws]
    out["w4a16"] = lambda: [w4a16_matmul(x, *w) for w in ws]
    out["deq+cublas"] = lambda: [F.linear(x, dequantize_int4(*w, x.dtype)) for w in ws]
    out["bf16"] = lambda: [F.linear(x, w) for w in bf16]
    return out


def _time_silu_mul(results: dict, ws: list, copies: int, m: int, k: int, q4_bytes: int,
                   best: str, reps: int) -> None:
    """The down projection from the gate/up output h [m, 2k]: SiLU·mul then the GEMV,
    against the fused GEMV at the default tile and at ``best`` (the plain sweep's best
    label), each checked against the unfused result first (printed and in results)."""
    from gpu_timing import time_graph

    from flashpage.kernels.int4_gemv import int4_gemv, parse_config
    from flashpage.kernels.silu_mul import silu_and_mul

    h = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16) * 2
    cfg = parse_config(best[5:]) if ":" in best else None
    fused_best = f"fused:{cfg.name}" if cfg is not None else "(best is the default)"
    variants = {
        "silu+gemv": lambda: [int4_gemv(silu_and_mul(h), *w) for w in ws],
        "fused": lambda: [int4_gemv(h, *w, silu_mul=True) for w in ws],
    }
    if cfg is not None:  # (the default's is "fused")
        variants[fused_best] = lambda: [int4_gemv(h, *w, config=cfg, silu_mul=True) for w in ws]
    ref = int4_gemv(silu_and_mul(h), *ws[0]).float()
    row = {"rows": m, "best_label": fused_best, "fused_best": float("nan")}
    for label, fn in variants.items():
        try:
            cfg_l = cfg if label == fused_best else None
            got = (int4_gemv(h, *ws[0], config=cfg_l, silu_mul=True).float()
                   if label.startswith("fused") else ref)
            err = (got - ref).abs().max().item()
            t = time_graph(fn, reps=reps) / copies
        except Exception as e:
            print(f"down     m={m:<3d} {label:32s} failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:120]}")
            t, err = float("nan"), float("nan")
        key = "fused_best" if label == fused_best else label
        row[key] = t * 1e6
        print(f"down (silu_mul) m={m:<3d} {label:36s} {t * 1e6:8.1f} us "
              f"{q4_bytes / t / 1e9:7.0f} GB/s  max|err| vs unfused {err:.3g}")
    results["silu_mul"].append(row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--configs", default=None,
                    help="GEMV tiles swept (comma-separated Int4GemvConfig names; default: "
                         "int4_gemv.CANDIDATES)")
    ap.add_argument("--reps", type=int, default=10, help="graph replays timed per variant")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("int4_gemv.py needs a CUDA GPU")
        return 1
    from gpu_timing import time_graph

    from flashpage.kernels.int4_gemm import int4_linear_ref
    from flashpage.kernels.int4_gemv import CANDIDATES, int4_gemv, parse_config

    sweep = ([parse_config(c) for c in filter(None, args.configs.split(","))]
             if args.configs is not None else list(CANDIDATES))
    torch.manual_seed(0)
    dt, g = torch.bfloat16, args.group
    rows = [int(r) for r in args.rows.split(",")]
    results: dict = {"device": torch.cuda.get_device_name(), "group_size": g, "rows": [],
                     "best": [], "silu_mul": []}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws, bf16, q4_bytes = weight_copies(n, k, g, dt)
        copies = len(ws)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            timed = {}
            ref = int4_linear_ref(x, *ws[0]).float()
            for label, fn in _variants(x, ws, bf16, sweep).items():
                calls = len(bf16) if label == "bf16" else copies
                try:
                    err = float("nan")
                    if label.startswith("gemv"):  # each tile checked before it is timed
                        cfg = parse_config(label[5:]) if ":" in label else None
                        got = int4_gemv(x, *ws[0], config=cfg).float()
                        err = (got - ref).abs().max().item()
                    t = time_graph(fn, reps=args.reps) / calls
                except Exception as e:  # a tile that does not build (shared memory): noted
                    print(f"{name:8s} m={m:<3d} {label:32s} failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]}")
                    continue
                nbytes = 2 * n * k if label == "bf16" else q4_bytes
                row = {"shape": name, "n": n, "k": k, "rows": m, "kernel": label,
                       "us": t * 1e6, "weight_gbps": nbytes / t / 1e9,
                       "int4_gbps_equiv": q4_bytes / t / 1e9, "max_err": err,
                       "ref_max": ref.abs().max().item()}
                results["rows"].append(row)
                timed[label] = t
                print(f"{name:8s} {n:6d}x{k:<6d} m={m:<3d} {label:32s} {row['us']:8.1f} us "
                      f"{row['weight_gbps']:7.0f} GB/s"
                      + (f"  max|err| {err:.3g} of {row['ref_max']:.3g}" if err == err else ""))
            gemvs = {lb: t for lb, t in timed.items() if lb.startswith("gemv")}
            if gemvs:
                best = min(gemvs, key=gemvs.__getitem__)
                pipe = {lb: t for lb, t in gemvs.items() if lb.endswith("p0")}
                regs = {lb: t for lb, t in gemvs.items() if not lb.endswith("p0")}
                best_pipe = min(pipe, key=pipe.__getitem__) if pipe else None
                best_regs = min(regs, key=regs.__getitem__) if regs else None
                results["best"].append({
                    "shape": name, "rows": m, "kernel": best, "us": gemvs[best] * 1e6,
                    "int4_gbps": q4_bytes / gemvs[best] / 1e9,
                    "default_us": gemvs.get("gemv", float("nan")) * 1e6,
                    "bf16_us": timed.get("bf16", float("nan")) * 1e6,
                    "best_pipelined": best_pipe,
                    "pipelined_us": pipe[best_pipe] * 1e6 if best_pipe else float("nan"),
                    "best_prefetch": best_regs,
                    "prefetch_us": regs[best_regs] * 1e6 if best_regs else float("nan")})
                if name == "down" and m in (1, 8, 16):
                    _time_silu_mul(results, ws, copies, m, k, q4_bytes, best, args.reps)
        ws.clear()
        bf16.clear()
        torch.cuda.empty_cache()
    print("\nbest GEMV tile per shape and rows (gemv = the default):")
    for b in results["best"]:
        print(f"  {b['shape']:8s} m={b['rows']:<3d} {b['kernel']:32s} {b['us']:8.1f} us "
              f"{b['int4_gbps']:6.0f} GB/s int4   default {b['default_us']:8.1f} us   "
              f"bf16 {b['bf16_us']:8.1f} us")
    print("\nbest pipelined (p0) against best register-prefetch tile per shape and rows:")
    for b in results["best"]:
        print(f"  {b['shape']:8s} m={b['rows']:<3d} pipelined {str(b['best_pipelined']):28s} "
              f"{b['pipelined_us']:8.1f} us   prefetch {str(b['best_prefetch']):28s} "
              f"{b['prefetch_us']:8.1f} us   ratio {b['pipelined_us'] / b['prefetch_us']:.3f}")
    if results["silu_mul"]:
        print("\ndown projection from the gate/up output (us): SiLU·mul then the GEMV, "
              "against the fused GEMV")
        for r in results["silu_mul"]:
            print(f"  m={r['rows']:<3d} silu+gemv {r['silu+gemv']:8.1f}   fused "
                  f"{r['fused']:8.1f}   {r['best_label']:34s} {r['fused_best']:8.1f}")
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
