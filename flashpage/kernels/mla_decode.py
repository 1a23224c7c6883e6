"""MLA decode attention over the paged latent cache (DeepSeek-V2/V3, absorbed form).

Cache layout (one tensor per layer)::

    kv_cache : [num_blocks, block_size, kv_lora_rank + rope_dim]
               entry = [ c_kv (kv_lora_rank) | k_pe (rope_dim) ]
    token p of sequence b -> kv_cache[block_tables[b, p // block_size], p % block_size]

With W_UK absorbed into the query and W_UV applied after attention, every head
attends over the same single latent entry (MQA with head dim 576, value dim 512)::

    score[h, j] = sm_scale * (q[b, h, :] . entry_j)              (all R + rope dims)
    out[b, h]   = sum_j softmax_j(score[h, :]) * entry_j[:R]       (first R dims)

Decode streams each sequence's latents once per step, so the kernel is built to read
every latent byte once: one program takes a block of BLOCK_H heads (16, 32 or 64), loads
a tile of BLOCK_N entries and uses it twice, as K^T for ``Q K^T`` and as V for ``P V``
(both ``tl.dot``). Grid ``(head_blocks, batch, num_splits)``: head blocks vary fastest,
so the programs that share a sequence's latents run together and the second one reads
them from L2. With few sequences and long contexts the keys are split into
``num_splits`` ranges (flash-decoding); each split writes its normalised partial output
and log-sum-exp, and they are merged either by a second kernel or, with few splits
(``MLADecodeConfig.fuse_merge_max_splits``), inside the main kernel: each split counts
itself in (an atomic counter per sequence and head block) and the last one to arrive
merges, then sets the counter back to 0, so a captured CUDA graph replays from a clean
state. One split writes ``out`` directly.

The value dims can be handled as ``qk_chunks`` column chunks (tuples of tiles): q's, each
latent tile's and the P V accumulators. Q K^T is then one dot per chunk, each from its own
accumulator, so the warp interleaves independent mma chains instead of waiting on one
chain over all 576 dims (``_qk``); and each thread computes the addresses of fewer latent
rows, since a narrower tile spreads its rows over more threads.

The cache holds q's dtype or float8_e4m3fn (``--kv-cache-dtype fp8``, kv_dtype.py): fp8
latent tiles are widened right after their load (exact: every e4m3 value is an fp16
value), to fp16 under a 16-bit q, whose two parts are then pre-scaled and rounded to fp16
once (``f16_query``: one widening instruction per pair of values on sm_90, three to
bf16), so both dots and the softmax run as over a 16-bit cache while the loop reads half
the bytes. The partials and the merge stay fp32 either way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.kv_dtype import check_latent_cache_dtype, f16_dots, f16_query, is_fp8
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl
from flashpage.kernels.plan import Launch, LaunchPlan
from flashpage.kernels.splits import split_range

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLADecodeConfig:
    """Tile shape of the main kernel, and how many of its programs fit on one SM."""

    block_h: int = 16  # heads per program (power of two >= 16)
    block_n: int = 32  # latent entries per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    # Resident programs per SM (shared memory and registers, from ptxas): the split
    # heuristic fills one wave of programs_per_sm * num_SMs programs.
    programs_per_sm: int = 1
    # Merge the splits inside the main kernel (the last split of a head block to finish
    # merges) when there are at most this many; more go through the merge kernel. The
    # last program reads the other splits' partials one after another, so this pays off
    # only for few splits; 0 keeps the two-kernel path (the one timed in mla.md).
    fuse_merge_max_splits: int = 0
    # The latent tile loaded one iteration ahead into registers and widened there, instead
    # of through Triton's shared-memory pipeline: an fp8 tile then reaches the P.V dot
    # (which reduces over entries, not contiguous in the cache) as fp16 through ldmatrix,
    # not gathered byte by byte. Use with num_stages=1.
    prefetch: bool = False
    # The value dims (kv_lora_rank) as this many column chunks (a power of two; chunks
    # stay >= 16 wide, so a small rank gets fewer): Q K^T becomes one dot per chunk, each
    # with its own accumulator, instead of one chain of dependent mma steps over all 576
    # dims, and P V one accumulator per chunk (_qk says why).
    qk_chunks: int = 1

    def __post_init__(self) -> None:
        if self.qk_chunks < 1 or self.qk_chunks & (self.qk_chunks - 1):
            raise ValueError(f"qk_chunks must be a power of two >= 1, got {self.qk_chunks}")


def default_config(num_heads: int, device: torch.device | None = None, *,
                   fp8: bool = False) -> MLADecodeConfig:
    """Tile defaults for a head count, by GPU generation (512 + 64), and cache dtype
    (``fp8``: a float8_e4m3fn latent cache).

    Hopper (and the interpreter, which only checks correctness): the H200 sweep in
    benchmarks/mla_decode.py (benchmarks/results/mla.md has the figures). Other GPUs:
    smaller tiles of the same shape, which fit their shared memory (~100-164 KB).
    An fp8 cache at 16 heads loads each tile a step ahead into registers and widens it
    there (``prefetch``): 1.26-1.36x the pipelined default over fp8 in the H200 run of
    2026-11-30 (run 23, ``mla_decode.py --kv-dtype fp8``); over bf16 it was slower.
    """
    hopper = True
    if device is not None and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        hopper = torch.cuda.get_device_capability(device)[0] == 9
    if num_heads <= 16 and fp8:
        return MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=1,
                               programs_per_sm=2 if hopper else 1, prefetch=True)
    if num_heads <= 16:
        # 93 KB shared memory: two programs per SM. The value dims in 8 chunks of 64, so
        # Q K^T runs as 9 independent mma chains instead of one of 36 (sm_90 SASS: 457
        # instructions per 32-entry iteration instead of 907, 135 registers instead of
        # 242). H200 run 31 (mla_decode.py --chunks-ab): 3-7% faster than unchunked at
        # every shape (4 chunks: 3-5%), 82% / 83% / 71% of copy at 8 x 32768,
        # 16 x 16384, 32 x 4096 and 92% at 64 x 8192 and 128 x 4096.
        return MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3,
                               # in-kernel merge off: in the H200 run of 2026-11-30 the
                               # merge kernel won at every split count (2-33)
                               programs_per_sm=2 if hopper else 1, fuse_merge_max_splits=0,
                               qk_chunks=8 if hopper else 1)
    if num_heads <= 32 or not hopper:
        return MLADecodeConfig(block_h=32 if num_heads <= 32 else 64, block_n=32, num_warps=8,
                               num_stages=3 if num_heads <= 32 else 2)
    # 221 KB shared memory (the q tile and two 64-entry latent buffers): one program per
    # SM. ptxas spills 76 bytes, yet it ran 5-14% faster than 64 x 32 with three buffers.
    return MLADecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)


# The chunked Q K^T (MLADecodeConfig.qk_chunks) at 16 heads, timed against the unchunked
# form by benchmarks/mla_decode.py --chunks-ab (bf16 tiles, then fp8's prefetch tiles).
# Left out: fp8's prefetch tile with 2 chunks (ptxas spills inside the loop).
QK_CHUNK_CONFIGS = [
    MLADecodeConfig(16, 32, 4, 3, 2, qk_chunks=2), MLADecodeConfig(16, 32, 4, 3, 2, qk_chunks=4),
    MLADecodeConfig(16, 32, 4, 3, 2, qk_chunks=8), MLADecodeConfig(16, 32, 4, 2, 2, qk_chunks=4),
    MLADecodeConfig(16, 32, 4, 2, 3, qk_chunks=8),
    MLADecodeConfig(16, 32, 4, 1, 2, prefetch=True, qk_chunks=4),
    MLADecodeConfig(16, 32, 8, 1, 1, prefetch=True, qk_chunks=4),
]

# What benchmarks/mla_decode.py --sweep times on Hopper (16 heads: block_h 16; 128 heads:
# block_h 64); programs_per_sm estimated from shared memory (228 KB per SM) and registers.
# The GPU tests run each one, so whichever becomes a default has been tested.
CANDIDATE_CONFIGS = [
    MLADecodeConfig(16, 32, 4, 3, 2), MLADecodeConfig(16, 32, 4, 2, 2), MLADecodeConfig(16, 32, 4, 4, 1),
    MLADecodeConfig(16, 64, 4, 2, 2), MLADecodeConfig(16, 64, 8, 2, 2), MLADecodeConfig(16, 64, 8, 3, 1),
    MLADecodeConfig(16, 16, 4, 5, 2),
    MLADecodeConfig(64, 64, 8, 2, 1), MLADecodeConfig(64, 32, 8, 3, 1),
    MLADecodeConfig(16, 32, 4, 1, 2, prefetch=True), MLADecodeConfig(16, 32, 8, 1, 1, prefetch=True),
    MLADecodeConfig(16, 16, 4, 1, 2, prefetch=True), MLADecodeConfig(16, 64, 8, 1, 1, prefetch=True),
    # value dims in chunks (qk_chunks); registers per thread from ptxas (sm_90, bf16):
    # 16x32w4s3 182 / 168 / 135 at 2 / 4 / 8 chunks (242 unchunked); s2 with 8 chunks:
    # 135 registers and 56 KB of shared memory, so three programs per SM
    *QK_CHUNK_CONFIGS,
]


def config_name(cfg: MLADecodeConfig) -> str:
    name = f"{cfg.block_h}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}p{cfg.programs_per_sm}"
    return (name + (f"f{cfg.fuse_merge_max_splits}" if cfg.fuse_merge_max_splits else "")
            + ("r" if cfg.prefetch else "") + (f"c{cfg.qk_chunks}" if cfg.qk_chunks > 1 else ""))


@triton.jit
def _load_latent(kv_ptr, blk, pos, end, stride_kvb, stride_kvt, offs_c, offs_p, p_mask,
                 RANK: tl.constexpr, PAGE: tl.constexpr, NC: tl.constexpr, CH: tl.constexpr,
                 DTYPE: tl.constexpr):
    """The latent entries at positions ``pos`` (0 at and past ``end``), widened to DTYPE (a
    no-op unless the cache is fp8): the value part as NC column chunks, a tuple of
    [BLOCK_N, CH] (chunk c holds dims c*CH .. c*CH + CH - 1), and the rope part
    [BLOCK_N, BLOCK_P]."""
    n_mask = pos < end
    row = kv_ptr + blk * stride_kvb + (pos % PAGE).to(tl.int64) * stride_kvt
    kvs = ()
    for c in tl.static_range(NC):
        col = c * CH + offs_c
        kv = tl.load(row[:, None] + col[None, :], mask=n_mask[:, None] & (col < RANK)[None, :],
                     other=0.0)
        kvs = kvs + (kv.to(DTYPE),)  # type: ignore[assignment]
    pe = tl.load(row[:, None] + RANK + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :],
                 other=0.0)
    return kvs, pe.to(DTYPE)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """a @ b (+ acc): exact fp32 products for fp32 inputs (IEEE), else the tensor cores'."""
    if IEEE:
        out = tl.dot(a, b, acc=acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc=acc)
    return out


