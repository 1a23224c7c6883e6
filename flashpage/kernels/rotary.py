"""Rotary position embedding, in place on q and k, optionally fused with the K/V cache write.

cos_sin_cache [max_pos, rot_dim] fp32: cos(pos * inv_freq) in the first rot_dim/2
columns, sin in the second. The first rot_dim dims of each head are rotated
(rot_dim == head_dim normally; DeepSeek and partial-rotary models use fewer).

Layouts, with i in [0, rot_dim/2)::

    neox (HF Llama):            pairs (x[i], x[i + rot_dim/2])
    interleaved (GPT-J, DS):    pairs (x[2i], x[2i + 1])
    (a, b) -> (a cos - b sin, b cos + a sin), with cos, sin at column i

Math in fp32, rounded once to the tensor's dtype. Scaling schemes (Llama 3.1, YaRN)
live in inv_freq and mscale, so the kernels never see them. With a float8_e4m3fn cache
(kv_dtype.py), the rotated k (already rounded to k's dtype, as in k itself) and v are
rounded again to e4m3 as they are stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.cache_write import _check_kv, write_kv_cache_ref
from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, num_heads, cos, sin,
    cache_ptr, stride_ch,
    WRITE_CACHE: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, REST_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate the first 2*HALF dims of heads [0, num_heads) at x_ptr (one token) in place;
    with WRITE_CACHE, also store each whole rotated head at cache_ptr."""
    offs_j = tl.arange(0, HALF_PAD)
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < num_heads
        rows = offs_h[:, None] * stride_h
        crows = offs_h[:, None] * stride_ch
        if IS_NEOX:
            mask = h_mask[:, None] & (offs_j < HALF)[None, :]
            x1 = tl.load(x_ptr + rows + offs_j[None, :], mask=mask).to(tl.float32)
            x2 = tl.load(x_ptr + rows + HALF + offs_j[None, :], mask=mask).to(tl.float32)
            o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty)
            o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + rows + offs_j[None, :], o1, mask=mask)
            tl.store(x_ptr + rows + HALF + offs_j[None, :], o2, mask=mask)
            if WRITE_CACHE:
                c_ty = cache_ptr.dtype.element_ty
                tl.store(cache_ptr + crows + offs_j[None, :], o1.to(c_ty), mask=mask)
                tl.store(cache_ptr + crows + HALF + offs_j[None, :], o2.to(c_ty), mask=mask)
        else:
            # Load each head's rotated part contiguously and pair neighbours in registers.
            offs_e = tl.arange(0, 2 * HALF_PAD)
            mask = h_mask[:, None] & (offs_e < 2 * HALF)[None, :]
            x = tl.load(x_ptr + rows + offs_e[None, :], mask=mask).to(tl.float32)
            xe, xo = tl.split(tl.reshape(x, [BLOCK_H, HALF_PAD, 2]))
            oe = xe * cos[None, :] - xo * sin[None, :]
            oo = xo * cos[None, :] + xe * sin[None, :]
            o = tl.reshape(tl.join(oe, oo), [BLOCK_H, 2 * HALF_PAD]).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + rows + offs_e[None, :], o, mask=mask)
            if WRITE_CACHE:
                tl.store(cache_ptr + crows + offs_e[None, :], o.to(cache_ptr.dtype.element_ty), mask=mask)
        if WRITE_CACHE and 2 * HALF < HEAD_DIM:  # the dims past rot_dim go to the cache as they are
            offs_r = 2 * HALF + tl.arange(0, REST_PAD)
            rmask = h_mask[:, None] & (offs_r < HEAD_DIM)[None, :]
            rest = tl.load(x_ptr + rows + offs_r[None, :], mask=rmask)
            tl.store(cache_ptr + crows + offs_r[None, :], rest.to(cache_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_q_heads, num_kv_heads,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cs,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    WRITE_CACHE: tl.constexpr,
    IS_NEOX: tl.constexpr,
    PAGE: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, REST_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    # Positions, the slot mapping (step inputs, written before the step's first kernel)
    # and the cos/sin table are requested before the wait: only q, k, v come from the
    # kernel before this one (kernels/pdl.py).
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_j = tl.arange(0, HALF_PAD)
    cs_mask = offs_j < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_j, mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_j, mask=cs_mask, other=0.0)
    slot = -1
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + t)
    pdl_prologue(PDL)

    _rotate_heads(q_ptr + t * stride_qn, stride_qh, num_q_heads, cos, sin, q_ptr, 0,
                  False, IS_NEOX, HALF, HALF_PAD, HEAD_DIM, REST_PAD, BLOCK_HQ)
    if WRITE_CACHE:
        if slot >= 0:
            kc = key_cache_ptr + (slot // PAGE) * stride_kcb + (slot % PAGE) * stride_kct
            _rotate_heads(k_ptr + t * stride_kn, stride_kh, num_kv_heads, cos, sin, kc, stride_kch,
                          True, IS_NEOX, HALF, HALF_PAD, HEAD_DIM, REST_PAD, BLOCK_HK)
            vc = value_cache_ptr + (slot // PAGE) * stride_vcb + (slot % PAGE) * stride_vct
            offs_d = tl.arange(0, BLOCK_D)
            for h0 in range(0, num_kv_heads, BLOCK_HK):
                offs_h = h0 + tl.arange(0, BLOCK_HK)
                mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
                v = tl.load(v_ptr + t * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
                tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :],
                         v.to(value_cache_ptr.dtype.element_ty), mask=mask)
        else:  # not cached, but k is still rotated in place
            _rotate_heads(k_ptr + t * stride_kn, stride_kh, num_kv_heads, cos, sin, k_ptr, 0,
                          False, IS_NEOX, HALF, HALF_PAD, HEAD_DIM, REST_PAD, BLOCK_HK)
    else:
        _rotate_heads(k_ptr + t * stride_kn, stride_kh, num_kv_heads, cos, sin, k_ptr, 0,
                      False, IS_NEOX, HALF, HALF_PAD, HEAD_DIM, REST_PAD, BLOCK_HK)


def compute_cos_sin_cache(inv_freq: torch.Tensor, max_pos: int, mscale: float = 1.0) -> torch.Tensor:
    """[max_pos, 2 * len(inv_freq)] fp32: cos(p * inv_freq) * mscale, then sin(p * inv_freq) * mscale.

    Matches HF: positions times inv_freq in fp32 (one product per entry), then cos/sin.
    """
    inv_freq = inv_freq.to(torch.float32)
    pos = torch.arange(max_pos, dtype=torch.float32, device=inv_freq.device)
    freqs = pos[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)


def _check_rotary(positions, q, k, cos_sin_cache) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [N, Hq, D] and k [N, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if positions.shape != (q.shape[0],) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{q.shape[0]}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k.dtype}")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache must be fp32 [max_pos, rot_dim], got {cos_sin_cache.dtype} "
                         f"{tuple(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > q.shape[2]:
        raise ValueError(f"rot_dim ({rot_dim}) must be even and <= head_dim ({q.shape[2]})")
    for name, t in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if positions.numel() > 1 and positions.stride(0) != 1:
        raise ValueError("positions must be contiguous")


def _launch(positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping, is_neox,
            pdl: bool | None = None):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    half_pad = triton.next_power_of_2(half)
    # ~4K elements per tile over the heads of one token.
    block_hq = min(triton.next_power_of_2(num_q_heads), max(1, 2048 // half_pad))
    block_hk = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // half_pad))
    write = key_cache is not None
    use_pdl = resolve_pdl(pdl, q.device)
    if not write:  # placeholders for unused pointers and strides
        v, key_cache, value_cache, slot_mapping = k, k.unsqueeze(0), k.unsqueeze(0), positions
    _LAUNCH(
        (num_tokens,),
        (positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping,
         num_q_heads, num_kv_heads,
         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         cos_sin_cache.stride(0),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
         value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)),
        dict(WRITE_CACHE=write, IS_NEOX=bool(is_neox), PAGE=key_cache.shape[1] if write else 1,
             HALF=half, HALF_PAD=half_pad, HEAD_DIM=head_dim,
             BLOCK_D=triton.next_power_of_2(head_dim),
             REST_PAD=triton.next_power_of_2(max(1, head_dim - 2 * half)),
             BLOCK_HQ=block_hq, BLOCK_HK=block_hk, PDL=use_pdl),
        dict(num_warps=4, **pdl_launch_kwargs(use_pdl)),
    )


_LAUNCH = FastLauncher(_rotary_kernel)


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [N, Hq, D] and k [N, Hkv, D] in place at positions [N]; returns (q, k).

    q and k may be strided views (e.g. of a fused qkv projection); their last dim is contiguous.
    pdl: programmatic dependent launch (kernels/pdl.py); None decides from the device and
    FLASHPAGE_PDL.
    """
    _check_rotary(positions, q, k, cos_sin_cache)
    if q.shape[0]:
        _launch(positions, q, k, None, cos_sin_cache, None, None, None, is_neox, pdl)
    return q, k


def rotary_and_cache_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q, k in place, then write k (rotated) and v into the paged cache, in
    one kernel: k is rotated in registers and stored twice, never re-read.

    v [N, Hkv, D]; key_cache, value_cache [num_blocks, block_size, Hkv, D] in k's dtype or
    float8_e4m3fn (the rotated k, rounded to k's dtype, then to e4m3: the cache gets what
    write_kv_cache would write of the rotated k);
    slot_mapping int64 [N], -1 = do not write token t (its q and k are still rotated).
    pdl as in apply_rotary. Returns (q, k).
    """
    _check_rotary(positions, q, k, cos_sin_cache)
    _check_kv(k, v, key_cache, value_cache, slot_mapping)
    if q.shape[0]:
        _launch(positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping, is_neox,
                pdl)
    return q, k


def apply_rotary_ref(positions, q, k, cos_sin_cache, is_neox=True):
    """Pure-torch apply_rotary (in place, fp32 math)."""
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for x in (q, k):
        r = x[..., :rot_dim].float()
        if is_neox:
            a, b = r[..., :half], r[..., half:]
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = r[..., 0::2], r[..., 1::2]
            out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        x[..., :rot_dim] = out.to(x.dtype)
    return q, k


def rotary_and_cache_write_ref(positions, q, k, v, cos_sin_cache, key_cache, value_cache,
                               slot_mapping, is_neox=True):
    """Pure-torch rotary_and_cache_write."""
    apply_rotary_ref(positions, q, k, cos_sin_cache, is_neox)
    write_kv_cache_ref(k, v, key_cache, value_cache, slot_mapping)
    return q, k
