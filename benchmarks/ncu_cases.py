"""One kernel call per case, for Nsight Compute: where do our kernels' warps stall?

    ncu --clock-control none --set full --import-source yes -k regex:NAME \
        --launch-skip 2 --launch-count 1 -o OUT python3 benchmarks/ncu_cases.py CASE

Each case builds its inputs once (random, shuffled block tables) and calls the kernel
three times: two warm-up calls (compilation, autotune-free), then the one ncu profiles
(``--launch-skip 2``). ``bash benchmarks/gpu_final.sh ncu`` profiles them all and writes
the per-instruction stall samples (``--page source --print-source sass``) beside the
summaries. Cases:

    decode_bf16 / decode_fp8   paged decode, 32 x 4096, GQA 32/8, head_dim 128, block 16
    mla_bf16_32x4k / mla_bf16_8x32k / mla_fp8_32x4k   MLA decode, 16 heads, 512 + 64, block 64
    prefill_causal / prefill_paged16 / prefill_paged128   2 x 4096 causal, 32 heads, D 128
    prefill_gluon_2x4k / prefill_gluon_1x16k   the Gluon prefill (flash_prefill_gluon.py), causal
    prefill_gluon_paged16_gather / _tma / _tma1s3   the same at 1 x 16384 over a block-16 paged cache, by
                               the cp.async gather producer / the TMA boxes / one-warp TMA, 3 deep
                               (issue 5's gap); prefill_gluon_8x1k / prefill_gluon_paged16_tma1s3_8x1k
                               at 8 x 1024 (the shape still short of 0.95x)
    decode_bf16_cudnn          SDPA cuDNN at decode_bf16's shape, K/V contiguous (issue 6's baseline;
                               decode_bf16 itself is the Gluon bf16 kernel on Hopper now)
    gemv_fp8_down / gemv_bf16_down / gemv_fp8_gate_up   the one-row GEMV (ncu regex _gemv_row)
    mla_gluon_8x32k / mla_gluon_32x4k   the Gluon MLA decode (mla_decode_gluon.py, its merge
                               kernel after it: profile the first kernel); mla_wgmma_8x32k the
                               wgmma one (mla_decode_wgmma.py; ncu regex _mla_decode_wgmma;
                               session 13's mla_wgmma_ws*_8x32k were forms since removed)
"""

from __future__ import annotations

import argparse

import torch

from flashpage.kernels.flash_prefill import flash_attn_varlen, paged_prefill
from flashpage.kernels.mla_decode import mla_decode
from flashpage.kernels.paged_decode import paged_decode

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _tables(batch: int, ctx: int, page: int) -> tuple[torch.Tensor, int]:
    nb = ctx // page
    perm = torch.randperm(batch * nb, device=DEV).to(torch.int32)
    return perm.view(batch, nb), batch * nb


def decode(dtype: torch.dtype, batch: int = 32, ctx: int = 4096):
    tables, blocks = _tables(batch, ctx, 16)
    q = torch.randn(batch, 32, 128, device=DEV, dtype=BF16)
    k = torch.randn(blocks, 16, 8, 128, device=DEV, dtype=BF16).to(dtype)
    v = torch.randn(blocks, 16, 8, 128, device=DEV, dtype=BF16).to(dtype)
    lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    return lambda: paged_decode(q, k, v, tables, lens)


def mla(dtype: torch.dtype, batch: int, ctx: int):
    tables, blocks = _tables(batch, ctx, 64)
    q = torch.randn(batch, 16, 576, device=DEV, dtype=BF16)
    kv = torch.randn(blocks, 64, 576, device=DEV, dtype=BF16).to(dtype)
    lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    return lambda: mla_decode(q, kv, tables, lens, kv_lora_rank=512, sm_scale=192 ** -0.5)


def prefill_gluon(batch: int, seq: int):
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

    q, k, v = (torch.randn(batch * seq, 32, 128, device=DEV, dtype=BF16) for _ in range(3))
    cu = torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * seq
    return lambda: flash_prefill_gluon(q, k, v, cu, seq, causal=True)


def decode_cudnn(batch: int = 32, ctx: int = 4096):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, 32, 1, 128, device=DEV, dtype=BF16)
    k = torch.randn(batch, 8, ctx, 128, device=DEV, dtype=BF16)
    v = torch.randn(batch, 8, ctx, 128, device=DEV, dtype=BF16)

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return call


def mla_gluon(batch: int, ctx: int, wgmma: bool = False, **kw):
    from flashpage.kernels.mla_decode_gluon import mla_decode_gluon
    from flashpage.kernels.mla_decode_wgmma import mla_decode_wgmma

    tables, blocks = _tables(batch, ctx, 64)
    q = torch.randn(batch, 16, 576, device=DEV, dtype=BF16)
    kv = torch.randn(blocks, 64, 576, device=DEV, dtype=BF16)
    lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    fn = mla_decode_wgmma if wgmma else mla_decode_gluon
    return lambda: fn(q, kv, tables, lens, kv_lora_rank=512, sm_scale=192 ** -0.5, **kw)


