"""An experiment for the e4m3 one-row GEMV: the products on the tensor cores.

Session 18 left kernels/gemv.gemv_row over e4m3 rows at ~60% of the copy rate on the 8B's
down projection (4096 x 14336) whatever its tiles (BENCHMARKS.md, FP8 weights, runs
149-157), with ~3 issued instructions per weight (unpack to f16, widen to f32, FMA) where
bf16 needs ~1 per two bytes. Here each weight tile is widened once to f16 (one
instruction per pair: e4m3 -> f16 is exact) and multiplied on the tensor cores against x
replicated into 16 columns (tl.dot's smallest N; 15 of them wasted, which the tensor cores
can afford), fp32 accumulation, the row scale applied at the end: W8A16 as gemv_row, no
per-element FMA on the CUDA cores, and the loads feed a dot, so Triton's pipeliner
stages them (num_stages). x goes to f16 too: exact for |x| < 65504 and within f16's
precision (bf16's 8 bits of mantissa fit in f16's 11), fine for a prototype, not yet for
activations past f16's range.

    python benchmarks/gemv_fp8_dot.py --check          # CPU (interpreter): against the reference
    python benchmarks/gemv_fp8_dot.py --out $OUT       # GPU: us per call and GB/s beside gemv_row

Not used by the engine; if it wins on the GPU it moves into kernels/gemv.py with tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "--check" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn,
                     SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     COLS: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SILU_MUL:
            g = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + k, mask=k_mask, other=0.0).to(tl.float32)
            # rounded as kernels/silu_mul: silu in fp32, to x's dtype, times up, to x's dtype
            dt = x_ptr.dtype.element_ty
            x = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
        else:
            x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        xt = tl.broadcast_to(x.to(tl.float16)[:, None], (BLOCK_K, COLS))
        acc = tl.dot(w.to(tl.float16), xt, acc)
    y = tl.sum(acc, axis=1) / COLS  # every column holds the same sums
    y *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_dot(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, silu_mul: bool = False,
             block_n: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 4,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] (or [1, 2K] with ``silu_mul``) bf16/fp16, w [N, K] float8_e4m3fn, scale fp32
    [N] -> [1, N] in x's dtype."""
    n, k = w.shape
    if x.shape != (1, 2 * k if silu_mul else k) or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x {tuple(x.shape)} / w {tuple(w.shape)} {w.dtype} do not fit")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    _gemv_dot_kernel[(triton.cdiv(n, block_n),)](
        x, w, scale, out, n, k, w.stride(0), SILU_MUL=silu_mul, BLOCK_N=block_n,
        BLOCK_K=block_k, COLS=16, num_warps=num_warps, num_stages=num_stages)
    return out


def check() -> None:
    from triton.runtime import interpreter

    from flashpage.kernels.gemv import skinny_linear_ref
    from flashpage.layers.quant import quantize_fp8_rowwise

    # numpy >= 2.4 refuses int() of the interpreter's 1-element scalars (tests/conftest.py
    # patches the same for the test suite)
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched

    g = torch.Generator().manual_seed(0)
    for n, k, silu in ((70, 96, False), (64, 256, True), (33, 40, False)):
        w, scale = quantize_fp8_rowwise(torch.randn(n, k, generator=g) / k ** 0.5)
        x = torch.randn(1, 2 * k if silu else k, generator=g).half()
        got = gemv_dot(x, w, scale, silu_mul=silu, block_n=32, block_k=32, num_stages=1)
        ref = skinny_linear_ref(x, w, None, silu_mul=silu, scale=scale)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"n={n} k={k} silu={silu}: rel err {err:.2e}")
        assert err < 2e-3, err


def bench(out_dir: str, tiles: list[tuple[int, int, int, int]]) -> None:
    from gpu_timing import copy_bandwidth, time_graph

    from flashpage.kernels.gemv import gemv_row
    from flashpage.layers.quant import quantize_fp8_rowwise

    torch.manual_seed(0)
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:,.0f} GB/s")
    rows = []
    for kind, (n, k) in SHAPES.items():
        silu = kind == "down"
        ws = [quantize_fp8_rowwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5)
              for _ in range(32)]
        x = torch.randn(1, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)
        ref = gemv_row(x, ws[0][0], silu_mul=silu, scale=ws[0][1])
        nbytes = 32 * n * k
        cands: list[tuple[str, Any]] = [
            ("gemv_row", lambda w, s, x=x, silu=silu: gemv_row(x, w, silu_mul=silu, scale=s))]
        for bn, bk, nw, st in tiles:
            cands.append((f"dot-n{bn}k{bk}w{nw}s{st}", lambda w, s, x=x, silu=silu, bn=bn, bk=bk, nw=nw, st=st:
                          gemv_dot(x, w, s, silu_mul=silu, block_n=bn, block_k=bk, num_warps=nw,
                                   num_stages=st)))
        for name, fn in cands:
            try:
                got = fn(*ws[0])
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                t = time_graph(lambda fn=fn, ws=ws: [fn(w, s) for w, s in ws])
            except Exception as e:  # a tile that does not compile or fit: say so, go on
                print(f"{kind:8s} {name:22s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            row = {"shape": kind, "kernel": name, "us_per_call": t / 32 * 1e6, "gbps": nbytes / t / 1e9,
                   "of_copy": nbytes / t / 1e9 / copy, "rel_err_vs_gemv_row": err}
            rows.append(row)
            print(f"{kind:8s} {name:22s} {row['us_per_call']:7.1f} us {row['gbps']:6.0f} GB/s "
                  f"({row['of_copy']:.0%} of copy)  rel err {err:.1e}")
    with open(os.path.join(out_dir, "gemv_fp8_dot.json"), "w") as f:
        json.dump({"copy_gbps": copy, "rows": rows}, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU: against the reference")
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiles", default="64,128,4,4;128,128,4,4;64,256,4,3;128,128,8,4;64,128,4,6;32,256,4,4",
                    help="block_n,block_k,warps,stages;...")
    args = ap.parse_args()
    if args.check:
        check()
        return 0
    if not torch.cuda.is_available():
        print("gemv_fp8_dot.py needs a CUDA GPU (or --check)")
        return 1
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")]
    bench(args.out, tiles)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
