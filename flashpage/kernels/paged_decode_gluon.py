"""Paged decode over an fp8 KV cache, in Gluon for sm_90: paged_decode.py's warp-split loop
(``DecodeConfig(64, 4, 3, warp_split=True, heads_fastest=True)``) rebuilt on TMA as one
persistent kernel. ``paged_decode`` runs it for an unsplit fp8 call on Hopper
(``DecodeConfig.gluon``) in the form ``engine_form`` picks: the ``keys_m`` variant at 4 programs
an SM, the default variant at 3 where the GQA group is over 8 (H200: 83-94% of copy at the
engine's batches against the Triton loop's 62-73%, run 79 in BENCHMARKS.md).

Same contract as ``paged_decode`` for the engine's fp8 decode: q [B, Hq, 128] bf16/fp16,
key_cache / value_cache [num_blocks, 16, Hkv, 128] float8_e4m3fn, (sequence, KV head) items,
KV heads fastest, no key splits, dots in fp16 (q scaled by sm_scale·log2(e) in fp32 and rounded
to fp16 once; e4m3 widened to fp16 exactly), fp32 accumulation, base-2 online softmax.

What Gluon lets this kernel do that Triton's pipeliner did not::

    global (fp8 page pieces)                                   registers
    key_cache[blk, 0:16, kvh, :] --TMA box [16,128]--> K stage rows 16p..16p+15 --LDS.128--> K^T operand
    value_cache[blk, ...]        --TMA box [16,128]--> V stage rows 16p..16p+15 --LDS.128--> V operand

- Each 64-key tile is 4 pieces of 16 keys (one page each); each piece's K and V rows land by
  TMA (one [16, 128] box each, 128-byte swizzle) in one ``STAGES``-deep ring, all 8 boxes
  of a tile counted by one mbarrier. No register round trip, no LDGSTS address math.
- Warp p owns piece p of every tile with its own softmax state (as ``WARP_SPLIT``), merged
  once at the end of an item. Per tile: one mbarrier wait and one CTA barrier (before the
  stage every warp has just finished reading is refilled) -- as written. Triton 3.6's membar
  analysis adds 9 more: it sees each TMA issue as a write to the stage buffer and to the
  mbarrier, so it puts a bar.sync between consecutive issues (sm_90 SASS: 10 BAR.SYNC per
  tile).
- The stage is read back through *views* of the same bytes (``SharedLinearLayout``) whose
  logical head-dim order is a permutation of the physical one, chosen so that each thread's
  mma fragment is 16 contiguous bytes of one cache row: K and V both reach the mma_v2
  operand layouts through 128-bit shared loads instead of byte loads, and are widened
  there (``cvt.rn.f16x2.e4m3x2``). The dots do not care about the order along the head dim
  as long as q uses the same one (for K; q is loaded with it), and the output's columns
  are stored through V's permutation.
- Persistent (section "the persistent kernel"): a grid of a few programs per SM, each over
  several (sequence, KV head) items as one continuous tile stream (TMA for the next item in
  flight while the current one ends).
- ``variant="keys_m"`` (its section; GQA groups <= 8) computes both dots transposed, S^T = K Q^T
  and O^T = V^T P^T, with the group padded to 8 as the mma's N instead of to 16 as its M: 16
  HMMA a tile instead of 32, a 32-register accumulator; sm_90 SASS of the tile loop 455
  instructions a warp against 590, 148 registers, no spill under 128 (4 programs an SM).

The last tile of each sequence is masked (keys past seq_len: scores -inf, V rows zeroed: an
unowned slot may hold NaN, and 0 · NaN is NaN in the P·V dot); its pieces past the context
re-read the last valid page (an L2 hit) instead of leaving a stage part-filled.

Forms that lost, removed (readable at commit 16f5823, BENCHMARKS.md's paged decode section): a
program per (KV head, sequence) (runs 68-70: 1.07-1.17x the Triton loop, then 4-15% under this
persistent kernel in run 74) and a warp-specialized form of it (a TMA producer partition, one-warp
compute partitions, optionally a lazy rescale: no faster, runs 68 and 70); the persistent variants
``dims_m`` (O^T = V^T P^T only) and ``keys_m2`` (keys_m over KV-head pairs, half the TMA issues),
within a few percent of keys_m in run 79 (keys_m2 +0.5% end to end in run 80, once, and only for
an even KV head count).
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    mma_v2,
    tma,
)

_LOG2E = 1.4426950408889634
HEAD_DIM = 128
PAGE = 16
NUM_WARPS = 4  # one 16-key piece of each tile per warp
BLOCK_N = 16 * NUM_WARPS
STAGES = 3  # tiles in the buffer: STAGES - 1 in flight while one is computed

# Kernel-side copies of the constants above.
_D = gl.constexpr(HEAD_DIM)
_PG = gl.constexpr(PAGE)
_W = gl.constexpr(NUM_WARPS)
_BN = gl.constexpr(BLOCK_N)

# mma_v2 m16n8k16 over [piece, rows, cols]: warp p computes piece p.
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[_W, 1, 1],
                                              instr_shape=[1, 16, 8]))
_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))
# The cache rows as TMA lands them: [rows, 128] fp8, 128-byte swizzle (16-byte chunk c of row
# r at chunk c ^ (r % 8)).
_TMA_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))

# Views of one stage ([64, 128] fp8 = 8 KB, offset bits 0-12) as the mma operands, offset bit
# -> logical coordinate. Physical: bits 0-6 the byte in the row (bits 4-6 the chunk, XORed
# with the row's low 3 bits), bits 7-12 the row (bits 10-12 row bit 3 and the piece).
#
# K^T view [piece, kk, key]: the B operand (k_width 2) gives thread (g, t) the kk with bits 1-2
# = t and the other five bits in its registers, in the order kk bits 0, 3, 4, 5, 6. Physical
# column d = kk0 | kk3 << 1 | kk4-6 << 2 | kk1-2 << 5 puts those 32 registers on 32 contiguous
# bytes of key row g (two 16-byte loads; the swizzle moves 16-byte chunks).
_K_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0],  # column bits 0-3
    [0, 64, 0], [0, 2, 0], [0, 4, 0],  # column bits 4-6 (the chunk)
    [0, 64, 1], [0, 2, 2], [0, 4, 4],  # row bits 0-2 (and the chunk swizzle)
    [0, 0, 8], [1, 0, 0], [2, 0, 0],  # row bit 3, the piece
]))
# V view [piece, key, n]: the B operand gives thread (g, t) the n with bits 0-2 = g and bits 3-6
# in registers. Physical column d = 16 (n % 8) + n // 8: 16 contiguous bytes of each key row
# (one 16-byte load per key). The output's column n is head-dim element d.
_V_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64],  # column bits 0-3
    [0, 0, 1], [0, 0, 2], [0, 0, 4],  # column bits 4-6
    [0, 1, 1], [0, 2, 2], [0, 4, 4],  # row bits 0-2 (and the chunk swizzle)
    [0, 8, 0], [1, 0, 0], [2, 0, 0],  # row bit 3, the piece
]))
# The V operand's registers reordered so that the first four run along n bits 3-6 (the 16
# contiguous bytes): the shared load vectorizes, and the conversion to _B only renames
# registers within each thread.
_V_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64], [0, 1, 0], [0, 8, 0]],
    lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[_W, 16, _D]))


@gluon.jit
def _k_column(kk):
    """Physical head-dim column of K's logical kk (q is loaded in the same order)."""
    return (kk & 1) | (((kk >> 3) & 1) << 1) | (((kk >> 4) & 7) << 2) | (((kk >> 1) & 3) << 5)


