"""Fused MoE experts for decode-sized batches: only the routed experts' weights are read,
with static shapes and no host sync (CUDA-graph capturable).

Three launches and one torch sum::

    topk_ids [T, K] ──align──► sorted_pairs [R] int32, block_expert [NB] int32
                               (R = NB * BLOCK_M rows, NB static: see num_blocks)

    sorted_pairs, grouped by expert, each expert's run padded to BLOCK_M rows:
      block 0     block 1     block 2          block NB-1
    | e0 e0 e0 · | e3 e3 · · | e5 e5 e5 e5 | … | · · · · |     · = padding (pair id P)
    block_expert:   0           3           5    …   -1 (nothing: the program exits)

    gate_up:  g = x[tok(r)] @ Wgu[e, :I].T (+ bgu[e, :I]),  u = x[tok(r)] @ Wgu[e, I:].T (+ bgu[e, I:])
              act[r, :] = silu(g) * u,  or GPT-OSS's clamped SwiGLU (ClampedSwiGLU)
    down:     y = round(act[r] @ Wd[e].T) (then round(y + bd[e]))
              ys[pair(r)] = round(w[pair(r)] * y)                           fp32 product
    out       = ys.view(T, K, H).sum(1)

A pair is ``t * K + k`` (slot k of token t). Every (block, N-tile) program reads one
tile of its own expert's weights: an expert no token chose owns no block, so its weights
are never read; blocks past the last used one exit before loading anything.

Biases are optional (both or neither: GPT-OSS has both): ``gate_up_bias`` [E, 2I] (gate
half first, as the weight's rows) is added to each projection before the activation,
``down_bias`` [E, H] to the down projection before the routing weight.

Rounding contract (that of ``flashpage.layers.moe.FusedExperts``'s torch paths, which is
transformers'): every step below is rounded to the model dtype, as a torch op on tensors
of that dtype would round it (computed in fp32, rounded once):

- each projection's output (fp32 accumulation, rounded), then its bias added (rounded);
- silu: silu(gate) in fp32 rounded, times ``up`` rounded;
- clamped SwiGLU (transformers' ``GptOssExperts._apply_gate``, step by step): gate
  clamped above at ``limit``, up both ways (rounded: exact for a representable limit),
  ``gate * alpha`` (alpha in fp32), its sigmoid, ``gate * sigmoid`` (glu), ``up + 1``,
  and ``(up + 1) * glu``, each rounded;
- each expert output times its fp32 routing weight, rounded, and the K slots summed by
  torch (``.sum(1)``, as the sync-free path does).

The same math spelled out in torch, one expert at a time: :func:`fused_moe_ref`.

MXFP4 weights (:func:`fused_moe_mxfp4`; GPT-OSS's released experts, models/mxfp4.py): the
same kernels with the constexpr MXFP4 on (the 16-bit launches compile as before), reading
``gate_up`` as uint8 [E, 2I, H / 2] (two e2m1 values a byte along K, the low nibble first:
the checkpoint's [E, 2I, H / 32, 16] blocks flattened) plus uint8 e8m0 scales [E, 2I,
H / 32], ``down`` as [E, H, I / 2] plus [E, H, I / 32]: 4.25 bits a weight, 3.76x fewer
bytes than bf16. Four forms bring a K tile to the tensor cores (MXFP4_FORMS; default_config
picks "scaled" for bf16, "tile" otherwise):

- "tile" (any dtype): the tile is loaded as bytes, split into nibbles, built exactly in fp32
  (value times 2 ** (scale - 127)), rounded once to the activation dtype, and fed to the
  same tl.dot as the 16-bit path. So the result equals, bit for bit, :func:`fused_moe` on
  the weights dequantized to the activation dtype (models/mxfp4.dequantize_mxfp4 rounds the
  same fp32 product once) wherever the two kernels' tl.dot orders agree (always in the
  interpreter; on the GPU the same MMA instructions over the same tiles).
- "scaled" (bf16): tl.dot_scaled(x, None, "bf16", bytes, scales, "e2m1", fast_math=True):
  Hopper has no MX MMA, so the compiler upcasts the nibbles to bf16 (byte permutes) and
  multiplies by the scale in bf16 (exact while the product is a normal bf16: every scale
  of a real checkpoint), then runs bf16 MMAs (wgmma); fast_math: no NaN for scale 255.
  Its sums need not take the 16-bit kernel's order (another MMA), so it equals the
  dequantized path within fp32 accumulation order, not bit for bit; 1.5-2.6x faster than
  "tile" at gpt-oss-20b's shape on the H200 (run 191), level with the bf16 kernel.
- "swap" (any dtype; decode sizes: a few rows per expert): the weight tile is wgmma's first
  operand (out^T = W . x^T, the block's rows the MMA's N), loaded as 32-bit words, one scale
  group (16 bytes) of a row a thread, and decoded in place into the A fragment: rows and K
  are ordered (wgmma_a_rows, _swap_x) so each thread's word is its own share of the fragment,
  and no value passes through shared memory. bf16 on the GPU: inline PTX, 5 instructions a
  pair of weights (mask, multiply to place sign and magnitude, mask, two packed multiplies:
  by 2 ** 126, then by the scale), each exact, so the weights equal dequantize_mxfp4's bf16
  ones; fp16 / fp32 / the interpreter: _e2m1's fp32 product rounded once, the same values.
  K tiles of 128, block_n a multiple of 64; sums in another order than the 16-bit kernel's
  (within accumulation order of it). Its K loop compiled for sm_90a: 3.6-4.2 SASS
  instructions a weight and thread unpipelined (gate_up 478 for 2 x 64 x 128 weights) against
  "scaled"'s 6.4-7.3 and "tile"'s 14.6-15.7 (tests/kernels/test_fused_moe_mxfp4_swap.py);
  not yet timed on a GPU.
- "swap_scaled" (bf16): tl.dot_scaled in the swapped orientation (the compiler's upcast
  into the A fragment): 6.0-6.7 instructions a weight.

The dequantized weights themselves are exact where the scale is in the dtype's range:

- bf16 (fp32's exponent range, 8 bits of mantissa; e2m1 needs 2): exact for scales 0-253
  (scale 0 is 2 ** -127, an fp32 subnormal, and 0.5 / 1.5 times it bf16 subnormals), and at
  254 for magnitudes up to 1.5; 2 * 2 ** 127 and above overflow to inf, as dequantizing does.
  255 (NaN in the OCP spec) reads as inf (zeros as NaN), as dequantizing does. A GPU that
  flushed fp32 subnormals would zero the weights of scales 0 (and 1 times 0.5): below
  3e-38, against GPT-OSS's scales of ~2 ** -7 (real scales lie well inside 117-137);
- fp16 (5 exponent bits): exact for scales 104-140 (0.5 * 2 ** -23 is its smallest
  subnormal, 6 * 2 ** 13 = 49152 < 65504); outside, the fp32 value rounds once to fp16
  (subnormals, zero, or inf past 65504) exactly as dequantize_mxfp4(..., fp16) rounds it,
  and as the dequantize-at-load path (fp32, then copied into the fp16 parameter) does, so
  fp16 models run the MXFP4 kernel too; their results match the dequantized path's;
- fp32 (the interpreter's tests): exact for every scale.

``block_k`` must be a multiple of 32 (a scale's group) and H, I multiples of 32.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels.flash_prefill import _dot  # tl.dot, in IEEE fp32 when asked
from flashpage.kernels.tiles import moe_block, wgmma_a_rows

# An MXFP4 K tile into the tensor cores (kernel constexpr MXFP4 = 1 + the index; 0: 16-bit
# weights): "tile": our decode (_mxfp4_tile: nibbles interleaved back into K order, each
# value built in fp32, rounded to x's dtype) and tl.dot, any dtype; "scaled": tl.dot_scaled,
# bf16 x only (the compiler's e2m1 upcast, by byte permutes, and the scale applied in bf16;
# Hopper has no MX MMA), 1.5-2.6x faster than "tile" on the H200 (run 191). A form dotting
# the even and odd K rows apart (no interleave) was slower than both (run 191). "swap": the
# weights as wgmma's first operand, decoded from 32-bit words in its register fragment
# (_swap_w), any dtype; "swap_scaled": tl.dot_scaled in that orientation, bf16 (the module
# docstring).
MXFP4_FORMS = ("tile", "scaled", "swap", "swap_scaled")


@dataclass(frozen=True)
class FusedMoEConfig:
    block_m: int = 16  # rows (token, slot pairs) per block; tl.dot needs >= 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    # MXFP4 weights only (MXFP4_FORMS): how a K tile's nibbles reach the tensor cores
    mxfp4_form: str = "tile"

    def __post_init__(self) -> None:
        if self.mxfp4_form not in MXFP4_FORMS:
            raise ValueError(f"mxfp4_form must be one of {', '.join(MXFP4_FORMS)}; got "
                             f"{self.mxfp4_form!r}")

    @property
    def name(self) -> str:
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} "
                f"w{self.num_warps} s{self.num_stages}")


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's activation: (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = gate.clamp(max=limit) (``limit`` may be inf: no clamp)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if not (self.limit > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"ClampedSwiGLU needs limit > 0 (inf: no clamp) and a finite "
                             f"alpha; got limit={self.limit}, alpha={self.alpha}")


def default_config(num_pairs: int, num_experts: int,
                   mxfp4: torch.dtype | None = None) -> FusedMoEConfig:
    """By shape only: rows per block near the mean pairs per expert (each block reads its
    expert's weights once, so fewer, fuller blocks mean less weight traffic). ``mxfp4``:
    MXFP4 weights under activations of that dtype: for bf16 "swap" (its inline-PTX decode)
    while the mean is at most 16 pairs an expert, 16 rows a block and 3 stages up to 8, 32
    rows and 1 stage up to 16 (run 196 at gpt-oss-20b's shape: 1.24-1.30x "scaled"'s speed
    at 8-128 tokens, 1.48-1.53x the bf16 kernel's at 8-64), past that "scaled" with rows
    per block near twice the mean (each block upcasts its expert's weights anew: at 128
    tokens 32 rows took 379 us against 16 rows' 454, run 192; level with swap's best at
    512 tokens, run 196); other dtypes "tile" at 32 columns a tile (its fastest of the
    tiles run 191 timed at gpt-oss-20b's shape)."""
    mean = triton.cdiv(max(num_pairs, 1), num_experts)
    cfg = FusedMoEConfig(block_m=min(64, max(16, triton.next_power_of_2(mean))))
    if mxfp4 == torch.bfloat16 and mean <= 16:
        return FusedMoEConfig(block_m=16 if mean <= 8 else 32, block_n=64, block_k=128,
                              num_stages=3 if mean <= 8 else 1, mxfp4_form="swap")
    if mxfp4 == torch.bfloat16:
        return dataclasses.replace(cfg, mxfp4_form="scaled",
                                   block_m=min(64, max(16, triton.next_power_of_2(2 * mean))))
    if mxfp4 is not None:
        return dataclasses.replace(cfg, block_n=32)
    return cfg


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case block count, from shapes alone: each used expert (at most
    min(E, pairs)) pads its run by at most block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


# ------------------------------------------------------------------------- alignment
@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts,
                  num_rows, num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program. Pair p goes to row start[e] + (pairs of expert e before p), where
    start[e] is the sum of the earlier experts' counts rounded up to BLOCK_M."""
    experts = tl.arange(0, BLOCK_E)
    # 1. pairs per expert
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=BLOCK_E).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)  # inclusive: expert e owns [end - blocks, end)
    start = (block_end - blocks) * BLOCK_M
    # 2. each block's expert (-1 past the used ones); every row padding for now
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        done = (block_end[None, :] <= b[:, None]) & (experts[None, :] < num_experts)
        e = tl.sum(done.to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(e < num_experts, e, -1), mask=b < num_blocks)
    for r0 in range(0, num_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        tl.store(sorted_ptr + r, tl.full([BLOCK_R], 0, tl.int32) + num_pairs, mask=r < num_rows)
    tl.debug_barrier()  # the padding stores above land before the pair stores below
    # 3. place the pairs, in pair order within an expert
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        valid = offs < num_pairs
        ids = tl.load(ids_ptr + offs, mask=valid, other=BLOCK_E).to(tl.int32)
        hot = (ids[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - 1 + seen[None, :] + start[None, :]
        row = tl.sum(hot * before, axis=1)
        tl.store(sorted_ptr + row, offs.to(tl.int32), mask=valid)
        seen += tl.sum(hot, axis=0)


# Up to this many (token, expert) pairs the alignment sizes its tiles to the work.
SMALL_ALIGN_PAIRS = 64


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] (ids in 0..E-1) -> (sorted_pairs int32 [NB * block_m],
    block_expert int32 [NB]), NB = num_blocks(T * K, E, block_m).

    sorted_pairs holds pair ids ``t * K + k`` grouped by expert, each expert's run
    starting at a multiple of block_m; padding rows hold T * K. block_expert[b] is the
    expert of rows [b * block_m, (b + 1) * block_m), or -1 for a block past the used ones.
    """
    num_pairs = topk_ids.numel()
    nb = num_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(nb * block_m, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=topk_ids.device)
    if nb == 0:
        return sorted_pairs, block_expert
    block_e = triton.next_power_of_2(num_experts)
    block_p, block_b = max(16, 8192 // block_e), 256
    if num_pairs <= SMALL_ALIGN_PAIRS:
        # Decode batches of a few tokens: tiles no larger than the work. The [pairs x
        # experts] and [blocks x experts] tiles are the kernel's cost; at 128 x 64 and
        # 256 x 64 one token's alignment (6 pairs, 6 blocks) took 21 us on an H200. Few
        # variants (one per graph bucket of <= 64 pairs), so nothing compiles mid-run.
        block_p = min(block_p, _pow2_at_least_16(num_pairs))
        block_b = _pow2_at_least_16(nb)
    _align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_pairs, block_expert, num_pairs, num_experts,
        nb * block_m, nb, BLOCK_M=block_m, BLOCK_E=block_e,
        BLOCK_P=block_p, BLOCK_B=block_b, BLOCK_R=256, num_warps=4)
    return sorted_pairs, block_expert


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch moe_align (same outputs, element for element)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    nb = num_blocks(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    start = (block_end - blocks) * block_m
    order = flat.argsort(stable=True)
    first = counts.cumsum(0) - counts  # first sorted position of each expert
    rank = torch.arange(num_pairs, device=flat.device) - first[flat[order]]
    sorted_pairs = torch.full((nb * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[start[flat[order]] + rank] = order.int()
    e = torch.searchsorted(block_end, torch.arange(nb, device=flat.device), right=True)
    return sorted_pairs, torch.where(e < num_experts, e, -1).int()


# ------------------------------------------------------------------------- grouped GEMMs
@triton.jit
def _e2m1(nib, scale, dt: tl.constexpr):
    """e2m1 codes ``nib`` (uint32 0-15) times fp32 ``scale`` (same shape), rounded once to
    ``dt``. Each value is built exactly in fp32 from its bits: magnitude codes 2-7 are
    1, 1.5, ..., 6 (exponent e + 126, the mantissa bit under it: bits (mag << 22) +
    (126 << 23)), 1 is 0.5 and 0 zero (the subnormal codes), the sign bit 3 moved to 31."""
    mag = nib & 7
    bits = tl.where(mag < 2, mag * (126 << 23), (mag << 22) + (126 << 23)) | ((nib & 8) << 28)
    return (bits.to(tl.float32, bitcast=True) * scale).to(dt)


@triton.jit
def _e8m0(sc):
    """e8m0 scale bytes -> fp32 2 ** (s - 127) from its bits (s << 23; s = 0: 2 ** -127, the
    fp32 subnormal 1 << 22; s = 255: inf)."""
    sc = sc.to(tl.uint32)
    return tl.where(sc == 0, 1 << 22, sc << 23).to(tl.float32, bitcast=True)


# Form "swap"'s decode of a 32-bit word (8 e2m1 nibbles, nibble m at bits 4m) to bf16 in
# packed registers: nibbles m and m + 4 sit 16 bits apart, so one mask keeps both of a pair,
# one multiply (v * 0x1040 = v << 12 | v << 6, disjoint for v < 16; the high nibble of a
# byte v * 0x104) puts each sign at bit 15 and its e1 e0 m at bits 8-6, where bf16's
# exponent ends and its mantissa starts: read as bf16 that is the e2m1 value times 2 ** -126
# (the code 0.5 a subnormal, as e2m1's own), so a packed multiply by 2 ** 126 gives the
# value and one by the scale (bf16 2 ** (s - 127), $9) the weight, each exact (powers of
# two; past bf16's range inf, as dequantizing gives). Out: $0..$7 = nibbles 0 4, 1 5, 2 6,
# 3 7, each pair the halves of one register (ptxas keeps them there: no repacking).
_E2M1_WORD_BF16_PTX = tl.constexpr("""{
.reg .b32 w8, t, m, sc;
mov.b32 m, 0x7E807E80;
mov.b32 sc, {$9, $9};
shr.b32 w8, $8, 8;
and.b32 t, $8, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, m; mul.rn.bf16x2 t, t, sc; mov.b32 {$0, $1}, t;
and.b32 t, $8, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, m; mul.rn.bf16x2 t, t, sc; mov.b32 {$2, $3}, t;
and.b32 t, w8, 0x000F000F; mul.lo.u32 t, t, 0x1040; and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, m; mul.rn.bf16x2 t, t, sc; mov.b32 {$4, $5}, t;
and.b32 t, w8, 0x00F000F0; mul.lo.u32 t, t, 0x104; and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, m; mul.rn.bf16x2 t, t, sc; mov.b32 {$6, $7}, t;
}""")


@triton.jit
def _e2m1_word(word, scale, dt: tl.constexpr, ASM: tl.constexpr):
    """int32 words (8 e2m1 nibbles, nibble m at bits 4m) and their fp32 scales (same shape)
    -> 8 tensors in ``dt``: the weights of nibbles 0, 4, 1, 5, 2, 6, 3, 7. ASM (bf16 on the
    GPU): _E2M1_WORD_BF16_PTX, 5 instructions a pair; otherwise _e2m1's (the scale's bf16
    value: the same bits)."""
    if ASM:
        return tl.inline_asm_elementwise(
            _E2M1_WORD_BF16_PTX.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [word, scale.to(dt)],
            dtype=(dt.value,) * 8, is_pure=True, pack=1)
    else:
        w = word.to(tl.uint32, bitcast=True)
        return (_e2m1(w & 0xF, scale, dt), _e2m1((w >> 16) & 0xF, scale, dt),
                _e2m1((w >> 4) & 0xF, scale, dt), _e2m1((w >> 20) & 0xF, scale, dt),
                _e2m1((w >> 8) & 0xF, scale, dt), _e2m1((w >> 24) & 0xF, scale, dt),
                _e2m1((w >> 12) & 0xF, scale, dt), _e2m1((w >> 28) & 0xF, scale, dt))


@triton.jit
def _swap_x(a_col, avalid, k0, kmax):
    """a[:, k0:k0 + 128].T [128, BM] with K in the order _swap_w's weights take: natural K
    32q + 8u + 4h + r (group q, word u, nibble r + 4h) at k' = 32u + 8r + 2q + h."""
    kk = k0 + tl.arange(0, 128)
    a = tl.load(a_col + kk[:, None], mask=avalid[None, :] & (kk < kmax)[:, None], other=0.0)
    bm: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.reshape(a, (4, 4, 2, 4, bm)), (1, 3, 0, 2, 4)), (128, bm))


