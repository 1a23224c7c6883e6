"""MLA decode over the bf16/fp16 paged latent cache, in Gluon for sm_90: one persistent kernel,
key splits merged inside it. Same contract as ``mla_decode`` (kernels/mla_decode.py), which it
is meant to replace at 16-head groups on Hopper; ``mla_gluon_unsupported`` says why a call
cannot be taken.

Why: the Triton kernel streams at 91-92% of copy at long contexts, but at batch <= 32 a call is
80% (a second, merge kernel and the gaps around it) or 69% (512 keys a split program: its ramp).
Here min(items, 2 x SMs) programs each walk their work items (sequence, key split, head group)
as ONE stream of latent slots through a TMA ring, so the next item's first slots are in flight
while the current one ends, and the last split of a sequence to finish merges the splits::

    item:   |--- pid ---|------- pid + nprog -------|-- ...
    slots:   0 1 2 3 4 5 6 7 8 9 ...      slot = 16 keys = TMA boxes [8 slabs, 16, 64] + [16, 64]
    TMA:     R - 2 slots ahead of the compute (ring of R; a tile is 2 slots = 32 keys)

A slot lands slab-major (the latent's 576 columns as 9 slabs of 64, 128-byte swizzle): the
8 value slabs from the cache seen as [8, blocks x page, 64] (strides 64, 576, 1), the rope
slab as [blocks x page, 64]: two boxes a slot whatever the page size (>= 16). Per 32-key
tile, 4 warps:

- scores, split along the 576 dims: warp w takes value slabs w and 4 + w and rope columns
  16w..16w+15 (q's matching columns in registers: 36 a thread), S_w = q_w . K_w^T by mma.sync
  (3 independent chains a slot), stored to a double-buffered fp32 scratch, one CTA barrier,
  and every warp sums the 4 partials (the same [16 heads, 32 keys] in every warp: the softmax
  runs redundantly, no second exchange);
- P . V with the warps splitting the 512 value columns (mma.sync, P in registers: the
  accumulator's layout is already the A operand's), the latent read from the same slots.

The ring's stage and phase come from the program's slot count g (index g % R, phase
(g // R) & 1): barriers initialized once; a producer cursor (item, slot in it, block id one
issue ahead) walks the same items as the consumer, skipping empty ones, and past the last
item its issues are predicated off, so every TMA issued is waited on. A freed tile's two
slots are refilled right after the next tile's barrier.

Splits: partials (o normalized, fp32 [16, 512], and lse base 2) go to scratch, in
``mla_decode``'s layout (mid_o [B, H, S, 512], mid_lse [B, H, S]). Past FUSE_MAX_SPLITS splits
its merge kernel runs after this one (one program per sequence, head and column chunk: the
partials read in parallel; ``pdl_merge`` launches it with PDL, this kernel triggering it at its
start, so its launch hides under this one's tail: not yet timed); up to it, each split counts itself in (an atomic per sequence and head group, acq_rel at gpu scope, after a CTA
barrier) and the last to arrive merges every partial, in split order from scratch (its own
too: a call's output does not depend on which split came last), into ``out`` and sets the
counter back to 0: a captured CUDA graph replays from a clean state. One split (a
batch that fills the GPU) writes ``out`` directly.

Tile-loop knobs (``_launch``; all off by default, the loop as first written): ``peel`` runs an
item's last tile once after the loop, so the loop's tiles skip the masking (the default's V
masking, behind a runtime test, is if-converted by the compiler and runs every tile: ~130 SEL
+ 128 PRMT); ``lean`` carries the ring's index, phase and scratch parity as counters and walks
the producer's items in mixed radix (sequence, split, head group: adding nprog is two compares
and carries; a split's share by an fp32 reciprocal, corrected), so no integer division or
modulo is left in the loop; ``lazy`` rescales the accumulator (64 FMUL a thread) only when a
row's running max grew by more than 2^8 (LAZY_LOG2; p <= 256 otherwise, the result unchanged;
the scores are the same in every warp, so the test is uniform); ``fewer_barriers`` (FB) lays
the shared memory and the issues out so that Triton's membar puts 4 CTA barriers a tile, not
8 (below). sm_90 SASS of the tile loop a warp (Triton 3.6, page 64 with splits, R = 5; static
instructions between the back branch and its label, so lazy's skipped rescale counts;
tests/kernels/test_mla_decode_gluon.py prints them and pins the first five)::

    form              loop   registers  spill   shared       BAR.SYNC  HMMA
    default           1,092  255        24 B    108,676 B    8         68
    peel                792  251        0       108,676 B    8         68
    lean              1,026  255        16 B    108,676 B    8         68
    lazy              1,111  252        0       108,676 B    8         68
    all (the three)     721  255        0       108,676 B    8         68   (2 programs an SM each)
    fb                1,090  255        0       108,676 B    4         68
    all_fb              722  254        0       108,676 B    4         68   (R = 4: 721, 90,244 B)

The 8 BAR.SYNC a tile: one is the scores' exchange (as written); Triton 3.6's membar adds the
rest, since it sees each access to an allocation through a dynamic index as an access to all
of it: one before the tile's first mbarrier wait (the loop's entry state holds the prologue's
TMA copies), one before the second slot's wait (the two slots' waits and scratch stores each
go to one allocation) and 5 in the issue (expect, value box, rope box, then the same for the
second slot: each writes the one barrier array). fewer_barriers leaves 4: the exchange, 2 in
the issue (both expects | a box of each slot | the other box of each) and one before the V
reads (the issue's last group writes the ring). It removes the others by:

- the second slot of a tile stores its partials to an allocation of its own (``scratch1``);
- slot count n's mbarrier is ``bars_{n % 2}[n % R]`` (``bars1`` the odd counts'), so the
  tile's two waits touch two allocations. A barrier serves every L = lcm(R, 2) slots, so its
  k-th use (phase k & 1) is slot count n = r + k L: phase (n // L) & 1, the same for a tile's
  two slots (2t and 2t + 1 sit in one L-block: L is even). lean carries the wrap count of the
  first slot's ring index, mod 2 (R even: the phase) or mod 4 (R odd, L = 2R: the phase is
  its high bit). The prologue issues slot counts 0 .. R - 3 (bars_{k % 2}); tile t then
  issues counts R - 2 + 2t (the parity of R: bars1 when R is odd) and R - 1 + 2t. Count n's
  barrier is re-armed for count n + L at tile (n + L - R + 2) / 2 > n / 2, after the exchange
  barrier of the tile that waited on n: every thread has seen its phase complete;
- a tile's two issues are batched (``_produce2``: both expects | slot p's value box and p +
  1's rope box | p's rope box and p + 1's value box, no conflict inside a group), the cursor
  two rows ahead (``p_row0``: -1 past the last item, so the predicates stay exact: a slot is
  issued if and only if the consumer waits on it, and the barriers end with no arrival
  pending);
- one CTA barrier after the prologue (outside the loops) clears membar's state at the loop's
  entry.

The scratch stays double buffered as before (parity t % 2: tile t + 2 writes it after every
warp passed tile t + 1's exchange), and a refill still follows the exchange barrier of the
tile after the one that read the slot. 4 is the least membar allows with two boxes a slot:
an expect and two copies write each slot's barrier (3 groups, 2 barriers), the waits read the
barriers, and the ring is read before and after the exchange. One [9, 16, 64] box a slot with
the ring split by slot parity too (R even) would put both copies in one group: 3. A
warp-specialized producer (as paged_decode_gluon's warp-specialized kernel had, until 16f5823) takes the issues out
of the compute warps altogether, but Gluon puts a bar.sync before each mbarrier wait and
arrive of a 4-warp partition, and a 5th warp's registers cost the second program an SM
unless setmaxnreg moves them.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    mma_v2,
    tma,
)

from flashpage.kernels.mla_decode import _merge, _merge_counters
from flashpage.kernels.pdl import resolve_pdl

_LOG2E = 1.4426950408889634
RANK, ROPE = 512, 64  # DeepSeek-V2/V3: the only shape taken
HEADS = 16  # heads a program (a head group); the head count must be a multiple
SLOT = 16  # keys a ring slot (one TMA box); the page size must be a multiple
BLOCK_N = 2 * SLOT  # keys a tile
NUM_WARPS = 4
STAGES = 5  # ring slots: 5 x 18 KB + 16 KB scratch = 106 KB, 2 programs an SM
PROGRAMS_PER_SM = 2
MIN_SPLIT_KEYS = 256  # a split keeps at least this many keys
# Splits a call merges inside the kernel (the last to arrive reads every partial, one after
# another: 32 KB each); more go to mla_decode's merge kernel, one program per (sequence, head,
# column chunk). Run 85: the in-kernel merge of 33 splits (8 x 32768) held the call to 58% of
# copy.
FUSE_MAX_SPLITS = 4
# The tile-loop knobs mla_decode_gluon runs with: all three. Run 88 (% of copy, page 64, 16
# heads; 8x32768, 16x16384, 32x4096, 64x8192, 128x4096, 8x4096): 81 82 69 90 91 41, against
# 79 81 68 85 86 40 without them and Triton's 82 75 71 83 83 42.
ENGINE_FORM = {"peel": True, "lean": True, "lazy": True}
LAZY_LOG2 = gl.constexpr(8.0)  # lazy=True: rescale once a row's max grew by > 2^8 (p <= 256)

_W = gl.constexpr(NUM_WARPS)
_SL = gl.constexpr(SLOT)
_BN = gl.constexpr(BLOCK_N)
_SLOT_BYTES = gl.constexpr(9 * SLOT * 64 * 2)  # both boxes of a slot

# Scores: batched mma.sync over [warp, 16 heads, keys], warp w its own slice of the dims.
_MMA3 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[_W, 1, 1], instr_shape=[1, 16, 8]))
_A3 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA3, k_width=2))
_B3 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA3, k_width=2))
# P . V: [16 heads, 512], the warps splitting the columns.
_MMA2 = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, _W], instr_shape=[16, 8]))
_A2 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA2, k_width=2))
_B2 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA2, k_width=2))
# The summed scores [16 heads, 16 keys] of a slot: an m16n8 accumulator's registers, the same in
# every warp (warp bases 0); as read from the scratch, the source warp in registers.
_S2 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [0, 8]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[16, 16]))
_SREAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 1], [0, 8, 0], [0, 0, 8], [1, 0, 0], [2, 0, 0]],
    lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
    warp_bases=[[0, 0, 0], [0, 0, 0]], block_bases=[], shape=[_W, 16, 16]))
_TMA_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3))
_TMA_SMEM2 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
_SCRATCH = gl.constexpr(gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[2, 1, 0]))

# Views of one slot ([9 slabs x 16 rows, 64] 16-bit, slab s at element 1024 s; 128-byte swizzle:
# 16-byte chunk c of row r at chunk c ^ (r % 8)), offset bit -> logical coordinate.
# K^T of 4 slabs as [warp, column, key]: warp w's slab w (the second view starts at slab 4).
_K_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1, 0], [0, 2, 0], [0, 4, 0],  # column bits 0-2
    [0, 8, 0], [0, 16, 0], [0, 32, 0],  # the 16-byte chunk
    [0, 8, 1], [0, 16, 2], [0, 32, 4],  # row bits 0-2 (and the chunk swizzle)
    [0, 0, 8],  # row bit 3
    [1, 0, 0], [2, 0, 0],  # the slab: the warp
]))
# K^T of the rope slab as [warp, column, key]: warp w's columns 16w..16w+15 (chunks 2w, 2w + 1).
_KR_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1, 0], [0, 2, 0], [0, 4, 0],
    [0, 8, 0], [1, 0, 0], [2, 0, 0],  # chunk bit 0: column bit 3; chunk bits 1-2: the warp
    [0, 8, 1], [1, 0, 2], [2, 0, 4],
    [0, 0, 8],
]))
# V of the 8 value slabs as [key, column].
_V_VIEW = gl.constexpr(gl.SharedLinearLayout(offset_bases=[
    [0, 1], [0, 2], [0, 4],
    [0, 8], [0, 16], [0, 32],
    [1, 8], [2, 16], [4, 32],
    [8, 0],
    [0, 64], [0, 128], [0, 256],
]))


@gluon.jit
def _item_range(seq_lens_ptr, item, num_items, num_splits, head_groups, TILE: gl.constexpr = 32):
    """Item -> (sequence, split, head group, first key, end key, sequence length); keys are
    split as ``splits.split_range`` does (equal shares, multiples of a TILE-key tile: 32 here,
    64 in mla_decode_wgmma); past the last item: an empty range of the last sequence."""
    it = gl.minimum(item, num_items - 1)
    bs = it // head_groups
    b = bs // num_splits
    s = bs % num_splits
    seq_len = gl.load(seq_lens_ptr + b, mask=item < num_items, other=0)
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), TILE) * TILE
    start = s * chunk
    return b, s, it % head_groups, start, gl.minimum(start + chunk, seq_len), seq_len


@gluon.jit
def _seek(item, nprog, num_items, num_splits, head_groups, seq_lens_ptr, block_tables_ptr, stride_btb,
          PAGE: gl.constexpr):
    """The producer's next item from ``item`` on with a key (or one past the end: no slot).
    Returns it, its first key, its slot count, block-table row and last page."""
    b, s, hg, start, end, seq_len = _item_range(seq_lens_ptr, item, num_items, num_splits, head_groups)
    while (end <= start) & (item < num_items):
        item += nprog
        b, s, hg, start, end, seq_len = _item_range(seq_lens_ptr, item, num_items, num_splits, head_groups)
    nslots = 2 * gl.cdiv(gl.maximum(end - start, 0), _BN)
    return (item, start, nslots, block_tables_ptr + b.to(gl.int64) * stride_btb,
            gl.maximum(seq_len - 1, 0) // PAGE)


@gluon.jit
def _slot_row(bt_row, pos, last_page, PAGE: gl.constexpr):
    """Cache row of the slot at key ``pos`` (past the context: in its last page, masked)."""
    blk = gl.load(bt_row + gl.minimum(pos // PAGE, last_page))
    return blk * PAGE + pos % PAGE


@gluon.jit
def _cdiv_splits(x, num_splits, inv_splits):
    """cdiv(x, num_splits) for 0 <= x < 2^24 without an integer division: x * (1 / num_splits)
    in fp32 (off by at most one), then corrected (lean=True)."""
    q = (x.to(gl.float32) * inv_splits).to(gl.int32)
    q = gl.where(q * num_splits > x, q - 1, q)
    q = gl.where((q + 1) * num_splits <= x, q + 1, q)
    return gl.where(q * num_splits < x, q + 1, q)


@gluon.jit
def _step_item(item, b, s, hg, nprog, db, ds, dh, num_splits, head_groups):
    """item + nprog with (sequence, split, head group) carried in mixed radix: nprog = (db *
    splits + ds) * groups + dh, so two compares and carries, no division."""
    hg += dh
    c = (hg >= head_groups).to(gl.int32)
    hg -= c * head_groups
    s += ds + c
    c = (s >= num_splits).to(gl.int32)
    s -= c * num_splits
    return item + nprog, b + db + c, s, hg


@gluon.jit
def _range_lean(item, b, s, num_items, num_splits, inv_splits, seq_lens_ptr):
    """_item_range's keys [start, end) and sequence length, the split share by _cdiv_splits."""
    seq_len = gl.load(seq_lens_ptr + b, mask=item < num_items, other=0)
    chunk = gl.cdiv(_cdiv_splits(seq_len, num_splits, inv_splits), _BN) * _BN
    start = s * chunk
    return seq_len, start, gl.minimum(start + chunk, seq_len)


