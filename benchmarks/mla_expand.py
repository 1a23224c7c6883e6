"""MLA's latents' expansion (GPU): kernels/mla_expand.py's planned gather and copy kernels
against the torch path (mla_expand_ref: index_select per request, cat, matmul, cat, copy,
cat), at DeepSeek-V2-Lite's shape (16 heads, nope 128, rope 64, v 128, rank 512, block 16).

Per case: host time a call (the wall time of N back-to-back calls over N: a step's layers
call it one after another; a planned call after the first layer's), GPU time a call (the
median of CUDA-event pairs around single calls), and the bytes the two copy kernels move
(gather: the latents read and written; copy: kv and the rope rows read, K / V / q written)
over the GPU time of the whole call, matmul included.

    python benchmarks/mla_expand.py [--dtype bfloat16] [--out $OUT]

Prints a markdown table; with --out writes $OUT/mla_expand.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_timing import event_us  # noqa: E402

from flashpage.kernels.mla_expand import MLAExpandPlan, mla_expand_ref  # noqa: E402

H, NOPE, ROPE, VD, RANK, PAGE = 16, 128, 64, 128, 512, 16
CASES = {  # name -> (prompt requests' context lengths, new query tokens)
    "1 x 128": ([128], 128),
    "1 x 16": ([16], 16),
    "4 x 128": ([128] * 4, 512),
    "1 x 2048": ([2048], 2048),
    "16-token chunk over 4k": ([4096], 16),
}


def inputs(lens: list[int], nq: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    per = [-(-n // PAGE) for n in lens]
    blocks = sum(per) + 8
    cache = torch.randn(blocks, PAGE, RANK + ROPE, device="cuda", dtype=dtype, generator=g)
    perm = torch.randperm(blocks, device="cuda", generator=g)
    width, rows, used = max(per), [], 0
    for k in per:
        rows.append(torch.cat([perm[used:used + k], perm.new_zeros(width - k)]))
        used += k
    tables = torch.stack(rows).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
    torch.cumsum(seq_lens, 0, out=cu_k[1:])
    w = torch.randn(H * (NOPE + VD), RANK, device="cuda", dtype=dtype, generator=g) / RANK**0.5
    q = torch.randn(nq, H, NOPE + ROPE, device="cuda", dtype=dtype, generator=g)
    return cache, tables, seq_lens, cu_k, w, q[..., :NOPE], q[..., NOPE:]


def timed(fn, iters: int) -> tuple[float, float]:
    """(host us a call over back-to-back calls, median GPU us of single calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    return host, event_us(fn, iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/mla_expand.py needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    dims = dict(num_heads=H, qk_nope_head_dim=NOPE, v_head_dim=VD)
    rows = []
    for name, (lens, nq) in CASES.items():
        cache, tables, seq_lens, cu_k, w, q_nope, q_pe = inputs(lens, nq, dtype)
        plan = MLAExpandPlan(cache, tables, seq_lens, cu_k, sum(lens), max(lens), w, q_nope, q_pe,
                             **dims)
        got = plan.run(cache, w, q_nope, q_pe)
        want = mla_expand_ref(cache, tables, seq_lens, w, q_nope, q_pe, **dims)
        equal = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        k_host, k_gpu = timed(lambda: plan.run(cache, w, q_nope, q_pe), args.iters)  # noqa: B023
        t_host, t_gpu = timed(lambda: mla_expand_ref(cache, tables, seq_lens, w, q_nope, q_pe,  # noqa: B023
                                                     **dims), args.iters)
        nk, es = sum(lens), cache.element_size()
        moved = es * (2 * nk * (RANK + ROPE) + nk * H * (NOPE + VD) + nk * ROPE
                      + nk * H * (NOPE + ROPE + VD) + 2 * nq * H * (NOPE + ROPE))
        rows.append(dict(case=name, equal=equal, kernel_host_us=round(k_host, 1),
                         torch_host_us=round(t_host, 1), kernel_gpu_us=round(k_gpu, 1),
                         torch_gpu_us=round(t_gpu, 1), kernel_gbps=round(moved / k_gpu / 1e3, 1)))
    print("| case | equal | host us (kernels / torch) | GPU us (kernels / torch) | copies' bytes / call time |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['equal']} | {r['kernel_host_us']} / {r['torch_host_us']} | "
              f"{r['kernel_gpu_us']} / {r['torch_gpu_us']} | {r['kernel_gbps']} GB/s |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mla_expand.json").write_text(json.dumps(dict(dtype=args.dtype, rows=rows), indent=1))


if __name__ == "__main__":
    main()
