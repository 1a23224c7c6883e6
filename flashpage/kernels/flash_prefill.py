"""FlashAttention-style prefill/extend attention over a ragged batch, in Triton.

One fused kernel: each program owns BLOCK_M queries of one (sequence, q head),
keeps them in SRAM, and streams the keys/values of its kv head through an online
softmax, so no seqlen x seqlen matrix ever reaches HBM. Keys come either from
contiguous ragged tensors (`flash_attn_varlen`) or from the paged KV cache through
block tables (`paged_prefill`, chunked prefill and prefix hits).

Masking is bottom-right aligned: in a sequence with Lq queries and Lk keys, query
i sits at key position i + Lk - Lq and sees keys j with

    j <= i + Lk - Lq                (causal)
    j >  i + Lk - Lq - window_size  (sliding window, optional)
    j >= (p // C) * C, p = i + Lk - Lq  (chunk_size C: Llama 4's chunked local attention,
                                    causal only: keys of the query's own chunk)

A query that sees no key (causal with Lq > Lk) gets a zero output and lse = -inf.
With ``softcap`` c (Gemma 2), scores (after sm_scale) become c * tanh(scores / c) before
the mask and softmax (kernels/softcap.py). With ``alibi_slopes`` (ALiBi: Bloom, MPT,
Falcon-RW; fp32 [Hq]), query head h adds slopes[h] * (j - i) to the score of query
position i and key position j (after sm_scale and any softcap): bias 0 on the diagonal,
more negative with distance, so the largest score stays near the diagonal and the online
softmax never meets a large positive bias. With ``sinks`` (GPT-OSS; fp32 [Hq]), query head
h's softmax denominator gains exp(sinks[h]), a logit with no value (kernels/sinks.py),
folded into the online-softmax state once after the key loop.

Q/K and V may have different head dims (MLA prefill: qk 192 = 128 nope + 64 rope, v 128),
and neither needs to be a power of two: each is padded to a power-of-two tile width
(>= 16) and the padding columns are masked on load (zeros, so they add nothing to QK^T)
and on store. Only equal power-of-two dims take the TMA path.

Key tiles of one program fall into three loop stages so that only the few tiles
that need a mask pay for it:

    keys:  [lo ........ s1)[s1 ............ s2)[s2 ...... hi)
            window edge /    every key visible   causal diagonal,
            chunk start,     (no mask)           masked (+ ragged end)
            masked

A row's lower bound (window edge, chunk start, or the larger of both) grows with the row:
`lo` is the first row's, rounded down to a tile; the first stage runs to the last row's,
rounded up, so the rows of a query tile that straddles a chunk boundary (rows in two
chunks) see their own chunk starts through the mask.

`paged_prefill` also reads a float8_e4m3fn cache (kv_dtype.py): each K/V tile is widened
to q's dtype right after its load (exact), then the loop runs as with a 16-bit cache. Such
a cache never takes the TMA path (its descriptors would load fp8 boxes; not built).

On Hopper, FLASHPAGE_PREFILL_GLUON=1 sends `paged_prefill` calls that the Gluon FA3-style
kernel covers (gluon_prefill_unsupported: 16-bit cache in q's dtype, head_dim 128, block
size a power of two >= 16, no window, no softcap, no ALiBi, no chunks, no explicit config) to
flash_prefill_gluon.
paged_prefill_gluon (default off until an H200 run shows it right and faster).

Tiles left of `lo` (outside the window) and right of `hi` (in the future) are
never loaded. Programs run heaviest query tile first (causal work grows with the
tile index), which shortens the tail of the grid, and the query tiles of one
(sequence, head) are launched side by side so that they share its K/V in L2.
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
from flashpage.kernels.device import sm90_reasons
from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.kv_dtype import check_kv_cache_dtype
from flashpage.kernels.plan import Launch, LaunchPlan
from flashpage.kernels.sinks import check_sinks, sinks_lse, softmax_with_sinks
from flashpage.kernels.softcap import softcap_log2, softcap_ref

try:  # host-side TMA descriptors (Hopper and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

# KV_MODE: how a tile of keys is read.
_KV_CONTIG, _KV_CONTIG_TMA, _KV_PAGED, _KV_PAGED_TMA = 0, 1, 2, 3


@triton.jit
def _page_rows(bt_row, start_n, seq_k, KV_MODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Cache slots of keys [start_n, start_n + BLOCK_N): int64 [BLOCK_N], or, for a TMA box
    inside one page, the int32 slot of its first key. Keys at or past seq_k have no table
    entry (their rows are masked or zeroed by the caller); every key before it must map to
    its own slot, even one the causal mask hides, since its V row still meets p = 0."""
    kpos = start_n + tl.arange(0, BLOCK_N)
    if KV_MODE == 3 or PAGE_SIZE >= BLOCK_N:  # the whole tile sits in one page
        blk = tl.load(bt_row + start_n // PAGE_SIZE, mask=start_n < seq_k, other=0)
        if KV_MODE == 3:
            return blk * PAGE_SIZE + start_n % PAGE_SIZE
        else:
            return blk.to(tl.int64) * PAGE_SIZE + (kpos % PAGE_SIZE)
    else:  # the tile spans BLOCK_N // PAGE_SIZE pages: one table entry per key
        blk = tl.load(bt_row + kpos // PAGE_SIZE, mask=kpos < seq_k, other=0)
        return blk.to(tl.int64) * PAGE_SIZE + (kpos % PAGE_SIZE)


@triton.jit
def _load_tile(X, desc, rows, kpos, seq_k, kv_col, stride_t, HEAD_DIM: tl.constexpr,
               DIM: tl.constexpr, KV_MODE: tl.constexpr, MASKED: tl.constexpr):
    """[BLOCK_N, HEAD_DIM] keys or values at `rows`; masked tiles zero rows >= seq_k.
    Columns DIM..HEAD_DIM (tile padding of a non-power-of-two head dim) load as zeros."""
    if KV_MODE == 1 or KV_MODE == 3:
        x = desc.load([rows, kv_col])
        if MASKED and KV_MODE == 3:  # slots past seq_k in the last page hold garbage (maybe NaN)
            x = tl.where((kpos < seq_k)[:, None], x, 0.0)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        ptrs = X + rows[:, None] * stride_t + kv_col + offs_d[None, :]
        if DIM < HEAD_DIM:
            if MASKED:
                x = tl.load(ptrs, mask=(kpos < seq_k)[:, None] & (offs_d < DIM)[None, :], other=0.0)
            else:
                x = tl.load(ptrs, mask=(offs_d < DIM)[None, :], other=0.0)
        elif MASKED:
            x = tl.load(ptrs, mask=(kpos < seq_k)[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _attn_stage(acc, l_i, m_i, q, K, V, desc_k, desc_v, bt_row, lo, hi, k_start, seq_k,
                kv_col, qpos, qk_scale, qlo, softcap, slope, qpos0, stride_kt, stride_vt,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_LO: tl.constexpr,
                KV_MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                HEAD_DIM: tl.constexpr, QK_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                V_DIM: tl.constexpr, IEEE: tl.constexpr, WARP_SPEC: tl.constexpr,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    if KV_MODE >= 2:
        # paged: block-table entries are read one tile ahead and carried into the next
        # iteration, so the K/V loads' addresses never wait on a load; an address computed
        # from a load in the same iteration makes Triton's pipeliner drop a buffer stage
        next_rows = _page_rows(bt_row, lo, seq_k, KV_MODE, PAGE_SIZE, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kpos = start_n + offs_n
        if KV_MODE >= 2:
            rows = next_rows
            next_rows = _page_rows(bt_row, start_n + BLOCK_N, seq_k, KV_MODE, PAGE_SIZE, BLOCK_N)
        elif KV_MODE == 1:
            rows = k_start + start_n
        else:
            rows = (k_start + kpos).to(tl.int64)
        # an fp8 cache's tile widened to q's dtype before the dot (else a no-op)
        k = _load_tile(K, desc_k, rows, kpos, seq_k, kv_col, stride_kt, HEAD_DIM, QK_DIM, KV_MODE,
                       MASKED).to(q.dtype)
        qk = _dot(q, tl.trans(k), None, IEEE)
        if MASKED:
            mask = (kpos < seq_k)[None, :]
            if CAUSAL:
                mask = mask & (kpos[None, :] <= qpos[:, None])
            if HAS_LO:  # the row's first visible key: window edge and / or chunk start
                mask = mask & (kpos[None, :] >= qlo[:, None])
            qk = qk * qk_scale
            if SOFTCAP:
                qk = softcap_log2(qk, softcap)
            if ALIBI:  # slope (base 2) x (key position - the tile's first query position)
                qk = qk + (slope * (kpos - qpos0).to(tl.float32))[None, :]
            qk = tl.where(mask, qk, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # a row with no visible key so far keeps m = -inf; subtract 0 there, not -inf
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_sub[:, None])
            alpha = tl.math.exp2(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = _load_tile(V, desc_v, rows, kpos, seq_k, kv_col, stride_vt, HEAD_DIM_V, V_DIM,
                           KV_MODE, True).to(q.dtype)
            acc = _dot(p.to(v.dtype), v, acc, IEEE)
            m_i = m_ij
        else:
            if SOFTCAP or ALIBI:
                qk = qk * qk_scale
                if SOFTCAP:
                    qk = softcap_log2(qk, softcap)
                if ALIBI:
                    qk = qk + (slope * (kpos - qpos0).to(tl.float32))[None, :]
                m_ij = tl.maximum(m_i, tl.max(qk, 1))
                p = tl.math.exp2(qk - m_ij[:, None])
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = _load_tile(V, desc_v, rows, kpos, seq_k, kv_col, stride_vt, HEAD_DIM_V, V_DIM,
                           KV_MODE, False).to(q.dtype)
            acc = _dot(p.to(v.dtype), v, acc, IEEE)
            m_i = m_ij
    return acc, l_i, m_i


# Ints that vary with the batch must not trigger recompiles (Triton specializes ints == 1 and
# % 16, pointers on 16-byte alignment): a mixed step passes seq_lens[nd:] and
# block_tables[nd:], whose alignment follows the number of decodes nd
@triton.jit(do_not_specialize=["window", "chunk", "group", "stride_lse", "stride_bt", "cu_q", "cu_k",
                               "seq_lens", "block_tables"])
def _prefill_fwd(
    Q, K, V, Out, Lse, desc_q, desc_k, desc_v,
    cu_q, cu_k, seq_lens, block_tables,
    qk_scale, window, chunk, softcap, Slopes, Sinks, group,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lse, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    QK_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, V_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_MODE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, RETURN_LSE: tl.constexpr, IEEE: tl.constexpr,
    WARP_SPEC: tl.constexpr, M_FASTEST: tl.constexpr,
    SOFTCAP: tl.constexpr,  # scores -> cap * tanh(scores / cap); softcap = cap * log2(e)
    ALIBI: tl.constexpr = False,  # scores + Slopes[h] * (j - i) (Slopes: fp32 [Hq])
    SINKS: tl.constexpr = False,  # Sinks[h] (fp32 [Hq]) joins the softmax denominator
    CHUNKED: tl.constexpr = False,  # keys j >= (p // chunk) * chunk only, p = qpos (Llama 4)
):
    # heaviest query tile first: causal work grows with the tile index
    if M_FASTEST:  # the tiles of one head run side by side and share its K/V in L2
        m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
        h = tl.program_id(1)
        b = tl.program_id(2)
    else:
        h = tl.program_id(0)
        b = tl.program_id(1)
        m0 = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    q_start = tl.load(cu_q + b)
    seq_q = tl.load(cu_q + b + 1) - q_start
    if m0 >= seq_q:
        return
    if KV_MODE >= 2:
        k_start = 0
        seq_k = tl.load(seq_lens + b)
    else:
        k_start = tl.load(cu_k + b)
        seq_k = tl.load(cu_k + b + 1) - k_start
    bt_row = block_tables + b.to(tl.int64) * stride_bt
    kvh = h // group
    shift = seq_k - seq_q  # query i sits at key position i + shift

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if KV_MODE == 1 or KV_MODE == 3:
        q = desc_q.load([q_start + m0, h * HEAD_DIM])
    else:
        q_ptrs = Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q_mask = (offs_m < seq_q)[:, None]
        if QK_DIM < HEAD_DIM:  # padded tile: zero columns add nothing to QK^T
            q_mask = q_mask & (offs_d < QK_DIM)[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)

    # key-tile ranges of the three stages (see the module docstring)
    last_row = tl.minimum(m0 + BLOCK_M, seq_q) - 1
    if CAUSAL:
        hi = tl.maximum(tl.minimum(seq_k, last_row + shift + 1), 0)
        full_end = tl.minimum(hi // BLOCK_N, tl.maximum(m0 + shift + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        hi = seq_k
        full_end = (hi // BLOCK_N) * BLOCK_N
    # Each row's first visible key (its lower bound: window edge, chunk start or both) grows
    # with the row: the first row's, rounded down to a tile, starts the key range; from the
    # last row's, rounded up, no row masks a key on the left. Rows of one query tile in two
    # chunks put the tiles between the two chunk starts in the masked first stage.
    qpos = offs_m + shift
    qlo = qpos * 0  # each row's first visible key (read under HAS_WINDOW or CHUNKED)
    if HAS_WINDOW or CHUNKED:
        lo_first = 0
        lo_last = 0
        if HAS_WINDOW:
            qlo = qpos - window + 1
            lo_first = m0 + shift - window + 1
            lo_last = last_row + shift - window + 1
        if CHUNKED:  # (a row at a negative position sees no key: chunk 0 for it)
            qlo = tl.maximum(qlo, (tl.maximum(qpos, 0) // chunk) * chunk)
            lo_first = tl.maximum(lo_first, (tl.maximum(m0 + shift, 0) // chunk) * chunk)
            lo_last = tl.maximum(lo_last, (tl.maximum(last_row + shift, 0) // chunk) * chunk)
        lo = (tl.maximum(lo_first, 0) // BLOCK_N) * BLOCK_N
        win_full = tl.cdiv(tl.maximum(lo_last, 0), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        win_full = 0
    s1 = tl.maximum(lo, tl.minimum(win_full, full_end))
    s2 = tl.maximum(s1, full_end)

    qpos0 = m0 + shift
    slope = 0.0
    if ALIBI:  # this program's query head's slope, in base 2 as the scores
        # Row i's bias slope * (j - qpos_i) is slope * (j - qpos0) less slope * (qpos_i - qpos0),
        # a constant of the row the softmax cancels: each tile adds a [BLOCK_N] vector (one
        # add an element, no [BLOCK_M, BLOCK_N] position difference); the LSE gets it back.
        slope = tl.load(Slopes + h) * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    kv_col = kvh * HEAD_DIM  # TMA column of this kv head in the [rows, Hkv * D] view
    K = K + kvh.to(tl.int64) * stride_kh
    V = V + kvh.to(tl.int64) * stride_vh
    if not (KV_MODE == 1 or KV_MODE == 3):
        kv_col = 0  # pointer paths fold the head offset into K and V
    if HAS_WINDOW or CHUNKED:
        acc, l_i, m_i = _attn_stage(
            acc, l_i, m_i, q, K, V, desc_k, desc_v, bt_row, lo, s1, k_start, seq_k, kv_col, qpos,
            qk_scale, qlo, softcap, slope, qpos0, stride_kt, stride_vt, True, CAUSAL, HAS_WINDOW or CHUNKED, KV_MODE,
            PAGE_SIZE, BLOCK_N, HEAD_DIM, QK_DIM, HEAD_DIM_V, V_DIM, IEEE, False, SOFTCAP, ALIBI)
    acc, l_i, m_i = _attn_stage(
        acc, l_i, m_i, q, K, V, desc_k, desc_v, bt_row, s1, s2, k_start, seq_k, kv_col, qpos,
        qk_scale, qlo, softcap, slope, qpos0, stride_kt, stride_vt, False, CAUSAL, HAS_WINDOW or CHUNKED, KV_MODE,
        PAGE_SIZE, BLOCK_N, HEAD_DIM, QK_DIM, HEAD_DIM_V, V_DIM, IEEE, WARP_SPEC, SOFTCAP, ALIBI)
    acc, l_i, m_i = _attn_stage(
        acc, l_i, m_i, q, K, V, desc_k, desc_v, bt_row, s2, hi, k_start, seq_k, kv_col, qpos,
        qk_scale, qlo, softcap, slope, qpos0, stride_kt, stride_vt, True, CAUSAL, HAS_WINDOW or CHUNKED, KV_MODE,
        PAGE_SIZE, BLOCK_N, HEAD_DIM, QK_DIM, HEAD_DIM_V, V_DIM, IEEE, False, SOFTCAP, ALIBI)

    if SINKS:  # one more "key" of score Sinks[h] (base 2 as the scores) and value 0
        sink = tl.load(Sinks + h) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.math.exp2(sink - m_sub)
        acc = acc * alpha[:, None]
        m_i = m_new
    row_ok = offs_m < seq_q
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    offs_dv = tl.arange(0, HEAD_DIM_V)
    o_ptrs = Out + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :]
    o_mask = row_ok[:, None]
    if V_DIM < HEAD_DIM_V:
        o_mask = o_mask & (offs_dv < V_DIM)[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=o_mask)
    if RETURN_LSE:
        lse2 = m_i + tl.math.log2(l_safe)
        if ALIBI:  # the row's constant the tiles left out
            lse2 = lse2 - slope * (qpos - qpos0).to(tl.float32)
        lse = tl.where(l_i == 0.0, float("-inf"), lse2 * 0.6931471805599453)
        tl.store(Lse + h.to(tl.int64) * stride_lse + q_start + offs_m, lse, mask=row_ok)


# ---------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and launch options; `use_tma` needs compute capability >= 9."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    warp_specialize: bool = False
    m_fastest: bool = True  # grid order: query tiles of one head adjacent (else heads)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_config(device: torch.device, head_dim: int, dtype: torch.dtype,
                   causal: bool) -> PrefillConfig:
    """The tile configuration per GPU generation (tuned on an H200 for capability 9.x)."""
    if device.type != "cuda" or _interpreting():
        return PrefillConfig(32, 16, 4, 1)  # small tiles: many tiles and diagonals in tiny tests
    major, _ = torch.cuda.get_device_capability(device)
    if dtype == torch.float32:
        # fp32 dots run on FMAs with both operands in registers: wide heads get short tiles.
        return PrefillConfig(64, 32, 4, 2) if head_dim <= 128 else PrefillConfig(32, 32, 4, 2)
    if major == 9:  # H200, 2026-11-30: best of a small sweep (benchmarks/attention_prefill.py)
        if head_dim <= 64:
            return PrefillConfig(128, 64, 4, 3, use_tma=True)
        if head_dim <= 128:
            return PrefillConfig(128, 128, 8, 3, use_tma=True)
        return PrefillConfig(128, 64, 8, 2, use_tma=True)
    if major >= 8:
        if head_dim <= 128:
            return PrefillConfig(128, 64, 4, 3)
        return PrefillConfig(64, 32, 4, 2)
    return PrefillConfig(64, 32, 4, 1)


def hopper_candidates(head_dim: int) -> list[PrefillConfig]:
    """Configurations that benchmarks/attention_prefill.py --tune times beside the capability
    9.x default (first in the list), and that the GPU tests check.

    Run 32 (H200, 2026-11-30, bf16, D=128, causal; TFLOP/s, candidate vs default
    128x128/w8/s3):

    - 64x64/w4/s3 (2 CTAs per SM): faster only at 8x1024 (347 vs 294 contiguous, 260 vs
      234 paged with 16-token pages), slower at 2x4096 (405 vs 434) and 1x16384 (466 vs
      502);
    - 128x64/w4/s2: 430 vs 434 at 2x4096, 494 vs 502 at 1x16384.

    A pipelined q·kᵀ (the next tile's wgmma in flight during the softmax, commit c025ffe,
    removed since) compiled without ptxas serialising the wgmmas (C7515), yet ran 8-17%
    slower than the default at every shape. The D=64 candidates other than the default
    crashed in the GPU test with an illegal memory access (unexplained; not kept).

    Run 2 timed these below the default and they are not tried again: the heads-first grid
    order, 128x128/w8/s2, 128x64/w8/s4 and the pointer path. 4-warp 128x128 tiles spill;
    warp_specialize compiles to the same code on sm_90 with triton 3.6."""
    c = PrefillConfig
    if head_dim <= 64:
        return [c(128, 64, 4, 3, use_tma=True)]
    return [c(128, 128, 8, 3, use_tma=True), c(64, 64, 4, 3, use_tma=True),
            c(128, 64, 4, 2, use_tma=True)]


# ---------------------------------------------------------------------------------------------
# launchers


def _check_cu(name: str, t: torch.Tensor, device: torch.device) -> int:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"{name} must be an int32 tensor [batch + 1], got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")
    return t.numel() - 1


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_name: str, fp8_kv: bool = False) -> tuple[int, int, int, int]:
    """-> (Hq, Hkv, qk head dim, v head dim). fp8_kv: k, v may also be float8_e4m3fn
    (paged caches)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} unsupported (float16, bfloat16, float32)")
    if fp8_kv:
        check_kv_cache_dtype(q.dtype, k, v)
    elif k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, {kv_name} dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{kv_name} shapes differ: {tuple(k.shape)} vs {tuple(v.shape)} "
                         "(only their head dims may differ)")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q and {kv_name} are on different devices")
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k.shape[-2], v.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"head_dim of q ({d}) and {kv_name} ({k.shape[-1]}) differ")
    for what, dim in (("head_dim", d), ("v head_dim", dv)):
        if not 1 <= dim <= 256:
            raise ValueError(f"{what} must be in [1, 256] (tiles pad it to a power of two), got {dim}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
    for name, t, td in (("q", q, d), (kv_name.split(",")[0], k, d),
                        (kv_name.split(",")[-1].strip(), v, dv)):
        if t.stride(-1) != 1 or t.stride(-2) != td:
            raise ValueError(f"{name} must have contiguous [heads, head_dim] rows, strides {t.stride()}")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    return hq, hkv, d, dv


def _check_out(out: torch.Tensor | None, q: torch.Tensor, dv: int) -> torch.Tensor:
    """out [total_q, Hq, v head dim] in q's dtype (q's shape when the head dims agree)."""
    shape = (*q.shape[:2], dv)
    if out is None:
        return q.new_empty(shape)
    if out.shape != shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {shape} {q.dtype} on {q.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.stride(-1) != 1:
        raise ValueError("out's last dimension must be contiguous")
    return out


def _check_softcap(softcap: float | None) -> None:
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")


def _check_chunk(chunk_size: int | None, causal: bool) -> int:
    """chunk_size (Llama 4's attention_chunk_size) -> the kernel's chunk, 0 for none."""
    if chunk_size is None:
        return 0
    if isinstance(chunk_size, bool) or int(chunk_size) != chunk_size or int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    if not causal:
        raise ValueError("chunk_size (chunked local attention) needs causal=True")
    return int(chunk_size)


def _check_window(window_size: int | None) -> int:
    if window_size is None:
        return 0
    if int(window_size) < 1:
        raise ValueError(f"window_size must be >= 1 or None, got {window_size}")
    return int(window_size)


def _tma_ok(*ts: torch.Tensor) -> bool:
    return TensorDescriptor is not None and all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in ts)


def _desc(t: torch.Tensor, rows: int, heads: int, d: int, box_rows: int):
    """TMA descriptor over the [rows, heads * head_dim] view of a token-major tensor."""
    return TensorDescriptor(t, [max(rows, 1), heads * d], [t.stride(0), 1], [box_rows, d])


def _form(q, k, v, paged, page_size, batch, max_seqlen_q, causal, sm_scale, window,
          cfg: PrefillConfig | None, softcap: float | None = None,
          alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
          chunk: int = 0):
    """The choices of a call (tile config, TMA or pointers, grid, constexprs) from its tensors'
    geometry -> (grid, constexprs, options, use_tma, cfg, scale)."""
    total_q, hq, d = q.shape
    dv = v.shape[-1]
    # Tile widths: powers of two >= 16 (tl.dot's smallest), padding masked in the kernel.
    block_d = max(16, triton.next_power_of_2(d))
    block_dv = max(16, triton.next_power_of_2(dv))
    if cfg is None:
        cfg = default_config(q.device, max(block_d, block_dv), q.dtype, causal)
    use_tma = cfg.use_tma and q.dtype != torch.float32
    # TMA boxes are [rows, head_dim] of one width for Q, K and V: unpadded, equal dims only.
    use_tma = use_tma and d == dv == block_d and _tma_ok(q, k, v)
    use_tma = use_tma and k.dtype == v.dtype == q.dtype  # an fp8 cache: the pointer path
    if paged:
        use_tma = use_tma and page_size % cfg.block_n == 0 and k.shape[0] < 2**31
        mode = _KV_PAGED_TMA if use_tma else _KV_PAGED
    else:
        mode = _KV_CONTIG_TMA if use_tma else _KV_CONTIG
    scale = (1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)) * _LOG2E
    num_m = triton.cdiv(max(int(max_seqlen_q), 1), cfg.block_m)
    grid = (num_m, hq, batch) if cfg.m_fastest else (hq, batch, num_m)
    if max(grid[1:]) > 65535:
        raise ValueError(f"grid {grid} too large: batch and heads must be <= 65535")
    consts = dict(HEAD_DIM=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  QK_DIM=d, HEAD_DIM_V=block_dv, V_DIM=dv, CAUSAL=bool(causal),
                  HAS_WINDOW=window > 0, KV_MODE=mode, PAGE_SIZE=page_size if paged else 1,
                  RETURN_LSE=False, IEEE=q.dtype == torch.float32,
                  WARP_SPEC=cfg.warp_specialize, M_FASTEST=cfg.m_fastest,
                  SOFTCAP=softcap is not None, ALIBI=alibi_slopes is not None,
                  SINKS=sinks is not None, CHUNKED=chunk > 0)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return grid, consts, options, use_tma, cfg, scale


def _args(q, k, v, out, lse, cu_q, cu_k, seq_lens, block_tables, use_tma, cfg, scale, window,
          softcap=None, alibi_slopes=None, sinks=None, chunk=0):
    """_prefill_fwd's positional arguments for these tensors."""
    hkv, d = k.shape[-2], q.shape[-1]
    desc_q = desc_k = desc_v = None
    if use_tma:
        desc_q = _desc(q, q.shape[0], q.shape[1], d, cfg.block_m)
        desc_k = _desc(k, k.shape[0], hkv, d, cfg.block_n)
        desc_v = _desc(v, v.shape[0], hkv, d, cfg.block_n)
    if lse is None:
        lse_arg, stride_lse = out, 0  # never written (RETURN_LSE is off)
    else:
        lse_arg, stride_lse = lse, lse.stride(0)
    paged = block_tables is not None
    return (q, k, v, out, lse_arg, desc_q, desc_k, desc_v,
            cu_q, cu_k if cu_k is not None else cu_q,
            seq_lens if seq_lens is not None else cu_q,
            block_tables if paged else cu_q,
            scale, window, chunk or 1, (softcap or 1.0) * _LOG2E,  # (chunk read only under CHUNKED)
            alibi_slopes if alibi_slopes is not None else cu_q,  # (read only under ALIBI)
            sinks if sinks is not None else cu_q,  # (read only under SINKS)
            q.shape[1] // hkv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), stride_lse, block_tables.stride(0) if paged else 0)


def _launch(q, k, v, out, lse, cu_q, cu_k, seq_lens, block_tables, page_size, batch,
            max_seqlen_q, causal, sm_scale, window, cfg: PrefillConfig | None,
            softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None, chunk: int = 0):
    grid, consts, options, use_tma, cfg, scale = _form(
        q, k, v, block_tables is not None, page_size, batch, max_seqlen_q, causal, sm_scale, window, cfg,
        softcap, alibi_slopes, sinks, chunk)
    consts["RETURN_LSE"] = lse is not None
    _prefill_fwd[grid](*_args(q, k, v, out, lse, cu_q, cu_k, seq_lens, block_tables, use_tma, cfg, scale,
                              window, softcap, alibi_slopes, sinks, chunk), **consts, **options)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, window_size) -> tuple[int, int, int]:
    """flash_attn_varlen's checks -> (query heads, batch, window)."""
    hq = _check_qkv(q, k, v, "k, v")[0]
    if k.dim() != 3:
        raise ValueError(f"k, v must be [total_k, num_kv_heads, head_dim], got {tuple(k.shape)}")
    batch = _check_cu("cu_seqlens_q", cu_seqlens_q, q.device)
    if _check_cu("cu_seqlens_k", cu_seqlens_k, q.device) != batch:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k differ in length: {batch + 1} vs "
                         f"{cu_seqlens_k.numel()}")
    return hq, batch, _check_window(window_size)


class VarlenPlan(LaunchPlan):
    """flash_attn_varlen planned for the layers of a step (kernels/plan.py), as MLA's prompt
    path calls it over each layer's own expanded keys and values: the checks, tile config and
    grid chosen once for one set of query and key offsets; ``run(q, k, v, out)`` as
    flash_attn_varlen over them (causal as planned, no lse), the launches after the first
    bound past Triton's dispatch (kernels/fast_launch.py) unless TMA descriptors are made per
    call."""

    name = "VarlenPlan"

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                 causal: bool = True, sm_scale: float | None = None, window_size: int | None = None,
                 out: torch.Tensor | None = None, chunk_size: int | None = None) -> None:
        _, batch, window = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, window_size)
        chunk = _check_chunk(chunk_size, causal)
        if out is not None:
            _check_out(out, q, v.shape[-1])
        grid, consts, options, use_tma, cfg, scale = _form(
            q, k, v, False, 0, batch, max_seqlen_q, causal, sm_scale, window, None, chunk=chunk)
        bound: list = []

        def launch(q, k, v, out):
            if q.shape[0] == 0 or batch == 0:
                return
            args = _args(q, k, v, out, None, cu_seqlens_q, cu_seqlens_k, None, None, use_tma, cfg,
                         scale, window, chunk=chunk)
            if bound:
                bound[0](args)
            elif use_tma:
                _prefill_fwd[grid](*args, **consts, **options)
            else:
                bound.append(_PREFILL_LAUNCH.bind(grid, args, consts, options, varying=(0, 1, 2, 3, 4)))

        super().__init__(launch, q, k, v, out)


_PREFILL_LAUNCH = FastLauncher(_prefill_fwd)


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                      causal=True, sm_scale=None, window_size=None, return_lse=False, out=None,
                      softcap=None, alibi_slopes=None, sinks=None, chunk_size=None,
                      _config: PrefillConfig | None = None):
    """Attention over a ragged batch with contiguous keys/values.

    q [total_q, Hq, D]; k [total_k, Hkv, D], v [total_k, Hkv, Dv] (Dv may differ from D,
    as in MLA prefill; both <= 256; Hq % Hkv == 0, q head h reads kv head
    h // (Hq // Hkv)); cu_seqlens_q/k int32 [B + 1] (sequence b owns rows
    cu[b]:cu[b+1]); max_seqlen_q sizes the grid and must be >= every query length.
    Returns out [total_q, Hq, Dv] in q's dtype, and lse [Hq, total_q] fp32 (natural
    log of the softmax denominator, -inf for a query that sees no key) if return_lse.
    The default sm_scale is D ** -0.5. softcap c: scores (after sm_scale) become
    c * tanh(scores / c) before the softmax (Gemma 2's attn_logit_softcapping).
    alibi_slopes (fp32 [Hq]): query head h's score of key j from query i (bottom-right
    positions, as the mask's) gains alibi_slopes[h] * (j - i) after sm_scale and softcap.
    sinks (fp32 [Hq]): query head h's softmax denominator gains exp(sinks[h]), a logit with
    no value (kernels/sinks.py); the lse then includes it.
    chunk_size C (Llama 4's chunked local attention; causal only): query i (bottom-right
    position p) sees only keys j with j // C == p // C, besides the causal and window masks.
    """
    hq, batch, window = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, window_size)
    chunk = _check_chunk(chunk_size, causal)
    _check_softcap(softcap)
    check_alibi(alibi_slopes, hq, q.device)
    check_sinks(sinks, hq, q.device)
    out = _check_out(out, q, v.shape[-1])
    lse = torch.empty(hq, q.shape[0], dtype=torch.float32, device=q.device) if return_lse else None
    if q.shape[0] > 0 and batch > 0:
        _launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, None, None, 0, batch,
                max_seqlen_q, causal, sm_scale, window, _config, softcap, alibi_slopes, sinks, chunk)
    return (out, lse) if return_lse else out


def paged_prefill(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                  max_seqlen_q, max_seqlen_k, *, causal=True, sm_scale=None,
                  window_size=None, return_lse=False, out=None, softcap=None,
                  alibi_slopes=None, sinks=None, chunk_size=None, _config: PrefillConfig | None = None):
    """Attention of new tokens over the paged KV cache (chunked prefill, prefix hits).

    q [total_q, Hq, D]; key_cache [num_blocks, block_size, Hkv, D], value_cache
    [num_blocks, block_size, Hkv, Dv] (block_size a power of two; Dv may differ from D;
    both in q's dtype or both float8_e4m3fn, read as q's dtype); block_tables int32
    [B, max_blocks]; seq_lens int32 [B] (context after this step: cached prefix + new
    tokens, whose K/V are already in the cache). Key p of sequence b lives in slot
    block_tables[b, p // bs] * bs + p % bs; query i of b sits at position
    seq_lens[b] - q_len_b + i. softcap, alibi_slopes, sinks and chunk_size as
    `flash_attn_varlen`'s.
    Returns as `flash_attn_varlen`.
    """
    launch = _plan_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                         max_seqlen_k, causal=causal, sm_scale=sm_scale, window_size=window_size,
                         return_lse=return_lse, out=out, _config=_config, softcap=softcap,
                         alibi_slopes=alibi_slopes, sinks=sinks, chunk_size=chunk_size)
    out = _check_out(out, q, value_cache.shape[-1])
    lse = launch(q, key_cache, value_cache, out)
    return (out, lse) if return_lse else out


def _plan_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                max_seqlen_k, *, causal, sm_scale, window_size, return_lse, out,
                _config: PrefillConfig | None = None, descriptors: dict | None = None,
                softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> Launch:
    """paged_prefill's checks and kernel choice once -> launch(q, key_cache, value_cache, out)
    -> lse or None, for tensors of this geometry over these tables, offsets and lengths
    (with ``sinks``, a layer's own as a fifth argument; default: these)."""
    if key_cache.dim() != 4:
        raise ValueError(f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)}")
    hq, hkv, d, dv = _check_qkv(q, key_cache, value_cache, "key_cache, value_cache", fp8_kv=True)
    page_size = key_cache.shape[1]
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"block_size must be a power of two, got {page_size}")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.stride(0) != page_size * c.stride(1):
            raise ValueError(f"{name} blocks must be contiguous, strides {c.stride()}")
    batch = _check_cu("cu_seqlens_q", cu_seqlens_q, q.device)
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,) or seq_lens.device != q.device:
        raise ValueError(f"seq_lens must be int32 [{batch}] on {q.device}, got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if (block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch
            or block_tables.stride(1) != 1 or block_tables.device != q.device):
        raise ValueError(f"block_tables must be int32 [{batch}, max_blocks] with contiguous rows, "
                         f"got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.shape[1] * page_size < max_seqlen_k:
        raise ValueError(f"block_tables has {block_tables.shape[1]} blocks of {page_size} tokens, "
                         f"fewer than max_seqlen_k={max_seqlen_k}")
    window = _check_window(window_size)
    chunk = _check_chunk(chunk_size, causal)
    _check_softcap(softcap)
    check_alibi(alibi_slopes, hq, q.device)
    check_sinks(sinks, hq, q.device)
    if out is not None:
        _check_out(out, q, dv)
    if (_config is None and envs.prefill_gluon() and q.shape[0] > 0 and batch > 0
            and not gluon_prefill_unsupported(q, key_cache, value_cache, window_size,
                                              softcap=softcap, alibi_slopes=alibi_slopes,
                                              sinks=sinks, chunk_size=chunk_size)):
        from flashpage.kernels.flash_prefill_gluon import engine_options, plan_paged

        return plan_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                          max_seqlen_q, max_seqlen_k, causal=causal, sm_scale=sm_scale,
                          return_lse=return_lse, out=out, descriptors=descriptors,
                          **engine_options(key_cache.shape[1], envs.prefill_producer()))

    def launch(q, key_cache, value_cache, out, layer_sinks=sinks):
        lse = torch.empty(hq, q.shape[0], dtype=torch.float32, device=q.device) if return_lse else None
        if q.shape[0] > 0 and batch > 0:
            slots_k = key_cache.view(-1, hkv, d) if key_cache.is_contiguous() else key_cache.flatten(0, 1)
            slots_v = value_cache.view(-1, hkv, dv) if value_cache.is_contiguous() else value_cache.flatten(0, 1)
            _launch(q, slots_k, slots_v, out, lse, cu_seqlens_q, None, seq_lens, block_tables,
                    page_size, batch, max_seqlen_q, causal, sm_scale, window, _config, softcap,
                    alibi_slopes, layer_sinks, chunk)
        return lse

    return launch


class PrefillPlan(LaunchPlan):
    """paged_prefill planned for the layers of a step (kernels/plan.py): the checks and the
    kernel's choices once for one block table, query offsets and lengths; ``run(q,
    key_cache, value_cache, out)`` as paged_prefill over them (no lse). ``descriptors``: a
    dict the caller keeps across plans (one per engine), where the Gluon kernel's cache
    descriptors are made once."""

    name = "PrefillPlan"

    def __init__(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                 max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = True,
                 sm_scale: float | None = None, window_size: int | None = None,
                 out: torch.Tensor | None = None, descriptors: dict | None = None,
                 softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> None:
        launch = _plan_paged(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                             max_seqlen_q, max_seqlen_k, causal=causal, sm_scale=sm_scale,
                             window_size=window_size, return_lse=False, out=out,
                             descriptors=descriptors, softcap=softcap, alibi_slopes=alibi_slopes,
                             sinks=sinks, chunk_size=chunk_size)
        super().__init__(launch, q, key_cache, value_cache, out)


def gluon_prefill_unsupported(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              window_size: int | None = None,
                              capability: tuple[int, int] | None = None, *,
                              softcap: float | None = None,
                              alibi_slopes: torch.Tensor | None = None,
                              sinks: torch.Tensor | None = None,
                              chunk_size: int | None = None) -> list[str]:
    """Why the Gluon paged prefill (flash_prefill_gluon.paged_prefill_gluon) cannot take this
    paged_prefill call; empty if it can (FLASHPAGE_PREFILL_GLUON=1 then sends it there).
    ``capability``: the device's compute capability (None: read from q's device; a CPU
    tensor or the interpreter count as none)."""
    reasons = sm90_reasons(q, capability)
    if q.dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"needs a bf16/fp16 query, got {q.dtype}")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        reasons.append(f"needs a cache in q's dtype {q.dtype} (no fp8), got {key_cache.dtype}")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        reasons.append("needs key and value caches of one shape [num_blocks, block_size, Hkv, D]")
        return reasons
    num_blocks, block_size, _, head_dim = key_cache.shape
    if q.dim() != 3 or q.shape[-1] != 128 or head_dim != 128:
        reasons.append(f"needs head_dim 128 (q, K and V), got {q.shape[-1]} and {head_dim}")
    if block_size < 16 or block_size & (block_size - 1):
        reasons.append(f"needs a power-of-two block_size >= 16, got {block_size}")
    if num_blocks * block_size >= 2**31:
        reasons.append(f"needs fewer than 2**31 cache slots, got {num_blocks} x {block_size}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        reasons.append("needs contiguous caches")
    if (q.dim() == 3 and (q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]
                          or (q.stride(0) * q.element_size()) % 16)):
        reasons.append(f"needs q's [heads, head_dim] rows contiguous, 16-byte strided, got strides {q.stride()}")
    if any(t.data_ptr() % 16 for t in (q, key_cache, value_cache)):
        reasons.append("needs q and the caches 16-byte aligned (TMA)")
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
    return reasons


# ---------------------------------------------------------------------------------------------
# pure-torch references (fp32, materialize one sequence's scores at a time)


def _attend_ref(q, k, v, causal, sm_scale, window, softcap=None, alibi_slopes=None, sinks=None,
                chunk_size=None):
    """q [Lq, Hq, D], k [Lk, Hkv, D], v [Lk, Hkv, Dv] -> out [Lq, Hq, Dv] fp32, lse [Hq, Lq] fp32
    (with ``sinks``: the softmax and the lse count each head's sink, kernels/sinks.py; with
    ``chunk_size`` C: query position p sees keys j with j // C == p // C alone)."""
    lq, hq, d = q.shape
    lk, hkv = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    qf = q.float().transpose(0, 1)
    kf = k.float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
    vf = v.float().transpose(0, 1).repeat_interleave(hq // hkv, dim=0)
    s = softcap_ref((qf @ kf.transpose(1, 2)) * scale, softcap)  # [Hq, Lq, Lk]
    qpos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    kpos = torch.arange(lk, device=q.device)[None, :]
    s = alibi_ref(s, alibi_slopes, qpos, kpos)
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        visible &= kpos <= qpos
    if window:
        visible &= kpos > qpos - window
    if chunk_size:
        visible &= kpos // chunk_size == qpos.clamp(min=0) // chunk_size
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        return (softmax_with_sinks(s, sinks) @ vf).transpose(0, 1), sinks_lse(
            torch.logsumexp(s, dim=-1), sinks)
    lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return (p @ vf).transpose(0, 1), lse


def flash_attn_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                          causal=True, sm_scale=None, window_size=None, return_lse=False, out=None,
                          softcap=None, alibi_slopes=None, sinks=None, chunk_size=None):
    """Reference for `flash_attn_varlen`, same signature, computed in fp32."""
    out = q.new_empty(*q.shape[:2], v.shape[-1]) if out is None else out
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        o, l_ = _attend_ref(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                            causal, sm_scale, window_size, softcap, alibi_slopes, sinks, chunk_size)
        out[cq[b]:cq[b + 1]] = o.to(out.dtype)
        lse[:, cq[b]:cq[b + 1]] = l_
    return (out, lse) if return_lse else out


def paged_prefill_ref(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                      max_seqlen_q, max_seqlen_k, *, causal=True, sm_scale=None,
                      window_size=None, return_lse=False, out=None, softcap=None, alibi_slopes=None,
                      sinks=None, chunk_size=None):
    """Reference for `paged_prefill`: gathers each sequence's keys, then attends in fp32 (an
    fp8 cache's values read exactly)."""
    bs = key_cache.shape[1]
    out = q.new_empty(*q.shape[:2], value_cache.shape[-1]) if out is None else out
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b in range(len(lens)):
        pos = torch.arange(lens[b], device=q.device)
        blk = block_tables[b].long()[pos // bs]
        k = key_cache[blk, pos % bs]
        v = value_cache[blk, pos % bs]
        o, l_ = _attend_ref(q[cq[b]:cq[b + 1]], k, v, causal, sm_scale, window_size, softcap,
                            alibi_slopes, sinks, chunk_size)
        out[cq[b]:cq[b + 1]] = o.to(out.dtype)
        lse[:, cq[b]:cq[b + 1]] = l_
    return (out, lse) if return_lse else out