@gluon.jit
def _seek_lean(item, b, s, hg, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups,
               seq_lens_ptr, block_tables_ptr, stride_btb, PAGE: gl.constexpr, ADVANCE: gl.constexpr):
    """_seek from ``item`` (+ nprog with ADVANCE) for lean=True: the cursor's (sequence, split,
    head group) carried (``b_last``: the last sequence, the block-table row past the end);
    also returns them."""
    if ADVANCE:
        item, b, s, hg = _step_item(item, b, s, hg, nprog, db, ds, dh, num_splits, head_groups)
    seq_len, start, end = _range_lean(item, b, s, num_items, num_splits, inv_splits, seq_lens_ptr)
    while (end <= start) & (item < num_items):
        item, b, s, hg = _step_item(item, b, s, hg, nprog, db, ds, dh, num_splits, head_groups)
        seq_len, start, end = _range_lean(item, b, s, num_items, num_splits, inv_splits, seq_lens_ptr)
    nslots = 2 * gl.cdiv(gl.maximum(end - start, 0), _BN)
    return (item, b, s, hg, start, nslots, block_tables_ptr + gl.minimum(b, b_last).to(gl.int64) * stride_btb,
            gl.maximum(seq_len - 1, 0) // PAGE)


@gluon.jit
def _produce(kv_desc, pe_desc, ring, ring_pe, bars, p, row, item, b, s, hg, slot, nslots, start, bt_row, last_page,
             nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups, seq_lens_ptr,
             block_tables_ptr, stride_btb, PAGE: gl.constexpr, R: gl.constexpr, LEAN: gl.constexpr):
    """Issue the cursor's slot, advance the cursor (to the next item with a key after the last
    slot of one) and load the next slot's cache row. ``p``: the program's issue count (ring
    index p % R), or with LEAN the ring index itself, wrapped by a compare; LEAN also walks
    the items by _seek_lean (b, s, hg carried; unused otherwise)."""
    pred = item < num_items
    if LEAN:
        idx = p
    else:
        idx = p % R
    bar = bars.index(idx)
    mbarrier.expect(bar, _SLOT_BYTES, pred=pred)
    tma.async_copy_global_to_shared(kv_desc, [0, row, 0], bar, ring.index(idx), pred=pred)
    tma.async_copy_global_to_shared(pe_desc, [row, 0], bar, ring_pe.index(idx), pred=pred)
    # _advance's step, written out: calling it swaps two uniform registers in lean's SASS, and
    # the forms without fewer_barriers keep their SASS byte for byte.
    slot += 1
    if slot == nslots:
        if LEAN:
            item, b, s, hg, start, nslots, bt_row, last_page = _seek_lean(
                item, b, s, hg, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups,
                seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, True)
        else:
            item, start, nslots, bt_row, last_page = _seek(item + nprog, nprog, num_items, num_splits, head_groups,
                                                           seq_lens_ptr, block_tables_ptr, stride_btb, PAGE)
        slot = 0
    row = _slot_row(bt_row, start + slot * _SL, last_page, PAGE)
    p += 1
    if LEAN:  # noqa: SIM102 (a constexpr test around a runtime one)
        if p == R:
            p = 0
    return p, row, item, b, s, hg, slot, nslots, start, bt_row, last_page


@gluon.jit
def _advance(item, b, s, hg, slot, nslots, start, bt_row, last_page, nprog, db, ds, dh, b_last, num_items,
             num_splits, inv_splits, head_groups, seq_lens_ptr, block_tables_ptr, stride_btb, PAGE: gl.constexpr,
             LEAN: gl.constexpr):
    """The producer cursor one slot on (to the next item with a key after the last slot of
    one) and that slot's cache row: _produce's step after its issue, and _produce2's two
    (fewer_barriers: two issues batched, then two steps)."""
    slot += 1
    if slot == nslots:
        if LEAN:
            item, b, s, hg, start, nslots, bt_row, last_page = _seek_lean(
                item, b, s, hg, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups,
                seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, True)
        else:
            item, start, nslots, bt_row, last_page = _seek(item + nprog, nprog, num_items, num_splits, head_groups,
                                                           seq_lens_ptr, block_tables_ptr, stride_btb, PAGE)
        slot = 0
    row = _slot_row(bt_row, start + slot * _SL, last_page, PAGE)
    return row, item, b, s, hg, slot, nslots, start, bt_row, last_page


@gluon.jit
def _produce2(kv_desc, pe_desc, ring, ring_pe, bars, bars1, p, row0, row, item, b, s, hg, slot, nslots, start,
              bt_row, last_page, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups,
              seq_lens_ptr, block_tables_ptr, stride_btb, PAGE: gl.constexpr, R: gl.constexpr, LEAN: gl.constexpr):
    """Two _produce calls with their issues batched (fewer_barriers): slot p at cache row
    ``row0`` (-1: past the last item, not issued) and slot p + 1, the cursor's, at ``row``,
    then the cursor two slots on (p + 2's row the new row0, p + 3's its row: two rows ahead).
    Slot count n's barrier is bars_{n % 2}[n % R] (_ring_slots); p's count has R's parity
    (R - 2 slots in the prologue, then 2 a tile). Membar sees every access through a dynamic
    index as one to the whole allocation: a TMA copy writes its barrier's and its box's, so
    the order (both expects | p's value box, p + 1's rope box | p's rope box, p + 1's value
    box) leaves no conflict inside a group: 2 CTA barriers instead of the 4 of two _produce."""
    if R % 2 == 1:
        bars_a = bars1
        bars_b = bars
    else:
        bars_a = bars
        bars_b = bars1
    pred0 = row0 >= 0
    pred1 = item < num_items
    if LEAN:
        i0 = p
        i1 = p + 1
        if i1 == R:
            i1 = 0
    else:
        i0 = p % R
        i1 = (p + 1) % R
    bar0 = bars_a.index(i0)
    bar1 = bars_b.index(i1)
    mbarrier.expect(bar0, _SLOT_BYTES, pred=pred0)
    mbarrier.expect(bar1, _SLOT_BYTES, pred=pred1)
    tma.async_copy_global_to_shared(kv_desc, [0, row0, 0], bar0, ring.index(i0), pred=pred0)
    tma.async_copy_global_to_shared(pe_desc, [row, 0], bar1, ring_pe.index(i1), pred=pred1)
    tma.async_copy_global_to_shared(pe_desc, [row0, 0], bar0, ring_pe.index(i0), pred=pred0)
    tma.async_copy_global_to_shared(kv_desc, [0, row, 0], bar1, ring.index(i1), pred=pred1)
    row, item, b, s, hg, slot, nslots, start, bt_row, last_page = _advance(
        item, b, s, hg, slot, nslots, start, bt_row, last_page, nprog, db, ds, dh, b_last, num_items, num_splits,
        inv_splits, head_groups, seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, LEAN)
    row0 = gl.where(item < num_items, row, -1)
    row, item, b, s, hg, slot, nslots, start, bt_row, last_page = _advance(
        item, b, s, hg, slot, nslots, start, bt_row, last_page, nprog, db, ds, dh, b_last, num_items, num_splits,
        inv_splits, head_groups, seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, LEAN)
    p += 2
    if LEAN:  # noqa: SIM102 (a constexpr test around a runtime one)
        if p >= R:
            p -= R
    return p, row0, row, item, b, s, hg, slot, nslots, start, bt_row, last_page


@gluon.jit
def _load_q(q_ptr, item, num_items, num_splits, head_groups, stride_qb, stride_qh):
    """q of an item's head group in the score dots' A layout: warp w's value columns 64w.. and
    256 + 64w.. ([4, 16, 64] each) and rope columns 512 + 16w.. ([4, 16, 16]); zeros past the end."""
    it = gl.minimum(item, num_items - 1)
    b = (it // head_groups) // num_splits
    head0 = (it % head_groups) * 16
    w = gl.expand_dims(gl.expand_dims(gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _A3))), 1), 2)
    h = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A3))), 0), 2)
    c = gl.expand_dims(gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A3))), 0), 1)
    cr = gl.expand_dims(gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A3))), 0), 1)
    row = q_ptr + b.to(gl.int64) * stride_qb + (head0 + h).to(gl.int64) * stride_qh
    ok = item < num_items
    q_lo = gl.load(row + 64 * w + c, mask=ok & (c < 64), other=0.0)
    q_hi = gl.load(row + 256 + 64 * w + c, mask=ok & (c < 64), other=0.0)
    q_r = gl.load(row + 512 + 16 * w + cr, mask=ok & (cr < 16), other=0.0)
    return q_lo, q_hi, q_r