@gluon.jit
def _v_column(n):
    """Physical head-dim column of V's (and the output's) logical column n."""
    return (n % 8) * 16 + n // 8


@gluon.jit
def _tile_blocks(bt_row, tile, last_page):
    """The 4 pages of a tile (pages past the context: the last page of it, re-read from L2)."""
    page = tile * _W
    b0 = gl.load(bt_row + gl.minimum(page, last_page))
    b1 = gl.load(bt_row + gl.minimum(page + 1, last_page))
    b2 = gl.load(bt_row + gl.minimum(page + 2, last_page))
    b3 = gl.load(bt_row + gl.minimum(page + 3, last_page))
    return b0, b1, b2, b3


@gluon.jit
def _issue_piece(k_desc, v_desc, k_smem, v_smem, bar, row0, blk, col, pred):
    tma.async_copy_global_to_shared(k_desc, [blk * _PG, col], bar, k_smem.slice(row0, _PG), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [blk * _PG, col], bar, v_smem.slice(row0, _PG), pred=pred)


@gluon.jit
def _attend(q, k_stage, v_stage, m3, l3, acc, n0, seq_len, MASKED: gl.constexpr):
    """_attend on one stage's K and V buffers ([64, 128] fp8 each)."""
    k_view = k_stage._reinterpret(
        gl.float8e4nv, [_W, _D, _PG], _K_VIEW)
    v_view = v_stage._reinterpret(
        gl.float8e4nv, [_W, _PG, _D], _V_VIEW)
    kt = k_view.load(_B).to(gl.float16)  # [4, 128, 16]
    s = mma_v2(q, kt, gl.zeros([_W, 16, _PG], gl.float32, _MMA))  # [4, 16 rows, 16 keys]
    if MASKED:
        offs_p = gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _MMA)))
        offs_j = gl.arange(0, _PG, layout=gl.SliceLayout(0, gl.SliceLayout(1, _MMA)))
        key = n0 + gl.expand_dims(gl.expand_dims(offs_p * _PG, 1), 2) + gl.expand_dims(gl.expand_dims(offs_j, 0), 1)
        s = gl.where(key < seq_len, s, float("-inf"))
        m_new = gl.maximum(m3, gl.max(s, 2))
        m_exp = gl.where(m_new == float("-inf"), 0.0, m_new)  # a piece with no key yet
    else:
        m_new = gl.maximum(m3, gl.max(s, 2))  # 16 valid keys: finite
        m_exp = m_new
    alpha = gl.exp2(m3 - m_exp)
    p = gl.exp2(s - gl.expand_dims(m_exp, 2))
    l3 = l3 * alpha + gl.sum(p, 2)
    pa = gl.convert_layout(p.to(gl.float16), _A)  # the accumulator's registers already
    v = gl.convert_layout(v_view.load(_V_LOAD).to(gl.float16), _B)  # [4, 16 keys, 128]
    if MASKED:
        offs_vp = gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _B)))
        offs_vj = gl.arange(0, _PG, layout=gl.SliceLayout(0, gl.SliceLayout(2, _B)))
        vkey = n0 + gl.expand_dims(gl.expand_dims(offs_vp * _PG, 1), 2) + gl.expand_dims(gl.expand_dims(offs_vj, 0), 2)
        v = gl.where(vkey < seq_len, v, 0.0)
    acc = mma_v2(pa, v, acc * gl.expand_dims(alpha, 2))
    return m_new, l3, acc


