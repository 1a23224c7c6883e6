"""Block-scaled fp8 linears (DeepSeek-V3's and Qwen3-FP8's checkpoints): y[M, N] =
x[M, K] @ W[N, K]^T (+ bias) with the weight kept as stored,

    w   float8_e4m3fn [N, K]
    ws  fp32 [ceil(N/BN), ceil(K/BK)]         W[n, k] = ws[n // BN, k // BK] * w[n, k]

(BN x BK the checkpoint's ``weight_block_size``, 128 x 128 in every published one; edge
tiles partial). Two kernels, one per regime:

``w8a8_block_matmul`` (W8A8, DeepSeek-V3's own recipe): x is quantized per token per
group of BK columns (``quantize_per_token_group``: a scale per (row, group) from the
group's amax, computed at run time, x [M, K] -> e4m3 [M, K] and fp32 [M, ceil(K/BK)]),
then each K tile of the product, inside one group, runs on the e4m3 tensor cores and
takes both scales on its fp32 partial sum:

    acc[m, n] += dot(xq[m, tile], w[n, tile]) * xs[m, g] * ws[n // BN, g]     g = k0 // BK

A K tile is BLOCK_K columns, the largest power of two dividing BK up to 128 (128 for 128 x
128 blocks; 16 at least, ``tl.dot``'s smallest: ``tile_k``), so a tile never straddles two
groups. Where an output tile's BLOCK_N columns lie in one weight block row (BN = 128,
BLOCK_N <= 128) ws is one number a tile and the two scales fold into one factor a row:
``acc += dot * (xs[m, g] * ws)[:, None]``, one FFMA per accumulator element a K tile. At
few rows K is split between programs until they cover the SMs (fp32 partial sums added
by one kernel after). The operand tiles come through pointers (cp.async) or, for configs
with ``tma``, host TMA descriptors. Needs e4m3 tensor cores (sm_89+).

``w8a16_block_matmul`` (weight-only, the decode sizes): x stays 16-bit; each weight tile
is widened to x's dtype in registers (exact: every e4m3 value is an fp16 and a bf16
value), ``tl.dot``-ed with x in fp32, and the tile's block scale goes on the partial sum:

    acc[m, n] += dot(x[m, tile], w[n, tile]) * ws[n // BN, g]

At 1-16 rows a linear only streams its weight: this reads 1 byte a weight (half of bf16)
and rounds the activations no further. K is split between programs until they cover the
SMs (the int4 GEMV's rule, kernels/int4_gemv.py), the fp32 partial sums added by one
kernel after. Any GPU Triton converts e4m3 on, and fp32 activations (its dots in IEEE
fp32): the fallback where W8A8 cannot run. (One row alone takes kernels/gemv.gemv_row,
which applies the same block scales with the one-row GEMV's norm prologue and PDL.)

Their pure-torch references live beside them in kernels/fp8_block_ref.py (no Triton:
the CPU path and the loader use them too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels.fp8_block_ref import FP8_MAX, MIN_SCALE, check_block_scales, tile_k
from flashpage.kernels.fp8_quant import check_activations
from flashpage.kernels.tiles import grouped_tile
from flashpage.kernels.tma_maps import cached_tma_maps


# ----------------------------------------------------------------------------- checks
def _check_call(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                bias: torch.Tensor | None) -> int:
    """Shapes and dtypes of a kernel call; returns the K tile."""
    check_block_scales(q, scale, block)
    n, k = q.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a [{n}, {k}] weight")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if scale.stride(1) != 1 or q.stride(1) != 1:
        raise ValueError("weight and scales must be contiguous in their last dimension")
    bk_tile = tile_k(block[1])
    if not bk_tile:
        raise ValueError(f"no kernel for K blocks of {block[1]} (a multiple of 16 needed)")
    return bk_tile


# ----------------------------------------------------------------------------- activations
@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, K, NG, stride_xm, stride_qm, stride_sm,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, GROUPS: tl.constexpr,
                         FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Row ``program_id(0)``, groups GROUPS * program_id(1) onwards: a [GROUPS, BLOCK_G]
    tile whose rows are groups of G columns (BLOCK_G = G rounded up to a power of two)."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = tl.arange(0, BLOCK_G)
    k = groups[:, None] * G + cols[None, :]
    mask = (cols[None, :] < G) & (k < K) & (groups[:, None] < NG)
    x = tl.load(x_ptr + row * stride_xm + k, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), MIN_SCALE)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -FP8_MAX, FP8_MAX)
    tl.store(q_ptr + row * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups < NG)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (fp16, bf16 or fp32; rows contiguous) -> (float8_e4m3fn [M, K], fp32
    [M, ceil(K/group)]): the bits of ``quantize_per_token_group_ref``, one launch, no host
    sync (graph-capturable)."""
    check_activations(x)
    if group <= 0:
        raise ValueError(f"group must be positive, got {group}")
    m, k = x.shape
    ng = -(-k // group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, ng), dtype=torch.float32, device=x.device)
    if m and k:
        block_g = max(16, triton.next_power_of_2(group))
        groups = max(1, min(triton.next_power_of_2(ng), 4096 // block_g))
        _quant_groups_kernel[(m, triton.cdiv(ng, groups))](
            x, q, s, k, ng, x.stride(0), q.stride(0), s.stride(0), G=group, BLOCK_G=block_g,
            GROUPS=groups, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, num_warps=4)
    return q, s


# ----------------------------------------------------------------------------- the GEMMs
@dataclass(frozen=True)
class BlockFp8Config:
    block_m: int
    block_n: int
    split_k: int = 1  # 0: chosen from the SM count at the call (w8a16_split_k / w8a8_split_k)
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # w8a8: programs walk GROUP_M row tiles per column tile (L2 reuse)
    tma: bool = False  # w8a8: operand tiles through TMA descriptors (where strides allow)

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}s{self.split_k}w{self.num_warps}"
                f"st{self.num_stages}g{self.group_m}" + ("t" if self.tma else ""))


# Not tuned on a GPU yet (benchmarks/fp8_block_gemm.py --configs times others): the tiles
# vLLM's and SGLang's block-fp8 Triton GEMMs default to for 128 x 128 blocks (64-128 rows,
# 128 columns, K tiles of 128), and the int4 GEMV's decode tile.
W8A16_SKINNY = BlockFp8Config(16, 64, split_k=0, num_warps=4, num_stages=4)  # 1-16 rows
W8A16_GEMM = BlockFp8Config(64, 128, num_warps=4, num_stages=3)

# W8A8 tiles that compile to e4m3 wgmma fed by a ring of num_stages shared-memory tiles
# (cp.async, or TMA for the ``t`` ones: 168-212 registers a thread against 254) and no
# spills for sm_90 (tests/kernels/test_fp8_block_gemm.py checks each): what
# `benchmarks/fp8_block_gemm.py --sweep` times at 64 / 256 / 2048 rows to choose
# w8a8_config's defaults from. Split 0: K split at few rows until the programs cover the
# SMs (w8a8_split_k). A 128-row tile
# needs 8 warps (two warpgroups, each 64 rows): with 4, the wgmma result and the
# accumulator (2 x 128 fp32 a thread) exceed the registers; so does 128 x 256 on 8
# (1.8 KB spilled a thread).
W8A8_CANDIDATES = tuple(BlockFp8Config(*c) for c in (
    (64, 128, 0, 4, 3, 8), (64, 128, 0, 4, 4, 8), (64, 128, 0, 4, 5, 8),
    (64, 64, 0, 4, 4, 8), (64, 256, 0, 8, 3, 8), (64, 128, 1, 4, 4, 8),
    (128, 128, 0, 8, 3, 8), (128, 128, 0, 8, 4, 8), (128, 64, 0, 8, 4, 8),
    (128, 128, 0, 8, 3, 16),
)) + tuple(BlockFp8Config(*c, tma=True) for c in (  # 64 x 128 in 3 stages: 3 CTAs an SM
    (64, 128, 0, 4, 3, 8), (64, 128, 0, 4, 4, 8), (64, 128, 0, 4, 5, 8), (64, 64, 0, 4, 4, 8),
    (128, 128, 0, 8, 3, 8), (128, 128, 0, 8, 4, 8),
))
# The defaults, from run 194's sweep on the H200 (BENCHMARKS.md): TMA-fed 64 x 128 won or
# came within 4% at every size of o_proj / gate_up (K 4096) and at 64 rows of down (K 14336);
# 128 x 128 on two warpgroups won down's 256 and 2048 rows (40 vs 45, 262 vs 300 us).
W8A8_SMALL = BlockFp8Config(64, 128, split_k=0, num_warps=4, num_stages=4, group_m=8, tma=True)
W8A8_LARGE = BlockFp8Config(128, 128, split_k=0, num_warps=8, num_stages=4, group_m=8, tma=True)


def w8a8_config(m: int, n: int, k: int) -> BlockFp8Config:
    """The W8A8 tile for an [m, k] x [n, k]^T product, as run 194's sweep found them
    (``benchmarks/fp8_block_gemm.py --sweep``): 64 x 128 through TMA, but 128 x 128 on two
    warpgroups past 128 rows of a long K (8192 up: a down projection), where each program's
    long K loop amortizes the larger tile."""
    del n  # not a factor at the swept shapes
    return W8A8_LARGE if m > 128 and k >= 8192 else W8A8_SMALL


def w8a8_split_k(tiles: int, k_tiles: int, device: torch.device) -> int:
    """K's split for ``tiles`` output tiles of ``k_tiles`` K tiles each: doubled while the
    programs cover under 90% of the SMs and every split keeps 4 K tiles at least (the
    cp.async ring's depth plus one); 1 off the GPU."""
    if device.type != "cuda":
        return 1
    from flashpage.kernels.device import num_sms

    split, sms = 1, num_sms(device)
    while tiles * split < 0.9 * sms and k_tiles // (2 * split) >= 4:
        split *= 2
    return split


def parse_config(name: str) -> BlockFp8Config:
    """A ``BlockFp8Config.name`` (m64n128s1w4st3g8, a trailing t: TMA) back to its config."""
    import re

    m = re.fullmatch(r"m(\d+)n(\d+)s(\d+)w(\d+)st(\d+)g(\d+)(t?)", name.strip())
    if m is None:
        raise ValueError(f"{name!r} is not a config name such as m64n128s1w4st3g8")
    bm, bn, split, warps, stages, group = map(int, m.groups()[:6])
    return BlockFp8Config(bm, bn, split, warps, stages, group, tma=m[7] == "t")


@triton.jit(do_not_specialize=["M"])  # one compile serves every row count
def _w8a8_block_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, a_desc, w_desc, M, N, K,
                       stride_am, stride_asm, stride_wn, stride_wsn, stride_om, stride_os,
                       BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                       TMA: tl.constexpr):
    """Program (pid, pid_k): one [BLOCK_M, BLOCK_N] tile of the output over split pid_k's
    share of the K tiles (all of them with SPLIT_K = 1; otherwise its fp32 partial sums go
    to out[pid_k]); tiles in GROUP_M-row bands so that neighbours share the weight tiles
    they read (the Triton tutorial's ordering). TMA: the operand tiles come through the
    tensor descriptors a_desc / w_desc (boxes [BLOCK_M | BLOCK_N, BLOCK_K], zero past the
    edges), else through pointers (a_desc / w_desc None).

    Where BLOCK_N divides BN the tile's columns share one weight block row, so each K
    tile's two scales fold into one factor per row (a_s * w_s, BLOCK_M products) and the
    partial sum takes one FFMA per element; otherwise a scale per column, two."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows and features past the end read row 0's / feature 0's data (never stored): the
    # loads need no mask along M and N
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    a_rows = a_ptr + rm[:, None] * stride_am
    w_rows = w_ptr + rn[:, None] * stride_wn
    as_rows = as_ptr + rm * stride_asm
    ONE_WS: tl.constexpr = BN % BLOCK_N == 0
    if ONE_WS:
        ws_row = ws_ptr + ((pid_n * BLOCK_N) // BN).to(tl.int64) * stride_wsn
    else:
        ws_rows = ws_ptr + (rn // BN) * stride_wsn
    tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(tiles, SPLIT_K)
    start = pid_k * per_split
    end = tl.minimum(start + per_split, tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(start, end):
        kk = t * BLOCK_K + offs_k
        if TMA:
            a = a_desc.load([pid_m * BLOCK_M, t * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, t * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_rows + kk[None, :])
            w = tl.load(w_rows + kk[None, :])
        else:
            a = tl.load(a_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=(kk < K)[None, :], other=0.0)
        g = (t * BLOCK_K) // BK
        a_s = tl.load(as_rows + g)
        part = tl.dot(a, tl.trans(w))
        if ONE_WS:
            acc += part * (a_s * tl.load(ws_row + g))[:, None]
        else:
            acc += part * a_s[:, None] * tl.load(ws_rows + g)[None, :]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om \
        + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _w8a16_block_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K,
                        stride_xm, stride_wn, stride_wsn, stride_om, stride_os,
                        BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (pid_n, pid_m, pid_k): BLOCK_N features of BLOCK_M rows over split pid_k's
    share of the K tiles; with SPLIT_K > 1 its fp32 partial sums go to out[pid_k]."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    dt = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    ws_rows = ws_ptr + (offs_n // BN) * stride_wsn
    tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(tiles, SPLIT_K)
    start = pid_k * per_split
    end = tl.minimum(start + per_split, tiles)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(start, end):
        kk = t * BLOCK_K + offs_k
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (kk < K)[None, :]
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask, other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
        w_s = tl.load(ws_rows + (t * BLOCK_K) // BK, mask=n_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(dt)), input_precision=PRECISION) * w_s[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out, acc, mask=out_mask)


def w8a16_block_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int], bias: torch.Tensor | None = None,
                       config: BlockFp8Config | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) @ the block-scaled e4m3 weight q [N, K] (scale
    [ceil(N/bn), ceil(K/bk)]) -> [M, N] in x's dtype (+ bias [N]); weight-only (W8A16)."""
    from flashpage.kernels.int4_gemv import _split_k, _split_sum_kernel

    bk_tile = _check_call(x, q, scale, block, bias)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} unsupported (float16, bfloat16, float32)")
    if x.stride(1) != 1:
        x = x.contiguous()
    (m, k), n = x.shape, q.shape[0]
    cfg = config or (W8A16_SKINNY if m <= 16 else W8A16_GEMM)
    tiles_n, tiles_m, k_tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), \
        triton.cdiv(k, bk_tile)
    split = cfg.split_k or (_split_k(tiles_n * tiles_m, k_tiles, x.device) if m else 1)
    split = max(1, min(split, k_tiles))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    out = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _w8a16_block_kernel[(tiles_n, tiles_m, split)](
        x, q, scale, bias if bias is not None else x, out, m, n, k,
        x.stride(0), q.stride(0), scale.stride(0), n, m * n,
        BN=block[0], BK=block[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk_tile,
        SPLIT_K=split, HAS_BIAS=bias is not None, EVEN_K=k % bk_tile == 0,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        _split_sum_kernel[(triton.cdiv(m * n, 1024),)](
            out, bias if bias is not None else out, y, m * n, n, SPLIT_K=split,
            HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    return y


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Whether TMA can read these row-major 1-byte tensors: 16-byte aligned bases and
    rows (K a multiple of 16)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in ts)


def w8a8_block_matmul(xq: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int], bias: torch.Tensor | None = None,
                      out_dtype: torch.dtype = torch.bfloat16,
                      config: BlockFp8Config | None = None) -> torch.Tensor:
    """xq e4m3 [M, K] with its per-token-group scales xs fp32 [M, ceil(K/bk)]
    (``quantize_per_token_group(x, bk)``) @ the block-scaled e4m3 weight q [N, K] (scale
    [ceil(N/bn), ceil(K/bk)]) -> [M, N] in ``out_dtype`` (+ bias [N]). sm_89+ (e4m3
    tensor cores) or the interpreter."""
    bk_tile = _check_call(xq, q, scale, block, bias)
    m, k = xq.shape
    n = q.shape[0]
    if bk_tile < 32 and xq.is_cuda:
        raise ValueError(f"w8a8 needs K blocks of 32 at least on the GPU (an e4m3 tl.dot's "
                         f"smallest K), got {block[1]}: use w8a16_block_matmul")
    if xq.dtype != torch.float8_e4m3fn or xq.stride(1) != 1:
        raise ValueError(f"xq must be contiguous float8_e4m3fn [M, K], got {xq.dtype}")
    if xs.shape != (m, -(-k // block[1])) or xs.dtype != torch.float32 or xs.stride(1) != 1:
        raise ValueError(f"xs must be fp32 [{m}, {-(-k // block[1])}] (a scale per token per "
                         f"{block[1]}-group), got {xs.dtype} {tuple(xs.shape)}")
    y = torch.empty(m, n, device=xq.device, dtype=out_dtype)
    if m == 0:
        return y
    cfg = config or w8a8_config(m, n, k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(k, bk_tile)
    split = cfg.split_k or w8a8_split_k(tiles, k_tiles, xq.device)
    split = max(1, min(split, k_tiles))
    out = y if split == 1 else torch.empty(split, m, n, device=xq.device, dtype=torch.float32)
    a_desc = w_desc = None
    if cfg.tma and _tma_ok(xq, q):
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [cfg.block_m, bk_tile])
        w_desc = TensorDescriptor(q, [n, k], [q.stride(0), 1], [cfg.block_n, bk_tile])
    # the two CUtensorMaps encoded once per (address, shape), not at every launch
    with cached_tma_maps(enabled=a_desc is not None and xq.is_cuda):
        _w8a8_block_kernel[(tiles, split)](
            xq, xs, q, scale, bias if bias is not None else y, out, a_desc, w_desc, m, n, k,
            xq.stride(0), xs.stride(0), q.stride(0), scale.stride(0), n, m * n,
            BN=block[0], BK=block[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=bk_tile, GROUP_M=cfg.group_m, SPLIT_K=split, HAS_BIAS=bias is not None,
            EVEN_K=k % bk_tile == 0, TMA=a_desc is not None, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    if split > 1:
        from flashpage.kernels.int4_gemv import _split_sum_kernel

        _split_sum_kernel[(triton.cdiv(m * n, 1024),)](
            out, bias if bias is not None else out, y, m * n, n, SPLIT_K=split,
            HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4)
    return y


def w8a8_block_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int], bias: torch.Tensor | None = None,
                      config: BlockFp8Config | None = None) -> torch.Tensor:
    """x [M, K] (16-bit or fp32) quantized per token per group (one kernel), then
    ``w8a8_block_matmul``; the output in x's dtype."""
    xq, xs = quantize_per_token_group(x if x.stride(1) == 1 else x.contiguous(), block[1])
    return w8a8_block_matmul(xq, xs, q, scale, block, bias, out_dtype=x.dtype, config=config)