@gluon.jit
def _ring_slots(g, ph, buf, R: gl.constexpr, LEAN: gl.constexpr, FB: gl.constexpr):
    """Ring index and phase of a tile's two slots, and its scratch parity. Default: g the
    program's slot count (index g % R, phase (g // R) & 1); LEAN: g the first slot's index,
    ph its phase, buf the parity, all carried (_ring_next), no division. FB: slot count n's
    barrier is bars_{n % 2}[n % R] (bars, bars1), used every L = lcm(R, 2) slots: phase
    (n // L) & 1, the same for the tile's two slots (g even); LEAN carries ph as the ring's
    wrap count mod 2L / R (the phase its high bit when R is odd)."""
    if FB:
        if LEAN:
            i1 = g + 1
            if i1 == R:
                i1 = 0
            if R % 2 == 1:
                phase = ph >> 1
            else:
                phase = ph
            return g, phase, i1, phase, buf
        else:
            if R % 2 == 1:
                phase = (g // (2 * R)) & 1
            else:
                phase = (g // R) & 1
            return g % R, phase, (g + 1) % R, phase, (g // 2) % 2
    else:
        if LEAN:
            i1 = g + 1
            ph1 = ph
            if i1 == R:
                i1 = 0
                ph1 = ph ^ 1
            return g, ph, i1, ph1, buf
        else:
            return g % R, (g // R) & 1, (g + 1) % R, ((g + 1) // R) & 1, (g // 2) % 2


@gluon.jit
def _ring_next(g, ph, buf, R: gl.constexpr, LEAN: gl.constexpr, FB: gl.constexpr):
    """The next tile's (g, ph, buf) (see _ring_slots)."""
    if LEAN:
        g += 2
        if g >= R:
            g -= R
            if FB and R % 2 == 1:
                ph = (ph + 1) & 3
            else:
                ph = ph ^ 1
        buf = buf ^ 1
    else:
        g += 2
    return g, ph, buf


@gluon.jit
def _score_partials(q_lo, q_hi, q_r, ring, ring_pe, bars, bars1, scratch, scratch1, idx0, ph0, idx1, ph1, buf,
                    FB: gl.constexpr):
    """Wait for the tile's two slots (ring indices idx0, idx1 at phases ph0, ph1) and store each
    warp's partial scores of both to the scratch buffer of parity ``buf`` (FB: the second
    slot's to ``scratch1``, an allocation of its own)."""
    for j in gl.static_range(2):
        if j == 0:
            idx = idx0
            ph = ph0
        else:
            idx = idx1
            ph = ph1
        if FB and j == 1:
            mbarrier.wait(bars1.index(idx), ph)
        else:
            mbarrier.wait(bars.index(idx), ph)
        slot = ring.index(idx)
        k_lo = slot.slice(0, 4)._reinterpret(q_lo.dtype, [_W, 64, _SL], _K_VIEW).load(_B3)
        k_hi = slot.slice(4, 4)._reinterpret(q_lo.dtype, [_W, 64, _SL], _K_VIEW).load(_B3)
        k_r = ring_pe.index(idx)._reinterpret(q_lo.dtype, [_W, 16, _SL], _KR_VIEW).load(_B3)
        z = gl.zeros([_W, 16, _SL], gl.float32, _MMA3)
        sw = mma_v2(q_lo, k_lo, z) + mma_v2(q_hi, k_hi, z) + mma_v2(q_r, k_r, z)
        if FB:
            if j == 0:
                scratch.index(buf).store(sw)
            else:
                scratch1.index(buf).store(sw)
        else:
            scratch.index(2 * buf + j).store(sw)


@gluon.jit
def _attend(ring, scratch, scratch1, idx0, idx1, buf, m, l, acc, key0, end, qk_scale, dtype: gl.constexpr,
            MASK: gl.constexpr, LAZY: gl.constexpr, FB: gl.constexpr):
    """The tile's scores (the 4 warps' partials summed, scaled to base 2; keys >= end -inf),
    the online-softmax step and acc += P V, the V rows of keys >= end zeroed (an unowned slot
    may hold NaN, and 0 * NaN is NaN). MASK 0: the V rows masked behind a runtime test
    (if-converted by the compiler: ~260 SEL/PRMT every tile), 1: no masking (a tile of the
    peeled loop: every key < end), 2: masked (the peeled last tile)."""
    if FB:
        t0 = scratch.index(buf)
        t1 = scratch1.index(buf)
    else:
        t0 = scratch.index(2 * buf)
        t1 = scratch.index(2 * buf + 1)
    s0 = gl.convert_layout(gl.sum(t0.load(_SREAD), 0), _S2, assert_trivial=True) * qk_scale
    s1 = gl.convert_layout(gl.sum(t1.load(_SREAD), 0), _S2, assert_trivial=True) * qk_scale
    if MASK != 1:
        offs = gl.expand_dims(gl.arange(0, _SL, layout=gl.SliceLayout(0, _S2)), 0)
        s0 = gl.where(key0 + offs < end, s0, float("-inf"))
        s1 = gl.where(key0 + _SL + offs < end, s1, float("-inf"))
    m_new = gl.maximum(m, gl.maximum(gl.max(s0, 1), gl.max(s1, 1)))  # finite: a tile has a key
    if LAZY:
        # Rescale only when some row's max grew by more than LAZY_LOG2 (the first tile: from
        # -inf); otherwise keep the old max: p <= 2^LAZY_LOG2, and o = acc / l is unchanged.
        # The scores are the same in every warp, so the branch is uniform across the CTA.
        if gl.max(m_new - m, 0) > LAZY_LOG2:
            alpha = gl.exp2(m - m_new)
            l = l * alpha
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, _MMA2)), 1)
            m = m_new
        m_new = m
        p0 = gl.exp2(s0 - gl.expand_dims(m_new, 1))
        p1 = gl.exp2(s1 - gl.expand_dims(m_new, 1))
        l = l + gl.sum(p0, 1) + gl.sum(p1, 1)
    else:
        alpha = gl.exp2(m - m_new)
        p0 = gl.exp2(s0 - gl.expand_dims(m_new, 1))
        p1 = gl.exp2(s1 - gl.expand_dims(m_new, 1))
        l = l * alpha + gl.sum(p0, 1) + gl.sum(p1, 1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, _MMA2)), 1)
    for j in gl.static_range(2):
        if j == 0:
            pa = gl.convert_layout(p0.to(dtype), _A2)
            idx = idx0
        else:
            pa = gl.convert_layout(p1.to(dtype), _A2)
            idx = idx1
        v = ring.index(idx)._reinterpret(dtype, [_SL, 512], _V_VIEW).load(_B2)
        if MASK == 0:
            if key0 + _BN > end:
                keys = gl.expand_dims(gl.arange(0, _SL, layout=gl.SliceLayout(1, _B2)), 1)
                v = gl.where(key0 + j * _SL + keys < end, v, gl.zeros_like(v))
        elif MASK == 2:
            keys = gl.expand_dims(gl.arange(0, _SL, layout=gl.SliceLayout(1, _B2)), 1)
            v = gl.where(key0 + j * _SL + keys < end, v, gl.zeros_like(v))
        acc = mma_v2(pa, v, acc)
    return m_new, l, acc


