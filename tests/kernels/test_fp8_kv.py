"""float8_e4m3fn K/V caches (kernels/kv_dtype.py) in the cache writes and the attention kernels.

Contract: a kernel infers an fp8 cache from its dtype. Writes round each value to e4m3;
reads widen it to the query's dtype before any arithmetic (exact). So:

- a write must equal torch's ``.to(torch.float8_e4m3fn)`` of what a 16-bit write stores,
  bit for bit (values within +-448; past that the GPU saturates to +-448);
- attention over an fp8 cache must match the reference run on *that same cache* within
  the tolerances of the 16-bit-cache tests (the references read fp8 values exactly);
- and against the same K/V in a 16-bit cache, it may differ by what e4m3 rounding does to
  the inputs, bounded below (FP8_REL_TOL).

CPU (Triton interpreter): fp32 and fp16 activations, small shapes; the fp8 variants are
also compiled for sm_90 (ptxas, no GPU). GPU (marked gpu): bf16 activations, decode
(with splits, GQA, a CUDA graph), prefill (with the Hopper configs, whose TMA path an fp8
cache must not take), the fused rotary write.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from sm90 import compile_sm90, run_compiled  # tests/kernels (on sys.path under pytest)

from flashpage.kernels import flash_prefill as fp_mod
from flashpage.kernels.cache_write import write_kv_cache, write_kv_cache_ref
from flashpage.kernels.flash_prefill import (
    PrefillConfig,
    flash_attn_varlen,
    paged_prefill,
    paged_prefill_ref,
)
from flashpage.kernels.kv_cache_write import KVWriteConfig, kv_write_name, write_kv_rows
from flashpage.kernels.paged_decode import (
    DecodeConfig,
    _launch,
    config_name,
    paged_decode,
    paged_decode_ref,
)
from flashpage.kernels.rotary import (
    compute_cos_sin_cache,
    rotary_and_cache_write,
    rotary_and_cache_write_ref,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(GPU, reason="interpreter cases; the GPU cases cover bf16")
FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.float16]

# ||out - ref|| / ||ref|| of a kernel against its reference on the same cache: the
# tolerances of test_paged_decode.py and test_flash_prefill.py (an fp8 cache's values reach
# the dots exactly, so the kernels' own rounding is all that is left).
DECODE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
PREFILL_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# fp8 cache against a 16-bit cache of the same K/V, exact math (both references, fp32):
# round to nearest with a 3-bit mantissa moves each element by at most 2^-4 of itself, about
# 2^-4 / sqrt(3) (0.036) rms relative to its binade for values spread over it. V's errors
# reach the output through a convex combination (||P dV|| / ||P V|| ~ rms relative error
# for independent errors); K's through the logits, q.dk * D^-0.5 having the same relative
# rms for unit-variance q, k, which perturbs each probability by that fraction. The two add
# in quadrature to ~0.03-0.05 on random data: 2^-4, the per-element worst case, bounds
# it, and the fp8 error must also exceed 2^-8 (else the cache did not hold e4m3 values).
FP8_REL_TOL = 2.0**-4
FP8_MIN_EFFECT = 2.0**-8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --------------------------------------------------------------------------- interpreter fix


def _torch_fp8_convert(original):
    """The interpreter's _convert_float, with every conversion to or from float8e4nv done
    by torch's casts (round to nearest even), everything else by the original."""
    import triton.language as tl
    from triton.runtime import interpreter

    torch_of = {tl.float32: torch.float32, tl.float16: torch.float16,
                tl.bfloat16: torch.bfloat16, tl.float8e4nv: FP8}
    rtne = interpreter._ir.ROUNDING_MODE.RTNE

    def convert(data, in_ty, out_ty, rounding_mode):
        if (tl.float8e4nv not in (in_ty, out_ty) or in_ty not in torch_of or out_ty not in torch_of
                or rounding_mode not in (None, rtne)):
            return original(data, in_ty, out_ty, rounding_mode)
        flat = np.ascontiguousarray(data).reshape(-1)
        x = torch.from_numpy(flat.view(np.uint8).copy()).view(torch_of[in_ty])
        y = x.to(torch_of[out_ty]).view(torch.uint8).numpy()
        return y.view(np.dtype(f"uint{out_ty.primitive_bitwidth}")).reshape(np.shape(data))

    return convert


