"""Head dims that are no power of two (Phi-2 / Pythia-2.8B's 80, GPT-NeoX-20B's 96, and 48)
on the Triton attention kernels: each pads the head dim to the next power of two in
registers and masks the padding columns on every load and store.

CPU (Triton's interpreter), fp32 and fp16, against the pure-torch references: the paged
decode's loops (main loop with ragged contexts, key splits with the merge kernel and the
in-kernel merge, sliding window, softcap, ALiBi, V prefetched, the hand-pipelined loop and
the warp-split loop), the paged prefill after a cached prefix (chunked prefill) with window,
softcap and ALiBi, and the contiguous varlen prefill. Unused cache slots hold NaN, so a
read past a context shows; a padding column loaded unmasked reads the next head's values
(or NaN past the last), which changes the dots (the warp-split loop without its column
mask fails here). The Gluon kernels' *_unsupported say why they step aside; the triton
backend's head-dim rule; the kernels at 80 and 96 compiled for sm_90 (no spills).
GPU (marked gpu): bf16 at 80 and 96 with the GPU's default configs against the references.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported by the kernel modules
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_flash_prefill import _close, _ragged, _to_paged  # noqa: E402  (tests/kernels)
from test_paged_decode import check, make_case  # noqa: E402

from flashpage.kernels.flash_prefill import (  # noqa: E402
    flash_attn_varlen,
    flash_attn_varlen_ref,
    gluon_prefill_unsupported,
    paged_prefill,
    paged_prefill_ref,
)
from flashpage.kernels.paged_decode import (  # noqa: E402
    DecodeConfig,
    _launch,
    gluon_bf16_unsupported,
    gluon_unsupported,
    paged_decode,
    paged_decode_ref,
)
from flashpage.layers.alibi import bloom_slopes  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on the CPU")
# (head dim, dtype): both dtypes at 80, one each at 96 and 48 (CI's interpreter budget)
DIM_DTYPES = [(80, torch.float32), (80, torch.float16), (96, torch.float16), (48, torch.float32)]


def _dd_id(dd) -> str:
    return f"d{dd[0]}-{str(dd[1]).replace('torch.', '')}"


# the prefill's option matrix (~4 s a case in the interpreter): 96 and 48 marked slow
PREFILL_DIM_DTYPES = [pytest.param(dd, id=_dd_id(dd), marks=[pytest.mark.slow] if dd[0] != 80 else [])
                      for dd in DIM_DTYPES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------------- decode
# (name, seq_lens, q heads, kv heads, block_size, config, num_splits, window, softcap, alibi)
DECODE_CASES = [
    ("ragged", [1, 17, 40, 70], 4, 2, 16, None, 1, None, None, False),
    ("splits_merge_kernel", [100, 1, 33], 8, 2, 16, None, 3, None, None, False),
    ("splits_fused_merge", [100, 1, 33], 8, 2, 16, DecodeConfig(32, 4, 3, fused_merge=True), 3,
     None, None, False),
    ("window", [97, 3, 64], 8, 2, 16, None, 2, 20, None, False),
    ("softcap", [45, 9], 4, 2, 16, None, 2, None, 2.5, False),
    ("alibi_splits", [70, 5], 4, 4, 16, None, 3, None, None, True),
    ("prefetch_v", [1, 32, 100], 8, 2, 16, DecodeConfig(32, 4, 3, prefetch_v=True), 2, None, None,
     False),
    ("prefetch", [1, 50, 90], 4, 1, 32, DecodeConfig(32, 4, 1, prefetch=True), 1, None, None, False),
    ("warp_split", [1, 17, 64, 130], 8, 2, 16, DecodeConfig(64, 4, 3, warp_split=True), 1, None,
     None, False),
    ("warp_split_splits", [100, 33], 8, 2, 16,
     DecodeConfig(64, 4, 3, warp_split=True, heads_fastest=True, fused_merge=True), 3, None, None,
     False),
]


@cpu_only
@pytest.mark.parametrize("dd", DIM_DTYPES, ids=_dd_id)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c[0])
def test_decode_head_dim_matches_reference(case, dd):
    d, dtype = dd
    _, lens, hq, hkv, bs, cfg, splits, window, softcap, alibi = case
    q, kc, vc, bt, sl = make_case(lens, hq, hkv, d, bs, dtype, seed=d)
    if softcap is not None:
        q = q * 4  # scores of a few units, into the cap's bend
    slopes = bloom_slopes(hq).to(DEV) if alibi else None
    out = torch.full_like(q, float("nan"))  # every element must be written
    _launch(q, kc, vc, bt, sl, sm_scale=None, window_size=window, out=out, num_splits=splits,
            config=cfg, softcap=softcap, alibi_slopes=slopes)
    ref = paged_decode_ref(q, kc, vc, bt, sl, window_size=window, softcap=softcap,
                           alibi_slopes=slopes)
    check(out, ref, dtype)
    if alibi:  # the bias changes the result: the check above could fail
        assert _rel(paged_decode_ref(q, kc, vc, bt, sl), ref) > 0.05


@cpu_only
def test_decode_head_dim_80_splits_agree_with_one_split():
    """The split partials ([.., num_splits, 80] fp32) and their merge: the same result as
    one split, to fp32 rounding."""
    q, kc, vc, bt, sl = make_case([150, 61], 8, 2, 80, 16, torch.float32, seed=3)
    one = paged_decode(q, kc, vc, bt, sl, num_splits=1)
    for splits in (2, 5):
        torch.testing.assert_close(paged_decode(q, kc, vc, bt, sl, num_splits=splits), one,
                                   atol=1e-6, rtol=1e-5)


@cpu_only
def test_decode_row_kernel_steps_aside_for_a_padded_head_dim():
    """The row kernel (heads_per_program > 1: contiguous HPB x D pieces of a cache row) takes
    power-of-two head dims only; asked for at 80, the main loop runs and is right."""
    q, kc, vc, bt, sl = make_case([33, 70], 8, 4, 80, 16, torch.float32, seed=5)
    out = torch.full_like(q, float("nan"))
    _launch(q, kc, vc, bt, sl, sm_scale=None, window_size=None, out=out, num_splits=2,
            config=DecodeConfig(32, 4, 3, heads_per_program=2))
    check(out, paged_decode_ref(q, kc, vc, bt, sl), torch.float32)


# ----------------------------------------------------------------------------- prefill


@cpu_only
@pytest.mark.parametrize("dd", PREFILL_DIM_DTYPES)
@pytest.mark.parametrize("opts", [
    {},
    {"window": 13},
    {"softcap": 0.5},
    {"alibi": True},
    {"window": 20, "alibi": True},
], ids=lambda o: "-".join(o) or "plain")
def test_prefill_head_dim_matches_reference(opts, dd):
    """Ragged queries after cached prefixes (chunked prefill, prefix hits), paged over
    blocks of 16 and contiguous, against the fp32 references (out and lse)."""
    d, dtype = dd
    q_lens, prefixes, hq, hkv = [45, 20, 1, 37], [10, 0, 30, 3], 4, 2
    q, k, v, cq, ck, mq, mk = _ragged(q_lens, prefixes, hq, hkv, d, dtype, seed=d)
    if "softcap" in opts:
        q = q * 4
    kc, vc, tables, seq_lens = _to_paged(k, v, ck, 16)
    kw = dict(window_size=opts.get("window"), softcap=opts.get("softcap"),
              alibi_slopes=bloom_slopes(hq).to(DEV) if opts.get("alibi") else None)
    out, lse = paged_prefill(q, kc, vc, tables, cq, seq_lens, mq, mk, return_lse=True, **kw)
    ref, ref_lse = paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk, return_lse=True, **kw)
    _close(out, ref, dtype)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4 if dtype == torch.float32 else 2e-3, rtol=1e-4)
    flat = q.new_full(q.shape, float("nan"))  # every row must be written
    flash_attn_varlen(q, k, v, cq, ck, mq, mk, out=flat, **kw)
    _close(flat, flash_attn_varlen_ref(q, k, v, cq, ck, mq, mk, **kw), dtype)
    if opts:  # each option changes the result: the checks above could fail
        plain = paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk)
        assert _rel(plain, ref) > 0.02


@cpu_only
@pytest.mark.parametrize("d", [40, 112, 160, 192])
def test_other_head_dims(d):
    """The rest of the rule's range, once each: 40 (a multiple of 8, not 16: a 64 tile),
    112 (128), 160 and 192 (256 tiles, 32-key decode tiles): decode with splits in fp32,
    paged prefill after cached prefixes in fp16."""
    q, kc, vc, bt, sl = make_case([1, 40, 90], 4, 2, d, 16, torch.float32, seed=d)
    out = torch.full_like(q, float("nan"))
    _launch(q, kc, vc, bt, sl, sm_scale=None, window_size=None, out=out, num_splits=2)
    check(out, paged_decode_ref(q, kc, vc, bt, sl), torch.float32)
    qp, k, v, cq, ck, mq, mk = _ragged([20, 1, 33], [9, 30, 0], 4, 2, d, torch.float16, seed=d)
    kcp, vcp, tables, seq_lens = _to_paged(k, v, ck, 16)
    _close(paged_prefill(qp, kcp, vcp, tables, cq, seq_lens, mq, mk),
           paged_prefill_ref(qp, kcp, vcp, tables, cq, seq_lens, mq, mk), torch.float16)


# ----------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("d", [80, 96])
def test_gluon_kernels_step_aside_for_other_head_dims(d):
    """On sm_90 the Gluon prefill and both Gluon decodes take head_dim 128 only: at 80 or 96
    each says so, and the dispatch then runs the Triton kernels."""
    q = torch.zeros(8, 8, d, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, d, dtype=torch.bfloat16)
    reasons = gluon_prefill_unsupported(q, cache, cache, capability=(9, 0))
    assert any("head_dim 128" in r for r in reasons), reasons
    assert any("head_dim 128" in r for r in gluon_bf16_unsupported(q, cache, cache, None, 1,
                                                                   capability=(9, 0)))
    fp8 = cache.to(torch.float8_e4m3fn)
    assert any("head_dim 128" in r for r in gluon_unsupported(q, fp8, fp8, None, 1, capability=(9, 0)))


def test_triton_backend_head_dim_rule():
    """Multiples of 8 from 32 to 256 run on the triton backend; the reason names the rule."""
    from flashpage.attention.triton import head_dim_reason

    for d in (32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256):
        assert head_dim_reason(d) is None, d
    for d in (16, 24, 20, 81, 100, 264, 512):
        reason = head_dim_reason(d)
        assert reason is not None and f"head_dim {d}" in reason and "multiple of 8" in reason


# ----------------------------------------------------------------------------- GPU


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 96])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_gpu_bf16_decode_head_dims(d, splits):
    """bf16 with the GPU's default config (Hopper: the head_dim-128 tile settings, the Gluon
    kernels stepping aside), batches from one sequence to past a wave, a window."""
    for lens, hq, hkv, window in (([3000], 32, 8, None), ([1, 500, 2047, 64] * 16, 32, 8, None),
                                  ([900, 37], 32, 32, 256)):
        q, kc, vc, bt, sl = make_case(lens, hq, hkv, d, 16, torch.bfloat16, device="cuda", seed=d)
        out = paged_decode(q, kc, vc, bt, sl, num_splits=splits, window_size=window)
        check(out, paged_decode_ref(q, kc, vc, bt, sl, window_size=window), torch.bfloat16)


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 96])
def test_gpu_bf16_decode_warp_split_fp8_head_dims(d):
    """An fp8 cache at 64+ programs (the warp-split default on Hopper), head dims 80 and 96."""
    q, kc, vc, bt, sl = make_case([1, 300, 1100, 77] * 32, 32, 8, d, 16, torch.bfloat16,
                                  device="cuda", seed=d)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    out = paged_decode(q, kc8, vc8, bt, sl)
    ref = paged_decode_ref(q, kc8, vc8, bt, sl)
    assert not out.isnan().any() and _rel(out, ref) < 1.2e-2  # test_fp8_kv's bf16 DECODE_TOL


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 96])
@pytest.mark.parametrize("window", [None, 100])
def test_gpu_bf16_prefill_head_dims(d, window):
    """bf16 paged and contiguous prefill with the GPU's default tiles (no TMA for a padded
    head dim), cached prefixes up to ~2000 tokens, GQA 4."""
    q_lens, prefixes = [1000, 1, 300, 77], [0, 2000, 129, 5]
    q, k, v, cq, ck, mq, mk = _ragged(q_lens, prefixes, 32, 8, d, torch.bfloat16, seed=d)
    kc, vc, tables, seq_lens = _to_paged(k, v, ck, 16)
    out = paged_prefill(q, kc, vc, tables, cq, seq_lens, mq, mk, window_size=window)
    _close(out, paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk, window_size=window),
           torch.bfloat16)
    flat = flash_attn_varlen(q, k, v, cq, ck, mq, mk, window_size=window)
    _close(flat, flash_attn_varlen_ref(q, k, v, cq, ck, mq, mk, window_size=window), torch.bfloat16)


# ----------------------------------------------------------------------------- sm_90 compile (CPU)


def _compile_padded_usage() -> dict[str, dict]:
    """The kernels the engine runs at a padded head dim, compiled for sm_90 with the Hopper
    tile settings that head_dim 128 uses (bf16 activations; the fp8 cache's warp-split loop):
    "name@D" -> ptxas's registers and spilled bytes, D in 80, 96 and 128 (the unpadded
    reference). The interpreter off, in a subprocess (sm90.run_compiled)."""
    import triton
    from sm90 import compile_sm90, ptxas_sm90a, ptxas_usage

    from flashpage.kernels import flash_prefill as fp_mod
    from flashpage.kernels import paged_decode as pd
    from flashpage.kernels import rotary as rot

    ptr = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "counter_ptr": "*i32",
           "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "cu_q": "*i32", "cu_k": "*i32",
           "seq_lens": "*i32", "block_tables": "*i32", "Lse": "*fp32", "Q": "*bf16",
           "Out": "*bf16", "K": "*bf16", "V": "*bf16", "sm_scale_log2": "fp32",
           "qk_scale": "fp32", "softcap": "fp32", "Slopes": "*fp32", "Sinks": "*fp32", "alibi_ptr": "*fp32", "sinks_ptr": "*fp32",
           "positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32"}
    out = {}
    for d in (80, 96, 128):
        decode = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=d, BLOCK_D=128, PAGE=16, BLOCK_N=64,
                      HAS_WINDOW=False, IEEE=False, HEADS_FASTEST=False, FUSED_MERGE=False,
                      GROUP_PAD=4, MERGE_CHUNK=1, PDL=False, F16_DOTS=False, WARP_SPLIT=False,
                      SOFTCAP=False, ALIBI=False, SINKS=False, CHUNKED=False, SPLIT=False, PREFETCH=False, PREFETCH_V=False)
        kernels = {
            "decode": (pd._paged_decode_kernel, decode, {}, 4, 3),
            "decode_split_fused_merge": (pd._paged_decode_kernel, {
                **decode, "SPLIT": True, "FUSED_MERGE": True, "MERGE_CHUNK": 16}, {}, 4, 3),
            "decode_fp8_warp_split": (pd._paged_decode_kernel, {
                **decode, "WARP_SPLIT": True, "F16_DOTS": True, "HEADS_FASTEST": True},
                {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}, 4, 3),
            "merge": (pd._merge_splits_kernel, dict(SPLITS_PAD=16, HEAD_DIM=d, BLOCK_D=128,
                                                    PDL=False), {"out_ptr": "*bf16"}, 4, 3),
            "prefill": (fp_mod._prefill_fwd, dict(
                HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, QK_DIM=d, HEAD_DIM_V=128, V_DIM=d,
                CAUSAL=True, HAS_WINDOW=False, KV_MODE=fp_mod._KV_PAGED, PAGE_SIZE=16,
                RETURN_LSE=False, IEEE=False, WARP_SPEC=False, M_FASTEST=True, SOFTCAP=False,
                ALIBI=False, SINKS=False, CHUNKED=False, desc_q=None, desc_k=None, desc_v=None), {}, 8, 3),
            "rotary_write": (rot._rotary_kernel, dict(
                WRITE_CACHE=True, IS_NEOX=True, PAGE=16, HALF=16, HALF_PAD=16, HEAD_DIM=d,
                BLOCK_D=128, REST_PAD=triton.next_power_of_2(d - 32), BLOCK_HQ=32, BLOCK_HK=8,
                PDL=False), {}, 4, 3),
        }
        for name, (fn, consts, types, warps, stages) in kernels.items():
            # as a GPU launch specializes them: 16-byte aligned tensors and strides (80 and 96
            # are multiples of 16 elements); the arguments it does not specialize left out
            free = set(getattr(fn, "do_not_specialize", ())) | {"stride_btb", "stride_bt"}
            aligned = [a for a in fn.arg_names if a not in consts and a not in free and (
                a.endswith("_ptr") or a.startswith("stride_") or a in ("Q", "K", "V", "Out"))]
            k = compile_sm90(fn, consts, {**ptr, **types}, num_warps=warps, num_stages=stages,
                             aligned=aligned)
            out[f"{name}@{d}"] = ptxas_usage(ptxas_sm90a(k.asm["ptx"])[0])
    return out


@cpu_only
def test_padded_head_dims_compile_for_sm90():
    """Every kernel the engine runs at head_dim 80 and 96 compiles for sm_90 with the tile
    settings of head_dim 128 and spills nothing (ptxas of triton 3.6, 2026-12-02: the
    decode loop 106 registers against 128's 96, the paged prefill 236 against 237); the fp8
    warp-split loop stays within 128's registers (168: 3 programs an SM, its tuning)."""
    from sm90 import run_compiled

    usage = run_compiled("test_head_dims", "_compile_padded_usage")
    assert len(usage) == 18
    for key, u in usage.items():
        assert u["spill_bytes"] == 0, (key, u)
    for d in (80, 96):
        assert (usage[f"decode_fp8_warp_split@{d}"]["regs"]
                <= usage["decode_fp8_warp_split@128"]["regs"]), usage
