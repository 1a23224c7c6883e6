"""Probe (session 7, run of 2026-11-30; removed after it): fp8 paged decode over NHD vs HND caches, and a loads-only
kernel over the same pages, to see whether the access pattern caps the fp8 loop."""
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from attention_decode import BS, D, HKV, Shape  # noqa: E402
from gpu_timing import copy_bandwidth, time_graph  # noqa: E402

from flashpage.kernels.paged_decode import _launch  # noqa: E402


@triton.jit
def _loads_only(k_ptr, v_ptr, bt_ptr, out_ptr, ctx, stride_kb, stride_kt, stride_kh, stride_btb,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    bt = bt_ptr + b.to(tl.int64) * stride_btb
    blk = tl.load(bt + offs_n // PAGE).to(tl.int64)
    for n0 in tl.range(0, ctx, BLOCK_N, num_stages=3):
        pos = n0 + offs_n
        nxt = pos + BLOCK_N
        blk_x = tl.load(bt + nxt // PAGE, mask=nxt < ctx, other=0).to(tl.int64)
        off = blk * stride_kb + (pos % PAGE) * stride_kt + h * stride_kh
        blk = blk_x
        k = tl.load(k_ptr + off[:, None] + offs_d[None, :])
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :])
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + (b * 8 + h) * D + offs_d, tl.sum(acc, 0))


def main():
    out_path = sys.argv[1]
    copy = copy_bandwidth()
    rows = []
    for batch, ctx in [(32, 4096), (64, 4096), (128, 2048), (128, 8192), (8, 32768)]:
        row = dict(batch=batch, context=ctx)
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            shapes = {lay: Shape(batch, ctx, dtype, layout=lay) for lay in ("nhd", "hnd")}
            for lay, sh in shapes.items():
                fns = {"decode": sh.ours()}
                out = torch.empty(batch * 8 * D, device="cuda")
                for bn in (64, 128):
                    def lo(sh=sh, bn=bn, out=out):
                        i = sh.next()
                        t = sh.tables[i]
                        _loads_only[(batch, HKV)](sh.key_cache, sh.value_cache, t, out, ctx,
                                                  sh.key_cache.stride(0), sh.key_cache.stride(1),
                                                  sh.key_cache.stride(2), t.stride(0),
                                                  PAGE=BS, BLOCK_N=bn, D=D, num_warps=4)
                    fns[f"loads{bn}"] = lo
                for key, fn in fns.items():
                    ts = [time_graph(fn, sh.calls()) for _ in range(2)]
                    row[f"{name}_{lay}_{key}"] = round(sh.kv_bytes / min(ts) / 1e9)
            del shapes
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump(dict(copy_gbps=round(copy), rows=rows), f, indent=1)
    print("copy", round(copy))


if __name__ == "__main__":
    main()