@pytest.fixture(autouse=True, scope="module")
def exact_fp8_casts_in_the_interpreter():
    """Triton 3.6's interpreter converts fp32/fp16 to float8e4nv with its own bit
    arithmetic: it rounds half up from one guard bit (no sticky bit) and lets a mantissa
    carry collide with an odd exponent, so 1.97 becomes 1.0 (torch and the GPU's
    cvt.rn.satfinite: 2.0). Over randn values at five scales 9.9% of its codes differed
    from torch's cast, 1.8% of them by a factor of two. That tests Triton's interpreter,
    not our kernels: under the interpreter, fp8 conversions use torch's casts (the GPU
    tests check the hardware's conversion against torch's)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_convert_float", _torch_fp8_convert(interpreter._convert_float))
        yield


# --------------------------------------------------------------------------- inputs


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def fp8_nan_cache(shape) -> torch.Tensor:
    """An fp8 cache full of NaN (code 0x7f): a slot read by mistake poisons the output."""
    return torch.full(shape, float("nan"), device=DEVICE).to(FP8)


def special_values() -> torch.Tensor:
    """fp32 values on e4m3's edges, each exact in fp16 and bf16: ties between neighbours
    (round to even: 1.0625 -> 1.0, 1.1875 -> 1.25), subnormals and their ties
    (2^-10 -> 0, 3 * 2^-10 -> 2^-8), the largest finite 448 and the tie below it."""
    pos = [0.0, 1.0, 1.0625, 1.1875, 1.9375, 1.96875, 2.0**-9, 2.0**-10, 3 * 2.0**-10,
           5 * 2.0**-10, 2.0**-6, 15 * 2.0**-10, 432.0, 440.0, 448.0, 0.1, 3.3, 300.0]
    return torch.tensor(pos + [-x for x in pos], device=DEVICE)


def kv_inputs(n, hq, hkv, d, dtype, g):
    """q, k, v as strided views of one fused projection output; k and v spread over e4m3's
    range (random per-token scales 2^-12 .. 2^6, so subnormals and large values appear),
    the first token's heads holding special_values()."""
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=g, device=DEVICE)
    scale = torch.exp2(torch.randint(-12, 7, (n, 1), generator=g, device=DEVICE).float())
    qkv[:, hq * d:] = (qkv[:, hq * d:] * scale).clamp(-448, 448)
    sv = special_values()
    row = sv.repeat(-(-2 * hkv * d // sv.numel()))[: 2 * hkv * d]
    qkv[0, hq * d:] = row
    q, k, v = qkv.to(dtype).split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)


def random_slots(n, num_blocks, block_size, g, *, num_skipped):
    """Distinct slots; num_skipped tokens (never token 0, which holds the special values)
    set to -1."""
    slots = torch.randperm(num_blocks * block_size, generator=g, device=DEVICE)[:n]
    slots[torch.randperm(n - 1, generator=g, device=DEVICE)[:num_skipped] + 1] = -1
    return slots


def assert_fp8_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (NaN codes included)."""
    assert got.dtype == want.dtype == FP8
    diff = got.view(torch.uint8) != want.view(torch.uint8)
    if diff.any():
        i = diff.nonzero()[0].tolist()
        raise AssertionError(f"{int(diff.sum())} codes differ, first at {i}: "
                             f"{got[tuple(i)].float().item()} vs {want[tuple(i)].float().item()}")


# --------------------------------------------------------------------------- cache writes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,hkv,d", [(16, 2, 64), (32, 4, 128), (16, 2, 80)])
def test_write_kv_cache_fp8(dtype, block_size, hkv, d):
    g = gen(block_size + d)
    n, num_blocks = 29, 4
    _, k, v = kv_inputs(n, 4, hkv, d, dtype, g)
    key_cache = fp8_nan_cache((num_blocks, block_size, hkv, d))
    value_cache = fp8_nan_cache((num_blocks, block_size, hkv, d))
    slots = random_slots(n, num_blocks, block_size, g, num_skipped=5)
    kc_ref, vc_ref = key_cache.clone(), value_cache.clone()
    write_kv_cache(k, v, key_cache, value_cache, slots)
    write_kv_cache_ref(k, v, kc_ref, vc_ref, slots)  # torch's cast; untouched slots stay NaN
    assert_fp8_equal(key_cache, kc_ref)
    assert_fp8_equal(value_cache, vc_ref)
    written = key_cache.flatten(0, 1)[slots[slots >= 0]]
    assert not written.float().isnan().any()


@pytest.mark.parametrize("cfg", [KVWriteConfig(8, 4, True), KVWriteConfig(4, 4, False),
                                 KVWriteConfig(8, 4, True, streaming=True)], ids=kv_write_name)
def test_write_kv_rows_fp8(cfg):
    """The row kernel: flat rows out of a fused qkv, and a v whose heads are not adjacent."""
    dtype = DTYPES[-1]
    g = gen(cfg.block_t + 3 * cfg.split_kv)
    n, num_blocks, block_size, hkv, d = 21, 4, 16, 2, 64
    _, k, v = kv_inputs(n, 4, hkv, d, dtype, g)
    v_heads_apart = torch.cat([v, v], dim=-1)[..., :d]  # head stride 2 * d
    for vv in (v, v_heads_apart):
        key_cache = fp8_nan_cache((num_blocks, block_size, hkv, d))
        value_cache = fp8_nan_cache((num_blocks, block_size, hkv, d))
        slots = random_slots(n, num_blocks, block_size, g, num_skipped=3)
        kc_ref, vc_ref = key_cache.clone(), value_cache.clone()
        write_kv_rows(k, vv, key_cache, value_cache, slots, cfg)
        write_kv_cache_ref(k, vv, kc_ref, vc_ref, slots)
        assert_fp8_equal(key_cache, kc_ref)
        assert_fp8_equal(value_cache, vc_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox,d,rot_dim,block_size", [(True, 64, 64, 16), (False, 128, 64, 32),
                                                          (True, 80, 32, 16)])  # Phi-2's
def test_rotary_and_cache_write_fp8(dtype, is_neox, d, rot_dim, block_size):
    """q and k rotated as with a 16-bit cache; the cache holds torch's e4m3 cast of the
    rotated k (as rounded to k's dtype) and of v, and nothing else changes."""
    g = gen(5 + d)
    n, hq, hkv, num_blocks = 19, 4, 2, 3
    q, k, v = kv_inputs(n, hq, hkv, d, dtype, g)
    k.mul_(0.5)  # rotated pairs (|a|, |b| <= 448) stay within e4m3's range: <= 317
    positions = torch.randint(0, 1024, (n,), generator=g, device=DEVICE, dtype=torch.int32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, device=DEVICE).float() / rot_dim)
    cos_sin = compute_cos_sin_cache(inv_freq, 1024)
    key_cache = fp8_nan_cache((num_blocks, block_size, hkv, d))
    value_cache = fp8_nan_cache((num_blocks, block_size, hkv, d))
    slots = random_slots(n, num_blocks, block_size, g, num_skipped=4)
    refs = [t.clone() for t in (q, k, v, key_cache, value_cache)]
    before_k, before_v = key_cache.clone(), value_cache.clone()
    rotary_and_cache_write(positions, q, k, v, cos_sin, key_cache, value_cache, slots,
                           is_neox=is_neox)
    rotary_and_cache_write_ref(positions, *refs[:3], cos_sin, *refs[3:], slots, is_neox=is_neox)
    torch.testing.assert_close(q, refs[0])
    torch.testing.assert_close(k, refs[1])
    assert torch.equal(v, refs[2])
    # exactly what write_kv_cache_ref stores of the kernel's own rotated k
    write_kv_cache_ref(k, v, before_k, before_v, slots)
    assert_fp8_equal(key_cache, before_k)
    assert_fp8_equal(value_cache, before_v)


# --------------------------------------------------------------------------- attention inputs


def paged_pair(seq_lens, hkv, d, block_size, dtype, g, *, extra_blocks=2):
    """K/V of each sequence (randn, in dtype) at shuffled blocks, written by write_kv_cache
    into a 16-bit cache (dtype) and an fp8 cache through the same slots; every other slot
    NaN. -> (kc16, vc16, kc8, vc8, block_tables int32 [B, max_blocks + 1], seq_lens int32)."""
    nblk = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nblk) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g, device=DEVICE)
    tables = torch.full((len(seq_lens), max(nblk) + 1), num_blocks - 1, dtype=torch.int32,
                        device=DEVICE)  # the padded column: a never-written block
    slots, used = [], 0
    for b, n in enumerate(seq_lens):
        ids = perm[used:used + nblk[b]]
        used += nblk[b]
        tables[b, :nblk[b]] = ids.int()
        pos = torch.arange(n, device=DEVICE)
        slots.append(ids[pos // block_size] * block_size + pos % block_size)
    slots_t = torch.cat(slots)
    total = slots_t.numel()
    k = torch.randn(total, hkv, d, generator=g, device=DEVICE).to(dtype)
    v = torch.randn(total, hkv, d, generator=g, device=DEVICE).to(dtype)
    shape = (num_blocks, block_size, hkv, d)
    kc16 = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    vc16 = torch.full_like(kc16, float("nan"))
    kc8, vc8 = fp8_nan_cache(shape), fp8_nan_cache(shape)
    write_kv_cache(k, v, kc16, vc16, slots_t)
    write_kv_cache(k, v, kc8, vc8, slots_t)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return kc16, vc16, kc8, vc8, tables, lens


def check_fp8_attention(out8, ref8, out16, ref16, tol):
    """out8 vs the reference on the same fp8 cache (tol); the fp8 effect on exact math within
    FP8_REL_TOL and above FP8_MIN_EFFECT; the two kernels within the triangle inequality's
    sum of the three."""
    assert not out8.float().isnan().any(), "NaN: a slot past a context was read"
    e_kernel = rel_err(out8, ref8)
    e_fp8 = rel_err(ref8, ref16)
    e_pair = rel_err(out8, out16)
    assert e_kernel < tol, f"fp8 kernel vs its reference: {e_kernel:.2e} >= {tol:.0e}"
    assert FP8_MIN_EFFECT < e_fp8 < FP8_REL_TOL, f"fp8 vs 16-bit cache, references: {e_fp8:.2e}"
    assert e_pair < FP8_REL_TOL + 2 * tol, f"fp8 vs 16-bit cache, kernels: {e_pair:.2e}"


# --------------------------------------------------------------------------- paged decode

# (seq_lens, q heads, kv heads, head_dim, block_size, num_splits, window, config)
DECODE_CASES = [
    ([1, 17, 40], 4, 4, 64, 16, 1, None, None),  # MHA, one split, a context of 1
    ([33, 64, 5], 8, 2, 64, 16, None, None, None),  # GQA 4, splits chosen (8 "SMs")
    ([100, 9], 8, 1, 64, 32, 3, None, None),  # all heads on one KV head, 3 splits
    ([70, 20], 8, 2, 64, 16, 2, 24, None),  # sliding window, 2 splits
    ([50, 20], 8, 4, 64, 16, 2, None, DecodeConfig(32, 4, 3, heads_per_program=2)),
    ([45, 3], 4, 2, 64, 16, 1, None, DecodeConfig(32, 4, 1, prefetch=True)),
    ([45, 70, 3], 8, 2, 64, 16, 2, None, DecodeConfig(32, 4, 3, prefetch_v=True)),
    # head dims padded to a 128 tile (Phi-2's 80, NeoX-20B's 96): splits, the warp-split loop
    ([33, 100, 5], 8, 2, 80, 16, 3, None, None),
    ([1, 70, 130], 8, 2, 96, 16, 1, None, DecodeConfig(64, 4, 3, warp_split=True)),
]


def _decode_id(case):
    lens, hq, hkv, d, bs, splits, window, cfg = case
    return f"{hq}x{hkv}-d{d}-bs{bs}-s{splits}-w{window}-{cfg and config_name(cfg)}"


def run_decode_case(case, dtype, seed=0, softcap=None, alibi_slopes=None):
    lens, hq, hkv, d, bs, splits, window, cfg = case
    g = gen(seed + sum(lens))
    kc16, vc16, kc8, vc8, tables, seq_lens = paged_pair(lens, hkv, d, bs, dtype, g)
    q = torch.randn(len(lens), hq, d, generator=g, device=DEVICE).to(dtype)
    kw = dict(sm_scale=None, window_size=window, num_splits=splits, config=cfg, softcap=softcap,
              alibi_slopes=alibi_slopes)
    out8 = _launch(q, kc8, vc8, tables, seq_lens, out=torch.full_like(q, float("nan")), **kw)
    out16 = _launch(q, kc16, vc16, tables, seq_lens, out=None, **kw)
    ref8 = paged_decode_ref(q, kc8, vc8, tables, seq_lens, window_size=window, softcap=softcap,
                            alibi_slopes=alibi_slopes)
    ref16 = paged_decode_ref(q, kc16, vc16, tables, seq_lens, window_size=window, softcap=softcap,
                             alibi_slopes=alibi_slopes)
    assert out8.dtype == dtype
    check_fp8_attention(out8, ref8, out16, ref16, DECODE_TOL[dtype])


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=_decode_id)
def test_paged_decode_fp8(case, dtype):
    run_decode_case(case, dtype)


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_fp8_softcap(dtype):
    """Gemma 2's softcap over an fp8 cache: under a 16-bit q the dots take a pre-scaled q
    (F16_DOTS), and the cap applies to the same base-2 scores."""
    run_decode_case(([70, 20], 8, 2, 64, 16, 2, 24, None), dtype, softcap=0.5)


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_fp8_alibi(dtype):
    """ALiBi over an fp8 cache: the biases join the pre-scaled fp16 dots' base-2 scores
    (F16_DOTS) in fp32, with splits."""
    from flashpage.layers.alibi import bloom_slopes

    run_decode_case(([70, 20], 8, 2, 64, 16, 2, None, None), dtype,
                    alibi_slopes=bloom_slopes(8).to(DEVICE))


# --------------------------------------------------------------------------- paged prefill


def _cu(lens) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device=DEVICE)


