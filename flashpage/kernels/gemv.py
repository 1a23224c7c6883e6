"""Skinny GEMM for decode batches of a few tokens: y[M, N] = x[M, K] @ w[N, K]^T (+ bias).

At batch 1-8 a linear layer only streams its weight, and cuBLAS leaves bandwidth on the
table for the smaller projections of an 8B model (o_proj 2.7 TB/s and qkv 3.1 TB/s on an
H200, against ~4.2 TB/s for a large one, with a separate split-K reduce kernel). Here
each program owns ``BLOCK_N`` output features and streams their rows of ``w`` over the
whole K (no split, no reduce), the few rows of x riding along; ``tl.dot`` pads M to 16.

Optional prologue ``SILU_MUL``: x is the gate/up output [M, 2K] of the MLP and the
kernel computes ``silu(gate) * up`` on the fly (rounded as ``kernels/silu_mul`` rounds),
so the SiLU·mul kernel and its round trip disappear at decode batches.

Whether this beats cuBLAS depends on the GPU and the shape, so the engine times both at
start-up (``kernels/gemv_tune.pick_config``) and uses ours only where it wins.

``gemv_row`` is the one-row case (a single sequence decoding), built for a chain of
kernels rather than for one call: no tensor cores (a row of x times a tile of w, summed
in fp32 registers), and with programmatic dependent launch (kernels/pdl.py) each program
issues the load of its first weight tile *before* waiting for the previous kernel. The
weights are never written, so reading them early is safe; x and the output wait. The
GEMV's launch, its programs' start-up and its first DRAM round trip then overlap the
kernel before it (an RMSNorm, the attention merge), which is where a one-row step loses
its time: at one row a linear of an 8B model is 8-60 us of streaming and ~3 us of
ramp-up. Rows up to 8192 wide are loaded whole, at once (nothing is left to wait for
but that one round trip); longer rows go through a loop that keeps one tile in flight
ahead of the one it multiplies (loads issued a tile early, in registers). With whole
rows the RMSNorm before the linear (and its residual add) moves into the prologue: every
program normalizes the 8 KB row itself, so the norm's own kernel, with its wait and its
round trip, is gone from the step.

FP8 weights (``quantization="fp8"``, layers/quant.py): w in float8_e4m3fn with one fp32
scale per output row, ``scale`` [N]. Both kernels widen each weight tile to the
activations' dtype right after the load (exact: every e4m3 value is an fp16 and a bf16
value) and multiply the row's scale into the fp32 sum before the bias,
y[n] = scale[n] * sum_k x[k] w[n, k] + bias[n]: W8A16, half the weight bytes of bf16.
``gemv_row`` takes a block-scaled checkpoint's weights too (``block`` (bn, bk), ``scale``
fp32 [ceil(N/bn), ceil(K/bk)], kernels/fp8_block_gemm.py's layout): each weight tile's
products are summed per TB columns (TB the largest power of two dividing both bk and the
tile, so a sub-tile lies in one block) and each sub-sum takes its block's scale,
y[n] = sum_g ws[n // bn, g] * sum_{k in g} x[k] w[n, k]; the scales are requested before
the PDL wait with the first weight tile, and the norm / SiLU·mul prologues are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage import envs
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl

MAX_M = 16  # tl.dot pads the rows to 16 anyway


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4

    @property
    def name(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"


CANDIDATES = (
    GemvConfig(16, 256, 4, 4),
    GemvConfig(16, 512, 4, 3),
    GemvConfig(32, 256, 4, 4),
    GemvConfig(16, 128, 4, 6),
    GemvConfig(64, 128, 4, 4),
)


@triton.jit
def _silu_mul(g, u, OUT_DTYPE: tl.constexpr):
    """silu(g) * u from the loaded gate and up columns, rounded as kernels/silu_mul."""
    g = g.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT_DTYPE).to(tl.float32)
    return (act * u.to(tl.float32)).to(OUT_DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["M"])  # one compile serves every row count
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    dt = x_ptr.dtype.element_ty  # the dots' dtype: fp8 weights are widened to it
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None], other=0.0)
            xm = m_mask[:, None]
        else:
            k_mask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            xm = m_mask[:, None] & k_mask[None, :]
        if SILU_MUL:
            x = _silu_mul(tl.load(x_rows + kk[None, :], mask=xm, other=0.0),
                          tl.load(x_rows + K + kk[None, :], mask=xm, other=0.0), dt).to(dt)
        else:
            x = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
        acc = tl.dot(x, tl.trans(w.to(dt)), acc)
    if HAS_SCALE:
        acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check_weight(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
                  block: tuple[int, int] | None = None) -> None:
    """w in x's dtype, or float8_e4m3fn with ``scale`` fp32 [N] (with ``block`` (bn, bk):
    fp32 [ceil(N/bn), ceil(K/bk)], rows contiguous) (ValueError otherwise)."""
    if block is not None:
        from flashpage.kernels.fp8_block_ref import check_block_scales

        if scale is None:
            raise ValueError("block-scaled fp8 weights need their scales")
        check_block_scales(w, scale, block)
        if scale.stride(1) != 1:
            raise ValueError("block scales must be contiguous in their last dimension")
    elif w.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("fp8 weights need their scale (fp32 [N], one per output row)")
        if scale.shape != (w.shape[0],) or scale.dtype != torch.float32 or scale.stride(0) != 1:
            raise ValueError(f"scale must be contiguous fp32 [{w.shape[0]}], got "
                             f"{scale.dtype} {tuple(scale.shape)}")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"x dtype {x.dtype} unsupported with fp8 weights")
    elif scale is not None:
        raise ValueError(f"scale is for float8_e4m3fn weights, w is {w.dtype}")
    elif x.dtype != w.dtype:
        raise ValueError(f"dtype mismatch: x {x.dtype}, w {w.dtype}")


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig = GemvConfig(), silu_mul: bool = False,
                  out: torch.Tensor | None = None, *, scale: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with ``silu_mul``), w [N, K], bias [N] -> [M, N]; M <= MAX_M.
    w float8_e4m3fn: ``scale`` fp32 [N] multiplies each output feature (W8A16)."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m, kx = x.shape
    n, k = w.shape
    if kx != (2 * k if silu_mul else k):
        raise ValueError(f"x has {kx} columns, w needs {2 * k if silu_mul else k}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"skinny_linear takes 1..{MAX_M} rows, got {m}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w must be contiguous in their last dimension")
    _check_weight(x, w, scale)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, w, bias if bias is not None else x, scale if scale is not None else x, out,
        m, n, k, x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, SILU_MUL=silu_mul,
        BLOCK_M=16, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def skinny_linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                      silu_mul: bool = False, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same in PyTorch: fp32 accumulation, the activation rounded as the kernel does;
    ``scale`` [N] (fp8 weights) multiplies the fp32 sums before the bias."""
    if silu_mul:
        k = w.shape[1]
        g, u = x[:, :k].float(), x[:, k:].float()
        x = (torch.nn.functional.silu(g).to(x.dtype).float() * u).to(x.dtype)
    y = x.float() @ w.float().t()
    if scale is not None:
        y = y * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@dataclass(frozen=True)
