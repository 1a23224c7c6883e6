"""MLA decode over the bf16/fp16 paged latent cache with Hopper's warpgroup MMA, keys as the
MMA's M (sm_90, Gluon). Same contract as ``mla_decode`` (kernels/mla_decode.py); the triton
backend's MLA decode for 16 heads on Hopper (envs.mla_gluon); timed beside the other MLA
kernels by ``benchmarks/mla_decode_gluon.py`` (BENCHMARKS.md, MLA decode, session 13).

Why: both mma.sync kernels (Triton's, and mla_decode_gluon's) stream the latents at ~3.8 TB/s
on an H200 at 8 x 32768 (Nsight Compute, run 92: 80 us for 302 MB, 79% of DRAM peak, no
over-fetch); a TMA ring with no compute streams them at 4.34 TB/s (run 102,
benchmarks/mla_stream_probe.py). Here a 64-key tile is::

    S^T [64 keys, 16 heads] = sum over the 9 slabs s of  K_s [64 keys, 64] . Q_s^T [64, 16]
    O_c^T [64 dims, 16 heads] += V_c^T [64 dims, 64 keys] . P^T [64 keys, 16]   c = 0..7

as wgmma m64n16k16: A = the latent slab in shared memory as TMA landed it (K-major, 128-byte
swizzle: wgmma's own A layout; transposed for V^T), B = q's slab (permuted) and P^T (stored to
shared memory each tile); the softmax is over M (the keys: a reduction across the 4 warps).
Key splits partial into ``mla_decode``'s layout (mid_o [B, H, S, 512] normalized, mid_lse
[B, H, S] base 2), merged by its merge kernel; splits of >= 64 keys (``pick_splits``).

One program an SM, persistent over (sequence, split, head group) items, of 3 warpgroups:

- the producer (_produce): for each tile of its items, the block ids (loaded before it waits),
  then the 9 TMA boxes [64 keys, 64 columns] (columns 0, 64, .., 512 of the cache seen as
  [blocks x page, 576]; 128-byte swizzle) into a ring of SLOTS [64, 64] slab slots (tile g's
  slab j in slot (9 g + j) % SLOTS), each slot once the tile that held it is consumed;
  ready[g % 4] (the bytes) and empty[g % 4] (both consumers' arrives) a tile;
- two consumers (_consume_half) splitting each tile's columns (consumer 0: value slabs 0-3 and
  the rope slab; consumer 1: slabs 4-7): each its part of S^T, exchanged through shared
  memory (s_bar[g % 2], double-buffered) and added in the same order (the same softmax, m and
  l in both), then its 4 value slabs' O^T: half the MMAs and rescales each.

23 slab slots + q 18 KB + 2 P^T 4 KB + the exchange 16 KB = 222 KB; maxnreg 168, setmaxnreg per
warpgroup. How it got here (H200, 8 x 32768, BENCHMARKS.md): one warpgroup refilling a 2-tile
ring itself, 90 us a call (a quarter of its time in the refill, the next block id's load on the
path; Nsight, run 102); a producer warpgroup beside one consumer, 82 us (25 slots no faster than
18: the consumer's compute paced it; run 104); two consumers, 79-82 us (88% of copy; runs
105-109). The first two forms are in commit 0d3b918.

Pages: a power of two >= 16 (under 64, a tile's boxes come page by page). Keys past an item's
end: their scores masked to -inf, their V rows zeroed in shared memory before P.V (slots past a
context may hold anything, NaN included, and 0 x NaN is NaN).
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.mla_decode import merge_launcher
from flashpage.kernels.mla_decode_gluon import (
    HEADS,
    RANK,
    ROPE,
    _item_range,
    _num_sms,
    check_shapes,
    mla_gluon_unsupported,
)
from flashpage.kernels.mla_decode_gluon import pick_splits as gluon_pick_splits
from flashpage.kernels.tma_maps import cached_tma_maps, descriptor

_LOG2E = 1.4426950408889634
TILE = 64  # keys a tile: wgmma's M
NUM_WARPS = 4  # a warpgroup a partition
# a split keeps at least this many keys (one tile): with 512 (until run 108) a 1 x 1-4k call ran
# on 2-8 programs, 2x slower than Triton's kernel; 64 ties or beats it at every shape there
MIN_SPLIT_KEYS = 64
MIN_SLOTS = 18  # the slab ring: 2 whole tiles at least
SLOTS = 23  # and at most: 23 x 8 KB + q 18 KB + 2 P^T 4 KB + the S exchange 16 KB = 222 KB
MAXNREG = 168  # 3 warpgroups of 168 registers a thread (launch); setmaxnreg per partition:
CONSUMER_REGS = 208  # the second consumer (the first, the default partition: 3 x 168 - both = 208)
PRODUCER_REGS = 88
_NBARS = gl.constexpr(4)  # ready / empty barriers, tile g's at g % 4 (<= 4 tiles held)

_T = gl.constexpr(TILE)
_SLABS = gl.constexpr((RANK + ROPE) // 64)  # 9: 8 value slabs and the rope slab
_TILE_BYTES = gl.constexpr((RANK + ROPE) * TILE * 2)
_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
_P_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=16, rank=2))
# S^T [64 keys, 16 heads] and each O_c^T [64 dims, 16 heads]: one warpgroup's m64n16 accumulator
_ACC = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16]))
# q's [16 heads, 64] slab and a [64 keys, 64] slab through registers (16-byte vectors)
_Q_LD = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
_V_LD = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


@gluon.jit
def _seek(item, nprog, num_items, num_splits, head_groups, seq_lens_ptr, block_tables_ptr, stride_btb,
          PAGE: gl.constexpr):
    """The producer's next item from ``item`` on with a key (or one past the end: nothing to
    issue): it, its first key, tile count, block-table row and last page."""
    b, s, hg, start, end, seq_len = _item_range(seq_lens_ptr, item, num_items, num_splits, head_groups, _T)
    while (end <= start) & (item < num_items):
        item += nprog
        b, s, hg, start, end, seq_len = _item_range(seq_lens_ptr, item, num_items, num_splits, head_groups, _T)
    return (item, start, gl.cdiv(gl.maximum(end - start, 0), _T), block_tables_ptr + b.to(gl.int64) * stride_btb,
            gl.maximum(seq_len - 1, 0) // PAGE)


@gluon.jit
def _write(o, c, l, out_ptr, mid_o_ptr, b, s, hg, num_splits, head_groups, stride_ob, stride_oh,
           SPLIT: gl.constexpr):
    """Columns 64c .. 64c + 63 of the item's [16 heads, 512] output, O_c^T / l: into ``out``, or
    (SPLIT) the split's fp32 partial at mid_o[b, head, s]."""
    d = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, _ACC)), 1)
    head = gl.expand_dims(hg * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, _ACC)), 0)
    x = o / gl.expand_dims(gl.where(l > 0.0, l, 1.0), 0)  # no key at all: zeros
    if SPLIT:
        row = ((b * head_groups * 16 + head).to(gl.int64) * num_splits + s) * 512
        gl.store(mid_o_ptr + row + 64 * c + d, x)
    else:
        gl.store(out_ptr + b.to(gl.int64) * stride_ob + head.to(gl.int64) * stride_oh + 64 * c + d,
                 x.to(out_ptr.dtype.element_ty))


