"""Paged decode over a bf16 / fp16 KV cache, in Gluon for sm_90: the fp8 prototype's
structure (kernels/paged_decode_gluon.py) with 16-bit K and V read by ``ldmatrix``.

Same contract as ``paged_decode`` for the engine's 16-bit decode: q [B, Hq, 128] bf16/fp16,
key_cache / value_cache [num_blocks, 16, Hkv, 128] in q's dtype, contiguous; one program per
(KV head, sequence), KV heads fastest, no key splits, no window; dots in q's dtype, fp32
scores (scaled by sm_scale·log2(e) after the dot) and accumulation, base-2 online softmax.

A 128-dim row is 256 bytes, twice the 128-byte swizzle span, so a page piece (16 keys of one
KV head) lands as *one* 3-D TMA box [2 halves, 16 keys, 64 dims] over the cache seen as
[Hkv * 2 halves, num_blocks * 16 rows, 64] (strides 64, Hkv * 128, 1: a permuted view, no
copy)::

    key_cache[blk, 0:16, kvh, 0:64]   --> K stage, piece p, half 0: 16 rows of 128 bytes
    key_cache[blk, 0:16, kvh, 64:128] --> K stage, piece p, half 1      (128-byte swizzle:
                                          16-byte chunk c of key k at chunk c ^ (k % 8))

Half-major (not key-major [16, 2, 64]) so that the swizzle row is the key: the 8 keys an
``ldmatrix`` 8x8 reads sit in 8 different chunks (no bank conflict).

- Each 64-key tile is 4 pieces (one page each) in one ``STAGES``-deep buffer, its 8 boxes
  (4 K, 4 V: 32 KB) counted by one mbarrier; warp p owns piece p of every tile with its own
  softmax state, merged once at the end (as the fp8 kernel).
- The stage is read back through views (``SharedLinearLayout``) that undo the swizzle: K^T
  [piece, dim, key] for the mma_v2 B operand (``ldmatrix``, 8 x4 loads a warp a tile) and V
  [piece, key, dim] (``ldmatrix.trans``, 8 x4 loads). No permutation of the head dim: q and
  the output are in natural order.

The last tile of each sequence is masked (keys past seq_len: scores -inf, V rows zeroed: an
unowned slot may hold NaN, and 0 · NaN is NaN in the P·V dot); its pieces past the context
re-read the last valid page (an L2 hit) instead of leaving a stage part-filled.

Shared memory: 32 KB a stage (+ a few hundred bytes of barriers and scratch); STAGES 2
(default) allows 3 programs per SM, 3 two. sm_90 SASS (Triton 3.6) of the main loop, per warp
per 64-key tile: 394 instructions, 8 UTMALDG.3D, 8 LDSM (K), 8 LDSM.T (V), 32 HMMA, no other
shared load, 10 BAR.SYNC (Triton's barrier analysis puts one between consecutive TMA issues,
as in the fp8 kernel); 167 registers, no spill.

Variants, ``_launch`` knobs for the benchmark: ``stages``; ``warp_specialize`` (a TMA producer
partition and 4 one-warp compute partitions, see its section: compute loop 223 instructions,
no BAR.SYNC), with ``lazy`` rescaling; ``half_boxes`` (two 2-D [16, 64] boxes a piece over the
cache as it is, instead of one 3-D box over a permuted view: the same bytes in the same places,
16 TMA issues a tile).
"""

from __future__ import annotations

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
BLOCK_N = PAGE * NUM_WARPS
HALF = HEAD_DIM // 2  # a TMA box row: 64 16-bit elements = the 128-byte swizzle span
STAGES = 2  # default: 2 x 32 KB, 3 programs per SM

_D = gl.constexpr(HEAD_DIM)
_H = gl.constexpr(HALF)
_PG = gl.constexpr(PAGE)
_W = gl.constexpr(NUM_WARPS)
_BN = gl.constexpr(BLOCK_N)

