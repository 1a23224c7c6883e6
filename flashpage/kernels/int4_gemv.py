"""Row-wise int4 GEMV for decode batches (1-16 rows): y[M, N] = x[M, K] @ dequant(w)[N, K]^T
(+ bias), over the int4 layout of kernels/int4_gemm.py (qweight int32 [N, K/8], nibble j of
word c = w[n, 8c + j]; scales [N, K/G]; zeros uint8 [N, K/G]; w = (q - z) * s).

At 1-16 rows a linear only streams its weight, so the kernel is built like gemv.py's
``gemv_row``, not like a GEMM: a program owns ``block_n`` output features and walks K a
``block_k`` tile at a time (K split between ``split_k`` programs where the features alone
leave SMs idle), and the weight is read once for all M rows::

    program (pid_n, pid_k)     qweight rows offs_n, its K range's words, coalesced along K
      tile t: packed [BLOCK_N, BLOCK_K/8] int32      (kept in flight ahead of their use:
                                                      see below)
              q - z  [BLOCK_N, BLOCK_K/8, 2, 2, 2]   a word's 8 nibbles in the thread that
                                                      loaded it (tl.join), no int-to-float
                                                      conversion (OR into a float's mantissa)
              rows:  acc[n, m] += s[n, g] * sum_k (q - z)[n, k] x[m, k]

HBM's latency is hidden only by bytes in flight, so each program keeps K tiles requested
ahead of the one it multiplies, one of two ways (``Int4GemvConfig.prefetch``):

    prefetch 1-3   by hand, in registers: tile t + prefetch's words, scales and zeros are
                   loaded before tile t is used (the loop rotates the loaded tiles). Each
                   tile in flight holds its words in registers (64 x 128: 16 a thread at 4
                   warps), which caps how many a program can keep (3; 2 won run 171).
    prefetch 0     by Triton's software pipeliner: a plain ``tl.range(start, end,
                   num_stages=NUM_STAGES)`` loop that loads, unpacks and multiplies tile t;
                   on sm_90 the pipeliner turns the word tiles (and the tensor cores' x
                   tiles) into cp.async copies into shared memory issued num_stages - 1
                   tiles ahead (LDGSTS, 16 bytes a copy), so the tiles in flight cost shared
                   memory, not registers (64 x 128 at 4 stages: 96 registers, 44 KB). The
                   scales and zero points (2 and 1 bytes a feature, too narrow for cp.async,
                   which the pipeliner would leave a load waited on in its own iteration)
                   are loaded one tile ahead by hand. ~4.2 SASS instructions a weight in
                   the K loop with the inline-PTX tensor-core form, ~7.3 on the CUDA cores
                   at one row (3.8 / 7.4 with register prefetch).

With ``silu_mul`` x is an MLP's gate/up output h [M, 2K] (gate | up, as gemv.gemv_row takes
it) and each K tile of x is silu(gate) * up, computed in fp32 from the two halves and
rounded to x's dtype twice as kernels/silu_mul rounds (gemv.py's ``_silu_mul``): the
numbers the unfused path multiplies, so SiLU·mul's kernel and its [M, K] round trip go.
Every program recomputes it for its K range (as gemv_row does). On the H200 (run 175) it
pays at one row only (26.6 us at down, as SiLU·mul then the GEMV), and costs 8-16 rows on
the tensor cores 1.1-1.5x the unfused pair (every column's exp and division beside ~4
instructions a weight): the engine fuses it at one row (layers/int4.fuses_silu_mul).

Three ways to do the row products (``Int4GemvConfig.dot`` / ``chain``):

    dot False   CUDA cores: for each row m (unrolled over BLOCK_M = M rounded up to a power
                of two) each word's 8 products summed in its thread, times the word's
                scale, stacked per row with tl.join; the sum across threads once at the
                end. One FMA per weight per row: ~7 SASS instructions a weight at one
                row for sm_90, ~14 at four.
    chain True  (without dot) CUDA cores, each nibble made 2048 + q or 128 + q in fp32 by
                one lop3 (``_NIBBLES_PTX``: no zero point per weight), a word's 8 products
                chained in FFMAs, (2048 + z) and (128 + z) times the word's two sums of x
                taken off once: ~5.5-5.9 instructions a weight at one row (the one-row
                default: run 177, 0.87-0.99x the plain unpacking's time).
    dot True    tensor cores, operands swapped: q - z in x's dtype (exact: -16..15) is the
                A operand [BLOCK_N, BLOCK_K] straight from registers, x's tile transposed
                the B operand [BLOCK_K, 16] (tl.dot's smallest N; rows past M are zeros);
                the group's scale multiplies the tile's [BLOCK_N, 16] result. BLOCK_N >= 16,
                the K tile inside one group (16 wide at least; else the CUDA cores).
    asm True    (with dot, 16-bit x, on the GPU) the nibbles become 16-bit floats by inline
                PTX, two per lop3 (OR into the mantissa of 128.0 in bf16, 1024.0 in fp16)
                and one fma takes OFFSET + z off both: ~4 instructions a weight for sm_90
                against ~6 with the fp32 unpacking. The interpreter runs the plain path.

At one row on the chains, ``norm`` moves the RMSNorm before the linear (and its residual
add) into the prologue, as gemv.gemv_row does: every program computes the row's statistics
from L2 (``_norm_rstd``), program (0, 0) writes x + residual, and each K tile's x is normed
as it is loaded (``_norm_x``). With PDL (kernels/pdl.py) the first weight tiles are
requested before the wait on the previous kernel; the split-K sum launches with PDL too.

Scales and zero points are loaded once per (feature, tile) where the tile lies in one group
(BLOCK_K <= G: G = 128 and K tiles of 128, the 8B checkpoints' case), else once per word
(a word lies in one group: G is a multiple of 8 dividing K, G = K allowed). With split K
each program writes fp32 partial sums [split, M, N], added (and the bias) after by one
small kernel, in split order (deterministic, no atomics).

The tensor cores' sums are exact products of q - z and x (fp32 accumulation), the scale
applied after: not the bits of the dequantized weight's linear (which rounds (q - z) * s
to x's dtype first), but nearer fp32's. ``int4_gemv_ref`` is ``int4_linear_ref``
(kernels/int4_gemm.py). ``default_config`` is a first guess from the SASS until
benchmarks/int4_gemv.py has been run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels.device import interpreting
from flashpage.kernels.gemv import _silu_mul
from flashpage.kernels.int4_gemm import (
    _UNPACK_TYPES,
    PACK,
    _block_k,
    _nibbles_2048_128,
    _unpack_ptx,
    _unpack_words,
    _unpack_words_asm,
    check_int4,
    int4_linear_ref,
)
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl

# Rows of x one call takes: up to 16 either form (the dot path pads x to tl.dot's 16-wide
# operand), 17-64 on the tensor cores only (x's operand 32 or 64 wide: the weight still read
# once, where dequantize + cuBLAS writes and reads a 16-bit copy of it)
MAX_ROWS = 64
PAD_ROWS = 16

int4_gemv_ref = int4_linear_ref


@dataclass(frozen=True)
class Int4GemvConfig:
    block_n: int = 16
    block_k: int = 256
    split_k: int = 0  # 0: chosen from the GPU's SM count at the call (1 off the GPU)
    num_warps: int = 4
    num_stages: int = 1  # with prefetch 0: the software pipeliner's stages
    dot: bool = False  # row products on tensor cores (see the module's docstring)
    asm: bool = False  # with dot: nibbles to 16-bit floats by inline PTX, two an instruction
    # K tiles in flight per program: 1..3 prefetched in registers, or 0: the K loop left to
    # Triton's software pipeliner (num_stages - 1 tiles in flight, in shared memory)
    prefetch: int = 2
    # without dot: each word's products chained in FFMAs from 128 + q (``_row_chain``),
    # ~3 instructions a weight a row, not the fp32 unpacking's ~7
    chain: bool = False

    @property
    def pipelined(self) -> bool:
        return self.prefetch == 0

    @property
    def name(self) -> str:
        kind = ("a" if self.asm else "d") if self.dot else ("c" if self.chain else "f")
        return (f"{kind}n{self.block_n}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}st{self.num_stages}p{self.prefetch}")


# The tiles benchmarks/int4_gemv.py sweeps beside the default. Register prefetch (run 172 on
# the H200, BENCHMARKS.md INT4 weights): the one-row and many-row winners and their 4-way
# splits kept; 32 / 128 features, 64-wide K tiles, 8 warps, plain unpacking and 8-way
# splits, never best there, dropped. Pipelined (prefetch 0, Triton's cp.async pipeliner,
# not yet timed): 3-5 stages, 64 / 128 features, K tiles of 128 / 256 (the tensor cores
# cap theirs at G = 128), K split auto / 4 / 8, on both kinds of cores.
CANDIDATES = (
    Int4GemvConfig(32, 128, 0, 2, chain=True),                  # FFMA chains, 1 row's best
    Int4GemvConfig(64, 128, 0, 4, chain=True),
    Int4GemvConfig(64, 128, 8, 4, chain=True),
    Int4GemvConfig(64, 128, 0, 4, 4, prefetch=0, chain=True),
    Int4GemvConfig(64, 128, 0, 4),                              # CUDA cores, plain unpacking
    Int4GemvConfig(64, 128, 0, 4, dot=True, asm=True, prefetch=1),  # 2-16 rows' best
    Int4GemvConfig(64, 128, 0, 4, dot=True, asm=True, prefetch=3),
    Int4GemvConfig(64, 128, 4, 4),                              # CUDA cores, fixed split
    Int4GemvConfig(64, 128, 4, 4, dot=True, asm=True),
    Int4GemvConfig(64, 128, 0, 4, 3, prefetch=0),               # pipelined, CUDA cores
    Int4GemvConfig(64, 128, 0, 4, 4, prefetch=0),
    Int4GemvConfig(64, 256, 0, 4, 4, prefetch=0),
    Int4GemvConfig(64, 128, 4, 4, 4, prefetch=0),
    Int4GemvConfig(64, 128, 0, 4, 3, dot=True, asm=True, prefetch=0),  # pipelined, tensor
    Int4GemvConfig(64, 128, 0, 4, 4, dot=True, asm=True, prefetch=0),
    Int4GemvConfig(64, 128, 0, 4, 5, dot=True, asm=True, prefetch=0),
    Int4GemvConfig(64, 128, 8, 4, 4, dot=True, asm=True, prefetch=0),
    Int4GemvConfig(128, 128, 0, 4, 4, dot=True, asm=True, prefetch=0),
)


def default_config(m: int, n: int, k: int) -> Int4GemvConfig:
    """The tile for m rows of a [n, k] weight, from the H200 sweep of run 171
    (benchmarks/int4_gemv.py at the 8B shapes, 1-16 rows): 64 features by 128 of K, two
    tiles in flight; one row on the CUDA cores (no 16-row padding: 26.7 us against 28.8 for
    the tensor cores at down's 4096 x 14336), more rows on the tensor cores with the
    inline-PTX unpacking (the CUDA cores' 8 rows took 3.4x as long). K's split is
    ``_split_k``'s (what the sweep's best tiles had). One row since run 177: the CUDA
    cores' FFMA chains (``_row_chain``), 32 features a program, 2 warps."""
    if m == 1:
        # run 177: the FFMA chains 0.87-0.99x the plain unpacking's time at the 8B shapes
        return Int4GemvConfig(32, 128, 0, 2, prefetch=2, chain=True)
    # run 175 (1-64 rows): Triton's pipelining (3 stages through shared memory) best or
    # within 4% at 8-16 rows and 5-18% ahead of register prefetch at 32-64
    return Int4GemvConfig(64, 128, 0, 4, 3, dot=True, asm=True, prefetch=0)


def parse_config(name: str) -> Int4GemvConfig:
    """The config an ``Int4GemvConfig.name`` names (e.g. ``an64k128s0w4st1p2``: a / d / f
    tensor cores with inline PTX / tensor cores / CUDA cores, block_n, block_k, split_k,
    num_warps, num_stages, prefetch)."""
    import re

    match = re.fullmatch(r"([dfac])n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)p(\d+)", name.strip())
    if match is None:
        raise ValueError(f"{name!r} is not a config name such as an64k128s0w4st1p2")
    kind, *nums = match.groups()
    bn, bk, split, warps, stages, prefetch = map(int, nums)
    return Int4GemvConfig(bn, bk, split, warps, stages, dot=kind in "ad", asm=kind == "a",
                          prefetch=prefetch, chain=kind == "c")


@triton.jit
def _load_tile(qw_rows, s_rows, z_rows, n_mask, t, end, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile t's packed words [BLOCK_N, BLOCK_K/8] and their scales and zero points: one
    per feature [BLOCK_N, 1] where the tile lies in one group (BLOCK_K <= G), else one per
    word [BLOCK_N, BLOCK_K/8] (a word lies in one group), in the words' layout. All zero
    past ``end`` (the prefetch after the last tile)."""
    live = t < end
    offs_w = tl.arange(0, BLOCK_K // 8)
    packed = tl.load(qw_rows + (t * (BLOCK_K // 8) + offs_w)[None, :],
                     mask=n_mask[:, None] & live, other=0)
    s, z = _load_groups(s_rows, z_rows, n_mask, t, end, G, BLOCK_K)
    return packed, s, z


@triton.jit
def _load_groups(s_rows, z_rows, n_mask, t, end, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile t's scales and zero points (``_load_tile``'s), zero past ``end``."""
    live = t < end
    k0 = t * BLOCK_K
    offs_w = tl.arange(0, BLOCK_K // 8)
    if BLOCK_K <= G:
        s = tl.load(s_rows + k0 // G, mask=n_mask[:, None] & live, other=0.0)
        z = tl.load(z_rows + k0 // G, mask=n_mask[:, None] & live, other=0)
    else:
        groups = (k0 + offs_w * 8) // G
        s = tl.load(s_rows + groups[None, :], mask=n_mask[:, None] & live, other=0.0)
        z = tl.load(z_rows + groups[None, :], mask=n_mask[:, None] & live, other=0)
    return s, z


@triton.jit
def _row_chain(packed, z, sf, xr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """A row's sums of the words [BN, W] against its x tile ``xr`` [BLOCK_K] (fp32), one
    FFMA a weight: each word's 8 products (2048 + q) * x or (128 + q) * x
    (``_nibbles_2048_128``, exact in fp32) chained in its thread, then (2048 + z) and (128 + z) times the word's two sums of x taken off once
    and the scale applied once: [BN, W]. A chain carries 2048 * x beside the q * x wanted:
    ~2^-15 of a word's sum lost to rounding, far below a 16-bit output's 2^-9."""
    a3, a1, a5, a0, b4, b2, b6, b7 = _nibbles_2048_128(packed, ASM)
    # the tile's x, computed once (a column a thread), split into the 8 columns of each
    # word: [W] each, broadcast over the features (Triton moves them through shared
    # memory; as fast as each thread loading its own, run 177)
    xe, xo = tl.split(tl.reshape(xr, (BLOCK_K // 8, 2, 2, 2)))
    xee, xeo = tl.split(xe)
    xoe, xoo = tl.split(xo)
    x0, x4 = tl.split(xee)
    x2, x6 = tl.split(xeo)
    x1, x5 = tl.split(xoe)
    x3, x7 = tl.split(xoo)
    x0, x1, x2, x3 = x0[None, :], x1[None, :], x2[None, :], x3[None, :]
    x4, x5, x6, x7 = x4[None, :], x5[None, :], x6[None, :], x7[None, :]
    acc = b4 * x4
    acc = tl.fma(b2, x2, acc)
    acc = tl.fma(b6, x6, acc)
    acc = tl.fma(b7, x7, acc)
    acc = tl.fma(a3, x3, acc)
    acc = tl.fma(a1, x1, acc)
    acc = tl.fma(a5, x5, acc)
    acc = tl.fma(a0, x0, acc)
    zf = z.to(tl.float32)
    acc = tl.fma(-(zf + 2048.0), (x3 + x1) + (x5 + x0), acc)
    acc = tl.fma(-(zf + 128.0), (x4 + x2) + (x6 + x7), acc)
    return acc * sf


@triton.jit
def _load_x(ptrs, mask, K, SILU_MUL: tl.constexpr):
    """x's values at ``ptrs`` in x's dtype; with SILU_MUL (x the gate/up output [M, 2K])
    silu(gate) * up from its columns at ptrs and ptrs + K, in fp32, rounded to x's dtype
    as kernels/silu_mul rounds (gemv.py's ``_silu_mul``: what the unfused path multiplies)."""
    if SILU_MUL:
        dt = ptrs.dtype.element_ty
        return _silu_mul(tl.load(ptrs, mask=mask, other=0.0),
                         tl.load(ptrs + K, mask=mask, other=0.0), dt).to(dt)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _norm_x(x_ptr, res_ptr, nw_ptr, offs, mask, rstd, HAS_RES: tl.constexpr):
    """rmsnorm(x + residual) * weight at columns ``offs`` of the one row, in fp32, rounded
    as kernels/rms_norm and HF round it (gemv.py's prologue): the sum to x's dtype, then
    s * rstd, then the product with the weight."""
    dt = x_ptr.dtype.element_ty
    s = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s = (s + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        s = s.to(tl.float32)
    nw = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (nw * (s * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _norm_rstd(x_ptr, res_ptr, res_out_ptr, eps, K, write, HAS_RES: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """1 / sqrt(mean((x + residual)^2) + eps) over the whole row (x + residual rounded to
    x's dtype first), K ``BLOCK_K`` at a time from L2; where ``write``, x + residual is
    stored to ``res_out_ptr`` on the way (one program does it)."""
    dt = x_ptr.dtype.element_ty
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        s = tl.load(x_ptr + offs).to(tl.float32)
        if HAS_RES:
            s = (s + tl.load(res_ptr + offs).to(tl.float32)).to(dt)
            tl.store(res_out_ptr + offs, s, mask=write)
            s = s.to(tl.float32)
        ss += s * s
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _row_part(w5, c, sf, x_ptr, stride_xm, k0, M, K, m: tl.constexpr, BLOCK_K: tl.constexpr,
              SILU_MUL: tl.constexpr, CHAIN: tl.constexpr, ASM: tl.constexpr):
    """Each word's sum of (q - z) * x[m] over its 8 columns (in a thread's registers),
    times the word's scale ``sf``: [BN, W]. One multiply by the scale per word per row
    rather than one per weight. With CHAIN, w5 is the packed words and c their zero
    points (``_row_chain``; ASM: its inline PTX)."""
    if CHAIN:
        xr = _load_x(x_ptr + m * stride_xm + k0 + tl.arange(0, BLOCK_K), m < M, K, SILU_MUL)
        return _row_chain(w5, c, sf, xr.to(tl.float32), BLOCK_K, ASM)
    else:
        xr = _load_x(x_ptr + m * stride_xm + k0 + tl.arange(0, BLOCK_K), m < M, K, SILU_MUL)
        x5 = tl.reshape(xr.to(tl.float32), (BLOCK_K // 8, 2, 2, 2))
        p = w5 * x5[None, :, :, :, :]
        return tl.sum(tl.sum(tl.sum(p, axis=4), axis=3), axis=2) * sf


@triton.jit
def _rows_part(w5, c, sf, x_ptr, stride_xm, k0, M, K, m0: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, CHAIN: tl.constexpr,
               ASM: tl.constexpr):
    """Rows m0 .. m0 + ROWS - 1 of x against w5: [BN, W, ROWS], the rows stacked by
    tl.join (a new in-thread dimension: no select, no layout conversion)."""
    if ROWS == 1:
        return _row_part(w5, c, sf, x_ptr, stride_xm, k0, M, K, m0, BLOCK_K, SILU_MUL,
                         CHAIN, ASM)[:, :, None]
    elif ROWS == 2:
        return tl.join(
            _row_part(w5, c, sf, x_ptr, stride_xm, k0, M, K, m0, BLOCK_K, SILU_MUL, CHAIN, ASM),
            _row_part(w5, c, sf, x_ptr, stride_xm, k0, M, K, m0 + 1, BLOCK_K, SILU_MUL, CHAIN, ASM))
    else:
        HALF: tl.constexpr = ROWS // 2
        lo = _rows_part(w5, c, sf, x_ptr, stride_xm, k0, M, K, m0, HALF, BLOCK_K, SILU_MUL,
                        CHAIN, ASM)
        hi = _rows_part(w5, c, sf, x_ptr, stride_xm, k0, M, K, m0 + HALF, HALF, BLOCK_K,
                        SILU_MUL, CHAIN, ASM)
        # [BN, W, HALF, 2] -> [BN, W, 2, HALF] -> [BN, W, ROWS]: row m0 + i at index i
        return tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)),
                          (lo.shape[0], lo.shape[1], ROWS))


@triton.jit
def _tile_product(packed, s, z, t, x_ptr, stride_xm, M, K, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                  PRECISION: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr,
                  OFFSET: tl.constexpr, SILU_MUL: tl.constexpr, CHAIN: tl.constexpr,
                  res_ptr, nw_ptr, rstd, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """K tile t's share of the sums: [BLOCK_N, BLOCK_M] on the tensor cores (DOT), else
    per-word partial sums [BLOCK_N, BLOCK_K / 8, BLOCK_M]. NORM (one row, CHAIN): x is
    rmsnorm(x + residual) * weight (``_norm_x``, ``rstd`` the row's)."""
    if NORM:
        offs = t * BLOCK_K + tl.arange(0, BLOCK_K)
        xr = _norm_x(x_ptr, res_ptr, nw_ptr, offs, offs < K, rstd, HAS_RES)
        return _row_chain(packed, z, s.to(tl.float32), xr, BLOCK_K, ASM)[:, :, None]
    elif CHAIN:  # the CUDA cores' FFMA chains (``_row_chain``)
        return _rows_part(packed, z, s.to(tl.float32), x_ptr, stride_xm, t * BLOCK_K, M, K, 0,
                          BLOCK_M, BLOCK_K, SILU_MUL, True, ASM)
    else:
        if ASM:  # q - z in x's dtype, [BN, W, 2, 2, 2]
            w5 = _unpack_words_asm(packed, z, x_ptr.dtype.element_ty, PTX, OFFSET)
        else:  # q - z in fp32
            w5 = _unpack_words(packed, z)
        sf = s.to(tl.float32)
        k0 = t * BLOCK_K
        if DOT:
            offs_k = tl.arange(0, BLOCK_K)
            offs_m = tl.arange(0, BLOCK_M)
            # rows past M load zeros (with SILU_MUL every column's silu(g) * u is computed: a
            # form folding M < 16 rows into fewer columns failed its H200 check, run 175)
            xt = _load_x(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None],
                         (offs_m < M)[None, :], K, SILU_MUL)  # [BK, BLOCK_M]
            # q - z (exact in 16 bits) on tensor cores; the tile lies in one group
            # (the launcher's BLOCK_K divides G), so its scale is one per feature, after
            w = tl.reshape(w5, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
            return tl.dot(w, xt, input_precision=PRECISION) * sf
        else:
            return _rows_part(w5, sf, sf, x_ptr, stride_xm, k0, M, K, 0, BLOCK_M, BLOCK_K,
                              SILU_MUL, False, False)


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, stride_qw,
                      stride_xm, stride_om, stride_os, G: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                      PRECISION: tl.constexpr, PREFETCH: tl.constexpr = 2,
                      ASM: tl.constexpr = False,
                      PTX: tl.constexpr = "", OFFSET: tl.constexpr = 0.0,
                      NUM_STAGES: tl.constexpr = 1, SILU_MUL: tl.constexpr = False,
                      CHAIN: tl.constexpr = False,
                      res_ptr=None, nw_ptr=None, res_out_ptr=None, eps=0.0,
                      NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    # NORM (one row, CHAIN): x is rmsnorm(x + residual) * nw, the norm's statistics computed
    # by every program from the whole row (L2), x + residual written by program (0, 0).
    # PDL: the first weight tiles are requested before the wait (weights are only read),
    # x and everything else after (kernels/pdl.py).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    NG = K // G
    # stride_qw = K / 8 as its own argument: a launch marks it divisible by 16 where it is
    # (K % 128 == 0), so a thread's 4 words load as one 16-byte vector, not two 8-byte ones
    qw_rows = qw_ptr + offs_n[:, None].to(tl.int64) * stride_qw
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * NG
    z_rows = z_ptr + offs_n[:, None].to(tl.int64) * NG
    tiles = K // BLOCK_K
    per_split = tl.cdiv(tiles, SPLIT_K)
    start = pid_k * per_split
    end = tl.minimum(start + per_split, tiles)
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:  # per-word partial sums; the sum over words (across threads) once, at the end
        acc3 = tl.zeros((BLOCK_N, BLOCK_K // 8, BLOCK_M), dtype=tl.float32)
    rstd = 1.0
    if PREFETCH == 0:
        pdl_prologue(PDL)
        if NORM:
            rstd = _norm_rstd(x_ptr, res_ptr, res_out_ptr, eps, K, (pid_n == 0) & (pid_k == 0),
                              HAS_RES, BLOCK_K)
        # Triton's software pipeliner keeps NUM_STAGES - 1 tiles in flight: on sm_90 the
        # loads become cp.async copies into shared memory, issued stages ahead, so the
        # tiles in flight hold no registers (see the module's docstring). The scales and
        # zero points (2 and 1 bytes a feature: too narrow for cp.async, so the pipeliner
        # leaves them a load waited on in its own iteration) go one tile ahead by hand.
        sn, zn = _load_groups(s_rows, z_rows, n_mask, start, end, G, BLOCK_K)
        for t in tl.range(start, end, num_stages=NUM_STAGES):
            offs_w = tl.arange(0, BLOCK_K // 8)
            packed = tl.load(qw_rows + (t * (BLOCK_K // 8) + offs_w)[None, :],
                             mask=n_mask[:, None], other=0)
            s, z = sn, zn
            sn, zn = _load_groups(s_rows, z_rows, n_mask, t + 1, end, G, BLOCK_K)
            part = _tile_product(packed, s, z, t, x_ptr, stride_xm, M, K, BLOCK_M, BLOCK_N,
                                 BLOCK_K, DOT, PRECISION, ASM, PTX, OFFSET, SILU_MUL,
                                 CHAIN, res_ptr, nw_ptr, rstd, NORM, HAS_RES)
            if DOT:
                acc += part
            else:
                acc3 += part
    else:
        # PREFETCH tiles in flight, in registers: tile t + PREFETCH's words are requested
        # before tile t is used (weights are only read). A program's bytes in flight are
        # what hide HBM's latency: one 64 x 128 tile (4 KB) each was too few (prefetch 2
        # won run 171's sweep).
        pa, sa, za = _load_tile(qw_rows, s_rows, z_rows, n_mask, start, end, G, BLOCK_K)
        if PREFETCH >= 2:
            pb, sb, zb = _load_tile(qw_rows, s_rows, z_rows, n_mask, start + 1, end, G, BLOCK_K)
        if PREFETCH >= 3:
            pc, sc, zc = _load_tile(qw_rows, s_rows, z_rows, n_mask, start + 2, end, G, BLOCK_K)
        pdl_prologue(PDL)
        if NORM:
            rstd = _norm_rstd(x_ptr, res_ptr, res_out_ptr, eps, K, (pid_n == 0) & (pid_k == 0),
                              HAS_RES, BLOCK_K)
        for t in range(start, end):
            packed, s, z = pa, sa, za
            if PREFETCH == 1:
                pa, sa, za = _load_tile(qw_rows, s_rows, z_rows, n_mask, t + 1, end, G, BLOCK_K)
            elif PREFETCH == 2:
                pa, sa, za = pb, sb, zb
                pb, sb, zb = _load_tile(qw_rows, s_rows, z_rows, n_mask, t + 2, end, G, BLOCK_K)
            else:
                pa, sa, za = pb, sb, zb
                pb, sb, zb = pc, sc, zc
                pc, sc, zc = _load_tile(qw_rows, s_rows, z_rows, n_mask, t + 3, end, G, BLOCK_K)
            part = _tile_product(packed, s, z, t, x_ptr, stride_xm, M, K, BLOCK_M, BLOCK_N,
                                 BLOCK_K, DOT, PRECISION, ASM, PTX, OFFSET, SILU_MUL,
                                 CHAIN, res_ptr, nw_ptr, rstd, NORM, HAS_RES)
            if DOT:
                acc += part
            else:
                acc3 += part
    if not DOT:
        acc = tl.sum(acc3, axis=1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    out_mask = n_mask[:, None] & m_mask[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out, acc, mask=out_mask)


@triton.jit
def _split_sum_kernel(part_ptr, b_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = sum over the splits of part[split, m, n] (in split order: deterministic)
    + bias[n], in out's dtype: one launch for the sum, the bias and the rounding."""
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + i * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def supports(m: int, k: int, g: int) -> bool:
    """Whether ``int4_gemv`` takes m rows of a K-wide weight in groups of G (any valid
    layout: G a multiple of 8 dividing K; past 16 rows, K tiles the tensor cores take)."""
    if not (1 <= m <= MAX_ROWS and k % PACK == 0 and g % PACK == 0 and k % g == 0):
        return False
    return m <= PAD_ROWS or _block_k(k, g, 128, within_group=True) >= 16


def _split_k(tiles_n: int, k_tiles: int, device: torch.device) -> int:
    """K's split: a power of two leaving each program ~8-16 K tiles (the sweep's best at
    every 8B shape: 4 for K 4096, 8 for K 14336; ~2 programs per SM had left qkv 39% and
    gate_up 6% slower), doubled further while the programs do not cover the SMs (1 off
    the GPU)."""
    if device.type != "cuda":
        return 1
    from flashpage.kernels.device import num_sms

    split = 1
    while split * 2 <= min(8, k_tiles // 8):
        split *= 2
    while tiles_n * split < num_sms(device) and split * 2 <= k_tiles:
        split *= 2
    return split


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor, bias: torch.Tensor | None = None,
              config: Int4GemvConfig | None = None, silu_mul: bool = False, *,
              norm: tuple[torch.Tensor, float] | None = None,
              residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
              pdl: bool | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32, 1 <= M <= 64: past 16 a tensor-core config) @ the int4
    weight -> [M, N] in x's dtype (+ bias [N]); fp32 accumulation. ``silu_mul``: x is an
    MLP's gate/up output [M, 2K] (gate | up, as gemv.gemv_row takes it) and the kernel
    multiplies silu(gate) * up, computed per K tile and rounded as kernels/silu_mul rounds.

    ``norm`` = (weight [K], eps), one row on the chain form only: the input is
    rmsnorm(x + residual) * weight (kernels/rms_norm's rounding, as gemv.gemv_row's
    prologue), and with ``residual`` the sum x + residual is written to ``residual_out``
    [1, K]. ``pdl``: programmatic dependent launch (None: per FLASHPAGE_PDL and the
    device; kernels/pdl.py)."""
    g = check_int4(qweight, scales, zeros)
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    if x.dim() != 2 or x.shape[1] != (2 * k if silu_mul else k):
        what = "an x (gate | up)" if silu_mul else "x"
        raise ValueError(f"{what} {tuple(x.shape)} does not fit a [{n}, {k}] weight")
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"int4_gemv takes 1..{MAX_ROWS} rows, got {m}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] in x's dtype {x.dtype}, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or default_config(m, n, k)
    if norm is not None:
        nw = norm[0]
        if m != 1 or silu_mul or not cfg.chain or cfg.dot:
            raise ValueError(f"norm takes one row (got {m}) on a chain config (got {cfg.name}), "
                             "without silu_mul")
        if nw.shape != (k,) or nw.stride(0) != 1 or nw.dtype != x.dtype:
            raise ValueError(f"norm weight must be contiguous [{k}] in {x.dtype}, got "
                             f"{nw.dtype} {tuple(nw.shape)}")
        if residual is not None and any(
                t is None or t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous()
                for t in (residual, residual_out)):
            raise ValueError("residual and residual_out must be contiguous rows like x")
    elif residual is not None:
        raise ValueError("residual needs norm")
    if not 0 <= cfg.prefetch <= 3:
        raise ValueError(f"prefetch must be 0 (Triton pipelines) or 1, 2, 3 tiles, "
                         f"got {cfg.prefetch}")
    # tensor cores: K tiles inside one group (the scale goes on the dot), 16 wide at least;
    # else (K or G = 8 x odd, or block_n < 16) the CUDA cores, with any tile
    bk_dot = _block_k(k, g, cfg.block_k, within_group=True)
    dot = cfg.dot and bk_dot >= 16 and cfg.block_n >= 16
    bk = bk_dot if dot else _block_k(k, g, cfg.block_k)
    if m > PAD_ROWS and not dot:
        raise ValueError(f"{m} rows (past {PAD_ROWS}) run on the tensor cores only: a dot config "
                         f"with K tiles of 16 at least (K={k}, G={g}, {cfg.name})")
    # inline PTX runs on the GPU only, for 16-bit x (the interpreter takes the plain path)
    asm = dot and cfg.asm and x.dtype in _UNPACK_TYPES and not interpreting()
    chain = cfg.chain and not dot
    if chain:
        asm = not interpreting()  # the nibbles' PTX (fp32 out, whatever x's dtype)
    tiles_n = triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or _split_k(tiles_n, k // bk, x.device)
    split = max(1, min(split, k // bk))
    # PDL only with FLASHPAGE_PDL=all: with it and the norm prologue on, the 8B's batch-1
    # decode lost 15% (run 179; not yet split between the two)
    use_pdl = resolve_pdl(pdl, x.device, in_auto=False)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _int4_gemv_kernel[(tiles_n, split)](
        x, qweight, scales, zeros, bias if bias is not None else x, out, m, n, k,
        qweight.stride(0), x.stride(0), n, m * n, G=g,
        BLOCK_M=max(PAD_ROWS, triton.next_power_of_2(m)) if dot else triton.next_power_of_2(m),
        BLOCK_N=cfg.block_n, BLOCK_K=bk,
        SPLIT_K=split, HAS_BIAS=bias is not None, DOT=dot, PREFETCH=cfg.prefetch,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ASM=asm,
        PTX=_unpack_ptx(x.dtype) if asm and dot else "",
        OFFSET=_UNPACK_TYPES[x.dtype][1] if asm and dot else 0.0, NUM_STAGES=cfg.num_stages,
        SILU_MUL=silu_mul, CHAIN=chain,
        res_ptr=residual if residual is not None else x,
        nw_ptr=norm[0] if norm is not None else x,
        res_out_ptr=residual_out if residual_out is not None else x,
        eps=float(norm[1]) if norm is not None else 0.0, NORM=norm is not None,
        HAS_RES=residual is not None, PDL=use_pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch_kwargs(use_pdl))
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](
            out, bias if bias is not None else out, y, m * n, n, SPLIT_K=split,
            HAS_BIAS=bias is not None, BLOCK=block, PDL=use_pdl, num_warps=4,
            **pdl_launch_kwargs(use_pdl))
    return y
