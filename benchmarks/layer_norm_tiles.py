"""The fused LayerNorm kernel's launch shape (GPU): rows per program (BLOCK_R) and warps,
timed on Llama-3-8B's shape (16384 tokens x 4096, bf16) without and with the residual add,
beside torch's own bf16 layer_norm and a copy of the same bytes, in one run.

    python benchmarks/layer_norm_tiles.py --json-out $OUT/layer_norm_tiles.json

Run 180 put ``layer_norm`` (weight and bias, no residual) at 75% of copy bandwidth where
the residual variant reached 93%; this asks whether another launch shape closes the gap.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.testing import do_bench

from flashpage.kernels.layer_norm import _LAUNCH

N, W = 16384, 4096
SHAPES = [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16), (4, 8), (4, 16)]


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(N, W, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(1, W, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1, W, device="cuda", dtype=torch.bfloat16)
    out, res_out = torch.empty_like(x), torch.empty_like(x)
    mb = x.numel() * 2 / 1e6  # one tensor's MB: MB / ms = GB/s
    copy_dst = torch.empty_like(x)
    rows = []
    copy_ms = ms(lambda: copy_dst.copy_(x))
    rows.append({"case": "copy (read x, write out)", "gbps": 2 * mb / copy_ms})
    ref_ms = ms(lambda: torch.nn.functional.layer_norm(x, (W,), w[0], b[0], 1e-5))
    rows.append({"case": "torch F.layer_norm bf16", "gbps": 2 * mb / ref_ms})
    for residual in (False, True):
        for block_r, warps in SHAPES:
            def run(block_r=block_r, warps=warps, residual=residual):
                _LAUNCH((triton.cdiv(N, block_r),),
                        (x, res, w, b, out, res_out, N, 1, x.stride(0), W, res.stride(0), W, 0, 0, 1e-5),
                        dict(WIDTH=W, BLOCK=W, BLOCK_R=block_r, HAS_WEIGHT=True, HAS_BIAS=True,
                             HAS_RESIDUAL=residual, PDL=False),
                        dict(num_warps=warps))
            t = ms(run)
            moved = (4 if residual else 2) * mb
            rows.append({"case": f"ours residual={residual} BLOCK_R={block_r} warps={warps}",
                         "gbps": moved / t, "of_copy": moved / t / (2 * mb / copy_ms)})
    for r in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