@triton.jit
def _swap_w(w_rowp, s_rowp, mask_r, k0, kmax, BLOCK_N: tl.constexpr, dt: tl.constexpr,
            ASM: tl.constexpr):
    """Form "swap": the weights W[:, k0:k0 + 128] [BN, 128] (the MMA's first operand), rows
    in channel order, K in _swap_x's order. ``w_rowp`` [BN, 1] the rows' byte pointers in
    load order (tiles.wgmma_a_rows), ``s_rowp`` [BN, 1] their scales', ``mask_r`` [BN, 1] the real
    rows. Each thread loads 16 bytes a row (four words: one scale group) and decodes them
    in place: the 8 values of a word are its quad's share of wgmma's A fragment, so with the
    rows and K ordered so no value moves between threads (the word load's layout is the
    fragment's up to register order: measured on sm_90, tests/kernels/
    test_fused_moe_mxfp4_swap.py), no shared-memory round trip."""
    offs_w = tl.arange(0, 16)  # words of the tile's 64 bytes a row
    word = tl.load(w_rowp.to(tl.pointer_type(tl.int32), bitcast=True) + k0 // 8 + offs_w[None, :],
                   mask=mask_r & (k0 // 8 + offs_w < kmax // 8)[None, :], other=0)  # [BN, 16]
    offs_g = k0 // 32 + tl.arange(0, 4)
    sc = tl.load(s_rowp + offs_g[None, :], mask=mask_r & (offs_g < kmax // 32)[None, :], other=0)
    sc = _e8m0(tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, 4, 4)), (BLOCK_N, 16)))
    o0, o1, o2, o3, o4, o5, o6, o7 = _e2m1_word(word, sc, dt, ASM)
    return _swap_tile(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_N)


@triton.jit
def _swap_tile(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_N: tl.constexpr):
    """The "swap" forms' A operand [BN, 128] (rows in channel order, K in _swap_x's) from
    a tile's decoded words: o_{2r + h} [BN, 16] the values of nibble r + 4h (natural K
    8u + r + 4h of word u) of each row's 16 words, rows in load order (tiles.wgmma_a_rows). Only
    register moves: each thread's values are already its share of wgmma's A fragment."""
    # o_{2r + h} [BN, 16 = (q, u)]: natural K 32q + 8u + r + 4h -> k' = 32u + 8r + 2q + h
    j0 = tl.join(tl.reshape(o0, (BLOCK_N, 4, 4)), tl.reshape(o1, (BLOCK_N, 4, 4)))
    j1 = tl.join(tl.reshape(o2, (BLOCK_N, 4, 4)), tl.reshape(o3, (BLOCK_N, 4, 4)))
    j2 = tl.join(tl.reshape(o4, (BLOCK_N, 4, 4)), tl.reshape(o5, (BLOCK_N, 4, 4)))
    j3 = tl.join(tl.reshape(o6, (BLOCK_N, 4, 4)), tl.reshape(o7, (BLOCK_N, 4, 4)))
    jj = tl.join(tl.join(j0, j1), tl.join(j2, j3))  # [BN, q, u, h, r % 2, r // 2]
    w = tl.reshape(tl.permute(jj, (0, 2, 5, 4, 1, 3)), (BLOCK_N, 128))
    # rows back to channel order: load row 32j + 8w + l is channel 64(j // 2) + 16w + 8(j % 2) + l
    return tl.reshape(tl.permute(tl.reshape(w, (BLOCK_N // 64, 2, 4, 8, 128)), (0, 2, 1, 3, 4)),
                      (BLOCK_N, 128))


@triton.jit
def _mxfp4_swap_scaled_dot(acc, a_col, avalid, w_row, s_row, mask_n, k0, kmax,
                           BLOCK_K: tl.constexpr):
    """Form "swap_scaled" (bf16): acc [BN, BM] (the output transposed) += W[:, k0:k0 + BK]
    @ a[:, k0:k0 + BK].T by tl.dot_scaled with the weights its first operand. ``a_col``
    [1, BM] pointers to the rows of a (``avalid`` [BM] the real ones), ``w_row`` [BN, 1] to
    the N rows' bytes, ``s_row`` [BN] to their scales, ``kmax`` K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_col + offs_k[:, None], mask=avalid[None, :] & (offs_k < kmax)[:, None],
                other=0.0)  # [BK, BM]
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(w_row + offs_kb[None, :],
                   mask=mask_n[:, None] & (offs_kb < kmax // 2)[None, :], other=0)
    offs_ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sc = tl.load(s_row[:, None] + offs_ks[None, :],
                 mask=mask_n[:, None] & (offs_ks < kmax // 32)[None, :], other=0)
    return tl.dot_scaled(byte, sc, "e2m1", a, None, "bf16", acc, fast_math=True)


@triton.jit
def _mxfp4_tile(b_ptrs, s_ptrs, bmask, smask, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                dt: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile in ``dt`` from MXFP4 (form "tile"): ``b_ptrs``
    [BLOCK_K / 2, BLOCK_N] bytes (K contiguous; the low nibble the even row), ``s_ptrs``
    [BLOCK_K / 32, BLOCK_N] the e8m0 scales of the tile's 32-row groups (broadcast over
    their rows); each value _e2m1's: what models/mxfp4.dequantize_mxfp4 computes."""
    byte = tl.load(b_ptrs, mask=bmask, other=0)
    nib = tl.reshape(tl.permute(tl.join(byte & 0xF, byte >> 4), (0, 2, 1)),
                     (BLOCK_K, BLOCK_N)).to(tl.uint32)
    scale = _e8m0(tl.load(s_ptrs, mask=smask, other=0))
    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 32, BLOCK_N)),
                       (BLOCK_K, BLOCK_N))
    return _e2m1(nib, scale, dt)


@triton.jit
def _mxfp4_dot(acc, a_row, avalid, w_col, s_col, s_row, mask_n, k0, kmax,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
               MXFP4: tl.constexpr):
    """acc [BM, BN] += a[:, k0:k0 + BK] @ W[k0:k0 + BK, :] for MXFP4 W: ``a_row`` [BM, 1]
    pointers to the rows of a (``avalid`` [BM] the real ones), ``w_col`` [1, BN] to the N
    columns' bytes (K / 2 of them, contiguous), ``s_col`` [1, BN] and ``s_row`` [BN, 1] to
    their scales (K / 32), ``kmax`` K. MXFP4 = 1 + the MXFP4_FORMS index."""
    dt = a_row.dtype.element_ty
    offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # bytes
    offs_ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # scale groups
    kb_ok = offs_kb < kmax // 2
    ks_ok = offs_ks < kmax // 32
    bmask = kb_ok[:, None] & mask_n[None, :]
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_row + offs_k[None, :], mask=avalid[:, None] & (offs_k < kmax)[None, :],
                other=0.0)
    if MXFP4 == 2:  # scaled: [BK / 2, BN] bytes, [BN, BK / 32] scales
        byte = tl.load(w_col + offs_kb[:, None], mask=bmask, other=0)
        sc = tl.load(s_row + offs_ks[None, :], mask=mask_n[:, None] & ks_ok[None, :], other=0)
        acc = tl.dot_scaled(a, None, "bf16", byte, sc, "e2m1", acc, fast_math=True)
    else:  # tile
        w = _mxfp4_tile(w_col + offs_kb[:, None], s_col + offs_ks[:, None], bmask,
                        ks_ok[:, None] & mask_n[None, :], BLOCK_K, BLOCK_N, dt)
        acc = _dot(a, w, acc, IEEE)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, act_ptr, sorted_ptr, block_expert_ptr,
                    num_pairs, top_k, hidden, inter, stride_xt, stride_we, stride_wn, stride_se,
                    stride_sn, stride_be, stride_ar, alpha, limit,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr,
                    MXFP4: tl.constexpr, ASM: tl.constexpr):
    """act[r, n-tile] = activation(gate (+ bias), up (+ bias)) for the BLOCK_M rows of one
    block: silu(gate) * up, or with CLAMPED_SWIGLU GPT-OSS's (ClampedSwiGLU). MXFP4: w_ptr
    holds e2m1 nibble pairs [E, 2I, H / 2] and s_ptr e8m0 scales [E, 2I, H / 32]
    (MXFP4 = 1 + the MXFP4_FORMS index: _mxfp4_dot; "swap": _swap_w, ASM its inline PTX;
    "swap_scaled": _mxfp4_swap_scaled_dot); otherwise w_ptr the 16-bit weights [E, 2I, H]
    (s_ptr unread)."""
    expert = tl.load(block_expert_ptr + tl.program_id(1))
    if expert < 0:  # a padding block (moe_align)
        return
    pid_n, rows, pair, valid, token = moe_block(sorted_ptr, num_pairs, top_k, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    dt = act_ptr.dtype.element_ty
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4 == 3:  # swap: the accumulators transposed, [BN, BM]; K steps of 128
        arow = wgmma_a_rows(pid_n, BLOCK_N)
        w_rowp = w_base + arow[:, None].to(tl.int64) * stride_wn  # gate rows, load order
        s_rowp = s_ptr + expert.to(tl.int64) * stride_se + arow[:, None].to(tl.int64) * stride_sn
        mask_r = (arow < inter)[:, None]
        a_col = x_ptr + token[None, :] * stride_xt
        acc_gt = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_ut = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, hidden, 128):
            a = _swap_x(a_col, valid, k0, hidden)
            acc_gt = _dot(_swap_w(w_rowp, s_rowp, mask_r, k0, hidden, BLOCK_N, dt, ASM), a,
                          acc_gt, IEEE)
            acc_ut = _dot(_swap_w(w_rowp + inter * stride_wn, s_rowp + inter * stride_sn, mask_r,
                                  k0, hidden, BLOCK_N, dt, ASM), a, acc_ut, IEEE)
        acc_g = tl.trans(acc_gt)
        acc_u = tl.trans(acc_ut)
    elif MXFP4 == 4:  # swap_scaled: the accumulators transposed
        w_row = w_base + offs_n[:, None].to(tl.int64) * stride_wn
        s_row = s_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn
        a_col = x_ptr + token[None, :] * stride_xt
        acc_gt = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_ut = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            acc_gt = _mxfp4_swap_scaled_dot(acc_gt, a_col, valid, w_row, s_row, mask_n, k0,
                                            hidden, BLOCK_K)
            acc_ut = _mxfp4_swap_scaled_dot(acc_ut, a_col, valid, w_row + inter * stride_wn,
                                            s_row + inter * stride_sn, mask_n, k0, hidden,
                                            BLOCK_K)
        acc_g = tl.trans(acc_gt)
        acc_u = tl.trans(acc_ut)
    elif MXFP4:
        w_col = w_base + offs_n[None, :].to(tl.int64) * stride_wn  # [1, BN]: gate rows
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        s_col = s_base + offs_n[None, :].to(tl.int64) * stride_sn
        s_row = s_base + offs_n[:, None].to(tl.int64) * stride_sn
        a_row = x_ptr + token[:, None] * stride_xt
        for k0 in range(0, hidden, BLOCK_K):
            acc_g = _mxfp4_dot(acc_g, a_row, valid, w_col, s_col, s_row, mask_n, k0, hidden,
                               BLOCK_K, BLOCK_N, IEEE, MXFP4)
            acc_u = _mxfp4_dot(acc_u, a_row, valid, w_col + inter * stride_wn,
                               s_col + inter * stride_sn, s_row + inter * stride_sn, mask_n, k0,
                               hidden, BLOCK_K, BLOCK_N, IEEE, MXFP4)
    else:
        gate_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
        up_ptrs = gate_ptrs + inter * stride_wn
        x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]  # [BM, BK]
        for k0 in range(0, hidden, BLOCK_K):
            mask_k = offs_k < hidden - k0
            a = tl.load(x_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
            wmask = mask_k[:, None] & mask_n[None, :]
            wg = tl.load(gate_ptrs, mask=wmask, other=0.0)
            wu = tl.load(up_ptrs, mask=wmask, other=0.0)
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
            acc_g = _dot(a, wg, acc_g, IEEE)
            acc_u = _dot(a, wu, acc_u, IEEE)
            x_ptrs += BLOCK_K
    g = acc_g.to(dt).to(tl.float32)  # each projection output in the model dtype
    u = acc_u.to(dt).to(tl.float32)
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + offs_n
        g = (g + tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        u = (u + tl.load(b_ptrs + inter, mask=mask_n, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    if CLAMPED_SWIGLU:
        g = tl.minimum(g, limit).to(dt).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit).to(dt).to(tl.float32)
        ga = (g * alpha).to(dt).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-ga))).to(dt).to(tl.float32)
        glu = (g * sig).to(dt).to(tl.float32)
        act = (u + 1.0).to(dt).to(tl.float32) * glu
    else:
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u
    out_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_ar + offs_n[None, :]
    tl.store(out_ptrs, act.to(dt), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, bias_ptr, topk_w_ptr, ys_ptr, sorted_ptr,
                 block_expert_ptr, num_pairs, hidden, inter, stride_ar, stride_we, stride_wn,
                 stride_se, stride_sn, stride_be, stride_yp,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr,
                 ASM: tl.constexpr):
    """ys[pair, n-tile] = round(topk_weight[pair] * round(round(act[r] @ down[e].T) + bias))
    (no bias: the inner rounding alone). MXFP4: w_ptr [E, H, I / 2] nibble pairs, s_ptr
    [E, H, I / 32] scales, as _gate_up_kernel's."""
    # tiles.moe_block's prologue written out: inlined, its debug scope changes how ptxas
    # schedules this kernel's "swap_scaled" loop (moe_block's docstring)
    pid_n = tl.program_id(0)
    blk = tl.program_id(1)
    expert = tl.load(block_expert_ptr + blk)
    if expert < 0:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    dt = ys_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4 == 3:  # swap: the accumulator transposed, [BN, BM]; K steps of 128
        arow = wgmma_a_rows(pid_n, BLOCK_N)
        w_rowp = w_ptr + expert.to(tl.int64) * stride_we + arow[:, None].to(tl.int64) * stride_wn
        s_rowp = s_ptr + expert.to(tl.int64) * stride_se + arow[:, None].to(tl.int64) * stride_sn
        mask_r = (arow < hidden)[:, None]
        a_col = act_ptr + rows[None, :].to(tl.int64) * stride_ar
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, inter, 128):
            acc_t = _dot(_swap_w(w_rowp, s_rowp, mask_r, k0, inter, BLOCK_N, dt, ASM),
                         _swap_x(a_col, valid, k0, inter), acc_t, IEEE)
        acc = tl.trans(acc_t)
    elif MXFP4 == 4:  # swap_scaled: the accumulator transposed
        w_row = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
        s_row = s_ptr + expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn
        a_col = act_ptr + rows[None, :].to(tl.int64) * stride_ar
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            acc_t = _mxfp4_swap_scaled_dot(acc_t, a_col, valid, w_row, s_row, mask_n, k0, inter,
                                           BLOCK_K)
        acc = tl.trans(acc_t)
    elif MXFP4:
        w_col = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
        s_base = s_ptr + expert.to(tl.int64) * stride_se
        a_row = act_ptr + rows[:, None].to(tl.int64) * stride_ar
        for k0 in range(0, inter, BLOCK_K):
            acc = _mxfp4_dot(acc, a_row, valid, w_col,
                             s_base + offs_n[None, :].to(tl.int64) * stride_sn,
                             s_base + offs_n[:, None].to(tl.int64) * stride_sn, mask_n, k0, inter,
                             BLOCK_K, BLOCK_N, IEEE, MXFP4)
    else:
        w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we
                  + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None])  # [BK, BN]
        a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_ar + offs_k[None, :]  # [BM, BK]
        for k0 in range(0, inter, BLOCK_K):
            mask_k = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = _dot(a, w, acc, IEEE)
            w_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
    scale = tl.load(topk_w_ptr + pair, mask=valid, other=0.0)
    y = acc.to(dt).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=mask_n, other=0.0)
        y = (y + bias.to(tl.float32)[None, :]).to(dt).to(tl.float32)
    y = y * scale[:, None]
    out_ptrs = ys_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_yp + offs_n[None, :]
    tl.store(out_ptrs, y.to(dt), mask=valid[:, None] & mask_n[None, :])