# mma_v2 m16n8k16 over [piece, rows, cols]: warp p computes piece p (as the fp8 kernel's).
_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[_W, 1, 1],
                                              instr_shape=[1, 16, 8]))
_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA, k_width=2))
_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA, k_width=2))
# A page piece as TMA lands it: [2 halves, 16 keys, 64 dims], 128-byte swizzle over the
# 128-byte rows (half, key): chunk c of row r at chunk c ^ (r % 8) = c ^ (key % 8).
_TMA_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
# The same bytes as two [16 keys, 64 dims] boxes of a 2-D descriptor (``half_boxes``).
_TMA_SMEM_2D = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))

# Views of one stage ([4 pieces, 2, 16, 64] 16-bit = 16 KB, element offset bits 0-12) as the
# mma operands, offset bit -> logical coordinate. Physical: bits 0-2 the element in a 16-byte
# chunk, bits 3-5 the chunk (dim bits 3-5, XORed with key bits 0-2), bits 6-9 the key, bit 10
# the half (dim bit 6), bits 11-12 the piece.
_K_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[  # [piece, dim, key]
    [0, 1, 0], [0, 2, 0], [0, 4, 0],
    [0, 8, 0], [0, 16, 0], [0, 32, 0],
    [0, 8, 1], [0, 16, 2], [0, 32, 4], [0, 0, 8],  # key bits 0-3 (and the chunk swizzle)
    [0, 64, 0],  # the half
    [1, 0, 0], [2, 0, 0],  # the piece
]))
_V_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[  # [piece, key, dim]
    [0, 0, 1], [0, 0, 2], [0, 0, 4],
    [0, 0, 8], [0, 0, 16], [0, 0, 32],
    [0, 1, 8], [0, 2, 16], [0, 4, 32], [0, 8, 0],
    [0, 0, 64],
    [1, 0, 0], [2, 0, 0],
]))


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
def _issue_piece(desc, smem, bar, hrow, blk, p: gl.constexpr, HALF_BOXES: gl.constexpr, pred):
    """Piece p of a stage: one [2, 16, 64] box at (hrow, blk * 16), or (HALF_BOXES) two [16, 64]
    boxes of a 2-D descriptor at (blk * 16, 128 kvh) and (blk * 16, 128 kvh + 64), the same
    bytes in the same places (hrow = 2 kvh)."""
    if HALF_BOXES:
        dst0 = smem.slice(2 * p, 1)._reinterpret(desc.dtype, [_PG, _H], _TMA_SMEM_2D)
        dst1 = smem.slice(2 * p + 1, 1)._reinterpret(desc.dtype, [_PG, _H], _TMA_SMEM_2D)
        tma.async_copy_global_to_shared(desc, [blk * _PG, hrow * _H], bar, dst0, pred=pred)
        tma.async_copy_global_to_shared(desc, [blk * _PG, hrow * _H + _H], bar, dst1, pred=pred)
    else:
        tma.async_copy_global_to_shared(desc, [hrow, blk * _PG, 0], bar, smem.slice(2 * p, 2), pred=pred)


@gluon.jit
def _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, tile, b0, b1, b2, b3, hrow,
                STAGES: gl.constexpr, HALF_BOXES: gl.constexpr, pred):
    """TMA of a tile's 4 K and 4 V pieces into stage tile % STAGES, on its mbarrier."""
    stage = tile % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, 2 * _BN * _D * k_desc.dtype.primitive_bitwidth // 8, pred=pred)
    ks = k_smem.index(stage)
    vs = v_smem.index(stage)
    _issue_piece(k_desc, ks, bar, hrow, b0, 0, HALF_BOXES, pred)
    _issue_piece(v_desc, vs, bar, hrow, b0, 0, HALF_BOXES, pred)
    _issue_piece(k_desc, ks, bar, hrow, b1, 1, HALF_BOXES, pred)
    _issue_piece(v_desc, vs, bar, hrow, b1, 1, HALF_BOXES, pred)
    _issue_piece(k_desc, ks, bar, hrow, b2, 2, HALF_BOXES, pred)
    _issue_piece(v_desc, vs, bar, hrow, b2, 2, HALF_BOXES, pred)
    _issue_piece(k_desc, ks, bar, hrow, b3, 3, HALF_BOXES, pred)
    _issue_piece(v_desc, vs, bar, hrow, b3, 3, HALF_BOXES, pred)


