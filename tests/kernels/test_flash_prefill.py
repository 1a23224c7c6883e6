"""flash_attn_varlen / paged_prefill against their fp32 references.

CPU (no CUDA): Triton's interpreter, fp32 and fp16, small shapes with small tiles
(32 x 16), so that ragged ends, diagonals and windows cross several tiles; and an sm_90
compile of the D=128 default and the 2-CTA-per-SM candidate whose ptxas report is checked
(no GPU needed).
GPU (marked gpu): bf16 over head dims, GQA ratios, ragged lengths, block sizes
16-128 and prefixes up to a few thousand tokens, with the GPU's own tile configs and
every Hopper candidate that the benchmark times (flash_prefill.hopper_candidates).
MLA prefill shapes (qk dim 192 = 128 + 64 padded to a 256 tile, v dim 128) on both.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from sm90 import run_compiled  # tests/kernels (on sys.path under pytest)

if not torch.cuda.is_available():  # before triton is imported by the kernel module
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashpage.kernels.flash_prefill import (  # noqa: E402
    PrefillConfig,
    flash_attn_varlen,
    flash_attn_varlen_ref,
    hopper_candidates,
    paged_prefill,
    paged_prefill_ref,
)

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


def _ragged(q_lens, prefixes, hq, hkv, d, dtype, seed=0, dv=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    k_lens = [lq + p for lq, p in zip(q_lens, prefixes, strict=True)]
    q = torch.randn(sum(q_lens), hq, d, generator=g, device=DEV).to(dtype)
    k = torch.randn(sum(k_lens), hkv, d, generator=g, device=DEV).to(dtype)
    v = torch.randn(sum(k_lens), hkv, dv or d, generator=g, device=DEV).to(dtype)
    return q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens)


def _to_paged(k, v, cu_k, block_size, seed=0):
    """Scatter contiguous ragged K/V into a shuffled block pool; returns caches, tables, seq_lens."""
    lens = (cu_k[1:] - cu_k[:-1]).tolist()
    nblk = [(n + block_size - 1) // block_size for n in lens]
    total = sum(nblk) + 3  # spare blocks that no table points at, block 0 among them
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), max(nblk) + 1, dtype=torch.int32)
    # poison: slots no sequence owns must never reach the output
    kc = torch.full((total, block_size, *k.shape[1:]), float("nan"), dtype=k.dtype, device=DEV)
    vc = torch.full((total, block_size, *v.shape[1:]), float("nan"), dtype=v.dtype, device=DEV)
    start = cu_k.tolist()
    for b, n in enumerate(lens):
        ids = perm[:nblk[b]]
        perm = perm[nblk[b]:]
        tables[b, :nblk[b]] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n)
        blk = torch.tensor(ids, dtype=torch.long)[pos // block_size]
        kc[blk.to(DEV), (pos % block_size).to(DEV)] = k[start[b]:start[b] + n]
        vc[blk.to(DEV), (pos % block_size).to(DEV)] = v[start[b]:start[b] + n]
    return kc, vc, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def _close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output"
    err = (out.float() - ref.float()).abs().max().item()
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err <= 8 * TOL[dtype] and rel <= TOL[dtype], f"max abs {err:.2e}, rel {rel:.2e}"


def _check_varlen(q_lens, prefixes, hq, hkv, d, dtype, causal=True, window=None, cfg=None,
                  lse=True, dv=None, softcap=None):
    q, k, v, cq, ck, mq, mk = _ragged(q_lens, prefixes, hq, hkv, d, dtype, dv=dv)
    kw = dict(causal=causal, window_size=window, return_lse=lse, softcap=softcap)
    out = q.new_full((*q.shape[:2], v.shape[-1]), float("nan"))  # every row must be written
    res = flash_attn_varlen(q, k, v, cq, ck, mq, mk, out=out, _config=cfg, **kw)
    ref = flash_attn_varlen_ref(q, k, v, cq, ck, mq, mk, **kw)
    if lse:
        _close(res[0], ref[0], dtype)
        torch.testing.assert_close(res[1], ref[1], atol=1e-4 if dtype == torch.float32 else 2e-3,
                                   rtol=1e-4)
        assert res[0] is out
    else:
        _close(res, ref, dtype)


def _check_paged(q_lens, prefixes, hq, hkv, d, dtype, block_size, causal=True, window=None,
                 cfg=None, dv=None, softcap=None):
    q, k, v, cq, ck, mq, mk = _ragged(q_lens, prefixes, hq, hkv, d, dtype, seed=1, dv=dv)
    kc, vc, tables, seq_lens = _to_paged(k, v, ck, block_size)
    kw = dict(causal=causal, window_size=window, return_lse=True, softcap=softcap)
    out, lse = paged_prefill(q, kc, vc, tables, cq, seq_lens, mq, mk, _config=cfg, **kw)
    ref, ref_lse = paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk, **kw)
    _close(out, ref, dtype)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4 if dtype == torch.float32 else 2e-3,
                               rtol=1e-4)
    # the paged kernel must agree with the contiguous one on the same keys
    flat = flash_attn_varlen(q, k, v, cq, ck, mq, mk, causal=causal, window_size=window, _config=cfg,
                             softcap=softcap)
    _close(out, flat, dtype)
    if softcap is not None:  # the cap changes the result: the checks above could fail
        uncapped = paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk, causal=causal,
                                     window_size=window)[0]
        assert ((uncapped.float() - ref.float()).norm() / ref.float().norm()).item() > 0.05


# ----------------------------------------------------------------------------- CPU (interpreter)
# lengths: 1, non-multiples of the 32 x 16 tiles, and one longer than two query tiles
LENS = [1, 37, 16, 70]
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="interpreter grid; the GPU grid covers this")


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 13])
def test_softcap_cpu(dtype, window):
    """Gemma 2's attention logit softcap in every stage (window edge, unmasked, diagonal),
    paged and contiguous, a cached prefix ahead of the queries."""
    _check_varlen([45, 20, 1], [10, 2, 30], 4, 2, 64, dtype, window=window, softcap=0.5)
    _check_paged([45, 20, 1], [10, 2, 30], 4, 2, 64, dtype, 16, window=window, softcap=0.5)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (8, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_cpu(dtype, hq, hkv, causal):
    _check_varlen(LENS, [0, 5, 33, 0], hq, hkv, 64, dtype, causal=causal)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_dim_128_cpu(dtype):
    _check_varlen([19, 40], [3, 0], 4, 2, 128, dtype)


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_window_cpu(causal):
    _check_varlen([50, 7, 33], [20, 41, 0], 4, 2, 64, torch.float32, causal=causal, window=24)


@cpu_only
@pytest.mark.parametrize("cfg", [PrefillConfig(16, 32, 4, 1), PrefillConfig(64, 16, 4, 1),
                                 PrefillConfig(32, 16, 4, 1, m_fastest=False)])
def test_other_tiles_cpu(cfg):
    """BLOCK_N > BLOCK_M, a tall BLOCK_M whose diagonal spans four key tiles, and the
    heads-first grid order."""
    _check_varlen(LENS, [0, 9, 60, 3], 4, 2, 64, torch.float32, cfg=cfg)
    _check_varlen([45, 20], [10, 2], 4, 2, 64, torch.float32, window=13, cfg=cfg)


@cpu_only
def test_tma_descriptors_cpu():
    """The Hopper path (TMA tensor descriptors for Q, K, V; paged pages read as one box)."""
    cfg = PrefillConfig(32, 16, 4, 1, use_tma=True)
    _check_varlen(LENS, [0, 5, 33, 0], 4, 2, 64, torch.float16, cfg=cfg)
    _check_paged(LENS, [0, 21, 40, 3], 4, 2, 64, torch.float16, 32, cfg=cfg)
    _check_paged([30, 9], [45, 0], 4, 2, 64, torch.float16, 16, window=20, cfg=cfg)


@cpu_only
def test_more_queries_than_keys_cpu():
    """Causal with Lq > Lk: the first Lq - Lk queries see nothing -> 0 and lse -inf."""
    q, k, v, cq, _, mq, _ = _ragged([20, 9], [0, 0], 2, 1, 64, torch.float32)
    ck = _cu([12, 9])
    k, v = k[:21], v[:21]
    out, lse = flash_attn_varlen(q, k, v, cq, ck, mq, 12, return_lse=True)
    ref, ref_lse = flash_attn_varlen_ref(q, k, v, cq, ck, mq, 12, return_lse=True)
    assert (out[:8] == 0).all() and torch.isneginf(lse[:, :8]).all()
    _close(out, ref, torch.float32)
    torch.testing.assert_close(lse, ref_lse)


@cpu_only
def test_scale_and_out_cpu():
    q, k, v, cq, ck, mq, mk = _ragged([33, 5], [4, 0], 4, 4, 64, torch.float32)
    out = torch.empty_like(q)
    res = flash_attn_varlen(q, k, v, cq, ck, mq, mk, sm_scale=0.3, out=out)
    ref = flash_attn_varlen_ref(q, k, v, cq, ck, mq, mk, sm_scale=0.3)
    assert res is out
    _close(out, ref, torch.float32)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_cpu(dtype, block_size):
    _check_paged(LENS, [0, 21, 40, 3], 4, 2, 64, dtype, block_size)


@cpu_only
@pytest.mark.parametrize("block_size,cfg", [
    (1, PrefillConfig(32, 16, 4, 1)),     # a page per token: gather every row
    (8, PrefillConfig(32, 16, 4, 1)),     # tile spans two pages
    (64, PrefillConfig(16, 32, 4, 1)),    # tile inside one page
])
def test_paged_block_sizes_cpu(block_size, cfg):
    _check_paged([1, 30, 17], [50, 7, 0], 2, 1, 64, torch.float32, block_size, cfg=cfg)
    _check_paged([40], [25], 2, 1, 64, torch.float32, block_size, window=20, cfg=cfg)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("d,dv", [(192, 128), (24, 16), (40, 8)])
def test_separate_v_head_dim_cpu(dtype, d, dv):
    """MLA prefill: qk dim 192 (padded to a 256 tile) with v dim 128; the tiny test
    checkpoints' 24 / 16; and a v dim below tl.dot's 16. Prefixes, ragged ends, GQA."""
    _check_varlen([1, 37, 20], [0, 12, 33], 4, 2 if d != 192 else 1, d, dtype, dv=dv)


@cpu_only
def test_separate_v_head_dim_paged_and_window_cpu():
    _check_paged([30, 9], [21, 0], 2, 1, 192, torch.float32, 16, dv=128)
    _check_varlen([45, 20], [10, 2], 4, 2, 24, torch.float32, window=13, dv=16)


@pytest.mark.parametrize("d,dv", [(24, 16), (64, 64)])  # MLA-shaped (pointers), equal dims
def test_varlen_plan_serves_every_layer(d, dv):
    """A VarlenPlan made over one layer's q, k, v and out launches other layers' (new
    tensors, the same geometry) as flash_attn_varlen computes them; another geometry is
    refused. On the GPU in bf16 (TMA where the dims are equal), on the CPU in fp32."""
    from flashpage.kernels.flash_prefill import VarlenPlan

    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    q_lens, prefixes = [1, 37, 20], [0, 12, 33]
    layers = [_ragged(q_lens, prefixes, 4, 2, d, dtype, seed=s, dv=dv) for s in range(3)]
    q0, k0, v0, cq, ck, mq, mk = layers[0]
    out0 = q0.new_empty(*q0.shape[:2], dv)
    plan = VarlenPlan(q0, k0, v0, cq, ck, mq, mk, causal=True, sm_scale=0.3, out=out0)
    for _ in range(2):  # the second round: every launch bound
        for q, k, v, *_ in layers:
            out = q.new_full((*q.shape[:2], dv), float("nan"))
            plan.run(q, k, v, out)
            want = flash_attn_varlen(q, k, v, cq, ck, mq, mk, causal=True, sm_scale=0.3)
            assert torch.equal(out, want)
    with pytest.raises(ValueError, match="differ in shape"):
        plan.run(q0[:5], k0, v0, out0[:5])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 128)])  # MLA's dims (pointers), TMA
def test_varlen_plan_serves_every_layer_gpu(d, dv):
    test_varlen_plan_serves_every_layer(d, dv)


@cpu_only
def test_padded_head_dims_never_read_past_a_row():
    """The padding columns of a 192 row are the next head's first 64: if they were read
    (not masked), head 0 would see head 1's values. Poison head 1 and check head 0."""
    q, k, v, cq, ck, mq, mk = _ragged([20], [7], 2, 2, 192, torch.float32, dv=128)
    want = flash_attn_varlen_ref(q[:, :1], k[:, :1], v[:, :1], cq, ck, mq, mk)
    q[:, 1], k[:, 1], v[:, 1] = 1e30, float("nan"), float("nan")
    got = flash_attn_varlen(q, k, v, cq, ck, mq, mk)
    _close(got[:, :1].contiguous(), want, torch.float32)


