"""Causal / full prefill attention for sm_90 in Gluon, FlashAttention-3 style (beside
flash_prefill.py's Triton kernel; head_dim 128 only): contiguous self-attention
(``flash_prefill_gluon``) and over the paged KV cache (``paged_prefill_gluon``, which
flash_prefill.paged_prefill takes under FLASHPAGE_PREFILL_GLUON=1; see Paged below).
H200: 1.06x SDPA cuDNN at 2 x 4096 and 1 x 16384 causal (contiguous, BENCHMARKS.md).

Contract (self-attention over a ragged batch, as ``flash_attn_varlen`` with
cu_seqlens_q == cu_seqlens_k)::

    q    [total, Hq, 128]  bf16 / fp16, contiguous
    k, v [total, Hkv, 128] q's dtype, contiguous; q head h reads kv head h // (Hq // Hkv)
    cu_seqlens int32 [B + 1]: sequence b owns rows cu[b]:cu[b+1] of q, k and v
    out  [total, Hq, 128] q's dtype;  lse [Hq, total] fp32 (natural log), optional

Causal masking is top-left = bottom-right here (as many queries as keys): query i sees keys
j <= i. Scores, the softmax and the output accumulators are fp32 (base-2 online softmax).

Work tiles are (128-query tile, q head, sequence). Their order: the (head, sequence) pairs
in chunks of ``head_group`` (default: the fewest pairs whose tiles fill every SM once, e.g. 8
of 2 x 4096's 64, 2 of 16384's 32 heads), chunk after chunk, heaviest first within a chunk
(every pair's last query tile, then every second to last, ...): the SMs work on few heads at
a time, whose K/V stay in L2, and the causal tiles still come big to small. Persistent (the
default): one program per SM; ``dynamic`` (the default schedule): a program takes its next
tile from a global counter when it starts one, so whoever finishes first takes the next
(balanced whatever the chunk), the counter zeroed by the last program to finish;
``static``: tiles pid, pid + #SMs, ...; ``snake``: the same, every second round backwards.
Else one program per tile (the hardware hands them out in order). A program is 3 warpgroups
(maxnreg 168: 384 x 168 registers)::

    warpgroup 0 (default partition, 24 regs)   producer: per work tile, K_j and V_j of every
                                               key tile into a STAGES-deep ring (per slot: a
                                               ready mbarrier the TMA bytes complete, an empty
                                               one both consumers arrive on), and Q (two
                                               [64, 128] boxes) into Q buffer qi % Q_BUFS
                                               right after K_0, once both consumers released
                                               that buffer (q_empty: each arrives once its last
                                               S is done, before its last P.V and store, so
                                               one Q buffer loads under them); dynamic: the tile index
                                               posted with it (sched[2 + 2 pid + buffer]), and
                                               the next one fetched
    warpgroup 1 (worker, CONSUMER_REGS = 240)  consumer 0: query rows m0 .. m0 + 63
    warpgroup 2 (worker, CONSUMER_REGS = 240)  consumer 1: query rows m0 + 64 .. m0 + 127

Ring slots and mbarrier phases follow a key-tile counter that runs on across a program's
work tiles (slot it % STAGES, parity (it // STAGES) & 1; the producer's empty waits start
at parity 1, which a fresh barrier passes), so the producer loads the next work tile's
K/V and Q while the consumers finish the last one and store it.

Each consumer runs, for key tile j >= 1 of a work tile (FA3's intra-warpgroup order: the
P.V of tile j - 1 issued right behind QK^T of tile j)::

    wait K_j ready;  [PINGPONG: wait my turn]
    S_j  = Q K_j^T                      async wgmma (Q and K from shared memory)
    O   *= alpha_{j-1}                  (registers, while S_j runs)
    wait V_{j-1} ready
    O   += P_{j-1} V_{j-1}              async wgmma (P from registers, V from shared memory)
    [PINGPONG: pass the turn to the other consumer]
    wait S_j (wgmma wait 1) -> release K_j;  mask (diagonal / ragged-end tiles only), max,
    exp2, row sums -> P_j, alpha_j;  wait O (wgmma wait 0) -> release V_{j-1}

(tile 0: S_0 and its softmax only; after the last tile its P.V, then O / l stored.) What
ptxas makes of it (sm_90 SASS, tests/kernels/test_flash_prefill_gluon.py): 16 HGMMA
64x128x16 a tile, one ``wait 1`` and one ``wait 0``, no serialised wgmma (C7514), no spill.
PV_OVERLAP (the default): ptxas hoists a wgmma wait above any ALU work (without it: the
``wait 0`` sits above all 64 exp2 of an unmasked tile, right after the ``wait 1``, so a
warpgroup's softmax never overlaps its own P.V), but not above a shared-memory store: the
row sums l, the softmax's last result, are stored to a scratch row (``l_fence``, never read)
before the wait, and all 66 exp2 of a tile land between ``wait 1`` and ``wait 0`` (P_j
packed there too, into registers of its own: 215 (causal) to 237 (full) of 240 used).
Cost: 2 STS and one more named barrier per tile (Triton's membar orders the scratch stores
of consecutive tiles). A global store does not pin the wait (a masked-off STG: ptxas
hoists the wait above it).
Tried and dropped (SASS only): P through shared memory, a wait predicated on the row sum and
the next tile's QK^T issued before the softmax (the latter two make ptxas serialise every
wgmma, C7514).

PINGPONG (FA3's inter-warpgroup schedule): two mbarriers ``turn[0]``, ``turn[1]``; consumer g
waits on turn[g] before issuing its two wgmmas and arrives on turn[1 - g] after, so the
tensor cores take the two consumers' GEMM pairs alternately. Phases follow the key-tile
counter: consumer 0 waits parity (it + 1) & 1 (a fresh barrier passes parity 1: it goes
first), consumer 1 parity it & 1; both see the same key tiles, and a turn barrier is never
more than one phase ahead of its waiter (each arrive follows the arriver's own wait on the
other barrier).

Causal: key tiles past the query tile's last row are never loaded; tiles wholly at or below
its first row run unmasked; the diagonal tile(s) (and a ragged end) are masked. Tile rows
past a sequence's end read the next sequence's rows (TMA boxes are not clipped per
sequence; past the tensor they read zeros): their keys are masked to -inf (P = 0, and the
values are finite), their query rows are not stored.

The output is stored from the wgmma accumulator registers (masked, no TMA store: a box would
write into the next sequence); lse likewise when asked for.

Paged (``paged_prefill_gluon``, flash_prefill.paged_prefill's contract; PAGED): K and V come
from a cache [num_blocks, block_size, Hkv, 128] in q's dtype through block tables, queries
from q with cu_seqlens_q, each sequence's key count from seq_lens (cached prefix + its new
tokens); query i of a sequence sits at key position seq_len - q_len + i (the causal
diagonal moved right by the prefix: _kv_range). The K/V descriptors see the cache as its
[num_blocks * block_size, Hkv * 128] slots, one box = PIECE = min(block_size, 128) rows of
one KV head::

    per key tile j (128 keys), producer:
      rows = block_tables[b, min(page(128 j + PIECE p), last_page)] * bs + offset   p < 128/PIECE
             (one int32 load a thread, lane p holding box p's: before the k_empty wait)
      wait k_empty;  expect(k_ready, 32 KB);  128 / PIECE TMA boxes -> K stage rows PIECE p ..
      wait v_empty;  expect(v_ready, 32 KB);  the same rows -> V stage

(block 16: 8 boxes of [16, 128] a tile, K and V; 128 and up: one). Pages past the context
(a key tile reaching past seq_len) re-read the last valid page: never a block-table entry
past the context. Keys >= seq_len are masked to -inf like a ragged end, and since their
slots may hold anything (NaN included) and P = 0 times NaN is NaN, a work tile's last key
tile, the only one that can reach past seq_len, has its V rows there zeroed in shared
memory before its P.V (_zero_v_tail: both consumers write the same zeros over rows nothing
else writes until both released the stage, then fence.proxy.async and a warpgroup barrier;
16-row pieces, only those reaching seq_len). What ptxas makes of it (block 16, causal):
the consumers' loops as above (16 HGMMA, one wait 1 and one wait 0 a tile, all 66 exp2
under P.V), the producer's loop under 24 registers (22 used) with one LDG and 24 SHFL
(3 a box) a tile; a 12-byte spill of one work-tile invariant of the consumers
(128 num_m - 127), stored once and loaded once per work tile, none in a loop.

At block 16 that producer loop is 462 SASS instructions a key tile, 16 UTMALDG (each two
2 KB messages: a [16, 128] box under the 128-byte swizzle is two 64-column boxes) and 20
named bar.syncs (Triton's membar orders every TMA issue after the last); H200: 0.86x
contiguous (run 82). ``producer="gather"`` (PAGED == PAGED_GATHER, FA3's paged path for
pages smaller than a tile) copies K/V by cp.async instead::

    per key tile j, all 128 producer threads:
      offs[r] = (block_tables[b, k // PAGE] * PAGE + k % PAGE) * stride_slot,
                k = min(128 j + r, seq_k - 1)       16 rows a thread, one LDG each, before the wait
      wait k_empty;  16 x cp.async 16 B (row r's chunk) -> K stage;  cp.async.mbarrier.arrive.noinc k_ready
      wait v_empty;  the same rows -> V stage;                        ... v_ready (128 arrivals a phase)

into the same swizzled stages (the consumers' wgmmas unchanged; each fences the proxies,
fence.proxy.async, once a tile after its ready waits: cp.async writes through the generic
proxy). Rows past the context re-read key seq_k - 1's slot (finite, masked), so V needs no
zeroing. sm_90 SASS (block 16, causal, dynamic): the producer's loop 347 instructions
(32 LDGSTS, 16 LDG, 2 arrives, 6 named bar.syncs; the Q boxes and the dynamic schedule's
fetch of j = 0 included, as in the 462) under 56 registers (54 used; at 24 and 40 it spills in the loop), the
consumers at 224 (222 used, no spill; their loops as above plus one MEMBAR.ALL.CTA and
FENCE.VIEW.ASYNC.S). Not yet run on a GPU (benchmarks/gpu_s11_prefill.sh).

``producer="tma1"`` (PRODUCER_WARPS = 1): the same boxes from a producer of ONE warp. The
20 bar.syncs above are membar's (it sees every issue write the stage and the ready barrier
through a dynamic index, i.e. the whole allocation, and orders it after the last), and all 4
producer warps step through them; among one warp they lower to nothing. Gluon's default
partition has the kernel's 4 warps, so consumer 0 becomes the default partition and the
workers are consumer 1 (4 warps), the producer (1) and 3 idle warps (_idle) filling its
warpgroup; all 4 of that warpgroup ask for 504 - 2 x 240 = 24 registers, so Triton's split
is the same 240 / 240 / 24. The producer and the idle warps return only after consumer 1's
arrive on a ``done`` barrier: going back up (setmaxnreg) any earlier would spin for, or
starve consumer 1 of, registers its own 240 took (Triton's own padding warps return at
once). sm_90 SASS (block 16, causal, dynamic): the producer's loop 384 instructions, 36
UTMALDG (one warp issues both halves of a box), 0 bar.sync, under 24 registers (18 used);
the consumers' loops the same 16 HGMMA, waits and 66 exp2 under P.V, +1 to +4 instructions
(a thread-index read and moves: consumer 0 is the default partition); 36 B spilled (work-
tile invariants, none in a loop). Not yet run on a GPU: its correctness tests are
test_paged_prefill_gather.py's, parametrized over "gather" and "tma1".
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flashpage.kernels.device import cuda_capability, num_sms
from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.tma_maps import cached_tma_maps, descriptor

_LOG2E = 1.4426950408889634
HEAD_DIM = 128
BLOCK_M = 128  # queries per program: 64 per consumer warpgroup
BLOCK_N = 128  # keys per tile
WG_M = 64
STAGES = 2  # K/V ring depth: Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB of shared memory
MAXNREG = 168  # 384 threads x 168 = 64512 registers: 24 for the producer, 240 per consumer
CONSUMER_REGS = 240
# paged_prefill_gluon(producer="gather"): the cp.async producer's 16 row offsets and their
# pointers need 54 registers (sm_90 SASS: spills in its loop at 24 and 40), the consumers
# fit 224 (causal: 222 used, no spill): 56 for the producer
GATHER_CONSUMER_REGS = 224
PRODUCERS = ("tma", "gather", "tma1")


def engine_options(block_size: int, producer: str = "") -> dict:
    """paged_prefill_gluon's producer and ring depth as flash_prefill.paged_prefill runs them:
    ``producer`` ("", or FLASHPAGE_PREFILL_PRODUCER's value: "tma", "gather", "tma1") forces one;
    by default the one-warp TMA producer ("tma1") under 128-token blocks, TMA boxes ("tma") from
    128 up. The ring is 3 deep under "tma1" (its warpgroups leave the shared memory a third
    stage with one Q buffer), 2 otherwise.

    H200, block 16, causal (BENCHMARKS.md): the paged / contiguous ratio of graph replays timed
    back to back in 200 pairs (benchmarks/prefill_paired.py, runs 112 and 114, the consumers
    releasing Q before the last P.V) 0.975 / 0.978 / 0.966 at 2 x 4096 / 1 x 16384 / 8 x 1024 for
    tma1 3 deep, 0.87 / 0.90 / 0.87 for tma1 2 deep (run 111); over runs 95-97's rounds gather
    0.90 / 0.89 / 0.90 (the Gluon kernels' rounds spread by up to 10%: hence the pairs); 8192
    cached + 8192: 563-599 TFLOP/s against gather's 518-543. Run 89: gather 3-5%
    over the 4-warp TMA boxes at block 16, 8-19% under them at block 128 (the boxes there as fast
    as contiguous)."""
    if producer:
        if producer not in PRODUCERS:
            raise ValueError(f"FLASHPAGE_PREFILL_PRODUCER must be one of {list(PRODUCERS)}, got {producer!r}")
    else:
        producer = "tma1" if block_size < BLOCK_N else "tma"
    return {"producer": producer, "num_stages": 3 if producer == "tma1" else STAGES}


_D = gl.constexpr(HEAD_DIM)
_BM = gl.constexpr(BLOCK_M)
_BN = gl.constexpr(BLOCK_N)
_WM = gl.constexpr(WG_M)
_MAXNREG = gl.constexpr(MAXNREG)

# wgmma accumulators of one consumer warpgroup: S [64, BLOCK_N] and O [64, 128], m64nNk16.
_S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, BLOCK_N, 16]))
_O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, HEAD_DIM, 16]))
# P as the register A operand of O += P V: the S accumulator's registers, packed to 16 bits.
_P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT, k_width=2))
# A tile's box rows (paged), lane p of each producer warp holding box p's.
_ROWS_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
# The same for a producer of one warp (producer="tma1").
_ROWS_LAYOUT1 = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))
# A [16, 128] piece of a V tile over one consumer warpgroup (16 bytes a thread a row: the
# swizzle's unit), for zeroing the rows past a paged sequence's context.
_V_ROWS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                        warps_per_cta=[4, 1], order=[1, 0]))
# A [128, 128] K / V tile over the producer warpgroup as PAGED_GATHER copies it: 16 bytes a
# thread a row, a warp 2 rows (512 contiguous bytes of the cache) an instruction.
_GATHER_ROWS = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                             warps_per_cta=[4, 1], order=[1, 0]))
# Q, K and V tiles as TMA lands them (128-byte swizzle; a 256-byte row is two 64-column boxes).
_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


# --------------------------------------------------------------------------------- schedule

STATIC, SNAKE, DYNAMIC, DYNAMIC_MEMSET = 0, 1, 2, 3  # SCHEDULE (see the launcher's schedule)
# PAGED: K/V from the contiguous k, v (0), from a paged cache by TMA boxes (1, producer "tma")
# or by cp.async rows (2, producer "gather"); PAGED is true for both paged forms.
CONTIGUOUS, PAGED_TMA, PAGED_GATHER = 0, 1, 2
_GATHER = gl.constexpr(PAGED_GATHER)
_SNAKE = gl.constexpr(SNAKE)
_DYNAMIC = gl.constexpr(DYNAMIC)


@gluon.jit
def _tile_coords(t, cu_seqlens_ptr, num_m, num_heads, num_hb, head_group):
    """Work tile t -> (q head, first query row m0, the sequence's first row, its length, the
    sequence).
    (head, sequence) pairs hb = b * num_heads + h in chunks of head_group; chunk by chunk,
    heaviest first within a chunk: the last query tile of each of its pairs, then each
    second to last, ... (head_group = num_hb: every pair's last tile first; 1: one head's
    query tiles adjacent, last first). A chunk's K/V is what the SMs share in L2."""
    chunk = head_group * num_m
    c = t // chunk
    r = t - c * chunk
    hb0 = c * head_group
    hg = gl.minimum(head_group, num_hb - hb0)  # the last chunk may be short
    mt = num_m - 1 - r // hg
    hb = hb0 + r % hg
    h = hb % num_heads
    b = hb // num_heads
    q_start = gl.load(cu_seqlens_ptr + b)
    seq = gl.load(cu_seqlens_ptr + b + 1) - q_start
    return h, mt * _BM, q_start, seq, b


@gluon.jit
def _kv_len(b, seq_q, seq_lens_ptr, PAGED: gl.constexpr):
    """Keys of sequence b: its context seq_lens[b] (cached prefix + its seq_q new tokens)
    when PAGED, else its own seq_q rows."""
    if PAGED:
        seq_k = gl.load(seq_lens_ptr + b)
    else:
        seq_k = seq_q
    return seq_k


@gluon.jit
def _static_tile(k, SCHEDULE: gl.constexpr):
    """A static schedule's k-th work tile of this program: pid + k * #programs (STATIC), or
    boustrophedon (SNAKE: odd rounds walk the programs backwards, so a program that took a
    heavier tile in one round takes a lighter one in the next)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if SCHEDULE == _SNAKE:
        pid = pid + (k & 1) * (nprog - 1 - 2 * pid)
    return k * nprog + pid


@gluon.jit
def _kv_range(m0, seq_q, seq_k, CAUSAL: gl.constexpr, PAGED: gl.constexpr):
    """(n_full, n_tiles): key tiles [0, n_full) are visible whole to every query row of the
    tile at m0; tiles [n_full, n_tiles) need the mask (causal diagonal, ragged end); later
    key tiles are never loaded. PAGED: query row i sits at key position i + seq_k - seq_q
    (bottom right), and at least one tile runs (a work tile whose rows see no key, only if
    seq_k < seq_q, runs one masked tile: zero output, lse -inf); else seq_k = seq_q."""
    if PAGED:
        if CAUSAL:
            shift = seq_k - seq_q
            # keys of the tile's last row + 1
            hi = gl.minimum(seq_k, gl.minimum(m0 + _BM, seq_q) + shift)
            n_full = gl.maximum(gl.minimum(m0 + shift + 1, seq_k), 0) // _BN
        else:
            hi = seq_k
            n_full = seq_k // _BN
        n_tiles = gl.maximum(gl.cdiv(hi, _BN), 1)
    else:
        if CAUSAL:
            hi = gl.minimum(seq_q, m0 + _BM)  # keys of the tile's last row + 1
            n_full = gl.minimum(m0 + 1, seq_q) // _BN
        else:
            hi = seq_q
            n_full = seq_q // _BN
        n_tiles = gl.cdiv(hi, _BN)
    return n_full, n_tiles


# --------------------------------------------------------------------------------- producer


@gluon.jit
def _kv_rows(j, bt_row, last_page, PAGE: gl.constexpr, PIECE: gl.constexpr,
             PRODUCER_WARPS: gl.constexpr):
    """PAGED: the cache rows (slots) of key tile j's 128 / PIECE boxes, [128 / PIECE] int32 in
    every producer thread's registers: box p starts at key 128 j + PIECE p, in slot
    block_tables[b, page] * PAGE + the key's offset in its page; a page past the context
    (after last_page, the page of key seq_k - 1) re-reads last_page (a valid block id; the
    rows past seq_k are masked and their V zeroed). One load per box, all issued together
    (the producer loads them before it waits for the ring slot). PRODUCER_WARPS: the
    producer partition's warps (4, or 1 for producer="tma1"), which the layout spans."""
    if PRODUCER_WARPS == 1:
        offs = gl.arange(0, _BN // PIECE, layout=_ROWS_LAYOUT1)
    else:
        offs = gl.arange(0, _BN // PIECE, layout=_ROWS_LAYOUT)
    pos = j * _BN + offs * PIECE
    blk = gl.load(bt_row + gl.minimum(pos // PAGE, last_page))
    return blk * PAGE + pos % PAGE


@gluon.jit
def _issue_kv(desc, stage, bar, j, k_start, rows, kv_col, PAGED: gl.constexpr,
              PIECE: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """TMA of key tile j's [128, 128] rows of one KV head into ``stage``, on ``bar``.
    Contiguous: one box at row k_start + 128 j. PAGED: 128 / PIECE boxes of PIECE rows, box p
    at rows[p] (_kv_rows) into stage rows PIECE p .. PIECE p + PIECE - 1."""
    if PAGED:
        if PRODUCER_WARPS == 1:
            offs = gl.arange(0, _BN // PIECE, layout=_ROWS_LAYOUT1)
        else:
            offs = gl.arange(0, _BN // PIECE, layout=_ROWS_LAYOUT)
        for p in gl.static_range(_BN // PIECE):
            # element p of a tensor every thread holds whole (max, not sum: a replicated
            # layout may be reduced over its copies too; rows are >= 0)
            row = gl.max(gl.where(offs == p, rows, -1), 0)
            if PIECE == _BN:
                tma.async_copy_global_to_shared(desc, [row, kv_col], bar, stage)
            else:
                tma.async_copy_global_to_shared(desc, [row, kv_col], bar,
                                                stage.slice(p * PIECE, PIECE))
    else:
        tma.async_copy_global_to_shared(desc, [k_start + j * _BN, kv_col], bar, stage)


@gluon.jit
def _gather_rows(j, bt_row, seq_k, stride_slot, PAGE: gl.constexpr, SLOT64: gl.constexpr):
    """PAGED_GATHER: the element offsets in the cache of key tile j's 128 rows (one KV head's
    start excluded), [128] in the copy layout (16 a thread: the rows its 16-byte chunks come
    from), shared by K and V: key 128 j + r in slot block_tables[b, page] * PAGE + its offset
    in the page, slots stride_slot elements apart (int64 if SLOT64, else int32: the launcher
    knows the cache's size). Keys >= seq_k (a tile reaching past the context) read key
    seq_k - 1's slot instead: finite values (scores masked, P = 0) from a page of the
    context, so neither the copies nor the block-table loads need a mask, and the consumers
    need not zero V there (rows past the context of a TMA-gathered tile may be NaN). Loaded
    before the producer waits for the ring slot."""
    keys = j * _BN + gl.arange(0, _BN, layout=gl.SliceLayout(1, _GATHER_ROWS))
    # unsigned: the page and the offset in it by a shift and a mask (keys >= 0)
    keys = gl.minimum(keys, gl.maximum(seq_k - 1, 0)).to(gl.uint32)
    slots = gl.load(bt_row + keys // PAGE) * PAGE + (keys % PAGE).to(gl.int32)
    if SLOT64:
        offs = slots.to(gl.int64) * stride_slot
    else:
        offs = slots * stride_slot
    return offs


@gluon.jit
def _gather_kv(head_ptr, stage, bar, offs):
    """PAGED_GATHER: one key tile's [128, 128] rows of one KV head (``head_ptr``: its first
    element in slot 0) copied by cp.async into ``stage`` (the 128-byte-swizzled layout TMA
    writes): each producer thread 16 chunks of 16 bytes (a warp: 2 rows of 256 bytes an
    instruction), row r from head_ptr + offs[r] (_gather_rows). Then each thread's
    cp.async.mbarrier.arrive.noinc on ``bar`` (initialised to 128 arrivals): its phase
    completes once every thread's copies have landed."""
    cols = gl.expand_dims(gl.arange(0, _D, layout=gl.SliceLayout(0, _GATHER_ROWS)), 0)
    async_copy.async_copy_global_to_shared(stage, head_ptr + gl.expand_dims(offs, 1) + cols)
    async_copy.mbarrier_arrive(bar, increment_count=False)


@gluon.jit
def _load_tile(t, it, qi, h, m0, q_start, seq, seq_k, bt_row, sched_ptr, slot_ptr, q_desc,
               k_desc, v_desc, k_cache_ptr, v_cache_ptr, stride_slot, q_smem, k_smem, v_smem,
               q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, group, CAUSAL: gl.constexpr,
               DYN: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
               PAGED: gl.constexpr, PAGE: gl.constexpr, PIECE: gl.constexpr,
               SLOT64: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """One work tile's loads: K_j and V_j of every key tile into ring slot ``it % NUM_STAGES``
    (``it`` counts key tiles over all work tiles) once both consumers have released what it
    held, and Q into Q buffer ``qi % Q_BUFS`` (after K_0, once both consumers are done with
    the Q it held). DYN: the tile index posted in the buffer's slot before Q, for the
    consumers to read once Q landed, and the next tile fetched from the counter after V_0
    (the ring is full then: the fetch's round trip, which Triton's broadcast of the result
    makes the producer wait for, mostly costs it no time it had) -> (it, the next tile; 0
    if not DYN). PAGED: K and V tiles gathered from the cache, seq_k keys: TMA boxes
    (_issue_kv) or, PAGED_GATHER, cp.async rows (_gather_kv, from k_cache_ptr / v_cache_ptr,
    slots stride_slot elements apart)."""
    n_full, n_tiles = _kv_range(m0, seq, seq_k, CAUSAL, PAGED)
    kv_col = (h // group) * _D
    last_page = gl.maximum(seq_k - 1, 0) // PAGE
    # every box of a K (V) tile counts toward its slot's one mbarrier: 128 x 128 x 2 bytes
    kv_bytes: gl.constexpr = (_BN // PIECE) * k_desc.block_type.nbytes
    nxt = 0
    for j in range(n_tiles):
        s = it % NUM_STAGES
        phase = ((it // NUM_STAGES) & 1) ^ 1  # a fresh barrier passes parity 1
        rows = 0
        if PAGED == _GATHER:  # the block-table loads under the wait for the slot
            rows = _gather_rows(j, bt_row, seq_k, stride_slot, PAGE, SLOT64)
            mbarrier.wait(k_empty.index(s), phase)
            _gather_kv(k_cache_ptr + kv_col, k_smem.index(s), k_ready.index(s), rows)
        else:
            if PAGED:  # the block-table loads under the wait for the slot
                rows = _kv_rows(j, bt_row, last_page, PAGE, PIECE, PRODUCER_WARPS)
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_ready.index(s), kv_bytes)
            _issue_kv(k_desc, k_smem.index(s), k_ready.index(s), j, q_start, rows, kv_col, PAGED,
                      PIECE, PRODUCER_WARPS)
        if j == 0:
            qb = qi % Q_BUFS
            mbarrier.wait(q_empty.index(qb), ((qi // Q_BUFS) & 1) ^ 1)
            if DYN:
                gl.store(slot_ptr + qb, t)
                gl.thread_barrier()  # the store before the (elected thread's) arrive below
            mbarrier.expect(q_bar.index(qb), 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_start + m0, h * _D], q_bar.index(qb),
                                            q_smem.index(2 * qb))
            tma.async_copy_global_to_shared(q_desc, [q_start + m0 + _WM, h * _D], q_bar.index(qb),
                                            q_smem.index(2 * qb + 1))
        mbarrier.wait(v_empty.index(s), phase)
        if PAGED == _GATHER:
            _gather_kv(v_cache_ptr + kv_col, v_smem.index(s), v_ready.index(s), rows)
        else:
            mbarrier.expect(v_ready.index(s), kv_bytes)
            _issue_kv(v_desc, v_smem.index(s), v_ready.index(s), j, q_start, rows, kv_col, PAGED,
                      PIECE, PRODUCER_WARPS)
        if DYN:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if j == 0:
                nxt = gl.num_programs(0) + gl.atomic_add(sched_ptr, 1)
        it += 1
    return it, nxt


@gluon.jit
def _produce(q_desc, k_desc, v_desc, k_cache_ptr, v_cache_ptr, stride_slot, q_smem, k_smem,
             v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, cu_seqlens_ptr,
             seq_lens_ptr, block_tables_ptr, stride_bt,
             sched_ptr, group, num_m, num_heads, num_hb, head_group, CAUSAL: gl.constexpr,
             SCHEDULE: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
             PAGED: gl.constexpr, PAGE: gl.constexpr, PIECE: gl.constexpr, SLOT64: gl.constexpr,
             PRODUCER_WARPS: gl.constexpr):
    """Default partition (one warpgroup; TMA issued by single threads): this program's work
    tiles' loads. Static schedules: tiles _static_tile(0), _static_tile(1), ... Dynamic: tile
    pid first, then #programs + a global counter's next value (fetched early, _load_tile), each
    non-empty tile posted to the consumers with its Q; past the last, ``total`` posted with a
    bare arrive on q_bar (the consumers' stop), and (DYNAMIC) the last program to stop
    zeroes the counters for the next launch."""
    total = num_m * num_hb
    nprog = gl.num_programs(0)
    slot_ptr = sched_ptr + 2 + Q_BUFS * gl.program_id(0)  # this program's slots, one per Q buffer
    it = 0  # key tiles loaded so far
    qi = 0  # query tiles loaded so far
    if SCHEDULE >= _DYNAMIC:
        t = gl.program_id(0)
        while t < total:
            h, m0, q_start, seq, b = _tile_coords(t, cu_seqlens_ptr, num_m, num_heads, num_hb,
                                                  head_group)
            if m0 < seq:
                seq_k = _kv_len(b, seq, seq_lens_ptr, PAGED)
                it, t = _load_tile(t, it, qi, h, m0, q_start, seq, seq_k,
                                   block_tables_ptr + b * stride_bt, sched_ptr, slot_ptr, q_desc,
                                   k_desc, v_desc, k_cache_ptr, v_cache_ptr, stride_slot, q_smem,
                                   k_smem, v_smem, q_bar, q_empty, k_ready,
                                   v_ready, k_empty, v_empty, group, CAUSAL, True, NUM_STAGES,
                                   Q_BUFS, PAGED, PAGE, PIECE, SLOT64, PRODUCER_WARPS)
                qi += 1
            else:  # past a short sequence's end: nothing to load or compute
                t = nprog + gl.atomic_add(sched_ptr, 1)
        qb = qi % Q_BUFS
        mbarrier.wait(q_empty.index(qb), ((qi // Q_BUFS) & 1) ^ 1)
        gl.store(slot_ptr + qb, total)
        gl.thread_barrier()
        mbarrier.arrive(q_bar.index(qb))
        # every program's fetches precede its increment of sched[1]
        if SCHEDULE == _DYNAMIC:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if gl.atomic_add(sched_ptr + 1, 1) == nprog - 1:
                gl.store(sched_ptr, 0)
                gl.store(sched_ptr + 1, 0)
    else:
        for k in range(gl.cdiv(total, nprog)):
            t = _static_tile(k, SCHEDULE)
            if t < total:
                h, m0, q_start, seq, b = _tile_coords(t, cu_seqlens_ptr, num_m, num_heads, num_hb,
                                                      head_group)
                if m0 < seq:
                    seq_k = _kv_len(b, seq, seq_lens_ptr, PAGED)
                    it, _ = _load_tile(t, it, qi, h, m0, q_start, seq, seq_k,
                                       block_tables_ptr + b * stride_bt, sched_ptr, slot_ptr,
                                       q_desc, k_desc, v_desc, k_cache_ptr, v_cache_ptr,
                                       stride_slot, q_smem, k_smem, v_smem, q_bar,
                                       q_empty, k_ready, v_ready, k_empty, v_empty, group, CAUSAL,
                                       False, NUM_STAGES, Q_BUFS, PAGED, PAGE, PIECE, SLOT64,
                                       PRODUCER_WARPS)
                    qi += 1


# --------------------------------------------------------------------------------- consumers


@gluon.jit
def _softmax(s, m, l, qk_scale, rows, n0, seq, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """Online-softmax step on raw scores s [64, BLOCK_N] (base 2, scaled by qk_scale):
    -> (m_new, l_new, p fp32, alpha = exp2(m - m_new)). MASKED: keys >= seq (and, CAUSAL,
    keys > the row) count as -inf; a row that has seen no key yet keeps m = -inf."""
    if MASKED:
        cols = n0 + gl.arange(0, _BN, layout=gl.SliceLayout(0, _S_LAYOUT))
        keep = gl.expand_dims(cols < seq, 0)
        if CAUSAL:
            keep = keep & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1))
        s = gl.where(keep, s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
        m_use = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m - m_use)
    l = l * alpha + gl.sum(p, 1)
    return m_new, l, p, alpha


@gluon.jit
def _to_p(p, dtype: gl.constexpr):
    return gl.convert_layout(p.to(dtype), _P_LAYOUT)


@gluon.jit
def _to_rows_o(x):
    return gl.convert_layout(x, gl.SliceLayout(1, _O_LAYOUT))


@gluon.jit
def _first_tile(it, q, k_smem, k_ready, k_empty, turn, m, l, qk_scale, rows, seq,
                G: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                NUM_STAGES: gl.constexpr, PAGED: gl.constexpr):
    """Key tile 0 of a work tile (ring position it): S_0 and its softmax, no P.V yet; always
    masked (cheap, once; it is the diagonal of the first query tile and the ragged end of
    short sequences). PAGED_GATHER: a proxy fence after the wait (cp.async writes K through
    the generic proxy, wgmma reads it through the async one)."""
    sk = it % NUM_STAGES
    mbarrier.wait(k_ready.index(sk), (it // NUM_STAGES) & 1)
    if PAGED == _GATHER:
        fence_async_shared()
    if PINGPONG:
        mbarrier.wait(turn.index(G), (it + 1 - G) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(sk).permute((1, 0)),
                          gl.zeros([_WM, _BN], gl.float32, _S_LAYOUT), use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - G))
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(sk))
    return _softmax(s, m, l, qk_scale, rows, 0, seq, True, CAUSAL)


@gluon.jit
def _tile(j, it0, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, l_fence, m, l, o,
          p, alpha, qk_scale, rows, seq, G: gl.constexpr, MASKED: gl.constexpr,
          CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, PV_OVERLAP: gl.constexpr,
          NUM_STAGES: gl.constexpr, PAGED: gl.constexpr):
    """Key tile j >= 1 (ring position it0 + j): S_j = Q K_j^T and O = alpha_{j-1} O +
    P_{j-1} V_{j-1} issued back to back, then the softmax of S_j. PAGED_GATHER: V_{j-1}
    (loaded before K_j) waited for with K_j, then one proxy fence for both, before any wgmma
    of the tile is issued (none is in flight then)."""
    it = it0 + j
    sk = it % NUM_STAGES
    sv = (it - 1) % NUM_STAGES
    mbarrier.wait(k_ready.index(sk), (it // NUM_STAGES) & 1)
    if PAGED == _GATHER:
        mbarrier.wait(v_ready.index(sv), ((it - 1) // NUM_STAGES) & 1)
        fence_async_shared()
    if PINGPONG:
        mbarrier.wait(turn.index(G), (it + 1 - G) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(sk).permute((1, 0)),
                          gl.zeros([_WM, _BN], gl.float32, _S_LAYOUT), use_acc=False, is_async=True)
    o = o * gl.expand_dims(_to_rows_o(alpha), 1)
    if PAGED != _GATHER:
        mbarrier.wait(v_ready.index(sv), ((it - 1) // NUM_STAGES) & 1)
    o_tok = warpgroup_mma(p, v_smem.index(sv), o, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - G))
    s = warpgroup_mma_wait(1, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(sk))
    m, l, p32, alpha = _softmax(s, m, l, qk_scale, rows, j * _BN, seq, MASKED, CAUSAL)
    if PV_OVERLAP:
        # ptxas hoists a wgmma wait above any ALU work it likes (here: the whole softmax), but
        # not above a shared-memory store: the row sums l (the softmax's last result) stored
        # to a scratch row pin the wait below every exp2, so the softmax of S_j runs under
        # P_{j-1} V_{j-1}. P_j packed before the wait and kept live through it (registers of
        # its own; packed after it instead, LLVM's 16-bit shuffling costs 32 PRMT a tile).
        p_new = _to_p(p32, q.dtype)
        l_fence.index(G).store(l)
        o, p, p_new = warpgroup_mma_wait(0, deps=(o_tok, p, p_new))
        mbarrier.arrive(v_empty.index(sv))
    else:
        p_new = _to_p(p32, q.dtype)
        o, p, p_new = warpgroup_mma_wait(0, deps=(o_tok, p, p_new))
        mbarrier.arrive(v_empty.index(sv))
    return m, l, o, p_new, alpha


@gluon.jit
def _zero_v_tail(v_stage, n0, seq_k):
    """Rows of a V tile (keys n0 ..) at keys >= seq_k set to zero in shared memory, by
    16-row pieces (only pieces reaching seq_k are read and written): a paged cache's slots
    past the context may hold anything, NaN included, and their P = 0 times NaN would be
    NaN. Both consumers do it on the same stage: each writes only zeros over rows that
    nothing else writes until both released the stage, so whichever store lands last, the
    rows are zero before each consumer's own fence and P.V."""
    for c in gl.static_range(_BN // 16):
        if n0 + (c + 1) * 16 > seq_k:
            piece = v_stage.slice(c * 16, 16)
            keys = n0 + c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, _V_ROWS))
            x = piece.load(_V_ROWS)
            piece.store(gl.where(gl.expand_dims(keys < seq_k, 1), x, gl.zeros_like(x)))
    fence_async_shared()  # the stores before the wgmma's (async proxy) reads
    gl.thread_barrier()  # every thread of the warpgroup's stores before its wgmma


@gluon.jit
def _attend(q, q_empty, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, l_fence, it,
            n_full, n_tiles, qk_scale, rows, seq, G: gl.constexpr, CAUSAL: gl.constexpr,
            PINGPONG: gl.constexpr, PV_OVERLAP: gl.constexpr, NUM_STAGES: gl.constexpr,
            PAGED: gl.constexpr):
    """One work tile's key tiles (ring positions it .. it + n_tiles - 1), the default schedule
    (module docstring): -> (m, l, O unnormalised). rows: the query rows' key positions;
    seq: the key count (keys >= seq masked). PAGED: the last tile's V rows past seq zeroed
    before its P.V (only the last tile of a work tile can reach past seq; PAGED_GATHER: by
    the copies, zero-filled)."""
    m = gl.full([_WM], float("-inf"), gl.float32, gl.SliceLayout(1, _S_LAYOUT))
    l = gl.zeros([_WM], gl.float32, gl.SliceLayout(1, _S_LAYOUT))
    o = gl.zeros([_WM, _D], gl.float32, _O_LAYOUT)
    m, l, p32, alpha = _first_tile(it, q, k_smem, k_ready, k_empty, turn, m, l, qk_scale,
                                   rows, seq, G, CAUSAL, PINGPONG, NUM_STAGES, PAGED)
    p = _to_p(p32, q.dtype)
    for j in range(1, n_full):  # every key visible to every row
        m, l, o, p, alpha = _tile(j, it, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                  turn, l_fence, m, l, o, p, alpha, qk_scale, rows, seq, G, False,
                                  CAUSAL, PINGPONG, PV_OVERLAP, NUM_STAGES, PAGED)
    for j in range(gl.maximum(n_full, 1), n_tiles):  # the diagonal, the ragged end
        m, l, o, p, alpha = _tile(j, it, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                  turn, l_fence, m, l, o, p, alpha, qk_scale, rows, seq, G, True,
                                  CAUSAL, PINGPONG, PV_OVERLAP, NUM_STAGES, PAGED)
    # every S of the work tile is done (the last wgmma wait retired it): Q may be replaced
    # while the last P.V and the store run (with one Q buffer the producer's next Q, and the
    # K/V behind it, wait for this; released after the P.V instead, the next work tile waited
    # for its Q's whole load)
    mbarrier.arrive(q_empty)
    # the last key tile's P.V
    last = it + n_tiles - 1
    sv = last % NUM_STAGES
    o = o * gl.expand_dims(_to_rows_o(alpha), 1)
    mbarrier.wait(v_ready.index(sv), (last // NUM_STAGES) & 1)
    if PAGED == _GATHER:  # rows past seq were zero-filled by the copies
        fence_async_shared()
    elif PAGED:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if n_tiles * _BN > seq:
            _zero_v_tail(v_smem.index(sv), (n_tiles - 1) * _BN, seq)
    o_tok = warpgroup_mma(p, v_smem.index(sv), o, is_async=True)
    o, p = warpgroup_mma_wait(0, deps=(o_tok, p))
    mbarrier.arrive(v_empty.index(sv))
    return m, l, o


@gluon.jit
def _compute_tile(it, h, m0, q_start, seq, seq_k, q, k_smem, v_smem, q_empty, k_ready, v_ready,
                  k_empty, v_empty, turn, l_fence, out_ptr, lse_ptr, qk_scale, stride_ot,
                  stride_oh, stride_lse, G: gl.constexpr, CAUSAL: gl.constexpr,
                  RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr, PV_OVERLAP: gl.constexpr,
                  NUM_STAGES: gl.constexpr, PAGED: gl.constexpr):
    """Query rows m0 + 64g .. m0 + 64g + 63 of one work tile (its Q landed; seq queries,
    seq_k keys, query i at key position i + seq_k - seq) over its key tiles, then those
    output rows (and lse) stored -> it past its key tiles."""
    n_full, n_tiles = _kv_range(m0, seq, seq_k, CAUSAL, PAGED)
    row0 = m0 + G * _WM
    rows = row0 + gl.arange(0, _WM, layout=gl.SliceLayout(1, _S_LAYOUT))
    m, l, o = _attend(q, q_empty, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn,
                      l_fence, it, n_full, n_tiles, qk_scale, rows + (seq_k - seq), seq_k, G,
                      CAUSAL, PINGPONG, PV_OVERLAP, NUM_STAGES, PAGED)

    l_safe = gl.where(l == 0.0, 1.0, l)
    o = o * gl.expand_dims(_to_rows_o(1.0 / l_safe), 1)  # 2 divisions a thread, not 64
    rows_o = row0 + gl.arange(0, _WM, layout=gl.SliceLayout(1, _O_LAYOUT))
    cols_o = gl.arange(0, _D, layout=gl.SliceLayout(0, _O_LAYOUT))
    r2 = gl.expand_dims(rows_o, 1)
    c2 = gl.expand_dims(cols_o, 0)
    ptrs = out_ptr + (q_start + r2).to(gl.int64) * stride_ot + h * stride_oh + c2
    gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=(r2 < seq) & (c2 < _D))
    if RETURN_LSE:
        lse = gl.where(l == 0.0, float("-inf"), (m + gl.log2(l_safe)) * 0.6931471805599453)
        gl.store(lse_ptr + h.to(gl.int64) * stride_lse + q_start + rows, lse, mask=rows < seq)
    return it + n_tiles


@gluon.jit
def _consume(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
             l_fence, out_ptr, lse_ptr, cu_seqlens_ptr, seq_lens_ptr, sched_ptr, qk_scale, num_m,
             num_heads, num_hb, head_group, stride_ot, stride_oh, stride_lse, G: gl.constexpr,
             CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr,
             PV_OVERLAP: gl.constexpr, SCHEDULE: gl.constexpr, NUM_STAGES: gl.constexpr,
             Q_BUFS: gl.constexpr, PAGED: gl.constexpr):
    """Worker partition g (one warpgroup): this program's work tiles, as the producer walks
    them (dynamic: the tile index the producer posted with each Q, until one >= total); the
    qi-th one's Q in buffer qi % Q_BUFS."""
    total = num_m * num_hb
    it = 0  # key tiles consumed so far (ring position and turn parity)
    qi = 0  # query tiles consumed so far
    if SCHEDULE >= _DYNAMIC:
        slot_ptr = sched_ptr + 2 + Q_BUFS * gl.program_id(0)
        mbarrier.wait(q_bar.index(0), 0)
        t = gl.load(slot_ptr, volatile=True)
        while t < total:
            qb = qi % Q_BUFS
            h, m0, q_start, seq, b = _tile_coords(t, cu_seqlens_ptr, num_m, num_heads, num_hb,
                                                  head_group)
            seq_k = _kv_len(b, seq, seq_lens_ptr, PAGED)
            it = _compute_tile(it, h, m0, q_start, seq, seq_k, q_smem.index(2 * qb + G), k_smem,
                               v_smem, q_empty.index(qb), k_ready, v_ready, k_empty, v_empty, turn,
                               l_fence, out_ptr, lse_ptr, qk_scale, stride_ot, stride_oh,
                               stride_lse, G, CAUSAL, RETURN_LSE, PINGPONG, PV_OVERLAP, NUM_STAGES,
                               PAGED)
            qi += 1
            qb = qi % Q_BUFS
            mbarrier.wait(q_bar.index(qb), (qi // Q_BUFS) & 1)
            t = gl.load(slot_ptr + qb, volatile=True)
    else:
        for k in range(gl.cdiv(total, gl.num_programs(0))):
            t = _static_tile(k, SCHEDULE)
            if t < total:
                h, m0, q_start, seq, b = _tile_coords(t, cu_seqlens_ptr, num_m, num_heads, num_hb,
                                                      head_group)
                if m0 < seq:
                    seq_k = _kv_len(b, seq, seq_lens_ptr, PAGED)
                    qb = qi % Q_BUFS
                    mbarrier.wait(q_bar.index(qb), (qi // Q_BUFS) & 1)
                    it = _compute_tile(it, h, m0, q_start, seq, seq_k, q_smem.index(2 * qb + G),
                                       k_smem, v_smem, q_empty.index(qb), k_ready, v_ready,
                                       k_empty, v_empty, turn, l_fence, out_ptr, lse_ptr, qk_scale,
                                       stride_ot, stride_oh, stride_lse, G, CAUSAL, RETURN_LSE,
                                       PINGPONG, PV_OVERLAP, NUM_STAGES, PAGED)
                    qi += 1


@gluon.jit
def _consume_then_arrive(done, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty,
                         v_empty, turn, l_fence, out_ptr, lse_ptr, cu_seqlens_ptr, seq_lens_ptr,
                         sched_ptr, qk_scale, num_m, num_heads, num_hb, head_group, stride_ot,
                         stride_oh, stride_lse, G: gl.constexpr, CAUSAL: gl.constexpr,
                         RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr,
                         PV_OVERLAP: gl.constexpr, SCHEDULE: gl.constexpr,
                         NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr, PAGED: gl.constexpr):
    """producer="tma1": consumer 1 (a worker), then an arrive on ``done``: its work is over,
    the producer's warpgroup may take its registers back (_idle)."""
    _consume(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
             l_fence, out_ptr, lse_ptr, cu_seqlens_ptr, seq_lens_ptr, sched_ptr, qk_scale, num_m,
             num_heads, num_hb, head_group, stride_ot, stride_oh, stride_lse, G, CAUSAL,
             RETURN_LSE, PINGPONG, PV_OVERLAP, SCHEDULE, NUM_STAGES, Q_BUFS, PAGED)
    mbarrier.arrive(done)


@gluon.jit
def _produce_then_wait(done, q_desc, k_desc, v_desc, k_cache_ptr, v_cache_ptr, stride_slot, q_smem,
                       k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                       cu_seqlens_ptr, seq_lens_ptr, block_tables_ptr, stride_bt, sched_ptr,
                       group, num_m, num_heads, num_hb, head_group, CAUSAL: gl.constexpr,
                       SCHEDULE: gl.constexpr, NUM_STAGES: gl.constexpr, Q_BUFS: gl.constexpr,
                       PAGED: gl.constexpr, PAGE: gl.constexpr, PIECE: gl.constexpr,
                       SLOT64: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
    """producer="tma1": the producer (one warp), then _idle's wait."""
    _produce(q_desc, k_desc, v_desc, k_cache_ptr, v_cache_ptr, stride_slot, q_smem, k_smem, v_smem,
             q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, cu_seqlens_ptr, seq_lens_ptr,
             block_tables_ptr, stride_bt, sched_ptr, group, num_m, num_heads, num_hb, head_group,
             CAUSAL, SCHEDULE, NUM_STAGES, Q_BUFS, PAGED, PAGE, PIECE, SLOT64, PRODUCER_WARPS)
    _idle(done)


@gluon.jit
def _idle(done):
    """producer="tma1": the producer's warp and the 3 idle warps beside it in its warpgroup
    return only once consumer 1 is done (its arrive on ``done``). Each of the 4 sets its
    registers down to the producer's 24 on entering its partition (setmaxnreg is a
    warpgroup's) and back up to the idle workers' count when it returns; consumer 1's 240
    take exactly what they and the default partition gave up, so a way back up before
    consumer 1's own way down spins in setmaxnreg (issue slots the consumers share) and,
    before consumer 1 got its registers, would starve it for good (Triton pads a 1-warp
    partition with warps that return at once: that race). Here they sleep in an mbarrier
    wait instead."""
    mbarrier.wait(done, 0)


# --------------------------------------------------------------------------------- kernel


# Nothing that varies from one engine step to the next is specialized (Triton specializes
# ints == 1 and % 16, pointers on 16-byte alignment), so that serving compiles it once per
# dtype / block size / Q buffers: block_tables / seq_lens are views (block_tables[nd:]) whose
# alignment follows the number of decodes; the work sizes and the lse stride follow the batch
@gluon.jit(do_not_specialize=["seq_lens_ptr", "block_tables_ptr", "stride_bt", "group", "num_m",
                              "num_heads", "num_hb", "head_group", "stride_lse"])
def _flash_prefill_gluon_kernel(
    q_desc, k_desc, v_desc, out_ptr, lse_ptr, cu_seqlens_ptr,
    seq_lens_ptr,  # PAGED: int32 [B], each sequence's keys (else unused)
    block_tables_ptr, stride_bt,  # PAGED: int32 [B, max_blocks] (else unused)
    k_cache_ptr, v_cache_ptr, stride_slot,  # PAGED_GATHER: the caches, slots apart (else unused)
    sched_ptr,  # int32 [2 + #programs]: dynamic schedules' counter, stop count, posted tiles
    qk_scale,  # sm_scale * log2(e)
    group,  # q heads per kv head
    num_m,  # query tiles per sequence (of the longest)
    num_heads, num_hb,  # q heads; q heads x sequences
    head_group,  # (head, sequence) pairs per chunk of the work order
    stride_ot, stride_oh, stride_lse,
    CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr,
    PV_OVERLAP: gl.constexpr, SCHEDULE: gl.constexpr, NUM_STAGES: gl.constexpr,
    Q_BUFS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PAGED: gl.constexpr,  # K/V from a paged cache: PAGED_TMA (k_desc, v_desc over its slots)
    # or PAGED_GATHER (cp.async from k_cache_ptr, v_cache_ptr); CONTIGUOUS: k_desc, v_desc
    PAGE: gl.constexpr,  # PAGED: the cache's block size (a power of two >= 16), else 1
    PIECE: gl.constexpr,  # rows of a K/V TMA box: min(PAGE, 128) when PAGED, else 128
    SLOT64: gl.constexpr,  # PAGED_GATHER: cache offsets past int32 (a cache of >= 2**31 elements)
    PRODUCER_WARPS: gl.constexpr = 4,  # 4: the producer is the default partition (a warpgroup);
    # 1: a worker of one warp, consumer 0 the default partition (producer="tma1")
):
    """Work tiles 0 .. num_m * num_hb - 1 over the programs (a grid of all of them: one each;
    a grid of #SMs: persistent) as SCHEDULE says."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2 * Q_BUFS, _WM, _D], _SMEM)  # [buffer, consumer]
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, _BN, _D], _SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, _BN, _D], _SMEM)
    # PV_OVERLAP's scratch rows (written, never read)
    l_fence = gl.allocate_shared_memory(gl.float32, [2, _WM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_BUFS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(Q_BUFS):
        mbarrier.init(q_bar.index(i), count=1)  # the producer's expect; the bytes complete it
        mbarrier.init(q_empty.index(i), count=2)  # one arrive per consumer warpgroup
    # the ready barriers: the producer's expect (the TMA bytes complete them), or PAGED_GATHER
    # one cp.async arrive (noinc) per producer thread
    ready_count: gl.constexpr = 128 if PAGED == _GATHER else 1
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=ready_count)
        mbarrier.init(v_ready.index(i), count=ready_count)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()

    if PRODUCER_WARPS == 1:
        # producer="tma1": consumer 0 the default partition (4 warps); workers consumer 1 (4
        # warps) and, in the third warpgroup, the producer (1 warp) and 3 idle warps (_idle),
        # each asking for the producer's registers: the default partition gets what is left
        # of 3 x 128 x MAXNREG, 3 x 168 - CONSUMER_REGS - producer_regs = CONSUMER_REGS: the
        # budgets of the 4-warp producer's form (240 / 240 / 24)
        producer_regs: gl.constexpr = 3 * _MAXNREG - 2 * CONSUMER_REGS
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(done, count=1)  # consumer 1's arrive after its last work tile
        fence_async_shared()
        gl.warp_specialize([
            (_consume, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty,
                        v_empty, turn, l_fence, out_ptr, lse_ptr, cu_seqlens_ptr, seq_lens_ptr,
                        sched_ptr, qk_scale, num_m, num_heads, num_hb, head_group, stride_ot,
                        stride_oh, stride_lse, 0, CAUSAL, RETURN_LSE, PINGPONG, PV_OVERLAP,
                        SCHEDULE, NUM_STAGES, Q_BUFS, PAGED)),
            (_consume_then_arrive, (done, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty,
                        v_empty, turn, l_fence, out_ptr, lse_ptr, cu_seqlens_ptr, seq_lens_ptr,
                        sched_ptr, qk_scale, num_m, num_heads, num_hb, head_group, stride_ot,
                        stride_oh, stride_lse, 1, CAUSAL, RETURN_LSE, PINGPONG, PV_OVERLAP,
                        SCHEDULE, NUM_STAGES, Q_BUFS, PAGED)),
            (_produce_then_wait, (done, q_desc, k_desc, v_desc, k_cache_ptr, v_cache_ptr,
                                  stride_slot, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                                  v_ready, k_empty, v_empty, cu_seqlens_ptr, seq_lens_ptr,
                                  block_tables_ptr, stride_bt, sched_ptr, group, num_m, num_heads,
                                  num_hb, head_group, CAUSAL, SCHEDULE, NUM_STAGES, Q_BUFS, PAGED,
                                  PAGE, PIECE, SLOT64, PRODUCER_WARPS)),
            (_idle, (done,)),
            (_idle, (done,)),
            (_idle, (done,)),
        ], [4, 1, 1, 1, 1], [CONSUMER_REGS, producer_regs, producer_regs, producer_regs,
                             producer_regs])
    else:
        gl.warp_specialize([
            (_produce, (q_desc, k_desc, v_desc, k_cache_ptr, v_cache_ptr, stride_slot, q_smem,
                        k_smem, v_smem, q_bar, q_empty, k_ready,
                        v_ready, k_empty, v_empty, cu_seqlens_ptr, seq_lens_ptr, block_tables_ptr,
                        stride_bt, sched_ptr, group, num_m, num_heads, num_hb, head_group, CAUSAL,
                        SCHEDULE, NUM_STAGES, Q_BUFS, PAGED, PAGE, PIECE, SLOT64, PRODUCER_WARPS)),
            (_consume, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                        turn, l_fence, out_ptr, lse_ptr, cu_seqlens_ptr, seq_lens_ptr, sched_ptr,
                        qk_scale, num_m, num_heads, num_hb, head_group, stride_ot, stride_oh,
                        stride_lse, 0, CAUSAL, RETURN_LSE, PINGPONG, PV_OVERLAP, SCHEDULE,
                        NUM_STAGES, Q_BUFS, PAGED)),
            (_consume, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                        turn, l_fence, out_ptr, lse_ptr, cu_seqlens_ptr, seq_lens_ptr, sched_ptr,
                        qk_scale, num_m, num_heads, num_hb, head_group, stride_ot, stride_oh,
                        stride_lse, 1, CAUSAL, RETURN_LSE, PINGPONG, PV_OVERLAP, SCHEDULE,
                        NUM_STAGES, Q_BUFS, PAGED)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# --------------------------------------------------------------------------------- launcher


def _descriptor(t: torch.Tensor, box_rows: int):
    """TMA descriptor over the [rows, heads * 128] view of a token-major [rows, heads, 128]
    tensor whose [heads, 128] rows are contiguous (rows t.stride(0) apart): one
    [box_rows, 128] box per tile of one head. A [num_blocks, page, Hkv, 128] cache is seen
    as its [num_blocks * page, Hkv * 128] slots."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if t.dim() == 4:
        t = t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1],
                            [box_rows, HEAD_DIM], _SMEM.value)


def _check(q, k, v, cu_seqlens, max_seqlen, sm_scale, out) -> None:
    """ValueErrors a caller can act on; the device check last, so that shape errors show
    on any machine."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, cu_seqlens)):
        raise ValueError("q, k, v and cu_seqlens must be tensors")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [total_tokens, num_q_heads, {HEAD_DIM}], got {tuple(q.shape)}")
    if k.dim() != 3 or k.shape[2] != HEAD_DIM or k.shape[0] != q.shape[0]:
        raise ValueError(f"k must be [total_tokens={q.shape[0]}, num_kv_heads, {HEAD_DIM}], "
                         f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, strides {t.stride()}")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start 16-byte aligned (TMA), got address {t.data_ptr():#x}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be int32 [batch + 1], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if int(max_seqlen) < 1:
        raise ValueError(f"max_seqlen must be >= 1 (and >= every sequence's length), got {max_seqlen}")
    if sm_scale is not None and not float(sm_scale) > 0.0:
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {q.dtype} {tuple(q.shape)}, got {out.dtype} "
                         f"{tuple(out.shape)}")
    devices = {t.device for t in (q, k, v, cu_seqlens)} | ({out.device} if out is not None else set())
    if len(devices) != 1:
        raise ValueError(f"q, k, v, cu_seqlens (and out) must be on one device, got {sorted(map(str, devices))}")
    if q.device.type != "cuda" or cuda_capability(q.device)[0] != 9:
        raise ValueError("flash_prefill_gluon runs on CUDA sm_90 (Hopper) only")


_SCHEDULES = {"static": STATIC, "snake": SNAKE, "dynamic": DYNAMIC, "dynamic_memset": DYNAMIC_MEMSET}
_SCHED_BUFFERS: dict[tuple[torch.device, bool], torch.Tensor] = {}


def flash_prefill_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    pingpong: bool = True,
    pv_overlap: bool = True,
    persistent: bool = True,
    schedule: str = "dynamic",
    head_group: int | None = None,
    m_fastest: bool = False,
    num_stages: int = STAGES,
    q_buffers: int | None = None,
    cache_descriptors: bool = True,
):
    """Self-attention prefill over a ragged batch (see the module docstring for the layout).

    q [total, Hq, 128], k and v [total, Hkv, 128], bf16 or fp16, contiguous; cu_seqlens int32
    [B + 1]; max_seqlen >= every sequence's length (sizes the work). Returns out [total, Hq,
    128] in q's dtype, and lse [Hq, total] fp32 if return_lse. The default sm_scale is
    128 ** -0.5.

    Tuning knobs (the defaults are the expected best; benchmarks/prefill_gluon.py times each):
    ``pingpong``: the two consumer warpgroups take turns issuing their GEMMs (off: they issue
    freely). ``pv_overlap``: a warpgroup's softmax of S_j runs under its own P_{j-1} V_{j-1}
    (off: ptxas waits for P.V before the softmax). ``persistent``: one program per SM walks
    the work tiles (else one program per work tile, in work order). ``schedule`` (persistent
    only): ``"dynamic"`` (the default: each program takes the next work tile from a global
    counter when it starts one; the last program to finish zeroes the counter, so a launch
    is CUDA-graph safe, but two launches must not run concurrently on one device),
    ``"dynamic_memset"`` (a counter of its own, zeroed by a memset before each launch),
    ``"static"`` (program p takes tiles p, p + #SMs, ...), ``"snake"`` (static,
    boustrophedon). ``head_group``: the work order's chunk, in (head, sequence) pairs: chunk by
    chunk, heaviest query tiles first within each, so that the SMs share a few heads' K/V in
    L2; None: the smallest divisor of heads x sequences whose chunk holds >= #SMs work tiles;
    ``m_fastest`` = head_group 1 (one head's query tiles adjacent); with a static schedule a
    chunk smaller than all pairs unbalances the SMs. ``num_stages``: K/V ring depth (2 or 3).
    ``q_buffers``: Q tiles in shared memory (2: the next work tile's Q loads while this one
    runs; None: 2 with 2 stages up to ``max_seqlen`` 8192, else 1 (3 stages and 2 Q buffers,
    256 KB, do not fit; at 1 x 16384 causal one Q buffer read 606 TFLOP/s against 555 with
    two in run 75 and 600 against 566 in run 76, at 2 x 4096 534 against 584 in run 75).
    ``cache_descriptors``: the launcher's TMA maps (cuTensorMapEncodeTiled of q, k, v) kept
    across calls with the same addresses and shapes (tma_maps; off: encoded every call).
    """
    q_buffers = _check_options(num_stages, q_buffers, schedule, max_seqlen)
    _check(q, k, v, cu_seqlens, max_seqlen, sm_scale, out)
    return _launch(q, _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), k.shape[1], cu_seqlens,
                   None, None, 0, max_seqlen, causal=causal, sm_scale=sm_scale,
                   return_lse=return_lse, out=out, pingpong=pingpong, pv_overlap=pv_overlap,
                   persistent=persistent, schedule=schedule, head_group=head_group,
                   m_fastest=m_fastest, num_stages=num_stages, q_buffers=q_buffers,
                   cache_descriptors=cache_descriptors)


def _check_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                 max_seqlen_k, sm_scale, out) -> None:
    """paged_prefill_gluon's ValueErrors; the device check last (shape errors on any machine)."""
    tensors = (q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("q, key_cache, value_cache, block_tables, cu_seqlens_q and seq_lens must be tensors")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(f"q, key_cache, value_cache dtypes differ: {q.dtype}, {key_cache.dtype}, "
                         f"{value_cache.dtype} (an fp8 cache takes flash_prefill.paged_prefill)")
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [total_q, num_q_heads, {HEAD_DIM}], got {tuple(q.shape)}")
    if q.stride(2) != 1 or q.stride(1) != HEAD_DIM or (q.stride(0) * q.element_size()) % 16:
        raise ValueError(f"q's [heads, {HEAD_DIM}] rows must be contiguous and 16-byte aligned, "
                         f"strides {q.stride()}")
    if key_cache.dim() != 4 or key_cache.shape[3] != HEAD_DIM:
        raise ValueError(f"key_cache must be [num_blocks, block_size, num_kv_heads, {HEAD_DIM}], "
                         f"got {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache "
                         f"{tuple(value_cache.shape)} differ")
    num_blocks, page, hkv, _ = key_cache.shape
    if page < 16 or page & (page - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {page}")
    if num_blocks * page >= 2**31:
        raise ValueError(f"{num_blocks} blocks x {page} slots: at most 2**31 - 1 slots (int32 rows)")
    hq = q.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if name != "q" and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, strides {t.stride()}")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start 16-byte aligned (TMA), got address {t.data_ptr():#x}")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() < 2:
        raise ValueError(f"cu_seqlens_q must be int32 [batch + 1], got {cu_seqlens_q.dtype} "
                         f"{tuple(cu_seqlens_q.shape)}")
    batch = cu_seqlens_q.numel() - 1
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if (block_tables.dtype != torch.int32 or block_tables.dim() != 2
            or block_tables.shape[0] != batch or block_tables.stride(1) != 1):
        raise ValueError(f"block_tables must be int32 [{batch}, max_blocks] with contiguous rows, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if int(max_seqlen_q) < 1:
        raise ValueError(f"max_seqlen_q must be >= 1 (and >= every query count), got {max_seqlen_q}")
    if block_tables.shape[1] * page < int(max_seqlen_k):
        raise ValueError(f"block_tables has {block_tables.shape[1]} blocks of {page} tokens, fewer "
                         f"than max_seqlen_k={max_seqlen_k}")
    if sm_scale is not None and not float(sm_scale) > 0.0:
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1):
        raise ValueError(f"out must be a {q.dtype} {tuple(q.shape)} with a contiguous last "
                         f"dimension, got {out.dtype} {tuple(out.shape)}")
    devices = {t.device for t in tensors} | ({out.device} if out is not None else set())
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.device.type != "cuda" or cuda_capability(q.device)[0] != 9:
        raise ValueError("paged_prefill_gluon runs on CUDA sm_90 (Hopper) only")


def paged_prefill_gluon(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    pingpong: bool = True,
    pv_overlap: bool = True,
    persistent: bool = True,
    schedule: str = "dynamic",
    head_group: int | None = None,
    m_fastest: bool = False,
    num_stages: int = STAGES,
    q_buffers: int | None = None,
    cache_descriptors: bool = True,
    producer: str = "tma",
    consumer_regs: int | None = None,
):
    """flash_prefill.paged_prefill's contract on this kernel: new tokens' queries over the
    paged KV cache (chunked prefill, prefix hits).

    q [total_q, Hq, 128] bf16 / fp16 (rows may be strided: [heads, 128] contiguous);
    key_cache, value_cache [num_blocks, block_size, Hkv, 128] in q's dtype, contiguous,
    block_size a power of two >= 16; block_tables int32 [B, max_blocks]; cu_seqlens_q int32
    [B + 1]; seq_lens int32 [B]: each sequence's context after this step (cached prefix + its
    new tokens, whose K/V are already in the cache), >= its query count (not checked: a
    host sync). Key p of sequence b lives in slot block_tables[b, p // bs] * bs + p % bs;
    query i of b sits at position seq_lens[b] - q_len_b + i (causal: bottom right). Block
    table entries past a sequence's context are never read, and slots past it (in its last
    block) may hold anything, NaN included. max_seqlen_q sizes the work (>= every query
    count); max_seqlen_k (>= every seq_len) only picks the default q_buffers. Returns out
    [total_q, Hq, 128] in q's dtype (and lse [Hq, total_q] fp32 if return_lse).

    K and V tiles of 128 keys are gathered by TMA from the cache seen as [num_blocks * bs,
    Hkv * 128]: min(bs, 128)-row boxes (8 of 16 rows at block size 16), all counted by the
    ring slot's mbarrier; a work tile's last key tile is masked past seq_len (its V rows
    there zeroed in shared memory before the P.V). The knobs are flash_prefill_gluon's
    (q_buffers None: 2 up to max_seqlen_k 8192, else 1), and:

    ``producer``: how K/V tiles reach shared memory. ``"tma"`` (the default): the TMA boxes
    above, issued by one thread of the producer warpgroup each (block 16: 16 UTMALDG a key
    tile, each two 2 KB messages of 64 columns). ``"gather"``: cp.async by all 128 producer
    threads, 16 bytes a row chunk (FA3's paged path for pages smaller than a tile): each
    thread loads the block-table entries of its 16 rows once per key tile (for K and V),
    copies 16 chunks of K and 16 of V into the same swizzled layout, and arrives on the
    slot's mbarrier when its copies land (cp.async.mbarrier.arrive.noinc, 128 arrivals a
    phase); keys past the context re-read key seq_len - 1's slot, so V needs no zeroing; the
    consumers fence the proxies (fence.proxy.async) before their wgmmas read a gathered stage.
    ``"tma1"``: the boxes of "tma" issued by a producer of one warp (a worker partition,
    consumer 0 the default one): no named barrier between its issues (module docstring).
    ``consumer_regs``: each consumer warpgroup's registers (setmaxnreg; a multiple of 8 in
    [208, 240]), the producer warpgroup getting the rest of 384 x 168: None = 240 (producer
    24) for "tma" and "tma1", GATHER_CONSUMER_REGS = 224 (producer 56) for "gather".
    """
    launch = plan_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                        max_seqlen_k, causal=causal, sm_scale=sm_scale, return_lse=return_lse, out=out,
                        pingpong=pingpong, pv_overlap=pv_overlap, persistent=persistent,
                        schedule=schedule, head_group=head_group, m_fastest=m_fastest,
                        num_stages=num_stages, q_buffers=q_buffers, cache_descriptors=cache_descriptors,
                        producer=producer, consumer_regs=consumer_regs)
    out = torch.empty_like(q) if out is None else out
    lse = launch(q, key_cache, value_cache, out)
    return (out, lse) if return_lse else out


def plan_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
               max_seqlen_k, *, causal=True, sm_scale=None, return_lse=False, out=None, pingpong=True,
               pv_overlap=True, persistent=True, schedule="dynamic", head_group=None, m_fastest=False,
               num_stages=STAGES, q_buffers=None, cache_descriptors=True, producer="tma",
               consumer_regs=None, descriptors: dict | None = None):
    """paged_prefill_gluon's checks and choices once -> launch(q, key_cache, value_cache, out)
    -> lse (None without return_lse) for tensors of the same geometry over the planned tables,
    offsets and lengths (flash_prefill.PrefillPlan holds callers to it). Each cache's TMA
    descriptor is made once, kept in ``descriptors`` (a caller's dict kept across plans, e.g.
    one per engine; None: this plan's own)."""
    q_buffers = _check_options(num_stages, q_buffers, schedule, max_seqlen_k)
    if producer not in PRODUCERS:
        raise ValueError(f"producer must be one of {PRODUCERS}, got {producer!r}")
    gather = producer == "gather"
    if consumer_regs is None:
        consumer_regs = GATHER_CONSUMER_REGS if gather else CONSUMER_REGS
    if consumer_regs % 8 or not 208 <= consumer_regs <= 240:
        raise ValueError(f"consumer_regs must be a multiple of 8 in [208, 240], got {consumer_regs}")
    _check_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                 max_seqlen_k, sm_scale, out)
    page = key_cache.shape[1]
    box = min(page, BLOCK_N)
    inner = _plan_launch(q, key_cache.shape[2], cu_seqlens_q, seq_lens, block_tables, page, max_seqlen_q,
                         causal=causal, sm_scale=sm_scale, return_lse=return_lse, pingpong=pingpong,
                         pv_overlap=pv_overlap, persistent=persistent, schedule=schedule,
                         head_group=head_group, m_fastest=m_fastest, num_stages=num_stages,
                         q_buffers=q_buffers, cache_descriptors=cache_descriptors,
                         slot64=gather and key_cache.numel() >= 2**31, consumer_regs=consumer_regs,
                         producer_warps=1 if producer == "tma1" else 4, gather=gather)
    descs = {} if descriptors is None else descriptors
    kind = f"prefill{box}"

    def make(cache):
        return _descriptor(cache, box)

    def launch(q, kc, vc, out):
        return inner(q, descriptor(descs, kind, kc, make), descriptor(descs, kind, vc, make), out,
                     (kc, vc) if gather else None)

    return launch


def _check_options(num_stages: int, q_buffers: int | None, schedule: str, max_seqlen: int) -> int:
    """-> q_buffers (None: the default for max_seqlen, see flash_prefill_gluon)."""
    if num_stages not in (2, 3):
        raise ValueError(f"num_stages must be 2 or 3, got {num_stages}")
    if q_buffers is None:
        q_buffers = 2 if num_stages == 2 and max_seqlen <= 8192 else 1
    if q_buffers not in (1, 2) or q_buffers + num_stages > 4:
        raise ValueError(f"q_buffers must be 1 or 2 (1 with num_stages 3: shared memory), got {q_buffers}")
    if schedule not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(_SCHEDULES)}, got {schedule!r}")
    return q_buffers


def _launch(q, k_desc, v_desc, hkv, cu_seqlens, seq_lens, block_tables, page, max_seqlen, *,
            causal, sm_scale, return_lse, out, pingpong, pv_overlap, persistent, schedule,
            head_group, m_fastest, num_stages, q_buffers, cache_descriptors=True, caches=None,
            consumer_regs=CONSUMER_REGS, producer_warps=4):
    """The kernel over checked inputs: contiguous (block_tables None: k_desc, v_desc over
    [total, Hkv * 128]) or paged (k_desc, v_desc over the cache's [num_blocks * page, Hkv *
    128] slots, seq_lens the key counts; ``caches`` = (key_cache, value_cache): the gather
    producer, cp.async from them; producer_warps 1: the one-warp TMA producer, "tma1");
    max_seqlen: the longest query count."""
    launch = _plan_launch(q, hkv, cu_seqlens, seq_lens, block_tables, page, max_seqlen, causal=causal,
                          sm_scale=sm_scale, return_lse=return_lse, pingpong=pingpong,
                          pv_overlap=pv_overlap, persistent=persistent, schedule=schedule,
                          head_group=head_group, m_fastest=m_fastest, num_stages=num_stages,
                          q_buffers=q_buffers, cache_descriptors=cache_descriptors,
                          slot64=caches is not None and caches[0].numel() >= 2**31,
                          consumer_regs=consumer_regs, producer_warps=producer_warps,
                          gather=caches is not None)
    out = torch.empty_like(q) if out is None else out
    lse = launch(q, k_desc, v_desc, out, caches)
    return (out, lse) if return_lse else out


def _plan_launch(q, hkv, cu_seqlens, seq_lens, block_tables, page, max_seqlen, *, causal, sm_scale,
                 return_lse, pingpong, pv_overlap, persistent, schedule, head_group, m_fastest,
                 num_stages, q_buffers, cache_descriptors, slot64, consumer_regs, producer_warps, gather):
    """_launch's choices (work, grid, schedule, head group, constexprs) for q's shape ->
    launch(q, k_desc, v_desc, out, caches) -> lse or None; q's TMA descriptor made once per
    address."""
    total, hq, _ = q.shape
    batch = cu_seqlens.numel() - 1
    num_hb = hq * batch
    if head_group is not None and not 1 <= int(head_group) <= num_hb:
        raise ValueError(f"head_group must be in [1, heads x sequences = {num_hb}], got {head_group}")
    scale = (1.0 / math.sqrt(HEAD_DIM) if sm_scale is None else float(sm_scale)) * _LOG2E
    if total == 0 or batch == 0:
        return lambda q, *_: (torch.empty(hq, total, dtype=torch.float32, device=q.device)
                              if return_lse else None)
    num_m = -(-int(max_seqlen) // BLOCK_M)
    work = num_m * num_hb
    sms = _num_sms(q.device)
    if work + 4 * sms >= 2**31:
        raise ValueError(f"{work} work tiles (query tiles x heads x sequences): at most 2**31 - {4 * sms + 1}")
    if m_fastest:
        head_group = 1
    elif head_group is None:
        head_group = default_head_group(num_m, num_hb, sms)
    grid = (min(work, sms) if persistent else work,)
    sched_code = _SCHEDULES[schedule] if persistent else STATIC
    sched = _sched_buffer(q.device, sms, sched_code)
    paged = block_tables is not None
    mode = CONTIGUOUS if not paged else PAGED_GATHER if gather else PAGED_TMA
    consts = dict(CAUSAL=bool(causal), RETURN_LSE=bool(return_lse), PINGPONG=bool(pingpong),
                  PV_OVERLAP=bool(pv_overlap), SCHEDULE=sched_code, NUM_STAGES=num_stages,
                  Q_BUFS=q_buffers, CONSUMER_REGS=consumer_regs, PAGED=mode, PAGE=page if paged else 1,
                  PIECE=min(page, BLOCK_N) if paged else BLOCK_N, SLOT64=bool(slot64),
                  PRODUCER_WARPS=producer_warps)
    options = dict(num_warps=4, maxnreg=MAXNREG)
    # The last q's descriptor (a piecewise step's layers share one q buffer); only the last,
    # as each holds its q: an eager step's 32 layers' q kept alive would grow its peak memory
    # (its address: the geometry is the plan's, and the q held keeps the address its own)
    last_q: list = [None, None]
    bound: list = []  # the launch bound by the first (fast_launch.bind)

    def launch(q, k_desc, v_desc, out, caches):
        if last_q[0] is None or last_q[0].data_ptr() != q.data_ptr():
            last_q[:] = [q, _descriptor(q, WG_M)]
        q_desc = last_q[1]
        lse = torch.empty(hq, total, dtype=torch.float32, device=q.device) if return_lse else None
        k_cache, v_cache = caches if caches is not None else (q, q)
        if sched_code == DYNAMIC_MEMSET:
            sched[:2].zero_()
        args = (q_desc, k_desc, v_desc, out, lse if lse is not None else out, cu_seqlens,
                seq_lens if paged else cu_seqlens, block_tables if paged else cu_seqlens,
                block_tables.stride(0) if paged else 0, k_cache, v_cache,
                k_cache.stride(1) if caches is not None else 0, sched, scale, hq // hkv, num_m, hq, num_hb,
                int(head_group), out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0)
        with cached_tma_maps(enabled=cache_descriptors):
            if bound:
                bound[0](args)
            else:
                bound.append(_LAUNCH.bind(grid, args, consts, options, varying=(3, 4, 9, 10)))
        return lse

    return launch


_LAUNCH = FastLauncher(_flash_prefill_gluon_kernel)  # Triton's per-call dispatch skipped after a variant's first launch


def default_head_group(num_m: int, num_hb: int, num_sms: int) -> int:
    """The smallest divisor of num_hb ((head, sequence) pairs) whose chunk of work tiles
    (x num_m query tiles) fills every SM once; all pairs if none does. Small: few heads' K/V
    live in L2 at a time (2 x 4096 x 32 heads: 8 pairs, 16 MB; 1 x 16384: 2 heads, 16 MB);
    a divisor: no short last chunk whose heavy tiles start late."""
    for d in range(1, num_hb + 1):
        if num_hb % d == 0 and d * num_m >= num_sms:
            return d
    return num_hb


def _sched_buffer(device: torch.device, num_sms: int, schedule: int) -> torch.Tensor:
    """int32 [2 + 2 x #SMs], zeroed once per device: the dynamic schedules' counter, their
    stop count and each program's posted tiles (one per Q buffer). Allocated on the first
    call (make that one before a CUDA-graph capture).

    DYNAMIC has a buffer of its own: it relies on the counter being zero at launch, which
    only its own launches keep (the last program zeroes it). DYNAMIC_MEMSET leaves its
    counter at the work size (the memset before its next launch clears it), so sharing one
    buffer made the first DYNAMIC launch after a DYNAMIC_MEMSET one start from there and
    skip every tile past the programs' first (gpu_run1: the query rows below 512
    of paged options[scale], the test right after dynamic_memset, left NaN). The static
    schedules never touch theirs (the memset one's)."""
    key = (device, schedule == DYNAMIC)
    buf = _SCHED_BUFFERS.get(key)
    if buf is None:
        buf = _SCHED_BUFFERS[key] = torch.zeros(2 + 2 * num_sms, dtype=torch.int32, device=device)
    return buf


def _num_sms(device: torch.device) -> int:
    return num_sms(device)