# --------------------------------------------------------------------------- the persistent kernel
#
# The tiles, pieces, views and masking above on a grid of min(items, programs_per_sm x SMs)
# programs, each looping over the work items pid, pid + nprog, ... (item = b * Hkv + kvh: KV
# heads fastest, so the engine's longest-first sequences give an LPT-like static schedule) as
# ONE tile stream:
#
#     item:   |---- pid ----|------ pid + nprog ------|-- pid + 2 nprog --|
#     tiles:   0   1   2   3  4   5   6   7   8   9   10  11 ...           g: the program's tile count
#     TMA:     issued S - 1 tiles ahead of the compute, across item boundaries
#
# The ring's stage and phase come from g (stage g % S, phase (g // S) & 1), the mbarriers are
# initialized once, and the next item's first tiles are in flight while the current item's last
# ones are computed (no drain and refill between items, no partial last wave). A producer cursor
# (item, tile in it, the block ids of that tile loaded one issue ahead) and the consumer's item
# loop walk the same items; the producer skips items without a key (seq_len 0: CUDA-graph
# padding rows, no tile; the consumer writes their zeros), and past the last item its issues are
# predicated off, so every issued TMA is waited on before the barriers are invalidated. q and
# seq_len of the next item are loaded when an item starts (q: 8 registers a thread, [16, 128]
# bf16 over the 4 warps), q scaled and handed to every warp (a layout conversion through shared
# memory) when it begins. The 4 pieces are merged through the stage the next issue will refill
# (fp16, each piece already normalized): the ring is live, and gl.sum over the warps would need
# 32 KB of scratch beside it (81 KB a program: 2 an SM). programs_per_sm sets the register cap
# (ptxas maxnreg) that lets that many share an SM.

# The prefetched q [16 rows, 128] over the CTA: 16 elements a thread.
_Q_NEXT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[_W, 1],
                                        order=[1, 0]))
# The merge: the ring ([2S, 64, 128] fp8: K of stage s at 2s, V at 2s + 1) seen as S stages of
# [4 pieces, 16 rows, 128] fp16, and the normalized pieces read back summed in registers (the
# piece dimension within each thread).
_MERGE_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[2, 1, 0]))
_MERGE_LOAD = gl.constexpr(gl.BlockedLayout(size_per_thread=[_W, 1, 8], threads_per_warp=[1, 2, 16],
                                            warps_per_cta=[1, _W, 1], order=[2, 1, 0]))