# ----------------------------------------------------------------------------- sm_90 code (CPU)
# compiled as the GPU specializes the kernel: 16-byte aligned tensors and strides
_DIV16 = ("Q", "K", "V", "Out", "Lse", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
          "stride_vt", "stride_vh", "stride_ot", "stride_oh")
SM90_CASES = {  # name: (config, paged block size or 0)
    "default": (PrefillConfig(128, 128, 8, 3, use_tma=True), 0),
    "default_paged16": (PrefillConfig(128, 128, 8, 3, use_tma=True), 16),
    "64x64": (PrefillConfig(64, 64, 4, 3, use_tma=True), 0),
}


def _compile_sm90_candidates() -> dict:
    """(In a subprocess with the interpreter off.) The causal D=128 kernel of each
    SM90_CASES config (contiguous: TMA; paged by 16: slots gathered per key) compiled for
    sm_90, and ptxas -v's report on its PTX."""
    import triton
    from sm90 import compile_sm90

    from flashpage.kernels import flash_prefill as fp

    fn = fp._prefill_fwd
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    out = {}
    for name, (cfg, page) in SM90_CASES.items():
        consts = dict(HEAD_DIM=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, QK_DIM=128,
                      HEAD_DIM_V=128, V_DIM=128, CAUSAL=True, HAS_WINDOW=False,
                      KV_MODE=fp._KV_PAGED if page else fp._KV_CONTIG_TMA,
                      PAGE_SIZE=page or 1, RETURN_LSE=False, IEEE=False, WARP_SPEC=False,
                      M_FASTEST=True, SOFTCAP=False, ALIBI=False, SINKS=False, CHUNKED=False)
        types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Lse": "*fp32",
                 "cu_q": "*i32", "cu_k": "*i32", "seq_lens": "*i32", "block_tables": "*i32",
                 "qk_scale": "fp32", "softcap": "fp32", "Slopes": "*fp32", "Sinks": "*fp32"}
        for desc, rows in (("desc_q", cfg.block_m), ("desc_k", cfg.block_n),
                           ("desc_v", cfg.block_n)):
            if page:
                consts[desc] = None  # the pointer path
            else:
                types[desc] = f"tensordesc<bf16[{rows}, 128]>"
        k = compile_sm90(fn, consts, types, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         aligned=_DIV16)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.ptx").write_text(k.asm["ptx"])
            r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", "k.ptx", "-o", "k.cubin"],
                               cwd=tmp, capture_output=True, text=True, check=True)
        out[name] = dict(ptxas=r.stderr, shared=k.metadata.shared, warps=cfg.num_warps)
    return out


