"""Write new tokens' K/V into the paged cache through the slot mapping.

    slot_mapping[t] = block_id * block_size + offset_in_block   (int64; -1: skip token t)

    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache (MLA)         : [num_blocks, block_size, kv_lora_rank + rope_dim]

One program per token: a skipped token reads and writes nothing. Offsets are int64
because a pool can pass 2^31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_heads,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        blk = slot // PAGE
        off = slot % PAGE
        offs_d = tl.arange(0, BLOCK_D)
        for h0 in range(0, num_heads, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
            k = tl.load(k_ptr + t * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
            v = tl.load(v_ptr + t * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
            kc = key_cache_ptr + blk * stride_kcb + off * stride_kct
            vc = value_cache_ptr + blk * stride_vcb + off * stride_vct
            tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
            tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


@triton.jit
def _write_mla_kernel(
    latent_ptr, kv_cache_ptr, slot_mapping_ptr,
    stride_ln, stride_cb, stride_ct,
    PAGE: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < WIDTH
        x = tl.load(latent_ptr + t * stride_ln + offs, mask=mask)
        dst = kv_cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct
        tl.store(dst + offs, x, mask=mask)


def _check_slots(slot_mapping: torch.Tensor, num_tokens: int) -> None:
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 [{num_tokens}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.stride(0) != 1 and num_tokens > 1:
        raise ValueError("slot_mapping must be contiguous")


def _check_kv(k, v, key_cache, value_cache, slot_mapping) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if k.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"k/v heads and head_dim {tuple(k.shape[1:])} do not match the cache's "
                         f"{tuple(key_cache.shape[2:])}")
    if not (k.dtype == v.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(f"dtype mismatch: k {k.dtype}, v {v.dtype}, key_cache {key_cache.dtype}, "
                         f"value_cache {value_cache.dtype}")
    for name, t in (("k", k), ("v", v), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    _check_slots(slot_mapping, k.shape[0])


def _head_tile(num_heads: int, head_dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(head_dim)
    # About 2K elements per tile: enough bytes in flight, few registers.
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // block_d))
    return block_h, block_d


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key_cache[slot] = k[t], value_cache[slot] = v[t] for each t with slot_mapping[t] >= 0.

    k, v [N, Hkv, D] (rows may be strided, e.g. views of a fused qkv projection);
    caches [num_blocks, block_size, Hkv, D]; slot_mapping int64 [N].
    """
    _check_kv(k, v, key_cache, value_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_h, block_d = _head_tile(num_heads, head_dim)
    _write_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping, num_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        PAGE=key_cache.shape[1], HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4,
    )


def write_kv_cache_ref(k, v, key_cache, value_cache, slot_mapping) -> None:
    """Pure-torch write_kv_cache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = k[keep]
    value_cache[slots // block_size, slots % block_size] = v[keep]


def write_mla_cache(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[slot] = latent[t] for each t with slot_mapping[t] >= 0.

    latent [N, Dl + Dr] (c_kv after its norm, then k_pe with rope applied);
    kv_cache [num_blocks, block_size, Dl + Dr]; slot_mapping int64 [N].
    """
    if latent.dim() != 2 or kv_cache.dim() != 3 or latent.shape[1] != kv_cache.shape[2]:
        raise ValueError(f"latent must be [N, W] and kv_cache [num_blocks, block_size, W], got "
                         f"{tuple(latent.shape)} and {tuple(kv_cache.shape)}")
    if latent.dtype != kv_cache.dtype:
        raise ValueError(f"dtype mismatch: latent {latent.dtype}, kv_cache {kv_cache.dtype}")
    if latent.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("latent and kv_cache must be contiguous in their last dimension")
    _check_slots(slot_mapping, latent.shape[0])
    num_tokens, width = latent.shape
    if num_tokens == 0:
        return
    _write_mla_kernel[(num_tokens,)](
        latent, kv_cache, slot_mapping, latent.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE=kv_cache.shape[1], WIDTH=width, BLOCK=triton.next_power_of_2(width), num_warps=4,
    )


def write_mla_cache_ref(latent, kv_cache, slot_mapping) -> None:
    """Pure-torch write_mla_cache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = latent[keep]
