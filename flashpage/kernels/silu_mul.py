"""Activation-and-multiply, the gated MLP activation: x [N, 2I] -> act(x[:, :I]) * x[:, I:],
act SiLU (Llama, Qwen, DeepSeek) or GELU's tanh approximation (Gemma's gelu_pytorch_tanh).

Rounding follows HF (act_fn(gate) * up in the model dtype): the activation in fp32,
rounded to the dtype, then the product rounded again. One pass: x read once, out
written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl

_BLOCK = 1024  # elements of I per program; benchmarks/fused_ops.py sweeps it
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                         PDL: tl.constexpr, GELU_TANH: tl.constexpr):
    pdl_prologue(PDL)  # programmatic dependent launch (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        # 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), tanh(u) = 2 sigmoid(2u) - 1
        # (exp's overflow at large -u gives the right limits, -1 and 0). Not the simpler
        # x * sigmoid(2u): torch rounds 1 + tanh(u) where it nearly cancels, and this
        # form rounds alike (fp16: 99.6% of values equal to torch's, against 95%)
        u = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, *,
                 pdl: bool | None = None, gelu_tanh: bool = False) -> torch.Tensor:
    """x [..., 2I] -> [..., I]. pdl: programmatic dependent launch (kernels/pdl.py); None
    decides from the device and FLASHPAGE_PDL. gelu_tanh: GELU's tanh approximation
    instead of SiLU (gelu_tanh_and_mul)."""
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
                dict(BLOCK=_BLOCK, PDL=use_pdl, GELU_TANH=gelu_tanh), dict(num_warps=4, **pdl_launch_kwargs(use_pdl)))
    return out


_LAUNCH = FastLauncher(_silu_and_mul_kernel)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, *,
                      pdl: bool | None = None) -> torch.Tensor:
    """x [..., 2I] -> gelu_tanh(x[..., :I]) * x[..., I:], [..., I] (Gemma's MLP)."""
    return silu_and_mul(x, out, pdl=pdl, gelu_tanh=True)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Pure-torch gelu_tanh_and_mul, as HF Gemma computes it."""
    inter = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :inter], approximate="tanh") * x[..., inter:]


def silu_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch silu_and_mul."""
    inter = x.shape[-1] // 2
    res = torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]
    if out is not None:
        out.copy_(res)
        return out
    return res