@cpu_only
def test_sm90_default_and_2cta_candidate_compile():
    """ptxas keeps the wgmmas asynchronous (no C7515: a plain move into the registers of an
    in-flight wgmma serializes all of them) and spills nothing, contiguous or paged (ptxas
    of triton 3.6, 2026-11-30: 191, 237 and 147 registers); the 64x64 tiles fit two CTAs
    per SM (shared memory and registers), which is what the candidate is for."""
    got = run_compiled("test_flash_prefill", "_compile_sm90_candidates")
    for name, k in got.items():
        report = k["ptxas"]
        assert "C7515" not in report and "serialized" not in report, f"{name}: {report}"
        assert "0 bytes spill stores" in report, f"{name}: {report}"
        k["regs"] = int(re.search(r"Used (\d+) registers", report).group(1))
    two = got["64x64"]
    assert 2 * (two["shared"] + 1024) <= 228 * 1024, two["shared"]  # 1 KB reserved per CTA
    assert 2 * two["regs"] * 32 * two["warps"] <= 65536, two["regs"]


# ----------------------------------------------------------------------------- validation


def test_rejects_bad_inputs():
    def z(*shape):
        return torch.zeros(*shape, device=DEV)

    q = z(10, 4, 64)
    k = z(10, 2, 64)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="int32"):
        flash_attn_varlen(q, k, k, cu.long(), cu, 10, 10)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        flash_attn_varlen(q, z(10, 3, 64), z(10, 3, 64), cu, cu, 10, 10)
    with pytest.raises(ValueError, match="head_dim"):
        flash_attn_varlen(z(10, 4, 320), z(10, 2, 320), z(10, 2, 320), cu, cu, 10, 10)
    with pytest.raises(ValueError, match="v head_dim"):
        flash_attn_varlen(q, k, z(10, 2, 512), cu, cu, 10, 10)
    with pytest.raises(ValueError, match="shapes differ"):
        flash_attn_varlen(q, k, z(10, 1, 64), cu, cu, 10, 10)
    with pytest.raises(ValueError, match="out must be"):
        flash_attn_varlen(q, k, z(10, 2, 32), cu, cu, 10, 10, out=z(10, 4, 64))
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attn_varlen(q, k.half(), k.half(), cu, cu, 10, 10)
    with pytest.raises(ValueError, match="contiguous"):
        flash_attn_varlen(q.transpose(0, 1).contiguous().transpose(0, 1), k, k, cu, cu, 10, 10)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_varlen(q, k, k, cu, cu, 10, 10, window_size=0)
    with pytest.raises(ValueError, match="out must be"):
        flash_attn_varlen(q, k, k, cu, cu, 10, 10, out=z(10, 4, 32))
    cache = z(4, 12, 2, 64)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEV)
    lens = torch.tensor([10], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="power of two"):
        paged_prefill(q, cache, cache, tables, cu, lens, 10, 10)
    cache = z(4, 4, 2, 64)
    with pytest.raises(ValueError, match="fewer than max_seqlen_k"):
        paged_prefill(q, cache, cache, tables, cu, lens, 10, 10)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_prefill(q, cache, cache, tables, cu, lens.long(), 10, 8)


