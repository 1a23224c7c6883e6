"""Row-wise int4 GEMV for decode batches (1-16 rows): y[M, N] = x[M, K] @ dequant(w)[N, K]^T
(+ bias), over the int4 layout of kernels/int4_gemm.py (qweight int32 [N, K/8], nibble j of
word c = w[n, 8c + j]; scales [N, K/G]; zeros uint8 [N, K/G]; w = (q - z) * s).

At 1-16 rows a linear only streams its weight, so the kernel is built like gemv.py's
``gemv_row``, not like a GEMM: a program owns ``block_n`` output features and walks K a
``block_k`` tile at a time (K optionally split between ``split_k`` programs), and the
weight is read once for all M rows::

    program (pid_n, pid_k)       qweight rows offs_n, words of its K range, coalesced along K
        tile t:  packed [BLOCK_N, BLOCK_K/8] int32   (next tile's words loaded before this
                 one is used: one tile in flight, in registers)
                 q = packed >> 4j & 0xF              [BLOCK_N, BLOCK_K] in registers
                 w = (q - z) * s                     fp32, z and s one per (feature, group)
                 rows: acc[n, m] += sum_k w[n, k] x[m, k]

Two ways to do the row products (``Int4GemvConfig.dot``):

    dot False   CUDA cores: for each row m (unrolled over BLOCK_M = M rounded up to a power
                of two) the fp32 products w * x[m] summed over the tile, added to column m
                of the [BLOCK_N, BLOCK_M] accumulator. One FMA per weight per row: cheap
                at 1-4 rows; at 16 rows the FMAs alone (16 per weight) exceed what the
                H200's CUDA cores do at 2 TB/s of int4 bytes.
    dot True    tensor cores with the operands swapped: w rounded to x's dtype (the bits
                the dequantizing reference builds) is the A operand [BLOCK_N, BLOCK_K],
                x's tile transposed the B operand [BLOCK_K, 16] (``tl.dot``'s smallest N):
                no FMA per row, BLOCK_N >= 16.

Dequantizing per weight (a subtract and a multiply, shared by all rows) rather than
applying s and z to per-group partial sums keeps any group size G (a multiple of 8
dividing K; G = K allowed) in one code path: a tile holds BLOCK_K / min(G, BLOCK_K)
groups, and their scales and zeros are loaded once per (feature, group). With split K
each program writes fp32 partial sums [split, M, N], added (and the bias) after.

``int4_gemv_ref`` is ``int4_linear_ref`` (kernels/int4_gemm.py). ``default_config`` is a
first guess until benchmarks/int4_gemv.py has been run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels.int4_gemm import PACK, _block_k, check_int4, int4_linear_ref

MAX_ROWS = 16  # rows of x one call takes: the dot path's B operand is 16 wide

int4_gemv_ref = int4_linear_ref


@dataclass(frozen=True)
class Int4GemvConfig:
    block_n: int = 16
    block_k: int = 256
    split_k: int = 0  # 0: chosen from the GPU's SM count at the call (1 off the GPU)
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = False  # row products on tensor cores (see the module's docstring)

    @property
    def name(self) -> str:
        return (f"{'d' if self.dot else 'f'}n{self.block_n}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}st{self.num_stages}")


# The tiles benchmarks/int4_gemv.py sweeps beside the default (not yet measured).
CANDIDATES = (
    Int4GemvConfig(16, 256, 0, 4, dot=False),
    Int4GemvConfig(32, 256, 0, 4, dot=False),
    Int4GemvConfig(8, 512, 0, 4, dot=False),
    Int4GemvConfig(64, 128, 0, 8, dot=False),
    Int4GemvConfig(32, 128, 0, 4, dot=True),
    Int4GemvConfig(64, 128, 0, 4, dot=True),
    Int4GemvConfig(64, 256, 0, 4, dot=True),
    Int4GemvConfig(128, 128, 0, 8, dot=True),
)


def default_config(m: int, n: int, k: int) -> Int4GemvConfig:
    """The tile for m rows of a [n, k] weight. A first guess (no GPU figures yet): CUDA
    cores up to 2 rows, where one FMA per weight per row is cheap, tensor cores above."""
    if m <= 2:
        return Int4GemvConfig(16, 256, 0, 4, dot=False)
    return Int4GemvConfig(64, 128, 0, 4, dot=True)


def parse_config(name: str) -> Int4GemvConfig:
    """The config an ``Int4GemvConfig.name`` names (e.g. ``dn64k128s0w4st1``)."""
    import re

    match = re.fullmatch(r"([df])n(\d+)k(\d+)s(\d+)w(\d+)st(\d+)", name.strip())
    if match is None:
        raise ValueError(f"{name!r} is not a config name such as dn64k128s0w4st1")
    kind, *nums = match.groups()
    bn, bk, split, warps, stages = map(int, nums)
    return Int4GemvConfig(bn, bk, split, warps, stages, dot=kind == "d")


@triton.jit
def _load_tile(qw_rows, s_rows, z_rows, n_mask, t, end, G: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile t's packed words [BLOCK_N, BLOCK_K/8] and each word's scale and zero point
    [BLOCK_N, BLOCK_K/8] (a word lies in one group; all zero past ``end``: the prefetch
    after the last tile). The scales and zeros take the words' layout: no conversion."""
    live = t < end
    k0 = t * BLOCK_K
    offs_w = tl.arange(0, BLOCK_K // 8)
    packed = tl.load(qw_rows + (k0 // 8 + offs_w)[None, :], mask=n_mask[:, None] & live, other=0)
    groups = (k0 + offs_w * 8) // G
    s = tl.load(s_rows + groups[None, :], mask=n_mask[:, None] & live, other=0.0)
    z = tl.load(z_rows + groups[None, :], mask=n_mask[:, None] & live, other=0)
    return packed, s, z


@triton.jit
def _row_part(w3, x_ptr, stride_xm, k0, M, m: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over each word's 8 columns of w * x[m] (in a thread's registers): [BN, BK/8]."""
    offs = k0 + tl.arange(0, BLOCK_K // 8)[:, None] * 8 + tl.arange(0, 8)[None, :]
    xr = tl.load(x_ptr + m * stride_xm + offs, mask=m < M, other=0.0).to(tl.float32)
    return tl.sum(w3 * xr[None, :, :], axis=2)


@triton.jit
def _rows_part(w3, x_ptr, stride_xm, k0, M, m0: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """Rows m0 .. m0 + ROWS - 1 of x against w3 [BN, BK/8, 8]: [BN, BK/8, ROWS], the rows
    stacked by tl.join (a new in-thread dimension: no select, no layout conversion)."""
    if ROWS == 1:
        return _row_part(w3, x_ptr, stride_xm, k0, M, m0, BLOCK_K)[:, :, None]
    elif ROWS == 2:
        return tl.join(_row_part(w3, x_ptr, stride_xm, k0, M, m0, BLOCK_K),
                       _row_part(w3, x_ptr, stride_xm, k0, M, m0 + 1, BLOCK_K))
    else:
        HALF: tl.constexpr = ROWS // 2
        lo = _rows_part(w3, x_ptr, stride_xm, k0, M, m0, HALF, BLOCK_K)
        hi = _rows_part(w3, x_ptr, stride_xm, k0, M, m0 + HALF, HALF, BLOCK_K)
        # [BN, W, HALF, 2] -> [BN, W, ROWS]: row m0 + j * ... ordered by the permute below
        return tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)),
                          (lo.shape[0], lo.shape[1], ROWS))


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, stride_xm,
                      stride_om, stride_os, G: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
                      PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    NG = K // G
    qw_rows = qw_ptr + offs_n[:, None].to(tl.int64) * (K // 8)
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * NG
    z_rows = z_ptr + offs_n[:, None].to(tl.int64) * NG
    tiles = K // BLOCK_K
    per_split = tl.cdiv(tiles, SPLIT_K)
    start = pid_k * per_split
    end = tl.minimum(start + per_split, tiles)
    shifts = (tl.arange(0, 8) * 4).to(tl.uint32)
    if DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif BLOCK_M == 1:  # products summed across threads once, at the end (as gemv_row)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:  # per-word partial sums; the sum over words (across threads) once, at the end
        acc3 = tl.zeros((BLOCK_N, BLOCK_K // 8, BLOCK_M), dtype=tl.float32)
    packed_n, s_n, z_n = _load_tile(qw_rows, s_rows, z_rows, n_mask, start, end, G, BLOCK_K)
    for t in range(start, end):
        packed, s, z = packed_n, s_n, z_n
        # the next tile's words requested before this one is used (weights are only read)
        packed_n, s_n, z_n = _load_tile(qw_rows, s_rows, z_rows, n_mask, t + 1, end, G,
                                        BLOCK_K)
        # each nibble ORed into the mantissa of 2^23 (0x4B000000): the fp32 2^23 + q with
        # no int-to-float conversion; 2^23 goes with the zero point, exactly
        pk = packed.to(tl.uint32, bitcast=True)
        q = (((pk[:, :, None] >> shifts[None, None, :]) & 0xF) | 0x4B000000).to(
            tl.float32, bitcast=True)
        zf = z.to(tl.float32) + 8388608.0
        w3 = (q - zf[:, :, None]) * s.to(tl.float32)[:, :, None]  # [BN, W, 8]
        k0 = t * BLOCK_K
        if DOT:
            # w in x's dtype: the dequantizing reference's bits; rows past M load zeros
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None],
                         mask=m_mask[None, :], other=0.0)  # [BK, BLOCK_M]
            w = tl.reshape(w3, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
            acc = tl.dot(w, xt, acc, input_precision=PRECISION)
        elif BLOCK_M == 1:
            xr = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
            acc2 += tl.reshape(w3, (BLOCK_N, BLOCK_K)) * xr[None, :]
        else:
            acc3 += _rows_part(w3, x_ptr, stride_xm, k0, M, 0, BLOCK_M, BLOCK_K)
    if not DOT:
        if BLOCK_M == 1:
            acc = tl.sum(acc2, axis=1)[:, None]
        else:
            acc = tl.sum(acc3, axis=1)
    out_mask = n_mask[:, None] & m_mask[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out, acc, mask=out_mask)


def supports(m: int, k: int, g: int) -> bool:
    """Whether ``int4_gemv`` takes m rows of a K-wide weight in groups of G (any valid
    layout: G a multiple of 8 dividing K)."""
    return 1 <= m <= MAX_ROWS and k % PACK == 0 and g % PACK == 0 and k % g == 0


def _split_k(tiles_n: int, k_tiles: int, device: torch.device) -> int:
    """Splits of K until the programs reach ~2 per SM (1 off the GPU)."""
    if device.type != "cuda":
        return 1
    from flashpage.kernels.device import num_sms

    target = 2 * num_sms(device)
    split = 1
    while tiles_n * split * 2 <= target and split * 2 <= k_tiles:
        split *= 2
    return split


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor, bias: torch.Tensor | None = None,
              config: Int4GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32, 1 <= M <= 16) @ the int4 weight -> [M, N] in x's
    dtype (+ bias [N]); fp32 accumulation."""
    g = check_int4(qweight, scales, zeros)
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a [{n}, {k}] weight")
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
    bk = _block_k(k, g, cfg.block_k)
    # tensor cores need 16-wide tiles; narrower K tiles (K = 8 x odd) use the CUDA cores
    dot = cfg.dot and bk >= 16 and cfg.block_n >= 16
    tiles_n = triton.cdiv(n, cfg.block_n)
    split = cfg.split_k or _split_k(tiles_n, k // bk, x.device)
    split = max(1, min(split, k // bk))
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _int4_gemv_kernel[(tiles_n, split)](
        x, qweight, scales, zeros, bias if bias is not None else x, out, m, n, k,
        x.stride(0), n, m * n, G=g,
        BLOCK_M=16 if dot else triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=bk,
        SPLIT_K=split, HAS_BIAS=bias is not None, DOT=dot,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split == 1:
        return out
    y = out.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