def run_prefill_case(q_lens, prefixes, hq, hkv, d, block_size, dtype, *, window=None, cfg=None,
                     seed=0, softcap=None, alibi_slopes=None):
    g = gen(seed + sum(q_lens))
    seq = [lq + p for lq, p in zip(q_lens, prefixes, strict=True)]
    kc16, vc16, kc8, vc8, tables, seq_lens = paged_pair(seq, hkv, d, block_size, dtype, g)
    q = torch.randn(sum(q_lens), hq, d, generator=g, device=DEVICE).to(dtype)
    cq, mq, mk = _cu(q_lens), max(q_lens), max(seq)
    kw = dict(window_size=window, return_lse=True, softcap=softcap, alibi_slopes=alibi_slopes)
    out = torch.full_like(q, float("nan"))  # every row must be written
    out8, lse8 = paged_prefill(q, kc8, vc8, tables, cq, seq_lens, mq, mk, out=out, _config=cfg, **kw)
    out16, _ = paged_prefill(q, kc16, vc16, tables, cq, seq_lens, mq, mk, _config=cfg, **kw)
    ref8, ref_lse8 = paged_prefill_ref(q, kc8, vc8, tables, cq, seq_lens, mq, mk, **kw)
    ref16, _ = paged_prefill_ref(q, kc16, vc16, tables, cq, seq_lens, mq, mk, **kw)
    assert out8 is out and out8.dtype == dtype
    check_fp8_attention(out8, ref8, out16, ref16, PREFILL_TOL[dtype])
    torch.testing.assert_close(lse8, ref_lse8, atol=1e-4 if dtype == torch.float32 else 2e-3,
                               rtol=1e-4)


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,block_size", [(4, 2, 16), (4, 1, 32)])
def test_paged_prefill_fp8(dtype, hq, hkv, block_size):
    """Ragged new tokens over cached prefixes (none, shorter and longer than a block)."""
    run_prefill_case([1, 37, 16, 40], [0, 21, 40, 3], hq, hkv, 64, block_size, dtype)


