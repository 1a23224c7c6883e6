"""SiLU-and-multiply, the gated MLP activation: x [N, 2I] -> silu(x[:, :I]) * x[:, I:].

Rounding follows HF (act_fn(gate) * up in the model dtype): silu in fp32, rounded to
the dtype, then the product rounded again. One pass: x read once, out written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl

_BLOCK = 1024  # elements of I per program; benchmarks/fused_ops.py sweeps it


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_prologue(PDL)  # programmatic dependent launch (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, *,
                 pdl: bool | None = None) -> torch.Tensor:
    """x [..., 2I] -> [..., I]. pdl: programmatic dependent launch (kernels/pdl.py); None
    decides from the device and FLASHPAGE_PDL."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim of x must be even (gate and up halves), got {x.shape[-1]}")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], inter) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} {(*x.shape[:-1], inter)}")
    o2 = out.view(-1, inter)
    if x2.shape[0] and inter:
        use_pdl = resolve_pdl(pdl, x.device)
        _LAUNCH((x2.shape[0], triton.cdiv(inter, _BLOCK)), (x2, o2, inter, x2.stride(0), o2.stride(0)),
                dict(BLOCK=_BLOCK, PDL=use_pdl), dict(num_warps=4, **pdl_launch_kwargs(use_pdl)))
    return out


_LAUNCH = FastLauncher(_silu_and_mul_kernel)


def silu_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch silu_and_mul."""
    inter = x.shape[-1] // 2
    res = torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]
    if out is not None:
        out.copy_(res)
        return out
    return res