@gluon.jit
def _finish(acc, m, l, out_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr, b, s, hg, num_splits, head_groups,
            stride_ob, stride_oh, SPLIT: gl.constexpr, MERGE: gl.constexpr):
    """The item's output: into ``out`` (no split), or its partial into scratch (mla_decode's
    layout: mid_o [B, H, S, 512], mid_lse [B, H, S]) and, with MERGE, the last split of the
    (sequence, head group) to arrive merges them all into ``out``."""
    rows_l: gl.constexpr = gl.SliceLayout(1, _MMA2)
    rows = gl.arange(0, 16, layout=rows_l)
    cols = gl.arange(0, 512, layout=gl.SliceLayout(0, _MMA2))
    l2 = gl.convert_layout(l, rows_l)
    m2 = gl.convert_layout(m, rows_l)
    o = acc / gl.expand_dims(gl.where(l2 > 0.0, l2, 1.0), 1)  # no key at all: zeros
    out_off = b.to(gl.int64) * stride_ob + gl.expand_dims((hg * 16 + rows).to(gl.int64) * stride_oh, 1) \
        + gl.expand_dims(cols, 0)
    if SPLIT:
        group = b * head_groups + hg
        lse = gl.where(l2 > 0.0, m2 + gl.log2(gl.where(l2 > 0.0, l2, 1.0)), float("-inf"))
        # head row h's partial of split i at (h x num_splits + i) x 512 (lse: h x num_splits + i)
        hrow = (group * 16 + rows).to(gl.int64) * num_splits
        tile_off = gl.expand_dims(hrow * 512, 1) + gl.expand_dims(cols, 0)
        gl.store(mid_o_ptr + s * 512 + tile_off, o)
        gl.store(mid_lse_ptr + hrow + s, lse)
        if MERGE:
            _merge_if_last(o, lse, out_ptr, out_off, mid_o_ptr, mid_lse_ptr, counter_ptr, group, hrow, tile_off,
                           num_splits)
    else:
        gl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty))