class RowConfig:
    """``gemv_row``'s tile: ``block_n`` output features per program, ``block_k`` columns
    of their weight rows per loop step (one such tile in flight ahead of the one used).
    With ``block_k`` >= K a program loads its whole rows at once, before the wait."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4

    @property
    def name(self) -> str:
        return f"row-n{self.block_n}k{self.block_k}w{self.num_warps}"


# The tiles benchmarks/gemv.py times and the GPU tests run (default_row_config picks).
# Looped, on the H200 (runs 38-42): 4 x 1024 with 4 warps the best for K = 4096 alone,
# 16 x 512 with 8 warps for K = 14336 (down); whole rows the best in a chain.
ROW_CANDIDATES = (
    RowConfig(4, 1024, 4),
    RowConfig(16, 512, 8),
    RowConfig(8, 512, 4),
    RowConfig(16, 1024, 8),
    RowConfig(2, 2048, 4),
    RowConfig(4, 4096, 4),   # whole rows (K = 4096)
    RowConfig(2, 4096, 4),
    RowConfig(8, 4096, 8),
)
# Whole rows of K = 14336 (2 x 16384 with 8 warps, 4 x 16384 with 16, 1 x 16384 with 4)
# ran the down projection at 32-59% of the copy rate (run 41): not candidates.
# Rows up to this wide are loaded whole by default (the weight tile then lives in
# registers); FLASHPAGE_GEMV_WHOLE_ROW overrides it (a power of two, <= 16384).
MAX_WHOLE_ROW = 8192
WHOLE_ROW_LIMIT = 16384


def max_whole_row() -> int:
    """The widest row ``gemv_row`` loads whole: FLASHPAGE_GEMV_WHOLE_ROW or MAX_WHOLE_ROW."""
    width = envs.gemv_whole_row()
    if width is None:
        return MAX_WHOLE_ROW
    if width & (width - 1) or not 16 <= width <= WHOLE_ROW_LIMIT:
        raise ValueError(f"FLASHPAGE_GEMV_WHOLE_ROW must be a power of two in 16..{WHOLE_ROW_LIMIT}, "
                         f"got {width}")
    return width


@triton.jit
def _gemv_row_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, y_ptr,
    res_ptr, nw_ptr, res_out_ptr, eps,  # NORM: residual in, norm weight, x + residual out
    N, K, stride_wn, stride_sn,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SILU_MUL: tl.constexpr,
    NORM: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE_ROW: tl.constexpr, PDL: tl.constexpr,
    SBN: tl.constexpr, SBK: tl.constexpr, TB: tl.constexpr,  # block scales (SBN > 0)
):
    pid = tl.program_id(0)
    dt = x_ptr.dtype.element_ty  # the activations' rounding (fp8 weights: not w's dtype)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # The first weight tile (and fp8 rows' scales) requested before the wait: weights are
    # only ever read.
    w_next = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :],
                     other=0.0)
    if SBN > 0:  # block scales: [BLOCK_N, BLOCK_K // TB], one per TB-column sub-tile
        sub = tl.arange(0, BLOCK_K // TB) * TB
        s_rows = s_ptr + (offs_n // SBN)[:, None] * stride_sn
        w_scale = tl.load(s_rows + (sub // SBK)[None, :],
                          mask=n_mask[:, None] & (sub < K)[None, :], other=0.0)
    else:
        w_scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0) if HAS_SCALE else 1.0
    pdl_prologue(PDL)
    if WHOLE_ROW:  # K <= BLOCK_K: one tile, no loop
        k_mask = offs_k < K
        if SILU_MUL:
            x = _silu_mul(tl.load(x_ptr + offs_k, mask=k_mask, other=0.0),
                          tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0), dt)
        elif NORM:
            # rmsnorm(x + residual) * weight, rounded as kernels/rms_norm and HF round it;
            # every program computes it (8-16 KB from L2), the first writes x + residual.
            s = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_RES:
                s = (s + tl.load(res_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32))
                s = s.to(dt).to(tl.float32)
                tl.store(res_out_ptr + offs_k, s.to(dt), mask=k_mask & (pid == 0))
            rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / K + eps)
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = (nw * (s * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if SBN > 0:
            part = tl.reshape(w_next.to(tl.float32) * x[None, :], (BLOCK_N, BLOCK_K // TB, TB))
            y = tl.sum(tl.sum(part, axis=2) * w_scale, axis=1)
        else:
            y = tl.sum(w_next.to(tl.float32) * x[None, :], axis=1)
    else:
        # x (or the gate/up columns) is loaded a tile ahead too: an L2 round trip on every
        # iteration's critical path would otherwise cost ~1/3 of a 14336-wide row's time.
        k_mask = offs_k < K
        x_next = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
        u_next = x_next
        if SILU_MUL:
            u_next = tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_N, BLOCK_K // TB), dtype=tl.float32)  # block scales: per sub-tile
        for k0 in range(0, K, BLOCK_K):
            w = w_next
            xr = x_next
            ur = u_next
            kn = k0 + BLOCK_K + offs_k
            kn_mask = kn < K
            w_next = tl.load(w_rows + kn[None, :], mask=n_mask[:, None] & kn_mask[None, :],
                             other=0.0)
            x_next = tl.load(x_ptr + kn, mask=kn_mask, other=0.0)
            if SILU_MUL:
                u_next = tl.load(x_ptr + K + kn, mask=kn_mask, other=0.0)
                x = _silu_mul(xr, ur, dt)
            else:
                x = xr.to(tl.float32)
            if SBN > 0:
                sub_k = k0 + sub
                s = tl.load(s_rows + (sub_k // SBK)[None, :],
                            mask=n_mask[:, None] & (sub_k < K)[None, :], other=0.0)
                part = tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, BLOCK_K // TB, TB))
                acc_b += tl.sum(part, axis=2) * s
            else:
                acc += w.to(tl.float32) * x[None, :]
        if SBN > 0:
            y = tl.sum(acc_b, axis=1)
        else:
            y = tl.sum(acc, axis=1)
    if HAS_SCALE and SBN == 0:
        y *= w_scale
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def default_row_config(n: int, k: int, whole: bool = False) -> RowConfig:
    """The tile for a [n, k] weight: whole rows where K fits ``max_whole_row()`` (or
    ``whole``: a norm in the prologue), about 16K weights per program with 4 warps per 16K
    (4 rows up to 4096 columns; 4 rows and 8 warps at 8192; 2 rows and 8 warps at 16384);
    longer rows 16 x 512 tiles with 8 warps. Measured on the H200 (benchmarks/gemv.py,
    runs 38-40): whole rows gave the best chain of one-row linears, and in the engine
    a looped o_proj (faster alone: 9.3 against 10.0 us) made a token 2% slower: a whole
    row is requested before the PDL wait, a looped one only its first tile."""
    block_k = max(16, triton.next_power_of_2(k))
    if block_k <= max_whole_row() or (whole and block_k <= WHOLE_ROW_LIMIT):
        if block_k <= 4096:
            return RowConfig(4, block_k, 4)
        return RowConfig(4, block_k, 8) if block_k == 8192 else RowConfig(2, block_k, 8)
    return RowConfig(16, 512, 8)


def gemv_row(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
             config: RowConfig | None = None, silu_mul: bool = False,
             pdl: bool | None = None, out: torch.Tensor | None = None, *,
             norm: tuple[torch.Tensor, float] | None = None,
             residual: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None,
             scale: torch.Tensor | None = None,
             block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [1, K] (or [1, 2K] with ``silu_mul``: silu(gate) * up computed on the fly),
    w [N, K], bias [N] -> [1, N], fp32 accumulation. ``pdl``: programmatic dependent
    launch (None: per FLASHPAGE_PDL and the device). w float8_e4m3fn: ``scale`` fp32 [N]
    multiplies each output feature's sum (W8A16; loaded before the PDL wait too); with
    ``block`` (bn, bk), ``scale`` is the tiles' fp32 [ceil(N/bn), ceil(K/bk)] and each
    block's sub-sum takes its own (see the module's docstring).

    ``norm`` = (weight [K], eps): the input is rmsnorm(x + residual) * weight, computed
    in the prologue (kernels/rms_norm's rounding), and with ``residual`` the sum
    x + residual is written to ``residual_out`` [1, K] (what the RMSNorm kernel returns
    beside its output). Needs whole rows (K <= WHOLE_ROW_LIMIT)."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x must be [1, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    m, kx = x.shape
    n, k = w.shape
    if m != 1:
        raise ValueError(f"gemv_row takes one row, got {m}")
    if kx != (2 * k if silu_mul else k):
        raise ValueError(f"x has {kx} columns, w needs {2 * k if silu_mul else k}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w must be contiguous in their last dimension")
    _check_weight(x, w, scale, block)
    cfg = config or default_row_config(n, k, whole=norm is not None)
    whole = k <= cfg.block_k
    tb = 1
    if block is not None:  # sub-tiles of TB columns inside one K block: TB divides bk and the tile
        while block[1] % (2 * tb) == 0 and cfg.block_k % (2 * tb) == 0:
            tb *= 2
    nw, eps = norm if norm is not None else (w, 0.0)
    if norm is not None:
        if silu_mul:
            raise ValueError("norm and silu_mul cannot be combined")
        if not whole:
            raise ValueError(f"norm needs whole rows: K={k} is wider than the tile's {cfg.block_k}")
        if nw.shape != (k,) or nw.stride(0) != 1:
            raise ValueError(f"norm weight must be contiguous [{k}], got {tuple(nw.shape)}")
        if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                     or residual.stride(1) != 1 or residual_out is None
                                     or residual_out.shape != x.shape or residual_out.stride(1) != 1):
            raise ValueError("residual and residual_out must be contiguous rows like x")
    elif residual is not None:
        raise ValueError("residual needs norm")
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    use_pdl = resolve_pdl(pdl, x.device)
    _gemv_row_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, bias if bias is not None else x, scale if scale is not None else x, out,
        residual if residual is not None else x, nw,
        residual_out if residual is not None else x, eps,
        n, k, w.stride(0), scale.stride(0) if block is not None and scale is not None else 0,
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, SILU_MUL=silu_mul,
        NORM=norm is not None, HAS_RES=residual is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, WHOLE_ROW=whole, PDL=use_pdl,
        SBN=block[0] if block is not None else 0, SBK=block[1] if block is not None else 0,
        TB=tb,
        num_warps=cfg.num_warps, num_stages=1, **pdl_launch_kwargs(use_pdl),
    )
    return out


def gemv_row_norm_ref(x: torch.Tensor, w: torch.Tensor, norm_w: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm(x + residual) * norm_w, then the linear, in PyTorch (HF's rounding);
    returns (y, x + residual)."""
    s = x if residual is None else x + residual
    h = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)
    return skinny_linear_ref(norm_w * h.to(x.dtype), w, bias, scale=scale), s