# ------------------------------------------------------------- the producer warpgroup


@gluon.jit
def _tile_blocks(bt_row, pos, last_page, PAGE: gl.constexpr):
    """The block ids of the tile from key ``pos``: one (pages >= 64 keys) or its 64 / PAGE pages
    (up to 4; the unused ones repeat the first), pages past the context clamped to the last."""
    first = pos // PAGE
    b0 = gl.load(bt_row + gl.minimum(first, last_page))
    b1 = b0
    b2 = b0
    b3 = b0
    if PAGE < _T:
        b1 = gl.load(bt_row + gl.minimum(first + 1, last_page))
        if PAGE * 4 == _T:
            b2 = gl.load(bt_row + gl.minimum(first + 2, last_page))
            b3 = gl.load(bt_row + gl.minimum(first + 3, last_page))
    return b0, b1, b2, b3


@gluon.jit
def _slot(base, sl, SLOTS: gl.constexpr):
    """The slab slot of a tile's slab ``sl`` (the tile's slab 0 at ``base``), wrapping at SLOTS."""
    x = base + sl
    return gl.where(x >= SLOTS, x - SLOTS, x)


@gluon.jit
def _copy_slab(desc, ring, bar, slot, sl, pos, b0, b1, b2, b3, PAGE: gl.constexpr):
    """Column slab ``sl`` of the tile from key ``pos`` into ring slot ``slot`` (page by page
    under 64-key pages)."""
    if PAGE >= _T:
        tma.async_copy_global_to_shared(desc, [b0 * PAGE + pos % PAGE, 64 * sl], bar, ring.index(slot))
    else:
        for pc in gl.static_range(_T // PAGE):
            if pc == 0:
                blk = b0
            elif pc == 1:
                blk = b1
            elif pc == 2:
                blk = b2
            else:
                blk = b3
            tma.async_copy_global_to_shared(desc, [blk * PAGE, 64 * sl], bar,
                                            ring.index(slot).slice(pc * PAGE, PAGE))


@gluon.jit
def _tile_done_wait(empty, e):
    """Wait until the tile that held slab number ``e`` (9 a tile, counted over the program's
    tiles) is consumed: tile t's arrive is on empty[t % 4], phase (t // 4) & 1; none if e < 0."""
    t = gl.maximum(e, 0) // _SLABS
    mbarrier.wait(empty.index(t % _NBARS), (t // _NBARS) & 1, pred=e >= 0)


@gluon.jit
def _produce(kv_desc, ring, ready, empty, block_tables_ptr, seq_lens_ptr, num_items, num_splits, head_groups,
             stride_btb, PAGE: gl.constexpr, SLOTS: gl.constexpr):
    """The producer warpgroup: the program's items' tiles in order into the slab ring, slab j of
    tile g into slot (9 g + j) % SLOTS once the tile that held that slot is consumed (slab
    9 g + j - SLOTS; SLOTS = 18 is a ring of 2 tiles, 25 lets a third tile's first 7 slabs in
    while the consumer still holds the one before), all 9 on ready[g % 4]. A tile's block ids
    are loaded before its waits, so their latency hides under them."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    item, start, nt, bt_row, last_page = _seek(pid, nprog, num_items, num_splits, head_groups, seq_lens_ptr,
                                               block_tables_ptr, stride_btb, PAGE)
    g = 0
    while item < num_items:
        for t in range(nt):
            pos = start + t * _T
            b0, b1, b2, b3 = _tile_blocks(bt_row, pos, last_page, PAGE)
            e0 = g * _SLABS - SLOTS
            # slab 0's slot: its tile (g - 3 or later) consumed, so ready[g % 4] (tile g - 4's) is free too
            _tile_done_wait(empty, e0)
            bar = ready.index(g % _NBARS)
            mbarrier.expect(bar, _TILE_BYTES)
            base = (g * _SLABS) % SLOTS
            for sl in gl.static_range(_SLABS):
                if sl > 0:
                    _tile_done_wait(empty, e0 + sl)
                _copy_slab(kv_desc, ring, bar, _slot(base, sl, SLOTS), sl, pos, b0, b1, b2, b3, PAGE)
            g += 1
        item, start, nt, bt_row, last_page = _seek(item + nprog, nprog, num_items, num_splits, head_groups,
                                                   seq_lens_ptr, block_tables_ptr, stride_btb, PAGE)


# ------------------------------------------------------------- the consumer warpgroups


@gluon.jit
def _consume_half(q_ptr, ring, q_smem, p_smem, s_smem, ready, empty, s_bar, seq_lens_ptr, out_ptr, mid_o_ptr,
                  mid_lse_ptr, qk_scale, num_items, num_splits, head_groups, stride_qb, stride_qh, stride_ob,
                  stride_oh, X: gl.constexpr, SLOTS: gl.constexpr, SPLIT: gl.constexpr):
    """Consumer X of two: the latent's 576 columns split between them, slabs 4X ..
    4X + 3 (and the rope slab for X = 0). Per tile: its part of S^T to s_smem[X, g % 2], the
    two parts exchanged on s_bar[g % 2] (an arrive from each) and added in the same order in
    both (S_0 + S_1: the same softmax, m and l in both), then P^T to its own p_smem[X] and its
    4 value slabs' O_c^T += V_c^T . P^T. Its 256 output columns at the item's end (and X = 0
    the lse). A tile is handed back once both arrived on empty[g % 4]."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    qh = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, _Q_LD)), 1)
    qc = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, _Q_LD)), 0)
    keys = gl.arange(0, _T, layout=gl.SliceLayout(1, _ACC))
    c0: gl.constexpr = 4 * X  # the first of its value slabs
    g = 0
    for item in range(pid, num_items, nprog):
        b, s, hg, start, end, seq_len = _item_range(seq_lens_ptr, item, num_items, num_splits, head_groups, _T)
        nt = gl.cdiv(gl.maximum(end - start, 0), _T)
        # its own q slabs only (the other consumer's may still be read by that one's wgmmas)
        q_row = q_ptr + b.to(gl.int64) * stride_qb + (hg * 16 + qh).to(gl.int64) * stride_qh + qc
        for j in gl.static_range(4):
            q_smem.index(c0 + j).store(gl.load(q_row + 64 * (c0 + j)))
        if X == 0:
            q_smem.index(8).store(gl.load(q_row + 64 * 8))
        fence_async_shared()
        gl.thread_barrier()
        m = gl.full([16], float("-inf"), gl.float32, gl.SliceLayout(0, _ACC))
        l = gl.zeros([16], gl.float32, gl.SliceLayout(0, _ACC))
        o0 = gl.zeros([64, 16], gl.float32, _ACC)
        o1 = gl.zeros_like(o0)
        o2 = gl.zeros_like(o0)
        o3 = gl.zeros_like(o0)
        for t in range(nt):
            mbarrier.wait(ready.index(g % _NBARS), (g // _NBARS) & 1)
            base = (g * _SLABS) % SLOTS
            valid = end - (start + t * _T)
            sacc = gl.zeros([_T, 16], gl.float32, _ACC)
            for j in gl.static_range(4):
                sacc = warpgroup_mma(ring.index(_slot(base, c0 + j, SLOTS)), q_smem.index(c0 + j).permute((1, 0)),
                                     sacc, use_acc=j > 0, is_async=True)
            if X == 0:
                sacc = warpgroup_mma(ring.index(_slot(base, 8, SLOTS)), q_smem.index(8).permute((1, 0)), sacc,
                                     is_async=True)
            sacc = warpgroup_mma_wait(0, deps=(sacc,))
            sb = g % 2
            s_smem.index(2 * X + sb).store(sacc)
            gl.thread_barrier()  # every thread's part stored before the (elected) arrive
            mbarrier.arrive(s_bar.index(sb))
            mbarrier.wait(s_bar.index(sb), (g // 2) & 1)
            other = s_smem.index(2 * (1 - X) + sb).load(_ACC)
            if X == 0:
                sacc = sacc + other
            else:
                sacc = other + sacc
            sc = gl.where(gl.expand_dims(keys < valid, 1), sacc * qk_scale, float("-inf"))
            m_new = gl.maximum(m, gl.max(sc, 0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_safe)
            p = gl.exp2(sc - gl.expand_dims(m_safe, 0))
            l = l * alpha + gl.sum(p, 0)
            m = m_new
            a2 = gl.expand_dims(alpha, 0)
            o0 = o0 * a2
            o1 = o1 * a2
            o2 = o2 * a2
            o3 = o3 * a2
            if valid < _T:  # its own value slabs' rows past the item's end zeroed (may hold NaN)
                rows = gl.expand_dims(gl.arange(0, _T, layout=gl.SliceLayout(1, _V_LD)), 1)
                for j in gl.static_range(4):
                    slab = ring.index(_slot(base, c0 + j, SLOTS))
                    x = slab.load(_V_LD)
                    slab.store(gl.where(rows < valid, x, gl.zeros_like(x)))
            pv = p_smem.index(X)
            pv.store(p.to(dtype))
            fence_async_shared()
            gl.thread_barrier()
            o0 = warpgroup_mma(ring.index(_slot(base, c0 + 0, SLOTS)).permute((1, 0)), pv, o0, is_async=True)
            o1 = warpgroup_mma(ring.index(_slot(base, c0 + 1, SLOTS)).permute((1, 0)), pv, o1, is_async=True)
            o2 = warpgroup_mma(ring.index(_slot(base, c0 + 2, SLOTS)).permute((1, 0)), pv, o2, is_async=True)
            o3 = warpgroup_mma(ring.index(_slot(base, c0 + 3, SLOTS)).permute((1, 0)), pv, o3, is_async=True)
            o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=(o0, o1, o2, o3))
            gl.thread_barrier()  # every warp past its wgmmas
            mbarrier.arrive(empty.index(g % _NBARS))
            g += 1
        _write(o0, c0 + 0, l, out_ptr, mid_o_ptr, b, s, hg, num_splits, head_groups, stride_ob, stride_oh, SPLIT)
        _write(o1, c0 + 1, l, out_ptr, mid_o_ptr, b, s, hg, num_splits, head_groups, stride_ob, stride_oh, SPLIT)
        _write(o2, c0 + 2, l, out_ptr, mid_o_ptr, b, s, hg, num_splits, head_groups, stride_ob, stride_oh, SPLIT)
        _write(o3, c0 + 3, l, out_ptr, mid_o_ptr, b, s, hg, num_splits, head_groups, stride_ob, stride_oh, SPLIT)
        if SPLIT and X == 0:
            head = hg * 16 + gl.arange(0, 16, layout=gl.SliceLayout(0, _ACC))
            lse = gl.where(l > 0.0, m + gl.log2(gl.where(l > 0.0, l, 1.0)), float("-inf"))
            gl.store(mid_lse_ptr + (b * head_groups * 16 + head).to(gl.int64) * num_splits + s, lse)


@gluon.jit(do_not_specialize=["num_items", "num_splits"])
def _mla_decode_wgmma_kernel(
    q_ptr, kv_desc, block_tables_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, qk_scale, num_items,
    num_splits, head_groups, stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    PAGE: gl.constexpr, SLOTS: gl.constexpr, SPLIT: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """_consume_half(0) (the default partition), _consume_half(1) and the producer warpgroup over
    the slab ring; 3 warpgroups of maxnreg 168 (launch), setmaxnreg per partition."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    ring = gl.allocate_shared_memory(dtype, [SLOTS, _T, 64], _SMEM)
    q_smem = gl.allocate_shared_memory(dtype, [_SLABS, 16, 64], _SMEM)
    p_smem = gl.allocate_shared_memory(dtype, [2, _T, 16], _P_SMEM)
    s_smem = gl.allocate_shared_memory(gl.float32, [4, _T, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [_NBARS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [_NBARS, 1], mbarrier.MBarrierLayout())
    s_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(_NBARS):
        mbarrier.init(ready.index(k), count=1)
        mbarrier.init(empty.index(k), count=2)  # one arrive per consumer
    mbarrier.init(s_bar.index(0), count=2)
    mbarrier.init(s_bar.index(1), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_consume_half, (q_ptr, ring, q_smem, p_smem, s_smem, ready, empty, s_bar, seq_lens_ptr, out_ptr, mid_o_ptr,
                         mid_lse_ptr, qk_scale, num_items, num_splits, head_groups, stride_qb, stride_qh, stride_ob,
                         stride_oh, 0, SLOTS, SPLIT)),
        (_consume_half, (q_ptr, ring, q_smem, p_smem, s_smem, ready, empty, s_bar, seq_lens_ptr, out_ptr, mid_o_ptr,
                         mid_lse_ptr, qk_scale, num_items, num_splits, head_groups, stride_qb, stride_qh, stride_ob,
                         stride_oh, 1, SLOTS, SPLIT)),
        (_produce, (kv_desc, ring, ready, empty, block_tables_ptr, seq_lens_ptr, num_items, num_splits,
                    head_groups, stride_btb, PAGE, SLOTS)),
    ], [4, 4], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------- launcher


def _cache_descriptor(kv_cache: torch.Tensor):
    """The cache [blocks, page, 576] as [blocks x page rows, 576], boxes of [min(page, 64) rows,
    64 columns] (128-byte swizzle): slab s of a tile is the box(es) at column 64 s."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], RANK + ROPE)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [min(kv_cache.shape[1], TILE), 64],
                            _SMEM.value)


def mla_wgmma_unsupported(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, *, kv_lora_rank: int) -> list[str]:
    """Why ``mla_decode_wgmma`` cannot take this call (empty: it can): mla_decode_gluon's
    reasons (a bf16/fp16 latent of 512 + 64, a power-of-two block size >= 16, sm_90, ...)."""
    return mla_gluon_unsupported(q, kv_cache, block_tables, seq_lens, kv_lora_rank=kv_lora_rank)


def pick_splits(batch: int, head_groups: int, max_context: int, programs: int,
                min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """mla_decode_gluon's split rule with splits of at least ``min_split_keys`` keys, then as few
    splits as cover ``max_context`` in its 64-key-tile share (1 x 32768 on 132 programs: shares
    of 256 keys, 128 splits, not 132 with 4 empty)."""
    s = gluon_pick_splits(batch, head_groups, max_context, programs, min_split_keys)
    chunk = math.ceil(math.ceil(max_context / s) / TILE) * TILE
    return max(1, math.ceil(max_context / chunk))


def mla_decode_wgmma(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     *, kv_lora_rank: int, sm_scale: float, out: torch.Tensor | None = None,
                     num_splits: int | None = None, programs: int | None = None, slots: int = SLOTS,
                     min_split_keys: int = MIN_SPLIT_KEYS) -> torch.Tensor:
    """mla_decode's contract (q [B, H, 576] absorbed, kv_cache [blocks, page, 576] in q's dtype,
    block_tables int32 [B, max_blocks], seq_lens int32 [B]; returns out [B, H, 512]) on this
    kernel; ``programs`` (None: one an SM), ``slots`` (the slab ring, MIN_SLOTS..SLOTS) and the
    split knobs for tests and benchmarks."""
    out = check_shapes(q, block_tables, seq_lens, out)
    plan(q, kv_cache, block_tables, seq_lens, kv_lora_rank=kv_lora_rank, sm_scale=sm_scale, out=out,
         num_splits=num_splits, programs=programs, slots=slots, min_split_keys=min_split_keys,
         bind=False)(q, kv_cache, kv_cache, out)
    return out


def plan(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
         *, kv_lora_rank: int, sm_scale: float, out: torch.Tensor, num_splits: int | None = None,
         programs: int | None = None, slots: int = SLOTS, min_split_keys: int = MIN_SPLIT_KEYS,
         descriptors: dict | None = None, bind: bool = True):
    """mla_decode_wgmma's checks and choices (splits, scratch, grid) once -> launch(q, kv_cache,
    kv_cache, out) for tensors of this geometry over these tables and lengths
    (mla_decode.MLADecodePlan holds callers to it; the second cache argument is unused). Each
    cache's TMA descriptor is made once, kept in ``descriptors`` (a caller's dict kept across
    plans; None: this plan's own); with ``bind`` the launches after the first skip Triton's
    dispatch (kernels/fast_launch.py)."""
    if not MIN_SLOTS <= slots <= SLOTS:
        raise ValueError(f"slots must be in {MIN_SLOTS}..{SLOTS}, got {slots}")
    why = mla_wgmma_unsupported(q, kv_cache, block_tables, seq_lens, kv_lora_rank=kv_lora_rank)
    if why:
        raise ValueError("mla_decode_wgmma cannot take this call: " + "; ".join(why))
    B, H, _ = q.shape
    check_shapes(q, block_tables, seq_lens, out)
    if B == 0:
        return lambda *_: None
    hg = H // HEADS
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    nprog = programs or _num_sms(dev)
    if num_splits is None:
        num_splits = pick_splits(B, hg, block_tables.shape[1] * kv_cache.shape[1], nprog, min_split_keys)
    num_splits = max(1, int(num_splits))
    items = B * hg * num_splits
    split = num_splits > 1
    mid_o = mid_lse = out  # unused without splits
    if split:  # scratch shared by every launch of the plan (one stream: each merge reads it first)
        mid_o = torch.empty(B, H, num_splits, RANK, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    grid = (min(items, nprog),)
    consts = dict(PAGE=kv_cache.shape[1], SLOTS=slots, SPLIT=split, CONSUMER_REGS=CONSUMER_REGS,
                  PRODUCER_REGS=PRODUCER_REGS)
    options = dict(num_warps=NUM_WARPS, maxnreg=MAXNREG)
    scale2 = sm_scale * _LOG2E
    descs: dict = {} if descriptors is None else descriptors
    bound: list = []
    merge = merge_launcher(mid_o, mid_lse, RANK, bind=bind) if split else None

    def launch(q, kc, _vc, out):
        args = (q, descriptor(descs, "mla_wgmma", kc, _cache_descriptor), block_tables, seq_lens, out,
                mid_o if split else out, mid_lse if split else out, scale2, items, num_splits, hg,
                q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1))
        with cached_tma_maps():
            if bound:
                bound[0](args)
            elif bind:
                bound.append(_LAUNCH.bind(grid, args, consts, options, varying=(0, 4)))
            else:
                _mla_decode_wgmma_kernel[grid](*args, **consts, **options)
        if merge is not None:
            merge(out)

    return launch


_LAUNCH = FastLauncher(_mla_decode_wgmma_kernel)