@gluon.jit
def _attend(q, k_smem, v_smem, stage, m3, l3, acc, n0, seq_len, sm_scale_log2, MASKED: gl.constexpr):
    """One 64-key tile from stage ``stage``: warp p's online-softmax step over keys
    n0 + 16p .. n0 + 16p + 15 (MASKED: keys >= seq_len dropped, their V rows zeroed)."""
    dtype: gl.constexpr = q.dtype
    kt = k_smem.index(stage)._reinterpret(dtype, [_W, _D, _PG], _K_VIEW).load(_B)  # [4, 128, 16]
    s = mma_v2(q, kt, gl.zeros([_W, 16, _PG], gl.float32, _MMA)) * sm_scale_log2  # [4, 16 rows, 16 keys]
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
    pa = gl.convert_layout(p.to(dtype), _A)  # the accumulator's registers already
    v = v_smem.index(stage)._reinterpret(dtype, [_W, _PG, _D], _V_VIEW).load(_B)  # [4, 16 keys, 128]
    if MASKED:
        offs_vp = gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _B)))
        offs_vj = gl.arange(0, _PG, layout=gl.SliceLayout(0, gl.SliceLayout(2, _B)))
        vkey = n0 + gl.expand_dims(gl.expand_dims(offs_vp * _PG, 1), 2) + gl.expand_dims(gl.expand_dims(offs_vj, 0), 2)
        v = gl.where(vkey < seq_len, v, 0.0)
    acc = mma_v2(pa, v, acc * gl.expand_dims(alpha, 2))
    return m_new, l3, acc


