"""Chunked local attention (Llama 4's attention_chunk_size C: a query at position p sees keys
j <= p with j // C == p // C) in our Triton kernels: paged_prefill / flash_attn_varlen (the
chunk start as the rows' lower bound, the masked first stage over the tiles where rows of one
query tile sit in different chunks) and paged_decode (the query's chunk start as the key
range's lower bound, split or not, warp-split loop), against the fp32 references, which are
checked against the rule written out; and the triton backend against torch_native's mask.

CPU: Triton's interpreter, fp32 and fp16, the CPU tiles (32 queries x 16 keys): chunks of 8
(several chunks in a query tile), 20 and 24 (chunk starts inside query and key tiles), with
cached prefixes, ragged lengths, GQA. GPU (marked gpu): bf16 with the GPU's configs (TMA
tiles, Gluon kernels asked for: they step aside).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported by the kernel modules
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_alibi_kernels import _backend_case  # noqa: E402  (tests/kernels)
from test_flash_prefill import _close, _ragged, _to_paged  # noqa: E402
from test_paged_decode import check, make_case  # noqa: E402
from variant_checks import check_decode_variant, check_prefill_variant, rel  # noqa: E402

from flashpage.kernels.flash_prefill import (  # noqa: E402
    PrefillPlan,
    _attend_ref,
    flash_attn_varlen,
    gluon_prefill_unsupported,
    paged_prefill_ref,
)
from flashpage.kernels.paged_decode import (  # noqa: E402
    DecodeConfig,
    DecodePlan,
    _launch,
    gluon_bf16_unsupported,
    gluon_unsupported,
    paged_decode_ref,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on the CPU")



# ----------------------------------------------------------------------------- references


def test_prefill_reference_is_the_rule():
    """_attend_ref with chunk_size equals attention under the mask written out: key j is seen
    from position p iff j <= p and j // C == p // C (bottom-right positions after a prefix)."""
    g = torch.Generator().manual_seed(0)
    lq, lk, hq, hkv, d, c = 11, 30, 4, 2, 16, 7
    q, k, v = (torch.randn(n, h, d, generator=g) for n, h in ((lq, hq), (lk, hkv), (lk, hkv)))
    out, lse = _attend_ref(q, k, v, True, None, None, chunk_size=c)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(lq):
        p = i + lk - lq
        seen = [j for j in range(lk) if j <= p and j // c == p // c]
        s = torch.einsum("hd,jhd->hj", q[i], kk[seen]) / math.sqrt(d)
        torch.testing.assert_close(out[i], torch.einsum("hj,jhd->hd", s.softmax(-1), vv[seen]))
        torch.testing.assert_close(lse[:, i], s.logsumexp(-1))
    assert rel(_attend_ref(q, k, v, True, None, None)[0], out) > 0.05  # the chunks matter


def test_decode_reference_is_the_rule():
    q, kc, vc, bt, lens = make_case([1, 8, 9, 23], 4, 2, 16, 4, torch.float32, device="cpu")
    got = paged_decode_ref(q, kc, vc, bt, lens, chunk_size=8)
    for b, n in enumerate(lens.tolist()):
        start = (n - 1) // 8 * 8  # the query at n - 1 sees [start, n)
        keys = torch.arange(start, n)
        blk = bt[b].long()[keys // 4]
        k = kc[blk, keys % 4].repeat_interleave(2, 1)
        v = vc[blk, keys % 4].repeat_interleave(2, 1)
        s = torch.einsum("hd,jhd->hj", q[b], k) / 4.0
        torch.testing.assert_close(got[b], torch.einsum("hj,jhd->hd", s.softmax(-1), v))


# ----------------------------------------------------------------------------- prefill


def _check_prefill(q_lens, prefixes, hq, hkv, d, dtype, block_size, chunk, window=None, cfg=None):
    check_prefill_variant(q_lens, prefixes, hq, hkv, d, dtype, block_size, seed=2, window=window,
                          cfg=cfg, chunk_size=chunk)


@cpu_only
@pytest.mark.parametrize(("dtype", "chunk"), [(torch.float32, 8), (torch.float32, 20),
                                              (torch.float32, 24), (torch.float16, 20)])
def test_prefill_chunks_cpu(dtype, chunk):
    """32 x 16 tiles: chunk 8 puts four chunks in a query tile (and two in a key tile), 20
    and 24 start chunks inside query tiles and inside key tiles; prompts of 70 and 45 after
    no prefix and a prefix ending mid-chunk, one query alone after a long prefix (a
    decode-like row), GQA 4."""
    _check_prefill([70, 45, 1, 13], [0, 27, 61, 20], 8, 2, 32, dtype, 16, chunk)


@cpu_only
def test_prefill_chunks_with_window_and_pages_across_tiles_cpu():
    """A window inside the chunks (the row's bound the larger of both), MHA, pages of 64 that
    span several key tiles, and chunk 48 (query tiles in one chunk or two)."""
    _check_prefill([80, 30], [0, 50], 4, 4, 32, torch.float32, 64, 48, window=12)
    _check_prefill([50], [9], 4, 1, 64, torch.float32, 8, 16)  # chunk == key tile, pages of 8


@cpu_only
def test_prefill_chunk_larger_than_context_is_plain_causal():
    """Every key in the query's first chunk: the chunked kernel equals the unchunked one."""
    q, k, v, cq, ck, mq, mk = _ragged([30, 9], [5, 40], 4, 2, 32, torch.float32, seed=3)
    got = flash_attn_varlen(q, k, v, cq, ck, mq, mk, chunk_size=64)
    torch.testing.assert_close(got, flash_attn_varlen(q, k, v, cq, ck, mq, mk), atol=1e-6, rtol=0)


@cpu_only
def test_prefill_plan_serves_chunked_layers():
    """PrefillPlan made with a chunk runs as paged_prefill with it, layer after layer."""
    q, k, v, cq, ck, mq, mk = _ragged([40, 7], [10, 30], 4, 2, 32, torch.float32, seed=4)
    kc, vc, tables, seq_lens = _to_paged(k, v, ck, 16)
    plan = PrefillPlan(q, kc, vc, tables, cq, seq_lens, mq, mk, chunk_size=12)
    ref = paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk, chunk_size=12)
    for _ in range(2):
        _close(plan.run(q, kc, vc), ref, torch.float32)


def test_prefill_rejects_bad_chunks():
    q, k, v, cq, ck, mq, mk = _ragged([4], [0], 2, 2, 32, torch.float32)
    for bad in (0, -8, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            flash_attn_varlen(q, k, v, cq, ck, mq, mk, chunk_size=bad)
    with pytest.raises(ValueError, match="chunk_size.*causal"):
        flash_attn_varlen(q, k, v, cq, ck, mq, mk, causal=False, chunk_size=8)


def test_gluon_prefill_steps_aside_for_chunks():
    q = torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    assert any("chunked" in r for r in gluon_prefill_unsupported(q, kc, kc, capability=(9, 0),
                                                                  chunk_size=8192))
    assert not any("chunked" in r for r in gluon_prefill_unsupported(q, kc, kc, capability=(9, 0)))


# ----------------------------------------------------------------------------- decode

# (seq_lens, q heads, kv heads, head_dim, block_size, num_splits, chunk, config): contexts
# ending at, just past and just before chunk starts (a query alone in its chunk: one key)
DECODE_CASES = [
    ([1, 32, 33, 100, 129], 8, 2, 32, 16, 1, 32, None),
    ([1, 32, 33, 100, 129], 8, 2, 32, 16, 3, 32, None),  # splits over the chunk's keys
    ([70, 9, 200], 4, 4, 32, 16, 8, 20, DecodeConfig(block_n=16)),  # more splits than tiles
    ([150, 61, 17], 8, 1, 64, 8, 2, 40, None),  # all heads on one KV head, pages of 8
    # warp split (pieces of 16 keys): a chunk of 48 keeps the pieces inside one page; one of
    # 20 steps aside to the plain loop
    ([150, 61, 17], 8, 2, 32, 16, 2, 48, DecodeConfig(block_n=32, num_warps=2, warp_split=True)),
    ([150, 61, 17], 8, 2, 32, 16, 1, 20, DecodeConfig(block_n=32, num_warps=2, warp_split=True)),
    # a config asking for the row kernel (KV heads in pairs): it steps aside for chunks
    ([90, 33], 8, 4, 32, 16, 2, 16, DecodeConfig(block_n=32, heads_per_program=2)),
]


def _decode_case(case, dtype, seed=0, window=None):
    seq_lens, hq, hkv, d, bs, splits, chunk, config = case
    check_decode_variant(seq_lens, hq, hkv, d, bs, dtype, splits=splits, config=config, window=window,
                         seed=seed, chunk_size=chunk)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-s{c[5]}-c{c[6]}-{c[7]}")
def test_decode_chunks_match_reference(case, dtype):
    _decode_case(case, dtype)


@cpu_only
def test_decode_chunk_with_window_and_plan():
    """A window and a chunk together (the larger lower bound); a DecodePlan with a chunk."""
    _decode_case(([100, 57, 5], 8, 2, 32, 16, 2, 32, None), torch.float32, window=10)
    q, kc, vc, bt, lens = make_case([77, 12], 4, 2, 32, 16, torch.float32, seed=5, device=DEV)
    plan = DecodePlan(q, kc, vc, bt, lens, chunk_size=24, num_splits=2)
    ref = paged_decode_ref(q, kc, vc, bt, lens, chunk_size=24)
    for _ in range(2):
        check(plan.run(q, kc, vc), ref, torch.float32)


def test_decode_rejects_bad_chunks():
    q, kc, vc, bt, lens = make_case([5], 4, 2, 32, 16, torch.float32, device=DEV)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="chunk_size"):
            _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=None, num_splits=1,
                    chunk_size=bad)


