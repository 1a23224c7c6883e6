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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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