@cpu_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_prefill_fp8_padded_head_dim(dtype):
    """Phi-2's head_dim 80 (a 128-wide tile, columns past 80 masked) over an fp8 cache."""
    run_prefill_case([1, 37, 16], [0, 21, 40], 4, 2, 80, 16, dtype)


@cpu_only
def test_paged_prefill_fp8_window():
    run_prefill_case([30, 9], [45, 0], 4, 2, 64, 16, torch.float16, window=20)
    run_prefill_case([30, 9], [45, 0], 4, 2, 64, 16, torch.float16, window=20, softcap=0.5)


@cpu_only
def test_paged_prefill_fp8_alibi():
    from flashpage.layers.alibi import bloom_slopes

    run_prefill_case([30, 9], [45, 0], 4, 2, 64, 16, torch.float16,
                     alibi_slopes=bloom_slopes(4).to(DEVICE))


@cpu_only
def test_fp8_cache_never_takes_the_tma_path(monkeypatch):
    """With a TMA config (the Hopper defaults), an fp8 cache runs the pointer path: no
    descriptor is built. The same config over a 16-bit cache does build them (so the probe
    would see a TMA launch)."""
    built = []
    real = fp_mod._desc
    monkeypatch.setattr(fp_mod, "_desc", lambda t, *a: built.append(t.dtype) or real(t, *a))
    cfg = PrefillConfig(32, 16, 4, 1, use_tma=True)
    run_prefill_case([30, 9], [21, 0], 4, 2, 64, 32, torch.float16, cfg=cfg)
    assert built and FP8 not in built  # the 16-bit run took TMA, the fp8 run did not


