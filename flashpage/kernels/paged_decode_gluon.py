"""Paged decode over an fp8 KV cache, in Gluon for sm_90 (a prototype of paged_decode.py's
warp-split loop, ``DecodeConfig(64, 4, 3, warp_split=True, heads_fastest=True)``).

Same contract as ``paged_decode`` for the engine's fp8 decode: q [B, Hq, 128] bf16/fp16,
key_cache / value_cache [num_blocks, 16, Hkv, 128] float8_e4m3fn, one program per (KV head,
sequence), KV heads fastest, no key splits, dots in fp16 (q scaled by sm_scale·log2(e) in
fp32 and rounded to fp16 once; e4m3 widened to fp16 exactly), fp32 accumulation, base-2
online softmax.

What Gluon lets this kernel do that Triton's pipeliner did not::

    global (fp8 page pieces)                                   registers
    key_cache[blk, 0:16, kvh, :] --TMA box [16,128]--> K stage rows 16p..16p+15 --LDS.128--> K^T operand
    value_cache[blk, ...]        --TMA box [16,128]--> V stage rows 16p..16p+15 --LDS.128--> V operand

- Each 64-key tile is 4 pieces of 16 keys (one page each); each piece's K and V rows land by
  TMA (one [16, 128] box each, 128-byte swizzle) in one ``STAGES``-deep buffer, all 8 boxes
  of a tile counted by one mbarrier. No register round trip, no LDGSTS address math.
- Warp p owns piece p of every tile with its own softmax state (as ``WARP_SPLIT``), merged
  once at the end. Per tile: one mbarrier wait and one CTA barrier (before warp 0 refills
  the stage every warp has just finished reading) -- as written. Triton 3.6's membar
  analysis adds 9 more: it sees each TMA issue as a write to the stage buffer and to the
  mbarrier, so it puts a bar.sync between consecutive issues (sm_90 SASS: 10 BAR.SYNC per
  tile). A 1-warp producer partition (``gl.warp_specialize``) would confine those to one
  warp; not done here (a 5th warp's registers cost a program per SM at 157 registers).
- The stage is read back through *views* of the same bytes (``SharedLinearLayout``) whose
  logical head-dim order is a permutation of the physical one, chosen so that each thread's
  mma fragment is 16 contiguous bytes of one cache row: K and V both reach the mma_v2
  operand layouts through 128-bit shared loads instead of byte loads, and are widened
  there (``cvt.rn.f16x2.e4m3x2``). The dots do not care about the order along the head dim
  as long as q uses the same one (for K; q is loaded with it), and the output's columns
  are stored through V's permutation.

The last tile of each sequence is masked (keys past seq_len: scores -inf, V rows zeroed: an
unowned slot may hold NaN, and 0 · NaN is NaN in the P·V dot); its pieces past the context
re-read the last valid page (an L2 hit) instead of leaving a stage part-filled.
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
BLOCK_N = 16 * NUM_WARPS
STAGES = 3  # tiles in the buffer: STAGES - 1 in flight while one is computed

# Kernel-side copies of the constants above.
_D = gl.constexpr(HEAD_DIM)
_PG = gl.constexpr(PAGE)
_W = gl.constexpr(NUM_WARPS)
_BN = gl.constexpr(BLOCK_N)
_S = gl.constexpr(STAGES)

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
def _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, tile, b0, b1, b2, b3, col, pred):
    """TMA of a tile's 4 K and 4 V pieces into stage tile % STAGES, on its mbarrier."""
    stage = tile % _S
    bar = bars.index(stage)
    mbarrier.expect(bar, 2 * _BN * _D, pred=pred)
    ks = k_smem.index(stage)
    vs = v_smem.index(stage)
    _issue_piece(k_desc, v_desc, ks, vs, bar, 0, b0, col, pred)
    _issue_piece(k_desc, v_desc, ks, vs, bar, _PG, b1, col, pred)
    _issue_piece(k_desc, v_desc, ks, vs, bar, 2 * _PG, b2, col, pred)
    _issue_piece(k_desc, v_desc, ks, vs, bar, 3 * _PG, b3, col, pred)


