"""Causal / full prefill attention for sm_90 in Gluon, FlashAttention-3 style (a prototype
beside flash_prefill.py's Triton kernel; head_dim 128 only).

Contract (self-attention over a ragged batch, as ``flash_attn_varlen`` with
cu_seqlens_q == cu_seqlens_k)::

    q    [total, Hq, 128]  bf16 / fp16, contiguous
    k, v [total, Hkv, 128] q's dtype, contiguous; q head h reads kv head h // (Hq // Hkv)
    cu_seqlens int32 [B + 1]: sequence b owns rows cu[b]:cu[b+1] of q, k and v
    out  [total, Hq, 128] q's dtype;  lse [Hq, total] fp32 (natural log), optional

Causal masking is top-left = bottom-right here (as many queries as keys): query i sees keys
j <= i. Scores, the softmax and the output accumulators are fp32 (base-2 online softmax).

Work tiles are (128-query tile, q head, sequence), heaviest first: every (head, sequence)'s
last query tile, then every second to last, ... (``m_fastest``: one head's tiles adjacent,
last first). Persistent (the default): one program per SM takes tiles pid, pid + #SMs, ...;
else one program per tile. A program is 3 warpgroups (maxnreg 168: 384 x 168 registers)::

    warpgroup 0 (default partition, 24 regs)   producer: per work tile, K_j and V_j of every
                                               key tile into a STAGES-deep ring (per slot: a
                                               ready mbarrier the TMA bytes complete, an empty
                                               one both consumers arrive on), and Q (two
                                               [64, 128] boxes) right after K_0, once both
                                               consumers released the previous Q (q_empty)
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
64x128x16 a tile, one ``wait 1`` and one ``wait 0``, no serialised wgmma, no spill, but
ptxas hoists the ``wait 0`` above the softmax of an unmasked tile (0 of its 64 exp2 before
it): P_j's packed registers are P_{j-1}'s, which the in-flight P.V reads, and ptxas places
the wait before the first pack it interleaves with the exp2s. So within a warpgroup the
softmax does not overlap its own P.V; across warpgroups the ping-pong still puts one
consumer's softmax under the other's GEMMs. Tried and dropped (SASS only): P through shared
memory (the wait is hoisted all the same), a wait predicated on the row sum and the next
tile's QK^T issued before the softmax (both make ptxas serialise every wgmma, C7514).

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

_LOG2E = 1.4426950408889634
HEAD_DIM = 128
BLOCK_M = 128  # queries per program: 64 per consumer warpgroup
BLOCK_N = 128  # keys per tile
WG_M = 64
STAGES = 2  # K/V ring depth: Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB of shared memory
MAXNREG = 168  # 384 threads x 168 = 64512 registers: 24 for the producer, 240 per consumer
CONSUMER_REGS = 240

_D = gl.constexpr(HEAD_DIM)
_BM = gl.constexpr(BLOCK_M)
_BN = gl.constexpr(BLOCK_N)
_WM = gl.constexpr(WG_M)

# wgmma accumulators of one consumer warpgroup: S [64, BLOCK_N] and O [64, 128], m64nNk16.
_S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, BLOCK_N, 16]))
_O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, HEAD_DIM, 16]))
# P as the register A operand of O += P V: the S accumulator's registers, packed to 16 bits.
_P_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_O_LAYOUT, k_width=2))
# Q, K and V tiles as TMA lands them (128-byte swizzle; a 256-byte row is two 64-column boxes).
_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))


# --------------------------------------------------------------------------------- schedule


@gluon.jit
def _tile_coords(t, cu_seqlens_ptr, num_m, num_heads, num_hb, M_FASTEST: gl.constexpr):
    """Work tile t -> (q head, first query row m0, the sequence's first row, its length).
    Heaviest first: the last query tile of every (head, sequence) comes before any second to
    last one (M_FASTEST: the query tiles of one (head, sequence) are adjacent instead, last
    first). num_hb = heads x sequences."""
    if M_FASTEST:
        mt = num_m - 1 - t % num_m
        hb = t // num_m
    else:
        mt = num_m - 1 - t // num_hb
        hb = t % num_hb
    h = hb % num_heads
    b = hb // num_heads
    q_start = gl.load(cu_seqlens_ptr + b)
    seq = gl.load(cu_seqlens_ptr + b + 1) - q_start
    return h, mt * _BM, q_start, seq


@gluon.jit
def _kv_range(m0, seq, CAUSAL: gl.constexpr):
    """(n_full, n_tiles): key tiles [0, n_full) are visible whole to every query row of the
    tile at m0; tiles [n_full, n_tiles) need the mask (causal diagonal, ragged end); later
    key tiles are never loaded."""
    if CAUSAL:
        hi = gl.minimum(seq, m0 + _BM)  # keys of the tile's last row + 1
        n_full = gl.minimum(m0 + 1, seq) // _BN
    else:
        hi = seq
        n_full = seq // _BN
    return n_full, gl.cdiv(hi, _BN)


# --------------------------------------------------------------------------------- producer


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready,
             k_empty, v_empty, cu_seqlens_ptr, group, num_m, num_heads, num_hb,
             CAUSAL: gl.constexpr, M_FASTEST: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Default partition (one warpgroup; TMA issued by single threads): for each of this
    program's work tiles, K_j and V_j into ring slot ``it % NUM_STAGES`` (``it`` counts key
    tiles over all work tiles) once both consumers have released what it held, and Q (after
    K_0, once both consumers are done with the previous Q)."""
    it = 0  # key tiles loaded so far
    qi = 0  # query tiles loaded so far
    for t in range(gl.program_id(0), num_m * num_hb, gl.num_programs(0)):
        h, m0, q_start, seq = _tile_coords(t, cu_seqlens_ptr, num_m, num_heads, num_hb, M_FASTEST)
        if m0 < seq:
            n_full, n_tiles = _kv_range(m0, seq, CAUSAL)
            kv_col = (h // group) * _D
            for j in range(n_tiles):
                s = it % NUM_STAGES
                phase = ((it // NUM_STAGES) & 1) ^ 1  # a fresh barrier passes parity 1
                row = q_start + j * _BN
                mbarrier.wait(k_empty.index(s), phase)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(s), k_smem.index(s))
                if j == 0:
                    mbarrier.wait(q_empty, (qi & 1) ^ 1)
                    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(q_desc, [q_start + m0, h * _D], q_bar, q_smem.index(0))
                    tma.async_copy_global_to_shared(q_desc, [q_start + m0 + _WM, h * _D], q_bar,
                                                    q_smem.index(1))
                mbarrier.wait(v_empty.index(s), phase)
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(s), v_smem.index(s))
                it += 1
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
                NUM_STAGES: gl.constexpr):
    """Key tile 0 of a work tile (ring position it): S_0 and its softmax, no P.V yet; always
    masked (cheap, once; it is the diagonal of the first query tile and the ragged end of
    short sequences)."""
    sk = it % NUM_STAGES
    mbarrier.wait(k_ready.index(sk), (it // NUM_STAGES) & 1)
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
def _tile(j, it0, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, m, l, o, p, alpha,
          qk_scale, rows, seq, G: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
          PINGPONG: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Key tile j >= 1 (ring position it0 + j): S_j = Q K_j^T and O = alpha_{j-1} O +
    P_{j-1} V_{j-1} issued back to back, then the softmax of S_j."""
    it = it0 + j
    sk = it % NUM_STAGES
    sv = (it - 1) % NUM_STAGES
    mbarrier.wait(k_ready.index(sk), (it // NUM_STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turn.index(G), (it + 1 - G) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(sk).permute((1, 0)),
                          gl.zeros([_WM, _BN], gl.float32, _S_LAYOUT), use_acc=False, is_async=True)
    o = o * gl.expand_dims(_to_rows_o(alpha), 1)
    mbarrier.wait(v_ready.index(sv), ((it - 1) // NUM_STAGES) & 1)
    o_tok = warpgroup_mma(p, v_smem.index(sv), o, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - G))
    s = warpgroup_mma_wait(1, deps=(s_tok,))
    mbarrier.arrive(k_empty.index(sk))
    m, l, p32, alpha = _softmax(s, m, l, qk_scale, rows, j * _BN, seq, MASKED, CAUSAL)
    # P_j packed to 16 bits before the wait and kept live through it beside P_{j-1} (at the
    # LLVM level; ptxas still gives P_j P_{j-1}'s registers and hoists the wait, see SASS)
    p_new = _to_p(p32, q.dtype)
    o, p, p_new = warpgroup_mma_wait(0, deps=(o_tok, p, p_new))
    mbarrier.arrive(v_empty.index(sv))
    return m, l, o, p_new, alpha


@gluon.jit
def _attend(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, it, n_full, n_tiles,
            qk_scale, rows, seq, G: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
            NUM_STAGES: gl.constexpr):
    """One work tile's key tiles (ring positions it .. it + n_tiles - 1), the default schedule
    (module docstring): -> (m, l, O unnormalised)."""
    m = gl.full([_WM], float("-inf"), gl.float32, gl.SliceLayout(1, _S_LAYOUT))
    l = gl.zeros([_WM], gl.float32, gl.SliceLayout(1, _S_LAYOUT))
    o = gl.zeros([_WM, _D], gl.float32, _O_LAYOUT)
    m, l, p32, alpha = _first_tile(it, q, k_smem, k_ready, k_empty, turn, m, l, qk_scale,
                                   rows, seq, G, CAUSAL, PINGPONG, NUM_STAGES)
    p = _to_p(p32, q.dtype)
    for j in range(1, n_full):  # every key visible to every row
        m, l, o, p, alpha = _tile(j, it, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                  turn, m, l, o, p, alpha, qk_scale, rows, seq, G, False, CAUSAL,
                                  PINGPONG, NUM_STAGES)
    for j in range(gl.maximum(n_full, 1), n_tiles):  # the diagonal, the ragged end
        m, l, o, p, alpha = _tile(j, it, q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                                  turn, m, l, o, p, alpha, qk_scale, rows, seq, G, True, CAUSAL,
                                  PINGPONG, NUM_STAGES)
    # the last key tile's P.V
    last = it + n_tiles - 1
    sv = last % NUM_STAGES
    o = o * gl.expand_dims(_to_rows_o(alpha), 1)
    mbarrier.wait(v_ready.index(sv), (last // NUM_STAGES) & 1)
    o_tok = warpgroup_mma(p, v_smem.index(sv), o, is_async=True)
    o, p = warpgroup_mma_wait(0, deps=(o_tok, p))
    mbarrier.arrive(v_empty.index(sv))
    return m, l, o


@gluon.jit
def _consume(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty, turn,
             out_ptr, lse_ptr, cu_seqlens_ptr, qk_scale, num_m, num_heads, num_hb, stride_ot,
             stride_oh, stride_lse, G: gl.constexpr, CAUSAL: gl.constexpr,
             RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr, M_FASTEST: gl.constexpr,
             NUM_STAGES: gl.constexpr):
    """Worker partition g (one warpgroup): for each of this program's work tiles, query rows
    m0 + 64g .. m0 + 64g + 63 over its key tiles, then those output rows (and lse) stored."""
    it = 0  # key tiles consumed so far (ring position and turn parity)
    qi = 0  # query tiles consumed so far
    q = q_smem.index(G)
    for t in range(gl.program_id(0), num_m * num_hb, gl.num_programs(0)):
        h, m0, q_start, seq = _tile_coords(t, cu_seqlens_ptr, num_m, num_heads, num_hb, M_FASTEST)
        if m0 < seq:
            n_full, n_tiles = _kv_range(m0, seq, CAUSAL)
            row0 = m0 + G * _WM
            rows = row0 + gl.arange(0, _WM, layout=gl.SliceLayout(1, _S_LAYOUT))
            mbarrier.wait(q_bar, qi & 1)
            m, l, o = _attend(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, turn, it,
                              n_full, n_tiles, qk_scale, rows, seq, G, CAUSAL, PINGPONG, NUM_STAGES)
            mbarrier.arrive(q_empty)  # every S of this work tile is done: Q may be replaced
            it += n_tiles
            qi += 1

            l_safe = gl.where(l == 0.0, 1.0, l)
            o = o / gl.expand_dims(_to_rows_o(l_safe), 1)
            rows_o = row0 + gl.arange(0, _WM, layout=gl.SliceLayout(1, _O_LAYOUT))
            cols_o = gl.arange(0, _D, layout=gl.SliceLayout(0, _O_LAYOUT))
            r2 = gl.expand_dims(rows_o, 1)
            c2 = gl.expand_dims(cols_o, 0)
            ptrs = out_ptr + (q_start + r2).to(gl.int64) * stride_ot + h * stride_oh + c2
            gl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=(r2 < seq) & (c2 < _D))
            if RETURN_LSE:
                lse = gl.where(l == 0.0, float("-inf"), (m + gl.log2(l_safe)) * 0.6931471805599453)
                gl.store(lse_ptr + h.to(gl.int64) * stride_lse + q_start + rows, lse, mask=rows < seq)



# --------------------------------------------------------------------------------- kernel


@gluon.jit
def _flash_prefill_gluon_kernel(
    q_desc, k_desc, v_desc, out_ptr, lse_ptr, cu_seqlens_ptr,
    qk_scale,  # sm_scale * log2(e)
    group,  # q heads per kv head
    num_m,  # query tiles per sequence (of the longest)
    num_heads, num_hb,  # q heads; q heads x sequences
    stride_ot, stride_oh, stride_lse,
    CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PINGPONG: gl.constexpr,
    M_FASTEST: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
):
    """Work tiles t = program_id, program_id + num_programs, ... < num_m * num_hb (a grid of
    all of them: one each; a grid of #SMs: persistent)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, _WM, _D], _SMEM)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, _BN, _D], _SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, _BN, _D], _SMEM)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)  # the producer's expect; the bytes complete it
    mbarrier.init(q_empty, count=2)  # one arrive per consumer warpgroup
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready,
                    v_ready, k_empty, v_empty, cu_seqlens_ptr, group, num_m, num_heads, num_hb,
                    CAUSAL, M_FASTEST, NUM_STAGES)),
        (_consume, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                    turn, out_ptr, lse_ptr, cu_seqlens_ptr, qk_scale, num_m, num_heads, num_hb,
                    stride_ot, stride_oh, stride_lse, 0, CAUSAL, RETURN_LSE, PINGPONG, M_FASTEST,
                    NUM_STAGES)),
        (_consume, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, k_empty, v_empty,
                    turn, out_ptr, lse_ptr, cu_seqlens_ptr, qk_scale, num_m, num_heads, num_hb,
                    stride_ot, stride_oh, stride_lse, 1, CAUSAL, RETURN_LSE, PINGPONG, M_FASTEST,
                    NUM_STAGES)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# --------------------------------------------------------------------------------- launcher


def _descriptor(t: torch.Tensor, box_rows: int):
    """TMA descriptor over the [total, heads * 128] view of a token-major [total, heads, 128]
    tensor: one [box_rows, 128] box per tile of one head."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = t.view(t.shape[0], t.shape[1] * t.shape[2])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [box_rows, HEAD_DIM],
                            _SMEM.value)


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
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError("flash_prefill_gluon runs on CUDA sm_90 (Hopper) only")


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
    persistent: bool = True,
    m_fastest: bool = False,
    num_stages: int = STAGES,
):
    """Self-attention prefill over a ragged batch (see the module docstring for the layout).

    q [total, Hq, 128], k and v [total, Hkv, 128], bf16 or fp16, contiguous; cu_seqlens int32
    [B + 1]; max_seqlen >= every sequence's length (sizes the work). Returns out [total, Hq,
    128] in q's dtype, and lse [Hq, total] fp32 if return_lse. The default sm_scale is
    128 ** -0.5.

    ``pingpong``: the two consumer warpgroups take turns issuing their GEMMs (off: they issue
    freely). ``persistent``: one program per SM walks the work tiles (else one program per
    work tile). ``m_fastest``: work order: the query tiles of one head adjacent (else every
    head's last tile first). ``num_stages``: K/V ring depth (2 or 3; 3: 224 KB of shared memory).
    """
    _check(q, k, v, cu_seqlens, max_seqlen, sm_scale, out)
    if num_stages not in (2, 3):
        raise ValueError(f"num_stages must be 2 or 3, got {num_stages}")
    total, hq, _ = q.shape
    hkv = k.shape[1]
    batch = cu_seqlens.numel() - 1
    scale = (1.0 / math.sqrt(HEAD_DIM) if sm_scale is None else float(sm_scale)) * _LOG2E
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(hq, total, dtype=torch.float32, device=q.device) if return_lse else None
    if total == 0 or batch == 0:
        return (out, lse) if return_lse else out
    num_m = -(-int(max_seqlen) // BLOCK_M)
    work = num_m * hq * batch
    if work >= 2**31:
        raise ValueError(f"{work} work tiles (query tiles x heads x sequences): at most 2**31 - 1")
    grid = min(work, _num_sms(q.device)) if persistent else work
    _flash_prefill_gluon_kernel[(grid,)](
        _descriptor(q, WG_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out,
        lse if lse is not None else out, cu_seqlens, scale, hq // hkv, num_m, hq, hq * batch,
        out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0,
        CAUSAL=bool(causal), RETURN_LSE=return_lse, PINGPONG=bool(pingpong),
        M_FASTEST=bool(m_fastest), NUM_STAGES=num_stages, CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4, maxnreg=MAXNREG,
    )
    return (out, lse) if return_lse else out


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