@gluon.jit
def _paged_decode_gluon_bf16_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, out_ptr,
    sm_scale_log2,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    GROUP: gl.constexpr,  # query heads per KV head (<= 16)
    STAGES: gl.constexpr,  # tiles in the buffer: STAGES - 1 in flight while one is computed
    HALF_BOXES: gl.constexpr,  # two 2-D boxes a piece instead of one 3-D box
):
    kvh = gl.program_id(0)  # KV heads fastest
    b = gl.program_id(1)
    seq_len = gl.load(seq_lens_ptr + b)
    b64 = b.to(gl.int64)
    bt_row = block_tables_ptr + b64 * stride_btb
    num_tiles = gl.cdiv(seq_len, _BN)
    last_page = gl.maximum(seq_len - 1, 0) // _PG
    hrow = kvh * 2  # the descriptor's outer coordinate: (KV head, half 0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # Stage s: [4 pieces x 2 halves, 16 keys, 64 dims]; piece p's box at rows 2p, 2p + 1.
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 2 * _W, _PG, _H], _TMA_SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 2 * _W, _PG, _H], _TMA_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    gl.thread_barrier()

    # The first STAGES - 1 tiles in flight; the next tile's pages loaded one iteration ahead
    # of their TMA (no warp waits on a block-table load before an issue).
    for t in gl.static_range(STAGES - 1):
        b0, b1, b2, b3 = _tile_blocks(bt_row, t, last_page)
        _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, t, b0, b1, b2, b3, hrow, STAGES, HALF_BOXES,
                    t < num_tiles)
    b0, b1, b2, b3 = _tile_blocks(bt_row, STAGES - 1, last_page)

    # q in the A operand layout (every warp a copy; rows >= GROUP zero), unscaled.
    offs_r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A)))
    offs_k = gl.arange(0, _D, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A)))
    offs_w = gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _A)))
    r3 = gl.expand_dims(gl.expand_dims(offs_r, 0), 2) + gl.expand_dims(gl.expand_dims(offs_w * 0, 1), 2)
    k3 = gl.expand_dims(gl.expand_dims(offs_k, 0), 1)
    head0 = kvh * GROUP
    q_ptrs = q_ptr + b64 * stride_qb + (head0 + r3).to(gl.int64) * stride_qh + k3
    q = gl.load(q_ptrs, mask=(r3 < GROUP) & (k3 < _D), other=0.0)

    m3 = gl.full([_W, 16], float("-inf"), gl.float32, gl.SliceLayout(2, _MMA))
    l3 = gl.zeros([_W, 16], gl.float32, gl.SliceLayout(2, _MMA))
    acc = gl.zeros([_W, 16, _D], gl.float32, _MMA)

    for i in range(num_tiles - 1):  # every tile but the last: 64 valid keys
        gl.thread_barrier()  # every warp is done reading tile i - 1's stage
        fence_async_shared()  # ... before the async proxy overwrites it
        t_next = i + STAGES - 1
        _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, t_next, b0, b1, b2, b3, hrow, STAGES, HALF_BOXES,
                    t_next < num_tiles)
        b0, b1, b2, b3 = _tile_blocks(bt_row, t_next + 1, last_page)
        stage = i % STAGES
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        m3, l3, acc = _attend(q, k_smem, v_smem, stage, m3, l3, acc, i * _BN, seq_len, sm_scale_log2, False)
    if num_tiles > 0:
        last = num_tiles - 1
        stage = last % STAGES
        mbarrier.wait(bars.index(stage), (last // STAGES) & 1)
        m3, l3, acc = _attend(q, k_smem, v_smem, stage, m3, l3, acc, last * _BN, seq_len, sm_scale_log2, True)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    # The pieces merged (a piece that saw no key has m = -inf: weight 0).
    m = gl.max(m3, 0)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    w3 = gl.exp2(m3 - gl.expand_dims(m_safe, 0))
    l = gl.sum(l3 * w3, 0)
    o = gl.sum(acc * gl.expand_dims(w3, 2), 0)  # [16, 128]
    o_layout: gl.constexpr = gl.SliceLayout(0, _MMA)
    l = gl.convert_layout(gl.where(l > 0.0, l, 1.0), gl.SliceLayout(1, o_layout))
    o = o / gl.expand_dims(l, 1)
    rows = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, o_layout)), 1)
    cols = gl.expand_dims(gl.arange(0, _D, layout=gl.SliceLayout(0, o_layout)), 0)
    out_ptrs = out_ptr + b64 * stride_ob + (head0 + rows).to(gl.int64) * stride_oh + cols
    gl.store(out_ptrs, o.to(dtype), mask=(rows < GROUP) & (cols < _D))


# --------------------------------------------------------------------------- warp-specialized variant
#
# ``_launch(..., warp_specialize=True)``: the fp8 kernel's warp-specialized structure (see
# paged_decode_gluon.py) with this file's boxes and views: a 4-warp producer (the default
# partition; warp 0's elected lane issues) waits on a stage's *empty* barrier and issues its
# 8 boxes on its *ready* barrier; 4 one-warp compute partitions, warp p owning piece p of every
# tile, wait on ready and arrive on empty (count 4) once K and V are in registers, before the
# P·V dot: no bar.sync in their loop, and a stage is refilled as soon as every warp has read
# it. At the end the 4 accumulators ([16, 128] fp32, 8 KB each) meet in the K buffer (32 KB at
# STAGES >= 2) and warp p writes output columns 32p .. 32p + 31.
#
# ``lazy`` (a constexpr; 1-warp partitions make the test a warp-uniform branch): a warp keeps
# its running max and skips rescaling l and the accumulator (64 multiplies a thread a tile)
# unless some row's max grew by more than 2^LAZY_LOG2; p = 2^(s - m) then stays below 2^8.
#
# Registers: 8 warps, 256 threads; setmaxnreg leaves the producer's warpgroup 24 a thread and
# gives the compute warps 2 M - 24 under ``maxnreg`` M (WS_MAXNREG: STAGES 2, 3 programs per SM
# by shared memory: M 80, 136; STAGES 3, 2 per SM: M 128, 232).

