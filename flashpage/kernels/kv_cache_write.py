"""K/V cache write, one whole token row per step: the kernel behind ``write_kv_cache``.

    k, v                   : [N, Hkv, D]   (rows may be strided: views of a fused qkv output)
    key_cache, value_cache : [num_blocks, block_size, Hkv, D]
    slot_mapping           : int64 [N]; slot = block_id * block_size + offset, -1: skip

Grid ``(cdiv(N, block_t), 2)`` when ``split_kv`` (axis 1 picks K or V), else
``(cdiv(N, block_t),)`` with both tensors in one program. Each program copies the
whole ``Hkv * D`` row of ``block_t`` tokens as one [block_t, row] tile: when the
heads of a row are adjacent (the usual case, checked at launch) the offsets are
``row_base + e`` with no per-element head/dim split, so every thread moves 16-byte
vectors; the slot's block and offset are computed once per token. The earlier
kernel (``cache_write._write_kv``: tiles of ``elems`` elements split into head and
dim per element, K and V in one program) stays for comparison in the benchmark.

The caller (``cache_write.write_kv_cache``) checks shapes, dtypes and strides. Values are
converted to the cache's dtype as they are stored (float8_e4m3fn caches, kv_dtype.py).
Offsets are int64: a pool can pass 2^31 elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class KVWriteConfig:
    block_t: int = 8  # tokens per program (a power of two)
    num_warps: int = 4
    split_kv: bool = True  # K and V in separate programs (2-D grid)
    # Loads evict-first, stores .cs (streaming: evict-first in L1 and L2): the op's bytes
    # leave the L2 first, whatever else it holds stays (timed as a variant, not a default).
    streaming: bool = False


# Not yet timed on a GPU against the tile kernel: benchmarks/fused_ops.py --only kv_write
# times both (and the variants below) side by side.
KV_WRITE_DEFAULT = KVWriteConfig()
KV_WRITE_VARIANTS = [
    KVWriteConfig(8, 4, True), KVWriteConfig(4, 4, True), KVWriteConfig(16, 8, True),
    KVWriteConfig(8, 4, False), KVWriteConfig(16, 8, False),
    KVWriteConfig(8, 4, True, streaming=True), KVWriteConfig(8, 4, False, streaming=True),
]


def kv_write_name(cfg: KVWriteConfig) -> str:
    """t{tokens}w{warps}, then s (K, V split) or j (joint), then c (streaming hints)."""
    return f"t{cfg.block_t}w{cfg.num_warps}{'s' if cfg.split_kv else 'j'}{'c' if cfg.streaming else ''}"


@triton.jit
def _copy_rows(src_ptr, stride_sn, stride_sh, dst_ptr, stride_db, stride_dt, stride_dh,
               offs_t, blk, off, mask,
               HEAD_DIM: tl.constexpr, ROW_PAD: tl.constexpr, FLAT: tl.constexpr, STREAM: tl.constexpr):
    """dst[blk, off] = src[offs_t] for a [BLOCK_T, ROW_PAD] tile of whole rows."""
    e = tl.arange(0, ROW_PAD)
    if FLAT:  # heads adjacent in both source and cache: one contiguous run per token
        s_off = e
        d_off = e
    else:
        s_off = (e // HEAD_DIM) * stride_sh + e % HEAD_DIM
        d_off = (e // HEAD_DIM) * stride_dh + e % HEAD_DIM
    src = src_ptr + offs_t * stride_sn
    dst = dst_ptr + blk * stride_db + off * stride_dt
    if STREAM:
        x = tl.load(src[:, None] + s_off[None, :], mask=mask, eviction_policy="evict_first")
        tl.store(dst[:, None] + d_off[None, :], x.to(dst_ptr.dtype.element_ty), mask=mask,
                 cache_modifier=".cs")
    else:
        x = tl.load(src[:, None] + s_off[None, :], mask=mask)
        tl.store(dst[:, None] + d_off[None, :], x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_rows_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    num_tokens,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    PAGE: tl.constexpr,  # block_size (a power of two: // and % become shifts and masks)
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW_PAD: tl.constexpr,  # NUM_HEADS * HEAD_DIM rounded up to a power of two
    BLOCK_T: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    FLAT: tl.constexpr,
    STREAM: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)
    blk = slot // PAGE
    off = slot % PAGE
    mask = keep[:, None] & (tl.arange(0, ROW_PAD) < NUM_HEADS * HEAD_DIM)[None, :]
    if SPLIT_KV:
        if tl.program_id(1) == 0:
            _copy_rows(k_ptr, stride_kn, stride_kh, key_cache_ptr, stride_kcb, stride_kct, stride_kch,
                       offs_t, blk, off, mask, HEAD_DIM, ROW_PAD, FLAT, STREAM)
        else:
            _copy_rows(v_ptr, stride_vn, stride_vh, value_cache_ptr, stride_vcb, stride_vct, stride_vch,
                       offs_t, blk, off, mask, HEAD_DIM, ROW_PAD, FLAT, STREAM)
    else:
        _copy_rows(k_ptr, stride_kn, stride_kh, key_cache_ptr, stride_kcb, stride_kct, stride_kch,
                   offs_t, blk, off, mask, HEAD_DIM, ROW_PAD, FLAT, STREAM)
        _copy_rows(v_ptr, stride_vn, stride_vh, value_cache_ptr, stride_vcb, stride_vct, stride_vch,
                   offs_t, blk, off, mask, HEAD_DIM, ROW_PAD, FLAT, STREAM)


def write_kv_rows(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cfg: KVWriteConfig = KV_WRITE_DEFAULT,
) -> None:
    """key_cache[slot] = k[t], value_cache[slot] = v[t] for each t with slot_mapping[t] >= 0.

    Inputs already checked (``cache_write._check_kv``): k, v [N, Hkv, D] with a unit
    last stride; caches [num_blocks, block_size, Hkv, D]; slot_mapping int64 [N].
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    flat = (num_heads == 1 or (k.stride(1) == head_dim and v.stride(1) == head_dim
                               and key_cache.stride(2) == head_dim and value_cache.stride(2) == head_dim))
    # At most 16K elements a tile (rows of Hkv * D = 1024: up to 16 tokens).
    row_pad = triton.next_power_of_2(num_heads * head_dim)
    block_t = max(1, min(cfg.block_t, 16384 // row_pad))
    grid = (triton.cdiv(num_tokens, block_t), 2) if cfg.split_kv else (triton.cdiv(num_tokens, block_t),)
    _write_kv_rows_kernel[grid](
        k, v, key_cache, value_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        PAGE=key_cache.shape[1], NUM_HEADS=num_heads, HEAD_DIM=head_dim, ROW_PAD=row_pad,
        BLOCK_T=block_t, SPLIT_KV=cfg.split_kv, FLAT=flat, STREAM=cfg.streaming,
        num_warps=cfg.num_warps,
    )
