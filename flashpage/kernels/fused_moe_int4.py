"""Fused MoE experts over int4 weights kept packed (an AWQ / GPTQ checkpoint's routed
experts: models/int4_checkpoint.py, layers/moe.FusedExperts.hold_int4), in the one int4
layout of kernels/int4_gemm.py, an expert a leading index::

    gate_up         int32 [E, 2I, H/8]     gate rows first, then up; word c of row n holds
                                           w[n, 8c + j] in bits 4j..4j+3
    gate_up_scales  16/32-bit [E, 2I, H/G1]
    gate_up_zeros   uint8 [E, 2I, H/G1]    w[e, n, k] = (q - zeros[e, n, k // G]) * scales[e, n, k // G]
    down            int32 [E, H, I/8]
    down_scales     [E, H, I/G2], down_zeros uint8 [E, H, I/G2]

(G1 and G2 are the file's group size, or H and I for one group per row; each a multiple
of 16 for tl.dot's K.) Weight-only (W4A16): the routing and alignment are
kernels/fused_moe.py's (moe_align: (token, slot) pairs sorted by expert, each expert's
run padded to block_m rows); a program per (N tile, block) reads only its own expert's
packed words, half a byte a weight. Each K tile lies inside one group (BLOCK_K divides
G), so, as kernels/int4_gemm._w4a16_kernel does, the raw nibbles (0..15, exact in any
float type) are unpacked in registers to x's dtype and ``tl.dot``ed with x in fp32, and
the group's zero point and scale, one per output feature, apply to that partial sum::

    sum_k x[r, k] w[n, k] = s[n] * (sum_k x[r, k] q[n, k] - z[n] * sum_k x[r, k])

Rounding: as kernels/fused_moe.py's contract (each projection's fp32 sum rounded to x's
dtype, silu(gate) rounded, times up rounded, the expert output times its fp32 routing
weight rounded, the K slots summed by torch). The sums differ from the dequantized
weight's linear in fp32 order only (a cancellation of z * sum(x) costs a few of fp32's
bits), far inside 16-bit rounding. :func:`fused_moe_int4_ref` is the same math in torch,
one expert at a time over kernels/int4_gemm.dequantize_int4_ref's weights (the weights the
dequantize-at-load path holds): kernels/fused_moe.fused_moe_ref over them.

Two forms (``FusedMoEInt4Config.form``, INT4_FORMS):

- "dot" (any dtype, any group a multiple of 16): the tl.dot above, x the MMA's first
  operand, the unpacked nibbles the second. Bound by the unpack: built for sm_90a its K
  loop is 8.6-10.5 SASS instructions a weight and thread (shift, mask, convert each
  nibble, the tile through shared memory to mma.sync); on the H200 (run 199, Qwen3-30B-
  A3B's experts) 1.65-2.2x the bf16 fused kernel's time, 6-11% of copy bandwidth.
- "swap" (16-bit or fp32 x, groups a multiple of 128; the default for bf16 / fp16 up to a
  mean of 16 pairs an expert; its kernels in kernels/fused_moe_int4_swap.py): MXFP4's
  "swap" layout (kernels/fused_moe.py) with int4's decode. The weight tile is wgmma's
  first operand, the block's rows its N::

      out^T [BN, BM] = sum over K tiles of s[:, g] * ((q - z)[:, tile] . x[rows, tile]^T)

  K tiles of 128, each inside one group g: a thread loads 4 words (16 bytes) of a row, the
  rows in tiles.wgmma_a_rows' order and x's K in _swap_x's, so the 8 values of each word
  are already its share of wgmma's A fragment (fused_moe._swap_tile: register moves only;
  our packing, nibble j of a word = K 8c + j, is e2m1's). The decode (inline PTX,
  fused_moe_int4_swap.word_ptx): per pair of nibbles (j, j + 4), 16 bits apart, one lop3
  ORs both into the mantissas of a 16-bit magic (bf16 128.0 = 0x4300: 128 + q, a nibble
  at bits 0-3 of each half, so three shifts a word, kernels/int4_gemm's _unpack_ptx; fp16
  1024.0 = 0x6400 for bits 0-3 and 64.0 = 0x5400 for bits 4-7, one shift a word) and one
  packed fma (x * 1 - (magic + z)) leaves q - z, exact in either 16-bit type
  (|q - z| <= 16), in x's dtype (bf16 x decodes to bf16: no fp16 detour). The group's
  scale (fp32, one per feature) multiplies each tile's fp32 sums; the weights (q - z) * s
  are never rounded, so the result is the dequantized weights' linear within fp32
  accumulation order and the reference's 16-bit rounding of each weight (the reference
  rounds (q - z) * s to x's dtype; here it is exact). fp32 x and the interpreter: the
  same q - z by shifts and masks (Triton ops). Built for sm_90a (bf16 or fp16, 64
  features, 16 rows, tests/kernels/test_fused_moe_int4_swap.py) its K loop is 2.3-2.9
  SASS instructions a weight and thread: per thread and tile of 64 x 128 weights, 32 lop3
  + 32 packed adds + 24 shifts (fp16: 8) of decode, 8 HGMMA 64x16x16 with A from
  registers, and,
  unpipelined, no shared-memory read at all (pipelined, the words arrive by cp.async and
  one LDS.128 per 4 words); 128 features a tile convert the fragment through shared
  memory (Triton's layout for two warpgroup row blocks) and are not used. The gate_up
  kernel stores act with each 128 features in _swap_x's K order (every row, padding rows
  too), so the down kernel loads its K tiles as they lie, unmasked; rows past N read
  wrapped real rows (never stored): no masks in the loop. Each tile's wgmma is waited on
  before its scale (the accumulators are the fp32 sums, not the MMA's).
  Not yet timed on a GPU: benchmarks/fused_moe.py --int4 times each form's tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels import fused_moe_int4_swap as swap_kernels
from flashpage.kernels.fused_moe import fused_moe_ref, moe_align
from flashpage.kernels.int4_gemm import PACK, dequantize_int4_ref
from flashpage.kernels.tiles import moe_block

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# How a K tile reaches the tensor cores: "dot" (x . unpacked nibbles^T, any group of 16+)
# or "swap" (the decoded weight tile wgmma's first operand, groups a multiple of 128): the
# module docstring.
INT4_FORMS = ("dot", "swap")
SWAP_K = 128  # form "swap"'s K tile: 16 words a row, 4 a thread (a quad's A fragment)


@dataclass(frozen=True)
class FusedMoEInt4Config:
    block_m: int = 16  # rows (token, slot pairs) per block; tl.dot needs >= 16
    block_n: int = 64  # output features a program ("swap": a multiple of 64, wgmma's M)
    block_k: int = 128  # K a tile, at most: the launcher takes the largest power of two
    #                     dividing the group (>= 16); "swap": 128 exactly
    num_warps: int = 4
    num_stages: int = 3
    form: str = "dot"

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.form not in INT4_FORMS:
            raise ValueError(f"form must be one of {', '.join(INT4_FORMS)}; got {self.form!r}")
        if self.form == "swap" and (self.block_k != SWAP_K or self.block_n % 64):
            raise ValueError(f"form 'swap' takes K tiles of {SWAP_K} (16 words a row) and "
                             f"block_n a multiple of 64 (wgmma's rows); got block_k "
                             f"{self.block_k}, block_n {self.block_n}")

    @property
    def name(self) -> str:
        return (f"{'swap ' if self.form == 'swap' else ''}m{self.block_m} n{self.block_n} "
                f"k{self.block_k} w{self.num_warps} s{self.num_stages}")


def swap_supports(dtype: torch.dtype, g_gate_up: int, g_down: int) -> bool:
    """Whether form "swap" takes x of ``dtype`` over groups of these sizes: its K tile of
    128 inside one group (groups a multiple of 128; hidden and intermediate are multiples
    of their groups)."""
    return dtype in _TL_DTYPES and g_gate_up % SWAP_K == 0 and g_down % SWAP_K == 0


def default_config(num_pairs: int, num_experts: int, dtype: torch.dtype | None = None,
                   groups: tuple[int, int] | None = None) -> FusedMoEInt4Config:
    """Where ``dtype`` is bf16 / fp16 and ``groups`` (gate_up's, down's) are multiples of 128
    (a checkpoint's usual 128): form "swap", 64 features on 4 warps and 3 stages, 16 rows up
    to a mean of 16 pairs an expert, 32 past it. Run 200 (H200, Qwen3-30B-A3B's experts in
    bf16, benchmarks/fused_moe.py --int4): at 1-128 tokens (means 1-8) 16 rows and 3 stages
    were the fastest tile, 0.57-0.89x the bf16 fused kernel's time (29.5 / 86.6 / 155 / 198
    us against 33.2 / 123 / 271 / 341) and 0.26-0.40x "dot"'s; at 512 tokens (a mean of 32)
    32 rows took 487 us, 16 rows 494, the bf16 kernel 531 and "dot" at 64 rows 1,066.
    Larger means (prompt steps past 512 tokens) are untimed. Otherwise (groups under 128,
    fp32) "dot": 16 rows on 4 warps up to a mean of 16, 64 rows on 8 warps past it (run
    199), 64 features a program and K tiles of 64: the tiles that do not spill when built
    for sm_90 (tests/kernels/test_fused_moe_int4.py reads ptxas' log)."""
    mean = triton.cdiv(max(num_pairs, 1), num_experts)
    if dtype in (torch.bfloat16, torch.float16) and groups is not None \
            and swap_supports(dtype, *groups):
        return FusedMoEInt4Config(block_m=16 if mean <= 16 else 32, block_n=64,
                                  block_k=SWAP_K, num_warps=4, num_stages=3, form="swap")
    if mean <= 16:
        return FusedMoEInt4Config(block_m=16, block_n=64, block_k=64, num_warps=4)
    return FusedMoEInt4Config(block_m=64, block_n=64, block_k=64, num_warps=8)


def tile_k(g: int, want: int) -> int:
    """The K tile for groups of ``g``: the largest power of two <= ``want`` dividing g."""
    bk = want
    while bk > 16 and g % bk:
        bk //= 2
    if g % bk:
        raise ValueError(f"group size {g} is not a multiple of 16 (tl.dot's K)")
    return bk


def kernel_supports(hidden: int, inter: int, g_gate_up: int, g_down: int) -> str | None:
    """Why the kernel cannot run experts of these sizes and groups, or None."""
    for name, k, g in (("hidden", hidden, g_gate_up), ("intermediate", inter, g_down)):
        if k % g or g % 16:
            return (f"{name} size {k} with groups of {g}: the groups must divide it and be "
                    "multiples of 16")
    return None


# ------------------------------------------------------------------------- kernels
@triton.jit
def _w4_partial(a, a_sum, w_rows, s_rows, z_rows, n_mask, k0, g, DT: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """One K tile's contribution [BLOCK_M, BLOCK_N]: a [BLOCK_M, BLOCK_K] against the
    packed rows (w_rows: each feature's word pointers at k = 0) of group g."""
    shifts = tl.arange(0, 8) * 4
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(w_rows[:, None] + offs_w[None, :], mask=n_mask[:, None], other=0)
    q = tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
    part = tl.dot(a, tl.trans(q.to(DT)), input_precision=PRECISION)
    s = tl.load(s_rows + g, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_rows + g, mask=n_mask, other=0).to(tl.float32)
    return (part - a_sum[:, None] * z[None, :]) * s[None, :]


@triton.jit
def _int4_gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, act_ptr, sorted_ptr, block_expert_ptr,
                         num_pairs, top_k, hidden, inter, stride_xt, stride_we, stride_wn,
                         stride_se, stride_sn, stride_ar, G: tl.constexpr, DT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    """act[r, n tile] = silu(gate) * up for the BLOCK_M rows of one block (scales and
    zeros share their strides: both [E, 2I, H / G])."""
    expert = tl.load(block_expert_ptr + tl.program_id(1))
    if expert < 0:  # a padding block (moe_align)
        return
    pid_n, rows, pair, valid, token = moe_block(sorted_ptr, num_pairs, top_k, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    gate_w = w_ptr + e64 * stride_we + n64 * stride_wn
    up_w = gate_w + inter.to(tl.int64) * stride_wn
    gate_s = s_ptr + e64 * stride_se + n64 * stride_sn
    up_s = gate_s + inter.to(tl.int64) * stride_sn
    gate_z = z_ptr + e64 * stride_se + n64 * stride_sn
    up_z = gate_z + inter.to(tl.int64) * stride_sn
    x_rows = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(0, hidden // BLOCK_K):
        k0 = t * BLOCK_K
        a = tl.load(x_rows + k0, mask=valid[:, None], other=0.0)
        a_sum = tl.sum(a.to(tl.float32), axis=1)
        g = k0 // G
        acc_g += _w4_partial(a, a_sum, gate_w, gate_s, gate_z, n_mask, k0, g, DT, BLOCK_N,
                             BLOCK_K, PRECISION)
        acc_u += _w4_partial(a, a_sum, up_w, up_s, up_z, n_mask, k0, g, DT, BLOCK_N,
                             BLOCK_K, PRECISION)
    gate = acc_g.to(DT).to(tl.float32)  # each projection output in the model dtype
    up = acc_u.to(DT).to(tl.float32)
    act = ((gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up).to(DT)
    out = act_ptr + rows[:, None].to(tl.int64) * stride_ar + offs_n[None, :]
    tl.store(out, act, mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _int4_down_kernel(a_ptr, w_ptr, s_ptr, z_ptr, topk_w_ptr, ys_ptr, sorted_ptr,
                      block_expert_ptr, num_pairs, hidden, inter, stride_ar, stride_we,
                      stride_wn, stride_se, stride_sn, stride_yp, G: tl.constexpr,
                      DT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """ys[pair, n tile] = round(topk_weight[pair] * round(act[r] @ down[e].T))."""
    expert = tl.load(block_expert_ptr + tl.program_id(1))
    if expert < 0:  # a padding block (moe_align)
        return
    pid_n, rows, pair, valid, _ = moe_block(sorted_ptr, num_pairs, 1, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    e64 = expert.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + n64 * stride_wn
    s_rows = s_ptr + e64 * stride_se + n64 * stride_sn
    z_rows = z_ptr + e64 * stride_se + n64 * stride_sn
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_ar + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(0, inter // BLOCK_K):
        k0 = t * BLOCK_K
        a = tl.load(a_rows + k0, mask=valid[:, None], other=0.0)
        a_sum = tl.sum(a.to(tl.float32), axis=1)
        acc += _w4_partial(a, a_sum, w_rows, s_rows, z_rows, n_mask, k0, k0 // G, DT, BLOCK_N,
                           BLOCK_K, PRECISION)
    weight = tl.load(topk_w_ptr + pair, mask=valid, other=0.0)
    y = acc.to(DT).to(tl.float32) * weight[:, None]
    out = ys_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_yp + offs_n[None, :]
    tl.store(out, y.to(DT), mask=valid[:, None] & n_mask[None, :])


# ------------------------------------------------------------------------- launcher
def _check(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
           gate_up_zeros: torch.Tensor, down: torch.Tensor, down_scales: torch.Tensor,
           down_zeros: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
           ) -> tuple[int, int, int, int, int]:
    """-> (E, I, H, G of gate_up, G of down) of checked arguments (ValueError naming what
    is wrong)."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"x must be [T, H], gate_up [E, 2I, H/8], down [E, H, I/8]; got "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    if x.dtype not in _TL_DTYPES:
        raise ValueError(f"x must be fp32, fp16 or bf16, got {x.dtype}")
    if gate_up.dtype != torch.int32 or down.dtype != torch.int32:
        raise ValueError(f"gate_up and down must be int32 (8 nibbles a word), got "
                         f"{gate_up.dtype}, {down.dtype}")
    e, two_i, hw = gate_up.shape
    inter, h = two_i // 2, hw * PACK
    if two_i % 2 or x.shape[1] != h or down.shape != (e, h, inter // PACK) or inter % PACK:
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)} (want [E, 2I, H/8] and [E, H, I/8])")
    groups = []
    for name, s, z, n, k in (("gate_up", gate_up_scales, gate_up_zeros, two_i, h),
                             ("down", down_scales, down_zeros, h, inter)):
        if s.dim() != 3 or s.shape[:2] != (e, n) or s.shape[2] == 0 or k % s.shape[2]:
            raise ValueError(f"{name}_scales must be [{e}, {n}, K/G] with G dividing {k}, got "
                             f"{tuple(s.shape)}")
        if z.shape != s.shape or z.dtype != torch.uint8 or z.stride() != s.stride():
            raise ValueError(f"{name}_zeros must be uint8 of {name}_scales' shape and strides "
                             f"{tuple(s.shape)}, got {z.dtype} {tuple(z.shape)}")
        if s.dtype not in _TL_DTYPES:
            raise ValueError(f"{name}_scales must be fp16, bf16 or fp32, got {s.dtype}")
        groups.append(k // s.shape[2])
    if (why := kernel_supports(h, inter, groups[0], groups[1])) is not None:
        raise ValueError(why)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must be [T, K] with T = {x.shape[0]}; got "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be fp32, got {topk_weights.dtype}")
    return e, inter, h, groups[0], groups[1]


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def fused_moe_int4(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
                   gate_up_zeros: torch.Tensor, down: torch.Tensor, down_scales: torch.Tensor,
                   down_zeros: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   config: FusedMoEInt4Config | None = None) -> torch.Tensor:
    """x [T, H] (fp32 / fp16 / bf16), the int4 experts (the module docstring's layout),
    topk_ids int [T, K] (0..E-1), topk_weights fp32 [T, K] -> [T, H] in x's dtype =
    sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with silu(gate) * up. No host sync, every
    shape a function of the input shapes: capturable in a CUDA graph."""
    e, inter, h, g1, g2 = _check(x, gate_up, gate_up_scales, gate_up_zeros, down, down_scales,
                                 down_zeros, topk_ids, topk_weights)
    t, k = topk_ids.shape
    num_pairs = t * k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cfg = config or default_config(num_pairs, e, x.dtype, (g1, g2))
    swap = cfg.form == "swap"
    if swap and not swap_supports(x.dtype, g1, g2):
        raise ValueError(f"form 'swap' takes groups that are multiples of {SWAP_K} (its K tile "
                         f"in one group); got {g1} (gate_up) and {g2} (down)")
    x, gate_up, down = _contig(x), _contig(gate_up), _contig(down)
    gate_up_scales, gate_up_zeros = _contig(gate_up_scales), _contig(gate_up_zeros)
    down_scales, down_zeros = _contig(down_scales), _contig(down_zeros)
    sorted_pairs, block_expert = moe_align(topk_ids, e, cfg.block_m)
    nb = block_expert.shape[0]
    launch = dict(DT=_TL_DTYPES[x.dtype], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    act = torch.empty(nb * cfg.block_m, inter, device=x.device, dtype=x.dtype)
    if swap:
        from flashpage.kernels.device import interpreting

        asm = x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda and not interpreting()
        ptx, offset = swap_kernels.word_ptx(x.dtype) if asm else ("", 0.0)
        launch.update(ASM=asm, PTX=ptx, OFFSET=offset)
        swap_kernels._int4_swap_gate_up_kernel[(triton.cdiv(inter, cfg.block_n), nb)](
            x, gate_up, gate_up_scales, gate_up_zeros, act, sorted_pairs, block_expert,
            num_pairs, k, h, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
            gate_up_scales.stride(0), gate_up_scales.stride(1), act.stride(0), G=g1, **launch)
        ys = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
        swap_kernels._int4_swap_down_kernel[(triton.cdiv(h, cfg.block_n), nb)](
            act, down, down_scales, down_zeros, topk_weights.reshape(-1).contiguous(), ys,
            sorted_pairs, block_expert, num_pairs, h, inter, act.stride(0), down.stride(0),
            down.stride(1), down_scales.stride(0), down_scales.stride(1), ys.stride(0), G=g2,
            **launch)
        return ys.view(t, k, h).sum(1)
    _int4_gate_up_kernel[(triton.cdiv(inter, cfg.block_n), nb)](
        x, gate_up, gate_up_scales, gate_up_zeros, act, sorted_pairs, block_expert, num_pairs,
        k, h, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gate_up_scales.stride(0), gate_up_scales.stride(1), act.stride(0), G=g1,
        BLOCK_K=tile_k(g1, cfg.block_k), **launch)
    ys = torch.empty(num_pairs, h, dtype=x.dtype, device=x.device)
    _int4_down_kernel[(triton.cdiv(h, cfg.block_n), nb)](
        act, down, down_scales, down_zeros, topk_weights.reshape(-1).contiguous(), ys,
        sorted_pairs, block_expert, num_pairs, h, inter, act.stride(0), down.stride(0),
        down.stride(1), down_scales.stride(0), down_scales.stride(1), ys.stride(0), G=g2,
        BLOCK_K=tile_k(g2, cfg.block_k), **launch)
    return ys.view(t, k, h).sum(1)


def dequantize_experts_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K/8] int32 (+ [E, N, K/G] scales and zeros) -> [E, N, K] in ``dtype``, each
    expert as kernels/int4_gemm.dequantize_int4_ref (fp32, then ``dtype``)."""
    e, n, kw = qweight.shape
    w = dequantize_int4_ref(qweight.reshape(e * n, kw), scales.reshape(e * n, -1),
                            zeros.reshape(e * n, -1), dtype)
    return w.view(e, n, kw * PACK)


def fused_moe_int4_ref(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scales: torch.Tensor,
                       gate_up_zeros: torch.Tensor, down: torch.Tensor,
                       down_scales: torch.Tensor, down_zeros: torch.Tensor,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Pure-torch fused_moe_int4: the 16-bit reference (kernels/fused_moe.fused_moe_ref)
    over the experts dequantized to x's dtype."""
    _check(x, gate_up, gate_up_scales, gate_up_zeros, down, down_scales, down_zeros, topk_ids,
           topk_weights)
    return fused_moe_ref(x, dequantize_experts_int4(gate_up, gate_up_scales, gate_up_zeros,
                                                    x.dtype),
                         dequantize_experts_int4(down, down_scales, down_zeros, x.dtype),
                         topk_ids, topk_weights)


__all__ = ["INT4_FORMS", "FusedMoEInt4Config", "default_config", "dequantize_experts_int4",
           "fused_moe_int4", "fused_moe_int4_ref", "kernel_supports", "swap_supports", "tile_k"]