def _check_routing(x: torch.Tensor, e: int, two_i: int, h: int, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None,
                   down_bias: torch.Tensor | None) -> None:
    """What both weight formats share: x [T, H], the routing, the biases."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must be [T, K] with T = {x.shape[0]}; got "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32, got {topk_weights.dtype}")
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError("gate_up_bias and down_bias: give both or neither")
    if gate_up_bias is not None and down_bias is not None:
        if gate_up_bias.shape != (e, two_i) or down_bias.shape != (e, h):
            raise ValueError(f"gate_up_bias must be [E, 2I] = {(e, two_i)} and down_bias [E, H] = "
                             f"{(e, h)}; got {tuple(gate_up_bias.shape)}, {tuple(down_bias.shape)}")
        if not (gate_up_bias.dtype == down_bias.dtype == x.dtype):
            raise ValueError(f"the biases must have x's dtype ({x.dtype}); got "
                             f"{gate_up_bias.dtype}, {down_bias.dtype}")


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None,
           down_bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"x must be [T, H], gate_up [E, 2I, H], down [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    e, two_i, h = gate_up.shape
    if two_i % 2 or x.shape[1] != h or down.shape != (e, h, two_i // 2):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)}")
    if not (x.dtype == gate_up.dtype == down.dtype):
        raise ValueError(f"x, gate_up, down must share a dtype: {x.dtype}, {gate_up.dtype}, {down.dtype}")
    _check_routing(x, e, two_i, h, topk_ids, topk_weights, gate_up_bias, down_bias)


def _check_mxfp4(x: torch.Tensor, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                 down_blocks: torch.Tensor, down_scales: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, gate_up_bias: torch.Tensor | None,
                 down_bias: torch.Tensor | None) -> tuple[int, int, int]:
    """-> (E, 2I, H) of MXFP4 weights in the kernel's layout (fused_moe_mxfp4)."""
    tensors = (gate_up_blocks, gate_up_scales, down_blocks, down_scales)
    if x.dim() != 2 or any(t.dim() != 3 for t in tensors):
        raise ValueError(f"x must be [T, H], the MXFP4 blocks and scales 3-D; got x "
                         f"{tuple(x.shape)}, " + ", ".join(str(tuple(t.shape)) for t in tensors))
    if any(t.dtype != torch.uint8 for t in tensors):
        raise ValueError("MXFP4 blocks and scales must be uint8; got "
                         + ", ".join(str(t.dtype) for t in tensors))
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32, fp16 or bf16 for MXFP4 weights, got {x.dtype}")
    e, two_i, half_h = gate_up_blocks.shape
    h, inter = 2 * half_h, two_i // 2
    want = {"gate_up_blocks": (e, two_i, h // 2), "gate_up_scales": (e, two_i, h // 32),
            "down_blocks": (e, h, inter // 2), "down_scales": (e, h, inter // 32)}
    if (two_i % 2 or h % 32 or inter % 32 or x.shape[1] != h
            or [tuple(t.shape) for t in tensors] != list(want.values())):
        raise ValueError(f"MXFP4 shapes disagree with x {tuple(x.shape)} (H = {x.shape[1]}, H and "
                         f"I multiples of 32): want {want}, got "
                         + ", ".join(str(tuple(t.shape)) for t in tensors))
    _check_routing(x, e, two_i, h, topk_ids, topk_weights, gate_up_bias, down_bias)
    return e, two_i, h


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (uint8 blocks) readable as 32-bit words: 4-byte aligned, every stride too."""
    aligned = t.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:-1])
    return t if aligned else t.contiguous().clone()


def _launch(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
            down: torch.Tensor, down_scales: torch.Tensor, e: int, two_i: int, h: int,
            topk_ids: torch.Tensor, topk_weights: torch.Tensor, config: FusedMoEConfig | None,
            gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
            activation: ClampedSwiGLU | None, mxfp4: bool) -> torch.Tensor:
    """The alignment and the two grouped GEMMs, for checked arguments (scales: the weights
    themselves, never read, when not ``mxfp4``)."""
    t, k = topk_ids.shape
    inter = two_i // 2
    num_pairs = t * k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_pairs, e, x.dtype if mxfp4 else None)
    if mxfp4 and cfg.block_k % 32:
        raise ValueError(f"MXFP4 weights need block_k a multiple of 32 (a scale's group), got "
                         f"{cfg.block_k}")
    if mxfp4 and cfg.mxfp4_form.endswith("scaled") and x.dtype != torch.bfloat16:
        raise ValueError(f"mxfp4_form {cfg.mxfp4_form!r} (tl.dot_scaled) takes bf16 activations, "
                         f"got {x.dtype}: use 'tile' or 'swap'")
    if mxfp4 and cfg.mxfp4_form == "swap" and (cfg.block_k != 128 or cfg.block_n % 64):
        raise ValueError(f"mxfp4_form 'swap' takes K tiles of 128 (a thread's 16 bytes of a row) "
                         f"and block_n a multiple of 64 (wgmma's rows); got block_k "
                         f"{cfg.block_k}, block_n {cfg.block_n}")
    x, gate_up, down = _contig(x), _contig(gate_up), _contig(down)
    if mxfp4 and cfg.mxfp4_form == "swap":  # its bytes are read as 32-bit words
        gate_up, down = _words(gate_up), _words(down)
    gate_up_scales, down_scales = _contig(gate_up_scales), _contig(down_scales)
    has_bias = gate_up_bias is not None and down_bias is not None
    if gate_up_bias is None or down_bias is None:
        gate_up_bias, down_bias = x, x  # never read (HAS_BIAS off)
    else:
        gate_up_bias, down_bias = _contig(gate_up_bias), _contig(down_bias)
    act_fn = activation or ClampedSwiGLU()  # its numbers unused when activation is None
    sorted_pairs, block_expert = moe_align(topk_ids, e, cfg.block_m)
    nb = block_expert.shape[0]
    act = torch.empty(nb * cfg.block_m, inter, dtype=x.dtype, device=x.device)
    ys = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32  # fp32 stays fp32 (tl.dot would use tf32)
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, IEEE=ieee,
                  HAS_BIAS=has_bias, MXFP4=1 + MXFP4_FORMS.index(cfg.mxfp4_form) if mxfp4 else 0,
                  ASM=mxfp4 and x.dtype == torch.bfloat16 and x.is_cuda and not _interpreting(),
                  num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    _gate_up_kernel[(triton.cdiv(inter, cfg.block_n), nb)](
        x, gate_up, gate_up_scales, gate_up_bias, act, sorted_pairs, block_expert, num_pairs, k,
        h, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scales.stride(0),
        gate_up_scales.stride(1), gate_up_bias.stride(0), act.stride(0),
        float(act_fn.alpha), float(act_fn.limit), CLAMPED_SWIGLU=activation is not None, **launch)
    _down_kernel[(triton.cdiv(h, cfg.block_n), nb)](
        act, down, down_scales, down_bias, topk_weights.reshape(-1).contiguous(), ys,
        sorted_pairs, block_expert, num_pairs, h, inter, act.stride(0), down.stride(0),
        down.stride(1), down_scales.stride(0), down_scales.stride(1), down_bias.stride(0),
        ys.stride(0), **launch)
    return ys.view(t, k, h).sum(1)


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              config: FusedMoEConfig | None = None, *,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H] (gate rows first), down [E, H, I], topk_ids int [T, K]
    (0..E-1), topk_weights fp32 [T, K] -> [T, H] = sum_k w[t, k] * expert_{ids[t, k]}(x[t]).

    ``gate_up_bias`` [E, 2I] and ``down_bias`` [E, H] (both or neither, x's dtype) are added
    to the projections; ``activation`` None is silu(gate) * up, a ClampedSwiGLU GPT-OSS's.
    Rounding: the module docstring's contract. No host sync, every shape a function of the
    input shapes: capturable in a CUDA graph.
    """
    _check(x, gate_up, down, topk_ids, topk_weights, gate_up_bias, down_bias)
    e, two_i, h = gate_up.shape
    return _launch(x, gate_up, gate_up, down, down, e, two_i, h, topk_ids, topk_weights, config,
                   gate_up_bias, down_bias, activation, mxfp4=False)


def fused_moe_mxfp4(x: torch.Tensor, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor,
                    down_blocks: torch.Tensor, down_scales: torch.Tensor,
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    config: FusedMoEConfig | None = None, *,
                    gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None,
                    activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """:func:`fused_moe` over MXFP4 weights (the module docstring's "MXFP4 weights"):
    ``gate_up_blocks`` uint8 [E, 2I, H / 2] and ``gate_up_scales`` uint8 [E, 2I, H / 32],
    ``down_blocks`` [E, H, I / 2] and ``down_scales`` [E, H, I / 32] (H and I multiples of
    32); x fp32, fp16 or bf16. The same result, bit for bit where the module docstring says,
    as :func:`fused_moe` on the weights dequantized to x's dtype."""
    e, two_i, h = _check_mxfp4(x, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                               topk_ids, topk_weights, gate_up_bias, down_bias)
    return _launch(x, gate_up_blocks, gate_up_scales, down_blocks, down_scales, e, two_i, h,
                   topk_ids, topk_weights, config, gate_up_bias, down_bias, activation, mxfp4=True)


def dequantize_kernel_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """Kernel-layout MXFP4 (blocks [..., N, K / 2], scales [..., N, K / 32]) -> [..., N, K]
    in ``dtype`` (models/mxfp4.dequantize_mxfp4 over the checkpoint's [..., K / 32, 16])."""
    from flashpage.models.mxfp4 import dequantize_mxfp4

    return dequantize_mxfp4(blocks.unflatten(-1, (scales.shape[-1], 16)), scales, dtype).view(
        *blocks.shape[:-1], 2 * blocks.shape[-1])


def fused_moe_mxfp4_ref(x: torch.Tensor, gate_up_blocks: torch.Tensor,
                        gate_up_scales: torch.Tensor, down_blocks: torch.Tensor,
                        down_scales: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, config: FusedMoEConfig | None = None, *,
                        gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None,
                        activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Pure-torch fused_moe_mxfp4: the weights dequantized to x's dtype
    (models/mxfp4.dequantize_mxfp4), then :func:`fused_moe_ref`."""
    _check_mxfp4(x, gate_up_blocks, gate_up_scales, down_blocks, down_scales, topk_ids,
                 topk_weights, gate_up_bias, down_bias)
    return fused_moe_ref(x, dequantize_kernel_mxfp4(gate_up_blocks, gate_up_scales, x.dtype),
                         dequantize_kernel_mxfp4(down_blocks, down_scales, x.dtype), topk_ids,
                         topk_weights, config, gate_up_bias=gate_up_bias, down_bias=down_bias,
                         activation=activation)


def fused_moe_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  config: FusedMoEConfig | None = None, *,
                  gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """Pure-torch fused_moe, one expert at a time, with the same rounding (config unused):
    each op below is a torch op on x's dtype, so it rounds as the contract says."""
    _check(x, gate_up, down, topk_ids, topk_weights, gate_up_bias, down_bias)
    t, k = topk_ids.shape
    inter = gate_up.shape[1] // 2
    ys = torch.zeros(t, k, x.shape[1], dtype=x.dtype, device=x.device)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = x[tok] @ gate_up[e].T
        if gate_up_bias is not None:
            h = h + gate_up_bias[e]
        gate, up = h[:, :inter], h[:, inter:]
        if activation is None:
            act = torch.nn.functional.silu(gate) * up
        else:  # transformers' GptOssExperts._apply_gate, op for op
            gate = gate.clamp(max=activation.limit)
            up = up.clamp(min=-activation.limit, max=activation.limit)
            act = (up + 1) * (gate * torch.sigmoid(gate * activation.alpha))
        y = act @ down[e].T
        if down_bias is not None:
            y = y + down_bias[e]
        ys[tok, slot] = (y * topk_weights[tok, slot, None]).to(x.dtype)
    return ys.sum(1)


__all__ = ["MXFP4_FORMS", "ClampedSwiGLU", "FusedMoEConfig", "default_config", "dequantize_kernel_mxfp4",
           "fused_moe", "fused_moe_mxfp4", "fused_moe_mxfp4_ref", "fused_moe_ref", "moe_align",
           "moe_align_ref", "num_blocks"]
