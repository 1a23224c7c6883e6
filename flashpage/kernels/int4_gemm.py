"""W4A16: y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias) over 4-bit weights kept packed.

One layout for every int4 checkpoint (AWQ and GPTQ files are repacked into it at load,
models/int4_formats.py), output rows first so a merged linear (qkv, gate_up) is its
pieces' rows stacked and a row of the weight is contiguous along K:

    qweight  int32 [N, K/8]   word c of row n holds w[n, 8c + j] in bits 4j..4j+3 (j = 0..7)
    scales   16/32-bit [N, K/G]   as the checkpoint stores them (fp16 for AWQ / GPTQ)
    zeros    uint8 [N, K/G]   the zero point, 0..16 (GPTQ's stored z - 1, plus one, may be 16)

    w[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]      in fp32, then x's dtype

G (the group size) is a multiple of 8 dividing K; G = K is one group per row (GPTQ's
group_size -1). The dequantizing paths compute that value in fp32 and round it once to
x's dtype, so the dequantized weight is the same bits wherever it is built.

``w4a16_matmul`` is one Triton kernel for every row count: a program owns BLOCK_M rows of
x and BLOCK_N output features and walks K a BLOCK_K tile at a time, each tile inside one
group (BLOCK_K divides G). It loads the tile's packed words [BLOCK_N, BLOCK_K/8], unpacks
the nibbles in registers (shift, mask, reshape) straight into 16-bit floats (each nibble
ORed into the mantissa of 128.0 in bf16, 1024.0 in fp16: OFFSET + q, no int-to-float
conversion), and ``tl.dot``s them with x in fp32; the group's zero point and scale, one
per feature, then apply to that partial sum, not to every weight:

    sum_k x[m, k] w[n, k] = s[n] * (sum_k x[m, k] (OFFSET + q[n, k]) - (OFFSET + z[n]) sum_k x[m, k])

(built for sm_90 that is ~580 SASS instructions per 64 x 128 tile and 4 warps, against
~1,600 with the weight dequantized before the dot: the broadcast scales and zeros were
loaded and converted per weight.) The sums' rounding differs from the dequantized
weight's linear (exact products, fp32 sums; a cancellation of OFFSET * sum(x) costs a few
of fp32's bits), far inside 16-bit rounding. K is split between programs (``split_k``)
until there are ~2 per SM, so that a projection of a few thousand features fills the GPU
at decode batches: each split writes fp32 partial sums, added once after. Decode batches
(1-16 rows) take BLOCK_M 16 (``tl.dot``'s smallest). ``dequantize_int4`` unpacks the whole
weight to x's dtype with the reference's bits (for large prompt steps, where a 16-bit
GEMM wins). Their references: ``unpack_int4``, ``dequantize_int4_ref``,
``int4_linear_ref``.

``w4a16_gemm`` (``_w4a16_swap_kernel``) is the path past the GEMV's 64 rows (prompt steps,
big decode batches): operands swapped, y^T [N, M] = w [N, K] . x^T [K, M], so the weight
tile is the MMA's A operand (64 features a warpgroup) and the rows of x its N side (16 to
256 a tile: the tile's dequantizing is paid once for all of them). Two forms
(``Int4GemmConfig.per_weight``):

    per weight   each nibble becomes the fp32 2048 + q or 128 + q (one lop3), one FMA
                 (O + q) * s - (O + z) * s gives (q - z) * s exactly (16-bit scales), packed
                 to x's dtype two at a time: the bits of ``dequantize_int4_ref``, so the
                 MMAs accumulate into one fp32 accumulator (Triton keeps them in flight
                 across K tiles) and a K tile may span groups
    on the sums  q - z in x's dtype (exact; inline PTX, two an instruction) and the group's
                 scale on each tile's [BLOCK_N, BLOCK_M] sums (as the GEMV does): fewer
                 instructions a weight, but one FFMA per output element a tile, and each
                 tile's MMAs waited on before the scale

Built for sm_90 by Triton 3.6 (tests/kernels/test_int4_swap_gemm.py reads the SASS): the
MMAs are wgmma (HGMMA 64xBLOCK_Mx16) with A from registers, but the unpacked tile reaches
wgmma's register layout through shared memory (a store and an ldmatrix a 16-wide K slice:
the reshape of a word's 8 nibbles gives a layout Triton converts that way); x^T is read by
wgmma from shared memory, the words through Triton's cp.async pipeliner, x's tiles too or
by TMA (``Int4GemmConfig.tma``: one box a tile, ~30-50 fewer registers). The K loop is
~6.4-7.9 SASS instructions a weight a thread, whatever the tile's rows (the tl.dot kernel
above: ~18 for 64 rows). Unswapped (x the A operand, this unpacked tile transposed as B)
the same loop does not build in Triton 3.6 (OptimizeDotOperands: "Illegal shared layout").

The fragment tiles (``Int4GemmConfig.fragment``, kernels/int4_fragment.py; the default
where the weight allows them, K tiles of 128, 64 features on 4 warps) keep the decoded tile
out of shared memory: each thread loads the words of the rows it holds in wgmma's A
fragment (``tiles.wgmma_a_rows``) and decodes them in place, a pair of nibbles (j, j + 4)
into one register of the fragment, and x's K is put once a call in the order that makes
that the right product (``fragment_x``). Per weight: fp16 x under fp16 scales by packed
16-bit PTX (lop3, fma, mul: 3 instructions a pair, the reference's bits), otherwise the fp32
FMA above; on the sums: q - z (lop3 + fma a pair). Built for sm_90a: no STS or ldmatrix in
the K loop, nothing spilled, 238-370 SASS instructions a 128-wide K tile against the older
tiles' 291-496 (tests/kernels/test_int4_fragment_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels.int4_fragment import (
    DEQUANT16_TYPES,
    FRAG_K,
    dequant16_8,
    dequant16_ptx,
    fragment_tile,
    fragment_x,
    packed_nibbles_ptx,
    qz8,
    wgmma_drain,
)
from flashpage.kernels.tiles import grouped_tile, wgmma_a_rows

PACK = 8  # nibbles per int32 word


# ----------------------------------------------------------------------------- references
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 -> int32 [N, K/8], nibble j of word c = q[:, 8c + j]."""
    n, k = q.shape
    if k % PACK:
        raise ValueError(f"K={k} is not a multiple of {PACK}")
    q = q.to(torch.int32).reshape(n, k // PACK, PACK)
    words = q[..., 0].clone(memory_format=torch.contiguous_format)
    for j in range(1, PACK):  # int32 shifts wrap: nibble 7 lands in the sign bit
        words |= q[..., j] << (4 * j)
    return words


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> int32 [N, K] in 0..15 (the inverse of ``pack_int4``)."""
    shifts = torch.arange(PACK, device=qweight.device, dtype=torch.int32) * 4
    q = (qweight.unsqueeze(-1) >> shifts) & 0xF
    return q.reshape(qweight.shape[0], -1)


def dequantize_int4_ref(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The layout's meaning: (q - zero) * scale of each value's group, in fp32, then
    ``dtype``; [N, K]."""
    q = unpack_int4(qweight)
    g = q.shape[1] // scales.shape[1]
    s = scales.float().repeat_interleave(g, dim=1)
    z = zeros.float().repeat_interleave(g, dim=1)
    return ((q.float() - z) * s).to(dtype)


def int4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ the weight dequantized to x's dtype, products summed in fp32 (+ bias),
    in x's dtype."""
    w = dequantize_int4_ref(qweight, scales, zeros, x.dtype).float()
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, KW, NG,
                  G: tl.constexpr, TG: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """The weight tile w[offs_n, k0:k0 + BLOCK_K] dequantized, fp32 [BLOCK_N, BLOCK_K].
    TG = min(G, BLOCK_K): the tile holds BLOCK_K // TG groups of TG columns."""
    GPB: tl.constexpr = BLOCK_K // TG
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(qw_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=n_mask[:, None],
                     other=0)
    shifts = tl.arange(0, 8) * 4
    q = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [BN, BK/8, 8]
    q = tl.reshape(q, (BLOCK_N, GPB, TG)).to(tl.float32)
    groups = (k0 + tl.arange(0, GPB) * TG) // G
    g_off = offs_n[:, None] * NG + groups[None, :]
    s = tl.load(s_ptr + g_off, mask=n_mask[:, None], other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_off, mask=n_mask[:, None], other=0).to(tl.float32)
    w = (q - z[:, :, None]) * s[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _unpack_words(packed, z):
    """Packed words [BN, W] and their zero points ([BN, W] or [BN, 1]) -> q - z in fp32
    [BN, W, 2, 2, 2] (integers: the scale goes on sums of them), nibble j of a word at
    [..., j >> 2, (j >> 1) & 1, j & 1] (so a reshape to [BN, 8W] is the K order). tl.join stacks in a thread's registers: a word's
    8 weights stay in the thread that loaded it (a 3D [BN, W, 8] shift puts them in 8
    lanes). Each nibble is ORed into the mantissa of 2^23 (0x4B000000): the fp32 2^23 + q
    with no int-to-float conversion; 2^23 is taken off with the zero point, exactly."""
    pk = packed.to(tl.uint32, bitcast=True)
    n0 = ((pk & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    n1 = (((pk >> 4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    n2 = (((pk >> 8) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    n3 = (((pk >> 12) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    n4 = (((pk >> 16) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    n5 = (((pk >> 20) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    n6 = (((pk >> 24) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    n7 = ((pk >> 28) | 0x4B000000).to(tl.float32, bitcast=True)
    q = tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)),
                tl.join(tl.join(n1, n5), tl.join(n3, n7)))
    zf = z.to(tl.float32) + 8388608.0
    return q - zf[:, :, None, None, None]


# PTX of one packed word and its -(OFFSET + zero) as a 16-bit float -> its 8 values q - z
# in that 16-bit type, two per instruction: each pair of nibbles (j, j + 4) masked into the
# mantissas of OFFSET (bf16 0x4300 = 128, fp16 0x6400 = 1024: the float OFFSET + q, exact)
# by one lop3, then OFFSET + z taken off both by one fma (x * 1 - (OFFSET + z), exact).
# _UNPACK_TYPES: x's dtype -> (its 16-bit pattern of OFFSET, OFFSET, the pair (1.0, 1.0), the
# PTX type)
_UNPACK_TYPES = DEQUANT16_TYPES


def _unpack_ptx(dtype: torch.dtype) -> str:
    """One packed word -> its 8 nibbles' q - z in x's 16-bit type, a lop3 + packed fma a pair
    (int4_fragment.packed_nibbles_ptx without the scale)."""
    return packed_nibbles_ptx(dtype, scaled=False)


@triton.jit
def _unpack_words_asm(packed, z, DT: tl.constexpr, PTX: tl.constexpr, OFFSET: tl.constexpr):
    """``_unpack_words`` in x's 16-bit type by inline PTX (the GPU only): [BN, W, 2, 2, 2]."""
    nz = (-(z.to(tl.float32) + OFFSET)).to(DT)
    nz = tl.broadcast_to(nz, packed.shape)
    outs = tl.inline_asm_elementwise(
        PTX.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [packed, nz],
        dtype=(DT.value,) * 8, is_pure=True, pack=1)
    n0, n1, n2, n3, n4, n5, n6, n7 = outs
    return tl.join(tl.join(tl.join(n0, n4), tl.join(n2, n6)),
                   tl.join(tl.join(n1, n5), tl.join(n3, n7)))


# PTX of one packed word -> its 8 nibbles as fp32 (``_row_chain``), two magics: a nibble at
# bits 12-15 ORed into 2048.0's mantissa (0x45000000, where bit 12 is worth 1) is 2048 + q,
# at bits 16-19 into 128.0's (0x43000000) 128 + q. Four shifts bring every nibble to one
# of the two places (w: 3 and 4; w << 8: 1 and 2; w >> 8: 5 and 6; w << 12: 0; w >> 12: 7),
# one lop3 each (a & mask | magic, both in registers): 12 instructions for 8 weights.
# Outputs in the order $0-$3 = nibbles 3, 1, 5, 0 (2048 + q), $4-$7 = 4, 2, 6, 7 (128 + q).
_NIBBLES_PTX = tl.constexpr("""{
.reg .b32 t, ma, mb, ca, cb;
mov.b32 ma, 0x0000F000;
mov.b32 mb, 0x000F0000;
mov.b32 ca, 0x45000000;
mov.b32 cb, 0x43000000;
lop3.b32 $0, $8, ma, ca, 0xEA;
lop3.b32 $4, $8, mb, cb, 0xEA;
shl.b32 t, $8, 8;
lop3.b32 $1, t, ma, ca, 0xEA;
lop3.b32 $5, t, mb, cb, 0xEA;
shr.u32 t, $8, 8;
lop3.b32 $2, t, ma, ca, 0xEA;
lop3.b32 $6, t, mb, cb, 0xEA;
shl.b32 t, $8, 12;
lop3.b32 $3, t, ma, ca, 0xEA;
shr.u32 t, $8, 12;
lop3.b32 $7, t, mb, cb, 0xEA;
}""")


@triton.jit
def _nibbles_2048_128(packed, ASM: tl.constexpr):
    """Packed words [BN, W] -> 8 fp32 tensors [BN, W]: nibbles 3, 1, 5, 0 as 2048 + q,
    then 4, 2, 6, 7 as 128 + q (``_NIBBLES_PTX``; the interpreter runs the same bit
    arithmetic in Triton ops, which ptxas leaves two lop3s a weight)."""
    if ASM:
        return tl.inline_asm_elementwise(
            _NIBBLES_PTX.value, "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed],
            dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        w = packed.to(tl.uint32, bitcast=True)
        lo = w << 8
        hi = w >> 8
        a3 = ((w & 0xF000) | 0x45000000).to(tl.float32, bitcast=True)
        a1 = ((lo & 0xF000) | 0x45000000).to(tl.float32, bitcast=True)
        a5 = ((hi & 0xF000) | 0x45000000).to(tl.float32, bitcast=True)
        a0 = (((w << 12) & 0xF000) | 0x45000000).to(tl.float32, bitcast=True)
        b4 = ((w & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)
        b2 = ((lo & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)
        b6 = ((hi & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)
        b7 = (((w >> 12) & 0xF0000) | 0x43000000).to(tl.float32, bitcast=True)
        return a3, a1, a5, a0, b4, b2, b6, b7


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, stride_xm,
                  stride_om, stride_os, G: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, MAGIC: tl.constexpr,
                  OFFSET: tl.constexpr):
    """A K tile lies inside one group (BLOCK_K divides G), so its zero and scale are one
    per output feature and come out of the sum:

        sum_k x[m, k] (q[n, k] - z[n]) s[n] = s[n] (sum_k x[m, k] q[n, k] - z[n] sum_k x[m, k])

    The dot runs over the raw nibbles (0..15: exact in any 16-bit type), and the zero and
    scale touch the [BLOCK_M, BLOCK_N] partial sum, not every weight (broadcast into the
    weight tile, each thread would load and convert its own copy per weight)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    KW = K // 8
    NG = K // G
    tiles = K // BLOCK_K
    per_split = tl.cdiv(tiles, SPLIT_K)
    start = pid_k * per_split
    end = tl.minimum(start + per_split, tiles)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(start, end):
        k0 = t * BLOCK_K
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qw_ptr + offs_n[:, None] * KW + offs_w[None, :], mask=n_mask[:, None],
                         other=0)
        q = tl.reshape((packed[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K))
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None], other=0.0)
        if MAGIC != 0:
            # the nibble ORed into the mantissa of a 16-bit float whose last bit is worth 1
            # (bf16 0x4300 = 128, fp16 0x6400 = 1024): the value OFFSET + q, exactly, with
            # no int-to-float conversion (a quarter-rate instruction); OFFSET * sum(x) is
            # taken off with the zero point
            w = (q | MAGIC).to(tl.int16).to(x.dtype, bitcast=True)
            z_off = OFFSET
        else:
            w = q.to(x.dtype)
            z_off = 0.0
        part = tl.dot(x, tl.trans(w), input_precision=PRECISION)
        g_row = offs_n * NG + k0 // G
        s = tl.load(s_ptr + g_row, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_row, mask=n_mask, other=0).to(tl.float32) + z_off
        x_sum = tl.sum(x.to(tl.float32), axis=1)
        acc += (part - x_sum[:, None] * z[None, :]) * s[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out, acc, mask=out_mask)


@triton.jit
def _dequant8(packed, s, z, DT: tl.constexpr, ASM: tl.constexpr):
    """Packed words [BN, W] with their scales and zero points ([BN, W] or [BN, 1]) -> 8
    tensors [BN, W] in DT, nibbles 0..7's weights (q - z) * s, the bits of
    ``dequantize_int4_ref`` for 16-bit scales: each nibble is 2048 + q or 128 + q in fp32
    (``_nibbles_2048_128``, one lop3), and one FMA (O + q) * s - (O + z) * s gives
    (q - z) * s exactly (O + q has 12 bits, a 16-bit scale 11: the products and the result
    fit fp32's 24), rounded once to DT."""
    sf = s.to(tl.float32)
    zf = z.to(tl.float32)
    c_hi = -(zf + 2048.0) * sf
    c_lo = -(zf + 128.0) * sf
    a3, a1, a5, a0, b4, b2, b6, b7 = _nibbles_2048_128(packed, ASM)
    w0 = tl.fma(a0, sf, c_hi).to(DT)
    w1 = tl.fma(a1, sf, c_hi).to(DT)
    w3 = tl.fma(a3, sf, c_hi).to(DT)
    w5 = tl.fma(a5, sf, c_hi).to(DT)
    w2 = tl.fma(b2, sf, c_lo).to(DT)
    w4 = tl.fma(b4, sf, c_lo).to(DT)
    w6 = tl.fma(b6, sf, c_lo).to(DT)
    w7 = tl.fma(b7, sf, c_lo).to(DT)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _dequant_words(packed, s, z, DT: tl.constexpr, ASM: tl.constexpr):
    """``_dequant8``'s weights as one tensor [BN, W, 2, 2, 2] (nibble j of a word at
    [..., j >> 2, (j >> 1) & 1, j & 1]: a reshape to [BN, 8W] is the K order)."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _dequant8(packed, s, z, DT, ASM)
    return tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)),
                   tl.join(tl.join(w1, w5), tl.join(w3, w7)))


# one compile serves every row count and every split of K (a sweep compiles each tile twice:
# whole K, split K)
@triton.jit(do_not_specialize=["M", "SPLIT_K"])
def _w4a16_swap_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, x_desc, M, N, K,
                       stride_qw, stride_xm, stride_om, stride_os, SPLIT_K, G: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, PARTIAL: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                       PER_WEIGHT: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr,
                       OFFSET: tl.constexpr, NUM_STAGES: tl.constexpr, TMA: tl.constexpr,
                       FRAG: tl.constexpr, PW16: tl.constexpr):
    """Operands swapped: program (pid, pid_k) computes y^T [BLOCK_N features, BLOCK_M rows]
    over its share of the K tiles as (weight tile [BLOCK_N, BLOCK_K]) . x^T [BLOCK_K,
    BLOCK_M]: the weight tile is the MMA's A operand (64 features a warpgroup), the rows of
    x its N side (16..256). PER_WEIGHT: the tile dequantized, (q - z) * s rounded to x's
    dtype (``_dequant_words``), the MMAs accumulating into acc (the tile may span groups);
    else q - z (exact in 16 bits) and the group's scale, one per feature (BLOCK_K divides
    G), on each tile's sums. Tiles in GROUP_M-wide bands of row tiles, the row tile the
    fastest index, so neighbouring programs read the same weight tile (from L2). Rows and
    features past the ends read row 0 / feature 0 (never stored): no masks on the loads.

    FRAG (kernels/int4_fragment.py): BLOCK_K 128, 4 warps, x's K in the fragment order
    (x_ptr / x_desc are ``fragment_x``'s copy); the words loaded in ``wgmma_a_rows``'s row
    order and decoded in place into wgmma's A fragment (``fragment_tile``): PER_WEIGHT by
    ``dequant16_8`` (PW16: the scales are x's type; PTX its ``dequant16_ptx``) or
    ``_dequant8``, else q - z by ``qz8`` and the scale on the sums (PTX ``_unpack_ptx``)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (offs_n % N).to(tl.int64)
    rm = (offs_m % M).to(tl.int64)
    NG = K // G
    if FRAG:  # the words, and what decodes them, in the fragment's row order
        rl = (wgmma_a_rows(pid_n, BLOCK_N) % N).to(tl.int64)
    else:
        rl = rn
    qw_rows = qw_ptr + rl[:, None] * stride_qw
    if FRAG and not PER_WEIGHT:  # the scale goes on the sums: feature order
        s_rows = s_ptr + rn[:, None] * NG
    else:
        s_rows = s_ptr + rl[:, None] * NG
    z_rows = z_ptr + rl[:, None] * NG
    x_cols = x_ptr + rm[None, :] * stride_xm
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    tiles = K // BLOCK_K
    per_split = tl.cdiv(tiles, SPLIT_K)
    start = pid_k * per_split
    end = tl.minimum(start + per_split, tiles)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # the scales and zero points (1-2 bytes a feature, too narrow for cp.async) one tile
    # ahead by hand; the words and x's tiles through Triton's pipeliner (cp.async copies
    # NUM_STAGES - 1 tiles ahead)
    sn, zn = _groups(s_rows, z_rows, start, end, G, BLOCK_K)
    for t in tl.range(start, end, num_stages=NUM_STAGES):
        packed = tl.load(qw_rows + (t * (BLOCK_K // 8) + offs_w)[None, :])
        if TMA:  # x's tile [BLOCK_M, BLOCK_K] by one TMA box (zeros past M), transposed
            xt = tl.trans(x_desc.load([pid_m * BLOCK_M, t * BLOCK_K]))
        else:
            xt = tl.load(x_cols + (t * BLOCK_K + offs_k)[:, None])  # [BLOCK_K, BLOCK_M]
        s, z = sn, zn
        sn, zn = _groups(s_rows, z_rows, t + 1, end, G, BLOCK_K)
        if FRAG:
            if PER_WEIGHT:
                if PW16:  # (q - z) * s in packed 16-bit PTX, 3 instructions a pair
                    n0, n1, n2, n3, n4, n5, n6, n7 = dequant16_8(packed, s, z, DT, PTX, OFFSET)
                else:  # fp32 FMAs, rounded once
                    n0, n1, n2, n3, n4, n5, n6, n7 = _dequant8(packed, s, z, DT, ASM)
                w = fragment_tile(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N)
                acc = tl.dot(w, xt, acc, input_precision=PRECISION)
                if ASM:  # the MMAs done before the next tile's decode reuses w's registers
                    wgmma_drain(t)
            else:  # q - z, the scale on the sums
                n0, n1, n2, n3, n4, n5, n6, n7 = qz8(packed, z, DT, ASM, PTX, OFFSET)
                w = fragment_tile(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N)
                acc += tl.dot(w, xt, input_precision=PRECISION) * s.to(tl.float32)
        elif PER_WEIGHT:
            w = tl.reshape(_dequant_words(packed, s, z, DT, ASM), (BLOCK_N, BLOCK_K))
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        else:
            if ASM:  # q - z in x's dtype, two an instruction
                w5 = _unpack_words_asm(packed, z, DT, PTX, OFFSET)
            else:  # q - z in fp32
                w5 = _unpack_words(packed, z)
            w = tl.reshape(w5, (BLOCK_N, BLOCK_K)).to(DT)
            acc += tl.dot(w, xt, input_precision=PRECISION) * s.to(tl.float32)
    out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m[None, :].to(tl.int64) * stride_om \
        + offs_n[:, None]
    if PARTIAL:  # fp32 partial sums of split pid_k, added (and the bias) after
        tl.store(out, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _groups(s_rows, z_rows, t, end, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """K tile t's scales and zero points: [BN, 1] where the tile lies in one group
    (BLOCK_K <= G), else one per word [BN, BLOCK_K / 8] (a word lies in one group); zero
    past ``end`` (the look-ahead after the last tile)."""
    live = t < end
    k0 = t * BLOCK_K
    if BLOCK_K <= G:
        s = tl.load(s_rows + k0 // G, mask=live, other=0.0)
        z = tl.load(z_rows + k0 // G, mask=live, other=0)
    else:
        groups = (k0 + tl.arange(0, BLOCK_K // 8) * 8) // G
        s = tl.load(s_rows + groups[None, :], mask=live, other=0.0)
        z = tl.load(z_rows + groups[None, :], mask=live, other=0)
    return s, z


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, G: tl.constexpr, TG: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    w = _dequant_tile(qw_ptr, s_ptr, z_ptr, offs_n, n_mask, k0, K // 8, K // G, G, TG,
                      BLOCK_N, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None])


# ----------------------------------------------------------------------------- launchers
@dataclass(frozen=True)
class Int4Config:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1  # 0: chosen from the GPU's SM count at the call
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}st{self.num_stages}")


SKINNY = Int4Config(16, 64, 128, split_k=0, num_warps=4, num_stages=4)  # 1-16 rows
GEMM = Int4Config(64, 128, 64, split_k=0, num_warps=4, num_stages=3)  # 17+ rows


# activations' dtype -> (16-bit pattern of a float whose last mantissa bit is worth 1, its value)
MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}
# Off: the offset's terms (128 + q times x) dwarf the result before 128 * sum(x) is taken
# off again, on tensor cores whose fp32 sums are not exact. On the H200 it bought nothing
# measurable (qkv at one row 53.2 us with it, run 165; 52.3 without, run 166), and the
# GPU checks that missed the reference in a few elements missed it as much without it: the
# reference was as far from fp32 as ours (benchmarks/int4_check.py, run 167).
USE_MAGIC = False


def default_config(m: int) -> Int4Config:
    return SKINNY if m <= 16 else GEMM


def kernel_supports(k: int, g: int) -> bool:
    """Whether ``w4a16_matmul`` takes a K-wide weight in groups of G on the GPU: its K tiles
    (dividing K and G, or G dividing them) must be 16 wide at least for ``tl.dot``."""
    return _block_k(k, g, 16, within_group=True) == 16


def check_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> int:
    """Checks the layout's shapes and dtypes; returns the group size G."""
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"qweight must be int32 [N, K/8], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    if scales.dim() != 2 or scales.shape[0] != n or scales.shape[1] == 0 \
            or k % scales.shape[1]:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit a [{n}, {k}] weight "
                         "(expected [N, K/G])")
    if zeros.shape != scales.shape or zeros.dtype != torch.uint8:
        raise ValueError(f"zeros must be uint8 of the scales' shape {tuple(scales.shape)}, got "
                         f"{zeros.dtype} {tuple(zeros.shape)}")
    g = k // scales.shape[1]
    if g % PACK:
        raise ValueError(f"group size {g} is not a multiple of {PACK}")
    return g


def _block_k(k: int, g: int, want: int, within_group: bool = False) -> int:
    """The largest power of two <= want dividing K, and dividing G or divided by it
    (``within_group``: dividing G: each K tile in one group)."""
    bk = want
    while bk > PACK and (k % bk or (g % bk and (within_group or bk % g))):
        bk //= 2
    return bk


def _split_k(tiles_n: int, tiles_m: int, k_tiles: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    from flashpage.kernels.device import num_sms

    target = 2 * num_sms(device)
    split = 1
    while tiles_n * tiles_m * split * 2 <= target and split * 2 <= k_tiles:
        split *= 2
    return split


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, bias: torch.Tensor | None = None,
                 config: Int4Config | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32, rows contiguous) @ the int4 weight -> [M, N] in x's
    dtype (+ bias [N])."""
    g = check_int4(qweight, scales, zeros)
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a [{n}, {k}] weight")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    cfg = config or default_config(m)
    bk = _block_k(k, g, cfg.block_k, within_group=True)
    tiles_n, tiles_m = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m)
    split = cfg.split_k or _split_k(tiles_n, tiles_m, k // bk, x.device)
    split = max(1, min(split, k // bk))
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    if m == 0:
        return out if split == 1 else out.sum(0).to(x.dtype)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _w4a16_kernel[(tiles_n, tiles_m, split)](
        x, qweight, scales, zeros, bias if bias is not None else x, out, m, n, k, x.stride(0),
        n, m * n, G=g, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        SPLIT_K=split, HAS_BIAS=bias is not None, PRECISION=precision,
        MAGIC=MAGIC.get(x.dtype, (0, 0.0))[0] if USE_MAGIC else 0,
        OFFSET=MAGIC.get(x.dtype, (0, 0.0))[1] if USE_MAGIC else 0.0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split == 1:
        return out
    y = out.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype, block_n: int = 64, block_k: int = 128) -> torch.Tensor:
    """The weight as ``dtype`` [N, K], by one kernel (the bits of ``dequantize_int4_ref``)."""
    g = check_int4(qweight, scales, zeros)
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    bk = _block_k(k, g, block_k)
    out = torch.empty(n, k, device=qweight.device, dtype=dtype)
    _dequant_kernel[(triton.cdiv(n, block_n), k // bk)](
        qweight, scales, zeros, out, n, k, G=g, TG=min(g, bk), BLOCK_N=block_n, BLOCK_K=bk)
    return out


# ----------------------------------------------------------------------------- the swapped GEMM
@dataclass(frozen=True)
class Int4GemmConfig:
    """A tile of ``w4a16_gemm`` (``_w4a16_swap_kernel``): block_m rows of x (the MMA's N
    side, 16..256) by block_n features (64 a warpgroup) by block_k of K; ``per_weight``:
    the weight tile dequantized before the MMA (else q - z and the scale on each tile's
    sums); group_m: row tiles a band (neighbours share the weight tile); ``fragment``: the
    weight tile decoded straight into wgmma's A fragment (kernels/int4_fragment.py; block_k
    128, block_n a multiple of 64, 4 warps, x's K reordered once a call)."""
    block_m: int = 128
    block_n: int = 64
    block_k: int = 128
    split_k: int = 0  # 0: chosen from the GPU's SM count at the call (1 off the GPU)
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    per_weight: bool = True
    tma: bool = False  # x's tiles by TMA (one box a tile), else cp.async copies
    fragment: bool = False  # decoded in wgmma's A fragment (no shared round trip)

    @property
    def name(self) -> str:
        return (f"{'f' if self.fragment else ''}{'w' if self.per_weight else 'p'}"
                f"m{self.block_m}n{self.block_n}"
                f"k{self.block_k}s{self.split_k}w{self.num_warps}st{self.num_stages}"
                f"g{self.group_m}{'t' if self.tma else ''}")


def parse_gemm_config(name: str) -> Int4GemmConfig:
    """The config an ``Int4GemmConfig.name`` names, e.g. ``wm128n64k128s0w4st3g8``: a
    leading f for the fragment tiles, w / p (dequantized per weight / scale on the sums), block_m, block_n, block_k, split_k,
    num_warps, num_stages, group_m, and a trailing t for x's tiles by TMA."""
    import re

    match = re.fullmatch(r"(f?)([wp])m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)g(\d+)(t?)",
                         name.strip())
    if match is None:
        raise ValueError(f"{name!r} is not a config name such as wm128n64k128s0w4st3g8")
    frag, kind, *nums, tma = match.groups()
    bm, bn, bk, split, warps, stages, group = map(int, nums)
    return Int4GemmConfig(bm, bn, bk, split, warps, stages, group, per_weight=kind == "w",
                          tma=tma == "t", fragment=frag == "f")


# The tiles benchmarks/int4_gemm.py --sweep times (a first list from the sm_90 SASS): 64 /
# 128 features (one or two warpgroups), 64-256 rows, K tiles of 64 / 128, 3-4 stages, both
# forms of the scale, x by cp.async or TMA (none spills for sm_90; the scale-on-the-sums
# form at 256 x 128 x 64 on 8 warps did: 960 bytes; TMA leaves the per-weight form ~30-50
# fewer registers). Run 196 (H200): 64 features on 4 warps won at every shape and size;
# 256 x 128 x 64 on 8 warps with TMA and 4 stages computed garbage on the GPU (its GPU test
# failed: ~1e20 off) and is no longer a candidate.
GEMM_CANDIDATES = (
    Int4GemmConfig(64, 64, 128, 0, 4, 4),
    Int4GemmConfig(128, 64, 128, 0, 4, 3),
    Int4GemmConfig(128, 64, 128, 0, 4, 4),
    Int4GemmConfig(128, 64, 64, 0, 4, 4),
    Int4GemmConfig(128, 128, 64, 0, 8, 3),
    Int4GemmConfig(256, 64, 64, 0, 4, 3),
    Int4GemmConfig(256, 128, 64, 0, 8, 3),
    Int4GemmConfig(64, 64, 128, 0, 4, 4, per_weight=False),
    Int4GemmConfig(128, 64, 128, 0, 4, 3, per_weight=False),
    Int4GemmConfig(128, 64, 128, 0, 4, 3, tma=True),
    Int4GemmConfig(256, 64, 64, 0, 4, 3, tma=True),
    # the fragment tiles (kernels/int4_fragment.py), compiled for sm_90a: no shared round trip
    # of the decoded tile, nothing spilled (the scale-on-the-sums form at 256 rows spilled
    # 1,160 bytes, block_n 128 on 4 warps went through shared memory: not candidates)
    Int4GemmConfig(64, 64, 128, 0, 4, 4, per_weight=False, fragment=True),
    Int4GemmConfig(128, 64, 128, 0, 4, 3, per_weight=False, tma=True, fragment=True),
    Int4GemmConfig(128, 64, 128, 0, 4, 3, tma=True, fragment=True),
    Int4GemmConfig(128, 64, 128, 0, 4, 4, tma=True, fragment=True),
    Int4GemmConfig(256, 64, 128, 0, 4, 3, tma=True, fragment=True),  # 205 KB of shared memory
    Int4GemmConfig(256, 64, 128, 0, 4, 2, tma=True, fragment=True),
)


def gemm_config(m: int, n: int, k: int, g: int = 128,
                dtype: torch.dtype | None = None) -> Int4GemmConfig:
    """The tile for m rows of a [n, k] weight in groups of g under activations of ``dtype``.
    Run 196's sweep (H200, the 8B's four shapes at 64-2048 rows, benchmarks/int4_gemm.py
    --sweep) chose among the tiles that dequantize through shared memory: up to 64 rows 64 x
    64 x 128 with the scale on the sums; up to 128, 128 x 64 x 128 per weight, 3 stages, x by
    TMA; past that 256 x 64 x 64, 3 stages, TMA. Run 201 (the same sweep at 64-256 rows, bf16)
    timed the fragment tiles (kernels/int4_fragment.py: the decoded weights in wgmma's A
    registers): the scale-on-the-sums ones won at 64 rows on every shape (64 x 64: 0.71-0.99x
    the older tile's time), at 128 (128 x 64: 0.73-0.97x) and at 256 on the four shapes
    together (0.92x; 1.04x on down), lost 5% at 100 rows; so for 16-bit x, groups a multiple
    of 128 and K of 128, they are the default at 64-256 rows. fp16 x too since run 206
    showed these two tiles right there (the 8B's shapes, bias, 64-256 rows; run 201's fp16
    failures were per-weight fragment tiles, see test_fragment_tiles_on_the_gpu) and their
    sm_90a K loops are the bf16 ones' instruction for instruction (238 / 281 SASS a K tile;
    untimed in fp16). Not for groups under 128 (per-weight scales)."""
    if m <= 64:
        old = Int4GemmConfig(64, 64, 128, 0, 4, 4, per_weight=False)
    elif m <= 128:
        old = Int4GemmConfig(128, 64, 128, 0, 4, 3, tma=True)
    else:
        old = Int4GemmConfig(256, 64, 64, 0, 4, 3, tma=True)
    if dtype not in (torch.bfloat16, torch.float16):
        return old
    frag = Int4GemmConfig(64 if m <= 64 else 128, 64, 128, 0, 4, 4 if m <= 64 else 3,
                          per_weight=False, tma=m > 64, fragment=True)
    return old if fragment_reasons(k, g, frag) else frag


def gemm_block_k(k: int, g: int, cfg: Int4GemmConfig) -> int:
    """The K tile ``w4a16_gemm`` runs: a power of two <= cfg.block_k dividing K and G or a
    multiple of G (``per_weight``; dividing G otherwise: the scale goes on the tile's sums)."""
    return _block_k(k, g, cfg.block_k, within_group=not cfg.per_weight)


def fragment_reasons(k: int, g: int, cfg: Int4GemmConfig) -> list[str]:
    """Why the fragment tiles (``cfg.fragment``) cannot run a K-wide weight in groups of G
    with ``cfg`` ([] if they can)."""
    why = []
    if cfg.block_k != FRAG_K:
        why.append(f"block_k {cfg.block_k} is not {FRAG_K} (a row's 16 words)")
    if cfg.block_n != 64:  # 128 on 4 warps: the tile went through shared memory and spilled
        why.append(f"block_n {cfg.block_n} is not 64 (one warpgroup's rows)")
    if cfg.num_warps != 4:
        why.append(f"num_warps {cfg.num_warps} is not 4 (the row order is one warpgroup's)")
    if k % FRAG_K:
        why.append(f"K={k} is not a multiple of {FRAG_K}")
    if cfg.per_weight and g > FRAG_K and g % FRAG_K:
        why.append(f"group size {g} neither divides {FRAG_K} nor is a multiple of it")
    if not cfg.per_weight and g % FRAG_K:
        why.append(f"group size {g} is not a multiple of {FRAG_K} (the scale on the sums)")
    return why


def gemm_supports(k: int, g: int) -> bool:
    """Whether ``w4a16_gemm``'s default tiles take a K-wide weight in groups of G: K tiles
    of 16 at least (the 16-bit MMA's K)."""
    return k % PACK == 0 and g % PACK == 0 and k % g == 0 \
        and gemm_block_k(k, g, Int4GemmConfig()) >= 16


def _gemm_split_k(tiles: int, k_tiles: int, device: torch.device) -> int:
    """K's split: doubled while the tiles do not cover the SMs and each split keeps 4 K
    tiles at least (1 off the GPU)."""
    if device.type != "cuda":
        return 1
    from flashpage.kernels.device import num_sms

    split = 1
    while tiles * split < num_sms(device) and split * 2 <= k_tiles // 4:
        split *= 2
    return split


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, bias: torch.Tensor | None = None,
               config: Int4GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) @ the int4 weight -> [M, N] in x's dtype (+ bias [N]),
    by ``_w4a16_swap_kernel`` (the weight tile the MMA's A operand, x^T its B): built for
    prompt steps and decode batches past the GEMV's 64 rows; any M. fp32 accumulation."""
    g = check_int4(qweight, scales, zeros)
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a [{n}, {k}] weight")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] in x's dtype {x.dtype}, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    m = x.shape[0]
    cfg = config or gemm_config(m, n, k, g, x.dtype)
    if cfg.fragment:
        if why := fragment_reasons(k, g, cfg):
            raise ValueError(f"{cfg.name}: the fragment tiles cannot run this weight: "
                             + "; ".join(why))
        bk = FRAG_K
    else:
        bk = gemm_block_k(k, g, cfg)
    if bk < 16:
        raise ValueError(f"w4a16_gemm needs K tiles of 16 at least (K={k}, G={g}, {cfg.name}); "
                         "see gemm_supports")
    if x.stride(1) != 1:
        x = x.contiguous()
    from flashpage.kernels.device import interpreting

    asm = x.dtype in _UNPACK_TYPES and not interpreting()
    # the packed 16-bit per-weight decode: the reference's bits where the scales are x's type
    pw16 = cfg.fragment and cfg.per_weight and asm and scales.dtype == x.dtype
    if cfg.fragment:
        x = fragment_x(x)  # K in the fragment's order, one copy
        ptx = dequant16_ptx(x.dtype) if pw16 else \
            (_unpack_ptx(x.dtype) if asm and not cfg.per_weight else "")
    else:
        ptx = _unpack_ptx(x.dtype) if asm and not cfg.per_weight else ""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or _gemm_split_k(tiles, k // bk, x.device)
    split = max(1, min(split, k // bk))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    x_desc = None
    if cfg.tma and x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.block_m, bk])
    from flashpage.kernels.tma_maps import cached_tma_maps

    # the CUtensorMap encoded once per (address, shape), not at every launch
    with cached_tma_maps(enabled=x_desc is not None and x.is_cuda):
        _w4a16_swap_kernel[(tiles, split)](
            x, qweight, scales, zeros, bias if bias is not None else y, out, x_desc, m, n, k,
            qweight.stride(0), x.stride(0), n, m * n, split, G=g, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=cfg.group_m, PARTIAL=split > 1,
            HAS_BIAS=bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            PER_WEIGHT=cfg.per_weight, ASM=asm, PTX=ptx,
            OFFSET=_UNPACK_TYPES[x.dtype][1] if ptx else 0.0,
            NUM_STAGES=cfg.num_stages, TMA=x_desc is not None, FRAG=cfg.fragment, PW16=pw16,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        from flashpage.kernels.int4_gemv import _split_sum_kernel

        _split_sum_kernel[(triton.cdiv(m * n, 1024),)](
            out, bias if bias is not None else out, y, m * n, n, SPLIT_K=split,
            HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    return y

