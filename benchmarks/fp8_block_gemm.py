"""Block-scaled fp8 linears on the GPU (kernels/fp8_block_gemm.py, DeepSeek-V3 / Qwen3-FP8
checkpoints: e4m3 weights with a fp32 scale per 128 x 128 tile) against cuBLAS.

Llama-3-8B shapes (N out x K in): 4096x4096 (o_proj), 14336x4096 (gate / up), 4096x14336
(down); bf16 activations; rows 1, 16, 64, 256, 2048 by default. Each timed call streams
its weight from HBM: a CUDA graph cycles through enough distinct copies of the weight to
be far past the L2 (50 MB on the H200). Variants:

    row gemv      kernels/gemv.gemv_row with the block scales (one row only): what the
                  engine runs at one row (its default tile, PDL per FLASHPAGE_PDL)
    layer         layers/quant.fp8_block_linear: what the engine runs past one row
                  (weight-only up to BLOCK_W8A16_ROWS rows, W8A8 above on sm_89+)
    w8a16         w8a16_block_matmul: the weight tile widened to bf16 in registers, the
                  block scale on each K tile's fp32 partial sum (K split at few rows)
    w8a8          quantize_per_token_group + w8a8_block_matmul (e4m3 tensor cores)
    w8a8 gemm     w8a8_block_matmul alone, x quantized before the timing
    ours:<cfg>    each --configs tile (BlockFp8Config names) on the path of its rows
    deq+cublas    the weight dequantized per call (torch: scale * value, to bf16), then
                  torch.matmul: what keeping e4m3 would cost without the kernels
    bf16          torch.matmul over a bf16 weight of the same shape (cuBLAS; what a
                  block checkpoint ran as when it was dequantized at load)
    rowwise mm    torch._scaled_mm with a scale per row and per token (what per-channel
                  fp8 checkpoints run): the W8A8 ceiling cuBLAS reaches (sm_89+)

Printed and written (--json-out): us per call, GB/s of the weight bytes each reads (e4m3:
one byte a value plus the tiles' fp32 scales; bf16: two bytes), TFLOP/s of the product,
and the speed against bf16. First, each kernel is checked against its reference.

    python benchmarks/fp8_block_gemm.py --json-out $OUT/fp8_block_gemm.json
    python benchmarks/fp8_block_gemm.py --shapes down --rows 1,16 --configs m16n128s0w4st4g8

--sweep times the W8A8 GEMM alone (x quantized before the timing) in every tile of
``W8A8_CANDIDATES`` and in the default (``w8a8_config``), at 64, 256 and 2048 rows (--rows
to change), beside bf16 cuBLAS, ``torch._scaled_mm`` over per-token / per-row fp8 operands
(the GEMM alone too: ``scaled_mm gemm``) and the activation quantizer alone (``quant``),
each tile first checked against the fp32 emulation (``rel_err``); the JSON's ``best`` names
the fastest tile per shape and row count:

    python benchmarks/fp8_block_gemm.py --sweep --json-out $OUT/fp8_block_sweep.json

Without a GPU, --sweep runs tiny shapes in the Triton interpreter (fp32 activations, no
cuBLAS fp8): a smoke test of the script; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time  # noqa: E402

import torch  # noqa: E402

GPU = torch.cuda.is_available()
if not GPU:  # --sweep's smoke test: the kernels interpreted (set before Triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton.runtime import interpreter  # noqa: E402

    import tests.conftest  # noqa: E402,F401  (its numpy fix for the interpreter)

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests", "kernels"))  # test_fp8_kv imports sm90 from there
    from tests.kernels.test_fp8_kv import _torch_fp8_convert  # noqa: E402

    # torch's fp8 rounding under the interpreter, as the kernel tests (Triton 3.6's own
    # interpreted cast rounds ~10% of codes differently from torch and the GPU)
    interpreter._convert_float = _torch_fp8_convert(interpreter._convert_float)

SHAPES = {"o_proj": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}  # (N, K)
TINY_SHAPES = {"o_proj": (256, 256), "gate_up": (384, 256), "down": (256, 384)}  # interpreter
BLOCK = (128, 128)
L2_PAST = 256 << 20  # bytes of distinct weights a graph cycles through


def weight_copies(n: int, k: int) -> tuple[list, list, list, int]:
    """Block-quantized random e4m3 weights [n, k] (with their tile scales), the same weights
    with one scale per row (for _scaled_mm), and bf16 ones of the shape, each in enough
    copies that a graph cycling through them reads past L2; and one e4m3 copy's bytes."""
    from flashpage.kernels.fp8_block_ref import quantize_fp8_block
    from flashpage.layers.quant import quantize_fp8_rowwise

    nbytes = n * k + 4 * -(-n // BLOCK[0]) * -(-k // BLOCK[1])
    blocks, rows = [], []
    for _ in range(max(2, -(-L2_PAST // nbytes))):
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        blocks.append(quantize_fp8_block(w, BLOCK))
        rows.append(quantize_fp8_rowwise(w))
        del w
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            for _ in range(max(2, -(-L2_PAST // (2 * n * k))))]
    return blocks, rows, bf16, nbytes


def _variants(x: torch.Tensor, blocks: list, rows: list, bf16: list, extra: list,
              fp8_cores: bool) -> dict:
    """label -> a call over every weight copy (the timed unit)."""
    from flashpage.kernels.fp8_block_gemm import (
        quantize_per_token_group,
        w8a8_block_linear,
        w8a8_block_matmul,
        w8a16_block_matmul,
    )
    from flashpage.kernels.fp8_block_ref import dequantize_fp8_block
    from flashpage.kernels.gemv import gemv_row
    from flashpage.layers.quant import BLOCK_W8A16_ROWS, fp8_block_linear, scaled_mm_linear

    m = x.shape[0]
    out = {"row gemv": lambda: [gemv_row(x, q, scale=s, block=BLOCK) for q, s in blocks]} \
        if m == 1 else {}
    out |= {"layer": lambda: [fp8_block_linear(x, q, s, BLOCK) for q, s in blocks],
           "w8a16": lambda: [w8a16_block_matmul(x, q, s, BLOCK) for q, s in blocks]}
    if fp8_cores:
        xq, xs = quantize_per_token_group(x, BLOCK[1])
        out["w8a8"] = lambda: [w8a8_block_linear(x, q, s, BLOCK) for q, s in blocks]
        out["w8a8 gemm"] = lambda: [w8a8_block_matmul(xq, xs, q, s, BLOCK) for q, s in blocks]
    for c in extra:
        if m <= BLOCK_W8A16_ROWS or not fp8_cores:
            out[f"ours:{c.name}"] = lambda c=c: [w8a16_block_matmul(x, q, s, BLOCK, config=c)
                                                 for q, s in blocks]
        else:
            out[f"ours:{c.name}"] = lambda c=c: [w8a8_block_linear(x, q, s, BLOCK, config=c)
                                                 for q, s in blocks]
    out["deq+cublas"] = lambda: [torch.matmul(x, dequantize_fp8_block(q, s, BLOCK, x.dtype).t())
                                 for q, s in blocks]
    out["bf16"] = lambda: [torch.matmul(x, w.t()) for w in bf16]
    if fp8_cores:
        out["rowwise mm"] = lambda: [scaled_mm_linear(x, q, s) for q, s in rows]
    return out


def check(name: str, blocks: list, k: int, fp8_cores: bool) -> None:
    """Each kernel against its reference at a decode and a prompt row count."""
    from flashpage.kernels.fp8_block_gemm import w8a8_block_linear, w8a16_block_matmul
    from flashpage.kernels.fp8_block_ref import w8a8_block_linear_ref, w8a16_block_linear_ref

    q, s = blocks[0]
    for m in (1, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        pairs = [("w8a16", w8a16_block_matmul(x, q, s, BLOCK), w8a16_block_linear_ref(x, q, s, BLOCK))]
        if fp8_cores:
            pairs.append(("w8a8", w8a8_block_linear(x, q, s, BLOCK),
                          w8a8_block_linear_ref(x, q, s, BLOCK)))
        for label, got, ref in pairs:
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"{name} m={m} {label}: |ours - reference| / |reference| = {err:.2e}")


def write_json(path: str | None, results: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def _sweep_calls(x: torch.Tensor, xq: torch.Tensor, xs: torch.Tensor, blocks: list,
                 rowwise: list, bf16: list, default) -> dict:
    """--sweep's timed units: label -> (a call over every weight copy, the copies, the
    tile's name or None); the default tile first."""
    from flashpage.kernels.fp8_block_gemm import (
        W8A8_CANDIDATES,
        quantize_per_token_group,
        w8a8_block_matmul,
    )

    calls: dict = {}
    for c in (default, *[c for c in W8A8_CANDIDATES if c != default]):
        label = f"w8a8 default ({c.name})" if c == default else f"tile:{c.name}"
        calls[label] = (lambda c=c: [w8a8_block_matmul(xq, xs, q, s, BLOCK, out_dtype=x.dtype,
                                                       config=c) for q, s in blocks],
                        len(blocks), c.name)
    calls["quant"] = (lambda: quantize_per_token_group(x, BLOCK[1]), 1, None)
    calls["bf16"] = (lambda: [torch.matmul(x, w.t()) for w in bf16], len(bf16), None)
    if GPU:
        from flashpage.kernels.fp8_quant import quantize_per_token

        xr, xrs = quantize_per_token(x)
        calls["scaled_mm gemm"] = (lambda: [torch._scaled_mm(
            xr, q.t(), scale_a=xrs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
            for q, s in rowwise], len(rowwise), None)
    return calls


def sweep(shapes: list[str], rows: list[int], results: dict, json_out: str | None,
          t0: float) -> None:
    """--sweep: each W8A8 candidate tile and the default, the GEMM alone, beside bf16
    cuBLAS, torch._scaled_mm (row-wise, the GEMM alone) and the quantizer; appends to
    results["rows"] and fills results["best"] (shape -> rows -> fastest tile), the JSON
    rewritten after each row count (a run cut short keeps what it timed)."""
    from flashpage.kernels.fp8_block_gemm import quantize_per_token_group, w8a8_config
    from flashpage.kernels.fp8_block_ref import quantize_fp8_block, w8a8_block_linear_ref

    if GPU:
        from gpu_timing import time_graph
    dt = torch.bfloat16 if GPU else torch.float32  # the interpreter computes bf16 wrongly
    dev = "cuda" if GPU else "cpu"
    for name in shapes:
        n, k = (SHAPES if GPU else TINY_SHAPES)[name]
        if GPU:
            blocks, rowwise, bf16, nbytes = weight_copies(n, k)
        else:
            w = torch.randn(n, k) / k ** 0.5
            blocks, rowwise, bf16 = [quantize_fp8_block(w, BLOCK)], [], [w]
            nbytes = n * k + 4 * -(-n // BLOCK[0]) * -(-k // BLOCK[1])
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            xq, xs = quantize_per_token_group(x, BLOCK[1])
            q0, s0 = blocks[0]
            ref = w8a8_block_linear_ref(x, q0, s0, BLOCK).float()
            default = w8a8_config(m, n, k)
            calls = _sweep_calls(x, xq, xs, blocks, rowwise, bf16, default)
            times = {}
            for label, (fn, copies, cfg) in calls.items():
                err = None
                if cfg is not None:  # checked before it is timed
                    got = fn()[0].float()
                    err = ((got - ref).norm() / ref.norm()).item()
                if GPU:
                    t = time_graph(fn, reps=10) / copies
                else:
                    start = time.perf_counter()
                    fn()
                    t = (time.perf_counter() - start) / copies
                times[label] = t
                wbytes = 2 * n * k if label == "bf16" else n * k + 4 * n \
                    if label == "scaled_mm gemm" else 0 if label == "quant" else nbytes
                row = {"shape": name, "n": n, "k": k, "rows": m, "kernel": label, "config": cfg,
                       "us": t * 1e6, "weight_gbps": wbytes / t / 1e9,
                       "tflops": 2 * m * n * k / t / 1e12, "rel_err": err}
                results["rows"].append(row)
            for row in results["rows"][-len(times):]:
                row["vs_bf16"] = times["bf16"] / (row["us"] / 1e6)
                err = "" if row["rel_err"] is None else f" err {row['rel_err']:.1e}"
                print(f"{name:8s} {n:6d}x{k:<6d} m={m:<5d} {row['kernel']:36s} {row['us']:9.1f} us "
                      f"{row['tflops']:7.1f} TFLOP/s {row['vs_bf16']:5.2f}x bf16{err}", flush=True)
            tiles = [r for r in results["rows"][-len(times):] if r["config"] is not None]
            best = min(tiles, key=lambda r: r["us"])
            results["best"].setdefault(name, {})[str(m)] = {
                "config": best["config"], "us": best["us"], "vs_bf16": best["vs_bf16"],
                "default": default.name, "default_us": tiles[0]["us"]}
            print(f"{name:8s} m={m:<5d} best {best['config']} {best['us']:.1f} us "
                  f"({best['vs_bf16']:.2f}x bf16); default {default.name} {tiles[0]['us']:.1f} us",
                  flush=True)
            results["seconds"] = time.perf_counter() - t0
            write_json(json_out, results)
            del ref
        blocks.clear()
        rowwise.clear()
        bf16.clear()
        if GPU:
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--rows", default=None,
                    help="comma-separated row counts (1,16,64,256,2048; --sweep: 64,256,2048)")
    ap.add_argument("--sweep", action="store_true",
                    help="time the W8A8 GEMM in every W8A8_CANDIDATES tile and the default "
                         "beside bf16 and torch._scaled_mm (without a GPU: tiny shapes, "
                         "interpreted, a smoke test)")
    ap.add_argument("--configs", default="",
                    help="extra tiles of ours (comma-separated BlockFp8Config names, e.g. "
                         "m16n128s0w4st4g8): w8a16 at rows the layer runs it, w8a8 above")
    ap.add_argument("--no-deq", action="store_true", help="skip the per-call dequantize + cuBLAS")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    shapes = args.shapes.split(",")
    for name in shapes:
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown {name!r} (known: {', '.join(SHAPES)})")
    if args.sweep:
        rows = [int(r) for r in (args.rows or ("64,256,2048" if GPU else "8,70")).split(",")]
        torch.manual_seed(0)
        results: dict = {"device": torch.cuda.get_device_name() if GPU else
                         "CPU (Triton interpreter: smoke test only)", "block": list(BLOCK),
                         "sweep": True, "rows": [], "best": {}}
        t0 = time.perf_counter()
        sweep(shapes, rows, results, args.json_out, t0)
        print(f"done in {time.perf_counter() - t0:.0f} s")
        return 0
    if not GPU:
        print("fp8_block_gemm.py needs a CUDA GPU (but --sweep runs interpreted, tiny)")
        return 1
    from gpu_timing import time_graph

    from flashpage.kernels.device import cuda_capability
    from flashpage.kernels.fp8_block_gemm import parse_config

    extra = [parse_config(c) for c in filter(None, args.configs.split(","))]
    fp8_cores = cuda_capability(torch.device("cuda")) >= (8, 9)
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "block": list(BLOCK), "rows": []}
    for name in shapes:
        n, k = SHAPES[name]
        blocks, rows, bf16, nbytes = weight_copies(n, k)
        check(name, blocks, k, fp8_cores)
        for m in map(int, (args.rows or "1,16,64,256,2048").split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            variants = _variants(x, blocks, rows, bf16, extra, fp8_cores)
            if args.no_deq:
                variants.pop("deq+cublas")
            times = {}
            for label, fn in variants.items():
                calls = len(bf16) if label == "bf16" else len(blocks)
                times[label] = time_graph(fn, reps=10) / calls
            for label, t in times.items():
                wbytes = 2 * n * k if label == "bf16" else n * k + 4 * n if label == "rowwise mm" \
                    else nbytes
                row = {"shape": name, "n": n, "k": k, "rows": m, "kernel": label,
                       "us": t * 1e6, "weight_gbps": wbytes / t / 1e9,
                       "tflops": 2 * m * n * k / t / 1e12, "vs_bf16": times["bf16"] / t}
                results["rows"].append(row)
                print(f"{name:8s} {n:6d}x{k:<6d} m={m:<5d} {label:26s} {row['us']:9.1f} us "
                      f"{row['weight_gbps']:7.0f} GB/s {row['tflops']:7.1f} TFLOP/s "
                      f"{row['vs_bf16']:5.2f}x bf16")
        blocks.clear()
        rows.clear()
        bf16.clear()
        torch.cuda.empty_cache()
    write_json(args.json_out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