# --------------------------------------------------------------------------- validation


def test_rejects_other_cache_dtypes():
    q = torch.zeros(2, 4, 64, device=DEVICE)
    cache8 = torch.zeros(3, 16, 2, 64, device=DEVICE).to(FP8)
    e5m2 = cache8.to(torch.float8_e5m2)
    half = torch.zeros(3, 16, 2, 64, device=DEVICE, dtype=torch.float16)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    kv = torch.zeros(2, 2, 64, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    cos_sin = compute_cos_sin_cache(torch.ones(32, device=DEVICE), 4)
    calls = {
        "paged_decode": lambda kc, vc: paged_decode(q, kc, vc, tables, lens),
        "paged_prefill": lambda kc, vc: paged_prefill(q, kc, vc, tables, cu, lens, 1, 1),
        "write_kv_cache": lambda kc, vc: write_kv_cache(kv, kv, kc, vc, slots),
        "rotary_and_cache_write": lambda kc, vc: rotary_and_cache_write(
            lens.long(), q.clone(), kv.clone(), kv, cos_sin, kc, vc, slots),
    }
    for call in calls.values():
        with pytest.raises(ValueError, match="float8_e5m2"):
            call(e5m2, e5m2)
        with pytest.raises(ValueError, match="dtype mismatch"):  # K fp8, V 16-bit
            call(cache8, half)
        with pytest.raises(ValueError, match="dtype mismatch"):  # 16-bit, not the activations'
            call(half, half)
        call(cache8, cache8.clone())  # accepted
    # contiguous K/V (flash_attn_varlen) is not a cache: it stays in q's dtype
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attn_varlen(q, kv.to(FP8), kv.to(FP8), cu, cu, 1, 1)


# --------------------------------------------------------------------------- sm_90 compile (CPU)


def _compile_fp8_ptx() -> dict[str, str]:
    """The fp8 variants of every kernel touched, compiled for sm_90 with bf16 activations and
    fp8 caches: name -> PTX (Triton ships ptxas; the interpreter off, in a subprocess)."""
    from flashpage.kernels import cache_write as cw
    from flashpage.kernels import kv_cache_write as kvw
    from flashpage.kernels import paged_decode as pd
    from flashpage.kernels import paged_decode_rows as rows
    from flashpage.kernels import rotary as rot

    fp8 = {"key_cache_ptr", "value_cache_ptr", "dst_ptr", "K", "V"}
    decode_fp8 = {"k_ptr", "v_ptr"}
    ptr = {"positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32",
           "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "counter_ptr": "*i32",
           "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "cu_q": "*i32", "cu_k": "*i32",
           "seq_lens": "*i32", "block_tables": "*i32", "Lse": "*fp32"}
    decode = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_N=64,
                  HAS_WINDOW=False, IEEE=False, HEADS_FASTEST=False, FUSED_MERGE=False,
                  GROUP_PAD=4, MERGE_CHUNK=1, PDL=False, F16_DOTS=True, WARP_SPLIT=False, SOFTCAP=False,
                  ALIBI=False, SINKS=False, CHUNKED=False)
    kernels = {
        "write_kv": (cw._write_kv_kernel, dict(PAGE=16, NUM_HEADS=8, HEAD_DIM=128, BLOCK_T=4,
                                                BLOCK_E=1024), set(), 8, 3),
        "write_kv_rows": (kvw._write_kv_rows_kernel, dict(
            PAGE=16, NUM_HEADS=8, HEAD_DIM=128, ROW_PAD=1024, BLOCK_T=8, SPLIT_KV=True, FLAT=True,
            STREAM=False), set(), 4, 3),
        "rotary_write": (rot._rotary_kernel, dict(
            WRITE_CACHE=True, IS_NEOX=True, PAGE=16, HALF=64, HALF_PAD=64, HEAD_DIM=128,
            BLOCK_D=128, REST_PAD=1, BLOCK_HQ=32, BLOCK_HK=8, PDL=False), set(), 4, 3),
        "paged_decode": (pd._paged_decode_kernel, {**decode, "SPLIT": False, "PREFETCH": False,
                                                   "PREFETCH_V": False}, decode_fp8, 4, 5),
        "paged_decode_split_prefetch": (pd._paged_decode_kernel, {
            **decode, "SPLIT": True, "PREFETCH": True, "PREFETCH_V": False}, decode_fp8, 4, 1),
        "paged_decode_prefetch_v": (pd._paged_decode_kernel, {
            **decode, "SPLIT": False, "PREFETCH": False, "PREFETCH_V": True}, decode_fp8, 4, 3),
        # Gemma 2's softcap, as the engine launches it (split, window)
        "paged_decode_softcap": (pd._paged_decode_kernel, {
            **decode, "SPLIT": True, "PREFETCH": False, "PREFETCH_V": False, "HAS_WINDOW": True,
            "SOFTCAP": True}, decode_fp8, 4, 3),
        "paged_decode_rows": (rows._paged_decode_rows_kernel, dict(
            GROUP=4, HPB=2, ROWS_PAD=16, HEAD_DIM=128, WIDTH=256, PAGE=16, BLOCK_N=32,
            SPLIT=True, HAS_WINDOW=False, IEEE=False, PDL=False, F16_DOTS=True), decode_fp8, 4, 3),
        "paged_prefill": (fp_mod._prefill_fwd, dict(
            HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, QK_DIM=128, HEAD_DIM_V=128, V_DIM=128,
            CAUSAL=True, HAS_WINDOW=False, KV_MODE=fp_mod._KV_PAGED, PAGE_SIZE=16,
            RETURN_LSE=False, IEEE=False, WARP_SPEC=False, M_FASTEST=True, SOFTCAP=False,
            ALIBI=False, SINKS=False, CHUNKED=False), set(), 8, 3),
        "paged_prefill_softcap": (fp_mod._prefill_fwd, dict(
            HEAD_DIM=128, BLOCK_M=128, BLOCK_N=128, QK_DIM=128, HEAD_DIM_V=128, V_DIM=128,
            CAUSAL=True, HAS_WINDOW=True, KV_MODE=fp_mod._KV_PAGED, PAGE_SIZE=16,
            RETURN_LSE=False, IEEE=False, WARP_SPEC=False, M_FASTEST=True, SOFTCAP=True,
            ALIBI=False, SINKS=False, CHUNKED=False), set(), 8, 3),
    }
    out = {}
    for name, (fn, consts, extra_fp8, warps, stages) in kernels.items():
        # the prefill's TMA descriptors: None, the pointer path
        consts = {**consts, **{a: None for a in ("desc_q", "desc_k", "desc_v") if a in fn.arg_names}}
        types = {**ptr, "Q": "*bf16", "Out": "*bf16", "sm_scale_log2": "fp32", "qk_scale": "fp32",
                 "softcap": "fp32", "Slopes": "*fp32", "Sinks": "*fp32", "alibi_ptr": "*fp32", "sinks_ptr": "*fp32",
                 **{a: "*fp8e4nv" for a in fp8 | extra_fp8}}
        k = compile_sm90(fn, consts, types, num_warps=warps, num_stages=stages)
        out[name] = k.asm["ptx"]
    return out


