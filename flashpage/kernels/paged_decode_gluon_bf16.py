"""Paged decode over a 16-bit (bf16 / fp16) KV cache, in Gluon for sm_90: the fp8 kernel's
persistent ``keys_m`` form (kernels/paged_decode_gluon.py, section 'variant="keys_m"') over pages
twice as wide, read by ``ldmatrix`` with no widening.

Same contract as ``paged_decode`` for an unsplit 16-bit call: q [B, Hq, 128] bf16/fp16,
key_cache / value_cache [num_blocks, 16, Hkv, 128] in q's dtype, GQA groups of 1-8 query heads
a KV head (padded to 8), no window, no key splits; dots in q's dtype with fp32 accumulation,
scores scaled by sm_scale·log2(e) after the dot (q is not rounded again), base-2 online
softmax, P rounded to q's dtype for the P·V dot (as the Triton kernel).

A 128-dim row is 256 bytes, twice the 128-byte swizzle span, so a page piece (16 keys of one
KV head) lands as one 3-D TMA box [2 halves, 16 keys, 64 dims] over the cache seen as
[Hkv * 2 halves, num_blocks * 16 rows, 64] (strides 64, Hkv * 128, 1: a permuted view, no
copy; session 9's commit 7eb7ddb, whose 53 GPU tests passed)::

    key_cache[blk, 0:16, kvh, 0:64]   --> K stage, piece p, half 0: 16 rows of 128 bytes
    key_cache[blk, 0:16, kvh, 64:128] --> K stage, piece p, half 1   (128-byte swizzle: 16-byte
                                          chunk c of key k at chunk c ^ (k % 8))

Half-major, so that the swizzle row is the key: the 8 rows an ``ldmatrix`` 8x8 reads sit in 8
different chunks (no bank conflict).

The persistent structure is the fp8 kernel's (see its section "the persistent kernel"): a grid of
min(items, programs_per_sm x SMs) programs, each walking the (sequence, KV head) items pid, pid
+ nprog, ... (item = b * Hkv + kvh) as ONE tile stream through one ring of ``stages`` tiles:
the producer cursor (reused from the fp8 module: ``_seek``, ``_tile_blocks``) issues S - 1
tiles ahead across item boundaries, skips items without a key, and is predicated off past the
last item; stage g % S, phase (g // S) & 1 for the program's g-th tile. Each 64-key tile is
4 pages, warp p owning page p of every tile with its own softmax state; 8 boxes a tile (4 K,
4 V: 32 KB) counted by one mbarrier.

keys_m (the only form here): S^T = K·Q^T with the piece's 16 keys as the mma's M, the group
padded to 8 as N and the head dims as K (8 HMMA a piece); O^T = V^T·P^T with the 128 head dims
as M (8 m-tiles), the 8 heads as N and the 16 keys as K (8 HMMA): 16 HMMA a tile, an O^T
accumulator of 32 fp32 registers a thread. K reaches the A operand through ``ldmatrix`` (its
rows are keys, head dims contiguous) and V^T through ``ldmatrix.trans`` (the same bytes, read
transposed): 8 + 8 LDSM a warp a tile, no other shared load. The views below undo the
swizzle; the head dims stay in natural order (q and the output need no permutation).

At an item's end each warp's piece is normalized in registers and the 4 are summed through
the K half of the stage the next issue will refill (fp32 [4, 8, 128] = 16 KB: exactly that
half; fp32 so a bf16 value past fp16's range survives), then written.

Shared memory: 32 KB a stage; ``programs_per_sm`` x ``stages`` <= 6 (3 x 2, 2 x 3, 1 x 6).
Bytes in flight per SM in the steady state ~ programs_per_sm x (stages - 1) x 32 KB: 96 KB at
3 x 2, 128 KB at 2 x 3 (memory-bound decode on an H200 wants >= 32-48 KB).
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

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.paged_decode import gluon_bf16_unsupported
from flashpage.kernels.paged_decode_gluon import _A, _B, _MMA, _cursor, _seek, _tile_blocks
from flashpage.kernels.tma_maps import cached_tma_maps, descriptor

_LOG2E = 1.4426950408889634
HEAD_DIM = 128
PAGE = 16
NUM_WARPS = 4  # one page of each 64-key tile per warp
BLOCK_N = PAGE * NUM_WARPS
HALF = HEAD_DIM // 2  # a TMA box row: 64 16-bit elements = the 128-byte swizzle span
TILE_BYTES = 2 * BLOCK_N * HEAD_DIM * 2  # a tile's K and V: 32 KB
SMEM_PER_SM = 227 * 1024
VARIANTS = ("keys_m",)

_D = gl.constexpr(HEAD_DIM)
_H = gl.constexpr(HALF)
_PG = gl.constexpr(PAGE)
_W = gl.constexpr(NUM_WARPS)
_BN = gl.constexpr(BLOCK_N)
_TILE_BYTES = gl.constexpr(TILE_BYTES)

# A page piece as TMA lands it: [2 halves, 16 keys, 64 dims], 128-byte swizzle over the 128-byte
# rows (half, key): chunk c of row r at chunk c ^ (r % 8) = c ^ (key % 8).
_TMA_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))

# Views of one stage's K or V ([4 pieces x 2 halves, 16, 64] 16-bit = 16 KB, element offset
# bits 0-12), offset bit -> logical coordinate. Physical: bits 0-2 the element in a 16-byte
# chunk, bits 3-5 the chunk (dim bits 3-5, XORed with key bits 0-2), bits 6-9 the key, bit 10
# the half (dim bit 6), bits 11-12 the piece.
# K [piece, key, dim]: the A operand of S^T = K Q^T (rows = keys; ldmatrix).
_K_ROWS = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 0, 1], [0, 0, 2], [0, 0, 4],
    [0, 0, 8], [0, 0, 16], [0, 0, 32],
    [0, 1, 8], [0, 2, 16], [0, 4, 32], [0, 8, 0],  # key bits 0-3 (and the chunk swizzle)
    [0, 0, 64],  # the half
    [1, 0, 0], [2, 0, 0],  # the piece
]))
# V^T [piece, dim, key]: the A operand of O^T = V^T P^T (rows = head dims; ldmatrix.trans).
_VT_COLS = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1, 0], [0, 2, 0], [0, 4, 0],
    [0, 8, 0], [0, 16, 0], [0, 32, 0],
    [0, 8, 1], [0, 16, 2], [0, 32, 4], [0, 0, 8],
    [0, 64, 0],
    [1, 0, 0], [2, 0, 0],
]))
# The prefetched q of an item, [8 heads, 128]: 8 elements (16 bytes) a thread.
_Q_NEXT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[_W, 1],
                                        order=[1, 0]))
# The merge: the normalized pieces [4, 8 heads, 128] fp32 in the K half of a stage, read back
# summed in registers (the piece dimension within each thread).
_MERGE_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[2, 1, 0]))
_MERGE_LOAD = gl.constexpr(gl.BlockedLayout(size_per_thread=[_W, 1, 4], threads_per_warp=[1, 1, 32],
                                            warps_per_cta=[1, _W, 1], order=[2, 1, 0]))


@gluon.jit
def _produce16(k_desc, v_desc, kv, bars, t, b0, b1, b2, b3, item, tile, nt, bt_row, last_page, col,
               nprog, num_items, HKV: gl.constexpr, seq_lens_ptr, block_tables_ptr, stride_btb,
               S: gl.constexpr):
    """Issue the producer cursor's tile (the program's t-th: stage t % S, K at 2 (t % S), V at
    2 (t % S) + 1; one [2, 16, 64] box per page piece), then advance the cursor (to the next
    item with a key after its last tile) and load its tile's block ids."""
    pred = item < num_items
    stage = t % S
    bar = bars.index(stage)
    mbarrier.expect(bar, _TILE_BYTES, pred=pred)
    ks = kv.index(2 * stage)
    vs = kv.index(2 * stage + 1)
    hrow = col // _H  # (KV head, half 0): 2 kvh
    tma.async_copy_global_to_shared(k_desc, [hrow, b0 * _PG, 0], bar, ks.slice(0, 2), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [hrow, b0 * _PG, 0], bar, vs.slice(0, 2), pred=pred)
    tma.async_copy_global_to_shared(k_desc, [hrow, b1 * _PG, 0], bar, ks.slice(2, 2), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [hrow, b1 * _PG, 0], bar, vs.slice(2, 2), pred=pred)
    tma.async_copy_global_to_shared(k_desc, [hrow, b2 * _PG, 0], bar, ks.slice(4, 2), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [hrow, b2 * _PG, 0], bar, vs.slice(4, 2), pred=pred)
    tma.async_copy_global_to_shared(k_desc, [hrow, b3 * _PG, 0], bar, ks.slice(6, 2), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [hrow, b3 * _PG, 0], bar, vs.slice(6, 2), pred=pred)
    tile += 1
    if tile == nt:
        item, nt, bt_row, last_page, col = _seek(item + nprog, nprog, num_items, HKV, seq_lens_ptr,
                                                 block_tables_ptr, stride_btb)
        tile = 0
    b0, b1, b2, b3 = _tile_blocks(bt_row, tile, last_page)
    return b0, b1, b2, b3, item, tile, nt, bt_row, last_page, col


