"""LayerNorm over the last dim, optionally fused with the residual add that precedes it.

    no residual:  out = layernorm(x) * weight + bias
    residual:     r = x + residual;  returns (layernorm(r) * weight + bias, r)

weight and bias are each optional (Cohere: weight only; Starcoder2: both; OLMo 1: neither).
A weight (and bias) of [heads, W] norms x [..., heads, W] head by head, each head with its
own row (Command-R+'s per-head q/k norms).

Rounding follows torch's ``layer_norm`` on fp32 input, as transformers' CohereLayerNorm and
our torch path (layers/ops.layer_norm) run it: the sum r is rounded to x's dtype; mean and
biased variance, the weight and bias all in fp32; the result rounded once to x's dtype.

One program per row, the whole row in registers (several rows per program when rows are
short: BLOCK_R), x and residual read once, out and r written once. Mean and variance are
two passes over the registers (the centred sum of squares), not E[x^2] - E[x]^2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl

_MAX_WIDTH = 65536
_ROW_ELEMS = 2048  # elements a program takes at least, in rows of short widths


@triton.jit
def _layer_norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
    n_rows, heads,
    stride_xt, stride_xh, stride_rt, stride_rh, stride_wh, stride_bh,
    eps,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    # rows: the flat index over [tokens, heads]; out and res_out are contiguous [rows, WIDTH]
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < WIDTH)[None, :]
    tok, head = rows // heads, rows % heads
    # parameters: requested before the wait (a head stride of 0: one row for every head)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + head[:, None] * stride_wh + cols[None, :], mask=mask, other=0.0)
    if HAS_BIAS:
        b = tl.load(b_ptr + head[:, None] * stride_bh + cols[None, :], mask=mask, other=0.0)
    pdl_prologue(PDL)
    x = tl.load(x_ptr + tok[:, None] * stride_xt + head[:, None] * stride_xh + cols[None, :],
                mask=mask, other=0.0)
    out_offs = rows[:, None] * WIDTH + cols[None, :]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + tok[:, None] * stride_rt + head[:, None] * stride_rh + cols[None, :],
                    mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + out_offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, 1) / WIDTH
    d = tl.where(mask, xf - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(d * d, 1) / WIDTH + eps)
    y = d * rstd[:, None]
    if HAS_WEIGHT:
        y = y * w.to(tl.float32)
    if HAS_BIAS:
        y = y + b.to(tl.float32)
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _param_rows(p: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
    """weight or bias as [1 or heads, W] with unit stride along W."""
    width = x.shape[-1]
    if p.dim() == 1 and p.shape[0] == width:
        p = p.view(1, width)
    elif not (p.dim() == 2 and x.dim() >= 2 and p.shape == x.shape[-2:]):
        want = f"[{width}]" + (f" or [{x.shape[-2]}, {width}]" if x.dim() >= 2 else "")
        raise ValueError(f"{name} must be {want} for x of shape {tuple(x.shape)}, got {tuple(p.shape)}")
    return p if p.stride(-1) == 1 else p.contiguous()


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., W]; weight and bias [W] (one for every row) or [heads, W] over x [..., heads, W]
    (a row per head), each or both None; residual like x (or None).

    Returns out (x's shape and dtype), or (out, x + residual) when residual is given.
    Inputs are not modified; x may be a strided view (rows and heads at any stride, W
    contiguous: q of a fused qkv output). pdl: programmatic dependent launch
    (kernels/pdl.py); None decides from the device and FLASHPAGE_PDL.
    """
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    width = x.shape[-1]
    if width > _MAX_WIDTH:
        raise ValueError(f"normalized size {width} is larger than the supported {_MAX_WIDTH}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)}), got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    w2 = _param_rows(weight, "weight", x) if weight is not None else None
    b2 = _param_rows(bias, "bias", x) if bias is not None else None
    heads = max([p.shape[0] for p in (w2, b2) if p is not None], default=1)
    x3 = x.reshape(-1, heads, width)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    n_rows = x3.shape[0] * heads
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r3 = residual.reshape(-1, heads, width)
        if r3.stride(-1) != 1:
            r3 = r3.contiguous()
        res_out = torch.empty_like(out)
    else:
        r3, res_out = x3, out  # unused
    stride_wh, stride_bh = (p.stride(0) if p is not None and p.shape[0] > 1 else 0 for p in (w2, b2))
    block = triton.next_power_of_2(width)
    block_r = min(max(1, _ROW_ELEMS // block), triton.next_power_of_2(max(n_rows, 1)))
    if n_rows:
        use_pdl = resolve_pdl(pdl, x.device)
        _LAUNCH((triton.cdiv(n_rows, block_r),),
                (x3, r3, w2 if w2 is not None else x3, b2 if b2 is not None else x3, out, res_out,
                 n_rows, heads, x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), stride_wh, stride_bh,
                 float(eps)),
                dict(WIDTH=width, BLOCK=block, BLOCK_R=block_r, HAS_WEIGHT=w2 is not None,
                     HAS_BIAS=b2 is not None, HAS_RESIDUAL=residual is not None, PDL=use_pdl),
                dict(num_warps=min(16, max(4, block * block_r // 512)), **pdl_launch_kwargs(use_pdl)))
    if residual is None:
        return out
    return out, res_out


_LAUNCH = FastLauncher(_layer_norm_kernel)


def layer_norm_ref(x, weight, bias, eps, residual=None):
    """Pure-torch layer_norm: torch's layer_norm on fp32, weight and bias in fp32 (a [heads, W]
    one broadcast over [..., heads, W]), rounded once to x's dtype."""
    if residual is not None:
        x = x + residual
    h = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    if weight is not None:
        h = h * weight.float()
    if bias is not None:
        h = h + bias.float()
    out = h.to(x.dtype)
    return out if residual is None else (out, x)
