"""The key range of one split (flash-decoding), shared by the decode kernels: paged_decode,
paged_decode_rows and mla_decode split a sequence's keys the same way."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_range(seq_lens_ptr, b, window, num_splits, split, HAS_WINDOW: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Keys [start, end) of split ``split`` of sequence ``b``: an equal share of its context
    (within the window), a multiple of BLOCK_N long; empty past the end."""
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    return start, tl.minimum(start + chunk, seq_len)