@gluon.jit
def _seek(item, nprog, num_items, HKV: gl.constexpr, seq_lens_ptr, block_tables_ptr, stride_btb):
    """The producer's next item from ``item`` on: the first of item, item + nprog, ... with a key,
    or one past the end (>= num_items: its issues are predicated off). Returns it, its tile
    count, block-table row, last page and head-dim column (past the end: of the last row, a
    context of 1, never issued)."""
    seq_len = gl.load(seq_lens_ptr + item // HKV, mask=item < num_items, other=1)
    while seq_len <= 0:  # padding rows: no tile (as the consumer sees them: cdiv(seq_len, 64) <= 0)
        item += nprog
        seq_len = gl.load(seq_lens_ptr + item // HKV, mask=item < num_items, other=1)
    return _cursor(item, seq_len, num_items, HKV, block_tables_ptr, stride_btb)


@gluon.jit
def _cursor(item, seq_len, num_items, HKV: gl.constexpr, block_tables_ptr, stride_btb):
    """The producer cursor at ``item``, whose context is ``seq_len`` keys: it, its tile count,
    block-table row, last page and head-dim column (past the end: of the last row)."""
    b = gl.minimum(item, num_items - 1) // HKV
    bt_row = block_tables_ptr + b.to(gl.int64) * stride_btb
    return item, gl.cdiv(seq_len, _BN), bt_row, (seq_len - 1) // _PG, (item % HKV) * _D


@gluon.jit
def _produce(k_desc, v_desc, kv, bars, t, b0, b1, b2, b3,
             item, tile, nt, bt_row, last_page, col,
             nprog, num_items, HKV: gl.constexpr, seq_lens_ptr, block_tables_ptr, stride_btb,
             S: gl.constexpr):
    """Issue the producer cursor's tile (the program's t-th: stage t % S), then advance the cursor
    (to the next item with a key after its last tile) and load its tile's block ids."""
    _issue_kv(k_desc, v_desc, kv, bars, t, b0, b1, b2, b3, col, item < num_items, S)
    tile += 1
    if tile == nt:
        item, nt, bt_row, last_page, col = _seek(item + nprog, nprog, num_items, HKV, seq_lens_ptr,
                                                 block_tables_ptr, stride_btb)
        tile = 0
    b0, b1, b2, b3 = _tile_blocks(bt_row, tile, last_page)
    return b0, b1, b2, b3, item, tile, nt, bt_row, last_page, col


@gluon.jit
def _issue_kv(k_desc, v_desc, kv, bars, t, b0, b1, b2, b3, col, pred, S: gl.constexpr):
    """TMA of a tile's 4 K and 4 V pieces into stage t % S of the ring (K at 2 (t % S), V at
    2 (t % S) + 1), on its mbarrier."""
    stage = t % S
    bar = bars.index(stage)
    mbarrier.expect(bar, 2 * _BN * _D, pred=pred)
    ks = kv.index(2 * stage)
    vs = kv.index(2 * stage + 1)
    _issue_piece(k_desc, v_desc, ks, vs, bar, 0, b0, col, pred)
    _issue_piece(k_desc, v_desc, ks, vs, bar, _PG, b1, col, pred)
    _issue_piece(k_desc, v_desc, ks, vs, bar, 2 * _PG, b2, col, pred)
    _issue_piece(k_desc, v_desc, ks, vs, bar, 3 * _PG, b3, col, pred)


@gluon.jit
def _load_q_next(q_ptr, item, num_items, HKV: gl.constexpr, stride_qb, stride_qh, GROUP: gl.constexpr):
    """q of ``item`` (zeros past the end), rows >= GROUP zero, columns in K's order, raw."""
    offs_r = gl.arange(0, 16, layout=gl.SliceLayout(1, _Q_NEXT))
    offs_k = gl.arange(0, _D, layout=gl.SliceLayout(0, _Q_NEXT))
    r2 = gl.expand_dims(offs_r, 1)
    k2 = gl.expand_dims(_k_column(offs_k), 0)
    b64 = (item // HKV).to(gl.int64)
    head0 = (item % HKV) * GROUP
    q_ptrs = q_ptr + b64 * stride_qb + (head0 + r2).to(gl.int64) * stride_qh + k2
    return gl.load(q_ptrs, mask=(r2 < GROUP) & (k2 < _D) & (item < num_items), other=0.0)


# --------------------------------------------------------------------------- variant="keys_m"
#
# The engine's form (GQA groups <= 8): both dots transposed, the group padded to 8 as the mma's N
# instead of to 16 as its M. S^T = K Q^T: the piece's 16 keys as M, the head dims as K, q^T as the
# B operand (16 registers): 8 HMMA a piece instead of 16. O^T = V^T P^T: the 128 head dims as M (8
# m-tiles), the 16 keys as K: 8 HMMA a piece, an accumulator of [128, 8] fp32 = 32 registers a
# thread instead of 64 (32 FMUL to rescale it, not 64). The scores' heads sit on the same lanes
# and register as the accumulator's (alpha needs no exchange); the max over keys is across lanes
# 2-4 (3 shuffle rounds); l is kept per thread ([W, 16, 8], summed at the end: no shuffle a
# tile); P^T moves from the accumulator layout (key g, heads 2t, 2t + 1) to the B operand's (head
# g, keys 2t, 2t + 1, ...): a transpose within each warp (Triton's layout conversion). K and V^T,
# both A operands, read the stage through _K_VIEW's and _V_VIEW's permutations with their last
# two coordinates swapped (each thread: 16 contiguous bytes of a cache row, as before). The merge
# goes through the K half of the stage the next issue will refill ([W, 8, 128] fp16).
#
# q is scaled in the mma operand layout (moved raw, then scaled in fp32 and rounded to fp16 once,
# as the default does before the move: the same values). Moved after scaling, the operand comes
# out of the layout conversion in registers that cross the mma's pairs, and ptxas copies it into
# fresh ones before every Q.K^T HMMA (the default loop's ~64 IMAD.MOV); written by the scaling, it
# is allocated as the mma wants, once per item.
#
# sm_90 SASS a warp a tile (Triton 3.6, tests/kernels/test_paged_decode_gluon.py prints them):
# default 590 (32 HMMA, 64 FMUL, 10 MUFU, 70 IMAD.MOV), keys_m 455 (16 HMMA, 32 FMUL, 6 MUFU);
# the TMA issue and producer cursor (~250, 10 BAR.SYNC: every warp runs the issue code,
# predicated) are the same in both, now half the loop.
# K [piece, key, kk]: _K_VIEW with its last two coordinates swapped.
_KA_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 0, 1], [0, 0, 8], [0, 0, 16], [0, 0, 32],
    [0, 0, 64], [0, 0, 2], [0, 0, 4],
    [0, 1, 64], [0, 2, 2], [0, 4, 4],
    [0, 8, 0], [1, 0, 0], [2, 0, 0],
]))
# The A operand's registers reordered so that the first five run along kk bits 0, 3-6 (32 bytes).
_KA_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64], [0, 8, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[_W, _PG, _D]))
# V^T [piece, n, key]: _V_VIEW with its last two coordinates swapped.
_VT_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 8, 0], [0, 16, 0], [0, 32, 0], [0, 64, 0],  # column bits 0-3
    [0, 1, 0], [0, 2, 0], [0, 4, 0],  # column bits 4-6
    [0, 1, 1], [0, 2, 2], [0, 4, 4],  # row bits 0-2 (and the chunk swizzle)
    [0, 0, 8], [1, 0, 0], [2, 0, 0],  # row bit 3, the piece
]))
# The A operand's registers reordered so that the first four run along n bits 3-6 (16 bytes).
_VT_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 8, 0], [0, 16, 0], [0, 32, 0], [0, 64, 0], [0, 0, 1], [0, 0, 8]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[_W, _D, 16]))
# The merge: the normalized pieces [W, 8 heads, 128] fp16 in the K half of a stage.
_MERGE_LOAD_T = gl.constexpr(gl.BlockedLayout(size_per_thread=[_W, 1, 8], threads_per_warp=[1, 2, 16],
                                              warps_per_cta=[1, _W, 1], order=[2, 1, 0]))