def test_gluon_decode_kernels_step_aside_for_chunks():
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    kc16 = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    kc8 = kc16.to(torch.float8_e4m3fn)
    for why, cache in ((gluon_unsupported, kc8), (gluon_bf16_unsupported, kc16)):
        assert any("chunked" in r for r in why(q, cache, cache, None, 1, (9, 0), chunk_size=8192))
        assert why(q, cache, cache, None, 1, (9, 0)) == []


# ----------------------------------------------------------------------------- backend


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backend_matches_torch_native(dtype):
    """One mixed step (two decodes, a chunk after a cached prefix, a fresh prompt) with
    chunk 8 through both backends: triton (interpreted) equals torch_native's chunk mask."""
    from flashpage.attention.torch_native import TorchNativeBackend
    from flashpage.attention.triton import TritonBackend
    from flashpage.config import ModelConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=8,
                      hidden_size=512, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=64)
    q, k_new, v_new, kc, vc, md, _, _, _ = _backend_case(dtype, seed=1)
    outs = {}
    for cls in (TorchNativeBackend, TritonBackend):
        backend = cls(cfg, torch.device("cpu"), dtype)
        backend.bind_kv_cache(kc.shape[0], kc.shape[1])
        prepared = backend.prepare(md)
        kv = (kc.clone(), vc.clone())
        outs[cls.name] = backend.forward(q, k_new, v_new, kv, prepared, scale=0.125, chunk_size=8)
        # the same metadata (its plans) for an unchunked layer next: a plan of its own
        whole = backend.forward(q, k_new, v_new, kv, prepared, scale=0.125)
        assert rel(whole, outs[cls.name]) > 0.05
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel(outs["triton"], outs["torch_native"]) < tol


