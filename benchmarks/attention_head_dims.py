"""Our paged decode and prefill at head sizes that are not powers of two (GPU): Phi-2 /
Pythia-2.8B's 32 heads of 80 and GPT-NeoX-20B's 64 heads of 96 (MHA, bf16, block 16; the
kernels pad the head to 128 in registers), beside PyTorch's SDPA on contiguous K/V (what
cuDNN / flash give a dense cache) and torch_native's way over the same paged cache (gather
the blocks, then SDPA). Decode reports GB/s of K+V read; prefill the time. Medians of
CUDA-graph replays (gpu_timing.graph_ms: no host time per call; do_bench's medians up to
run 185 included it).

    python benchmarks/attention_head_dims.py --out $OUT

writes $OUT/attention_head_dims.json and prints one JSON row per case.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_timing import graph_ms, paged_cache  # noqa: E402

PAGE = 16
SHAPES = {"phi2_80": (32, 80), "neox20b_96": (64, 96), "ref_128": (32, 128)}


def _dense(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, H, ctx, D] from the paged cache (the contiguous K or V SDPA reads)."""
    b = tables.shape[0]
    return cache[tables.long()].reshape(b, -1, *cache.shape[2:])[:, :ctx].transpose(1, 2).contiguous()


def decode_rows(name: str, batch: int, ctx: int) -> list[dict]:
    from flashpage.kernels.paged_decode import paged_decode

    h, d = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    kc, vc, tables, lens = paged_cache(batch, ctx, h, d, g, PAGE)
    q = torch.randn(batch, h, d, generator=g, device="cuda").bfloat16()
    k, v = _dense(kc, tables, ctx), _dense(vc, tables, ctx)
    nbytes = 2 * batch * ctx * h * d * 2
    cases = {
        "ours (paged)": lambda: paged_decode(q, kc, vc, tables, lens, sm_scale=d**-0.5),
        "SDPA, contiguous K/V": lambda: F.scaled_dot_product_attention(q[:, :, None], k, v),
        "gather + SDPA (torch_native's way)": lambda: F.scaled_dot_product_attention(
            q[:, :, None], _dense(kc, tables, ctx), _dense(vc, tables, ctx)),
    }
    rows = []
    for case, fn in cases.items():
        ms = graph_ms(fn)
        rows.append(dict(op="decode", shape=name, batch=batch, context=ctx, case=case,
                         us=round(ms * 1e3, 1), kv_gbps=round(nbytes / ms / 1e6)))
    return rows


def prefill_rows(name: str, tokens: int) -> list[dict]:
    from flashpage.kernels.flash_prefill import paged_prefill

    h, d = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc, tables, lens = paged_cache(1, tokens, h, d, g, PAGE)
    q = torch.randn(tokens, h, d, generator=g, device="cuda").bfloat16()
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    k, v = _dense(kc, tables, tokens), _dense(vc, tables, tokens)
    qd = q.transpose(0, 1)[None]
    cases = {
        "ours (paged)": lambda: paged_prefill(q, kc, vc, tables, cu, lens, tokens, tokens,
                                              sm_scale=d**-0.5),
        "SDPA causal, contiguous K/V": lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True),
    }
    rows = []
    for case, fn in cases.items():
        ms = graph_ms(fn)
        flops = 2 * 2 * h * d * tokens * tokens / 2  # causal: half the QK^T and PV products
        rows.append(dict(op="prefill", shape=name, tokens=tokens, case=case,
                         us=round(ms * 1e3, 1), tflops=round(flops / ms / 1e9, 1)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_head_dims.py needs a CUDA GPU")
        sys.exit(1)
    rows: list[dict] = []
    for name in SHAPES:
        for batch, ctx in ((1, 8192), (32, 2048), (128, 1024)):
            rows += decode_rows(name, batch, ctx)
        for tokens in (2048, 8192):
            rows += prefill_rows(name, tokens)
    for r in rows:
        print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention_head_dims.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
