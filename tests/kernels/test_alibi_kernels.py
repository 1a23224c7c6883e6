"""ALiBi (kernels/alibi.py, layers/alibi.py): the slopes against transformers' own, the
references against transformers' form of the bias, and the kernels (paged decode with its
key splits and their LSE merge, paged and contiguous prefill over cached prefixes) and both
backends against the references.

CPU: Triton's interpreter, fp32 and fp16, ragged lengths. GPU (marked gpu): bf16 with the
GPU's default configs, whose Gluon kernels must step aside for ALiBi.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported by the kernel modules
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_paged_decode import make_case  # noqa: E402
from variant_checks import check_decode_variant, check_prefill_variant, rel  # noqa: E402

from flashpage.kernels.flash_prefill import (  # noqa: E402
    flash_attn_varlen_ref,
    paged_prefill,
)
from flashpage.kernels.paged_decode import DecodeConfig, _launch, paged_decode_ref  # noqa: E402
from flashpage.layers.alibi import bloom_slopes, mpt_slopes  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(GPU, reason="the interpreter cases run on the CPU")


def _slopes(hq: int) -> torch.Tensor:
    return bloom_slopes(hq).to(DEV)



# ----------------------------------------------------------------------------- slopes


@pytest.mark.parametrize("heads", [1, 2, 5, 8, 12, 16, 24, 40, 71])
def test_bloom_slopes_are_transformers(heads):
    """Bloom's (and Falcon's) slopes, bit for bit, for power-of-two head counts and others
    (the closest power of two, then every other term of the next sequence)."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    assert torch.equal(bloom_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu")))


@pytest.mark.parametrize("heads", [1, 4, 6, 16, 24])
@pytest.mark.parametrize("bias_max", [8, 16])
def test_mpt_slopes_are_transformers(heads, bias_max):
    """MPT's slopes (odd terms then even ones for non-power-of-two head counts) against
    build_mpt_alibi_tensor, whose last two columns are -slope and 0."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(heads, 2, alibi_bias_max=bias_max)  # [H, 1, 2]
    assert torch.equal(bias[:, 0, 1], torch.zeros(heads))
    torch.testing.assert_close(mpt_slopes(heads, bias_max), -bias[:, 0, 0], rtol=0, atol=0)
    if heads == 16 and bias_max == 8:  # a power of two at the default: Bloom's sequence
        torch.testing.assert_close(mpt_slopes(heads), bloom_slopes(heads), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- references


def test_references_match_bloom_form():
    """Our references add slope * (j - i); transformers' Bloom adds slope * j to the scaled
    scores (baddbmm with alpha = scale) and MPT slope * (j - (L - 1)): one constant per query
    row apart, which the softmax cancels. Checked against the Bloom form written out, and the
    bias must change the result."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, lq, lk = 8, 2, 64, 5, 37
    q = torch.randn(lq, hq, d, generator=g)
    k = torch.randn(lk, hkv, d, generator=g)
    v = torch.randn(lk, hkv, d, generator=g)
    slopes = bloom_slopes(hq)
    cq = torch.tensor([0, lq], dtype=torch.int32)
    ck = torch.tensor([0, lk], dtype=torch.int32)
    ours = flash_attn_varlen_ref(q, k, v, cq, ck, lq, lk, alibi_slopes=slopes)
    scale = d ** -0.5
    kk = k.repeat_interleave(hq // hkv, 1)
    vv = v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * scale + slopes[:, None, None] * torch.arange(lk)
    qpos = torch.arange(lk - lq, lk)[:, None]
    scores = scores.masked_fill(torch.arange(lk)[None, :] > qpos, float("-inf"))
    bloom = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(ours, bloom, atol=1e-5, rtol=1e-5)
    assert rel(flash_attn_varlen_ref(q, k, v, cq, ck, lq, lk), ours) > 0.05
    # the decode reference: the last query row of the same sequence
    one = paged_decode_ref(q[-1:], k[None], v[None], torch.zeros(1, 1, dtype=torch.int32),
                           torch.tensor([lk], dtype=torch.int32), alibi_slopes=slopes)
    torch.testing.assert_close(one[0], bloom[-1], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- decode

# (seq_lens, q heads, kv heads, head_dim, block_size, num_splits, window, config): the main
# loop, GQA, key splits (empty ones too) with the merge kernel and the fused merge, a window,
# the hand-prefetched and V-prefetched loops, and configs asking for the warp-split loop and
# the row kernel (which step aside for ALiBi)
DECODE_CASES = [
    ([1, 17, 40], 4, 4, 64, 16, None, None, None),
    ([97, 3, 64], 8, 2, 64, 16, 3, None, None),
    ([70, 129], 8, 1, 64, 16, 8, None, None),
    ([97, 3, 64], 8, 2, 64, 16, 2, 20, None),
    ([100, 33], 8, 2, 64, 16, 3, None, DecodeConfig(32, 4, 3, fused_merge=True)),
    ([1, 32, 100], 8, 2, 64, 16, 2, None, DecodeConfig(32, 4, 3, prefetch_v=True)),
    ([1, 32, 100], 8, 2, 64, 16, 2, None, DecodeConfig(32, 4, 1, prefetch=True)),
    ([33, 70], 8, 2, 64, 16, 1, None, DecodeConfig(64, 4, 3, warp_split=True)),
    ([33, 70], 8, 4, 64, 16, 2, None, DecodeConfig(32, 4, 3, heads_per_program=2)),
]


def _decode_case(case, dtype, seed=0):
    seq_lens, hq, hkv, d, bs, splits, window, config = case
    check_decode_variant(seq_lens, hq, hkv, d, bs, dtype, splits=splits, config=config, window=window,
                         seed=seed, alibi_slopes=_slopes(hq))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-s{c[5]}-w{c[6]}-{c[7]}")
def test_decode_alibi_matches_reference(case, dtype):
    _decode_case(case, dtype)


def test_decode_splits_agree_with_one_split():
    """The split partials carry the biases of their own keys: merged, they give the unsplit
    result."""
    q, kc, vc, bt, lens = make_case([150, 61], 8, 2, 64, 16, torch.float32, seed=3, device=DEV)
    slopes = _slopes(8)
    one = _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=None, num_splits=1,
                  alibi_slopes=slopes)
    for splits in (2, 5):
        got = _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=None,
                      num_splits=splits, alibi_slopes=slopes)
        torch.testing.assert_close(got, one, atol=1e-5, rtol=1e-5)