LAZY_LOG2 = gl.constexpr(8.0)
WS_MAXNREG = {2: 80, 3: 128}  # STAGES -> maxnreg: the programs per SM that shared memory allows

_MMA1 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
_A1 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA1, k_width=2))
_B1 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA1, k_width=2))
# One piece ([2, 16, 64] 16-bit = 4 KB, element offset bits 0-10) as _K_VIEW / _V_VIEW see it.
_K_VIEW1 = gl.constexpr(gl.SharedLinearLayout(offset_bases=[  # [dim, key]
    [1, 0], [2, 0], [4, 0], [8, 0], [16, 0], [32, 0],
    [8, 1], [16, 2], [32, 4], [0, 8], [64, 0],
]))
_V_VIEW1 = gl.constexpr(gl.SharedLinearLayout(offset_bases=[  # [key, dim]
    [0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32],
    [1, 8], [2, 16], [4, 32], [8, 0], [0, 64],
]))
# The merge: a piece's accumulator [16, 128] fp32 (row-major, 8-byte vectors XOR-swizzled by
# row against bank conflicts), read back 32 columns a warp.
_ACC_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0]))
_ROWS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
_OUT1 = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                      order=[1, 0]))


@gluon.jit
def _ws_produce(k_desc, v_desc, kv_k, kv_v, ready, empty, bt_row, num_tiles, last_page, hrow,
                STAGES: gl.constexpr, HALF_BOXES: gl.constexpr):
    """Producer partition: tile t into stage t % STAGES once every compute warp has released it
    (the stage's empty barrier), its block ids loaded one tile ahead."""
    b0, b1, b2, b3 = _tile_blocks(bt_row, 0, last_page)
    for t in range(num_tiles):
        stage = t % STAGES
        mbarrier.wait(empty.index(stage), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        fence_async_shared()  # the compute warps' generic reads before the async proxy's writes
        _issue_tile(k_desc, v_desc, kv_k, kv_v, ready, t, b0, b1, b2, b3, hrow, STAGES, HALF_BOXES, True)
        b0, b1, b2, b3 = _tile_blocks(bt_row, t + 1, last_page)


@gluon.jit
def _attend_piece(q, k_piece, v_piece, empty_bar, m, l, acc, key0, seq_len, sm_scale_log2,
                  MASKED: gl.constexpr, LAZY: gl.constexpr):
    """_attend for one warp: keys key0 .. key0 + 15 from its piece of a stage; the stage's empty
    barrier arrived on once K and V are in registers. LAZY: see the section's comment (unmasked
    tiles only; a -inf row's growth is inf, so the first tile always rescales)."""
    dtype: gl.constexpr = q.dtype
    kt = k_piece._reinterpret(dtype, [_D, _PG], _K_VIEW1).load(_B1)  # [128, 16]
    s = mma_v2(q, kt, gl.zeros([16, _PG], gl.float32, _MMA1)) * sm_scale_log2  # [16 rows, 16 keys]
    if MASKED:
        offs_j = gl.arange(0, _PG, layout=gl.SliceLayout(0, _MMA1))
        s = gl.where(gl.expand_dims(key0 + offs_j, 0) < seq_len, s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1))
        m_exp = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m, gl.max(s, 1))
        m_exp = m_new
    if LAZY:
        if gl.max(m_new - m, 0) > LAZY_LOG2:
            alpha = gl.exp2(m - m_new)
            acc = acc * gl.expand_dims(alpha, 1)
            l = l * alpha
            m = m_new
        p = gl.exp2(s - gl.expand_dims(m, 1))
        l = l + gl.sum(p, 1)
        m_new = m
    else:
        alpha = gl.exp2(m - m_exp)
        p = gl.exp2(s - gl.expand_dims(m_exp, 1))
        l = l * alpha + gl.sum(p, 1)
        acc = acc * gl.expand_dims(alpha, 1)
    pa = gl.convert_layout(p.to(dtype), _A1)
    v = v_piece._reinterpret(dtype, [_PG, _D], _V_VIEW1).load(_B1)  # [16 keys, 128]
    mbarrier.arrive(empty_bar)  # this warp is done with the stage
    if MASKED:
        offs_vj = gl.arange(0, _PG, layout=gl.SliceLayout(1, _B1))
        v = gl.where(gl.expand_dims(key0 + offs_vj, 1) < seq_len, v, 0.0)
    acc = mma_v2(pa, v, acc)
    return m_new, l, acc