# ----------------------------------------------------------------------------- GPU (bf16)
BF16 = torch.bfloat16
GQA = [(8, 8), (8, 2), (16, 2), (8, 1)]  # ratios 1, 4, 8, all heads on one


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu(d, hq, hkv, causal):
    _check_varlen([1, 300, 128, 1000, 77], [0, 0, 2000, 37, 3500], hq, hkv, d, BF16, causal=causal)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_window_gpu(d):
    _check_varlen([1, 700, 2048], [4000, 0, 333], 8, 2, d, BF16, window=512)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d,block_size", [(128, 16), (128, 32), (128, 64), (128, 128),
                                          (64, 16), (64, 128), (256, 16), (256, 128)])
def test_paged_gpu(d, block_size):
    _check_paged([1, 513, 64, 1000], [0, 3000, 2047, 129], 8, 2, d, BF16, block_size)


@gpu
@pytest.mark.gpu
def test_paged_window_gpu():
    _check_paged([1, 900], [5000, 100], 8, 1, 128, BF16, 16, window=1024)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_paged_softcap_gpu(d):
    """Gemma 2's softcap (the Gluon prefill steps aside for it), with and without a window."""
    _check_paged([1, 900], [5000, 100], 8, 2, d, BF16, 16, window=1024, softcap=0.5)
    _check_paged([1, 900], [5000, 100], 8, 2, d, BF16, 16, softcap=0.5)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("hq", [16, 128])
