"""Multi-adapter LoRA in two kernels: each token reads only its own slot's A and B.

An engine with ``S`` adapter slots keeps, per adapted linear, every slot's A and B stacked
(flashpage/lora/layers.py; ``n`` = slices x max rank columns per slot, e.g. qkv_proj at
rank 16: 3 x 16 = 48)::

    a      [S * n, K]     slot s: rows s*n .. s*n + n - 1
    b      [OUT, S * n]   slot s: columns s*n .. s*n + n - 1
    slots  int64 [>= T]   token t's slot, -1: no adapter

    lora_shrink:  xa[t] = a[slot_t*n : slot_t*n + n] @ x[t]            [T, n]  (0 for -1)
    lora_expand:  y[t] += b[:, slot_t*n : slot_t*n + n] @ xa[t]        in place (none for -1)

The idea is punica's (BGMV for decode, SGMV for segments of one adapter); the code is ours.
punica's SGMV wants the batch sorted into one segment per adapter, which the engine's slot
map is not (and sorting it every step is a kernel more). Here a program takes a tile of
``BLOCK_T`` consecutive tokens, as the step lays them out, and for each slot present in the
tile (a data-dependent branch, no host sync) runs one ``tl.dot`` over the tile's tokens
with the others' rows masked to zero: a slot's weights are read once per tile it appears
in, and a slot nobody in the tile uses is never read. A tile with no adapter at all
(requests without one, the graphs' padding rows) reads no weights and writes nothing.
The shrink runs each slot of a tile in its own program (``ShrinkConfig.slot_grid``): run
161 timed the one-program loop over the slots at 0.48-0.92x the dense path at 64 tokens
spread over 4 adapters (one adapter: 1.3-2.0x), the slots streamed one after another by
the few programs a 64-token tile has.

    shrink   grid (T tiles, P splits of K,     x tile [BLOCK_T, BLOCK_K] . a_s tile^T
                   S slots)                    (a program whose slot the tile lacks exits)
             -> fp32 partial sums [P, T, n]    (no atomics, no zero-fill, deterministic)
    expand   grid (T tiles, OUT / BLOCK_O)     sum of the P partials, rounded to y's dtype
                                               (as the dense path's x @ a^T is), . b_s^T,
                                               y += in fp32, stored once

Split K: at one token the shrink is a [n, K] GEMV (48 x 4096 for qkv, 16 x 14336 for down);
one program streaming it would take a few us alone, so K is cut into up to
``256 // BLOCK_T`` pieces, each program writing its own partial sums and the expand adding
them as it loads xa (at most 256 partial rows of n per expand program, from L2).

``n`` need not be a power of two (3 x 16 = 48): the tile is padded to the next power of
two, at least 16 (``tl.dot``'s minimum), and the padding columns are masked (never read,
never written). Every dot accumulates in fp32 (fp32 inputs: IEEE, not TF32, to match
``F.linear``).

Optional shrink prologue ``silu_mul``: x is an MLP's gate/up output [T, 2K] and the kernel
computes silu(gate) * up as it loads it (rounded as kernels/silu_mul), so the down
projection's delta needs no materialized activation and the base linear keeps its fused
SiLU·mul GEMV.

Size of T: these are built for decode steps (T up to ~256; a tile of 16 tokens at T <= 16,
64 from T > 32). At prompt chunks of thousands of tokens the tiles re-read each present
slot's weights once per 64 tokens (qkv at S = 4, T = 4096: ~250 MB from L2 for a 6 MB
delta) and the y read-modify-write is the base GEMM's output again, while the dense torch
path (two GEMMs over all slots' columns and a mask, flashpage/lora/layers.py) is then a few
percent of the base GEMM with its launches amortized: the engine keeps the dense path above
``KERNEL_MAX_TOKENS``: on the H200 (run 165) the kernels beat the dense path 1.0-2.3x up
to 256 tokens in every mix (4.9-6.3x with no adapter), so the threshold is 256
(benchmarks/lora.py --kernels times both paths and the slot loop).

Both kernels are graph-capturable: shapes and grids follow T alone, the slot map is read on
the device, and nothing is synchronized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.gemv import _silu_mul

KERNEL_MAX_TOKENS = 256  # above: the dense path (module docstring; measured, run 165)
MAX_PARTIAL_ROWS = 256  # split-K partial rows an expand program sums at most (P * BLOCK_T)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class ShrinkConfig:
    """``block_t`` tokens per program, ``block_k`` columns of K per loop step, K cut into
    at most ``max_splits`` pieces (rounded to ``block_k``)."""

    block_t: int = 16
    block_k: int = 256
    max_splits: int = 16
    num_warps: int = 4
    # a program per (tile, split, slot): a tile mixing slots runs them side by side, not one
    # after another in one program (False: each program loops over the slots)
    slot_grid: bool = True


@dataclass(frozen=True)
class ExpandConfig:
    """``block_t`` tokens and ``block_o`` output features per program."""

    block_t: int = 16
    block_o: int = 64
    num_warps: int = 4


def _block_t(t: int) -> int:
    return 16 if t <= 16 else 32 if t <= 32 else 64


def default_shrink_config(t: int) -> ShrinkConfig:
    bt = _block_t(t)
    return ShrinkConfig(bt, 256 if bt == 16 else 128, MAX_PARTIAL_ROWS // bt, 4)


def default_expand_config(t: int) -> ExpandConfig:
    return ExpandConfig(_block_t(t), 64, 4)


def _block_n(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _k_split(k: int, cfg: ShrinkConfig) -> int:
    """Columns of K per split: whole ``block_k`` steps, at most ``max_splits`` pieces."""
    steps = triton.cdiv(k, cfg.block_k)
    return cfg.block_k * triton.cdiv(steps, max(1, min(steps, cfg.max_splits)))


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, out_ptr,
    T, K, N, S, K_SPLIT,
    stride_xt, stride_an, stride_op,
    SILU_MUL: tl.constexpr, PRECISION: tl.constexpr, SLOT_GRID: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_k = tl.program_id(1)
    if SLOT_GRID:  # this program's slot only; slot 0's also writes the zeros of rows without one
        s_lo = tl.program_id(2)
        s_hi = s_lo + 1
    else:
        s_lo = 0
        s_hi = S
    dt = x_ptr.dtype.element_ty
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    slot = tl.load(slot_ptr + offs_t, mask=t_mask, other=-1)
    offs_n = tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_rows = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for s in range(s_lo, s_hi):
        mine = slot == s
        if tl.max(mine.to(tl.int32), axis=0) > 0:  # some token of the tile has slot s
            a_rows = a_ptr + (s * N + offs_n)[:, None].to(tl.int64) * stride_an
            for k0 in range(k_lo, k_hi, BLOCK_K):
                kk = k0 + offs_k
                k_mask = kk < k_hi
                xm = mine[:, None] & k_mask[None, :]  # other slots' rows: zeros
                if SILU_MUL:
                    xt = _silu_mul(tl.load(x_rows + kk[None, :], mask=xm, other=0.0),
                                   tl.load(x_rows + K + kk[None, :], mask=xm, other=0.0),
                                   dt).to(dt)
                else:
                    xt = tl.load(x_rows + kk[None, :], mask=xm, other=0.0)
                at = tl.load(a_rows + kk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                             other=0.0)
                acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
    out = out_ptr + pid_k * stride_op + offs_t[:, None].to(tl.int64) * N + offs_n[None, :]
    rows = t_mask
    if SLOT_GRID:
        rows = rows & ((slot == s_lo) | ((slot < 0) & (s_lo == 0)))
    tl.store(out, acc, mask=rows[:, None] & n_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    xa_ptr, b_ptr, slot_ptr, y_ptr,
    T, N, OUT, S, P,
    stride_xp, stride_xt, stride_bo, stride_yt,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_o = tl.program_id(1)
    dt = y_ptr.dtype.element_ty
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    slot = tl.load(slot_ptr + offs_t, mask=t_mask, other=-1)
    if tl.max(slot, axis=0) >= 0:  # a tile without adapters reads and writes nothing
        offs_n = tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        has = t_mask & (slot >= 0)
        xa_rows = xa_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_n[None, :]
        xm = has[:, None] & n_mask[None, :]
        xa = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for p in range(0, P):  # the shrink's split-K partial sums
            xa += tl.load(xa_rows + p * stride_xp, mask=xm, other=0.0).to(tl.float32)
        xa = xa.to(dt)  # rounded as the dense path's x @ a^T output is
        zero = tl.zeros_like(xa)
        offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        o_mask = offs_o < OUT
        b_rows = b_ptr + offs_o[:, None].to(tl.int64) * stride_bo
        acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
        for s in range(0, S):
            mine = slot == s
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                bt = tl.load(b_rows + (s * N + offs_n)[None, :],
                             mask=o_mask[:, None] & n_mask[None, :], other=0.0)
                acc = tl.dot(tl.where(mine[:, None], xa, zero), tl.trans(bt), acc,
                             input_precision=PRECISION)
        y = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_o[None, :]
        ym = has[:, None] & o_mask[None, :]
        out = tl.load(y, mask=ym, other=0.0).to(tl.float32) + acc
        tl.store(y, out.to(dt), mask=ym)


_SHRINK = FastLauncher(_lora_shrink_kernel)
_EXPAND = FastLauncher(_lora_expand_kernel)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (16-bit inputs ignore it)


def _check_slots(token_slots: torch.Tensor, t: int, device: torch.device) -> None:
    if token_slots.dtype != torch.int64 or token_slots.dim() != 1 or token_slots.stride(0) != 1:
        raise ValueError(f"token_slots must be contiguous int64 [>= T], got {token_slots.dtype} "
                         f"{tuple(token_slots.shape)}")
    if token_slots.shape[0] < t:
        raise ValueError(f"token_slots has {token_slots.shape[0]} entries for {t} tokens")
    if token_slots.device != device:
        raise ValueError(f"token_slots is on {token_slots.device}, the activations on {device}")


def _check_stack(w: torch.Tensor, name: str, cols: int, n: int, dtype: torch.dtype,
                 device: torch.device) -> int:
    """The number of slots of a stacked weight whose slot dimension has ``cols`` entries."""
    if n < 1 or cols % n or cols == 0:
        raise ValueError(f"{name} holds {cols} slot rows/columns, not a positive multiple of n={n}")
    if not w.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if w.dtype != dtype:
        raise ValueError(f"dtype mismatch: {name} {w.dtype}, activations {dtype}")
    if w.device != device:
        raise ValueError(f"{name} is on {w.device}, the activations on {device}")
    return cols // n


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, n: int,
                config: ShrinkConfig | None = None, *, silu_mul: bool = False) -> torch.Tensor:
    """x [T, K] (or [T, 2K] with ``silu_mul``: silu(gate) * up on the fly), a [S*n, K],
    token_slots int64 [>= T] (-1: none) -> fp32 partial sums [P, T, n] whose sum over P
    is x[t] @ a[slot_t*n : slot_t*n + n]^T (zeros for -1). ``lora_expand`` takes them."""
    if x.dim() != 2 or a.dim() != 2:
        raise ValueError(f"x must be [T, K] and a [S*n, K], got {tuple(x.shape)} and {tuple(a.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x dtype {x.dtype} unsupported (float16, bfloat16, float32)")
    t, kx = x.shape
    k = a.shape[1]
    if kx != (2 * k if silu_mul else k):
        raise ValueError(f"x has {kx} columns, a needs {2 * k if silu_mul else k}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    num_slots = _check_stack(a, "a", a.shape[0], n, x.dtype, x.device)
    _check_slots(token_slots, t, x.device)
    cfg = config or default_shrink_config(t)
    k_split = _k_split(k, cfg)
    p = max(1, triton.cdiv(k, k_split))
    out = torch.empty((p, t, n), dtype=torch.float32, device=x.device)
    if t:
        _SHRINK((triton.cdiv(t, cfg.block_t), p, num_slots if cfg.slot_grid else 1),
                (x, a, token_slots, out, t, k, n, num_slots, k_split,
                 x.stride(0), a.stride(0), out.stride(0)),
                dict(SILU_MUL=silu_mul, PRECISION=_precision(x.dtype), SLOT_GRID=cfg.slot_grid,
                     BLOCK_T=cfg.block_t,
                     BLOCK_N=_block_n(n), BLOCK_K=cfg.block_k),
                dict(num_warps=cfg.num_warps))
    return out


def lora_expand(xa: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, n: int,
                y: torch.Tensor, config: ExpandConfig | None = None) -> torch.Tensor:
    """y [T, OUT] += b[:, slot_t*n : slot_t*n + n] @ xa[t] in place (rows of slot -1
    untouched); xa [T, n] or split-K partials [P, T, n] (summed in fp32, then rounded to
    y's dtype), b [OUT, S*n] in y's dtype. Returns y."""
    if xa.dim() == 2:
        xa = xa[None]
    if xa.dim() != 3 or b.dim() != 2 or y.dim() != 2:
        raise ValueError(f"xa must be [T, n] or [P, T, n], b [OUT, S*n] and y [T, OUT], got "
                         f"{tuple(xa.shape)}, {tuple(b.shape)} and {tuple(y.shape)}")
    if y.dtype not in _DTYPES:
        raise ValueError(f"y dtype {y.dtype} unsupported (float16, bfloat16, float32)")
    p, t, nx = xa.shape
    out_f = b.shape[0]
    if nx != n or y.shape != (t, out_f):
        raise ValueError(f"shapes do not fit: xa {tuple(xa.shape)} (n={n}), b {tuple(b.shape)}, "
                         f"y {tuple(y.shape)}")
    if xa.dtype not in (torch.float32, y.dtype) or not xa.is_contiguous():
        raise ValueError(f"xa must be contiguous float32 or {y.dtype}, got {xa.dtype}")
    if y.stride(1) != 1:
        raise ValueError("y must be contiguous in its last dimension")
    if xa.device != y.device:
        raise ValueError(f"xa is on {xa.device}, y on {y.device}")
    num_slots = _check_stack(b, "b", b.shape[1], n, y.dtype, y.device)
    _check_slots(token_slots, t, y.device)
    cfg = config or default_expand_config(t)
    if t and out_f:
        _EXPAND((triton.cdiv(t, cfg.block_t), triton.cdiv(out_f, cfg.block_o)),
                (xa, b, token_slots, y, t, n, out_f, num_slots, p,
                 xa.stride(0), xa.stride(1), b.stride(0), y.stride(0)),
                dict(PRECISION=_precision(y.dtype), BLOCK_T=cfg.block_t, BLOCK_N=_block_n(n),
                     BLOCK_O=cfg.block_o),
                dict(num_warps=cfg.num_warps))
    return y


def _own_slot(w: torch.Tensor, token_slots: torch.Tensor, n: int, rows: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's own slot's piece of a stacked weight, fp32: rows (a: [T, n, K]) or
    columns (b: [T, OUT, n]), zeros for -1; and the mask of tokens with a slot."""
    s = (w.shape[0] if rows else w.shape[1]) // n
    slots = token_slots.long()
    has = slots >= 0
    idx = slots.clamp(min=0)
    if rows:
        piece = w.float().view(s, n, -1)[idx]
    else:
        piece = w.float().view(w.shape[0], s, n).permute(1, 0, 2)[idx]
    return piece * has[:, None, None].float(), has


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, n: int,
                    silu_mul: bool = False) -> torch.Tensor:
    """``lora_shrink``'s sum over its splits, in PyTorch: fp32 [T, n]."""
    t = x.shape[0]
    if silu_mul:
        k = a.shape[1]
        g, u = x[:, :k].float(), x[:, k:].float()
        x = (torch.nn.functional.silu(g).to(x.dtype).float() * u).to(x.dtype)
    a_tok, _ = _own_slot(a, token_slots[:t], n, rows=True)
    return torch.einsum("tnk,tk->tn", a_tok, x.float())


def lora_expand_ref(xa: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, n: int,
                    y: torch.Tensor) -> torch.Tensor:
    """``lora_expand`` in PyTorch, out of place: partials summed in fp32 and rounded to y's
    dtype, the product with the token's own B in fp32, added to y and rounded once."""
    if xa.dim() == 3:
        xa = xa.float().sum(0)
    t = y.shape[0]
    b_tok, has = _own_slot(b, token_slots[:t], n, rows=False)
    delta = torch.einsum("ton,tn->to", b_tok, xa.to(y.dtype).float())
    return torch.where(has[:, None], (y.float() + delta).to(y.dtype), y)