@gluon.jit
def _merge_if_last(o, lse, out_ptr, out_off, mid_o_ptr, mid_lse_ptr, counter_ptr, group, hrow, tile_off,
                   num_splits):
    """Count this split in; the last of the group's splits to arrive merges them into out."""
    # Every thread's stores before the count (one thread's acq_rel atomic after the barrier).
    gl.thread_barrier()
    count = gl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
    if count == num_splits - 1:
        gl.atomic_xchg(counter_ptr + group, 0, sem="relaxed", scope="gpu")
        # Online merge, base 2, over the partials in split order from scratch (this program's
        # own too: the same result whichever split arrives last, so a call is
        # deterministic): mm the running max of the lse, den and o the sums of
        # 2^(lse_i - mm) and 2^(lse_i - mm) o_i. The next partial is loaded (L2: .cg)
        # before the current one is added.
        mm = gl.full_like(lse, float("-inf"))
        den = gl.zeros_like(lse)
        o = gl.zeros_like(o)
        lse_n = gl.load(mid_lse_ptr + hrow, cache_modifier=".cg")
        o_n = gl.load(mid_o_ptr + tile_off, cache_modifier=".cg")
        for i in range(num_splits):
            lse_i = lse_n
            o_i = o_n
            nxt = i + 1
            lse_n = gl.load(mid_lse_ptr + hrow + nxt, mask=nxt < num_splits,
                            other=float("-inf"), cache_modifier=".cg")
            o_n = gl.load(mid_o_ptr + nxt * 512 + tile_off, mask=nxt < num_splits, other=0.0,
                          cache_modifier=".cg")
            m_new = gl.maximum(mm, lse_i)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # every partial so far empty
            a = gl.exp2(mm - m_safe)
            w = gl.exp2(lse_i - m_safe)
            o = o * gl.expand_dims(a, 1) + o_i * gl.expand_dims(w, 1)
            den = den * a + w
            mm = m_new
        o = o / gl.expand_dims(gl.where(den > 0.0, den, 1.0), 1)
        gl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty))


