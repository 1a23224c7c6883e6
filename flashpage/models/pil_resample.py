"""PIL's ``Image.resize`` on uint8 [3, H, W] tensors: the resampler transformers' PIL image
processors run (Idefics3's and SmolVLM's LANCZOS, models/idefics3.py), which torch's
``interpolate`` has no filter for. ``pil_resize`` calls Pillow itself where it is installed
(the pixels transformers' processor makes, bit for bit, whatever Pillow's version); without
it, a torch port of Pillow's resampler:

Pillow's libImaging/Resample.c, on uint8 [C, H, W]::

    per output index o (each axis): scale = in / out, fs = max(scale, 1), center = (o + 0.5) scale
        taps [int(center - support fs + 0.5), int(center + support fs + 0.5)) within the input,
        weight filter((i - center + 0.5) / fs), normalized to sum 1,
        then fixed point: int(w 2^22 +- 0.5)
    horizontal pass first (rounded to uint8: (sum + 2^21) >> 22, clipped), then vertical;
    an axis whose size does not change is not resampled

Filters (support): bilinear (1), bicubic a = -0.5 (2), lanczos: sinc(x) sinc(x / 3) (3).
Each pass equals Pillow's exactly; Pillow 13 runs the vertical pass first for some
reductions (its own choice by the sizes), where the port's order may leave a pixel a level
apart (tests/models/test_pil_resample.py).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

_PRECISION = 22  # Pillow's PRECISION_BITS (32 - 8 - 2)


def _sinc(x: float) -> float:
    if x == 0.0:
        return 1.0
    x *= math.pi
    return math.sin(x) / x


def _lanczos(x: float) -> float:
    return _sinc(x) * _sinc(x / 3) if -3.0 <= x < 3.0 else 0.0


def _bicubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def _bilinear(x: float) -> float:
    x = abs(x)
    return 1.0 - x if x < 1.0 else 0.0


FILTERS = {"lanczos": (3.0, _lanczos), "bicubic": (2.0, _bicubic), "bilinear": (1.0, _bilinear)}
_PIL_CODES = {"lanczos": 1, "bilinear": 2, "bicubic": 3}


@lru_cache(maxsize=128)
def _coeffs(in_size: int, out_size: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(tap indexes [out, k] int64, fixed-point weights [out, k] int64) of one axis, as
    Pillow's precompute_coeffs and normalize_coeffs_8bpc make them (unused taps weigh 0)."""
    support, fn = FILTERS[name]
    scale = in_size / out_size
    fscale = max(scale, 1.0)
    support *= fscale
    ksize = int(math.ceil(support)) * 2 + 1
    idx = torch.zeros(out_size, ksize, dtype=torch.int64)
    wts = torch.zeros(out_size, ksize, dtype=torch.int64)
    for o in range(out_size):
        center = (o + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        n = min(int(center + support + 0.5), in_size) - lo
        w = [fn((i + lo - center + 0.5) / fscale) for i in range(n)]
        total = sum(w)
        if total != 0.0:
            w = [v / total for v in w]
        idx[o, :n] = torch.arange(lo, lo + n)
        idx[o, n:] = lo
        wts[o, :n] = torch.tensor([int(v * (1 << _PRECISION) + (-0.5 if v < 0 else 0.5)) for v in w],
                                  dtype=torch.int64)
    return idx, wts


def _last_axis(x: torch.Tensor, out_size: int, name: str) -> torch.Tensor:
    """uint8 [..., W] -> uint8 [..., out_size] along the last axis (one Pillow pass)."""
    idx, wts = _coeffs(x.shape[-1], out_size, name)
    flat = x.reshape(-1, x.shape[-1]).to(torch.int64)
    out = torch.empty(flat.shape[0], out_size, dtype=torch.uint8)
    step = max(1, (1 << 22) // idx.numel())  # rows a slice: its products stay ~32 MiB
    for s in range(0, flat.shape[0], step):
        acc = (flat[s:s + step, idx] * wts).sum(-1) + (1 << (_PRECISION - 1))
        out[s:s + step] = (acc >> _PRECISION).clamp_(0, 255).to(torch.uint8)
    return out.view(*x.shape[:-1], out_size)


def _by_pillow(x: torch.Tensor, size: tuple[int, int], name: str) -> torch.Tensor | None:
    """Pillow's own resize of RGB uint8 [3, H, W]; None without Pillow."""
    try:
        from PIL import Image
    except ImportError:
        return None
    h, w = size
    src = Image.frombuffer("RGB", (x.shape[2], x.shape[1]), x.permute(1, 2, 0).contiguous().numpy().tobytes(),
                           "raw", "RGB", 0, 1)
    out = src.resize((w, h), resample=_PIL_CODES[name])
    return torch.frombuffer(bytearray(out.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1).contiguous()


def pil_resize(x: torch.Tensor, size: tuple[int, int], name: str = "lanczos", pillow: bool = True) -> torch.Tensor:
    """uint8 [C, H, W] (on the host) -> uint8 [C, *size] as PIL's ``resize((w, h), filter)``
    gives it: by Pillow where installed (RGB; ``pillow`` False: the port always), else the
    port (module docstring)."""
    h, w = size
    if x.dtype != torch.uint8 or x.dim() != 3:
        raise ValueError(f"pil_resize takes uint8 [C, H, W], got {list(x.shape)} {x.dtype}")
    if h <= 0 or w <= 0:
        raise ValueError(f"pil_resize: output size {size} must be positive")
    x = x.cpu()
    if (h, w) == tuple(x.shape[1:]):
        return x.contiguous()
    if pillow and x.shape[0] == 3:
        out = _by_pillow(x, size, name)
        if out is not None:
            return out
    if w != x.shape[2]:
        x = _last_axis(x, w, name)
    if h != x.shape[1]:
        x = _last_axis(x.transpose(1, 2), h, name).transpose(1, 2)
    return x.contiguous()
