"""Write new tokens' K/V into the paged cache through the slot mapping.

    slot_mapping[t] = block_id * block_size + offset_in_block   (int64; -1: skip token t)

    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_dim]
    kv_cache (MLA)         : [num_blocks, block_size, kv_lora_rank + rope_dim]

Each program moves a tile of several tokens; a skipped token is masked out of the
loads and stores, so it reads and writes nothing. Offsets are int64
because a pool can pass 2^31 elements.

The K/V caches (and the MLA latent cache) hold k's (the latent's) dtype or float8_e4m3fn
(kv_dtype.py): values are converted to the cache's dtype as they are stored (a no-op when
the dtypes agree).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.kv_dtype import check_kv_cache_dtype, check_latent_cache_dtype
from flashpage.kernels.mla_cache_write import write_mla_cache_vec


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_tokens,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    PAGE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_E: tl.constexpr,  # elements of a token's [NUM_HEADS, HEAD_DIM] per step
):
    """A tile of BLOCK_T tokens x BLOCK_E elements of their flattened heads; skipped
    tokens are masked out of both the loads and the stores."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    slot = tl.load(slot_mapping_ptr + offs_t, mask=t_mask, other=-1)
    t_mask = slot >= 0
    blk = tl.where(t_mask, slot, 0) // PAGE
    off = tl.where(t_mask, slot, 0) % PAGE
    k_row = k_ptr + offs_t * stride_kn
    v_row = v_ptr + offs_t * stride_vn
    kc_row = key_cache_ptr + blk * stride_kcb + off * stride_kct
    vc_row = value_cache_ptr + blk * stride_vcb + off * stride_vct
    for e0 in tl.static_range(0, NUM_HEADS * HEAD_DIM, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        h = e // HEAD_DIM
        d = e % HEAD_DIM
        mask = t_mask[:, None] & (e < NUM_HEADS * HEAD_DIM)[None, :]
        k = tl.load(k_row[:, None] + (h * stride_kh + d)[None, :], mask=mask)
        v = tl.load(v_row[:, None] + (h * stride_vh + d)[None, :], mask=mask)
        # to the cache's dtype: e4m3 for an fp8 cache (round to nearest even)
        tl.store(kc_row[:, None] + (h * stride_kch + d)[None, :],
                 k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_row[:, None] + (h * stride_vch + d)[None, :],
                 v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_mla_kernel(
    latent_ptr, kv_cache_ptr, slot_mapping_ptr,
    num_tokens, stride_ln, stride_cb, stride_ct,
    PAGE: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    CHUNK: tl.constexpr,  # elements of a row per step (a power of two)
):
    """A tile of BLOCK_T tokens, CHUNK elements of their rows at a time: with CHUNK
    dividing WIDTH (64 for 512 + 64) no lane is masked off for padding."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    t_mask = slot >= 0
    slot = tl.where(t_mask, slot, 0)
    src = latent_ptr + offs_t * stride_ln
    dst = kv_cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct
    for c0 in tl.static_range(0, WIDTH, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        mask = t_mask[:, None] & (offs < WIDTH)[None, :]
        x = tl.load(src[:, None] + offs[None, :], mask=mask)
        tl.store(dst[:, None] + offs[None, :], x.to(kv_cache_ptr.dtype.element_ty), mask=mask)


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
    if k.dtype != v.dtype:
        raise ValueError(f"dtype mismatch: k {k.dtype}, v {v.dtype}")
    check_kv_cache_dtype(k.dtype, key_cache, value_cache, "k")
    for name, t in (("k", k), ("v", v), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    _check_slots(slot_mapping, k.shape[0])


# Tile settings (elements per tensor per program, warps), from the H200 sweep in
# benchmarks/fused_ops.py (2026-11-30; benchmarks/results/fused_ops.md). K/V: every tile
# within 78-82% of copy, (4096, 8) among the best. MLA: the 64-wide steps give each
# thread BLOCK_T * 64 / (32 * warps) elements, so (4096, 8) moved 2 bytes per access
# (34% of copy) and (16384, 8), 8 bytes per access, the most of those timed (54-68%).
KV_TILE = (4096, 8)
MLA_TILE = (16384, 8)


def _token_tile(row: int, elems: int) -> tuple[int, int]:
    """(tokens per program, elements per step) for rows of ``row`` elements and about
    ``elems`` elements per tensor per program (enough bytes to hide latency)."""
    block_e = min(triton.next_power_of_2(row), 2048)
    return max(1, elems // block_e), block_e


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key_cache[slot] = k[t], value_cache[slot] = v[t] for each t with slot_mapping[t] >= 0.

    k, v [N, Hkv, D] (rows may be strided, e.g. views of a fused qkv projection);
    caches [num_blocks, block_size, Hkv, D] in k's dtype or float8_e4m3fn (each value
    rounded to e4m3 as it is stored); slot_mapping int64 [N].
    """
    _check_kv(k, v, key_cache, value_cache, slot_mapping)
    # The tile kernel: in the H200 run of 2026-11-30 it moved 3,740 / 3,693 GB/s (random /
    # prefill-like slots, graph-timed, 88% / 87% of copy) against 3,691 / 3,679 for the
    # row kernel (kv_cache_write.write_kv_rows), which stays importable.
    _write_kv(k, v, key_cache, value_cache, slot_mapping, *KV_TILE)


def _write_kv(k, v, key_cache, value_cache, slot_mapping, elems: int, num_warps: int) -> None:
    _check_kv(k, v, key_cache, value_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_t, block_e = _token_tile(num_heads * head_dim, elems)
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, key_cache, value_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        PAGE=key_cache.shape[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps,
    )


def write_kv_cache_ref(k, v, key_cache, value_cache, slot_mapping) -> None:
    """Pure-torch write_kv_cache (torch's cast to the cache's dtype)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = k[keep].to(key_cache.dtype)
    value_cache[slots // block_size, slots % block_size] = v[keep].to(value_cache.dtype)


def write_mla_cache(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[slot] = latent[t] for each t with slot_mapping[t] >= 0.

    latent [N, Dl + Dr] (c_kv after its norm, then k_pe with rope applied);
    kv_cache [num_blocks, block_size, Dl + Dr] in the latent's dtype or float8_e4m3fn
    (each value rounded to e4m3 as it is stored); slot_mapping int64 [N].
    """
    write_mla_cache_vec(latent, kv_cache, slot_mapping)  # old: _write_mla(..., *MLA_TILE)


def _write_mla(latent, kv_cache, slot_mapping, elems: int, num_warps: int) -> None:
    if latent.dim() != 2 or kv_cache.dim() != 3 or latent.shape[1] != kv_cache.shape[2]:
        raise ValueError(f"latent must be [N, W] and kv_cache [num_blocks, block_size, W], got "
                         f"{tuple(latent.shape)} and {tuple(kv_cache.shape)}")
    check_latent_cache_dtype(latent.dtype, kv_cache, "latent")
    if latent.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("latent and kv_cache must be contiguous in their last dimension")
    _check_slots(slot_mapping, latent.shape[0])
    num_tokens, width = latent.shape
    if num_tokens == 0:
        return
    chunk = min(width & -width, 256)  # the largest power of two dividing the width, <= 256
    if chunk < 16:  # an odd width: one masked tile per row rather than many tiny steps
        chunk = triton.next_power_of_2(width)
    block_t = max(1, elems // triton.next_power_of_2(width))
    _write_mla_kernel[(triton.cdiv(num_tokens, block_t),)](
        latent, kv_cache, slot_mapping, num_tokens, latent.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE=kv_cache.shape[1], WIDTH=width, BLOCK_T=block_t, CHUNK=chunk, num_warps=num_warps,
    )


def write_mla_cache_ref(latent, kv_cache, slot_mapping) -> None:
    """Pure-torch write_mla_cache (torch's cast to the cache's dtype)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = latent[keep].to(kv_cache.dtype)
