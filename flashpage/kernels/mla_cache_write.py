"""Write new tokens' MLA latents into the paged cache in 16-byte pieces.

    latent   : [N, W]                          W = kv_lora_rank + rope_dim (576 for V2/V3)
    kv_cache : [num_blocks, block_size, W]
    slot_mapping[t] = block_id * block_size + offset_in_block   (int64; -1: skip token t)

The copy is flattened into *units* of VEC elements (16 bytes: 8 bf16, 72 per 576-wide
row): a program takes BLOCK consecutive units, i.e. a contiguous run of the latent that
spans several tokens, and each thread moves whole 16-byte units. The earlier kernel
(``cache_write._write_mla``) walked a [tokens, 64] tile nine times per row, so each
access was BLOCK_T * 64 / threads elements wide (4 bf16 at its default) and each of the
nine steps waited on its own load: 54-68% of copy on an H200. Here one load and one
store per unit, all issued together, no padded lanes whatever the width.

VEC shrinks (8 -> 4 -> 2 -> 1 elements for bf16) until it divides the width, the
strides and the two base addresses, so an odd layout is still correct, only narrower.

The cache holds the latent's dtype or float8_e4m3fn (kv_dtype.py): each value is rounded
to e4m3 as it is stored (``cvt.rn.satfinite`` on the GPU: +-448 past the range). A unit
is then 16 bytes of the *wider* of the two tensors (8 bf16 latent values in, 8 bytes
out), and each tensor's base address is checked in its own element size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.kv_dtype import check_latent_cache_dtype

# (units per program, warps): 1024 units = 16 KB read + 16 KB written per program, 8
# units of 16 bytes in flight per thread with 4 warps. Not yet timed on a GPU: the
# benchmark (benchmarks/mla_decode.py --write) times every candidate beside it.
MLA_WRITE_TILE = (1024, 4)
CANDIDATE_TILES = [(512, 4), (1024, 4), (2048, 4), (1024, 8), (2048, 8), (4096, 8)]


@triton.jit
def _write_mla_vec_kernel(
    latent_ptr, kv_cache_ptr, slot_mapping_ptr,
    num_units, stride_ln, stride_cb, stride_ct,
    PAGE: tl.constexpr,
    UNITS: tl.constexpr,  # units per row: W // VEC
    VEC: tl.constexpr,  # elements per unit (16 bytes where the layout allows)
    BLOCK: tl.constexpr,  # units per program
):
    u = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # int32: the launcher checks the range
    u_mask = u < num_units
    tok = u // UNITS
    col = (u % UNITS) * VEC
    slot = tl.load(slot_mapping_ptr + tok, mask=u_mask, other=-1)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)
    # Every offset is a multiple of VEC (the launcher checked the strides): say so, so the
    # [BLOCK, VEC] accesses below compile to one 16-byte load / store per unit.
    src = tl.multiple_of(tok.to(tl.int64) * stride_ln + col, VEC)
    dst = tl.multiple_of((slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + col, VEC)
    offs_v = tl.arange(0, VEC)
    # Masked by the range only, not by the slot: the latent load then need not wait for
    # the slot load (one memory round trip, not two). A skipped token's row is read (it
    # exists) but not written.
    x = tl.load(latent_ptr + src[:, None] + offs_v[None, :], mask=u_mask[:, None])
    # to the cache's dtype: e4m3 for an fp8 cache (round to nearest even), else a no-op
    tl.store(kv_cache_ptr + dst[:, None] + offs_v[None, :], x.to(kv_cache_ptr.dtype.element_ty),
             mask=keep[:, None])


def _check(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if latent.dim() != 2 or kv_cache.dim() != 3 or latent.shape[1] != kv_cache.shape[2]:
        raise ValueError(f"latent must be [N, W] and kv_cache [num_blocks, block_size, W], got "
                         f"{tuple(latent.shape)} and {tuple(kv_cache.shape)}")
    check_latent_cache_dtype(latent.dtype, kv_cache, "latent")
    if latent.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("latent and kv_cache must be contiguous in their last dimension")
    n = latent.shape[0]
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping must be int64 [{n}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.stride(0) != 1 and n > 1:
        raise ValueError("slot_mapping must be contiguous")


def unit_elems(latent: torch.Tensor, kv_cache: torch.Tensor) -> int:
    """Elements per unit: 16 bytes' worth of the wider element (the latent's, with an fp8
    cache), halved until it divides the row width, every row stride and both base
    addresses (each in its own tensor's elements)."""
    lsize, csize = latent.element_size(), kv_cache.element_size()
    vec = max(1, 16 // max(lsize, csize))
    parts = (latent.shape[1], latent.stride(0), kv_cache.stride(0), kv_cache.stride(1),
             latent.data_ptr() // lsize, kv_cache.data_ptr() // csize)
    while vec > 1 and any(p % vec for p in parts):
        vec //= 2
    if latent.data_ptr() % lsize or kv_cache.data_ptr() % csize:
        vec = 1
    return vec


def write_mla_cache_vec(latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        tile: tuple[int, int] | None = None) -> None:
    """kv_cache[slot] = latent[t] for each t with slot_mapping[t] >= 0.

    latent [N, W] (rows may be strided); kv_cache [num_blocks, block_size, W] in the
    latent's dtype or float8_e4m3fn (each value rounded to e4m3 as it is stored);
    slot_mapping int64 [N]. ``tile`` = (units per program, warps), default MLA_WRITE_TILE.
    """
    _check(latent, kv_cache, slot_mapping)
    num_tokens, width = latent.shape
    if num_tokens == 0:
        return
    block, num_warps = tile or MLA_WRITE_TILE
    vec = unit_elems(latent, kv_cache)
    units = width // vec
    num_units = num_tokens * units
    if num_units + block >= 2**31:
        raise ValueError(f"{num_tokens} tokens of {width} elements: too many for one call")
    _write_mla_vec_kernel[(triton.cdiv(num_units, block),)](
        latent, kv_cache, slot_mapping, num_units,
        latent.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE=kv_cache.shape[1], UNITS=units, VEC=vec, BLOCK=block, num_warps=num_warps,
    )


__all__ = ["CANDIDATE_TILES", "MLA_WRITE_TILE", "unit_elems", "write_mla_cache_vec"]
