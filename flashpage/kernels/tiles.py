"""Tile orderings shared by the Triton GEMM kernels (imports nothing from the engine).

``grouped_tile``: a 1-D program id -> (pid_m, pid_n) over GROUP_M-wide bands of row tiles,
the row tile the fastest index inside a band, so that neighbouring programs read the same
weight tile (from L2); the Triton matmul tutorial's ordering. The last band may hold fewer
row tiles.

``wgmma_a_rows``: the row order in which a [BLOCK_N, 16] tile of 32-bit words is loaded so
that each thread's words are its own share of wgmma's A fragment (4 warps; 128 K values a
row: kernels/fused_moe.py's form "swap", kernels/int4_gemm.py's "fragment" tiles).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Program ``pid`` of tiles_m x tiles_n -> (pid_m, pid_n): bands of GROUP_M row tiles
    each across all tiles_n column tiles, the row tile the fastest index in a band."""
    band = GROUP_M * tiles_n
    first_m = (pid // band) * GROUP_M
    rows_in_band = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows_in_band
    pid_n = (pid % band) // rows_in_band
    return pid_m, pid_n


@triton.jit
def wgmma_a_rows(pid_n, BLOCK_N: tl.constexpr):
    """The weight rows (output features) of tile pid_n in the order its words are loaded:
    load row i = 32j + 8w + l (w, l < 8; a blocked layout of 4 warps, 8 x 4 lanes, 4 words a
    thread) reads feature 64(j // 2) + 16w + 8(j % 2) + l, the row that thread holds in
    wgmma's A fragment (warp w holds rows 16w + l and 16w + l + 8 of each 64)."""
    i = tl.arange(0, BLOCK_N)
    return pid_n * BLOCK_N + 64 * (i // 64) + 16 * ((i // 8) % 4) + 8 * ((i // 32) % 2) + i % 8
