"""The key range of one split (flash-decoding), shared by the decode kernels: paged_decode,
paged_decode_rows and mla_decode split a sequence's keys the same way."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_range(seq_lens_ptr, b, window, chunk, num_splits, split, HAS_WINDOW: tl.constexpr,
                CHUNKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [start, end) of split ``split`` of sequence ``b``: an equal share of its context
    (within the window; with CHUNKED, from the start of the query's chunk of ``chunk`` keys:
    Llama 4's chunked attention), a multiple of BLOCK_N long; empty past the end. The query
    sits at seq_len - 1; every key from the range's lower bound on is visible to it."""
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    if CHUNKED:
        lo = tl.maximum(lo, (tl.maximum(seq_len - 1, 0) // chunk) * chunk)
    share = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * share
    return start, tl.minimum(start + share, seq_len)
