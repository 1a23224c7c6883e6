"""An image as a Pixtral tower's pixel values (PixtralImageProcessor's steps):

    RGB [3, H, W] -> resize to (H', W'): fit longest_hw keeping the aspect (floor, never
    enlarged), then each side rounded up to a multiple of ``patch`` (the prompt's patch:
    patch_size x spatial_merge_size) -> x * rescale_factor -> (x - mean) / std
    -> float32 [3, H', W']

Images keep their own size (no padding: the tower takes each at its size). A PIL image is
resized by PIL itself (its ``resize`` method, the call transformers' PIL processor makes, so
the two agree exactly); a uint8 tensor by torch's antialiased interpolate (within a level of
1/255 of PIL's). PIL is never imported here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from flashpage.models.clip_image import is_pil_image, pil_to_uint8
from flashpage.models.pixtral_config import PixtralProcessing

_PIL_RESAMPLE = {"bilinear": 2, "bicubic": 3}


def resized_size(h: int, w: int, proc: PixtralProcessing, patch: int) -> tuple[int, int]:
    """transformers' pixtral get_resize_output_image_size: (H', W') for an h x w image."""
    if proc.longest_hw is not None:
        ratio = max(h / proc.longest_hw[0], w / proc.longest_hw[1])
        if ratio > 1:
            h, w = int(math.floor(h / ratio)), int(math.floor(w / ratio))
    if h <= 0 or w <= 0:
        raise ValueError("its aspect ratio is too extreme: fitted into "
                         f"{proc.longest_hw}, one side would be 0 pixels")
    return ((h - 1) // patch + 1) * patch, ((w - 1) // patch + 1) * patch


def preprocess(image: Any, proc: PixtralProcessing, patch: int) -> torch.Tensor:
    """A PIL image (or a uint8 [3, H, W] tensor) -> float32 pixel values [3, H', W']."""
    if is_pil_image(image):
        img = image.convert("RGB") if proc.convert_rgb or image.mode != "RGB" else image
        w, h = img.size
        if w == 0 or h == 0:
            raise ValueError(f"image has size {w} x {h}")
        size = resized_size(h, w, proc, patch)
        if size != (h, w):
            img = img.resize((size[1], size[0]), _PIL_RESAMPLE[proc.resample])
        x = pil_to_uint8(img, False)
    else:
        x = image
        h, w = x.shape[1:]
        size = resized_size(h, w, proc, patch)
        if size != (h, w):
            x = F.interpolate(x[None], size=size, mode=proc.resample, antialias=True,
                              align_corners=False)[0]
    out = x.to(torch.float32)
    if proc.rescale_factor is not None:
        out = out * proc.rescale_factor
    if proc.mean is not None and proc.std is not None:
        mean = torch.tensor(proc.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(proc.std, dtype=torch.float32)[:, None, None]
        out = (out - mean) / std
    return out.contiguous()
