"""The "fragment" tiles of the swapped W4A16 GEMM (kernels/int4_gemm.py ``w4a16_gemm``,
``Int4GemmConfig.fragment``): the int4 weight tile decoded straight into wgmma's A fragment
in registers, no shared-memory round trip of the decoded values (kernels/fused_moe.py's
MXFP4 form "swap" applied to the dense int4 layout, whose words hold nibble j of a word at
bits 4j, K order, as MXFP4's bytes read as words do).

A K tile is 128 wide: a row's 16 words, 4 a thread (one 16-byte load), rows loaded in the
order ``tiles.wgmma_a_rows`` gives so that each thread loads the rows it holds in the A
fragment. A 32-bit word's nibbles j and j + 4 lie 16 bits apart, so one lop3 puts both in
the mantissas of the 16-bit float OFFSET (bf16 128, fp16 1024): the pair OFFSET + q, packed
in one register, which is one register of the fragment. The tile's K order is then not the
weight's: thread c of a quad holds words 4c..4c+3 of a row (natural K 32c + 8u + 4h + r for
word u, nibble r + 4h), the fragment's K position of that value is k' = 32u + 8r + 2c + h.
The sum over K does not care in which order its terms come, so x's K is put in the same
order once per call (``fragment_x``: a copy of x, [M, K], K a multiple of 128) and its tiles
reach wgmma from shared memory as before (cp.async or TMA).

Two decodes (the kernel's PER_WEIGHT):

    per weight   (q - z) * s in x's dtype: where the scales are x's 16-bit type (fp16 AWQ /
                 GPTQ scales under fp16 activations) by packed 16-bit PTX, 3 instructions a
                 pair (lop3: OFFSET + q; fma: - (OFFSET + z), exact; mul by the scale: one
                 rounding of the exact product, the bits of ``dequantize_int4_ref``); else
                 (bf16 x under fp16 scales, whose values bf16 cannot hold) the fp32 FMA of
                 kernels/int4_gemm.py's per-weight form (the reference's bits too). MMAs
                 accumulate into one accumulator; groups of any size dividing 128 or a
                 multiple of it
    on the sums  q - z in x's dtype (lop3 + fma a pair, exact), the group's scale on each
                 tile's fp32 sums (one FFMA an output element a tile): groups a multiple of
                 128
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FRAG_K = 128  # the K tile of the fragment tiles (a row's 16 words)

# PTX of one packed word and -(OFFSET + zero) (and, ``scaled``, the scale; each in x's 16-bit
# type) -> its 8 weights q - z (or (q - z) * s): each pair of nibbles (j, j + 4) masked into
# the mantissas of OFFSET (one lop3: OFFSET + q, exact), OFFSET + z taken off (fma by 1: q - z,
# exact), ``scaled``: times the scale (one rounding of the exact product). Outputs $0-$3
# nibbles 0-3, $4-$7 nibbles 4-7 ({$j, $j+4} one register: the fragment's pair). The unscaled
# text is kernels/int4_gemm's _unpack_ptx (its GEMV and GEMM, the int4 MoE "swap" for bf16).
def packed_nibbles_ptx(dtype: torch.dtype, scaled: bool) -> str:
    """The PTX above for activations (and scales) of ``dtype`` (bf16 / fp16)."""
    magic, _, one, ty = DEQUANT16_TYPES[dtype]
    lines = ["{", f".reg .b32 w, t, p, nz, {'sc, ' if scaled else ''}one, mask, magic;",
             "mov.b32 w, $8;", "mov.b32 nz, {$9, $9};"]
    if scaled:
        lines.append("mov.b32 sc, {$10, $10};")
    lines += [f"mov.b32 one, {one};", "mov.b32 mask, 0x000F000F;", f"mov.b32 magic, {magic};"]
    for j in range(4):
        if j:
            lines.append(f"shr.u32 t, w, {4 * j};")
        lines += [f"lop3.b32 p, {'t' if j else 'w'}, mask, magic, 0xEA;",
                  f"fma.rn.{ty} p, p, one, nz;"]
        if scaled:
            lines.append(f"mul.rn.{ty} p, p, sc;")
        lines.append(f"mov.b32 {{${j}, ${j + 4}}}, p;")
    return "\n".join(lines + ["}"])


# x's dtype -> (its 16-bit pattern of OFFSET twice, OFFSET, the pair (1.0, 1.0), the PTX type)
DEQUANT16_TYPES = {torch.bfloat16: ("0x43004300", 128.0, "0x3F803F80", "bf16x2"),
                   torch.float16: ("0x64006400", 1024.0, "0x3C003C00", "f16x2")}


def dequant16_ptx(dtype: torch.dtype) -> str:
    """``packed_nibbles_ptx`` with the scale: (q - z) * s, 3 instructions a pair."""
    return packed_nibbles_ptx(dtype, scaled=True)


def fragment_k_order(k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [K]: position k' of the fragment tiles' K order holds x's column order[k']
    (within each 128-wide tile: natural 32c + 8u + 4h + r at k' = 32u + 8r + 2c + h)."""
    if k % FRAG_K:
        raise ValueError(f"K={k} is not a multiple of {FRAG_K} (the fragment tiles' K tile)")
    nat = torch.arange(k, device=device).view(k // FRAG_K, 4, 4, 2, 4)  # tile, c, u, h, r
    return nat.permute(0, 2, 4, 1, 3).reshape(k)  # tile, u, r, c, h


def fragment_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with its K in the fragment tiles' order (``fragment_k_order``), contiguous:
    one copy (M x K 16-bit values read and written)."""
    m, k = x.shape
    if k % FRAG_K:
        raise ValueError(f"K={k} is not a multiple of {FRAG_K} (the fragment tiles' K tile)")
    return x.reshape(m, k // FRAG_K, 4, 4, 2, 4).permute(0, 1, 3, 5, 2, 4).reshape(m, k)


@triton.jit
def qz8(packed, z, DT: tl.constexpr, ASM: tl.constexpr, PTX: tl.constexpr,
        OFFSET: tl.constexpr):
    """Packed words [BN, W] and their zero points ([BN, 1] or [BN, W]) -> 8 tensors [BN, W]
    in DT, nibbles 0..7's q - z (exact). ASM: PTX is kernels/int4_gemm.py's
    ``_unpack_ptx`` (lop3 + fma a pair); else the fp32 2^23 + q less 2^23 + z."""
    if ASM:
        nz = tl.broadcast_to((-(z.to(tl.float32) + OFFSET)).to(DT), packed.shape)
        return tl.inline_asm_elementwise(
            PTX.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [packed, nz],
            dtype=(DT.value,) * 8, is_pure=True, pack=1)
    else:
        pk = packed.to(tl.uint32, bitcast=True)
        zf = z.to(tl.float32) + 8388608.0
        n0 = ((pk & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        n1 = (((pk >> 4) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        n2 = (((pk >> 8) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        n3 = (((pk >> 12) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        n4 = (((pk >> 16) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        n5 = (((pk >> 20) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        n6 = (((pk >> 24) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        n7 = ((pk >> 28) | 0x4B000000).to(tl.float32, bitcast=True) - zf
        return (n0.to(DT), n1.to(DT), n2.to(DT), n3.to(DT), n4.to(DT), n5.to(DT), n6.to(DT),
                n7.to(DT))


@triton.jit
def dequant16_8(packed, s, z, DT: tl.constexpr, PTX: tl.constexpr, OFFSET: tl.constexpr):
    """Packed words [BN, W], their scales (in DT) and zero points ([BN, 1] or [BN, W]) -> 8
    tensors [BN, W] in DT, nibbles 0..7's (q - z) * s by ``dequant16_ptx`` (the GPU only)."""
    nz = tl.broadcast_to((-(z.to(tl.float32) + OFFSET)).to(DT), packed.shape)
    sc = tl.broadcast_to(s.to(DT), packed.shape)
    return tl.inline_asm_elementwise(
        PTX.value, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [packed, nz, sc],
        dtype=(DT.value,) * 8, is_pure=True, pack=1)


# Triton 3.6 pipelines the per-weight fragment tile's 8 wgmmas (A from registers) across K
# tiles: the loop's last wait leaves 7 in flight ("wgmma.wait_group 7"), so the next tile's
# decode runs while the last slice's wgmma may not yet have read its A registers, and ptxas
# gives those registers to the next tile's values (sm_90a SASS of fwm256n64k128s1w4st3g8t:
# the loop's first instructions write the last HGMMA's A registers R180/R181 with -(OFFSET +
# z) of the next tile and OFFSET). Run 206 saw it (H200): the weights of that register pair
# came out -(OFFSET + the next group's zero point). One "wgmma.wait_group 0" after a tile's
# MMAs keeps the registers until they are read.
WGMMA_DRAIN_PTX = tl.constexpr("wgmma.wait_group.sync.aligned 0;\nmov.b32 $0, $1;")


@triton.jit
def wgmma_drain(v):
    """``v`` (an int32 scalar) unchanged, after every wgmma this warpgroup issued has
    completed (the GPU only): the fragment tile's A registers may be reused after it."""
    return tl.inline_asm_elementwise(WGMMA_DRAIN_PTX.value, "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def fragment_tile(n0, n1, n2, n3, n4, n5, n6, n7, BLOCK_N: tl.constexpr):
    """Nibbles 0..7's values [BN, 16] (rows in ``wgmma_a_rows``'s load order, word 4c + u of
    the tile's 16) -> the tile [BN, 128], rows in feature order, K in the fragment order
    (natural 32c + 8u + 4h + r at k' = 32u + 8r + 2c + h): reshapes and permutes that move no
    value between threads (each thread's words are its share of wgmma's A fragment)."""
    j0 = tl.join(tl.reshape(n0, (BLOCK_N, 4, 4)), tl.reshape(n4, (BLOCK_N, 4, 4)))
    j1 = tl.join(tl.reshape(n1, (BLOCK_N, 4, 4)), tl.reshape(n5, (BLOCK_N, 4, 4)))
    j2 = tl.join(tl.reshape(n2, (BLOCK_N, 4, 4)), tl.reshape(n6, (BLOCK_N, 4, 4)))
    j3 = tl.join(tl.reshape(n3, (BLOCK_N, 4, 4)), tl.reshape(n7, (BLOCK_N, 4, 4)))
    jj = tl.join(tl.join(j0, j1), tl.join(j2, j3))  # [BN, c, u, h, r % 2, r // 2]
    w = tl.reshape(tl.permute(jj, (0, 2, 5, 4, 1, 3)), (BLOCK_N, 128))  # [BN, u, r, c, h]
    # rows back to feature order: load row 32j + 8w + l is feature 64(j // 2) + 16w + 8(j % 2) + l
    return tl.reshape(tl.permute(tl.reshape(w, (BLOCK_N // 64, 2, 4, 8, 128)), (0, 2, 1, 3, 4)),
                      (BLOCK_N, 128))
