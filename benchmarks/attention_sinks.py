"""What attention sinks cost in our kernels (GPU): paged decode and paged prefill at
GPT-OSS's attention shape (64 query heads of 64 over 8 KV heads, bf16, block 16), each
timed without sinks (the default dispatch: on Hopper the Gluon kernels where they apply)
and with them (the Triton loops: the Gluon kernels step aside), full and within GPT-OSS's
window of 128, and against torch_native's sink attention (masked_attention: what such a
model would run on without our kernels). Medians of CUDA-graph replays
(gpu_timing.graph_ms: no host time per call; torch_native's by triton.testing.do_bench).

    python benchmarks/attention_sinks.py --out $OUT

writes $OUT/attention_sinks.json and prints one JSON row per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_timing import graph_ms, paged_cache, run_attention_cases  # noqa: E402

HQ, HKV, D, PAGE, WINDOW = 64, 8, 64, 16, 128


def _sinks() -> torch.Tensor:
    return torch.randn(HQ, generator=torch.Generator().manual_seed(2)).cuda()


def decode_rows(batch: int, ctx: int) -> list[dict]:

    from flashpage.kernels.paged_decode import paged_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    kc, vc, tables, lens = paged_cache(batch, ctx, HKV, D, g, PAGE)
    q = torch.randn(batch, HQ, D, generator=g, device="cuda").bfloat16()
    rows = []
    for window in (None, WINDOW):
        for name, kw in (("none", {}), ("sinks", dict(sinks=_sinks()))):
            ms = graph_ms(lambda kw=kw, w=window: paged_decode(q, kc, vc, tables, lens,
                                                               sm_scale=D**-0.5, window_size=w, **kw))
            rows.append(dict(op="decode", batch=batch, context=ctx, window=window, case=name,
                             us=round(ms * 1e3, 1)))
    return rows


def prefill_rows(tokens: int) -> list[dict]:
    from triton.testing import do_bench

    from flashpage.attention.torch_native import causal_mask, gather_paged, masked_attention
    from flashpage.kernels.flash_prefill import paged_prefill

    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc, tables, lens = paged_cache(1, tokens, HKV, D, g, PAGE)
    q = torch.randn(tokens, HQ, D, generator=g, device="cuda").bfloat16()
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    sinks = _sinks()
    rows = []
    for window in (None, WINDOW):
        for name, kw in (("none", {}), ("sinks", dict(sinks=sinks))):
            ms = graph_ms(lambda kw=kw, w=window: paged_prefill(
                q, kc, vc, tables, cu, lens, tokens, tokens, sm_scale=D**-0.5, window_size=w, **kw))
            rows.append(dict(op="prefill", tokens=tokens, window=window, case=name,
                             us=round(ms * 1e3, 1)))
    if tokens <= 4096:  # torch_native's path materializes [Hq, L, L] fp32 scores
        k, v = gather_paged(kc, tables[0], tokens), gather_paged(vc, tables[0], tokens)
        mask = causal_mask(tokens, tokens, None, q.device)
        ms = do_bench(lambda: masked_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               mask, D**-0.5, None, None, sinks))
        rows.append(dict(op="prefill", tokens=tokens, window=None, case="torch_native sinks",
                         us=round(ms * 1e3, 1)))
    return rows


def main() -> None:
    run_attention_cases("attention_sinks", __doc__, decode_rows, prefill_rows)

if __name__ == "__main__":
    main()