@gluon.jit
def _tile(q_lo, q_hi, q_r, ring, ring_pe, bars, bars1, scratch, scratch1, g, ph, buf, m, l, acc, key0, end, qk_scale,
          kv_desc, pe_desc, p, p_row0, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row,
          p_last_page, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups, seq_lens_ptr,
          block_tables_ptr, stride_btb, dtype: gl.constexpr, PAGE: gl.constexpr, R: gl.constexpr,
          LEAN: gl.constexpr, MASK: gl.constexpr, LAZY: gl.constexpr, FB: gl.constexpr):
    """One 32-key tile: the partial scores, the CTA barrier, the refill of the last tile's two
    slots, the softmax step and P V. Returns the consumer's and the producer's new state
    (``p_row0``: FB's row of slot p, the cursor one slot further; unused otherwise)."""
    i0, ph0, i1, ph1, bf = _ring_slots(g, ph, buf, R, LEAN, FB)
    _score_partials(q_lo, q_hi, q_r, ring, ring_pe, bars, bars1, scratch, scratch1, i0, ph0, i1, ph1, bf, FB)
    gl.thread_barrier()  # every warp's partials stored; every warp done with the last tile
    fence_async_shared()  # ... its generic reads of the two slots refilled now
    if FB:
        p, p_row0, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row, p_last_page = _produce2(
            kv_desc, pe_desc, ring, ring_pe, bars, bars1, p, p_row0, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots,
            p_start, p_bt_row, p_last_page, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits,
            head_groups, seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, R, LEAN)
    else:
        for _ in gl.static_range(2):
            p, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row, p_last_page = _produce(
                kv_desc, pe_desc, ring, ring_pe, bars, p, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start,
                p_bt_row, p_last_page, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups,
                seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, R, LEAN)
    m, l, acc = _attend(ring, scratch, scratch1, i0, i1, bf, m, l, acc, key0, end, qk_scale, dtype, MASK, LAZY, FB)
    g, ph, buf = _ring_next(g, ph, buf, R, LEAN, FB)
    return (g, ph, buf, m, l, acc,
            p, p_row0, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row, p_last_page)


