"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

    no residual:  out = rmsnorm(x) * weight
    residual:     r = x + residual;  returns (rmsnorm(r) * weight, r)

Rounding follows HF Llama exactly: the sum r is rounded to x's dtype, the norm runs
in fp32, is rounded to x's dtype, and only then multiplied by weight
(y = (r.float() * rsqrt(mean(r.float()^2) + eps)).to(dtype) * weight). An fp32 weight
beside 16-bit x is HF Gemma's rounding instead: the product taken in fp32, rounded once
(y = (r.float() * rsqrt(...) * weight).to(dtype); Gemma keeps 1 + w in fp32).
One program per row, the whole row in registers: x and residual are read once,
out and r written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl

_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    W_FP32: tl.constexpr = False,  # Gemma's rounding: the weight's product before the cast
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a parameter: requested before the wait
    pdl_prologue(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    if W_FP32:
        y = xf * rstd * w.to(tl.float32)
    else:
        y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    pdl: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H], weight [H], residual like x (or None).

    Returns out (x's shape and dtype), or (out, x + residual) when residual is given.
    Inputs are not modified. pdl: programmatic dependent launch (kernels/pdl.py); None
    decides from the device and FLASHPAGE_PDL.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)}), got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is larger than the supported {_MAX_HIDDEN}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty_like(out)
    else:
        r2 = res_out = x2  # unused
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    block = triton.next_power_of_2(hidden)
    if x2.shape[0]:
        use_pdl = resolve_pdl(pdl, x.device)
        _LAUNCH((x2.shape[0],),
                (x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
                 float(eps)),
                dict(HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None, PDL=use_pdl,
                     W_FP32=weight.dtype == torch.float32 and x.dtype != torch.float32),
                dict(num_warps=min(16, max(4, block // 512)), **pdl_launch_kwargs(use_pdl)))
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, res_out.view(x.shape)


_LAUNCH = FastLauncher(_rms_norm_kernel)


def rms_norm_ref(x, weight, eps, residual=None):
    """Pure-torch rms_norm, written as HF Llama writes it (an fp32 weight beside 16-bit x:
    as HF Gemma writes it)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        out = (h * weight).to(x.dtype)
    else:
        out = (h.to(x.dtype) * weight).to(x.dtype)
    return out if residual is None else (out, x)