@cpu_only
def test_fp8_kernels_compile_for_sm90():
    """The writes convert with cvt.rn.satfinite (round to nearest even, saturating at 448:
    torch's rounding for values within +-448); the readers widen e4m3 in registers, and the
    decode kernels (bf16 q) widen it to fp16 in one step and run fp16 dots, never widening
    through fp16 to bf16 (three conversions per pair: slower than a bf16 cache)."""
    ptx = run_compiled("test_fp8_kv", "_compile_fp8_ptx")
    assert len(ptx) == 10
    for name in ("write_kv", "write_kv_rows", "rotary_write"):
        assert "cvt.rn.satfinite.e4m3x2" in ptx[name], name
    for name, text in ptx.items():
        if name.startswith("paged"):
            assert "e4m3x2" in text, f"{name}: no e4m3 conversion"
            assert "satfinite" not in text, f"{name}: converts to fp8"
        if name.startswith("paged_decode"):
            assert "cvt.bf16.f16" not in text, f"{name}: widens fp8 to bf16"
            assert ".f16.f16.f32" in text and ".bf16.bf16.f32" not in text, f"{name}: bf16 dots"
    # V widened in registers reaches the dot through ldmatrix, not byte by byte
    assert "ld.shared.b8" in ptx["paged_decode"] and "ld.shared.b8" not in ptx["paged_decode_prefetch_v"]


