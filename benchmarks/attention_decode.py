"""Paged decode benchmark (GPU): GB/s of K+V read, beside PyTorch and the copy bandwidth.

GQA 32 query heads / 8 KV heads / head_dim 128, bf16, block_size 16, random block
tables. Measured in one run, so the ratios hold when the machine's speed drifts:

- copy: a 4 GiB device-to-device copy (bytes read + written), the memory ceiling;
- ours: flashpage.kernels.paged_decode (auto num_splits) on the paged cache;
- cudnn, flash: SDPA on a contiguous [B, Hkv, ctx, D] K/V (enable_gqa);
- gather_sdpa: the paged cache gathered through the block table, then SDPA.

GB/s = 2 * batch * context * Hkv * D * 2 bytes (the real context only) / time.
Each time is the median over CUDA-graph replays of a graph holding several calls that
rotate over independent inputs (>= 256 MB in all), so no shape is timed out of the L2
and Python launch overhead is not counted. ``--sweep`` also times tile configs and
split counts for our kernel.

    python benchmarks/attention_decode.py --out $OUT [--sweep]

writes $OUT/decode.json and $OUT/decode.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashpage.kernels.paged_decode import _launch, choose_num_splits

HQ, HKV, D, BS = 32, 8, 128, 16
SHAPES = [(1, 4096), (32, 4096), (128, 2048), (8, 32768), (1, 32768), (4, 65536)]
ROTATE_BYTES = 256 * 2**20
# (keys per iteration, warps, num_stages, hand prefetch): the hand-prefetched loop, and the
# loop left to Triton's pipeliner (which buffers K/V twice only from num_stages=5 on).
SWEEP_CONFIGS = [(32, 4, 1, True), (64, 4, 1, True), (64, 8, 1, True), (128, 8, 1, True),
                 (64, 4, 3, False), (64, 4, 5, False), (128, 4, 3, False), (32, 4, 5, False)]


def time_graph(fn, calls: int, reps: int = 20) -> float:
    """Median seconds of one ``fn()`` call: a graph runs ``calls`` calls, replayed ``reps`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """A 4 GiB device-to-device copy; the clocks are warmed first (an idle GPU starts slow)."""
    a = torch.randn(2 * 1024**3, device="cuda").to(torch.bfloat16)
    b = torch.empty_like(a)
    for _ in range(50):
        b.copy_(a)
    t = time_graph(lambda: b.copy_(a), calls=1)
    return 2 * a.numel() * 2 / t / 1e9


class Shape:
    """R independent copies of a batch's K/V: paged (random block tables) and contiguous."""

    def __init__(self, batch: int, ctx: int):
        self.batch, self.ctx = batch, ctx
        self.kv_bytes = 2 * batch * ctx * HKV * D * 2
        self.copies = max(1, -(-ROTATE_BYTES // self.kv_bytes))
        nblk = ctx // BS
        total = self.copies * batch * nblk
        self.key_cache = torch.randn(total, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
        self.value_cache = torch.randn_like(self.key_cache)
        perm = torch.randperm(total, device="cuda", dtype=torch.int32)
        self.tables = perm.view(self.copies, batch, nblk)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.q = torch.randn(self.copies, batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.i = 0

    def next(self) -> int:
        self.i = (self.i + 1) % self.copies
        return self.i

    def calls(self) -> int:
        # Every copy in turn, repeated until a graph reads >= 1 GB (~0.25 ms at 4 TB/s).
        return self.copies * max(1, -(-(2**30) // (self.copies * self.kv_bytes)))

    def ours(self, **kw):
        def fn():
            i = self.next()
            _launch(self.q[i], self.key_cache, self.value_cache, self.tables[i], self.seq_lens,
                    sm_scale=None, window_size=None, out=self.out, **kw)
        return fn

    def contiguous(self):
        # [copies, B, Hkv, ctx, D] gathered once, outside the timing
        k = self.key_cache[self.tables.long()].view(self.copies, self.batch, self.ctx, HKV, D)
        v = self.value_cache[self.tables.long()].view(self.copies, self.batch, self.ctx, HKV, D)
        return k.transpose(2, 3).contiguous(), v.transpose(2, 3).contiguous()

    def sdpa(self, k, v, backend):
        q4 = self.q.unsqueeze(3)  # [copies, B, Hq, 1, D]

        def fn():
            i = self.next()
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q4[i], k[i], v[i], enable_gqa=True)
        return fn

    def gather_sdpa(self):
        q4 = self.q.unsqueeze(3)

        def fn():
            i = self.next()
            t = self.tables[i].long()
            k = self.key_cache[t].view(self.batch, self.ctx, HKV, D).transpose(1, 2)
            v = self.value_cache[t].view(self.batch, self.ctx, HKV, D).transpose(1, 2)
            F.scaled_dot_product_attention(q4[i], k, v, enable_gqa=True)
        return fn


def gbps(shape: Shape, fn) -> float | str:
    try:
        return round(shape.kv_bytes / time_graph(fn, shape.calls()) / 1e9)
    except Exception as ex:  # one refusing backend must not hide the rest
        return f"n/a: {type(ex).__name__}: {str(ex)[:80]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_before = copy_bandwidth()
    print(f"copy bandwidth {copy_before:.0f} GB/s", flush=True)
    rows = []
    for batch, ctx in SHAPES:
        shape = Shape(batch, ctx)
        splits = choose_num_splits(batch, HKV, ctx, sms)
        row = dict(batch=batch, context=ctx, kv_gb=round(shape.kv_bytes / 1e9, 3), auto_splits=splits,
                   ours=gbps(shape, shape.ours(num_splits=None)))
        k, v = shape.contiguous()
        row["cudnn"] = gbps(shape, shape.sdpa(k, v, SDPBackend.CUDNN_ATTENTION))
        row["flash"] = gbps(shape, shape.sdpa(k, v, SDPBackend.FLASH_ATTENTION))
        del k, v
        row["gather_sdpa"] = gbps(shape, shape.gather_sdpa())
        if args.sweep:
            sweep = {}
            split_options = sorted({1, max(1, splits // 2), splits, 2 * splits})
            for bn, warps, stages, prefetch in SWEEP_CONFIGS:
                for s in split_options:
                    key = f"n{bn}w{warps}s{stages}{'p' if prefetch else ''}/sp{s}"
                    sweep[key] = gbps(shape, shape.ours(num_splits=s, block_n=bn, num_warps=warps,
                                                        num_stages=stages, prefetch=prefetch))
            best = max((k_ for k_ in sweep if isinstance(sweep[k_], int)), key=sweep.get)
            row["sweep_best"], row["sweep_best_gbps"] = best, sweep[best]
            row["sweep"] = sweep
        rows.append(row)
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "sweep"}), flush=True)
        del shape
        torch.cuda.empty_cache()

    copy_after = copy_bandwidth()
    copy = max(copy_before, copy_after)  # the ceiling: the better of two measurements
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, copy_gbps=round(copy),
                copy_before_gbps=round(copy_before), copy_after_gbps=round(copy_after),
                shape=f"GQA {HQ}/{HKV} heads, head_dim {D}, block_size {BS}, bf16")
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"Paged decode, {meta['shape']}, {meta['gpu']}, torch {meta['torch']}, "
             f"triton {meta['triton']}. GB/s of K+V read; copy bandwidth {round(copy)} GB/s "
             f"(measured before and after: {round(copy_before)}, {round(copy_after)}).", "",
             "| batch × context | ours (auto splits) | % of copy | × cuDNN | SDPA cuDNN (contiguous) "
             "| SDPA flash (contiguous) | gather + SDPA (paged) | best swept config |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ours = r["ours"]
        pct = f"{100 * ours / copy:.0f}%" if isinstance(ours, int) else "-"
        vs = f"{ours / r['cudnn']:.2f}×" if isinstance(ours, int) and isinstance(r["cudnn"], int) else "-"
        best = f"{r['sweep_best']}: {r['sweep_best_gbps']}" if "sweep_best" in r else "-"
        lines.append(f"| {r['batch']} × {r['context']} | {ours} ({r['auto_splits']} splits) | {pct} | {vs} "
                     f"| {r['cudnn']} | {r['flash']} | {r['gather_sdpa']} | {best} |")
    with open(os.path.join(args.out, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