@gluon.jit
def _ws_compute(q_ptr, out_ptr, kv_k, kv_v, ml, ready, empty, sync, seq_len, num_tiles, b64, kvh,
                sm_scale_log2, stride_qb, stride_qh, stride_ob, stride_oh,
                GROUP: gl.constexpr, STAGES: gl.constexpr, LAZY: gl.constexpr, P: gl.constexpr):
    """Compute partition (one warp): piece P of every tile, then its share of the merge."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    head0 = kvh * GROUP
    r2 = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, _A1)), 1)
    k2 = gl.expand_dims(gl.arange(0, _D, layout=gl.SliceLayout(0, _A1)), 0)
    q_ptrs = q_ptr + b64 * stride_qb + (head0 + r2).to(gl.int64) * stride_qh + k2
    q = gl.load(q_ptrs, mask=(r2 < GROUP) & (k2 < _D), other=0.0)

    m = gl.full([16], float("-inf"), gl.float32, gl.SliceLayout(1, _MMA1))
    l = gl.zeros([16], gl.float32, gl.SliceLayout(1, _MMA1))
    acc = gl.zeros([16, _D], gl.float32, _MMA1)
    for i in range(num_tiles - 1):  # every tile but the last: 64 valid keys
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        m, l, acc = _attend_piece(q, kv_k.index(stage).slice(2 * P, 2), kv_v.index(stage).slice(2 * P, 2),
                                  empty.index(stage), m, l, acc, i * _BN + P * _PG, seq_len, sm_scale_log2,
                                  False, LAZY)
    if num_tiles > 0:
        last = num_tiles - 1
        stage = last % STAGES
        mbarrier.wait(ready.index(stage), (last // STAGES) & 1)
        m, l, acc = _attend_piece(q, kv_k.index(stage).slice(2 * P, 2), kv_v.index(stage).slice(2 * P, 2),
                                  empty.index(stage), m, l, acc, last * _BN + P * _PG, seq_len, sm_scale_log2,
                                  True, False)

    # The merge. Phase 0 of sync: every compute warp is past its last tile (no stage is read
    # any more, every TMA has landed): the K buffer is free.
    mbarrier.arrive(sync)
    mbarrier.wait(sync, 0)
    accs = kv_k._reinterpret(gl.float32, [2 * STAGES, 16, _D], _ACC_SMEM)  # the K buffer's bytes
    accs.index(P).store(acc)
    ml.index(P).store(m)
    ml.index(_W + P).store(l)
    mbarrier.arrive(sync)  # phase 1: every piece's m, l, acc stored
    mbarrier.wait(sync, 1)
    rows_l: gl.constexpr = gl.SliceLayout(1, _OUT1)
    m_all = ml.index(0).load(rows_l)
    for j in gl.static_range(1, _W):
        m_all = gl.maximum(m_all, ml.index(j).load(rows_l))
    m_safe = gl.where(m_all == float("-inf"), 0.0, m_all)  # no piece saw a key
    l_all = gl.zeros([16], gl.float32, rows_l)
    o = gl.zeros([16, 32], gl.float32, _OUT1)
    for j in gl.static_range(_W):
        w = gl.exp2(ml.index(j).load(rows_l) - m_safe)
        l_all += ml.index(_W + j).load(rows_l) * w
        o += accs.index(j).slice(32 * P, 32, dim=1).load(_OUT1) * gl.expand_dims(w, 1)
    o = o / gl.expand_dims(gl.where(l_all > 0.0, l_all, 1.0), 1)
    rows = gl.expand_dims(gl.arange(0, 16, layout=rows_l), 1)
    cols = gl.expand_dims(32 * P + gl.arange(0, 32, layout=gl.SliceLayout(0, _OUT1)), 0)
    out_ptrs = out_ptr + b64 * stride_ob + (head0 + rows).to(gl.int64) * stride_oh + cols
    gl.store(out_ptrs, o.to(dtype), mask=(rows < GROUP) & (cols < _D))


@gluon.jit
def _paged_decode_gluon_bf16_ws_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, out_ptr,
    sm_scale_log2,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    GROUP: gl.constexpr,  # query heads per KV head (<= 16)
    STAGES: gl.constexpr,  # >= 2 (the merge's 4 accumulators fill 2 stages of K)
    LAZY: gl.constexpr,  # lazy rescaling of the accumulator
    HALF_BOXES: gl.constexpr,  # two 2-D boxes a piece instead of one 3-D box
    COMPUTE_REGS: gl.constexpr,  # setmaxnreg of the compute warps
):
    kvh = gl.program_id(0)  # KV heads fastest
    b = gl.program_id(1)
    seq_len = gl.load(seq_lens_ptr + b)
    b64 = b.to(gl.int64)
    bt_row = block_tables_ptr + b64 * stride_btb
    num_tiles = gl.cdiv(seq_len, _BN)
    last_page = gl.maximum(seq_len - 1, 0) // _PG
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    # Stages as the 4-warp kernel's: piece p of stage s at [s, 2p:2p + 2].
    kv_k = gl.allocate_shared_memory(dtype, [STAGES, 2 * _W, _PG, _H], _TMA_SMEM)
    kv_v = gl.allocate_shared_memory(dtype, [STAGES, 2 * _W, _PG, _H], _TMA_SMEM)
    ml = gl.allocate_shared_memory(gl.float32, [2 * _W, 16], _ROWS_SMEM)  # the merge's m, l
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sync = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)  # the producer's expect; the bytes complete it
        mbarrier.init(empty.index(i), count=_W)  # one arrive per compute warp
    mbarrier.init(sync, count=_W)
    fence_async_shared()

    # One compute partition per piece (P, the last argument, a constexpr: 4 copies of the code).
    gl.warp_specialize([
        (_ws_produce, (k_desc, v_desc, kv_k, kv_v, ready, empty, bt_row, num_tiles, last_page, kvh * 2, STAGES,
                       HALF_BOXES)),
        (_ws_compute, (q_ptr, out_ptr, kv_k, kv_v, ml, ready, empty, sync, seq_len, num_tiles, b64, kvh,
                       sm_scale_log2, stride_qb, stride_qh, stride_ob, stride_oh, GROUP, STAGES, LAZY, 0)),
        (_ws_compute, (q_ptr, out_ptr, kv_k, kv_v, ml, ready, empty, sync, seq_len, num_tiles, b64, kvh,
                       sm_scale_log2, stride_qb, stride_qh, stride_ob, stride_oh, GROUP, STAGES, LAZY, 1)),
        (_ws_compute, (q_ptr, out_ptr, kv_k, kv_v, ml, ready, empty, sync, seq_len, num_tiles, b64, kvh,
                       sm_scale_log2, stride_qb, stride_qh, stride_ob, stride_oh, GROUP, STAGES, LAZY, 2)),
        (_ws_compute, (q_ptr, out_ptr, kv_k, kv_v, ml, ready, empty, sync, seq_len, num_tiles, b64, kvh,
                       sm_scale_log2, stride_qb, stride_qh, stride_ob, stride_oh, GROUP, STAGES, LAZY, 3)),
    ], [1, 1, 1, 1], [COMPUTE_REGS] * 4)


def ws_compute_regs(max_regs: int) -> int:
    """The compute warps' setmaxnreg under ``maxnreg`` = ``max_regs``: a program's 8 warps hold
    256 * max_regs registers, the producer's warpgroup keeps 24 a thread."""
    return 2 * max_regs - 24