def prefill_gluon_paged(producer: str, batch: int = 1, seq: int = 16384, page: int = 16, **opts):
    from flashpage.kernels.flash_prefill_gluon import paged_prefill_gluon

    q = torch.randn(batch * seq, 32, 128, device=DEV, dtype=BF16)
    tables, blocks = _tables(batch, seq, page)
    kc = torch.randn(blocks, page, 32, 128, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    cu = torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * seq
    lens = torch.full((batch,), seq, device=DEV, dtype=torch.int32)
    return lambda: paged_prefill_gluon(q, kc, vc, tables, cu, lens, seq, seq, causal=True, producer=producer, **opts)


def prefill(page: int | None, batch: int = 2, seq: int = 4096):
    q = torch.randn(batch * seq, 32, 128, device=DEV, dtype=BF16)
    k = torch.randn(batch * seq, 32, 128, device=DEV, dtype=BF16)
    v = torch.randn(batch * seq, 32, 128, device=DEV, dtype=BF16)
    cu = torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * seq
    if page is None:
        return lambda: flash_attn_varlen(q, k, v, cu, cu, seq, seq, causal=True)
    tables, blocks = _tables(batch, seq, page)
    kc = torch.empty(blocks, page, 32, 128, device=DEV, dtype=BF16)
    vc = torch.empty_like(kc)
    slots = tables.long().repeat_interleave(page, 1) * page + torch.arange(seq, device=DEV) % page
    kc.view(-1, 32, 128)[slots.flatten()] = k
    vc.view(-1, 32, 128)[slots.flatten()] = v
    lens = torch.full((batch,), seq, device=DEV, dtype=torch.int32)
    return lambda: paged_prefill(q, kc, vc, tables, cu, lens, seq, seq, causal=True)


def gemv(kind: str, fp8: bool):
    """One-row GEMV (kernels/gemv.gemv_row, default tile) over an 8B shape's weight: down
    (4096 x 14336, SiLU·mul in the prologue) or gate_up (28672 x 4096, whole rows), e4m3
    rows with their scales or bf16 (session 18: fp8 down stays at ~60% of copy)."""
    from flashpage.kernels.gemv import gemv_row
    from flashpage.layers.quant import quantize_fp8_rowwise

    n, k = (4096, 14336) if kind == "down" else (28672, 4096)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k ** 0.5
    scale = None
    if fp8:
        w, scale = quantize_fp8_rowwise(w)
    x = torch.randn(1, 2 * k if kind == "down" else k, device=DEV, dtype=BF16)
    return lambda: gemv_row(x, w, silu_mul=kind == "down", scale=scale)


CASES = {
    "gemv_fp8_down": lambda: gemv("down", True),
    "gemv_bf16_down": lambda: gemv("down", False),
    "gemv_fp8_gate_up": lambda: gemv("gate_up", True),
    "decode_bf16": lambda: decode(BF16),
    "decode_fp8": lambda: decode(torch.float8_e4m3fn),
    "decode_fp8_256x1k": lambda: decode(torch.float8_e4m3fn, 256, 1024),  # an 8B engine step's
    "decode_fp8_128x2k": lambda: decode(torch.float8_e4m3fn, 128, 2048),
    "mla_bf16_32x4k": lambda: mla(BF16, 32, 4096),
    "mla_bf16_8x32k": lambda: mla(BF16, 8, 32768),
    "mla_fp8_32x4k": lambda: mla(torch.float8_e4m3fn, 32, 4096),
    "prefill_causal": lambda: prefill(None),
    "prefill_paged16": lambda: prefill(16),
    "prefill_paged128": lambda: prefill(128),
    "prefill_gluon_2x4k": lambda: prefill_gluon(2, 4096),  # the Gluon FA3-style kernel, causal
    "prefill_gluon_1x16k": lambda: prefill_gluon(1, 16384),
    "prefill_gluon_paged16_gather": lambda: prefill_gluon_paged("gather"),
    "prefill_gluon_paged16_tma": lambda: prefill_gluon_paged("tma"),
    # the engine's form since session 12 (the one-warp TMA producer, 3 deep), and at 8 x 1024
    "prefill_gluon_paged16_tma1s3": lambda: prefill_gluon_paged("tma1", num_stages=3),
    "prefill_gluon_8x1k": lambda: prefill_gluon(8, 1024),
    "prefill_gluon_paged16_tma1s3_8x1k": lambda: prefill_gluon_paged("tma1", 8, 1024, num_stages=3),
    "decode_bf16_cudnn": lambda: decode_cudnn(),
    "mla_gluon_8x32k": lambda: mla_gluon(8, 32768),
    "mla_gluon_32x4k": lambda: mla_gluon(32, 4096),
    "mla_wgmma_8x32k": lambda: mla_gluon(8, 32768, wgmma=True),  # kernels/mla_decode_wgmma.py
}


def main() -> None:
    ap = argparse.ArgumentParser(description="One kernel call per case, for Nsight Compute.")
    ap.add_argument("case", choices=list(CASES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_cases.py needs a CUDA GPU")
    fn = CASES[args.case]()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