@gluon.jit
def _attend(q, k_smem, v_smem, stage, m3, l3, acc, n0, seq_len, MASKED: gl.constexpr):
    """One 64-key tile from stage ``stage``: warp p's online-softmax step over keys
    n0 + 16p .. n0 + 16p + 15 (MASKED: keys >= seq_len dropped, their V rows zeroed)."""
    k_view = k_smem.index(stage)._reinterpret(
        gl.float8e4nv, [_W, _D, _PG], _K_VIEW)
    v_view = v_smem.index(stage)._reinterpret(
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


@gluon.jit
def _paged_decode_gluon_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, out_ptr,
    sm_scale_log2,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    GROUP: gl.constexpr,  # query heads per KV head (<= 16)
):
    kvh = gl.program_id(0)  # KV heads fastest
    b = gl.program_id(1)
    seq_len = gl.load(seq_lens_ptr + b)
    b64 = b.to(gl.int64)
    bt_row = block_tables_ptr + b64 * stride_btb
    num_tiles = gl.cdiv(seq_len, _BN)
    last_page = gl.maximum(seq_len - 1, 0) // _PG
    col = kvh * _D

    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [_S, _BN, _D], _TMA_SMEM)
    v_smem = gl.allocate_shared_memory(gl.float8e4nv, [_S, _BN, _D], _TMA_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [_S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_S):
        mbarrier.init(bars.index(i), count=1)
    gl.thread_barrier()

    # The first STAGES - 1 tiles in flight; the next tile's pages loaded one iteration ahead
    # of their TMA (no warp waits on a block-table load before an issue).
    for t in gl.static_range(_S - 1):
        b0, b1, b2, b3 = _tile_blocks(bt_row, t, last_page)
        _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, t, b0, b1, b2, b3, col, t < num_tiles)
    b0, b1, b2, b3 = _tile_blocks(bt_row, _S - 1, last_page)

    # q in the A operand layout (every warp a copy; rows >= GROUP zero), its columns in K's
    # order, scaled and rounded to fp16 once.
    offs_r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A)))
    offs_k = gl.arange(0, _D, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A)))
    offs_w = gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, _A)))
    r3 = gl.expand_dims(gl.expand_dims(offs_r, 0), 2) + gl.expand_dims(gl.expand_dims(offs_w * 0, 1), 2)
    k3 = gl.expand_dims(gl.expand_dims(_k_column(offs_k), 0), 1)
    head0 = kvh * GROUP
    q_ptrs = q_ptr + b64 * stride_qb + (head0 + r3).to(gl.int64) * stride_qh + k3
    q = gl.load(q_ptrs, mask=(r3 < GROUP) & (k3 < _D), other=0.0)
    q = (q.to(gl.float32) * sm_scale_log2).to(gl.float16)

    m3 = gl.full([_W, 16], float("-inf"), gl.float32, gl.SliceLayout(2, _MMA))
    l3 = gl.zeros([_W, 16], gl.float32, gl.SliceLayout(2, _MMA))
    acc = gl.zeros([_W, 16, _D], gl.float32, _MMA)

    for i in range(num_tiles - 1):  # every tile but the last: 64 valid keys
        gl.thread_barrier()  # every warp is done reading tile i - 1's stage
        fence_async_shared()  # ... before the async proxy overwrites it
        t_next = i + _S - 1
        _issue_tile(k_desc, v_desc, k_smem, v_smem, bars, t_next, b0, b1, b2, b3, col, t_next < num_tiles)
        b0, b1, b2, b3 = _tile_blocks(bt_row, t_next + 1, last_page)
        stage = i % _S
        mbarrier.wait(bars.index(stage), (i // _S) & 1)
        m3, l3, acc = _attend(q, k_smem, v_smem, stage, m3, l3, acc, i * _BN, seq_len, False)
    if num_tiles > 0:
        last = num_tiles - 1
        stage = last % _S
        mbarrier.wait(bars.index(stage), (last // _S) & 1)
        m3, l3, acc = _attend(q, k_smem, v_smem, stage, m3, l3, acc, last * _BN, seq_len, True)
    for i in gl.static_range(_S):
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
    offs_or = gl.arange(0, 16, layout=gl.SliceLayout(1, o_layout))
    offs_on = gl.arange(0, _D, layout=gl.SliceLayout(0, o_layout))
    rows = gl.expand_dims(offs_or, 1)
    cols = gl.expand_dims(_v_column(offs_on), 0)
    out_ptrs = out_ptr + b64 * stride_ob + (head0 + rows).to(gl.int64) * stride_oh + cols
    gl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=(rows < GROUP) & (cols < _D))


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
) -> torch.Tensor:
    """paged_decode (kernels/paged_decode.py) over an fp8 cache, the Gluon prototype.

    q            [B, Hq, 128] bf16 or fp16
    key_cache    [num_blocks, 16, Hkv, 128] float8_e4m3fn, contiguous (value_cache the same)
    block_tables int32 [B, max_blocks]; entries past seq_lens are never read
    seq_lens     int32 [B]   context length, the query's own token included
    returns out  [B, Hq, 128] in q's dtype (written into ``out`` when given)

    No sliding window, no key splits: one program per (KV head, sequence).
    """
    return _launch(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale, out=out)


def _launch(q, key_cache, value_cache, block_tables, seq_lens, *, sm_scale=None, out=None,
            max_regs: int | None = None):
    """paged_decode_gluon with a register cap for ptxas (``max_regs``: 128 lets 4 programs
    share an SM, at a few spilled registers; None: ptxas decides, 157: 3 per SM)."""
    _check(q, key_cache, value_cache, block_tables, seq_lens, out)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    _paged_decode_gluon_kernel[(num_kv_heads, batch)](
        q, _cache_descriptor(key_cache), _cache_descriptor(value_cache), block_tables, seq_lens, out,
        sm_scale * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, num_warps=NUM_WARPS,
        **({"maxnreg": max_regs} if max_regs else {}),
    )
    return out