@gluon.jit
def _attend_keys_m(qt, k_stage, v_stage, m3, l4, acc, n0, seq_len, MASKED: gl.constexpr):
    """_attend for ``variant="keys_m"``: qt [W, 128, 8] (_B), m3 [W, 8] (SliceLayout(1, _MMA)),
    l4 [W, 16, 8] per-thread partial sums (_MMA), acc = O^T [W, 128, 8] (_MMA)."""
    ka = gl.convert_layout(k_stage._reinterpret(gl.float8e4nv, [_W, _PG, _D], _KA_VIEW).load(_KA_LOAD)
                           .to(gl.float16), _A)  # [4, 16 keys, 128]
    vt_view = v_stage._reinterpret(gl.float8e4nv, [_W, _D, _PG], _VT_VIEW)
    s = mma_v2(ka, qt, gl.zeros([_W, _PG, 8], gl.float32, _MMA))  # [4, 16 keys, 8 heads]
    if MASKED:
        offs_p = gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _MMA)))
        offs_j = gl.arange(0, _PG, layout=gl.SliceLayout(0, gl.SliceLayout(2, _MMA)))
        key = n0 + gl.expand_dims(gl.expand_dims(offs_p * _PG, 1), 2) + gl.expand_dims(gl.expand_dims(offs_j, 0), 2)
        s = gl.where(key < seq_len, s, float("-inf"))
        m_new = gl.maximum(m3, gl.max(s, 1))
        m_exp = gl.where(m_new == float("-inf"), 0.0, m_new)  # a piece with no key yet
    else:
        m_new = gl.maximum(m3, gl.max(s, 1))  # 16 valid keys: finite
        m_exp = m_new
    alpha = gl.exp2(m3 - m_exp)
    p = gl.exp2(s - gl.expand_dims(m_exp, 1))
    l4 = l4 * gl.expand_dims(alpha, 1) + p
    pt = gl.convert_layout(p.to(gl.float16), _B)  # [4, 16 keys, 8 heads]: a transpose in each warp
    vt = gl.convert_layout(vt_view.load(_VT_LOAD).to(gl.float16), _A)  # [4, 128, 16 keys]
    if MASKED:
        offs_vp = gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _A)))
        offs_vj = gl.arange(0, _PG, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A)))
        vkey = n0 + gl.expand_dims(gl.expand_dims(offs_vp * _PG, 1), 2) + gl.expand_dims(gl.expand_dims(offs_vj, 0), 1)
        vt = gl.where(vkey < seq_len, vt, 0.0)
    acc = mma_v2(vt, pt, acc * gl.expand_dims(alpha, 1))
    return m_new, l4, acc


