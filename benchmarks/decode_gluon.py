"""The persistent Gluon fp8 paged decode (kernels/paged_decode_gluon.py) beside the Triton
kernel's default path (``paged_decode`` under FLASHPAGE_DECODE_GLUON=0: the warp-split config at
these batches), GB/s.

GQA 32 / 8 heads, head_dim 128, block_size 16, float8_e4m3fn cache, bf16 q; the engine's
decode shapes: batch 256 x 1024, 128 x 2048 and 128 ragged contexts 101-2048 longest first.
GB/s = 2 * sum(contexts) * Hkv * D bytes (the fp8 bytes the contexts hold) / time; each time
is the median of CUDA-graph replays (gpu_timing.time_graph) of a graph of calls rotating
over independent copies of the inputs (>= 256 MB in all: out of the L2), with the copy
bandwidth (gpu_timing.copy_bandwidth) measured in the same run. "gluon": the form paged_decode
runs at this GQA group (``engine_form``: keys_m at 4 programs an SM); "gluon default": the
default variant at 3 programs an SM (what groups over 8 run). decode_gluon_knobs.py times the
launch knobs.

    python benchmarks/decode_gluon.py --out $OUT      # ~1 minute on an H200

writes $OUT/decode_gluon.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# "triton" is the Triton kernel: paged_decode would otherwise hand fp8 calls to the Gluon one
os.environ["FLASHPAGE_DECODE_GLUON"] = "0"

import torch  # noqa: E402
from gpu_timing import copy_bandwidth, time_graph

from flashpage.kernels.paged_decode import paged_decode
from flashpage.kernels.paged_decode_gluon import _launch as gluon_launch
from flashpage.kernels.paged_decode_gluon import engine_form

HQ, HKV, D, BS = 32, 8, 128, 16
ROTATE_BYTES = 256 * 2**20
FP8 = torch.float8_e4m3fn


class Batch:
    """One decode batch (given contexts) over copies of its K/V at random blocks."""

    def __init__(self, lens: list[int], kv_dtype: torch.dtype = FP8, runs: int = 1,
                 hq: int = HQ, hkv: int = HKV):
        """runs: the blocks shuffled over the cache in runs of this many consecutive ones (1:
        each on its own; 4: where a block-64 cache's would lie); 0: none shuffled, each
        sequence's blocks consecutive, in order (a fresh allocator's tables). hq / hkv: query
        and KV heads."""
        self.hq, self.hkv = hq, hkv
        self.lens = lens
        self.batch = len(lens)
        size = kv_dtype.itemsize
        self.kv_bytes = 2 * sum(lens) * hkv * D * size
        self.nblk = nblk = -(-max(lens) // BS)
        self.copies = max(1, -(-ROTATE_BYTES // (2 * self.batch * nblk * BS * hkv * D * size)))
        total = self.copies * self.batch * nblk
        run = runs or total
        groups = -(-total // run)
        self.key_cache = torch.randn(groups * run, BS, hkv, D, device="cuda").to(kv_dtype)
        self.value_cache = torch.randn(groups * run, BS, hkv, D, device="cuda").to(kv_dtype)
        starts = torch.randperm(groups, device="cuda", dtype=torch.int32) * run
        blocks = (starts[:, None] + torch.arange(run, device="cuda", dtype=torch.int32)).flatten()
        self.tables = blocks[:total].view(self.copies, self.batch, nblk)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.q = torch.randn(self.copies, self.batch, hq, D, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(self.batch, hq, D, device="cuda", dtype=torch.bfloat16)
        self.i = 0

    def calls(self) -> int:
        # every copy in turn, repeated until a graph reads >= 1 GB
        return self.copies * max(1, -(-(2**30) // (self.copies * self.kv_bytes)))

    def fn(self, launch, **kw):
        def call():
            self.i = (self.i + 1) % self.copies
            launch(self.q[self.i], self.key_cache, self.value_cache, self.tables[self.i], self.seq_lens,
                   out=self.out, **kw)
        return call

    def sdpa_cudnn(self):
        """SDPA cuDNN on the same K/V gathered once into contiguous [copies, B, Hkv, ctx, D]
        (uniform contexts only; the cache in q's dtype); its output [B, Hq, 1, D] left in
        sdpa_out (not copied into out: no extra kernel in the timing)."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if len(set(self.lens)) != 1:
            raise ValueError("SDPA's contiguous K/V needs one context length")
        ctx = self.lens[0]
        t = self.tables.long()
        k = self.key_cache[t].view(self.copies, self.batch, self.nblk * BS, self.hkv, D)[:, :, :ctx]
        v = self.value_cache[t].view(self.copies, self.batch, self.nblk * BS, self.hkv, D)[:, :, :ctx]
        k, v = k.transpose(2, 3).contiguous(), v.transpose(2, 3).contiguous()
        q4 = self.q.unsqueeze(3)  # [copies, B, Hq, 1, D]

        def call():
            self.i = (self.i + 1) % self.copies
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                self.sdpa_out = F.scaled_dot_product_attention(q4[self.i], k[self.i], v[self.i], enable_gqa=True)
        return call


def shapes() -> list[tuple[str, list[int]]]:
    gen = torch.Generator().manual_seed(1)
    ragged = sorted(torch.randint(101, 2049, (128,), generator=gen).tolist(), reverse=True)
    return [("256 x 1024", [1024] * 256), ("128 x 2048", [2048] * 128),
            ("128 x ragged 101-2048, longest first", ragged)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    t0 = time.time()
    copy_before = copy_bandwidth()
    kernels = {"triton": (paged_decode, {}), "gluon": (gluon_launch, engine_form(HQ // HKV)),
               "gluon default": (gluon_launch, {})}
    rows = []
    for name, lens in shapes():
        b = Batch(lens)
        ref = None
        row = dict(shape=name, batch=b.batch, mean_context=sum(lens) / b.batch, us={}, gbps={})
        for k, (launch, kw) in kernels.items():
            try:
                b.fn(launch, **kw)()
                if ref is None:
                    ref = b.out.clone()
                err = ((b.out.float() - ref.float()).norm() / ref.float().norm()).item()
                t = time_graph(b.fn(launch, **kw), b.calls())
                row["us"][k] = round(t * 1e6, 1)
                row["gbps"][k] = round(b.kv_bytes / t / 1e9)
                row.setdefault("rel_err_vs_triton", {})[k] = float(f"{err:.2e}")
            except Exception as ex:  # one failing variant must not hide the rest
                row["gbps"][k] = f"n/a: {type(ex).__name__}: {str(ex)[:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del b
        torch.cuda.empty_cache()
    copy = max(copy_before, copy_bandwidth())
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_gbps=round(copy), seconds=round(time.time() - t0))
    with open(os.path.join(args.out, "decode_gluon.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)

    def cell(g):
        return f"{g} ({100 * g / copy:.0f}%)" if isinstance(g, int) else g

    print(f"\nfp8 paged decode, GQA {HQ}/{HKV}, head_dim {D}, block {BS}, {meta['gpu']}, triton "
          f"{meta['triton']}: GB/s of the fp8 bytes the contexts hold (% of copy {round(copy)} GB/s)\n")
    def ratio(g, k):
        return f"{g[k] / g['triton']:.2f}x" if all(isinstance(g.get(x), int) for x in (k, "triton")) else "n/a"

    print("| shape | " + " | ".join(kernels) + " | gluon / triton | gluon default / triton |")
    print("| --- |" + " --- |" * (len(kernels) + 2))
    for r in rows:
        g = r["gbps"]
        print(f"| {r['shape']} | " + " | ".join(cell(g[k]) for k in kernels)
              + f" | {ratio(g, 'gluon')} | {ratio(g, 'gluon default')} |")


if __name__ == "__main__":
    main()
