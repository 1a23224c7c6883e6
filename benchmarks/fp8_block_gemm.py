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
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SHAPES = {"o_proj": (4096, 4096), "gate_up": (14336, 4096), "down": (4096, 14336)}  # (N, K)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--configs", default="",
                    help="extra tiles of ours (comma-separated BlockFp8Config names, e.g. "
                         "m16n128s0w4st4g8): w8a16 at rows the layer runs it, w8a8 above")
    ap.add_argument("--no-deq", action="store_true", help="skip the per-call dequantize + cuBLAS")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fp8_block_gemm.py needs a CUDA GPU")
        return 1
    from gpu_timing import time_graph

    from flashpage.kernels.device import cuda_capability
    from flashpage.kernels.fp8_block_gemm import parse_config

    extra = [parse_config(c) for c in filter(None, args.configs.split(","))]
    fp8_cores = cuda_capability(torch.device("cuda")) >= (8, 9)
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(), "block": list(BLOCK), "rows": []}
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: unknown {name!r} (known: {', '.join(SHAPES)})")
        n, k = SHAPES[name]
        blocks, rows, bf16, nbytes = weight_copies(n, k)
        check(name, blocks, k, fp8_cores)
        for m in map(int, args.rows.split(",")):
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
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