def _cache_descriptor(cache: torch.Tensor, half_boxes: bool = False):
    """A TMA descriptor over a cache seen as [Hkv * 2, num_blocks * 16, 64] (half h of KV head
    kvh at outer coordinate 2 kvh + h, row = block * 16 + slot): one [2, 16, 64] box per page
    piece of one KV head. ``half_boxes``: over [num_blocks * 16, Hkv * 128], [16, 64] boxes."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_blocks, page, hkv, d = cache.shape
    if half_boxes:
        flat = cache.view(num_blocks * page, hkv * d)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [PAGE, HALF], _TMA_SMEM_2D.value)
    view = cache.view(num_blocks * page, hkv * 2, d // 2).permute(1, 0, 2)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [2, PAGE, HALF], _TMA_SMEM.value)


def _check(q, key_cache, value_cache, block_tables, seq_lens, out):
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float16) or q.stride(-1) != 1:
        raise ValueError(f"q must be bf16/fp16 [batch, num_q_heads, 128] contiguous in its last dim, "
                         f"got {q.dtype} {tuple(q.shape)}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        if c.device != q.device:
            raise ValueError(f"{name} is on {c.device}, q on {q.device}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dtype != q.dtype:
            raise ValueError(f"{name} must be in q's dtype {q.dtype}, got {c.dtype}")
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
    # Last, so that the checks above hold (and are tested) on any device.
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError("paged_decode_gluon_bf16 runs on CUDA sm_90 (Hopper) only")


def paged_decode_gluon_bf16(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_decode (kernels/paged_decode.py) over a 16-bit cache, in Gluon for sm_90.

    q            [B, Hq, 128] bf16 or fp16
    key_cache    [num_blocks, 16, Hkv, 128] in q's dtype, contiguous (value_cache the same)
    block_tables int32 [B, max_blocks]; entries past seq_lens are never read
    seq_lens     int32 [B]   context length, the query's own token included
    returns out  [B, Hq, 128] in q's dtype (written into ``out`` when given)

    Hq / Hkv 1-16, no sliding window, no key splits: one program per (KV head, sequence).
    """
    return _launch(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale, out=out)