@gluon.jit(do_not_specialize=["num_items"])
def _paged_decode_gluon_persistent_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, out_ptr,
    sm_scale_log2,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    num_items,  # batch * HKV
    HKV: gl.constexpr,  # KV heads
    GROUP: gl.constexpr,  # query heads per KV head (<= 16; KEYS_M: <= 8)
    S: gl.constexpr,  # stages: tiles in the buffer (S - 1 in flight while one is computed)
    KEYS_M: gl.constexpr = False,  # variant "keys_m" (else "default")
):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)

    kv = gl.allocate_shared_memory(gl.float8e4nv, [2 * S, _BN, _D], _TMA_SMEM)  # stage s: K 2s, V 2s + 1
    merge_bufs = kv._reinterpret(gl.float16, [S, _W, 16, _D], _MERGE_SMEM)
    merge_bufs_t = kv._reinterpret(gl.float16, [2 * S, _W, 8, _D], _MERGE_SMEM)  # KEYS_M: K halves
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(bars.index(s), count=1)
    gl.thread_barrier()

    # The producer cursor at the program's first item with a key; its first S - 1 tiles in
    # flight (across items where they are short).
    p_item, p_nt, p_bt_row, p_last_page, p_col = _seek(pid, nprog, num_items, HKV, seq_lens_ptr,
                                                        block_tables_ptr, stride_btb)
    p_tile = 0
    b0, b1, b2, b3 = _tile_blocks(p_bt_row, 0, p_last_page)
    for t in gl.static_range(S - 1):
        b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row, p_last_page, p_col = _produce(
            k_desc, v_desc, kv, bars, t, b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row,
            p_last_page, p_col, nprog, num_items, HKV, seq_lens_ptr, block_tables_ptr, stride_btb, S)
    q_next = _load_q_next(q_ptr, pid, num_items, HKV, stride_qb, stride_qh, GROUP)
    seq_len_next = gl.load(seq_lens_ptr + pid // HKV)

    o_layout: gl.constexpr = gl.SliceLayout(0, _MERGE_LOAD)
    rows = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, o_layout)), 1)
    cols = gl.expand_dims(_v_column(gl.arange(0, _D, layout=gl.SliceLayout(0, o_layout))), 0)
    a_zeros = gl.zeros([_W, 16, _D], gl.float16, _A)
    ot_layout: gl.constexpr = gl.SliceLayout(0, _MERGE_LOAD_T)
    rows_t = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, ot_layout)), 1)
    cols_t = gl.expand_dims(_v_column(gl.arange(0, _D, layout=gl.SliceLayout(0, ot_layout))), 0)

    g = 0  # tiles consumed by this program: stage g % S, phase (g // S) & 1
    for item in range(pid, num_items, nprog):
        b = item // HKV
        kvh = item % HKV
        seq_len = seq_len_next
        nt = gl.cdiv(seq_len, _BN)
        if KEYS_M:
            # q^T [128, 8 heads] as the B operand, moved raw and scaled in place (the
            # conversion's registers cross the mma's pairs: scaled there, each pair is written once
            # per item instead of copied before every QK HMMA).
            qt = gl.convert_layout(gl.permute(q_next, [1, 0]), gl.SliceLayout(0, _B))  # [128, 16]
            qt, _ = gl.split(gl.permute(gl.reshape(qt, [_D, 2, 8]), [0, 2, 1]))  # heads 0-7
            qt = gl.convert_layout(qt, gl.SliceLayout(0, _B), assert_trivial=True)
            qt = gl.expand_dims((qt.to(gl.float32) * sm_scale_log2).to(gl.float16), 0)
            q, _ = gl.broadcast(qt, gl.zeros([_W, _D, 8], gl.float16, _B))
        else:
            # q in the A operand layout (every warp a copy), scaled and rounded to fp16 once.
            q1 = (q_next.to(gl.float32) * sm_scale_log2).to(gl.float16)
            q1 = gl.expand_dims(gl.convert_layout(q1, gl.SliceLayout(0, _A)), 0)
            q, _ = gl.broadcast(q1, a_zeros)
        q_next = _load_q_next(q_ptr, item + nprog, num_items, HKV, stride_qb, stride_qh, GROUP)
        seq_len_next = gl.load(seq_lens_ptr + (item + nprog) // HKV, mask=item + nprog < num_items, other=0)

        if KEYS_M:
            m3 = gl.full([_W, 8], float("-inf"), gl.float32, gl.SliceLayout(1, _MMA))
            l3 = gl.zeros([_W, _PG, 8], gl.float32, _MMA)  # per-thread partial sums
            acc = gl.zeros([_W, _D, 8], gl.float32, _MMA)  # O^T
        else:
            m3 = gl.full([_W, 16], float("-inf"), gl.float32, gl.SliceLayout(2, _MMA))
            l3 = gl.zeros([_W, 16], gl.float32, gl.SliceLayout(2, _MMA))
            acc = gl.zeros([_W, 16, _D], gl.float32, _MMA)
        for i in range(nt - 1):  # every tile but the last: 64 valid keys
            gl.thread_barrier()  # every warp is done reading tile g - 1's stage
            fence_async_shared()  # ... before the async proxy overwrites it
            b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row, p_last_page, p_col = _produce(
                k_desc, v_desc, kv, bars, g + S - 1, b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row,
                p_last_page, p_col, nprog, num_items, HKV, seq_lens_ptr, block_tables_ptr, stride_btb, S)
            stage = g % S
            mbarrier.wait(bars.index(stage), (g // S) & 1)
            if KEYS_M:
                m3, l3, acc = _attend_keys_m(q, kv.index(2 * stage), kv.index(2 * stage + 1), m3, l3, acc,
                                             i * _BN, seq_len, False)
            else:
                m3, l3, acc = _attend(q, kv.index(2 * stage), kv.index(2 * stage + 1), m3, l3, acc,
                                      i * _BN, seq_len, False)
            g += 1
        if nt > 0:
            gl.thread_barrier()
            fence_async_shared()
            b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row, p_last_page, p_col = _produce(
                k_desc, v_desc, kv, bars, g + S - 1, b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row,
                p_last_page, p_col, nprog, num_items, HKV, seq_lens_ptr, block_tables_ptr, stride_btb, S)
            stage = g % S
            mbarrier.wait(bars.index(stage), (g // S) & 1)
            if KEYS_M:
                m3, l3, acc = _attend_keys_m(q, kv.index(2 * stage), kv.index(2 * stage + 1), m3, l3, acc,
                                             (nt - 1) * _BN, seq_len, True)
            else:
                m3, l3, acc = _attend(q, kv.index(2 * stage), kv.index(2 * stage + 1), m3, l3, acc,
                                      (nt - 1) * _BN, seq_len, True)
            g += 1

        # The pieces merged (a piece that saw no key has m = -inf: weight 0; no key at all: zeros),
        # each normalized in registers (|values| <= max |V|: fp16) and summed through the stage the
        # next issue will refill (g + S - 1: not in flight; its refill waits for the CTA barrier at
        # the top of the next tile).
        if KEYS_M:
            l3 = gl.sum(l3, 1)
        m = gl.max(m3, 0)
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        w3 = gl.exp2(m3 - gl.expand_dims(m_safe, 0))
        l = gl.sum(l3 * w3, 0)
        w3 = w3 / gl.expand_dims(gl.where(l > 0.0, l, 1.0), 0)
        if KEYS_M:
            merge_buf_t = merge_bufs_t.index(2 * ((g + S - 1) % S))
            w3o = gl.convert_layout(w3, gl.SliceLayout(1, _MMA))
            gl.thread_barrier()  # every warp is done reading the last tile's stage (the same one)
            merge_buf_t.store(gl.permute((acc * gl.expand_dims(w3o, 1)).to(gl.float16), [0, 2, 1]))
            gl.thread_barrier()
            o_t = gl.sum(merge_buf_t.load(_MERGE_LOAD_T).to(gl.float32), 0)  # [8, 128]
            out_ptrs = out_ptr + b.to(gl.int64) * stride_ob + (kvh * GROUP + rows_t).to(gl.int64) * stride_oh + cols_t
            gl.store(out_ptrs, o_t.to(out_ptr.dtype.element_ty), mask=(rows_t < GROUP) & (cols_t < _D))
        else:
            merge_buf = merge_bufs.index((g + S - 1) % S)
            gl.thread_barrier()  # every warp is done reading the last tile's stage (the same one)
            merge_buf.store((acc * gl.expand_dims(w3, 2)).to(gl.float16))
            gl.thread_barrier()
            o = gl.sum(merge_buf.load(_MERGE_LOAD).to(gl.float32), 0)  # [16, 128]
            out_ptrs = out_ptr + b.to(gl.int64) * stride_ob + (kvh * GROUP + rows).to(gl.int64) * stride_oh + cols
            gl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=(rows < GROUP) & (cols < _D))
    for s in gl.static_range(S):  # every issued tile was waited on (the producer issues none past the end)
        mbarrier.invalidate(bars.index(s))


def _cache_descriptor(cache: torch.Tensor):
    """A TMA descriptor over a cache seen as [num_blocks * 16, Hkv * 128] (row = block * 16 +
    slot), one [16, 128] box per page piece of one KV head."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_blocks, page, hkv, d = cache.shape
    flat = cache.view(num_blocks * page, hkv * d)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [PAGE, HEAD_DIM], _TMA_SMEM.value)


def _check(q, key_cache, value_cache, block_tables, seq_lens, out):
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError("paged_decode_gluon runs on CUDA sm_90 (Hopper) only")
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16) or q.stride(-1) != 1:
        raise ValueError(f"q must be bf16/fp16 [batch, num_q_heads, 128] contiguous in its last dim, "
                         f"got {q.dtype} {tuple(q.shape)}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name} must be float8_e4m3fn, got {c.dtype}")
        if c.dim() != 4 or c.shape[1] != PAGE or c.shape[3] != HEAD_DIM or not c.is_contiguous():
            raise ValueError(f"{name} must be contiguous [num_blocks, {PAGE}, num_kv_heads, {HEAD_DIM}], "
                             f"got {tuple(c.shape)}")
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if head_dim != HEAD_DIM:
        raise ValueError(f"head_dim must be {HEAD_DIM}, got {head_dim}")
    if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > 16:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be 1-16 times num_kv_heads ({num_kv_heads})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks] contiguous in its last dim, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last dimension")


def paged_decode_gluon(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    variant: str = "default",
    programs_per_sm: int | None = None,
) -> torch.Tensor:
    """paged_decode (kernels/paged_decode.py) over an fp8 cache, in Gluon.

    q            [B, Hq, 128] bf16 or fp16
    key_cache    [num_blocks, 16, Hkv, 128] float8_e4m3fn, contiguous (value_cache the same)
    block_tables int32 [B, max_blocks]; entries past seq_lens are never read
    seq_lens     int32 [B]   context length, the query's own token included
    returns out  [B, Hq, 128] in q's dtype (written into ``out`` when given)

    No sliding window, no key splits: programs_per_sm x SMs persistent programs, each over
    (sequence, KV head) items as one tile stream; ``variant`` one of VARIANTS, ``programs_per_sm``
    None for PROGRAMS_PER_SM (``engine_form`` gives what paged_decode runs).
    """
    return _launch(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale, out=out,
                   variant=variant, programs_per_sm=programs_per_sm or PROGRAMS_PER_SM)


def engine_form(group: int, choice: str | None = None) -> dict:
    """The variant and programs per SM that paged_decode runs for a GQA ``group``: "keys_m" at 4
    programs an SM (run 79, H200: 83-94% of copy at the engine's fp8 shapes against the default
    variant's 75-88% at 3 an SM); the default variant at 3 where the group is over 8 (keys_m pads
    it to 8 rows). ``choice`` (FLASHPAGE_DECODE_GLUON's value when it names a variant) forces one
    where it can run."""
    variant = ENGINE_VARIANT if choice is None else choice
    if variant not in VARIANTS:
        raise ValueError(f"FLASHPAGE_DECODE_GLUON: 0, 1 or one of {list(VARIANTS)}, got {variant!r}")
    if group > 8:
        variant = "default"
    return {"variant": variant, "programs_per_sm": PROGRAMS_PER_SM if variant == "default" else 4}


VARIANTS = ("default", "keys_m")  # the kernel's KEYS_M constexpr: keys_m cuts a tile's instructions
PROGRAMS_PER_SM = 3  # the default: as many as the default variant's registers allow
ENGINE_VARIANT = "keys_m"  # paged_decode's form (engine_form)


def persistent_max_regs(programs_per_sm: int) -> int | None:
    """The kernel's ptxas register cap for ``programs_per_sm`` 128-thread programs on an SM
    (64K registers; a multiple of 8): None at 1-2 (no cap), 168 at 3, 128 at 4."""
    regs = 65536 // (programs_per_sm * 32 * NUM_WARPS) // 8 * 8
    return None if regs >= 256 else regs


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(q, key_cache, value_cache, block_tables, seq_lens, *, sm_scale=None, out=None,
            max_regs: int | None = None, stages: int = STAGES, programs_per_sm: int = PROGRAMS_PER_SM,
            programs: int | None = None, variant: str = "default"):
    """paged_decode_gluon with its knobs: min(batch x Hkv, ``programs_per_sm`` x SMs) programs
    (``programs``: that many instead, for tests: several items a program), ``max_regs`` the
    ptxas register cap (None for ``persistent_max_regs(programs_per_sm)``), ``stages`` tiles in
    the buffer (STAGES - 1 in flight). ``variant``: "default" or "keys_m" (S^T = K Q^T and O^T =
    V^T P^T; GQA groups <= 8)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    if not 1 <= programs_per_sm <= 4:  # 5 would not fit in shared memory (51 KB each)
        raise ValueError(f"programs_per_sm must be 1-4, got {programs_per_sm}")
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    _check(q, key_cache, value_cache, block_tables, seq_lens, out)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_q_heads // num_kv_heads
    if variant != "default" and group > 8:
        raise ValueError(f"variant {variant!r} pads the GQA group to 8: at most 8 query heads per KV head, "
                         f"got {group}")
    max_regs = max_regs or persistent_max_regs(programs_per_sm)
    num_items = batch * num_kv_heads
    if programs is None:
        programs = programs_per_sm * _num_sms(torch.cuda.current_device() if q.device.index is None
                                              else q.device.index)
    grid = min(num_items, max(1, programs))
    _paged_decode_gluon_persistent_kernel[(grid,)](
        q, _cache_descriptor(key_cache), _cache_descriptor(value_cache), block_tables, seq_lens, out,
        sm_scale * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        num_items, HKV=num_kv_heads, GROUP=group, S=stages, KEYS_M=variant == "keys_m",
        num_warps=NUM_WARPS, **({"maxnreg": max_regs} if max_regs else {}))
    return out
