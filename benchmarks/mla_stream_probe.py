"""How fast can one program an SM stream the MLA latents through a TMA ring, with no compute?
Issue 4's question: every MLA decode we have (Triton's, the two Gluon ones) reads the latents
at ~3.8 TB/s on an H200 at 8 x 32768, where the bf16 GQA decode reaches 4.29 TB/s. This
kernel only waits for each tile and refills its ring stage, so its rate is the ceiling of a
kernel that streams the same way; the knobs are what such a kernel could change:

- ``boxes``: ``slabs`` = a 64-key tile as 9 boxes [64 rows, 64 columns] (128-byte swizzle, the
  wgmma kernel's: 128 bytes of each 1152-byte row a box), ``contig`` = the same 72 KB as 9
  boxes [64, 64] over the cache seen as [rows x 9, 64] (each box 8 KB of contiguous memory;
  not a layout wgmma can read: the probe only streams);
- ``stages``: ring tiles of 72 KB (3 fit only without the decode's q and P buffers);
- ``programs``: 128 (what 8 x 16 splits give) or 132 (every SM), or two an SM (1 stage each).

Tiles are 64-key pages in a random order (a block table), as the decode reads them.

    python benchmarks/mla_stream_probe.py --out $OUT     # ~20 s on an H200
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from gpu_timing import copy_bandwidth, time_graph
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

D = 576
_TILE_BYTES = gl.constexpr(64 * D * 2)
_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


@gluon.jit
def _issue(desc, ring, bars, table_ptr, t, t_end, k, BOXES: gl.constexpr, ROWS: gl.constexpr,
           CONTIG: gl.constexpr, R: gl.constexpr):
    pred = t < t_end
    stage = k % R
    bar = bars.index(stage)
    blk = gl.load(table_ptr + t, mask=pred, other=0)
    mbarrier.expect(bar, _TILE_BYTES, pred=pred)
    for j in gl.static_range(BOXES):
        if CONTIG:  # the tile's 576 rows of 64 in the [rows x 9, 64] view, ROWS at a time
            tma.async_copy_global_to_shared(desc, [blk * 576 + ROWS * j, 0], bar, ring.index(stage * BOXES + j),
                                            pred=pred)
        else:  # column slab j of the tile's 64 rows
            tma.async_copy_global_to_shared(desc, [blk * 64, 64 * j], bar, ring.index(stage * BOXES + j), pred=pred)


@gluon.jit
def _stream_kernel(desc, table_ptr, sink_ptr, n_tiles, per_prog, BOXES: gl.constexpr, ROWS: gl.constexpr,
                   CONTIG: gl.constexpr, R: gl.constexpr):
    pid = gl.program_id(0)
    t0 = pid * per_prog
    t1 = gl.minimum(t0 + per_prog, n_tiles)
    ring = gl.allocate_shared_memory(gl.bfloat16, [R * BOXES, ROWS, 64], _SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [R, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(R):
        mbarrier.init(bars.index(j), count=1)
    gl.thread_barrier()
    for j in gl.static_range(R):
        _issue(desc, ring, bars, table_ptr, t0 + j, t1, j, BOXES, ROWS, CONTIG, R)
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc = gl.zeros([ROWS, 64], gl.float32, lay)
    for t in range(t0, t1):
        k = t - t0
        mbarrier.wait(bars.index(k % R), (k // R) & 1)
        acc += ring.index((k % R) * BOXES).load(lay).to(gl.float32)  # touch one box: the data is used
        gl.thread_barrier()
        _issue(desc, ring, bars, table_ptr, t + R, t1, k + R, BOXES, ROWS, CONTIG, R)
    gl.store(sink_ptr + pid, gl.sum(gl.sum(acc, 1), 0))
    for j in gl.static_range(R):
        mbarrier.invalidate(bars.index(j))


def run(pool: torch.Tensor, table: torch.Tensor, sink: torch.Tensor, boxes: str, stages: int, programs: int) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n = table.numel()
    if boxes == "contig":
        flat = pool.view(-1, 64)
        desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [64, 64], _SMEM.value)
        nb, rows = 9, 64
    else:
        flat = pool.view(-1, D)
        desc = TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [64, 64], _SMEM.value)
        nb, rows = 9, 64
    per = triton.cdiv(n, programs)
    _stream_kernel[(triton.cdiv(n, per),)](desc, table, sink, n, per, BOXES=nb, ROWS=rows,
                                           CONTIG=boxes == "contig", R=stages, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiles", type=int, default=8 * 32768 // 64, help="64-key tiles a call (8 x 32768: 4096)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth()
    rot = 4  # calls rotate over 4 x 302 MB: nothing from L2
    pools = [torch.randn(args.tiles, 64, D, device="cuda").to(torch.bfloat16) for _ in range(rot)]
    tables = [torch.randperm(args.tiles, device="cuda").int() for _ in range(rot)]
    sink = torch.zeros(2 * sms, device="cuda")
    nbytes = args.tiles * 64 * D * 2
    rows = []
    for boxes in ("slabs", "contig"):
        for stages, programs in ((1, 132), (2, 128), (2, 132), (3, 128), (3, 132), (1, 2 * sms), (2, 2 * sms)):
            if programs > sms and stages * 72 > 110:
                continue  # two programs an SM: at most 110 KB each

            def rotate(boxes=boxes, stages=stages, programs=programs):
                for i in range(rot):
                    run(pools[i], tables[i], sink, boxes, stages, programs)

            t = time_graph(rotate) / rot
            g = nbytes / t / 1e9
            row = dict(boxes=boxes, stages=stages, programs=programs, us=round(t * 1e6, 1), gbps=round(g),
                       pct_copy=round(100 * g / copy, 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(args.out, "mla_stream_probe.json"), "w") as f:
        json.dump(dict(copy_gbps=round(copy), gpu=torch.cuda.get_device_name(), tiles=args.tiles, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