@gluon.jit
def _load_q16(q_ptr, item, num_items, HKV: gl.constexpr, stride_qb, stride_qh, GROUP: gl.constexpr):
    """q of ``item`` [8 heads, 128] (rows >= GROUP and past the last item zero), raw."""
    r2 = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, _Q_NEXT)), 1)
    k2 = gl.expand_dims(gl.arange(0, _D, layout=gl.SliceLayout(0, _Q_NEXT)), 0)
    b64 = (item // HKV).to(gl.int64)
    head0 = (item % HKV) * GROUP
    q_ptrs = q_ptr + b64 * stride_qb + (head0 + r2).to(gl.int64) * stride_qh + k2
    return gl.load(q_ptrs, mask=(r2 < GROUP) & (k2 < _D) & (item < num_items), other=0.0)


@gluon.jit
def _attend16(qt, k_stage, v_stage, m3, l4, acc, n0, seq_len, sm_scale_log2, MASKED: gl.constexpr):
    """One 64-key tile, keys_m: warp p's online-softmax step over keys n0 + 16p .. n0 + 16p + 15.
    qt [W, 128, 8] (_B, unscaled), m3 [W, 8] (SliceLayout(1, _MMA), log2 units), l4 [W, 16, 8]
    per-thread partial sums (_MMA), acc = O^T [W, 128, 8] fp32 (_MMA). MASKED: keys >= seq_len
    dropped, their V rows zeroed (an unowned slot may hold NaN, and 0 * NaN is NaN)."""
    dtype: gl.constexpr = qt.dtype
    ka = k_stage._reinterpret(dtype, [_W, _PG, _D], _K_ROWS).load(_A)  # [4, 16 keys, 128]
    s = mma_v2(ka, qt, gl.zeros([_W, _PG, 8], gl.float32, _MMA)) * sm_scale_log2  # [4, 16 keys, 8 heads]
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
    pt = gl.convert_layout(p.to(dtype), _B)  # [4, 16 keys, 8 heads]: a transpose in each warp
    vt = v_stage._reinterpret(dtype, [_W, _D, _PG], _VT_COLS).load(_A)  # [4, 128, 16 keys]
    if MASKED:
        offs_vp = gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _A)))
        offs_vj = gl.arange(0, _PG, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A)))
        vkey = n0 + gl.expand_dims(gl.expand_dims(offs_vp * _PG, 1), 2) + gl.expand_dims(gl.expand_dims(offs_vj, 0), 1)
        vt = gl.where(vkey < seq_len, vt, 0.0)
    acc = mma_v2(vt, pt, acc * gl.expand_dims(alpha, 1))
    return m_new, l4, acc


