"""What Gemma 2's attention logit softcap costs in our kernels (GPU): paged decode and paged
prefill at Gemma-2-9B's attention shape (16 query heads over 8 KV heads of 256, bf16,
block 16), each timed without a softcap, with a softcap of 50 (its attn_logit_softcapping)
and with both a softcap and Gemma 2's 4096-token window, and against torch_native's
softcapped attention (masked_attention: what Gemma 2 ran on before). Medians of
CUDA-graph replays (gpu_timing.graph_ms: no host time per call; torch_native's by
triton.testing.do_bench). The softcap takes the Triton loops (the Gluon kernels step aside),
so "softcap / none" also holds what the Gluon path gives the plain call.

    python benchmarks/attention_softcap.py --out $OUT

writes $OUT/attention_softcap.json and prints one JSON row per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_timing import graph_ms, paged_cache, run_attention_cases  # noqa: E402

HQ, HKV, D, PAGE, CAP, WINDOW = 16, 8, 256, 16, 50.0, 4096


def decode_rows(batch: int, ctx: int) -> list[dict]:

    from flashpage.kernels.paged_decode import paged_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    kc, vc, tables, lens = paged_cache(batch, ctx, HKV, D, g, PAGE)
    q = torch.randn(batch, HQ, D, generator=g, device="cuda").bfloat16()
    scale = 224**-0.5  # Gemma-2-9B's query_pre_attn_scalar
    rows = []
    for name, kw in (("none", {}), ("softcap", dict(softcap=CAP)),
                     ("softcap+window", dict(softcap=CAP, window_size=WINDOW))):
        ms = graph_ms(lambda kw=kw: paged_decode(q, kc, vc, tables, lens, sm_scale=scale, **kw))
        rows.append(dict(op="decode", batch=batch, context=ctx, case=name, us=round(ms * 1e3, 1)))
    return rows


def prefill_rows(tokens: int) -> list[dict]:
    from triton.testing import do_bench

    from flashpage.attention.torch_native import causal_mask, gather_paged, masked_attention
    from flashpage.kernels.flash_prefill import paged_prefill

    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc, tables, lens = paged_cache(1, tokens, HKV, D, g, PAGE)
    q = torch.randn(tokens, HQ, D, generator=g, device="cuda").bfloat16()
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    scale = 224**-0.5
    rows = []
    for name, kw in (("none", {}), ("softcap", dict(softcap=CAP)),
                     ("softcap+window", dict(softcap=CAP, window_size=WINDOW))):
        ms = graph_ms(lambda kw=kw: paged_prefill(q, kc, vc, tables, cu, lens, tokens, tokens,
                                                  sm_scale=scale, **kw))
        rows.append(dict(op="prefill", tokens=tokens, case=name, us=round(ms * 1e3, 1)))
    if tokens <= 4096:  # torch_native's path materializes [Hq, L, L] fp32 scores
        k, v = gather_paged(kc, tables[0], tokens), gather_paged(vc, tables[0], tokens)
        mask = causal_mask(tokens, tokens, None, q.device)
        ms = do_bench(lambda: masked_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               mask, scale, CAP))
        rows.append(dict(op="prefill", tokens=tokens, case="torch_native softcap", us=round(ms * 1e3, 1)))
    return rows


def main() -> None:
    run_attention_cases("attention_softcap", __doc__, decode_rows, prefill_rows)

if __name__ == "__main__":
    main()