# ----------------------------------------------------------------------------- sm_90 compile (CPU)


def _compile_chunked() -> dict[str, int]:
    """The chunked kernels as the engine launches them on an H200 (bf16; the prefill's TMA
    and paged pointer paths with the default 128 x 128 tiles, the decode's split and
    warp-split loops), compiled for sm_90 with the interpreter off -> ptxas's spilled bytes."""
    from sm90 import compile_sm90, ptxas_sm90a, ptxas_usage

    from flashpage.kernels import flash_prefill as fp
    from flashpage.kernels import paged_decode as pd

    types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Lse": "*fp32",
             "cu_q": "*i32", "cu_k": "*i32", "seq_lens": "*i32", "block_tables": "*i32",
             "qk_scale": "fp32", "softcap": "fp32", "Slopes": "*fp32", "Sinks": "*fp32",
             "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "counter_ptr": "*i32",
             "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "sm_scale_log2": "fp32",
             "alibi_ptr": "*fp32", "sinks_ptr": "*fp32"}
    prefill = dict(HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, QK_DIM=128, HEAD_DIM_V=128, V_DIM=128,
                   CAUSAL=True, HAS_WINDOW=False, PAGE_SIZE=16, RETURN_LSE=False, IEEE=False,
                   WARP_SPEC=False, M_FASTEST=True, SOFTCAP=False, ALIBI=False, SINKS=False,
                   CHUNKED=True)
    decode = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_N=64,
                  HAS_WINDOW=False, IEEE=False, HEADS_FASTEST=False, FUSED_MERGE=False,
                  GROUP_PAD=4, MERGE_CHUNK=1, PDL=False, F16_DOTS=False, WARP_SPLIT=False,
                  SOFTCAP=False, ALIBI=False, SINKS=False, CHUNKED=True, SPLIT=True,
                  PREFETCH=False, PREFETCH_V=False)
    tma = {"desc_q": "tensordesc<bf16[128, 128]>", "desc_k": "tensordesc<bf16[128, 128]>",
           "desc_v": "tensordesc<bf16[128, 128]>"}
    kernels = {
        "prefill_tma": (fp._prefill_fwd, {**prefill, "KV_MODE": fp._KV_PAGED_TMA, "PAGE_SIZE": 128},
                        tma, 8, 3),
        "prefill_paged": (fp._prefill_fwd, {**prefill, "KV_MODE": fp._KV_PAGED, "desc_q": None,
                                            "desc_k": None, "desc_v": None}, {}, 8, 3),
        "decode_split": (pd._paged_decode_kernel, decode, {}, 4, 3),
        "decode_warp_split": (pd._paged_decode_kernel, {**decode, "WARP_SPLIT": True}, {}, 4, 3),
    }
    out = {}
    for name, (fn, consts, extra, warps, stages) in kernels.items():
        # as a GPU launch specializes them: 16-byte aligned tensors and strides
        free = set(getattr(fn, "do_not_specialize", ())) | {"stride_btb", "stride_bt"}
        aligned = [a for a in fn.arg_names if a not in consts and a not in free and (
            a.endswith("_ptr") or a.startswith("stride_") or a in ("Q", "K", "V", "Out"))]
        for chunked in (True, False):
            k = compile_sm90(fn, {**consts, "CHUNKED": chunked}, {**types, **extra},
                             num_warps=warps, num_stages=stages, aligned=aligned)
            out[f"{name}{'' if chunked else '/plain'}"] = ptxas_usage(
                ptxas_sm90a(k.asm["ptx"])[0])
    return out


