"""Attention sinks (GPT-OSS; kernels/sinks.py): the reference against transformers' eager
form (the sink a column of the softmax, dropped after it), the kernels (paged decode with
its key splits, merged by the merge kernel and the fused merge, counting the sink once;
paged and contiguous prefill over cached prefixes, with and without a window) and both
backends against the references; the Gluon kernels and flex step aside.

CPU: Triton's interpreter, fp32 and fp16, GQA, ragged lengths. GPU (marked gpu): bf16 with
the GPU's default configs, whose Gluon and row kernels must step aside for sinks.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported by the kernel modules
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_flash_prefill import _close  # noqa: E402  (tests/kernels)
from test_paged_decode import check, make_case  # noqa: E402
from variant_checks import check_decode_variant, check_prefill_variant, rel  # noqa: E402

from flashpage.kernels.flash_prefill import (  # noqa: E402
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
    paged_decode_ref,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on the CPU")


def _sinks(hq: int, seed: int = 0) -> torch.Tensor:
    """Sinks of a few units, some heads' well above their scores (most of the mass then)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(hq, generator=g) * 2 + 1).to(DEV)



# ----------------------------------------------------------------------------- reference


def test_reference_is_transformers_eager_form():
    """transformers' GPT-OSS eager attention: the sink as one more logit column, the row
    max subtracted, softmax, the column dropped. Our references (prefill and decode) give
    the same; the sinks must change the result; a row that sees no key gives zeros."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, lq, lk = 8, 2, 32, 5, 23
    q = torch.randn(lq, hq, d, generator=g)
    k = torch.randn(lk, hkv, d, generator=g)
    v = torch.randn(lk, hkv, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 2
    cq = torch.tensor([0, lq], dtype=torch.int32)
    ck = torch.tensor([0, lk], dtype=torch.int32)
    ours = flash_attn_varlen_ref(q, k, v, cq, ck, lq, lk, sinks=sinks, window_size=8)
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * d ** -0.5
    qpos = torch.arange(lk - lq, lk)[:, None]
    kpos = torch.arange(lk)[None, :]
    scores = scores.masked_fill((kpos > qpos) | (kpos <= qpos - 8), float("-inf"))
    combined = torch.cat([scores, sinks.view(-1, 1, 1).expand(hq, lq, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(-1)[..., :-1]
    hf = torch.einsum("hqk,khd->qhd", probs, vv)
    torch.testing.assert_close(ours, hf, atol=1e-5, rtol=1e-5)
    assert rel(flash_attn_varlen_ref(q, k, v, cq, ck, lq, lk, window_size=8), ours) > 0.05
    one = paged_decode_ref(q[-1:], k[None], v[None], torch.zeros(1, 1, dtype=torch.int32),
                           torch.tensor([lk], dtype=torch.int32), sinks=sinks, window_size=8)
    torch.testing.assert_close(one[0], hf[-1], atol=1e-5, rtol=1e-5)
    # queries that see no key (more queries than keys, causal): zeros, not NaN
    empty = flash_attn_varlen_ref(q, k[:2], v[:2], cq, torch.tensor([0, 2], dtype=torch.int32),
                                  lq, 2, sinks=sinks)
    assert torch.equal(empty[:3], torch.zeros_like(empty[:3]))


# ----------------------------------------------------------------------------- decode

# (seq_lens, q heads, kv heads, head_dim, block_size, num_splits, window, config): the main
# loop, GQA, key splits (empty ones too, whose lse is the sink's alone in split 0) with the
# merge kernel and the fused merge, a window with splits, the prefetching loops, and configs
# asking for the warp-split loop and the row kernel (which steps aside for sinks)
DECODE_CASES = [
    ([1, 17, 40], 4, 4, 64, 16, None, None, None),
    ([97, 3, 64], 8, 2, 64, 16, 3, None, None),
    ([70, 129], 8, 1, 32, 16, 8, None, None),
    ([97, 3, 64], 8, 2, 64, 16, 3, 20, None),
    ([100, 33], 8, 2, 64, 16, 3, None, DecodeConfig(32, 4, 3, fused_merge=True)),
    ([100, 33], 8, 2, 64, 16, 3, 40, DecodeConfig(32, 4, 3, fused_merge=True)),
    ([1, 32, 100], 8, 2, 64, 16, 2, None, DecodeConfig(32, 4, 1, prefetch=True)),
    ([33, 70], 8, 2, 64, 16, 1, None, DecodeConfig(64, 4, 3, warp_split=True)),
    ([33, 70], 8, 4, 64, 16, 2, None, DecodeConfig(32, 4, 3, heads_per_program=2)),
]


def _decode_case(case, dtype, seed=0):
    seq_lens, hq, hkv, d, bs, splits, window, config = case
    check_decode_variant(seq_lens, hq, hkv, d, bs, dtype, splits=splits, config=config, window=window,
                         seed=seed, sinks=_sinks(hq, seed))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-s{c[5]}-w{c[6]}-{c[7]}")
def test_decode_sinks_match_reference(case, dtype):
    _decode_case(case, dtype)


@cpu_only
def test_decode_splits_count_the_sink_once():
    """Split or not, the same output: a sink counted per split would weigh it num_splits
    times in the merge."""
    q, kc, vc, bt, lens = make_case([150, 61], 8, 2, 64, 16, torch.float32, seed=3, device=DEV)
    sinks = _sinks(8, 3)
    one = _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=None, num_splits=1,
                  sinks=sinks)
    for splits in (2, 5, 16):  # 16: some splits of the 61-key sequence are empty
        got = _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=None,
                      num_splits=splits, sinks=sinks)
        torch.testing.assert_close(got, one, atol=1e-5, rtol=1e-5)


@cpu_only
def test_sinks_over_an_fp8_cache():
    """An fp8 (e4m3) cache under an fp16 query (dots in fp16 with a pre-scaled q, F16_DOTS):
    the sink, in its own base-2 scale, is untouched by the query's scaling; decode (split)
    and prefill against the references, which read the e4m3 values exactly."""
    q, kc, vc, bt, lens = make_case([70, 9, 33], 8, 2, 64, 16, torch.float16, seed=4, device=DEV)
    kc8 = torch.nan_to_num(kc).to(torch.float8_e4m3fn)
    vc8 = torch.nan_to_num(vc).to(torch.float8_e4m3fn)
    sinks = _sinks(8, 4)
    for splits in (1, 3):
        out = _launch(q, kc8, vc8, bt, lens, sm_scale=None, window_size=None, out=None,
                      num_splits=splits, sinks=sinks)
        check(out, paged_decode_ref(q, kc8, vc8, bt, lens, sinks=sinks), torch.float16)
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEV)
    got = paged_prefill(q, kc8, vc8, bt, cu, lens, 1, 70, sinks=sinks)
    _close(got, paged_prefill_ref(q, kc8, vc8, bt, cu, lens, 1, 70, sinks=sinks), torch.float16)


def test_bad_sinks_are_refused():
    q, kc, vc, bt, lens = make_case([5], 4, 2, 64, 16, torch.float32, device=DEV)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    for bad in (torch.ones(3, device=DEV), torch.ones(4, dtype=torch.float16, device=DEV),
                torch.ones(8, device=DEV)[::2]):
        with pytest.raises(ValueError, match="sinks"):
            _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=None, num_splits=1,
                    sinks=bad)
        with pytest.raises(ValueError, match="sinks"):
            paged_prefill(q, kc, vc, bt, cu, lens, 1, 5, sinks=bad)


def test_gluon_kernels_step_aside():
    """The Gluon decode (fp8 and 16-bit) and prefill kernels have no sinks: each names it,
    whatever else it would say about this call (so the Triton kernel runs instead)."""
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 2, 128, dtype=torch.bfloat16)
    s = torch.zeros(8)
    for reasons in (gluon_unsupported(q, kc, kc, None, 1, (9, 0), sinks=s),
                    gluon_bf16_unsupported(q, kc, kc, None, 1, (9, 0), sinks=s),
                    gluon_prefill_unsupported(q, kc, kc, None, (9, 0), sinks=s)):
        assert any("sinks" in r for r in reasons), reasons
    assert not any("sinks" in r for r in gluon_bf16_unsupported(q, kc, kc, None, 1, (9, 0)))


# ----------------------------------------------------------------------------- prefill


def _check_prefill(q_lens, prefixes, hq, hkv, d, dtype, block_size, window=None):
    """The lse counts the sink (variant_checks.check_prefill_variant compares it)."""
    check_prefill_variant(q_lens, prefixes, hq, hkv, d, dtype, block_size, seed=1, window=window,
                          sinks=_sinks(hq, 1))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_sinks_cpu(dtype, window):
    """Every stage of the key loop (window edge, unmasked tiles, diagonal), ragged query
    lengths over ragged cached prefixes (one query alone after a long prefix), GQA."""
    _check_prefill([45, 20, 1], [10, 2, 30], 8, 2, 64, dtype, 16, window=window)


# ----------------------------------------------------------------------------- backends


def _config(**kw):
    from flashpage.config import ModelConfig

    return ModelConfig(architecture="GptOssForCausalLM", model_type="gpt_oss", vocab_size=8,
                       hidden_size=512, intermediate_size=8, num_hidden_layers=1,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                       max_position_embeddings=64, attention_sinks=True, **kw)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 12])
def test_backends_agree_with_reference(dtype, window):
    """torch_native and triton (interpreted) over one mixed step with sinks: decodes, a
    chunk after a cached prefix, a fresh prompt; each equal to the per-request reference."""
    from test_alibi_kernels import _backend_case

    from flashpage.attention.torch_native import TorchNativeBackend
    from flashpage.attention.triton import TritonBackend

    cfg = _config()
    q, k_new, v_new, kc, vc, md, ks, vs, q_lens = _backend_case(dtype)
    sinks = _sinks(8, 2)
    scale = 1 / math.sqrt(64)
    ref = torch.cat([flash_attn_varlen_ref(
        q[s:s + ql], k, v, torch.tensor([0, ql], dtype=torch.int32),
        torch.tensor([0, k.shape[0]], dtype=torch.int32), ql, k.shape[0], sm_scale=scale,
        window_size=window, sinks=sinks) for s, ql, k, v in zip(
            torch.tensor([0, *q_lens]).cumsum(0).tolist(), q_lens, ks, vs, strict=False)])
    for cls in (TorchNativeBackend, TritonBackend):
        assert cls.unsupported_reasons(cfg, torch.device("cpu"), dtype) == []
        backend = cls(cfg, torch.device("cpu"), dtype)
        backend.bind_kv_cache(kc.shape[0], kc.shape[1])
        kv = (kc.clone(), vc.clone())
        md_ = backend.prepare(md)
        out = backend.forward(q, k_new, v_new, kv, md_, scale=scale, sliding_window=window,
                              sinks=sinks)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert rel(out, ref) < tol, cls.name
        # a second layer of the step, with other sinks, on the same plans (triton: the plans
        # take each layer's sinks at launch)
        other = -sinks
        out2 = backend.forward(q, k_new, v_new, (kc.clone(), vc.clone()), md_, scale=scale,
                               sliding_window=window, sinks=other)
        ref2 = torch.cat([flash_attn_varlen_ref(
            q[s:s + ql], k, v, torch.tensor([0, ql], dtype=torch.int32),
            torch.tensor([0, k.shape[0]], dtype=torch.int32), ql, k.shape[0], sm_scale=scale,
            window_size=window, sinks=other) for s, ql, k, v in zip(
                torch.tensor([0, *q_lens]).cumsum(0).tolist(), q_lens, ks, vs, strict=False)])
        assert rel(out2, ref2) < tol, cls.name
        assert rel(out2, out) > 0.01


def test_flex_refuses_sinks():
    from flashpage.attention.flex import FlexBackend

    reasons = FlexBackend.unsupported_reasons(_config(), torch.device("cpu"), torch.float32)
    assert any("sinks" in r for r in reasons), reasons


# ----------------------------------------------------------------------------- GPU, bf16


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", [(64, 8, 64, 16), (16, 16, 128, 16), (8, 1, 64, 32)],
                         ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-bs{c[3]}")
def test_decode_sinks_gpu(case):
    """bf16 with the GPU's default configs (Gluon kernels, row kernel, warp split, fused
    merge where they would run: the first two step aside), over ragged contexts up to 4096,
    with splits, and GPT-OSS's window of 128."""
    hq, hkv, d, bs = case
    seq_lens = [1, 2047, bs + 1, 15, 16, 17, 4096]
    for splits in (None, 1, 7):
        _decode_case((seq_lens, hq, hkv, d, bs, splits, None, None), torch.bfloat16, seed=sum(case))
    _decode_case((seq_lens, hq, hkv, d, bs, None, 128, None), torch.bfloat16, seed=sum(case))
    # seed 5: every case's sinks move the reference by > 5% over 300 keys (seed 1's by 1.2-3.6%
    # for two of them, run 186: the check that the sinks matter failed, not the kernel's)
    _decode_case(([300] * 40, hq, hkv, d, bs, None, None, None), torch.bfloat16, seed=5)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("window", [None, 128])
def test_prefill_sinks_gpu(window):
    """bf16 prefill with the GPU's default configs (TMA where it applies), GPT-OSS's head
    shape (64 query heads of 64 over 8 KV heads), prefixes, with and without the window."""
    _check_prefill([300, 17, 1], [0, 500, 1000], 64, 8, 64, torch.bfloat16, 16, window=window)
