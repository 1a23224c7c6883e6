"""Paged decode attention: one query token per sequence, K/V read through block tables.

Cache layout (one pair per layer)::

    key_cache, value_cache : [num_blocks, block_size, num_kv_heads, head_dim]
    token p of sequence b  -> key_cache[block_tables[b, p // block_size], p % block_size]

head_dim need not be a power of two (Phi-2's 80, GPT-NeoX-20B's 96): every loop runs a
BLOCK_D = next_power_of_2(head_dim) tile with the columns past head_dim masked on each load
(zeros: they add nothing to the dots) and store, partials and merges included; the row
kernel (paged_decode_rows.py) and the Gluon kernels (head_dim 128) step aside for it.

The caches hold q's dtype or float8_e4m3fn (kv_dtype.py); on Hopper an fp8 cache at the
engine's larger batches goes to the Gluon kernel of paged_decode_gluon.py
(``DecodeConfig.gluon``; gluon_unsupported lists what it does not cover). Under a 16-bit q an fp8 cache's
dots run in fp16 (``F16_DOTS``): q is scaled by sm_scale·log2(e) in fp32 and rounded to
fp16 once, and K/V tiles are widened to fp16 after their load (exact). sm_90 widens
e4m3 pairs to fp16 in one instruction (``cvt.rn.f16x2.e4m3x2``) but to bf16 in three
(through fp16), which made a bf16 dot slower per tile than reading a bf16 cache.

Decode is memory-bound: every step streams each running sequence's whole K/V once.
So one program handles *all* the query heads that share a KV head (a GQA group,
padded to at least 16 rows for ``tl.dot``) and every K/V byte is read exactly once.

Grid ``(batch, num_kv_heads, num_splits)``, or ``(num_kv_heads, batch, num_splits)``
(``heads_fastest``: the KV heads of a sequence, which share its cache rows, launch
together). With few sequences and long contexts
the keys of one sequence are split into ``num_splits`` ranges (flash-decoding);
each program writes its partial result normalised by its own softmax sum plus its
log-sum-exp, and the splits are merged: with ``fused_merge`` by the last program of each
(sequence, KV head) to finish (a per-group counter, atomically incremented after the
partial is stored, says which one; it resets the counter to 0 for the next call), so
the merge starts as soon as that group's last split ends and no second launch waits
for the whole grid; otherwise by a second small kernel. With one split the main kernel
writes the output directly.

The counters are one int32 buffer per device, kept between calls (zero between calls):
calls on concurrent streams must not overlap (the engine runs one stream). Inside a
CUDA-graph capture the buffer is not allocated; a call that would need it there falls
back to the merge kernel.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage import envs
from flashpage.kernels.alibi import alibi_ref, check_alibi
from flashpage.kernels.device import cuda_capability, sm90_reasons
from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.kv_dtype import check_kv_cache_dtype, f16_dots, f16_query, is_fp8
from flashpage.kernels.paged_decode_rows import _paged_decode_rows_kernel
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl
from flashpage.kernels.plan import Launch, LaunchPlan
from flashpage.kernels.sinks import check_sinks, softmax_with_sinks
from flashpage.kernels.softcap import softcap_log2, softcap_ref
from flashpage.kernels.splits import split_range

_LOG2E = 1.4426950408889634

@dataclass(frozen=True)
class DecodeConfig:
    """Tile settings of the main kernel (the benchmark sweeps them)."""

    block_n: int = 64  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False  # hand-pipelined K/V loads (use with num_stages=1)
    heads_fastest: bool = False  # grid order: the KV heads of one sequence launch together
    # Splitting fills one wave of programs_per_sm * num_SMs programs, no more (a second,
    # part-empty wave costs as much as a full one): see choose_num_splits.
    programs_per_sm: int = 4
    # Split results merged by the last program of each (sequence, KV head) instead of a
    # second kernel (no effect with one split).
    fused_merge: bool = False
    # KV heads per program (paged_decode_rows.py): contiguous HPB * D pieces of each cache
    # row instead of D; 1 is the main kernel. Split results go through the merge kernel.
    heads_per_program: int = 1
    # The pipelined loop (num_stages > 1) with V loaded one tile ahead into registers and
    # widened there: an fp8 V tile then reaches the P.V dot as fp16 through ldmatrix
    # instead of byte by byte from shared memory (K stays in Triton's pipeline).
    prefetch_v: bool = False
    # A register cap for ptxas (Triton's ``maxnreg``; None: ptxas decides). The fp8 loop
    # is latency-bound at 2 programs per SM (190 registers x 128 threads); 168 lets 3 fit.
    max_regs: int | None = None
    # Each warp its own 16-key piece of every tile, with its own softmax state ([pieces, ...]
    # tensors: Triton puts the warps on the leading dim; sm_90 SASS shows 2 barriers per
    # tile, the pipeline's, instead of 8-10), merged once at the end: no cross-warp
    # reduction or exchange of P per tile. Needs block_n == 16 * num_warps and a block
    # size >= 16; no window, a chunk (Llama 4) a multiple of 16, not with prefetch.
    warp_split: bool = False
    # The Gluon kernel (paged_decode_gluon.py: TMA-fed pieces, LDS.128 operands; persistent
    # programs, each streaming its (sequence, KV head) items back to back, in engine_form's
    # variant) for the calls it covers (gluon_unsupported says which); the others run this
    # config's Triton loop. fp8 cache on sm_90 only. Over a 16-bit cache: the persistent
    # Gluon keys_m kernel of paged_decode_gluon_bf16.py (gluon_bf16_unsupported) unless
    # FLASHPAGE_DECODE_GLUON_BF16=0.
    gluon: bool = False


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_config(device: torch.device, head_dim: int, programs: int | None = None, *,
                   fp8: bool = False) -> DecodeConfig:
    """Tile defaults per GPU generation, head_dim, grid size (``programs`` = batch *
    num_kv_heads before splitting; None: a large batch) and cache dtype (``fp8``: a
    float8_e4m3fn cache).

    Hopper (capability 9.x), head_dim 128. The loop carries each tile's block ids one
    tile ahead, so ``num_stages`` s keeps s - 1 K/V tiles in flight (session 5; before
    it, Triton's pipeliner gave a load addressed by a load of the same iteration one
    buffer, and it took 5 stages to get two). bf16, from the H200 runs of 2026-11-30
    (benchmarks/results/decode.md, then ``attention_decode.py --tiles``, run 29): up to 2
    programs per SM before splitting, two tiles in flight (3 stages) and splits up to
    one wave of 2 per SM, with 8 warps where that wave is one split (between 1 and 2
    programs per SM: 32 x 4096 read 2-3% faster in runs 29 and 30); above that one tile
    in flight (2 stages) with a sequence's KV heads launched together, unsplit (deeper
    buffers there: 3-20% slower, fewer resident programs). Elsewhere (other generations,
    other head dims, the interpreter): 64 keys, 4 warps (32 keys for head_dim 256), 3
    stages, splits filling ~4 programs per SM.

    An fp8 cache on Hopper: 64-key tiles, 3 stages, splits filling 4 programs per SM (120
    registers: 4 fit). With the ids carried, 128-key tiles read it 12-17% faster than
    before (run 29; the same tiles had waited for each K tile right after its issue: 13%
    of the loop's stall samples under Nsight Compute), and V loaded a tile ahead into
    registers (``prefetch_v``) no longer paid; in run 30 64-key tiles read it 0.5-5.7%
    faster again at batch >= 8 (equal at 1 x 32768); ~60-65% of the copy rate. From 64
    programs the fp8 default is now the warp-split loop (``warp_split``: each warp its own
    16-key piece with its own softmax state, 168 registers, 3 programs per SM): in run 57
    (session 7, the version with a separate 16-key tail loop) 1.15-1.32x the loop above at
    batch 8-128 (72-84% of copy), 0.91x at 1 x 32768 (8 programs, which keeps the loop
    above). Halving the instructions alone (a keys-inner V, run 49) had bought 2-6%: what
    the old loop waited on was the chain of cross-warp reductions and P's exchange per
    tile, which the split removes. End to end (8B, fp8 cache, run 59) +1.0%; decode steps
    at batch 32-127 4.6% shorter. Where that grid is unsplit (batch * Hkv >= 3/2 waves'
    worth: batch >= 25 at 8 KV heads) the Gluon kernel (paged_decode_gluon.py) takes the
    call: 1.07-1.17x the Triton warp-split loop in run 68 (74-77% of copy at 256 x 1024 and
    128 x 2048), and its persistent form (each program's items back to back, one TMA stream)
    1.02-1.18x that in run 73 (75-88% of copy at the engine's shapes);
    FLASHPAGE_DECODE_GLUON=0 turns it off.
    """
    if device.type == "cuda" and not _interpreting():
        major, _ = cuda_capability(device)
        if major == 9 and triton.next_power_of_2(head_dim) == 128:
            if fp8:
                # From 64 programs (batch >= 8 at 8 KV heads) each warp takes its own 16-key
                # piece with its own softmax state: 1.15-1.32x at batch 8-128 in run 57
                # (attention_decode.py --warp-split); at 8 programs (1 x 32768) 0.91x.
                # A sequence's KV heads launched together (heads fastest): with the engine's
                # decodes longest first, the longest programs start first (run 61, ragged
                # 101-2048 contexts, batch 64 / 128: 1.29x / 1.10x the batch-major grid).
                if envs.decode_warp_split() and (programs is None or programs >= 64):
                    return DecodeConfig(64, 4, 3, programs_per_sm=3, warp_split=True,
                                        heads_fastest=True, fused_merge=envs.fused_merge(),
                                        gluon=envs.decode_gluon())
                return DecodeConfig(64, 4, 3, programs_per_sm=4, fused_merge=envs.fused_merge())
            # Unsplit 16-bit grids go to the persistent Gluon kernel (paged_decode_gluon_bf16.py)
            # unless FLASHPAGE_DECODE_GLUON_BF16=0 (8B bf16: 1.02x end to end, run 88).
            sms = _num_sms(device)
            if programs is not None and sms < programs <= 2 * sms:  # unsplit: 1-2 per SM
                return DecodeConfig(64, 8, 3, programs_per_sm=2, gluon=envs.decode_gluon_bf16())
            if programs is not None and programs <= sms:
                return DecodeConfig(64, 4, 3, programs_per_sm=2, fused_merge=envs.fused_merge())
            return DecodeConfig(64, 4, 2, heads_fastest=True, gluon=envs.decode_gluon_bf16())
    return DecodeConfig(32, 4, 3) if head_dim > 128 else DecodeConfig(64, 4, 3)


# What benchmarks/attention_decode.py --sweep times (head_dim 128); the GPU tests run each
# one in bf16, so whichever becomes a default has been tested.
CANDIDATE_CONFIGS = [
    DecodeConfig(64, 4, 3), DecodeConfig(32, 4, 5), DecodeConfig(64, 4, 5, programs_per_sm=2),
    DecodeConfig(64, 8, 3),
    DecodeConfig(128, 4, 3), DecodeConfig(128, 8, 3),
    DecodeConfig(32, 4, 1, prefetch=True), DecodeConfig(64, 4, 1, prefetch=True),
    DecodeConfig(64, 8, 1, prefetch=True), DecodeConfig(128, 8, 1, prefetch=True),
    DecodeConfig(64, 4, 3, heads_fastest=True), DecodeConfig(128, 4, 3, heads_fastest=True),
    DecodeConfig(64, 4, 1, prefetch=True, heads_fastest=True),
    DecodeConfig(64, 4, 5, prefetch_v=True), DecodeConfig(128, 4, 3, prefetch_v=True),
    DecodeConfig(64, 4, 2, heads_fastest=True), DecodeConfig(64, 4, 3, programs_per_sm=2),
    DecodeConfig(128, 4, 3, programs_per_sm=3, max_regs=168),
]


def config_name(cfg: DecodeConfig) -> str:
    """n{keys}w{warps}s{stages}, then p (hand prefetch), v (V prefetched), h (heads fastest),
    m (fused merge), r{n} (n KV heads per program), R{n} (register cap), W (warp split),
    G (the Gluon kernel where it covers the call)."""
    return (f"n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}{'p' if cfg.prefetch else ''}"
            f"{'v' if cfg.prefetch_v else ''}"
            f"{'h' if cfg.heads_fastest else ''}{'m' if cfg.fused_merge else ''}"
            f"{f'r{cfg.heads_per_program}' if cfg.heads_per_program > 1 else ''}"
            f"{f'R{cfg.max_regs}' if cfg.max_regs else ''}{'W' if cfg.warp_split else ''}"
            f"{'G' if cfg.gluon else ''}")


@triton.jit
def _block_ids(bt_row, offs_n, end, PAGE: tl.constexpr):
    """Physical block of each key position (0 past ``end``: never dereferenced)."""
    return tl.load(bt_row + offs_n // PAGE, mask=offs_n < end, other=0).to(tl.int64)


@triton.jit
def _load_rows(x_ptr, stride_b, stride_t, stride_h, kvh, blk, offs_n, end, offs_d, d_mask,
               PAGE: tl.constexpr):
    """Cache rows [BLOCK_N, BLOCK_D] of one KV head at key positions offs_n (0 past end)."""
    off = blk * stride_b + (offs_n % PAGE).to(tl.int64) * stride_t + kvh * stride_h
    return tl.load(x_ptr + off[:, None] + offs_d[None, :],
                   mask=(offs_n < end)[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _load_kv(k_ptr, v_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, kvh,
             blk, offs_n, end, offs_d, d_mask, PAGE: tl.constexpr):
    """K and V rows [BLOCK_N, BLOCK_D] of one KV head at key positions offs_n (0 past end)."""
    k = _load_rows(k_ptr, stride_kb, stride_kt, stride_kh, kvh, blk, offs_n, end, offs_d, d_mask, PAGE)
    v = _load_rows(v_ptr, stride_vb, stride_vt, stride_vh, kvh, blk, offs_n, end, offs_d, d_mask, PAGE)
    return k, v


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b: exact fp32 products for fp32 inputs (IEEE), else the tensor cores'."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _piece_rows(x_ptr, stride_b, stride_t, stride_h, kvh, blkp, first, offs_j, offs_d, key_ok,
                PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Cache rows [NP, 16, BLOCK_D] of one KV head: piece p's 16 keys from ``first[p]`` on,
    inside block ``blkp[p]`` (0 where ``key_ok`` is false, and in the padding columns
    HEAD_DIM..BLOCK_D of a head dim that is no power of two)."""
    rows = blkp * stride_b + (first % PAGE) * stride_t
    ptrs = (x_ptr + kvh * stride_h + rows[:, None, None] + (offs_j * stride_t)[None, :, None]
            + offs_d[None, None, :])
    if HEAD_DIM < BLOCK_D:
        return tl.load(ptrs, mask=key_ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :], other=0.0)
    else:  # whole rows: the mask by key only, so the vector loads stay whole
        return tl.load(ptrs, mask=key_ok[:, :, None], other=0.0)


@triton.jit
def _attend_tile(q, k, v, offs_n, end, m_i, l_i, acc, sm_scale_log2, softcap, slopes, qpos,
                 IEEE: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """One online-softmax step over a tile of keys at positions ``offs_n`` (those >= ``end``
    masked; base-2 exponentials). K/V tiles of an fp8 cache are widened to q's dtype first
    (a no-op for a cache in q's dtype); scores are ``q . k * sm_scale_log2``, softcapped with
    SOFTCAP (``softcap``: cap * log2(e)), plus ``slopes`` [BLOCK_H] (base 2) x (key position
    - ``qpos``) with ALIBI."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    qk = _dot(q, tl.trans(k), IEEE) * sm_scale_log2
    if SOFTCAP:
        qk = softcap_log2(qk, softcap)
    if ALIBI:
        qk = qk + slopes[:, None] * (offs_n - qpos).to(tl.float32)[None, :]
    qk = tl.where((offs_n < end)[None, :], qk, float("-inf"))
    # Every tile holds at least one valid key, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)


# Sizes that change from call to call are not specialised on (a split count of 16 or a
# table width that happens to be a multiple of 16 would otherwise compile another copy).
@triton.jit(do_not_specialize=["window", "chunk", "stride_btb", "num_splits"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    counter_ptr,  # int32 [>= B * Hkv], zero on entry (FUSED_MERGE only)
    sm_scale_log2,  # sm_scale * log2(e): the softmax runs in base 2
    window,  # keys j >= seq_len - window (ignored unless HAS_WINDOW)
    chunk,  # keys j >= (seq_len - 1) // chunk * chunk (ignored unless CHUNKED)
    softcap,  # attention logit softcap * log2(e) (ignored unless SOFTCAP)
    alibi_ptr,  # fp32 [Hq] ALiBi slopes (read only under ALIBI)
    sinks_ptr,  # fp32 [Hq] attention sinks (read only under SINKS)
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ob, stride_oh,
    num_splits,  # a runtime value: a new split count compiles nothing new
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,  # block_size of the cache
    BLOCK_N: tl.constexpr,  # keys per iteration (may span several pages or part of one)
    SPLIT: tl.constexpr,  # num_splits > 1: write partial results for the merge kernel
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact dots, not tf32
    PREFETCH: tl.constexpr,  # hand-pipelined loads (use with num_stages=1)
    PREFETCH_V: tl.constexpr,  # V one tile ahead in registers, K pipelined (not with PREFETCH)
    HEADS_FASTEST: tl.constexpr,  # grid (Hkv, B, S) instead of (B, Hkv, S)
    FUSED_MERGE: tl.constexpr,  # the last split of each (b, kvh) merges (SPLIT only)
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two (the merge's rows)
    MERGE_CHUNK: tl.constexpr,  # splits the merge loads at once
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    F16_DOTS: tl.constexpr,  # an fp8 cache under a 16-bit q: pre-scaled fp16 q, fp16 dots
    WARP_SPLIT: tl.constexpr,  # pieces of 16 keys with their own softmax state (config.warp_split)
    SOFTCAP: tl.constexpr,  # scores -> cap * tanh(scores / cap) (Gemma 2; not with WARP_SPLIT)
    ALIBI: tl.constexpr = False,  # scores + slope[h] * (j - (seq_len - 1)) (not with WARP_SPLIT)
    SINKS: tl.constexpr = False,  # sink[h] joins the softmax denominator (split 0's only)
    CHUNKED: tl.constexpr = False,  # the query's own chunk of keys alone (Llama 4)
):
    if HEADS_FASTEST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)

    # The sequence's length and its first tile's block ids are step inputs (written before
    # the step's first kernel): requested before the wait, which only q needs.
    start, end = split_range(seq_lens_ptr, b, window, chunk, num_splits, split, HAS_WINDOW, CHUNKED,
                             BLOCK_N)
    b64 = b.to(tl.int64)
    bt_row = block_tables_ptr + b64 * stride_btb
    blk0 = _block_ids(bt_row, start + tl.arange(0, BLOCK_N), end, PAGE)
    pdl_prologue(PDL)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    head = kvh * GROUP + offs_h

    q_ptrs = q_ptr + b64 * stride_qb + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    q, sm_scale_log2 = f16_query(q, sm_scale_log2, F16_DOTS)
    slopes = tl.zeros([BLOCK_H], dtype=tl.float32)
    qpos = 0
    if ALIBI:  # the query sits at the context's last position
        slopes = tl.load(alibi_ptr + head, mask=h_mask, other=0.0) * 1.4426950408889634
        qpos = tl.load(seq_lens_ptr + b) - 1

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    kv_args = (k_ptr, v_ptr, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, kvh)
    if PREFETCH:
        # Software pipeline in registers: while tile i is computed, tile i+1's K/V and
        # tile i+2's block ids are in flight, so no load waits on another load.
        offs0 = start + tl.arange(0, BLOCK_N)
        blk_next = _block_ids(bt_row, offs0 + BLOCK_N, end, PAGE)
        k, v = _load_kv(*kv_args, blk0, offs0, end, offs_d, d_mask, PAGE)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            blk_after = _block_ids(bt_row, offs_n + 2 * BLOCK_N, end, PAGE)
            k_next, v_next = _load_kv(*kv_args, blk_next, offs_n + BLOCK_N, end, offs_d, d_mask, PAGE)
            m_i, l_i, acc = _attend_tile(q, k, v, offs_n, end, m_i, l_i, acc, sm_scale_log2, softcap,
                                          slopes, qpos, IEEE, SOFTCAP, ALIBI)
            k, v, blk_next = k_next, v_next, blk_after
    elif PREFETCH_V:
        # K through Triton's pipeline; V one tile ahead in registers, widened on arrival.
        # The block ids are carried one tile ahead too (they address this tile's K and the
        # next tile's V): a K load whose address came from a load in the same iteration
        # gets a single shared-memory buffer from Triton's pipeliner, i.e. it is waited
        # for in the iteration after its issue (Nsight Compute, H200: 13% of the stall
        # samples at that wait).
        offs0 = start + tl.arange(0, BLOCK_N)
        blk = blk0
        v_next = _load_rows(v_ptr, stride_vb, stride_vt, stride_vh, kvh, blk, offs0, end, offs_d,
                            d_mask, PAGE).to(q.dtype)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            offs_x = offs_n + BLOCK_N
            blk_x = _block_ids(bt_row, offs_x, end, PAGE)
            k = _load_rows(k_ptr, stride_kb, stride_kt, stride_kh, kvh, blk, offs_n, end, offs_d,
                           d_mask, PAGE)
            v = v_next
            v_next = _load_rows(v_ptr, stride_vb, stride_vt, stride_vh, kvh, blk_x, offs_x, end, offs_d,
                                d_mask, PAGE).to(q.dtype)
            blk = blk_x
            m_i, l_i, acc = _attend_tile(q, k, v, offs_n, end, m_i, l_i, acc, sm_scale_log2, softcap,
                                          slopes, qpos, IEEE, SOFTCAP, ALIBI)
    elif WARP_SPLIT:
        # Tile = NP pieces of 16 keys (each inside one page); [NP, ...] state per piece.
        # Loads are masked by key (rows are contiguous along D, so the vector loads stay
        # whole; a padded head dim also masks its columns past HEAD_DIM): slots past the
        # context read as 0, their scores as -inf.
        NP: tl.constexpr = BLOCK_N // 16
        offs_j = tl.arange(0, 16)
        q3 = tl.broadcast_to(q[None, :, :], [NP, BLOCK_H, BLOCK_D])
        m3 = tl.full([NP, BLOCK_H], float("-inf"), dtype=tl.float32)
        l3 = tl.zeros([NP, BLOCK_H], dtype=tl.float32)
        acc3 = tl.zeros([NP, BLOCK_H, BLOCK_D], dtype=tl.float32)
        pos = start + tl.arange(0, NP) * 16
        blkp = tl.load(bt_row + pos // PAGE, mask=pos < end, other=0).to(tl.int64)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + BLOCK_N + tl.arange(0, NP) * 16
            blkp_x = tl.load(bt_row + pos // PAGE, mask=pos < end, other=0).to(tl.int64)
            first = n0 + tl.arange(0, NP) * 16  # each piece's first key
            key_ok = (first[:, None] + offs_j[None, :]) < end  # [NP, 16]
            k3 = _piece_rows(k_ptr, stride_kb, stride_kt, stride_kh, kvh, blkp, first, offs_j, offs_d,
                             key_ok, PAGE, HEAD_DIM, BLOCK_D).to(q.dtype)
            v3 = _piece_rows(v_ptr, stride_vb, stride_vt, stride_vh, kvh, blkp, first, offs_j, offs_d,
                             key_ok, PAGE, HEAD_DIM, BLOCK_D).to(q.dtype)
            blkp = blkp_x
            s3 = _dot(q3, tl.trans(k3, 0, 2, 1), IEEE)
            s3 = tl.where(key_ok[:, None, :], s3 * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m3, tl.max(s3, 2))
            # a piece that has seen no key yet stays at -inf: exponents against 0 give 0
            m_exp = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m3 - m_exp)
            p3 = tl.exp2(s3 - m_exp[:, :, None])
            l3 = l3 * alpha + tl.sum(p3, 2)
            acc3 = acc3 * alpha[:, :, None] + _dot(p3.to(v3.dtype), v3, IEEE)
            m3 = m_new
        # The pieces merged (a piece that saw no key has m = -inf: weight 0).
        m_i = tl.max(m3, 0)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        w3 = tl.exp2(m3 - m_safe[None, :])
        l_i = tl.sum(l3 * w3, 0)
        acc = tl.sum(acc3 * w3[:, :, None], 0)
        m_i = tl.where(l_i > 0.0, m_safe, float("-inf"))
    else:
        # Triton's pipeliner overlaps the loads. The block ids are carried one tile ahead,
        # so that the K/V loads' addresses do not come from a load of the same iteration
        # (which leaves them one buffer: waited for one iteration after their issue).
        blk = blk0
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            blk_x = _block_ids(bt_row, offs_n + BLOCK_N, end, PAGE)
            k, v = _load_kv(*kv_args, blk, offs_n, end, offs_d, d_mask, PAGE)
            blk = blk_x
            m_i, l_i, acc = _attend_tile(q, k, v, offs_n, end, m_i, l_i, acc, sm_scale_log2, softcap,
                                          slopes, qpos, IEEE, SOFTCAP, ALIBI)

    if SINKS:
        # One more "key" of score sink[h] and value 0, folded in once: by split 0 alone, so
        # that the merge (which weighs each split by its lse) counts it once. Its lse then
        # holds the sink even where the split saw no key.
        sink = tl.load(sinks_ptr + head, mask=h_mask, other=float("-inf")) * 1.4426950408889634
        sink = tl.where(split == 0, sink, float("-inf"))
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.exp2(sink - m_safe)
        acc = acc * alpha[:, None]
        m_i = m_new
    has_keys = l_i > 0.0  # false for an empty split (or an empty sequence)
    o = tl.where(has_keys[:, None], acc / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    if not SPLIT:
        out_ptrs = out_ptr + b64 * stride_ob + head[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        # mid_o [B, Hq, num_splits, HEAD_DIM] fp32; mid_lse [B, Hq, num_splits] fp32 (base 2)
        row = (b64 * (num_kv_heads * GROUP) + head.to(tl.int64)) * num_splits + split
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=h_mask[:, None] & d_mask[None, :])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=h_mask)
        if FUSED_MERGE:
            # Every thread's partial is stored before the (one-thread) release below.
            tl.debug_barrier()
            count_ptr = counter_ptr + b * num_kv_heads + kvh
            done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:  # the last split of this group: merge them all
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call
                _merge_group(mid_o_ptr, mid_lse_ptr, out_ptr, b64, kvh * GROUP, num_kv_heads * GROUP,
                             stride_ob, stride_oh, num_splits, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D,
                             MERGE_CHUNK)


@triton.jit
def _merge_group(mid_o_ptr, mid_lse_ptr, out_ptr, b64, head0, num_q_heads, stride_ob, stride_oh,
                 num_splits, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """out[b, head0 : head0 + GROUP] from the num_splits partials of those heads.

    Weights exp2(lse_s - max lse), normalised by their sum, in one pass over chunks of
    MERGE_CHUNK splits (a running max rescales what came before, so each chunk costs one
    round trip to L2); an empty split has lse -inf (weight 0). Loads bypass L1 (.cg):
    the partials were written by other programs, published by the counter's
    release/acquire.
    """
    offs_g = tl.arange(0, GROUP_PAD)
    g_mask = offs_g < GROUP
    rows = (b64 * num_q_heads + head0 + offs_g) * num_splits  # first split of each head
    offs_c = tl.arange(0, MERGE_CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    for s0 in tl.range(0, num_splits, MERGE_CHUNK, num_stages=1):
        sm = g_mask[:, None] & (s0 + offs_c < num_splits)[None, :]
        r = rows[:, None] + s0 + offs_c[None, :]  # [GROUP_PAD, MERGE_CHUNK]
        lse = tl.load(mid_lse_ptr + r, mask=sm, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(mid_o_ptr + r[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=sm[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0
        scale = tl.exp2(m - m_safe)  # exp2(-inf) = 0 on the first chunk
        w = tl.exp2(lse - m_safe[:, None])
        acc = acc * scale[:, None] + tl.sum(o * w[:, :, None], 1)
        total = total * scale + tl.sum(w, 1)
        m = m_new
    res = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    head = (head0 + offs_g).to(tl.int64)
    tl.store(out_ptr + b64 * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
             res.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    num_q_heads, stride_ob, stride_oh, num_splits,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)  # b * Hq + h
    b = row // num_q_heads
    h = row % num_q_heads
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(mid_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights all 0
    w = tl.exp2(lse - m)
    o = tl.load(mid_o_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty),
             mask=d_mask)


_SM_COUNT: dict[int, int] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def _split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The device's zeroed int32 counters (>= n), kept between calls; None where one would
    have to be allocated inside a CUDA-graph capture (the caller then uses the merge kernel)."""
    key = torch.device(device.type, device.index if device.index is not None or device.type != "cuda"
                       else torch.cuda.current_device())
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:  # a captured graph may still point at it: never freed
            _RETIRED_COUNTERS.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=key)
        _COUNTERS[key] = buf
    return buf


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the CPU interpreter: small, so that small tests exercise splitting
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int, *,
                      programs_per_sm: int = 4, min_keys: int = 64, max_splits: int = 128) -> int:
    """Splits along the keys for grids too small to fill the GPU.

    As many splits as fit in one wave of ``programs_per_sm * num_sms`` programs (the
    config's, see DecodeConfig), each split keeping >= ``min_keys`` keys, at most
    ``max_splits`` (the merge kernel loads every split of a head at once). On an H200 the
    sweep's best split count sat at one full wave for every grid size it timed
    (benchmarks/results/decode.md); just past a wave the time jumps. ``max_context`` is an
    upper bound (the block table's width times the block size): no device-to-host sync.
    """
    want = programs_per_sm * num_sms // (batch * num_kv_heads)
    return max(1, min(want, max_context // min_keys, max_splits))


def _check(q, key_cache, value_cache, block_tables, seq_lens, window_size, out, softcap=None,
           alibi_slopes=None, sinks=None, chunk_size=None):
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    check_kv_cache_dtype(q.dtype, key_cache, value_cache)
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = key_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, the cache {cache_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    if window_size is not None and window_size < 1:
        raise ValueError(f"window_size must be >= 1 or None, got {window_size}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or int(chunk_size) != chunk_size
                                   or int(chunk_size) < 1):
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    check_alibi(alibi_slopes, num_q_heads, q.device)
    check_sinks(sinks, num_q_heads, q.device)
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last dimension")


def _launch(q, key_cache, value_cache, block_tables, seq_lens, *, sm_scale, window_size, out,
            num_splits, config: DecodeConfig | None = None, pdl: bool | None = None,
            softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None, chunk_size: int | None = None):
    """paged_decode with an explicit tile config (the benchmark sweeps them)."""
    launch = _plan(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale,
                   window_size=window_size, out=out, num_splits=num_splits, config=config, pdl=pdl,
                   softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, chunk_size=chunk_size)
    out = torch.empty_like(q) if out is None else out
    if q.shape[0]:
        launch(q, key_cache, value_cache, out)
    return out


def _plan(q, key_cache, value_cache, block_tables, seq_lens, *, sm_scale, window_size, out,
          num_splits, config: DecodeConfig | None = None, pdl: bool | None = None,
          descriptors: dict | None = None, softcap: float | None = None,
          alibi_slopes: torch.Tensor | None = None,
          sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> Launch:
    """The checks and every choice of a call (kernel, config, splits, grid, scratch), made
    once -> launch(q, key_cache, value_cache, out) for tensors of this geometry (DecodePlan
    holds callers to it). The tables and lengths are the planned ones; ``descriptors``: a
    dict kept across plans for the Gluon kernel's cache descriptors (None: the plan's own).
    With ``sinks``, launch takes a layer's own as a fifth argument (default: these)."""
    _check(q, key_cache, value_cache, block_tables, seq_lens, window_size, out, softcap, alibi_slopes,
           sinks, chunk_size)
    alibi = alibi_slopes is not None
    chunk = int(chunk_size or 0)
    has_sinks = sinks is not None
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if batch == 0:
        return lambda *_: None
    cfg = config or default_config(q.device, head_dim, batch * num_kv_heads,
                                   fp8=is_fp8(key_cache.dtype))
    hpb = cfg.heads_per_program
    if hpb > 1 and (softcap is not None or alibi or has_sinks or chunk or num_kv_heads % hpb or head_dim & (head_dim - 1) or head_dim < 16
                    or key_cache.stride(2) != head_dim or value_cache.stride(2) != head_dim):
        hpb = 1  # the row kernel's conditions (paged_decode_rows.py; no softcap, ALiBi, sinks or chunks) do not hold
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        if window_size is not None:
            max_context = min(max_context, window_size)
        if chunk:  # the query sees its own chunk's keys alone
            max_context = min(max_context, chunk)
        num_splits = choose_num_splits(batch, num_kv_heads // hpb, max_context, _num_sms(q.device),
                                       programs_per_sm=cfg.programs_per_sm)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if cfg.gluon and not gluon_unsupported(q, key_cache, value_cache, window_size, num_splits,
                                           softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                           chunk_size=chunk_size):
        from flashpage.kernels.paged_decode_gluon import engine_form, paged_decode_gluon

        form = engine_form(group, envs.decode_gluon_variant())
        return lambda q, kc, vc, out: paged_decode_gluon(q, kc, vc, block_tables, seq_lens,
                                                         sm_scale=sm_scale, out=out, **form)
    if cfg.gluon and not gluon_bf16_unsupported(q, key_cache, value_cache, window_size, num_splits,
                                                softcap=softcap, alibi_slopes=alibi_slopes,
                                                sinks=sinks, chunk_size=chunk_size):
        from flashpage.kernels import paged_decode_gluon_bf16 as g16

        form16 = g16.engine_form(batch * num_kv_heads, _num_sms(q.device))
        return g16.plan(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale,
                        out=out, descriptors=descriptors, **form16)
    # FLASHPAGE_PDL=auto leaves the unsplit kernel without PDL: on the H200 it timed 0.91x
    # at 32 x 4096 with it (split kernels and their merge: 1.04x at 1 x 32768)
    use_pdl = resolve_pdl(pdl, q.device, in_auto=num_splits > 1)
    launch_kw = pdl_launch_kwargs(use_pdl)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(group))
    split = num_splits > 1
    if split:  # scratch shared by every launch of the plan (one stream: each merge reads it first)
        mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    common = dict(SPLIT=split, HAS_WINDOW=window_size is not None, IEEE=q.dtype == torch.float32,
                  PDL=use_pdl, F16_DOTS=f16_dots(q.dtype, key_cache.dtype))
    scale2, window = sm_scale * _LOG2E, window_size or 0
    if hpb > 1:
        rows = dict(GROUP=group, HPB=hpb, ROWS_PAD=max(16, triton.next_power_of_2(hpb * group)),
                    HEAD_DIM=head_dim, WIDTH=hpb * head_dim, PAGE=block_size, BLOCK_N=cfg.block_n,
                    **common, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kw)

        def launch_rows(q, kc, vc, out):
            _paged_decode_rows_kernel[(batch, num_kv_heads // hpb, num_splits)](
                q, kc, vc, block_tables, seq_lens, out, mid_o if split else out,
                mid_lse if split else out, scale2, window, q.stride(0), q.stride(1),
                kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
                block_tables.stride(0), out.stride(0), out.stride(1), num_splits, **rows)
            if split:
                _merge(mid_o, mid_lse, out, num_splits, block_d, use_pdl)

        return launch_rows
    # (a chunk start, the range's lower bound, must keep the 16-key pieces inside one page)
    warp_split = (cfg.warp_split and window_size is None and softcap is None and not alibi
                  and chunk % 16 == 0 and block_size >= 16
                  and not cfg.prefetch and not cfg.prefetch_v and cfg.block_n == 16 * cfg.num_warps)
    counters = _split_counters(q.device, batch * num_kv_heads) if split and cfg.fused_merge else None
    fused_merge = counters is not None
    group_pad = triton.next_power_of_2(group)
    # The merge loads [GROUP_PAD, MERGE_CHUNK, BLOCK_D] fp32 at once: <= 8K values.
    merge_chunk = max(1, min(triton.next_power_of_2(num_splits), 8192 // (group_pad * block_d)))
    grid = (num_kv_heads, batch, num_splits) if cfg.heads_fastest else (batch, num_kv_heads, num_splits)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kw,
                   **({"maxnreg": cfg.max_regs} if cfg.max_regs and not _interpreting() else {}))
    consts = dict(
        GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=block_size,
        BLOCK_N=cfg.block_n, SPLIT=split, HAS_WINDOW=window_size is not None,
        IEEE=q.dtype == torch.float32, PREFETCH=cfg.prefetch,
        PREFETCH_V=cfg.prefetch_v and not cfg.prefetch, HEADS_FASTEST=cfg.heads_fastest,
        FUSED_MERGE=fused_merge, GROUP_PAD=group_pad, MERGE_CHUNK=merge_chunk if fused_merge else 1,
        PDL=use_pdl, F16_DOTS=common["F16_DOTS"], WARP_SPLIT=warp_split, SOFTCAP=softcap is not None,
        ALIBI=alibi, SINKS=has_sinks, CHUNKED=chunk > 0)
    softcap2 = (softcap or 1.0) * _LOG2E

    merge = split and not fused_merge
    bound: list = []  # the kernel (and merge) launches bound by the first layer (fast_launch.bind)

    def launch(q, kc, vc, out, layer_sinks=sinks):
        args = (q, kc, vc, block_tables, seq_lens, out, mid_o if split else out,
                mid_lse if split else out, counters if fused_merge else seq_lens, scale2, window,
                chunk or 1, softcap2, alibi_slopes if alibi else seq_lens,
                layer_sinks if has_sinks else seq_lens, q.stride(0), q.stride(1),
                kc.stride(0), kc.stride(1), kc.stride(2),
                vc.stride(0), vc.stride(1), vc.stride(2), block_tables.stride(0),
                out.stride(0), out.stride(1), num_splits)
        margs = (mid_o, mid_lse, out, num_q_heads, out.stride(0), out.stride(1), num_splits) if merge else ()
        if bound:
            bound[0](args)
            if merge:
                bound[1](margs)
            return
        # (the sinks, each layer's own, vary too)
        bound.append(_DECODE_LAUNCH.bind(grid, args, consts, options,
                                         varying=(0, 1, 2, 5, 6, 7) + ((14,) if has_sinks else ())))
        if merge:
            bound.append(_MERGE_LAUNCH.bind((batch * num_q_heads,), margs, *_merge_form(
                num_splits, head_dim, block_d, use_pdl), varying=(2,)))

    return launch


class DecodePlan(LaunchPlan):
    """paged_decode planned for the layers of a step (kernels/plan.py): the checks and every
    choice (kernel, config, splits, grid, scratch) for one block table and one set of lengths;
    ``run(q, key_cache, value_cache, out)`` as paged_decode over them. ``descriptors``: a dict
    the caller keeps across plans (one per engine), where the Gluon kernel's cache
    descriptors are made once."""

    name = "DecodePlan"

    def __init__(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, *, sm_scale: float | None = None,
                 window_size: int | None = None, out: torch.Tensor | None = None,
                 num_splits: int | None = None, pdl: bool | None = None,
                 descriptors: dict | None = None, softcap: float | None = None,
                 alibi_slopes: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> None:
        launch = _plan(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale,
                       window_size=window_size, out=out, num_splits=num_splits, pdl=pdl,
                       descriptors=descriptors, softcap=softcap, alibi_slopes=alibi_slopes,
                       sinks=sinks, chunk_size=chunk_size)
        super().__init__(launch, q, key_cache, value_cache, out)


def gluon_unsupported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      window_size: int | None, num_splits: int,
                      capability: tuple[int, int] | None = None, *,
                      softcap: float | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None,
                      chunk_size: int | None = None) -> list[str]:
    """Why the Gluon fp8 kernel (paged_decode_gluon.py) cannot take this call; empty if it can.
    ``capability``: the device's compute capability (None: read from q's device)."""
    reasons = sm90_reasons(q, capability)
    if key_cache.dtype != torch.float8_e4m3fn or value_cache.dtype != torch.float8_e4m3fn:
        reasons.append(f"needs a float8_e4m3fn cache, got {key_cache.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"needs a bf16/fp16 query, got {q.dtype}")
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if block_size != 16 or head_dim != 128:
        reasons.append(f"needs block_size 16 and head_dim 128, got {block_size} and {head_dim}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        reasons.append("needs contiguous caches")
    if q.shape[1] // num_kv_heads > 16:
        reasons.append(f"covers up to 16 query heads per KV head, got {q.shape[1] // num_kv_heads}")
    if window_size is not None:
        reasons.append("has no sliding window")
    if softcap is not None:
        reasons.append("has no logit softcap")
    if alibi_slopes is not None:
        reasons.append("has no ALiBi biases")
    if sinks is not None:
        reasons.append("has no attention sinks (the Triton kernel takes them)")
    if chunk_size is not None:
        reasons.append("has no chunked local attention (the Triton kernel takes it)")
    if num_splits != 1:
        reasons.append(f"does not split the keys ({num_splits} splits asked)")
    return reasons


def gluon_bf16_unsupported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           window_size: int | None, num_splits: int,
                           capability: tuple[int, int] | None = None, *,
                           softcap: float | None = None,
                           alibi_slopes: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None,
                           chunk_size: int | None = None) -> list[str]:
    """Why the Gluon 16-bit kernel (paged_decode_gluon_bf16.py: persistent keys_m) cannot take
    this call; empty if it can. ``capability``: the device's compute capability (None: read
    from q's device; a CPU tensor or the interpreter has none)."""
    reasons = sm90_reasons(q, capability)
    if q.dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"needs a bf16/fp16 query, got {q.dtype}")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        reasons.append(f"needs a cache in q's dtype {q.dtype}, got {key_cache.dtype} / {value_cache.dtype}")
    if q.dim() != 3 or key_cache.dim() != 4:
        reasons.append("needs q [B, Hq, D] and caches [num_blocks, block_size, Hkv, D]")
        return reasons
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if block_size != 16 or head_dim != 128 or q.shape[2] != 128:
        reasons.append(f"needs block_size 16 and head_dim 128, got {block_size} and {head_dim}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        reasons.append("needs contiguous caches")
    if q.stride(-1) != 1:
        reasons.append("needs q contiguous in its last dimension")
    if num_kv_heads == 0 or q.shape[1] % num_kv_heads or not 1 <= q.shape[1] // num_kv_heads <= 8:
        reasons.append(f"covers 1-8 query heads per KV head (the group is padded to 8), "
                       f"got {q.shape[1]} over {num_kv_heads}")
    if window_size is not None:
        reasons.append("has no sliding window")
    if softcap is not None:
        reasons.append("has no logit softcap")
    if alibi_slopes is not None:
        reasons.append("has no ALiBi biases")
    if sinks is not None:
        reasons.append("has no attention sinks (the Triton kernel takes them)")
    if chunk_size is not None:
        reasons.append("has no chunked local attention (the Triton kernel takes it)")
    if num_splits != 1:
        reasons.append(f"does not split the keys ({num_splits} splits asked)")
    return reasons


def _merge_form(num_splits: int, head_dim: int, block_d: int, pdl: bool) -> tuple[dict, dict]:
    """The merge kernel's constexprs and launch options."""
    return (dict(SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d, PDL=pdl),
            dict(num_warps=4, **pdl_launch_kwargs(pdl)))


def _merge(mid_o, mid_lse, out, num_splits: int, block_d: int, pdl: bool = False) -> None:
    """The merge kernel over mid_o [B, Hq, num_splits, D] and mid_lse [B, Hq, num_splits];
    pdl: launch it with PDL (already resolved: True only where supported)."""
    batch, num_q_heads, _, head_dim = mid_o.shape
    _MERGE_LAUNCH((batch * num_q_heads,),
                  (mid_o, mid_lse, out, num_q_heads, out.stride(0), out.stride(1), num_splits),
                  *_merge_form(num_splits, head_dim, block_d, pdl))


# Launched past Triton's per-call dispatch after a variant's first launch (kernels/fast_launch.py):
# a mixed step launches both in every layer, eagerly (host ~55 us a launch through the JIT, run 127)
_DECODE_LAUNCH = FastLauncher(_paged_decode_kernel)
_MERGE_LAUNCH = FastLauncher(_merge_splits_kernel)


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    window_size: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    pdl: bool | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    q            [B, Hq, D]  the query of sequence b sits at position seq_lens[b] - 1
    key_cache    [num_blocks, block_size, Hkv, D]   (value_cache the same), in q's dtype
                 or float8_e4m3fn (a 16-bit q: dots in fp16, see the module doc)
    block_tables int32 [B, max_blocks]; entries past seq_lens are never read
    seq_lens     int32 [B]   context length, the query's own token included
    window_size  W: only keys j > (seq_lens[b] - 1) - W are attended
    softcap      c: scores (after sm_scale) become c * tanh(scores / c) before the softmax
                 (Gemma 2's attn_logit_softcapping; the Gluon and row kernels step aside)
    alibi_slopes fp32 [Hq]: head h's score of key j gains alibi_slopes[h] * (j - (seq_lens[b]
                 - 1)) after sm_scale and softcap (ALiBi, kernels/alibi.py; the Gluon, row and
                 warp-split kernels step aside)
    sinks        fp32 [Hq]: head h's softmax denominator gains exp(sinks[h]), a logit with no
                 value (GPT-OSS, kernels/sinks.py; counted once across splits; the Gluon and
                 row kernels step aside)
    chunk_size   C: only keys j >= ((seq_lens[b] - 1) // C) * C, the query's own chunk (Llama
                 4's chunked local attention; the Gluon and row kernels step aside)
    num_splits   key-range splits per sequence; None picks from the batch size and
                 the block table's width (no device sync)
    pdl          programmatic dependent launch of its kernels (kernels/pdl.py): True all,
                 False none; None decides from the device and FLASHPAGE_PDL (default
                 "auto": split kernels and their merge, not the unsplit kernel)
    returns out  [B, Hq, D] in q's dtype (written into ``out`` when given)
    """
    return _launch(q, key_cache, value_cache, block_tables, seq_lens, sm_scale=sm_scale,
                   window_size=window_size, out=out, num_splits=num_splits, pdl=pdl, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, chunk_size=chunk_size)


def paged_decode_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    window_size: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    pdl: bool | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Pure-torch paged_decode, in fp32 (an fp8 cache's values read exactly), one sequence at
    a time. num_splits and pdl are ignored."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    res = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        seq_len = int(seq_lens[b])
        lo = 0 if window_size is None else max(0, seq_len - window_size)
        if chunk_size is not None:  # the query's own chunk
            lo = max(lo, (seq_len - 1) // chunk_size * chunk_size)
        if seq_len <= lo:
            continue  # no key: a zero output, with or without sinks
        blocks = block_tables[b, : triton.cdiv(seq_len, block_size)].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[lo:seq_len].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[lo:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale
        scores = softcap_ref(scores, softcap)
        scores = alibi_ref(scores, alibi_slopes, seq_len - 1, torch.arange(lo, seq_len, device=q.device))
        res[b] = torch.einsum("hl,lhd->hd", softmax_with_sinks(scores, sinks), v)
    res = res.to(q.dtype)
    if out is not None:
        out.copy_(res)
        return out
    return res
