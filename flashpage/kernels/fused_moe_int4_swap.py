"""Form "swap" of kernels/fused_moe_int4.py (its module docstring; the launcher, config and
reference live there): the int4 experts' K tiles decoded into wgmma's A fragment.

    out^T [BN, BM] = sum over K tiles of s[:, g] * ((q - z)[:, tile] . x[rows, tile]^T)

MXFP4's "swap" layout (kernels/fused_moe.py: _swap_x, _swap_tile; kernels/tiles.py: wgmma_a_rows) carries over
unchanged, since our int4 packing (nibble j of word c = K 8c + j) is e2m1's; only the decode
and the scale differ: q - z exact in x's dtype (inline PTX on the GPU, two a lop3 + packed
fma: ``word_ptx``), and the group's scale on each K tile's fp32 sums (a K tile of 128 lies
in one group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.fused_moe import _swap_tile
from flashpage.kernels.int4_gemm import _UNPACK_TYPES, _unpack_ptx
from flashpage.kernels.tiles import moe_block, wgmma_a_rows


@triton.jit
def _x_tile(a_col, k0):
    """fused_moe._swap_x unmasked: x[rows, k0:k0 + 128].T [128, BM] in its K order (_swap_k),
    ``a_col`` [1, BM] the rows' pointers (padding rows token 0's: real memory; K a multiple
    of 128)."""
    a = tl.load(a_col + (k0 + tl.arange(0, 128))[:, None])
    bm: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.reshape(a, (4, 4, 2, 4, bm)), (1, 3, 0, 2, 4)), (128, bm))


@triton.jit
def _swap_k(k):
    """fused_moe._swap_x's K order: where natural K (within each 128) 32q + 8u + 4h + r
    goes, 32u + 8r + 2q + h. The gate_up kernel stores act in it, so the down kernel reads
    its K tiles as they lie (no permute of them in its loop)."""
    kn = k % 128
    return k - kn + 32 * ((kn // 8) % 4) + 8 * (kn % 4) + 2 * (kn // 32) + (kn // 4) % 2


# fp16's decode of a word with one shift where kernels/int4_gemm's _unpack_ptx (bf16's, and
# the PTX ``word_ptx`` gives for bf16) takes three: bf16's 7 mantissa bits hold a nibble at
# bits 0-3 of each half only, fp16's 10 hold one at bits 0-3 (ORed into 1024.0 = 0x6400,
# whose last bit is worth 1: 1024 + q) or at bits 4-7 (into 64.0 = 0x5400, whose last bit
# is worth 1/16: 64 + q). So the word and the word >> 8 give the four pairs of nibbles
# (j, j + 4), 16 bits apart, each by one lop3 (a & mask | magic) and one packed fma
# (x * 1 + $9 = -(1024 + z), or + $10 = -(64 + z)), all exact. Out: $i = nibble i's q - z.
F16_WORD_PTX = """{
.reg .b32 w8, p, nzl, nzh, one, ml, mh, cl, ch;
mov.b32 nzl, {$9, $9};
mov.b32 nzh, {$10, $10};
mov.b32 one, 0x3C003C00;
mov.b32 ml, 0x000F000F;
mov.b32 mh, 0x00F000F0;
mov.b32 cl, 0x64006400;
mov.b32 ch, 0x54005400;
lop3.b32 p, $8, ml, cl, 0xEA;
fma.rn.f16x2 p, p, one, nzl;
mov.b32 {$0, $4}, p;
lop3.b32 p, $8, mh, ch, 0xEA;
fma.rn.f16x2 p, p, one, nzh;
mov.b32 {$1, $5}, p;
shr.u32 w8, $8, 8;
lop3.b32 p, w8, ml, cl, 0xEA;
fma.rn.f16x2 p, p, one, nzl;
mov.b32 {$2, $6}, p;
lop3.b32 p, w8, mh, ch, 0xEA;
fma.rn.f16x2 p, p, one, nzh;
mov.b32 {$3, $7}, p;
}"""


def word_ptx(dtype: torch.dtype) -> tuple[str, float]:
    """(the inline PTX, its OFFSET) _int4_word runs for x of ``dtype`` (bf16 / fp16)."""
    if dtype == torch.float16:
        return F16_WORD_PTX, 1024.0
    if dtype == torch.bfloat16:
        return _unpack_ptx(dtype), _UNPACK_TYPES[dtype][1]
    raise ValueError(f"no inline-PTX int4 decode for {dtype} (bf16 / fp16 only)")


@triton.jit
def _int4_word(word, z, DT: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr,
               OFFSET: tl.constexpr):
    """int32 words (8 nibbles, nibble j at bits 4j) and their zero points (uint8, same
    shape) -> 8 tensors q - z in DT (exact: |q - z| <= 16), nibbles 0, 4, 1, 5, 2, 6, 3, 7
    (fused_moe._swap_tile's order). ASM (bf16 / fp16 on the GPU; PTX and OFFSET
    ``word_ptx``'s): one lop3 + one packed fma a pair of nibbles (j, j + 4), ORed into the
    mantissas of a 16-bit magic in one 32-bit register, the magic + z taken off both (bf16
    kernels/int4_gemm's _unpack_ptx, three shifts a word; fp16 F16_WORD_PTX, one);
    otherwise shifts and masks, q - z in fp32, then DT."""
    if ASM:
        zf = z.to(tl.float32)
        if DT.value.is_fp16():
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                PTX.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
                [word, (-(zf + 1024.0)).to(DT), (-(zf + 64.0)).to(DT)],  # exact
                dtype=(DT.value,) * 8, is_pure=True, pack=1)
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                PTX.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [word, (-(zf + OFFSET)).to(DT)],
                dtype=(DT.value,) * 8, is_pure=True, pack=1)
        return n0, n4, n1, n5, n2, n6, n3, n7
    else:
        w = word.to(tl.uint32, bitcast=True)
        zf = z.to(tl.float32)
        return (((w & 0xF).to(tl.float32) - zf).to(DT),
                (((w >> 16) & 0xF).to(tl.float32) - zf).to(DT),
                (((w >> 4) & 0xF).to(tl.float32) - zf).to(DT),
                (((w >> 20) & 0xF).to(tl.float32) - zf).to(DT),
                (((w >> 8) & 0xF).to(tl.float32) - zf).to(DT),
                (((w >> 24) & 0xF).to(tl.float32) - zf).to(DT),
                (((w >> 12) & 0xF).to(tl.float32) - zf).to(DT),
                ((w >> 28).to(tl.float32) - zf).to(DT))


@triton.jit
def _swap_w4(w_rowp, z_rowp, k0, g, BLOCK_N: tl.constexpr, DT: tl.constexpr,
             ASM: tl.constexpr, PTX: tl.constexpr, OFFSET: tl.constexpr):
    """q - z of W[:, k0:k0 + 128] in DT, [BN, 128] (wgmma's first operand: rows in channel
    order, K in fused_moe._swap_x's), the tile inside group g. ``w_rowp`` [BN, 1] the rows'
    word pointers in load order (tiles.wgmma_a_rows; rows past the end wrapped to real
    ones: no masks), ``z_rowp`` [BN, 1] their zero points'. A thread loads 4 words (16
    bytes) of a row and decodes them in place: as MXFP4's "swap" (fused_moe._swap_w), the
    word load's layout is wgmma's A fragment's, so no value passes through shared memory."""
    offs_w = k0 // 8 + tl.arange(0, 16)
    word = tl.load(w_rowp + offs_w[None, :])  # [BN, 16]
    z = tl.broadcast_to(tl.load(z_rowp + g), (BLOCK_N, 16))
    o0, o1, o2, o3, o4, o5, o6, o7 = _int4_word(word, z, DT, ASM, PTX, OFFSET)
    return _swap_tile(o0, o1, o2, o3, o4, o5, o6, o7, BLOCK_N)


@triton.jit
def _int4_swap_gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, act_ptr, sorted_ptr,
                              block_expert_ptr, num_pairs, top_k, hidden, inter, stride_xt,
                              stride_we, stride_wn, stride_se, stride_sn, stride_ar,
                              G: tl.constexpr, DT: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                              ASM: tl.constexpr, PTX: tl.constexpr, OFFSET: tl.constexpr):
    """_int4_gate_up_kernel's act by form "swap": per K tile of 128 (in one group) the
    transposed sums [BN, BM] = (q - z) . x^T (_swap_w4, _x_tile), times the group's scale
    (one per feature) into fp32 accumulators."""
    expert = tl.load(block_expert_ptr + tl.program_id(1))
    if expert < 0:  # a padding block (moe_align)
        return
    pid_n, rows, pair, valid, token = moe_block(sorted_ptr, num_pairs, top_k, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # channel order (the sums' rows)
    n_mask = offs_n < inter
    # rows past the end read real ones (their sums are never stored): no masks in the loop
    arow = wgmma_a_rows(pid_n, BLOCK_N) % inter  # load order (the words' rows)
    e64 = expert.to(tl.int64)
    up_w = inter.to(tl.int64) * stride_wn
    up_s = inter.to(tl.int64) * stride_sn
    w_rowp = w_ptr + e64 * stride_we + arow[:, None].to(tl.int64) * stride_wn
    z_rowp = z_ptr + e64 * stride_se + arow[:, None].to(tl.int64) * stride_sn
    s_row = s_ptr + e64 * stride_se + (offs_n % inter).to(tl.int64) * stride_sn
    a_col = x_ptr + token[None, :] * stride_xt
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, hidden, 128):
        g = k0 // G
        a = _x_tile(a_col, k0)
        s_g = tl.load(s_row + g).to(tl.float32)
        s_u = tl.load(s_row + up_s + g).to(tl.float32)
        w_g = _swap_w4(w_rowp, z_rowp, k0, g, BLOCK_N, DT, ASM, PTX, OFFSET)
        acc_g += tl.dot(w_g, a, input_precision=PRECISION) * s_g[:, None]
        w_u = _swap_w4(w_rowp + up_w, z_rowp + up_s, k0, g, BLOCK_N, DT, ASM, PTX, OFFSET)
        acc_u += tl.dot(w_u, a, input_precision=PRECISION) * s_u[:, None]
    gate = tl.trans(acc_g).to(DT).to(tl.float32)  # each projection output in the model dtype
    up = tl.trans(acc_u).to(DT).to(tl.float32)
    act = ((gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32) * up).to(DT)
    # each row's features in _swap_k's order (the down kernel's K)
    out = act_ptr + rows[:, None].to(tl.int64) * stride_ar + _swap_k(offs_n)[None, :]
    # padding rows too (token 0's act): the down kernel reads its tiles unmasked
    tl.store(out, act, mask=n_mask[None, :])


@triton.jit
def _int4_swap_down_kernel(a_ptr, w_ptr, s_ptr, z_ptr, topk_w_ptr, ys_ptr, sorted_ptr,
                           block_expert_ptr, num_pairs, hidden, inter, stride_ar, stride_we,
                           stride_wn, stride_se, stride_sn, stride_yp, G: tl.constexpr,
                           DT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           PRECISION: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr,
                           OFFSET: tl.constexpr):
    """_int4_down_kernel's ys by form "swap" (as _int4_swap_gate_up_kernel's sums)."""
    expert = tl.load(block_expert_ptr + tl.program_id(1))
    if expert < 0:  # a padding block (moe_align)
        return
    pid_n, rows, pair, valid, _ = moe_block(sorted_ptr, num_pairs, 1, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    arow = wgmma_a_rows(pid_n, BLOCK_N) % hidden  # rows past the end wrapped (never stored)
    e64 = expert.to(tl.int64)
    w_rowp = w_ptr + e64 * stride_we + arow[:, None].to(tl.int64) * stride_wn
    z_rowp = z_ptr + e64 * stride_se + arow[:, None].to(tl.int64) * stride_sn
    s_row = s_ptr + e64 * stride_se + (offs_n % hidden).to(tl.int64) * stride_sn
    a_col = a_ptr + rows[None, :].to(tl.int64) * stride_ar  # act's K in _swap_k's order
    offs_k = tl.arange(0, 128)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, inter, 128):
        g = k0 // G
        s = tl.load(s_row + g).to(tl.float32)
        w = _swap_w4(w_rowp, z_rowp, k0, g, BLOCK_N, DT, ASM, PTX, OFFSET)
        a = tl.load(a_col + (k0 + offs_k)[:, None])  # padding rows too (gate_up wrote them)
        acc += tl.dot(w, a, input_precision=PRECISION) * s[:, None]
    weight = tl.load(topk_w_ptr + pair, mask=valid, other=0.0)
    y = tl.trans(acc).to(DT).to(tl.float32) * weight[:, None]
    out = ys_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_yp + offs_n[None, :]
    tl.store(out, y.to(DT), mask=valid[:, None] & n_mask[None, :])
