"""What ALiBi costs in our kernels (GPU): paged decode and paged prefill at Bloom-7B1 /
MPT-7B's attention shape (32 heads of 128, MHA, bf16, block 16), each timed without ALiBi
(the default dispatch: on Hopper the Gluon kernels; and the Triton loops alone, "none
(triton)": ALiBi's own cost is "alibi" against it) and with Bloom's slopes (the Triton
loops: the Gluon kernels step aside), and against torch_native's ALiBi attention
(masked_attention: what such a model would run on without our kernels). Medians of
CUDA-graph replays (gpu_timing.graph_ms: no host time per call; torch_native's by
triton.testing.do_bench).

    python benchmarks/attention_alibi.py --out $OUT

writes $OUT/attention_alibi.json and prints one JSON row per case.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_timing import graph_ms, paged_cache, run_attention_cases  # noqa: E402

H, D, PAGE = 32, 128, 16
# each case: its name, the Gluon switch it runs under, whether it passes the slopes
CASES = (("none", "1", False), ("none (triton)", "0", False), ("alibi", "1", True))


def _timed(env: str, value: str, fn) -> float:
    old = os.environ.get(env)
    os.environ[env] = value
    try:
        return graph_ms(fn)
    finally:
        if old is None:
            del os.environ[env]
        else:
            os.environ[env] = old


def _slopes() -> torch.Tensor:
    from flashpage.layers.alibi import bloom_slopes

    return bloom_slopes(H).cuda()


def decode_rows(batch: int, ctx: int) -> list[dict]:

    from flashpage.kernels.paged_decode import paged_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    kc, vc, tables, lens = paged_cache(batch, ctx, H, D, g, PAGE)
    q = torch.randn(batch, H, D, generator=g, device="cuda").bfloat16()
    rows = []
    for name, gluon, alibi in CASES:
        kw = dict(alibi_slopes=_slopes()) if alibi else {}
        ms = _timed("FLASHPAGE_DECODE_GLUON_BF16", gluon,
                    lambda kw=kw: paged_decode(q, kc, vc, tables, lens, sm_scale=D**-0.5, **kw))
        rows.append(dict(op="decode", batch=batch, context=ctx, case=name, us=round(ms * 1e3, 1)))
    return rows


def prefill_rows(tokens: int) -> list[dict]:
    from triton.testing import do_bench

    from flashpage.attention.torch_native import causal_mask, gather_paged, masked_attention
    from flashpage.kernels.flash_prefill import paged_prefill

    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc, tables, lens = paged_cache(1, tokens, H, D, g, PAGE)
    q = torch.randn(tokens, H, D, generator=g, device="cuda").bfloat16()
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    slopes = _slopes()
    rows = []
    for name, gluon, alibi in CASES:
        kw = dict(alibi_slopes=slopes) if alibi else {}
        ms = _timed("FLASHPAGE_PREFILL_GLUON", gluon, lambda kw=kw: paged_prefill(
            q, kc, vc, tables, cu, lens, tokens, tokens, sm_scale=D**-0.5, **kw))
        rows.append(dict(op="prefill", tokens=tokens, case=name, us=round(ms * 1e3, 1)))
    if tokens <= 4096:  # torch_native's path materializes [H, L, L] fp32 scores
        k, v = gather_paged(kc, tables[0], tokens), gather_paged(vc, tables[0], tokens)
        mask = causal_mask(tokens, tokens, None, q.device)
        ms = do_bench(lambda: masked_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                               mask, D**-0.5, None, slopes))
        rows.append(dict(op="prefill", tokens=tokens, case="torch_native alibi", us=round(ms * 1e3, 1)))
    return rows


def main() -> None:
    run_attention_cases("attention_alibi", __doc__, decode_rows, prefill_rows)

if __name__ == "__main__":
    main()
