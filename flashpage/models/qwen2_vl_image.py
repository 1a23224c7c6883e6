"""An image (or a video's frames) as Qwen2-VL's vision tower reads it, in torch
(Qwen2VLImageProcessor's and Qwen2VLVideoProcessor's steps):

    RGB uint8 [3, H, W] -> smart_resize to (h, w), multiples of patch x merge (28), with
    min_pixels <= h x w <= max_pixels and the aspect ratio kept as near as they allow
    -> x * rescale_factor -> (x - mean) / std -> patches

    patches [grid_h x grid_w, 3 x temporal_patch_size x patch x patch] fp32, grid (1, gh, gw)

A patch's values are laid out (channel, temporal, row, column), the Conv3d patch embedding's
weight layout, the image repeated over the temporal patch (an image is a one-frame video);
the patches are ordered by merge block: (gh / merge, gw / merge, merge, merge), so that each
run of merge^2 patches is one row of the patch merger (models/qwen2_vl.py). A video's frames,
resized alike (the video processor's own min / max pixels) and padded to a multiple of the
temporal patch by repeating the last, give each run of temporal_patch_size frames a grid step
t: patches (t, gh / merge, gw / merge, merge, merge), grid (t, gh, gw).

The resize is torch's antialiased ``interpolate`` on uint8, as models/clip_image.py's (the
kernel transformers' torchvision processor runs): equal to transformers' PIL processor
(Qwen2VLImageProcessorPil) where no resampling happens, within a level of 1/255 otherwise
(tests/models/test_qwen2_vl.py measures both).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flashpage.config import QwenImageProcessing
from flashpage.models.clip_image import pil_to_uint8


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """Qwen2-VL's smart_resize: (h, w) multiples of ``factor`` with min_pixels <= h x w <=
    max_pixels, the aspect ratio kept as near as they allow; a ValueError for an aspect
    ratio over 200."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {height} x {width}: its aspect ratio must be under 200, got "
                         f"{max(height, width) / min(height, width):.1f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(x: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """fp32 [3, H, W] (multiples of patch x merge) -> [gh x gw, 3 x temporal x patch^2]
    in merge-block order (module docstring); or a video's frames [T, 3, H, W] (T a multiple
    of temporal) -> [T / temporal x gh x gw, ...], each run of ``temporal`` frames one
    temporal patch (Qwen2VLVideoProcessor's layout: frame group, then merge blocks)."""
    if x.dim() == 3:
        x = x.unsqueeze(0).expand(temporal, *x.shape)
    f, c, h, w = x.shape
    gt, gh, gw = f // temporal, h // patch, w // patch
    p = x.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    p = p.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, c, temporal, patch, patch)
    return p.reshape(gt * gh * gw, c * temporal * patch * patch).contiguous()


def resize(image: Any, proc: QwenImageProcessing, patch: int, merge: int,
           size: Callable[[int, int], tuple[int, int]] | None = None
           ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A PIL image (or a uint8 [3, H, W] tensor) -> (uint8 [3, h, w] at smart_resize's size,
    or ``size(H, W)``'s (GLM-4.1V's rule, models/glm4v.py), its patch grid (1, h / patch,
    w / patch)): the host's part of the preprocessing."""
    x = image if isinstance(image, torch.Tensor) else pil_to_uint8(image, proc.convert_rgb)
    h, w = x.shape[1:]
    rh, rw = size(h, w) if size is not None else \
        smart_resize(h, w, patch * merge, proc.min_pixels, proc.max_pixels)
    if (rh, rw) != (h, w):
        x = F.interpolate(x[None], size=(rh, rw), mode=proc.resample, antialias=True,
                          align_corners=False)[0]
    return x, (1, rh // patch, rw // patch)


def normalize(x: torch.Tensor, proc: QwenImageProcessing, patch: int, merge: int, temporal: int
              ) -> torch.Tensor:
    """resize's uint8 [3, h, w] (or resize_video's [T, 3, h, w]) -> patches fp32 [gt x gh x
    gw, patch_dim] on x's device (the engine runs it on the GPU: a tenth of the bytes
    cross, and none of the host's time)."""
    out = x.to(torch.float32)
    if proc.rescale_factor is not None:
        out = out * proc.rescale_factor
    if proc.mean is not None and proc.std is not None:
        mean = torch.tensor(proc.mean, dtype=torch.float32, device=x.device)[:, None, None]
        std = torch.tensor(proc.std, dtype=torch.float32, device=x.device)[:, None, None]
        out = (out - mean) / std
    return patchify(out, patch, merge, temporal)


def resize_video(frames: torch.Tensor, proc: QwenImageProcessing, patch: int, merge: int, temporal: int
                 ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A video's frames uint8 [T, 3, H, W] -> (uint8 [T', 3, h, w] at smart_resize's size
    under the video processor's bounds, T' the next multiple of ``temporal``: an odd count's
    last frame repeated, as Qwen2VLVideoProcessor pads; the grid (T' / temporal, h / patch,
    w / patch)). Every frame is resized alike (one size for the whole video)."""
    h, w = frames.shape[2:]
    rh, rw = smart_resize(h, w, patch * merge, proc.min_pixels, proc.max_pixels)
    x = frames
    if (rh, rw) != (h, w):
        x = F.interpolate(x, size=(rh, rw), mode=proc.resample, antialias=True, align_corners=False)
    if pad := -x.shape[0] % temporal:
        x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
    return x.contiguous(), (x.shape[0] // temporal, rh // patch, rw // patch)


def preprocess(image: Any, proc: QwenImageProcessing, patch: int, merge: int, temporal: int
               ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A PIL image (or a uint8 [3, H, W] tensor) -> (patches fp32 [gh x gw, patch_dim],
    its grid (1, gh, gw)): ``resize`` then ``normalize``, on the host."""
    x, grid = resize(image, proc, patch, merge)
    return normalize(x, proc, patch, merge, temporal), grid