@triton.jit
def _qk(qs, q_pe, kvs, pe, n_mask, IEEE: tl.constexpr, NC: tl.constexpr):
    """q . entry for every (head, entry) pair, unscaled, -inf for entries past the end
    (``n_mask`` false): [BLOCK_H, BLOCK_N] fp32.

    One value chunk (NC == 1): one dot over the value dims, the rope dot accumulating onto
    it. With 16 heads and 4 warps over 32 entries each warp owns one 16 x 8 output tile,
    so that is one chain of 36 mma.sync steps, each waiting for the last one's result
    (on the H200, ``wait`` was the loop's main stall). NC chunks: NC + 1 dots (the rope
    dot one of them), each its own chain the warp can interleave, summed at the end. Each
    starts from the mask bias (0, or -inf past the end), not from zero: Triton folds
    ``x + dot(a, b, 0)`` into ``dot(a, b, x)``, which would chain them again.
    """
    if NC == 1:
        qk = _dot(qs[0], tl.trans(kvs[0]), None, IEEE)
        qk = _dot(q_pe, tl.trans(pe), qk, IEEE)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    else:
        bias = tl.where(n_mask, 0.0, float("-inf"))
        bias = tl.broadcast_to(bias[None, :], (q_pe.shape[0], pe.shape[0]))
        qk = _dot(q_pe, tl.trans(pe), bias, IEEE)
        for c in tl.static_range(NC):
            qk += _dot(qs[c], tl.trans(kvs[c]), bias, IEEE)
    return qk