def test_bad_slopes_are_refused():
    q, kc, vc, bt, lens = make_case([5], 4, 2, 64, 16, torch.float32, device=DEV)
    for bad in (torch.ones(3, device=DEV), torch.ones(4, dtype=torch.float16, device=DEV),
                torch.ones(8, device=DEV)[::2]):
        with pytest.raises(ValueError, match="alibi_slopes"):
            _launch(q, kc, vc, bt, lens, sm_scale=None, window_size=None, out=None, num_splits=1,
                    alibi_slopes=bad)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
        with pytest.raises(ValueError, match="alibi_slopes"):
            paged_prefill(q, kc, vc, bt, cu, lens, 1, 5, alibi_slopes=bad)


# ----------------------------------------------------------------------------- prefill


def _check_prefill(q_lens, prefixes, hq, hkv, d, dtype, block_size, window=None):
    check_prefill_variant(q_lens, prefixes, hq, hkv, d, dtype, block_size, seed=1, window=window,
                          alibi_slopes=_slopes(hq))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_alibi_cpu(dtype, window):
    """Every stage of the key loop (window edge, unmasked tiles, diagonal), ragged query
    lengths over ragged cached prefixes (one query alone after a long prefix: a decode-like
    row of the prefill), GQA."""
    _check_prefill([45, 20, 1], [10, 2, 30], 8, 2, 64, dtype, 16, window=window)


@cpu_only
def test_prefill_alibi_mha_page_spans_tiles():
    """MHA with pages larger than the key tiles, no prefix and a long one."""
    _check_prefill([40, 7], [0, 70], 4, 4, 64, torch.float32, 64)


# ----------------------------------------------------------------------------- backends