@gluon.jit(do_not_specialize=["num_items", "num_splits"])
def _mla_decode_gluon_kernel(
    q_ptr, kv_desc, pe_desc, block_tables_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    counter_ptr,  # int32 [B * head_groups], 0 on entry and on exit (SPLIT only)
    qk_scale,  # sm_scale * log2(e)
    inv_splits,  # 1 / num_splits (fp32; LEAN only)
    num_items,  # B * num_splits * head_groups
    num_splits, head_groups,
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    PAGE: gl.constexpr,  # cache block size, a multiple of 16
    R: gl.constexpr,  # ring slots (>= 4)
    SPLIT: gl.constexpr,  # num_splits > 1: partials (and the merge)
    PEEL: gl.constexpr,  # an item's last tile out of the loop (the loop's tiles unmasked)
    LEAN: gl.constexpr,  # ring counters and the producer's items without divisions
    LAZY: gl.constexpr,  # rescale the accumulator only when a row's max grew by > 2^LAZY_LOG2
    MERGE: gl.constexpr = True,  # SPLIT: the last split to arrive merges (else mla_decode's merge kernel)
    FB: gl.constexpr = False,  # fewer CTA barriers a tile: per-slot scratch, a tile's two issues batched
    PDL_TRIGGER: gl.constexpr = False,  # let the merge kernel (launched with PDL) launch before this one ends
):
    if PDL_TRIGGER:  # the merge kernel waits (griddepcontrol.wait) for this grid before it reads
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    dtype: gl.constexpr = q_ptr.dtype.element_ty

    ring = gl.allocate_shared_memory(dtype, [R, 8, _SL, 64], _TMA_SMEM)  # the value slabs
    ring_pe = gl.allocate_shared_memory(dtype, [R, _SL, 64], _TMA_SMEM2)  # the rope slab
    if FB:  # one allocation a slot of the tile, [parity] each (membar: no write-after-write between them)
        scratch = gl.allocate_shared_memory(gl.float32, [2, _W, 16, _SL], _SCRATCH)
        scratch1 = gl.allocate_shared_memory(gl.float32, [2, _W, 16, _SL], _SCRATCH)
    else:
        scratch = gl.allocate_shared_memory(gl.float32, [4, _W, 16, _SL], _SCRATCH)  # [parity x slot]
        scratch1 = scratch
    bars = gl.allocate_shared_memory(gl.int64, [R, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(R):
        mbarrier.init(bars.index(k), count=1)
    bars1 = bars
    if FB:  # the barriers of odd slot counts (see _ring_slots)
        bars1 = gl.allocate_shared_memory(gl.int64, [R, 1], mbarrier.MBarrierLayout())
        for k in gl.static_range(R):
            mbarrier.init(bars1.index(k), count=1)
    gl.thread_barrier()

    # The producer cursor at the program's first item with a key, its first R - 2 slots in flight.
    # LEAN: nprog and the cursor in mixed radix (sequence, split, head group), divided once here.
    groups = num_splits * head_groups
    dh = nprog % head_groups
    ds = (nprog // head_groups) % num_splits
    db = nprog // groups
    b_last = (num_items - 1) // groups
    p_b = pid // groups
    p_s = (pid // head_groups) % num_splits
    p_hg = pid % head_groups
    if LEAN:
        p_item, p_b, p_s, p_hg, p_start, p_nslots, p_bt_row, p_last_page = _seek_lean(
            pid, p_b, p_s, p_hg, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups,
            seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, False)
    else:
        p_item, p_start, p_nslots, p_bt_row, p_last_page = _seek(pid, nprog, num_items, num_splits, head_groups,
                                                                 seq_lens_ptr, block_tables_ptr, stride_btb, PAGE)
    p_slot = 0
    p_row = _slot_row(p_bt_row, p_start, p_last_page, PAGE)
    p = 0
    for _k in gl.static_range(R - 2):
        bars_k = bars
        if FB and _k % 2 == 1:  # slot count _k's barrier (see _ring_slots)
            bars_k = bars1
        p, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row, p_last_page = _produce(
            kv_desc, pe_desc, ring, ring_pe, bars_k, p, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start,
            p_bt_row, p_last_page, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups,
            seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, R, LEAN)
    p_row0 = p_row
    if FB:  # the cursor one slot ahead of the issues: p_row0 is slot p's row (-1: none to issue)
        p_row0 = gl.where(p_item < num_items, p_row, -1)
        p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row, p_last_page = _advance(
            p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row, p_last_page, nprog, db, ds, dh, b_last,
            num_items, num_splits, inv_splits, head_groups, seq_lens_ptr, block_tables_ptr, stride_btb, PAGE, LEAN)
        # Not for the hardware (the mbarrier waits order the TMA writes): for membar, whose state
        # at the tile loop's head otherwise holds the prologue's copies (writes of bars, bars1
        # and the ring) and puts a CTA barrier before every tile's first wait.
        gl.thread_barrier()

    g = 0  # default: slots consumed (ring index g % R, phase (g // R) & 1); LEAN: see _ring_slots
    ph = 0
    buf = 0
    for item in range(pid, num_items, nprog):
        b, s, hg, start, end, seq_len = _item_range(seq_lens_ptr, item, num_items, num_splits, head_groups)
        nt = gl.cdiv(gl.maximum(end - start, 0), _BN)
        # q's latency overlaps the wait for the item's first slots (issued long before).
        q_lo, q_hi, q_r = _load_q(q_ptr, item, num_items, num_splits, head_groups, stride_qb, stride_qh)
        m = gl.full([16], float("-inf"), gl.float32, gl.SliceLayout(1, _S2))
        l = gl.zeros([16], gl.float32, gl.SliceLayout(1, _S2))
        acc = gl.zeros([16, 512], gl.float32, _MMA2)
        if PEEL:
            n_loop = nt - 1
        else:
            n_loop = nt
        for i in range(n_loop):
            (g, ph, buf, m, l, acc,
             p, p_row0, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row, p_last_page) = _tile(
                q_lo, q_hi, q_r, ring, ring_pe, bars, bars1, scratch, scratch1, g, ph, buf, m, l, acc, start + i * _BN, end,
                qk_scale, kv_desc, pe_desc, p, p_row0, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start,
                p_bt_row, p_last_page, nprog, db, ds, dh, b_last, num_items, num_splits, inv_splits, head_groups,
                seq_lens_ptr, block_tables_ptr, stride_btb, dtype, PAGE, R, LEAN, 1 if PEEL else 0, LAZY, FB)
        if PEEL:  # noqa: SIM102 (a constexpr test around a runtime one)
            if nt > 0:
                (g, ph, buf, m, l, acc,
                 p, p_row0, p_row, p_item, p_b, p_s, p_hg, p_slot, p_nslots, p_start, p_bt_row, p_last_page) = _tile(
                    q_lo, q_hi, q_r, ring, ring_pe, bars, bars1, scratch, scratch1, g, ph, buf, m, l, acc,
                    start + n_loop * _BN, end, qk_scale, kv_desc, pe_desc, p, p_row0, p_row, p_item, p_b, p_s, p_hg,
                    p_slot, p_nslots, p_start, p_bt_row, p_last_page, nprog, db, ds, dh, b_last, num_items,
                    num_splits, inv_splits, head_groups, seq_lens_ptr, block_tables_ptr, stride_btb, dtype, PAGE, R,
                    LEAN, 2, LAZY, FB)
        _finish(acc, m, l, out_ptr, mid_o_ptr, mid_lse_ptr, counter_ptr, b, s, hg, num_splits, head_groups,
                stride_ob, stride_oh, SPLIT, MERGE)
    for k in gl.static_range(R):  # every issued slot was waited on (none issued past the last item)
        mbarrier.invalidate(bars.index(k))
    if FB:
        for k in gl.static_range(R):
            mbarrier.invalidate(bars1.index(k))


# --------------------------------------------------------------------------------- launcher


def _cache_descriptors(kv_cache: torch.Tensor):
    """TMA descriptors of a slot's two boxes: the value columns of the cache [blocks, page, 576]
    seen as [8 slabs, blocks x page rows, 64] (strides 64, 576, 1: a permuted view of the same
    bytes; one [8, 16, 64] box lands slab-major), and the rope columns as [blocks x page, 64]
    (row stride 576; one [16, 64] box)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n = kv_cache.shape[0] * kv_cache.shape[1]
    flat = kv_cache.view(n, RANK + ROPE)
    val = flat[:, :RANK].unflatten(1, (8, 64)).permute(1, 0, 2)
    pe = flat[:, RANK:]
    return (TensorDescriptor(val, list(val.shape), list(val.stride()), [8, SLOT, 64], _TMA_SMEM.value),
            TensorDescriptor(pe, list(pe.shape), list(pe.stride()), [SLOT, 64], _TMA_SMEM2.value))


def mla_gluon_unsupported(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          seq_lens: torch.Tensor, *, kv_lora_rank: int) -> list[str]:
    """Why ``mla_decode_gluon`` cannot take this call (empty: it can)."""
    why = []
    dev = q.device
    if dev.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        why.append("needs a CUDA device without the Triton interpreter")
    elif torch.cuda.get_device_capability(dev)[0] != 9:
        why.append(f"needs sm_90 (Hopper), got sm_{''.join(map(str, torch.cuda.get_device_capability(dev)))}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        why.append(f"q must be bf16 or fp16, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        why.append(f"the latent cache must be in q's dtype ({q.dtype}), got {kv_cache.dtype}")
    if q.dim() != 3 or kv_cache.dim() != 3:
        why.append("q must be [B, H, D] and kv_cache [num_blocks, block_size, D]")
        return why
    if kv_lora_rank != RANK or q.shape[2] != RANK + ROPE or kv_cache.shape[2] != RANK + ROPE:
        why.append(f"only kv_lora_rank {RANK} + rope {ROPE} (DeepSeek-V2/V3), got {kv_lora_rank} + "
                   f"{q.shape[2] - kv_lora_rank}")
    if q.shape[1] % HEADS:
        why.append(f"the head count must be a multiple of {HEADS}, got {q.shape[1]}")
    page = kv_cache.shape[1]
    if page % SLOT or page & (page - 1):
        why.append(f"block_size must be a power of two >= {SLOT}, got {page}")
    if not kv_cache.is_contiguous() or kv_cache.data_ptr() % 16:
        why.append("kv_cache must be contiguous and 16-byte aligned (TMA)")
    if q.stride(-1) != 1:
        why.append("q needs a contiguous last dim")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.dim() != 2 \
            or block_tables.stride(-1) != 1:
        why.append("block_tables and seq_lens must be int32, block_tables [B, max_blocks] with a contiguous last dim")
    return why


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_shapes(q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 out: torch.Tensor | None) -> torch.Tensor:
    """block_tables [B, ...], seq_lens [B] and out [B, H, 512] in q's dtype (allocated when
    None) for q [B, H, 576], or a ValueError naming what is wrong; returns out."""
    B, H, _ = q.shape
    if block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"block_tables must be [B={B}, max_blocks] and seq_lens [B], got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if out is None:
        return torch.empty(B, H, RANK, dtype=q.dtype, device=q.device)
    if out.shape != (B, H, RANK) or out.stride(-1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be {q.dtype} [{B}, {H}, {RANK}] with a contiguous last dim")
    return out


def pick_splits(batch: int, head_groups: int, max_context: int, programs: int,
                min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """Key splits a sequence: the most that keep the item count within one item a program and
    each split >= ``min_split_keys`` keys (of ``max_context``, an upper bound known on the host:
    reading ``seq_lens`` would sync and break CUDA-graph capture)."""
    by_fill = max(1, programs // (batch * head_groups))
    by_len = max(1, math.ceil(max_context / min_split_keys))
    return max(1, min(by_fill, by_len))


def _launch(q, kv_cache, block_tables, seq_lens, *, kv_lora_rank, sm_scale, out=None, num_splits=None,
            programs: int | None = None, stages: int = STAGES, peel: bool = False, lean: bool = False,
            lazy: bool = False, fewer_barriers: bool = False, fuse_max_splits: int = FUSE_MAX_SPLITS,
            pdl_merge: bool = False):
    """mla_decode_gluon with the knobs tests and benchmarks turn: ``programs`` (None: 2 an SM,
    at most one a work item), ``stages`` (ring slots, >= 4), ``peel`` (an item's last tile out
    of the loop), ``lean`` (ring counters, the producer's items without divisions), ``lazy``
    (the accumulator rescaled only when a row's max grew by > 2^8), ``fewer_barriers`` (fewer
    CTA barriers a tile: the module doc), ``fuse_max_splits`` (the most splits merged inside
    the kernel; more: the merge kernel), ``pdl_merge`` (that merge kernel launched with PDL,
    this one letting it launch from its start: its launch under this kernel's tail, not after)."""
    why = mla_gluon_unsupported(q, kv_cache, block_tables, seq_lens, kv_lora_rank=kv_lora_rank)
    if why:
        raise ValueError("mla_decode_gluon cannot take this call: " + "; ".join(why))
    if stages < 4:
        raise ValueError(f"stages must be >= 4, got {stages}")
    B, H, _ = q.shape
    out = check_shapes(q, block_tables, seq_lens, out)
    if B == 0:
        return out
    hg = H // HEADS
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    slots = PROGRAMS_PER_SM * _num_sms(dev)
    if num_splits is None:
        num_splits = pick_splits(B, hg, block_tables.shape[1] * kv_cache.shape[1], programs or slots)
    num_splits = max(1, int(num_splits))
    items = B * hg * num_splits
    split = num_splits > 1
    fused = split and num_splits <= fuse_max_splits
    mid_o = mid_lse = counters = out  # unused without splits
    if split:
        mid_o = torch.empty(B, H, num_splits, RANK, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    if fused:
        counters = _merge_counters(q.device, B * hg)
    grid = min(items, max(1, programs or slots))
    pdl = split and not fused and resolve_pdl(pdl_merge, q.device)
    _mla_decode_gluon_kernel[(grid,)](
        q, *_cache_descriptors(kv_cache), block_tables, seq_lens, out, mid_o, mid_lse, counters,
        sm_scale * _LOG2E, 1.0 / num_splits, items, num_splits, hg,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        PAGE=kv_cache.shape[1], R=stages, SPLIT=split, PEEL=peel, LEAN=lean, LAZY=lazy, MERGE=fused,
        FB=fewer_barriers, PDL_TRIGGER=pdl, num_warps=NUM_WARPS)
    if split and not fused:
        _merge(mid_o, mid_lse, out, RANK, pdl)
    return out


def mla_decode_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: object | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``mla_decode`` (kernels/mla_decode.py) as one persistent Gluon kernel on Hopper; the same
    arguments, layouts and result.

    q            : [B, H, 576] bf16/fp16, H a multiple of 16 (absorbed query, then q_pe)
    kv_cache     : [num_blocks, block_size, 576] in q's dtype, contiguous; block_size a power of
                   two >= 16
    block_tables : int32 [B, max_blocks]; entries past ``seq_lens[b]`` are never read
    seq_lens     : int32 [B] (0: a padding row, zeros out)
    returns out  : [B, H, 512] in q's dtype

    ``config`` and ``pdl`` are the Triton kernel's knobs, accepted for a drop-in swap and
    ignored (this kernel has one tile shape; its merge kernel's PDL launch is ``_launch``'s
    ``pdl_merge``, off until an H200 run times it). It runs ENGINE_FORM's tile-loop knobs. Raises ValueError with ``mla_gluon_unsupported``'s reasons where it cannot run.
    """
    del config, pdl
    return _launch(q, kv_cache, block_tables, seq_lens, kv_lora_rank=kv_lora_rank, sm_scale=sm_scale,
                   out=out, num_splits=num_splits, **ENGINE_FORM)


__all__ = ["mla_decode_gluon", "mla_gluon_unsupported", "pick_splits"]