# --------------------------------------------------------------------------- GPU, bf16


@pytest.mark.gpu
@gpu_only
def test_write_kv_cache_fp8_gpu_saturates():
    """Past +-448 (infinities included) the GPU's conversion (cvt.rn.satfinite) saturates
    (torch's CUDA cast may give NaN there: not the contract); NaN stays NaN; 400, the tie
    between 384 and 416, rounds to the even 384."""
    k = torch.tensor([460.0, -500.0, 1e4, -float("inf"), float("nan"), 400.0], device=DEVICE)
    k = k.to(torch.bfloat16).view(6, 1, 1).expand(6, 1, 16).contiguous()
    cache = fp8_nan_cache((1, 8, 1, 16))
    vcache = cache.clone()
    write_kv_cache(k, k, cache, vcache, torch.arange(6, device=DEVICE))
    got = cache[0, :6, 0, 0].float().tolist()
    assert got[:4] == [448.0, -448.0, 448.0, -448.0] and math.isnan(got[4]) and got[5] == 384.0


GPU_DECODE_CASES = [
    ([1, 900, 4000, 77], 32, 8, 128, 16, None, None, None),  # Llama-3-8B heads, default config
    ([3000, 17], 32, 8, 128, 16, 1, None, None),
    ([2048], 32, 8, 128, 16, None, None, None),  # one sequence: split across the GPU
    ([500, 1200, 33], 32, 4, 64, 64, None, None, None),
    ([700, 64], 16, 16, 256, 32, None, None, None),
    ([1000, 300], 32, 1, 128, 256, 4, 256, None),
    ([1500, 40], 32, 8, 128, 16, None, None, DecodeConfig(64, 4, 3, heads_fastest=True)),
    ([1500, 40], 32, 8, 128, 16, 4, None, DecodeConfig(64, 4, 1, prefetch=True)),
    ([1500, 40], 32, 8, 128, 16, 4, None, DecodeConfig(64, 4, 5, heads_per_program=2)),
    ([1500, 40], 32, 8, 128, 16, 4, None,
     DecodeConfig(64, 4, 3, programs_per_sm=2, fused_merge=True)),
    ([1500, 40, 3000], 32, 8, 128, 16, None, None, DecodeConfig(128, 4, 3, prefetch_v=True)),
    ([1500, 40], 32, 8, 128, 16, 4, 700, DecodeConfig(64, 4, 5, prefetch_v=True)),
    # --tiles candidates of session 5: register caps (ptxas spills a little), 64-key tiles
    ([1500, 40, 3000], 32, 8, 128, 16, None, None, DecodeConfig(128, 4, 3, programs_per_sm=3, max_regs=168)),
    ([1500, 40], 32, 8, 128, 16, 4, None,
     DecodeConfig(128, 4, 3, programs_per_sm=3, prefetch_v=True, max_regs=168)),
    ([1500, 40, 3000], 32, 8, 128, 16, None, None, DecodeConfig(64, 4, 3, programs_per_sm=4)),
    # session 7: each warp its own 16-key piece and softmax state
    ([1500, 40, 3000, 1], 32, 8, 128, 16, None, None, DecodeConfig(64, 4, 3, programs_per_sm=3, warp_split=True)),
    ([1500, 40], 32, 8, 128, 64, 4, None, DecodeConfig(32, 2, 3, programs_per_sm=6, warp_split=True)),
    ([1500, 40, 3000, 1], 32, 8, 128, 16, None, None,
     DecodeConfig(64, 4, 3, programs_per_sm=4, warp_split=True, max_regs=128)),
]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", GPU_DECODE_CASES, ids=_decode_id)
def test_paged_decode_fp8_gpu(case):
    run_decode_case(case, torch.bfloat16)


