"""Which dtypes a paged K/V cache (or MLA latent cache) may hold, checked by every kernel
that reads or writes one.

A cache holds either the activations' dtype (fp32, fp16, bf16: stored and read as they
are) or ``torch.float8_e4m3fn`` (``--kv-cache-dtype fp8``, scale 1.0, no calibration):

- writes round each value to e4m3 (round to nearest even; the GPU's conversion,
  ``cvt.rn.satfinite``, clamps magnitudes past 448 to 448);
- reads widen each value to the activations' dtype right after the load, before any
  arithmetic. That step is exact: every e4m3 value is an fp16 and a bf16 value.

Kernels tell the two apart by the cache tensor's dtype alone; no argument says which.
Decode kernels over an fp8 cache with a 16-bit q run their dots in fp16 whatever q's
16-bit type (``f16_dots``, ``f16_query``): sm_90 widens a pair of e4m3 values to fp16 in
one instruction and to bf16 in three, and that widening, once per cached value, is the
loop's main cost after the loads. q is scaled by the softmax scale first (in fp32), so
its fp16 rounding keeps 11 significant bits (bf16: 8) and only a scaled |q| past 65504
would overflow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_KV_DTYPE = torch.float8_e4m3fn
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_fp8(dtype: torch.dtype) -> bool:
    """Any one-byte float (e4m3fn, e5m2, the fnuz variants, e8m0)."""
    return dtype.is_floating_point and dtype.itemsize == 1


def _check_fp8(cache_dtype: torch.dtype, act_dtype: torch.dtype, act_name: str) -> None:
    if cache_dtype != FP8_KV_DTYPE:
        raise ValueError(f"KV cache dtype {cache_dtype} unsupported: an fp8 cache must be "
                         f"{FP8_KV_DTYPE}")
    if act_dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{act_name} dtype {act_dtype} unsupported with an fp8 KV cache "
                         "(float16, bfloat16, float32)")


def _check_cache_dtype(act_dtype: torch.dtype, cache_dtype: torch.dtype, act_name: str,
                       caches: str) -> None:
    """ValueError unless a cache dtype is ``act_dtype`` or float8_e4m3fn (with 16- or
    32-bit activations); ``caches`` names the cache(s) and their dtypes in the message."""
    if cache_dtype == act_dtype:
        return
    if is_fp8(cache_dtype):
        _check_fp8(cache_dtype, act_dtype, act_name)
        return
    raise ValueError(f"dtype mismatch: {act_name} {act_dtype}, {caches} "
                     f"(a cache holds {act_name}'s dtype or {FP8_KV_DTYPE})")


def check_kv_cache_dtype(act_dtype: torch.dtype, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         act_name: str = "q") -> None:
    """ValueError unless both caches hold ``act_dtype`` or both hold float8_e4m3fn (with
    16- or 32-bit activations)."""
    kd, vd = key_cache.dtype, value_cache.dtype
    if kd != vd:
        raise ValueError(f"dtype mismatch: key_cache {kd}, value_cache {vd}")
    _check_cache_dtype(act_dtype, kd, act_name, f"key_cache {kd}, value_cache {vd}")


def check_latent_cache_dtype(act_dtype: torch.dtype, kv_cache: torch.Tensor,
                             act_name: str = "q") -> None:
    """The MLA latent cache (one tensor): ValueError unless it holds ``act_dtype`` or
    float8_e4m3fn (with 16- or 32-bit activations)."""
    _check_cache_dtype(act_dtype, kv_cache.dtype, act_name, f"kv_cache {kv_cache.dtype}")


def f16_dots(act_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether a decode kernel's dots run in fp16: an fp8 cache under a 16-bit q."""
    return is_fp8(cache_dtype) and act_dtype in (torch.float16, torch.bfloat16)


@triton.jit
def f16_query(q, sm_scale_log2, F16_DOTS: tl.constexpr):
    """(q, the scale left to apply to q . k): with F16_DOTS, q * sm_scale_log2 rounded to
    fp16 once (from fp32) and 1.0; else q and sm_scale_log2 unchanged."""
    if F16_DOTS:
        q = (q.to(tl.float32) * sm_scale_log2).to(tl.float16)
        sm_scale_log2 = 1.0
    return q, sm_scale_log2
