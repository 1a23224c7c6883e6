"""Paged decode over several KV heads per program (``DecodeConfig.heads_per_program``).

The main kernel (paged_decode.py) gives each program one KV head, so it reads 256-byte
pieces (head_dim 128, bf16) out of each token's [Hkv, D] cache row. Here a program takes
HPB adjacent KV heads and reads HPB * D contiguous elements of each row (all 8 heads of
Llama-3-8B: whole 2 KB rows, whole 32 KB pages), closer to the contiguous streams SDPA
cuDNN reads. The per-head dot products become one dot with a block-diagonal query:

    q_bd [ROWS, HPB * D]: row r (query head r of the block, KV head r // GROUP) holds its
                          query in columns [(r // GROUP) * D, (r // GROUP + 1) * D), 0 elsewhere
    scores = q_bd @ K_rows^T            K_rows [BLOCK_N, HPB * D]: each row's own head only
    acc   += p @ V_rows                 [ROWS, HPB * D]; row r keeps its own head's D columns

The extra multiply-adds (HPB times the main kernel's) cost nothing in a memory-bound
loop; with GQA 4 and HPB 4 the 16 rows fill the dot exactly (one head pads 4 rows to 16).
Split results use the main kernel's layout and its merge kernel. Needs head_dim a power
of two and the cache's heads adjacent (stride of a head == head_dim); the launcher in
paged_decode.py falls back to one head per program otherwise. An fp8 cache's K/V rows are
widened to q's dtype right after their load, as in the main kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashpage.kernels.kv_dtype import f16_query
from flashpage.kernels.pdl import pdl_prologue
from flashpage.kernels.splits import split_range


@triton.jit(do_not_specialize=["window", "stride_btb", "num_splits"])
def _paged_decode_rows_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    sm_scale_log2, window,
    stride_qb, stride_qh,
    stride_kb, stride_kt,
    stride_vb, stride_vt,
    stride_btb,
    stride_ob, stride_oh,
    num_splits,
    GROUP: tl.constexpr,  # query heads per KV head
    HPB: tl.constexpr,  # KV heads per program
    ROWS_PAD: tl.constexpr,  # HPB * GROUP rounded up to a power of two >= 16
    HEAD_DIM: tl.constexpr,  # a power of two
    WIDTH: tl.constexpr,  # HPB * HEAD_DIM: the elements of a token's row this program reads
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    F16_DOTS: tl.constexpr,  # an fp8 cache under a 16-bit q: pre-scaled fp16 q, fp16 dots
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)  # block of HPB KV heads
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * HPB * GROUP

    start, end = split_range(seq_lens_ptr, b, window, 1, num_splits, split, HAS_WINDOW, False, BLOCK_N)

    offs_r = tl.arange(0, ROWS_PAD)
    offs_c = tl.arange(0, WIDTH)
    r_mask = offs_r < HPB * GROUP
    own = (offs_c // HEAD_DIM)[None, :] == (offs_r // GROUP)[:, None]  # [ROWS_PAD, WIDTH]
    head = (hb * (HPB * GROUP) + offs_r).to(tl.int64)
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + head[:, None] * stride_qh + (offs_c % HEAD_DIM)[None, :],
                mask=r_mask[:, None] & own, other=0.0)
    q, sm_scale_log2 = f16_query(q, sm_scale_log2, F16_DOTS)

    m_i = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS_PAD], dtype=tl.float32)
    acc = tl.zeros([ROWS_PAD, WIDTH], dtype=tl.float32)
    bt_row = block_tables_ptr + b64 * stride_btb
    col0 = hb.to(tl.int64) * WIDTH  # the block's first element in a token's [Hkv * D] row
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blk = tl.load(bt_row + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        tok = (offs_n % PAGE).to(tl.int64)
        k = tl.load(k_ptr + (blk * stride_kb + tok * stride_kt + col0)[:, None] + offs_c[None, :],
                    mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptr + (blk * stride_vb + tok * stride_vt + col0)[:, None] + offs_c[None, :],
                    mask=n_mask[:, None], other=0.0)
        k = k.to(q.dtype)  # fp8 cache: widened before any arithmetic (else a no-op)
        v = v.to(q.dtype)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(n_mask[None, :], qk * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # every tile holds a valid key: finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Row r keeps the D columns of its own KV head.
    o = tl.sum(tl.reshape(tl.where(own, acc, 0.0), [ROWS_PAD, HPB, HEAD_DIM]), 1)
    has_keys = l_i > 0.0
    o = tl.where(has_keys[:, None], o / tl.where(has_keys, l_i, 1.0)[:, None], 0.0)
    offs_d = tl.arange(0, HEAD_DIM)
    if not SPLIT:
        tl.store(out_ptr + b64 * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None])
    else:
        # mid_o [B, Hq, num_splits, HEAD_DIM] fp32; mid_lse [B, Hq, num_splits] (base 2)
        row = (b64 * num_q_heads + head) * num_splits + split
        tl.store(mid_o_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=r_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=r_mask)