def test_mla_prefill_dims_gpu(hq):
    """DeepSeek-V2/V3 prefill: qk 192 (128 nope + 64 rope), v 128, one kv head per q head."""
    _check_varlen([1, 300, 128, 1000, 77], [0, 0, 2000, 37, 1500], hq, hq, 192, BF16, dv=128)
    _check_varlen([1, 300, 128, 1000, 77], [0, 0, 2000, 37, 1500], hq, hq, 192, torch.float32,
                  dv=128)



HOPPER = [(d, c) for d in (64, 128) for c in hopper_candidates(d)[1:]]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d,cfg", HOPPER, ids=[f"d{d}-{c.block_m}x{c.block_n}w{c.num_warps}"
                                               f"s{c.num_stages}" for d, c in HOPPER])
def test_hopper_candidates_gpu(d, cfg):
    """Every configuration the benchmark times beside the default, in bf16: causal and
    not, a window, paged caches of 16 and 128 tokens (TMA boxes per page) and an fp8
    cache."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("Hopper configurations (TMA)")
    q_lens, prefixes = [1, 300, 128, 1000, 77], [0, 0, 2000, 37, 3500]
    _check_varlen(q_lens, prefixes, 8, 2, d, BF16, cfg=cfg)
    _check_varlen(q_lens, prefixes, 8, 2, d, BF16, causal=False, cfg=cfg)
    _check_varlen([1, 700, 2048], [4000, 0, 333], 8, 2, d, BF16, window=512, cfg=cfg)
    for bs in (16, 128):
        _check_paged([1, 513, 64, 1000], [0, 3000, 2047, 129], 8, 2, d, BF16, bs, cfg=cfg)
    q, k, v, cq, ck, mq, mk = _ragged([1, 513, 1000], [0, 3000, 129], 8, 2, d, BF16, seed=3)
    kc, vc, tables, seq_lens = _to_paged(k, v, ck, 16)
    kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    out = paged_prefill(q, kc, vc, tables, cq, seq_lens, mq, mk, _config=cfg)
    _close(out, paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk), BF16)


@pytest.mark.gpu
@gpu
def test_paged_one_compile_for_every_slice_offset_gpu():
    """A mixed step passes seq_lens[nd:] and block_tables[nd:]: their 16-byte alignment
    follows the number of decodes nd, and each alignment used to compile the prefill
    kernel anew inside the first users' steps. One compile must serve every offset."""
    q_lens, prefixes = [5, 9, 3, 17, 6, 11], [0, 7, 0, 40, 2, 0]
    q, k, v, cq, ck, mq, mk = _ragged(q_lens, prefixes, 8, 2, 128, torch.bfloat16, seed=2)
    kc, vc, tables, seq_lens = _to_paged(k, v, ck, 16)
    assert_one_compile_for_every_slice_offset(q, kc, vc, tables, cq, seq_lens, mq, mk)


def assert_one_compile_for_every_slice_offset(q, kc, vc, tables, cq, seq_lens, mq, mk):
    """paged_prefill over seq_lens[nd:] / block_tables[nd:] views (nd = 0..3 int32 past a
    fresh, aligned allocation) compiles the kernel at most once (for the first call) and
    gives the same output at every offset (test_fp8_kv runs it over an fp8 cache)."""
    from flashpage.kernels.flash_prefill import _prefill_fwd

    cache = _prefill_fwd.device_caches[torch.cuda.current_device()][0]
    outs, sizes = [], []
    n = seq_lens.numel()
    for nd in range(4):
        lens_view = torch.empty(n + nd, dtype=torch.int32, device=q.device)[nd:]
        lens_view.copy_(seq_lens)
        tab_view = torch.empty(n + nd, tables.shape[1], dtype=torch.int32, device=q.device)[nd:]
        tab_view.copy_(tables)
        outs.append(paged_prefill(q, kc, vc, tab_view, cq, lens_view, mq, mk))
        sizes.append(len(cache))
    assert sizes[-1] == sizes[0], f"compiled again for another slice offset: {sizes}"
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