def _backend_case(dtype, seed=0):
    """One mixed step (two decodes, then a chunk after a cached prefix and a fresh prompt)
    over a random cache: q, k, v of the step's tokens and the caches with the contexts'
    earlier K/V written, the metadata, and the whole contexts' K/V for the reference."""
    from tests.conftest import step_metadata

    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, bs = 8, 2, 64, 8
    q_lens, seq_lens = [1, 1, 9, 13], [21, 40, 30, 13]
    tables, nxt = [], 1
    for n in seq_lens:
        nb = -(-n // bs)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    md, _ = step_metadata(q_lens, seq_lens, tables, bs, num_decodes=2)
    kc = torch.zeros(nxt, bs, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    ks = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in seq_lens]
    vs = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in seq_lens]
    for t, n, ql, k, v in zip(tables, seq_lens, q_lens, ks, vs, strict=True):
        for p in range(n - ql):  # the cached prefix; this step's tokens the backend writes
            kc[t[p // bs], p % bs], vc[t[p // bs], p % bs] = k[p], v[p]
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    k_new = torch.cat([k[n - ql:] for k, n, ql in zip(ks, seq_lens, q_lens, strict=True)])
    v_new = torch.cat([v[n - ql:] for v, n, ql in zip(vs, seq_lens, q_lens, strict=True)])
    return q, k_new, v_new, kc, vc, md, ks, vs, q_lens


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backends_agree_with_reference(dtype):
    """torch_native and triton (interpreted) over one mixed step with ALiBi: decodes, a chunk
    after a cached prefix, a fresh prompt; each equal to the per-request reference."""
    from flashpage.attention.torch_native import TorchNativeBackend
    from flashpage.attention.triton import TritonBackend
    from flashpage.config import ModelConfig

    cfg = ModelConfig(architecture="BloomForCausalLM", model_type="bloom", vocab_size=8,
                      hidden_size=512, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=64, alibi=True)
    q, k_new, v_new, kc, vc, md, ks, vs, q_lens = _backend_case(dtype)
    slopes = bloom_slopes(8)
    scale = 1 / math.sqrt(64)
    ref = torch.cat([flash_attn_varlen_ref(
        q[s:s + ql], k, v, torch.tensor([0, ql], dtype=torch.int32),
        torch.tensor([0, k.shape[0]], dtype=torch.int32), ql, k.shape[0], sm_scale=scale,
        alibi_slopes=slopes) for s, ql, k, v in zip(
            torch.tensor([0, *q_lens]).cumsum(0).tolist(), q_lens, ks, vs, strict=False)])
    for cls in (TorchNativeBackend, TritonBackend):
        assert cls.unsupported_reasons(cfg, torch.device("cpu"), dtype) == []
        backend = cls(cfg, torch.device("cpu"), dtype)
        backend.bind_kv_cache(kc.shape[0], kc.shape[1])
        kv = (kc.clone(), vc.clone())
        out = backend.forward(q, k_new, v_new, kv, backend.prepare(md), scale=scale,
                              alibi_slopes=slopes)
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        assert rel(out, ref) < tol, cls.name


def test_flex_refuses_alibi():
    from flashpage.attention.flex import FlexBackend
    from flashpage.config import ModelConfig

    cfg = ModelConfig(architecture="BloomForCausalLM", model_type="bloom", vocab_size=8,
                      hidden_size=128, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=64, alibi=True)
    reasons = FlexBackend.unsupported_reasons(cfg, torch.device("cpu"), torch.float32)
    assert any("ALiBi" in r and "alibi" in r for r in reasons), reasons


# ----------------------------------------------------------------------------- GPU, bf16


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", [(32, 8, 128, 16), (16, 16, 64, 16), (12, 1, 128, 32)],
                         ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-bs{c[3]}")
def test_decode_alibi_gpu(case):
    """bf16 with the GPU's default configs (Gluon kernels, warp split, fused merge where
    they would run: they step aside), over ragged contexts up to 4096, with splits."""
    hq, hkv, d, bs = case
    seq_lens = [1, 2047, bs + 1, 15, 16, 17, 4096]
    for splits in (None, 1, 7):
        _decode_case((seq_lens, hq, hkv, d, bs, splits, None, None), torch.bfloat16, seed=sum(case))
    _decode_case((seq_lens, hq, hkv, d, bs, None, 500, None), torch.bfloat16, seed=sum(case))
    # many sequences: the grid the Gluon bf16 kernel would take
    _decode_case(([300] * 40, hq, hkv, d, bs, None, None, None), torch.bfloat16, seed=1)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_alibi_gpu(d, monkeypatch):
    """bf16 with the GPU's tile configs (TMA on Hopper), prefixes up to a few thousand, and
    with the Gluon prefill asked for (FLASHPAGE_PREFILL_GLUON=1): it steps aside."""
    monkeypatch.setenv("FLASHPAGE_PREFILL_GLUON", "1")
    _check_prefill([1, 900, 300], [5000, 100, 0], 16, 2, d, torch.bfloat16, 16)
    _check_prefill([1, 900], [3000, 100], 16, 16, d, torch.bfloat16, 64, window=1024)