def _launch(q, key_cache, value_cache, block_tables, seq_lens, *, sm_scale=None, out=None,
            stages: int = STAGES, max_regs: int | None = None, warp_specialize: bool = False,
            lazy: bool = False, half_boxes: bool = False):
    """paged_decode_gluon_bf16 with its knobs, for the benchmark: ``stages`` tiles of 32 KB in
    the buffer (2: 3 programs per SM, 3: 2), ``max_regs`` a register cap for ptxas;
    ``warp_specialize``: the warp-specialized variant (``max_regs`` then its ``maxnreg``, None:
    WS_MAXNREG[stages]), with ``lazy`` rescaling or not; ``half_boxes``: each page piece as two
    2-D TMA boxes (16 a tile) over the cache as it is, not one 3-D box over a permuted view."""
    _check(q, key_cache, value_cache, block_tables, seq_lens, out)
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    args = (q, _cache_descriptor(key_cache, half_boxes), _cache_descriptor(value_cache, half_boxes), block_tables,
            seq_lens, out, sm_scale * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0),
            out.stride(1))
    group = num_q_heads // num_kv_heads
    if warp_specialize:
        max_regs = max_regs or WS_MAXNREG.get(stages, 80)
        _paged_decode_gluon_bf16_ws_kernel[(num_kv_heads, batch)](
            *args, GROUP=group, STAGES=stages, LAZY=lazy, HALF_BOXES=half_boxes,
            COMPUTE_REGS=ws_compute_regs(max_regs), num_warps=NUM_WARPS, maxnreg=max_regs)
    else:
        _paged_decode_gluon_bf16_kernel[(num_kv_heads, batch)](
            *args, GROUP=group, STAGES=stages, HALF_BOXES=half_boxes, num_warps=NUM_WARPS,
            **({"maxnreg": max_regs} if max_regs else {}))
    return out