@pytest.mark.gpu
@gpu_only
def test_paged_decode_fp8_default_takes_gluon_on_hopper(monkeypatch):
    """At 40 sequences x 8 KV heads (unsplit) the default path hands an fp8 decode to the
    Gluon kernel on sm_90 and matches the reference and the Triton loop
    (FLASHPAGE_DECODE_GLUON=0); elsewhere it never calls it."""
    from flashpage.kernels import paged_decode_gluon as pg

    calls = []
    real = pg.paged_decode_gluon
    monkeypatch.setattr(pg, "paged_decode_gluon", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = gen(11)
    lens_list = [2000, 1, 17, 64, 65, 700, 1023, 300] * 5
    _, _, kc, vc, tables, lens = paged_pair(lens_list, 8, 128, 16, torch.bfloat16, g)
    q = torch.randn(len(lens_list), 32, 128, generator=g, device=DEVICE).bfloat16()
    ref = paged_decode_ref(q, kc, vc, tables, lens)
    out = paged_decode(q, kc, vc, tables, lens)
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert len(calls) == (1 if hopper else 0)
    assert rel_err(out, ref) < DECODE_TOL[torch.bfloat16]
    monkeypatch.setenv("FLASHPAGE_DECODE_GLUON", "0")
    triton_out = paged_decode(q, kc, vc, tables, lens)
    assert len(calls) == (1 if hopper else 0)
    assert rel_err(out, triton_out) < DECODE_TOL[torch.bfloat16]


@pytest.mark.gpu
@gpu_only
def test_paged_decode_fp8_cuda_graph():
    """Captured over an fp8 cache (split, merge kernel), replayed with new queries and lengths."""
    g = gen(3)
    _, _, kc, vc, tables, lens = paged_pair([900, 20, 2000], 8, 128, 16, torch.bfloat16, g)
    q = torch.randn(3, 32, 128, generator=g, device=DEVICE).bfloat16()
    out = torch.empty_like(q)
    kw = dict(sm_scale=None, window_size=None, out=out, num_splits=None,
              config=DecodeConfig(64, 4, 3, programs_per_sm=2))
    _launch(q, kc, vc, tables, lens, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(q, kc, vc, tables, lens, **kw)
    for new_lens in ([850, 20, 1500], [1, 19, 64], [899, 1, 1999]):
        q.copy_(torch.randn(q.shape, generator=g, device=DEVICE))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_decode_ref(q, kc, vc, tables, lens)
        assert not out.isnan().any()
        assert rel_err(out, ref) < DECODE_TOL[torch.bfloat16]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("d,block_size", [(128, 16), (128, 128), (64, 64), (256, 32)])
def test_paged_prefill_fp8_gpu(d, block_size):
    """The GPU's default configs (TMA on Hopper for 16-bit caches with block_size 128)."""
    run_prefill_case([1, 300, 77, 1024], [0, 517, 2000, 5], 32, 8, d, block_size, torch.bfloat16)


@pytest.mark.gpu
@gpu_only
def test_paged_prefill_fp8_window_gpu():
    run_prefill_case([200, 64], [900, 0], 16, 4, 128, 16, torch.bfloat16, window=256)


@pytest.mark.gpu
@gpu_only
def test_paged_prefill_fp8_one_compile_for_every_slice_offset_gpu():
    """As test_flash_prefill's check, over an fp8 cache: one new specialization, then
    seq_lens[nd:] / block_tables[nd:] at any alignment compile nothing more."""
    from test_flash_prefill import assert_one_compile_for_every_slice_offset

    q_lens, prefixes = [5, 9, 3, 17, 6, 11], [0, 7, 0, 40, 2, 0]
    g = gen(2)
    seq = [a + b for a, b in zip(q_lens, prefixes, strict=True)]
    _, _, kc, vc, tables, seq_lens = paged_pair(seq, 2, 128, 16, torch.bfloat16, g)
    q = torch.randn(sum(q_lens), 8, 128, generator=g, device=DEVICE).bfloat16()
    cq, mq, mk = _cu(q_lens), max(q_lens), max(seq)
    assert_one_compile_for_every_slice_offset(q, kc, vc, tables, cq, seq_lens, mq, mk)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("is_neox,d,rot_dim,block_size", [(True, 128, 128, 16), (False, 64, 32, 64)])
def test_rotary_and_cache_write_fp8_gpu(is_neox, d, rot_dim, block_size):
    test_rotary_and_cache_write_fp8(torch.bfloat16, is_neox, d, rot_dim, block_size)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("block_size,hkv,d", [(16, 8, 128), (256, 1, 128), (32, 4, 256)])
def test_write_kv_cache_fp8_gpu(block_size, hkv, d):
    test_write_kv_cache_fp8(torch.bfloat16, block_size, hkv, d)


@pytest.mark.gpu
@gpu_only
def test_decode_step_fp8_vs_bf16_cache_gpu():
    """One decode step as the engine runs it (rotary + cache write of the new token, then
    paged decode) over an fp8 and a bf16 cache holding the same context: within
    FP8_REL_TOL plus both kernels' tolerance of each other."""
    g = gen(11)
    kc16, vc16, kc8, vc8, tables, lens = paged_pair([301, 2, 4097, 1501], 8, 128, 16,
                                                     torch.bfloat16, g)
    pos = lens.long() - 1  # the new token: the last position of each context
    slots = tables.gather(1, (pos // 16)[:, None]).squeeze(1).long() * 16 + pos % 16
    q = torch.randn(4, 32, 128, generator=g, device=DEVICE).bfloat16()
    k = torch.randn(4, 8, 128, generator=g, device=DEVICE).bfloat16()
    v = torch.randn(4, 8, 128, generator=g, device=DEVICE).bfloat16()
    inv = 1.0 / 500000 ** (torch.arange(0, 128, 2, device=DEVICE).float() / 128)
    cos_sin = compute_cos_sin_cache(inv, 8192)
    outs = []
    for kc, vc in ((kc16, vc16), (kc8, vc8)):
        qq, kk = q.clone(), k.clone()
        rotary_and_cache_write(pos, qq, kk, v, cos_sin, kc, vc, slots)
        outs.append((paged_decode(qq, kc, vc, tables, lens), paged_decode_ref(qq, kc, vc, tables, lens)))
    (out16, ref16), (out8, ref8) = outs
    check_fp8_attention(out8, ref8, out16, ref16, DECODE_TOL[torch.bfloat16])