@gluon.jit(do_not_specialize=["num_items", "bt_last_col"])
def _paged_decode_gluon16_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, out_ptr,
    sm_scale_log2,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    num_items,  # batch * HKV
    bt_last_col,  # block_tables.shape[1] - 1 (>= 0 where FIRST_TOGETHER)
    HKV: gl.constexpr,  # KV heads
    GROUP: gl.constexpr,  # query heads per KV head (<= 8)
    S: gl.constexpr,  # stages: tiles in the ring (S - 1 in flight while one is computed)
    FIRST_TOGETHER: gl.constexpr = False,  # the first item's length and block ids in one round trip
):
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    kv = gl.allocate_shared_memory(dtype, [2 * S, 2 * _W, _PG, _H], _TMA_SMEM)  # stage s: K 2s, V 2s + 1
    merge_bufs = kv._reinterpret(gl.float32, [2 * S, _W, 8, _D], _MERGE_SMEM)  # K halves (16 KB each)
    bars = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(bars.index(s), count=1)
    gl.thread_barrier()

    # The producer cursor at the program's first item with a key; its first S - 1 tiles in
    # flight (across items where they are short).
    if FIRST_TOGETHER:
        # The first item's length and its first tile's 4 block ids requested together (the
        # ids clamped to the table's width, taken only up to its last page): the first TMA
        # goes out one DRAM round trip after the start instead of two (length, then ids).
        row0 = block_tables_ptr + (pid // HKV).to(gl.int64) * stride_btb  # pid < num_items
        seq0 = gl.load(seq_lens_ptr + pid // HKV)
        c0 = gl.load(row0)
        c1 = gl.load(row0 + gl.minimum(bt_last_col, 1))
        c2 = gl.load(row0 + gl.minimum(bt_last_col, 2))
        c3 = gl.load(row0 + gl.minimum(bt_last_col, 3))
        if seq0 > 0:
            p_item, p_nt, p_bt_row, p_last_page, p_col = _cursor(pid, seq0, num_items, HKV, block_tables_ptr,
                                                                  stride_btb)
            b0 = c0
            b1 = gl.where(p_last_page >= 1, c1, b0)
            b2 = gl.where(p_last_page >= 2, c2, b1)
            b3 = gl.where(p_last_page >= 3, c3, b2)
        else:  # a padding row first: the cursor's own walk
            p_item, p_nt, p_bt_row, p_last_page, p_col = _seek(pid + nprog, nprog, num_items, HKV, seq_lens_ptr,
                                                                block_tables_ptr, stride_btb)
            b0, b1, b2, b3 = _tile_blocks(p_bt_row, 0, p_last_page)
    else:
        p_item, p_nt, p_bt_row, p_last_page, p_col = _seek(pid, nprog, num_items, HKV, seq_lens_ptr,
                                                            block_tables_ptr, stride_btb)
        b0, b1, b2, b3 = _tile_blocks(p_bt_row, 0, p_last_page)
    p_tile = 0
    for t in gl.static_range(S - 1):
        b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row, p_last_page, p_col = _produce16(
            k_desc, v_desc, kv, bars, t, b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row,
            p_last_page, p_col, nprog, num_items, HKV, seq_lens_ptr, block_tables_ptr, stride_btb, S)
    q_next = _load_q16(q_ptr, pid, num_items, HKV, stride_qb, stride_qh, GROUP)
    seq_len_next = gl.load(seq_lens_ptr + pid // HKV)

    o_layout: gl.constexpr = gl.SliceLayout(0, _MERGE_LOAD)
    rows = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, o_layout)), 1)
    cols = gl.expand_dims(gl.arange(0, _D, layout=gl.SliceLayout(0, o_layout)), 0)
    q_zeros = gl.zeros([_W, _D, 8], dtype, _B)

    g = 0  # tiles consumed by this program: stage g % S, phase (g // S) & 1
    for item in range(pid, num_items, nprog):
        b = item // HKV
        kvh = item % HKV
        seq_len = seq_len_next
        nt = gl.cdiv(seq_len, _BN)
        # q^T [128, 8 heads] as the B operand, every warp a copy.
        qt = gl.convert_layout(gl.permute(q_next, [1, 0]), gl.SliceLayout(0, _B))
        qt, _ = gl.broadcast(gl.expand_dims(qt, 0), q_zeros)
        q_next = _load_q16(q_ptr, item + nprog, num_items, HKV, stride_qb, stride_qh, GROUP)
        seq_len_next = gl.load(seq_lens_ptr + (item + nprog) // HKV, mask=item + nprog < num_items, other=0)

        m3 = gl.full([_W, 8], float("-inf"), gl.float32, gl.SliceLayout(1, _MMA))
        l3 = gl.zeros([_W, _PG, 8], gl.float32, _MMA)  # per-thread partial sums
        acc = gl.zeros([_W, _D, 8], gl.float32, _MMA)  # O^T
        for i in range(nt - 1):  # every tile but the last: 64 valid keys
            gl.thread_barrier()  # every warp is done reading tile g - 1's stage
            fence_async_shared()  # ... before the async proxy overwrites it
            b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row, p_last_page, p_col = _produce16(
                k_desc, v_desc, kv, bars, g + S - 1, b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row,
                p_last_page, p_col, nprog, num_items, HKV, seq_lens_ptr, block_tables_ptr, stride_btb, S)
            stage = g % S
            mbarrier.wait(bars.index(stage), (g // S) & 1)
            m3, l3, acc = _attend16(qt, kv.index(2 * stage), kv.index(2 * stage + 1), m3, l3, acc,
                                    i * _BN, seq_len, sm_scale_log2, False)
            g += 1
        if nt > 0:
            gl.thread_barrier()
            fence_async_shared()
            b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row, p_last_page, p_col = _produce16(
                k_desc, v_desc, kv, bars, g + S - 1, b0, b1, b2, b3, p_item, p_tile, p_nt, p_bt_row,
                p_last_page, p_col, nprog, num_items, HKV, seq_lens_ptr, block_tables_ptr, stride_btb, S)
            stage = g % S
            mbarrier.wait(bars.index(stage), (g // S) & 1)
            m3, l3, acc = _attend16(qt, kv.index(2 * stage), kv.index(2 * stage + 1), m3, l3, acc,
                                    (nt - 1) * _BN, seq_len, sm_scale_log2, True)
            g += 1

        # The pieces merged (a piece that saw no key has m = -inf: weight 0; no key at all: zeros),
        # each normalized in registers and summed in fp32 through the K half of the stage the next
        # issue will refill (g + S - 1: the last tile's, not in flight; its refill waits for the
        # CTA barrier at the top of the next tile).
        l3 = gl.sum(l3, 1)
        m = gl.max(m3, 0)
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        w3 = gl.exp2(m3 - gl.expand_dims(m_safe, 0))
        l = gl.sum(l3 * w3, 0)
        w3 = w3 / gl.expand_dims(gl.where(l > 0.0, l, 1.0), 0)
        merge_buf = merge_bufs.index(2 * ((g + S - 1) % S))
        gl.thread_barrier()  # every warp is done reading the last tile's stage (the same one)
        merge_buf.store(gl.permute(acc * gl.expand_dims(w3, 1), [0, 2, 1]))
        gl.thread_barrier()
        o = gl.sum(merge_buf.load(_MERGE_LOAD), 0)  # [8, 128]
        out_ptrs = out_ptr + b.to(gl.int64) * stride_ob + (kvh * GROUP + rows).to(gl.int64) * stride_oh + cols
        gl.store(out_ptrs, o.to(dtype), mask=(rows < GROUP) & (cols < _D))
    for s in gl.static_range(S):  # every issued tile was waited on (the producer issues none past the end)
        mbarrier.invalidate(bars.index(s))


def _cache_descriptor(cache: torch.Tensor):
    """A TMA descriptor over a cache seen as [Hkv * 2, num_blocks * 16, 64] (half h of KV head
    kvh at outer coordinate 2 kvh + h, row = block * 16 + slot): one [2, 16, 64] box per page
    piece of one KV head."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_blocks, page, hkv, d = cache.shape
    view = cache.view(num_blocks * page, hkv * 2, d // 2).permute(1, 0, 2)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [2, PAGE, HALF], _TMA_SMEM.value)


def _check(q, key_cache, value_cache, block_tables, seq_lens, out):
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} differ")
    why = gluon_bf16_unsupported(q, key_cache, value_cache, None, 1, capability=(9, 0))  # the device: last
    if why:
        raise ValueError("paged_decode_gluon_bf16: " + "; ".join(why))
    batch = q.shape[0]
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch \
            or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks] contiguous in its last dim, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last dimension")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    # Last, so that the checks above hold (and are tested) on any device.
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError("paged_decode_gluon_bf16 runs on CUDA sm_90 (Hopper) only")


def max_regs(programs_per_sm: int) -> int | None:
    """ptxas's register cap for ``programs_per_sm`` 128-thread programs on an SM (64K registers,
    a multiple of 8): None at 1-2 (no cap), 168 at 3."""
    regs = 65536 // (programs_per_sm * 32 * NUM_WARPS) // 8 * 8
    return None if regs >= 256 else regs


def fits(programs_per_sm: int, stages: int) -> bool:
    """Whether ``programs_per_sm`` programs of ``stages`` 32 KB stages share an SM's shared
    memory, with 4 KB a program to spare (sm_90 SASS: ~2.1 KB of barriers and reduction scratch
    beside the ring; the driver reserves 1 KB a block): 3 x 2, 2 x 3, 1 x 2-6."""
    return stages >= 2 and programs_per_sm >= 1 and programs_per_sm * (stages * TILE_BYTES + 4096) <= SMEM_PER_SM


def engine_form(num_items: int, num_sms: int) -> dict:
    """The form paged_decode runs for ``num_items`` = batch x Hkv items on ``num_sms`` SMs: 2
    programs an SM of 2 stages, on ``balanced_grid``'s program count. H200 run 91
    (decode_gluon_knobs.py --set bf16, x SDPA cuDNN on contiguous K/V in the same run) at 32 x
    4096, 64 x 4096, 128 x 2048, 128 x 8192, 256 x 1024: 2 x 2 balanced 1.013 / 1.000 / 0.987 /
    0.993 / 0.985, 2 x 2 1.011 / 0.986 / 0.995 / 0.986 / 0.987, 3 x 2 (run 86's choice at 3 items an
    SM) 1.010 / 0.967 / 0.984 / 0.968 / 0.969; 256 ragged 101-2048: 253.7 / 251.9 / 251.1 us (3 x 2
    ahead by 1%). ``num_sms`` stays in the signature: the form is per GPU, not per batch, here.
    ``first_together`` since run 256 (9 rounds in turn, x cuDNN with / without it: 1.000 / 0.998,
    0.992 / 0.991, 0.990 / 0.985, 0.986 / 0.986, 0.988 / 0.987 at the five shapes above; never
    behind)."""
    del num_items, num_sms
    return {"variant": "keys_m", "programs_per_sm": 2, "stages": 2, "balance": True, "first_together": True}


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def balanced_grid(num_items: int, programs: int) -> int:
    """The fewest programs (<= ``programs``) that give every program the same item count, but
    for the last few: ceil(items / ceil(items / programs)). Items are dealt out pid, pid + grid,
    ..., so at 512 items over 396 slots (64 x 4096 at 3 an SM) 116 programs take 2 and 280 take
    1, and the second half of the call runs on 116 programs; balanced, 256 programs take 2 each.
    Whether the even tail beats the extra programs is for the H200 to say
    (decode_gluon_knobs.py --set bf16, the "bal" columns)."""
    programs = max(1, programs)
    per = -(-num_items // programs)
    return max(1, -(-num_items // per))


def _launch(q, key_cache, value_cache, block_tables, seq_lens, *, sm_scale=None, out=None,
            variant: str = "keys_m", programs_per_sm: int = 3, stages: int = 2, programs: int | None = None,
            max_regs_cap: int | None = None, balance: bool = False, first_together: bool = False):
    """paged_decode_gluon_bf16 with its knobs: ``programs_per_sm`` x ``stages`` must fit in
    shared memory (``fits``: 3 x 2, 2 x 3, 1 x 2-6, ...); ``programs`` that many programs
    instead (tests: several items a program); ``max_regs_cap`` None for ``max_regs(programs_per_sm)``;
    ``balance``: ``balanced_grid``'s program count (every program the same number of items);
    ``first_together``: each program's first length and block ids loaded in one round trip
    (FIRST_TOGETHER)."""
    launch = plan(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale, out=out,
                  variant=variant, programs_per_sm=programs_per_sm, stages=stages, programs=programs,
                  max_regs_cap=max_regs_cap, balance=balance, first_together=first_together)
    out = torch.empty_like(q) if out is None else out
    launch(q, key_cache, value_cache, out)
    return out


def plan(q, key_cache, value_cache, block_tables, seq_lens, *, sm_scale=None, out=None,
         variant: str = "keys_m", programs_per_sm: int = 3, stages: int = 2, programs: int | None = None,
         max_regs_cap: int | None = None, balance: bool = False, descriptors: dict | None = None,
         first_together: bool = False):
    """_launch's checks and choices once -> launch(q, key_cache, value_cache, out) for tensors
    of the same geometry over the planned tables and lengths (paged_decode.DecodePlan holds
    callers to it). Each cache's TMA descriptor is made once, kept in ``descriptors`` (a
    caller's dict kept across plans, e.g. one per engine; None: this plan's own), and the
    launches skip Triton's dispatch (kernels/fast_launch.py) and re-encoding the maps
    (kernels/tma_maps.py)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    if not fits(programs_per_sm, stages):
        raise ValueError(f"{programs_per_sm} programs an SM of {stages} stages of {TILE_BYTES // 1024} KB do not fit "
                         f"in {SMEM_PER_SM // 1024} KB of shared memory (stages >= 2)")
    _check(q, key_cache, value_cache, block_tables, seq_lens, out)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if batch == 0:
        return lambda *_: None
    num_items = batch * num_kv_heads
    if programs is None:
        programs = programs_per_sm * _num_sms(torch.cuda.current_device() if q.device.index is None
                                              else q.device.index)
    regs = max_regs_cap or max_regs(programs_per_sm)
    grid = (balanced_grid(num_items, programs) if balance else min(num_items, max(1, programs)),)
    bt_last_col = block_tables.shape[1] - 1
    consts = dict(HKV=num_kv_heads, GROUP=num_q_heads // num_kv_heads, S=stages,
                  FIRST_TOGETHER=first_together and bt_last_col >= 0)
    options = dict(num_warps=NUM_WARPS, **({"maxnreg": regs} if regs else {}))
    scale2 = sm_scale * _LOG2E
    descs = {} if descriptors is None else descriptors
    bound: list = []

    def launch(q, kc, vc, out):
        args = (q, descriptor(descs, "g16", kc, _cache_descriptor), descriptor(descs, "g16", vc, _cache_descriptor),
                block_tables, seq_lens, out, scale2, q.stride(0), q.stride(1), block_tables.stride(0),
                out.stride(0), out.stride(1), num_items, bt_last_col)
        with cached_tma_maps():
            if bound:
                bound[0](args)
            else:
                bound.append(_LAUNCH.bind(grid, args, consts, options, varying=(0, 5)))

    return launch


_LAUNCH = FastLauncher(_paged_decode_gluon16_kernel)


def paged_decode_gluon_bf16(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    variant: str = "keys_m",
    programs_per_sm: int = 3,
    stages: int = 2,
    balance: bool = False,
) -> torch.Tensor:
    """paged_decode (kernels/paged_decode.py) over a 16-bit cache, in Gluon for sm_90.

    q            [B, Hq, 128] bf16 or fp16
    key_cache    [num_blocks, 16, Hkv, 128] in q's dtype, contiguous (value_cache the same)
    block_tables int32 [B, max_blocks]; entries past seq_lens are never read
    seq_lens     int32 [B]   context length, the query's own token included (0: a zero row)
    returns out  [B, Hq, 128] in q's dtype (written into ``out`` when given)

    Hq / Hkv 1-8, no sliding window, no key splits: programs_per_sm x SMs persistent programs
    over the (sequence, KV head) items (``engine_form`` gives what paged_decode runs);
    ``balance``: as few programs as give each the same item count (``balanced_grid``).
    """
    return _launch(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale, out=out,
                   variant=variant, programs_per_sm=programs_per_sm, stages=stages, balance=balance)
