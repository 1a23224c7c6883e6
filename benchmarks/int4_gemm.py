"""W4A16 linears on the GPU (kernels/int4_gemm.py): our Triton kernel against torch's
dequantize-then-matmul and the bf16 GEMM of the same shape.

Llama-3-8B shapes, bf16 activations, int4 weights in groups of 128 (AWQ / GPTQ's usual):
qkv 4096 -> 6144, o_proj 4096 -> 4096, gate_up 4096 -> 28672, down 14336 -> 4096. Each
timed call streams its weight from HBM: a CUDA graph cycles through enough distinct copies
of the weight to be far past the L2 (50 MB). For every shape and row count (default 1, 2,
4, 8, 16, 64, 256, 1024):

    ours            w4a16_matmul, its default tile for the rows (split K at 1-16 rows)
    ours:<cfg>      each --configs tile (names as Int4Config.name prints them)
    layer           int4_linear: what the engine runs (kernels/int4_gemv.py up to
                    layers/int4.GEMV_ROWS rows, the swapped GEMM w4a16_gemm up to
                    GEMM_MAX_ROWS, dequantize kernel + cuBLAS above; the decode sizes'
                    comparison is benchmarks/int4_gemv.py)
    deq+cublas      our dequantizing kernel, then F.linear
    torch deq+mm    the pure-torch reference: unpack, dequantize, F.linear
    bf16            F.linear over a bf16 weight of the same shape (the 16-bit baseline)

Printed and written (--json-out): us per call, GB/s of the weight bytes each reads (int4:
half a byte a value plus the groups' fp16 scales and uint8 zeros; bf16: two bytes), and
the TFLOP/s of the product. First, ours is checked against the reference at 1 and 64 rows.

    python benchmarks/int4_gemm.py --json-out $OUT/int4_gemm.json
    python benchmarks/int4_gemm.py --shapes down --rows 1,4,16 --configs m16n32k256s0w4st4

--sweep: the swapped GEMM (``w4a16_gemm``, the path past the GEMV's 64 rows) at rows 64,
128, 256, 512, 1024, 2048 (or --rows): its default tile and every GEMM_CANDIDATES tile (or
--gemm-configs), beside "deq+cublas" and "bf16", each timed as the full mode times (a CUDA
graph cycling through weight copies past L2, time_graph; --reps replays); prints each (shape, rows)'s best tile and its time against bf16 and writes all
of it (--json-out). Checks each tile against the reference first (bf16 on the GPU, judged
as tests/kernels judge it). ~60-100 s on an H200. Tile names starting with f are the
fragment tiles (kernels/int4_fragment.py: decoded in wgmma's A fragment), fw / fp per weight
/ on the sums as w / p; "x copy" is fragment_x's time (inside theirs); --dtype fp16 times
fp16 activations ("bf16" is then fp16 cuBLAS):

    python benchmarks/int4_gemm.py --sweep --json-out $OUT/int4_gemm_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # name -> (N out, K in)
L2_PAST = 256 << 20  # bytes of distinct weights a graph cycles through


def parse_config(name: str):
    from flashpage.kernels.int4_gemm import Int4Config

    m = re.fullmatch(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)", name.strip())
    if m is None:
        raise SystemExit(f"--configs: {name!r} is not a name such as m16n64k128s0w4st4")
    return Int4Config(*map(int, m.groups()))


def weight_copies(n: int, k: int, g: int, dt: torch.dtype) -> tuple[list, list, int]:
    """Random int4 weights [n, k] in groups of g (packed words, fp16 scales, uint8 zeros)
    and bf16 ones of the same shape, each in enough copies that a graph cycling through them
    reads past L2; and one int4 copy's bytes."""
    from flashpage.kernels.int4_gemm import pack_int4

    q4_bytes = n * k // 2 + 3 * n * (k // g)
    ws = []
    for _ in range(max(2, -(-L2_PAST // q4_bytes))):
        q = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
        scales = (torch.rand(n, k // g, device="cuda") * 0.01 + 1e-3).half()
        zeros = torch.randint(1, 16, (n, k // g), device="cuda").to(torch.uint8)
        ws.append((pack_int4(q), scales, zeros))
        del q
    bf16 = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
            for _ in range(max(2, -(-L2_PAST // (2 * n * k))))]
    return ws, bf16, q4_bytes


def _variants(x: torch.Tensor, ws: list, bf16: list, extra: list, dt: torch.dtype) -> dict:
    """label -> a call of every weight copy (the timed unit)."""
    from flashpage.kernels.int4_gemm import dequantize_int4, dequantize_int4_ref, w4a16_matmul
    from flashpage.layers.int4 import int4_linear

    out = {"ours": lambda: [w4a16_matmul(x, *w) for w in ws]}
    for c in extra:
        out[f"ours:{c.name}"] = lambda c=c: [w4a16_matmul(x, *w, config=c) for w in ws]
    out["layer"] = lambda: [int4_linear(x, *w) for w in ws]
    out["deq+cublas"] = lambda: [F.linear(x, dequantize_int4(*w, dt)) for w in ws]
    out["torch deq+mm"] = lambda: [F.linear(x, dequantize_int4_ref(*w, dt)) for w in ws]
    out["bf16"] = lambda: [F.linear(x, w) for w in bf16]
    return out


def _judge(x, w):
    """A check of outputs for x through the int4 weight w: None if within 1.5x the bf16
    reference's own error from the fp32 linear (tests/kernels/test_int4_gemm.py's rule),
    else what is wrong."""
    from flashpage.kernels.int4_gemm import dequantize_int4_ref, int4_linear_ref

    want = x.float() @ dequantize_int4_ref(*w, torch.float32).t()
    theirs = (int4_linear_ref(x, *w).float() - want).abs().max().item()

    def check(got) -> str | None:
        ours = (got.float() - want).abs().max().item()
        return None if ours <= 1.5 * theirs + 1e-3 else \
            f"max error {ours:.3g} (reference {theirs:.3g})"

    return check


def _sweep_variants(x: torch.Tensor, ws: list, bf16: list, tiles: dict,
                    dt: torch.dtype) -> dict:
    """--sweep's label -> a call of every weight copy (the timed unit)."""
    from flashpage.kernels.int4_fragment import fragment_x
    from flashpage.kernels.int4_gemm import dequantize_int4, w4a16_gemm

    out = {f"gemm:{label}": (lambda c=c: [w4a16_gemm(x, *w, config=c) for w in ws])
           for label, c in tiles.items()}
    if any(c.fragment for c in tiles.values()) and x.shape[1] % 128 == 0:
        # the copy of x the fragment tiles make a call (inside their times): its share
        out["fragment_x"] = lambda: [fragment_x(x) for _ in ws]
    out["deq+cublas"] = lambda: [F.linear(x, dequantize_int4(*w, dt)) for w in ws]
    out["bf16"] = lambda: [F.linear(x, w) for w in bf16]
    return out


def sweep(args) -> int:
    """--sweep: the swapped GEMM's tiles against dequantize + cuBLAS and bf16 (see the
    module's docstring)."""
    from gpu_timing import time_graph

    from flashpage.kernels.int4_gemm import (
        GEMM_CANDIDATES,
        gemm_config,
        gemm_supports,
        parse_gemm_config,
        w4a16_gemm,
    )

    cands = ([parse_gemm_config(c) for c in filter(None, args.gemm_configs.split(","))]
             if args.gemm_configs else list(GEMM_CANDIDATES))
    torch.manual_seed(0)
    dt, g = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype], args.group
    results: dict = {"device": torch.cuda.get_device_name(), "group_size": g, "mode": "sweep",
                     "dtype": args.dtype,
                     "rows": [], "best": []}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        if not gemm_supports(k, g):
            print(f"{name}: K={k}, G={g} not taken by w4a16_gemm")
            continue
        ws, bf16, q4_bytes = weight_copies(n, k, g, dt)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            default = gemm_config(m, n, k, g, dt)
            tiles = {c.name: c for c in cands}
            if default.name not in tiles:  # else its time is its name's
                tiles["default"] = default
            variants = _sweep_variants(x, ws, bf16, tiles, dt)
            times = {}
            check = _judge(x, ws[0])
            for label, fn in variants.items():
                try:  # a tile that fails to build (e.g. shared memory) is noted, not fatal
                    bad = None
                    if label.startswith("gemm:"):
                        bad = check(w4a16_gemm(x, *ws[0], config=tiles[label[5:]]))
                    if not bad:
                        calls = len(bf16) if label == "bf16" else len(ws)
                        t = time_graph(fn, reps=args.reps) / calls
                except Exception as e:  # noqa: BLE001
                    bad = f"{type(e).__name__}: {str(e)[:200]}"
                if bad:
                    print(f"{name} m={m} {label}: FAILED, {bad}", flush=True)
                    results["rows"].append({"shape": name, "rows": m, "kernel": label,
                                            "error": bad})
                    continue
                times[label] = t
                nbytes = 2 * n * k if label == "bf16" else q4_bytes
                results["rows"].append({"shape": name, "n": n, "k": k, "rows": m, "kernel": label,
                                        "us": t * 1e6, "weight_gbps": nbytes / t / 1e9,
                                        "tflops": 2 * m * n * k / t / 1e12})
            gemms = {lb: t for lb, t in times.items() if lb.startswith("gemm:")}
            best = min(gemms, key=gemms.get) if gemms else None
            line = {"shape": name, "rows": m, "best": best,
                    "best_config": tiles[best[5:]].name if best else None,
                    **{f"{lb}_us": times[lb] * 1e6 for lb in ("deq+cublas", "bf16", "fragment_x")
                       if lb in times},
                    "default_config": default.name,
                    "default_us": times.get("gemm:default", times.get(f"gemm:{default.name}",
                                                                        float("nan"))) * 1e6,
                    "best_us": gemms[best] * 1e6 if best else float("nan")}
            results["best"].append(line)
            print(f"{name:8s} m={m:<5d} best {line['best_config']} {line['best_us']:8.1f} us | "
                  f"default {line['default_us']:8.1f} | deq+cublas {line.get('deq+cublas_us', 0):8.1f}"
                  f" | bf16 {line.get('bf16_us', 0):8.1f} | x copy {line.get('fragment_x_us', 0):5.1f}"
                  f" | best/bf16 "
                  f"{line['best_us'] / line.get('bf16_us', float('nan')):.2f}x", flush=True)
        ws.clear()
        bf16.clear()
        torch.cuda.empty_cache()
        if args.json_out:  # after each shape: a run cut short keeps what it timed
            os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
            with open(args.json_out, "w") as f:
                json.dump(results, f, indent=1)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default=None,
                    help="row counts (default 1,2,4,8,16,64,256,1024; --sweep: "
                         "64,128,256,512,1024,2048)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--configs", default="m16n32k256s0w4st4,m16n128k128s0w4st4",
                    help="extra tiles of ours (comma-separated Int4Config names)")
    ap.add_argument("--no-torch-ref", action="store_true", help="skip torch's dequant+matmul")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="time the swapped GEMM's candidate tiles (see above)")
    ap.add_argument("--gemm-configs", default="",
                    help="--sweep: these tiles (Int4GemmConfig names) in place of GEMM_CANDIDATES")
    ap.add_argument("--reps", type=int, default=10, help="graph replays a timing")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                    help="--sweep: the activations' dtype (fp16: the fragment tiles' packed "
                         "16-bit decode under the fp16 scales)")
    args = ap.parse_args()
    extra = [parse_config(c) for c in filter(None, args.configs.split(","))]
    if not torch.cuda.is_available():
        print("int4_gemm.py needs a CUDA GPU")
        return 1
    if args.sweep:
        args.rows = args.rows or "64,128,256,512,1024,2048"
        return sweep(args)
    args.rows = args.rows or "1,2,4,8,16,64,256,1024"
    from gpu_timing import time_graph

    from flashpage.kernels.int4_gemm import int4_linear_ref, w4a16_matmul

    torch.manual_seed(0)
    dt, g = torch.bfloat16, args.group
    results: dict = {"device": torch.cuda.get_device_name(), "group_size": g, "rows": []}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws, bf16, q4_bytes = weight_copies(n, k, g, dt)
        copies = len(ws)
        for m in (1, 64):  # correctness first
            x = torch.randn(m, k, device="cuda", dtype=dt)
            err = (w4a16_matmul(x, *ws[0]).float() - int4_linear_ref(x, *ws[0]).float()).abs().max()
            print(f"{name} {n}x{k} m={m}: max |ours - reference| = {err.item():.3g}")
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            variants = _variants(x, ws, bf16, extra, dt)
            if args.no_torch_ref:
                variants.pop("torch deq+mm")
            for label, fn in variants.items():
                calls = len(bf16) if label == "bf16" else copies
                t = time_graph(fn, reps=args.reps) / calls
                nbytes = 2 * n * k if label == "bf16" else q4_bytes
                row = {"shape": name, "n": n, "k": k, "rows": m, "kernel": label,
                       "us": t * 1e6, "weight_gbps": nbytes / t / 1e9,
                       "tflops": 2 * m * n * k / t / 1e12}
                results["rows"].append(row)
                print(f"{name:8s} {n:6d}x{k:<6d} m={m:<5d} {label:28s} {row['us']:9.1f} us "
                      f"{row['weight_gbps']:7.0f} GB/s {row['tflops']:7.1f} TFLOP/s")
        ws.clear()
        bf16.clear()
        torch.cuda.empty_cache()
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