# Sizes that vary from step to step are not specialised on, so one compiled kernel
# serves every batch (a block-table width that happens to be a multiple of 16 would
# otherwise compile a second copy).
@triton.jit(do_not_specialize=["num_heads", "num_splits", "stride_btb"])
def _mla_decode_kernel(
    q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    counter_ptr,  # int32 [B * head_blocks], all 0 on entry and on exit (FUSED only)
    sm_scale_log2,  # sm_scale * log2(e): the softmax runs in base 2
    num_heads, num_splits,
    stride_qb, stride_qh,
    stride_kvb, stride_kvt,
    stride_btb,
    stride_ob, stride_oh,
    RANK: tl.constexpr,  # kv_lora_rank: value dims, the first RANK of each entry
    ROPE: tl.constexpr,  # rope dims after them
    BLOCK_R: tl.constexpr,  # RANK padded to a power of two
    BLOCK_P: tl.constexpr,  # ROPE padded to a power of two >= 16
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,  # block_size of the cache
    SPLIT: tl.constexpr,  # write partial results (num_splits > 1) instead of out
    FUSED: tl.constexpr,  # SPLIT, and the last split of a head block merges them into out
    IEEE: tl.constexpr,  # fp32 inputs: exact dots, not tf32
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    F16_DOTS: tl.constexpr,  # an fp8 cache under a 16-bit q: pre-scaled fp16 q, fp16 dots
    PREFETCH: tl.constexpr,  # latent tiles one iteration ahead in registers (config.prefetch)
    QK_CHUNKS: tl.constexpr,  # value dims in this many column chunks (config.qk_chunks)
):
    pdl_prologue(PDL)
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    NC: tl.constexpr = QK_CHUNKS
    CH: tl.constexpr = BLOCK_R // QK_CHUNKS

    start, end = split_range(seq_lens_ptr, b, 0, 1, num_splits, split, False, False, BLOCK_N)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, CH)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask = offs_h < num_heads
    p_mask = offs_p < ROPE
    b64 = b.to(tl.int64)

    # The value dims are handled as NC column chunks throughout (tuples of NC tensors):
    # q's and each latent tile's, and the P.V accumulators; see _qk for why.
    q_row = q_ptr + b64 * stride_qb + offs_h[:, None].to(tl.int64) * stride_qh
    q_pe = tl.load(q_row + RANK + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :],
                   other=0.0)
    q_pe, qk_scale = f16_query(q_pe, sm_scale_log2, F16_DOTS)
    qs = ()
    accs = ()
    for c in tl.static_range(NC):
        col = c * CH + offs_c
        q_c = tl.load(q_row + col[None, :], mask=h_mask[:, None] & (col < RANK)[None, :],
                      other=0.0)
        q_c, _ = f16_query(q_c, sm_scale_log2, F16_DOTS)
        qs = qs + (q_c,)  # type: ignore[assignment]
        accs = accs + (tl.zeros([BLOCK_H, CH], dtype=tl.float32),)  # type: ignore[assignment]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    bt_row = block_tables_ptr + b64 * stride_btb

    # The block ids of the next tile are loaded one iteration ahead, by hand: when the
    # latent load's address comes from a load in the same iteration, Triton's pipeliner
    # gives it a single shared-memory buffer (no overlap of loads); carried across
    # iterations it gets num_stages - 1 buffers.
    offs_n = tl.arange(0, BLOCK_N)
    blk_next = tl.load(bt_row + (start + offs_n) // PAGE, mask=start + offs_n < end, other=0)
    if PREFETCH:  # the first tile now; each iteration loads the next one
        kvs_next, pe_next = _load_latent(kv_ptr, blk_next.to(tl.int64), start + offs_n, end,
                                         stride_kvb, stride_kvt, offs_c, offs_p, p_mask, RANK,
                                         PAGE, NC, CH, q_pe.dtype)
        blk_next = tl.load(bt_row + (start + BLOCK_N + offs_n) // PAGE,
                           mask=start + BLOCK_N + offs_n < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        if PREFETCH:
            kvs, pe = kvs_next, pe_next
            nxt = pos + BLOCK_N
            kvs_next, pe_next = _load_latent(kv_ptr, blk_next.to(tl.int64), nxt, end,
                                             stride_kvb, stride_kvt, offs_c, offs_p, p_mask,
                                             RANK, PAGE, NC, CH, q_pe.dtype)
            after = nxt + BLOCK_N
            blk_next = tl.load(bt_row + after // PAGE, mask=after < end, other=0)
        else:
            blk = blk_next.to(tl.int64)
            nxt = pos + BLOCK_N
            blk_next = tl.load(bt_row + nxt // PAGE, mask=nxt < end, other=0)
            # an fp8 cache: widened before any arithmetic (else a no-op)
            kvs, pe = _load_latent(kv_ptr, blk, pos, end, stride_kvb, stride_kvt, offs_c,
                                   offs_p, p_mask, RANK, PAGE, NC, CH, q_pe.dtype)
        qk = _qk(qs, q_pe, kvs, pe, n_mask, IEEE, NC) * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q_pe.dtype)
        new = ()
        for c in tl.static_range(NC):
            new = new + (_dot(p, kvs[c], accs[c] * alpha[:, None], IEEE),)  # type: ignore[assignment]
        accs = new
        m_i = m_new

    # An empty range (a split past the end of a short sequence) leaves l_i == 0.
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    os_ = ()
    for c in tl.static_range(NC):
        os_ = os_ + (accs[c] / safe_l[:, None],)  # type: ignore[assignment]
    if SPLIT:
        # mid_o [B, H, S, BLOCK_R] fp32, mid_lse [B, H, S] fp32 (base 2), contiguous
        mid = (b64 * num_heads + offs_h.to(tl.int64)) * num_splits + split
        for c in tl.static_range(NC):
            col = c * CH + offs_c
            tl.store(mid_o_ptr + mid[:, None] * BLOCK_R + col[None, :], os_[c],
                     mask=h_mask[:, None] & (col < RANK)[None, :])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(mid_lse_ptr + mid, lse, mask=h_mask)
        if FUSED:
            _merge_if_last(mid_o_ptr, mid_lse_ptr, counter_ptr, out_ptr, os_, lse, mid - split,
                           b64 * tl.num_programs(0) + hb, split, num_splits,
                           b64 * stride_ob + offs_h.to(tl.int64) * stride_oh, h_mask, offs_c,
                           RANK, BLOCK_R, NC, CH)
    else:
        o_row = out_ptr + b64 * stride_ob + offs_h[:, None].to(tl.int64) * stride_oh
        for c in tl.static_range(NC):
            col = c * CH + offs_c
            tl.store(o_row + col[None, :], os_[c].to(out_ptr.dtype.element_ty),
                     mask=h_mask[:, None] & (col < RANK)[None, :])


@triton.jit
def _merge_if_last(mid_o_ptr, mid_lse_ptr, counter_ptr, out_ptr, os_, lse, mid0, group, split,
                   num_splits, out_row, h_mask, offs_c, RANK: tl.constexpr,
                   BLOCK_R: tl.constexpr, NC: tl.constexpr, CH: tl.constexpr):
    """Count this split in; the last of the group's ``num_splits`` merges every split's
    partial (its own from registers, ``os_``: NC chunks [BLOCK_H, CH]; the others' from
    mid_o / mid_lse at rows ``mid0 + s``) into out, and resets the group's counter for
    the next call."""
    # Every thread's partial stores are issued before thread 0's release (the atomic is
    # done once per program); the acquire side reads L2 (.cg): L1 is not coherent.
    tl.debug_barrier()
    count = tl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
    if count == num_splits - 1:
        tl.atomic_xchg(counter_ptr + group, 0, sem="relaxed", scope="gpu")
        # Online merge, as in the main loop: m the running max of the lse (base 2), den
        # and accs the sums of 2^(lse_s - m) and 2^(lse_s - m) * o_s.
        m = lse
        den = tl.where(lse > float("-inf"), 1.0, 0.0)
        accs = os_
        for s in range(0, num_splits):
            other = h_mask & (s != split)
            lse_s = tl.load(mid_lse_ptr + mid0 + s, mask=other, other=float("-inf"),
                            cache_modifier=".cg")
            m_new = tl.maximum(m, lse_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far
            alpha = tl.exp2(m - m_safe)
            beta = tl.exp2(lse_s - m_safe)
            new = ()
            for c in tl.static_range(NC):
                col = c * CH + offs_c
                o_s = tl.load(mid_o_ptr + (mid0 + s)[:, None] * BLOCK_R + col[None, :],
                              mask=other[:, None] & (col < RANK)[None, :], other=0.0,
                              cache_modifier=".cg")
                new = new + (accs[c] * alpha[:, None] + o_s * beta[:, None],)  # type: ignore[assignment]
            accs = new
            den = den * alpha + beta
            m = m_new
        den = tl.where(den > 0.0, den, 1.0)  # every split empty: output zeros
        for c in tl.static_range(NC):
            col = c * CH + offs_c
            tl.store(out_ptr + out_row[:, None] + col[None, :],
                     (accs[c] / den[:, None]).to(out_ptr.dtype.element_ty),
                     mask=h_mask[:, None] & (col < RANK)[None, :])


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _mla_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    num_heads, num_splits,
    stride_ob, stride_oh,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,  # row stride of mid_o
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    CHUNK_R: tl.constexpr,  # value dims per program
    PDL: tl.constexpr,
):
    """One program per (sequence, head, chunk of value dims):
    out = sum_s w_s o_s / sum_s w_s, w_s = 2^(lse_s - max). All splits are loaded at once
    (a [BLOCK_S, CHUNK_R] tile): a loop over the splits waits on one load after another."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b.to(tl.int64) * num_heads + h
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    lse = tl.load(mid_lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: output zeros
    w = tl.exp2(lse - m)
    den = tl.sum(w, 0)
    den = tl.where(den > 0.0, den, 1.0)
    offs_r = tl.program_id(2) * CHUNK_R + tl.arange(0, CHUNK_R)
    r_mask = offs_r < RANK
    o = tl.load(mid_o_ptr + (row * num_splits + offs_s)[:, None] * BLOCK_R + offs_r[None, :],
                mask=s_mask[:, None] & r_mask[None, :], other=0.0)
    acc = tl.sum(o * w[:, None], 0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_r
    tl.store(o_ptrs, (acc / den).to(out_ptr.dtype.element_ty), mask=r_mask)


_SM_COUNT: dict[int, int] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """n int32 zeros that stay zero between calls (each fused call resets what it used).

    One buffer per device, reused by every call and layer: calls on one stream run one
    after another, so they never share a counter at the same time. Allocated outside a
    CUDA-graph capture; one needed first inside a capture is allocated (and zeroed) by the
    graph itself, every replay, and not kept.
    """
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    zeros = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return zeros
    _COUNTERS[device] = zeros
    return zeros


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: keep split grids small
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def pick_num_splits(batch: int, head_blocks: int, max_context: int, device: torch.device,
                    *, programs_per_sm: int = 1) -> int:
    """Splits along the keys so that the grid fills one wave of resident programs.

    One full wave, not more: with B * head_blocks * splits just over the resident
    slots, a second, nearly empty wave costs as much as the first (on an H200,
    128 x 4096 at 16 heads: 2 splits 3.65 TB/s, 3 splits 2.80). Splits keep >= 256 keys
    (>= 64 when even that leaves the grid under half the SMs: one short sequence).
    ``max_context`` is an upper bound known on the host (``max_blocks * block_size``):
    reading ``seq_lens`` would cost a device sync and break CUDA-graph capture.
    """
    sms = _num_sms(device)
    programs = batch * head_blocks
    by_fill = max(1, programs_per_sm * sms // programs)
    by_len = triton.cdiv(max_context, 256)
    if programs * by_len < sms // 2:
        by_len = triton.cdiv(max_context, 64)
    return max(1, min(by_fill, by_len, 128))


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """MLA decode over the paged latent cache.

    q            : [B, H, kv_lora_rank + rope_dim]  absorbed query (q_nope @ W_UK, then q_pe)
    kv_cache     : [num_blocks, block_size, kv_lora_rank + rope_dim]  (last dim contiguous),
                   in q's dtype or float8_e4m3fn (read as q's dtype)
    block_tables : int32 [B, max_blocks]; entries past ``seq_lens[b]`` are never read
    seq_lens     : int32 [B], >= 1; the query sits at position ``seq_lens[b] - 1``
    pdl          : programmatic dependent launch of its kernels (kernels/pdl.py); None
                   decides from the device and FLASHPAGE_PDL
    returns out  : [B, H, kv_lora_rank] in q's dtype
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got {tuple(q.shape)}")
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    launch = _plan(q, kv_cache, block_tables, seq_lens, kv_lora_rank=kv_lora_rank, sm_scale=sm_scale,
                   out=out, num_splits=num_splits, config=config, pdl=pdl)
    launch(q, kv_cache, kv_cache, out)
    return out


def _plan(q, kv_cache, block_tables, seq_lens, *, kv_lora_rank, sm_scale, out, num_splits=None,
          config: MLADecodeConfig | None = None, pdl: bool | None = None) -> Launch:
    """mla_decode's checks and choices (config, splits, scratch, grid) once -> launch(q,
    kv_cache, kv_cache, out) for tensors of this geometry over these tables and lengths (the
    second cache argument, a LaunchPlan's value cache, is the same latent cache and unused)."""
    if q.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(f"q must be [B, H, D] and kv_cache [num_blocks, block_size, D], got "
                         f"{tuple(q.shape)} and {tuple(kv_cache.shape)}")
    B, H, D = q.shape
    _, page, dk = kv_cache.shape
    rope = D - kv_lora_rank
    if dk != D or rope <= 0:
        raise ValueError(f"q's last dim ({D}) and kv_cache's ({dk}) must both be "
                         f"kv_lora_rank ({kv_lora_rank}) + rope_dim (> 0)")
    check_latent_cache_dtype(q.dtype, kv_cache)
    if page & (page - 1):
        raise ValueError(f"block_size must be a power of two, got {page}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(f"block_tables must be [B={B}, max_blocks] and seq_lens [B], got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need a contiguous last dim")
    if out is None or out.shape != (B, H, kv_lora_rank) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{B}, {H}, {kv_lora_rank}] with a contiguous last dim")
    if B == 0:
        return lambda *_: None

    cfg = config or default_config(H, q.device, fp8=is_fp8(kv_cache.dtype))
    block_r = triton.next_power_of_2(kv_lora_rank)
    block_p = max(16, triton.next_power_of_2(rope))
    qk_chunks = min(cfg.qk_chunks, max(1, block_r // 16))  # chunks >= 16 wide (tl.dot's k)
    head_blocks = triton.cdiv(H, cfg.block_h)
    if num_splits is None:
        num_splits = pick_num_splits(B, head_blocks, block_tables.shape[1] * page, q.device,
                                     programs_per_sm=cfg.programs_per_sm)
    num_splits = max(1, int(num_splits))
    split = num_splits > 1
    fused = split and num_splits <= cfg.fuse_merge_max_splits
    if split:  # scratch shared by every launch of the plan (one stream: each reads it first)
        mid_o = torch.empty(B, H, num_splits, block_r, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q.device)
    counters = _merge_counters(q.device, B * head_blocks) if fused else seq_lens  # else unused
    use_pdl = resolve_pdl(pdl, q.device, in_auto=False)  # timed 0.97-0.99x with PDL (H200)
    grid = (head_blocks, B, num_splits)
    consts = dict(RANK=kv_lora_rank, ROPE=rope, BLOCK_R=block_r, BLOCK_P=block_p,
                  BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, PAGE=page, SPLIT=split, FUSED=fused,
                  IEEE=q.dtype == torch.float32, PDL=use_pdl,
                  F16_DOTS=f16_dots(q.dtype, kv_cache.dtype), PREFETCH=cfg.prefetch,
                  QK_CHUNKS=qk_chunks)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(use_pdl))
    scale2 = sm_scale * _LOG2E
    merge = merge_launcher(mid_o, mid_lse, kv_lora_rank, use_pdl) if split and not fused else None
    bound: list = []  # the kernel (and merge) launches bound by the first call (fast_launch.bind)

    def launch(q, kc, _vc, out):
        args = (q, kc, block_tables, seq_lens, out, mid_o if split else out,
                mid_lse if split else out, counters, scale2, H, num_splits,
                q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), block_tables.stride(0),
                out.stride(0), out.stride(1))
        if bound:
            bound[0](args)
        else:
            bound.append(_DECODE_LAUNCH.bind(grid, args, consts, options, varying=(0, 1, 4)))
        if merge is not None:
            merge(out)

    return launch


class MLADecodePlan(LaunchPlan):
    """An MLA decode call planned for the layers of a step (kernels/plan.py): kernel
    (``kernel``: "wgmma", "gluon" or "" for this file's Triton kernel), splits, scratch and
    grid chosen once over one block table and set of lengths; ``run(q, kv_cache, kv_cache,
    out)`` as the chosen kernel's function over them. ``descriptors``: a dict the caller
    keeps across plans (one per engine), where the wgmma kernel's cache descriptors are made
    once; ``num_splits`` and ``config``: the Triton kernel's knobs (tests, benchmarks)."""

    name = "MLADecodePlan"

    def __init__(self, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, *, kv_lora_rank: int, sm_scale: float, out: torch.Tensor,
                 kernel: str = "", descriptors: dict | None = None, num_splits: int | None = None,
                 config: MLADecodeConfig | None = None) -> None:
        launch: Launch
        if kernel == "wgmma":
            from flashpage.kernels.mla_decode_wgmma import plan as wgmma_plan

            launch = wgmma_plan(q, kv_cache, block_tables, seq_lens, kv_lora_rank=kv_lora_rank,
                                sm_scale=sm_scale, out=out, descriptors=descriptors)
        elif kernel == "gluon":  # not planned inside: its function on every launch
            from flashpage.kernels.mla_decode_gluon import mla_decode_gluon

            def launch(q, kc, _vc, out):
                mla_decode_gluon(q, kc, block_tables, seq_lens, kv_lora_rank=kv_lora_rank,
                                 sm_scale=sm_scale, out=out)
        elif kernel == "":
            launch = _plan(q, kv_cache, block_tables, seq_lens, kv_lora_rank=kv_lora_rank,
                           sm_scale=sm_scale, out=out, num_splits=num_splits, config=config)
        else:
            raise ValueError(f"kernel must be 'wgmma', 'gluon' or '', got {kernel!r}")
        super().__init__(launch, q, kv_cache, kv_cache, out)


_DECODE_LAUNCH = FastLauncher(_mla_decode_kernel)


_MERGE_LAUNCH = FastLauncher(_mla_merge_kernel)


def merge_launcher(mid_o: torch.Tensor, mid_lse: torch.Tensor, kv_lora_rank: int, pdl: bool = False,
                   bind: bool = True) -> Callable[[torch.Tensor], None]:
    """launch(out): out [B, H, kv_lora_rank] from the splits' partials mid_o [B, H, S, BLOCK_R]
    (fp32) and mid_lse [B, H, S] (base 2), the merge kernel, one program per (b, h, column
    chunk). A plan's layers share the scratch, so with ``bind`` the launches after the first
    skip Triton's dispatch (fast_launch.bind: ``out`` the one argument that varies)."""
    B, H, num_splits, block_r = mid_o.shape
    block_s = triton.next_power_of_2(num_splits)
    chunk_r = min(block_r, max(16, 4096 // block_s))  # <= 4K fp32 per program
    grid = (B, H, triton.cdiv(kv_lora_rank, chunk_r))
    consts = dict(RANK=kv_lora_rank, BLOCK_R=block_r, BLOCK_S=block_s, CHUNK_R=chunk_r, PDL=pdl)
    options = dict(num_warps=4, **pdl_launch_kwargs(pdl))
    bound: list = []

    def launch(out: torch.Tensor) -> None:
        args = (mid_o, mid_lse, out, H, num_splits, out.stride(0), out.stride(1))
        if bound:
            bound[0](args)
        elif bind:
            bound.append(_MERGE_LAUNCH.bind(grid, args, consts, options, varying=(2,)))
        else:
            _MERGE_LAUNCH(grid, args, consts, options)

    return launch


def _merge(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor, kv_lora_rank: int,
           pdl: bool = False) -> None:
    """One merge (``merge_launcher``'s kernel) outside a plan."""
    merge_launcher(mid_o, mid_lse, kv_lora_rank, pdl, bind=False)(out)


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    kv_lora_rank: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """Pure-PyTorch reference, fp32 math (an fp8 cache's values read exactly); same
    contract as :func:`mla_decode`."""
    del num_splits, config, pdl  # the reference does not split or launch kernels
    B, H, D = q.shape
    page = kv_cache.shape[1]
    flat = kv_cache.reshape(-1, D)
    res = torch.empty(B, H, kv_lora_rank, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // page].long() * page + pos % page
        ent = flat[slots].float()  # [n, D]
        p = torch.softmax((q[b].float() @ ent.T) * sm_scale, dim=-1)  # [H, n]
        res[b] = p @ ent[:, :kv_lora_rank]
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out


def mla_decode_flops(num_heads: int, total_keys: int, kv_lora_rank: int, rope_dim: int) -> int:
    """FLOPs of one call: QK^T over all dims plus PV over the value dims."""
    return 2 * num_heads * total_keys * (2 * kv_lora_rank + rope_dim)


__all__ = [
    "CANDIDATE_CONFIGS",
    "MLADecodeConfig",
    "QK_CHUNK_CONFIGS",
    "config_name",
    "default_config",
    "mla_decode",
    "mla_decode_flops",
    "mla_decode_ref",
    "pick_num_splits",
]