@cpu_only
def test_chunked_kernels_compile_for_sm90():
    """The chunked variants compile for sm_90 (the interpreter checks none of Triton's
    compiler rules) and spill nothing (ptxas of triton 3.6, 2026-12-02: the paged prefill 247
    registers against 237 unchunked, the TMA prefill 208 against 196; the decode loops as
    many as unchunked)."""
    from sm90 import run_compiled

    usage = run_compiled("test_chunked_attention", "_compile_chunked")
    assert len(usage) == 8
    for key, u in usage.items():
        assert u["spill_bytes"] == 0, (key, u)
    for name in ("decode_split", "decode_warp_split"):
        assert usage[name]["regs"] == usage[f"{name}/plain"]["regs"], usage


# ----------------------------------------------------------------------------- GPU, bf16


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_chunks_gpu(d, monkeypatch):
    """bf16 with the GPU's tile configs (TMA on Hopper: 128-row tiles over chunks of 8192 and
    of 200), prefixes up to a few thousand, the Gluon prefill asked for: it steps aside."""
    monkeypatch.setenv("FLASHPAGE_PREFILL_GLUON", "1")
    _check_prefill([1, 900, 300], [5000, 100, 0], 16, 2, d, torch.bfloat16, 16, 200)
    _check_prefill([3000, 17], [6000, 8190], 8, 8, d, torch.bfloat16, 64, 8192)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", [(32, 8, 128, 16), (16, 16, 64, 16), (8, 1, 128, 32)],
                         ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-bs{c[3]}")
def test_decode_chunks_gpu(case, monkeypatch):
    """bf16 with the GPU's default configs (Gluon kernels, warp split, fused merge where
    they would run), ragged contexts around chunk starts, with splits; an fp8-free cache."""
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON_BF16", "1")
    hq, hkv, d, bs = case
    seq_lens = [1, 2047, 2048, 2049, bs + 1, 15, 4096, 5000]
    for splits in (None, 1, 7):
        _decode_case((seq_lens, hq, hkv, d, bs, splits, 2048, None), torch.bfloat16, seed=sum(case))
    _decode_case(([3000] * 40, hq, hkv, d, bs, None, 1000, None), torch.bfloat16, seed=1)
