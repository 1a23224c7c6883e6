"""Tile orderings shared by the Triton GEMM kernels (imports nothing from the engine).

``grouped_tile``: a 1-D program id -> (pid_m, pid_n) over GROUP_M-wide bands of row tiles,
the row tile the fastest index inside a band, so that neighbouring programs read the same
weight tile (from L2); the Triton matmul tutorial's ordering. The last band may hold fewer
row tiles.

``wgmma_a_rows``: the row order in which a [BLOCK_N, 16] tile of 32-bit words is loaded so
that each thread's words are its own share of wgmma's A fragment (4 warps; 128 K values a
row: kernels/fused_moe.py's form "swap", kernels/int4_gemm.py's "fragment" tiles).

``moe_block``: the rows of a fused-MoE program (kernels/fused_moe*.py: grid (N tiles, NB
blocks) over moe_align's blocks of BLOCK_M sorted pairs). The kernel loads its block's
expert and returns on -1 itself first (a jit helper cannot return from its caller), so a
padding block reads nothing more.
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


@triton.jit
def moe_block(sorted_ptr, num_pairs, top_k, BLOCK_M: tl.constexpr):
    """(pid_n, rows, pair, valid, token) of program (pid_n, block): rows its block's BLOCK_M
    rows of sorted_pairs, pair = sorted_pairs[rows] (num_pairs on a padding row), valid =
    pair < num_pairs, token = pair // top_k as int64 (0 on a padding row; the down kernels
    pass top_k 1 and leave it: unused, it is not computed).

    The SASS of every kernel that calls it is the inlined prologue's to the instruction
    (sm_90a, the sm_90 tests' configs). Not more in here: with the rows loaded before the
    caller's early return the code changes, and with the N tile's offsets (pid_n * BLOCK_N
    + arange) or fused_moe._down_kernel's prologue, ptxas schedules an MXFP4 form
    differently (the inlined scope's debug labels split its blocks)."""
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    token = tl.where(valid, pair // top_k, 0).to(tl.int64)
    return pid_n, rows, pair, valid, token
