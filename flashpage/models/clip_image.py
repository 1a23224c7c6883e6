"""An image as a CLIP vision tower's pixel values, in torch (CLIPImageProcessor's steps):

    RGB uint8 [3, H, W] -> (pad to square) -> resize (shortest edge, antialiased bicubic)
    -> center crop -> x * rescale_factor -> (x - mean) / std  ->  float32 [3, S, S]

The steps and their numbers come from the checkpoint's preprocessor_config.json
(config.ImageProcessing). The resize is torch's antialiased ``interpolate`` on uint8, the
kernel torchvision's CLIPImageProcessor runs and a port of PIL's (a = -0.5 cubic, fixed
point), so it equals transformers' torchvision processor, and PIL's (CLIPImageProcessorPil,
transformers' fallback without torchvision) to within a level of 1/255 on natural images:
the two passes may be taken in the other order (tests/models/test_llava.py measures it).
An image already of the output size is not resampled: equal to both exactly.

PIL is never imported here: a PIL.Image is read through its own methods (``convert``,
``tobytes``), so a caller that never passes one needs no Pillow.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flashpage.config import ImageProcessing


def is_pil_image(x: object) -> bool:
    """A PIL.Image.Image, recognized without importing PIL."""
    return any(c.__module__.startswith("PIL.") and c.__name__ == "Image" for c in type(x).__mro__)


def pil_to_uint8(img: Any, convert_rgb: bool = True) -> torch.Tensor:
    """A PIL image as uint8 [3, H, W] (converted to RGB first; a grayscale one repeated)."""
    if convert_rgb or img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    if w == 0 or h == 0:
        raise ValueError(f"image has size {w} x {h}")
    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return data.view(h, w, 3).permute(2, 0, 1).contiguous()


def tile_given_image(image: Any, i: int, tile: Any) -> Any:
    """``tile(image)`` for a PIL image or uint8 pixels [3, H, W] (the tiling processors'
    input: InternVL's, Idefics3's); anything else, or a file PIL cannot read, refused by
    name as image ``i``."""
    if is_pil_image(image) or isinstance(image, torch.Tensor):
        if isinstance(image, torch.Tensor) and (image.dtype != torch.uint8 or image.dim() != 3
                                                or image.shape[0] != 3 or 0 in image.shape):
            raise ValueError(f"image {i}: a tensor image must be uint8 pixels [3, H, W] (its tiles "
                             f"follow its size), got {list(image.shape)} "
                             f"{str(image.dtype).replace('torch.', '')}")
        try:
            return tile(image.detach().cpu() if isinstance(image, torch.Tensor) else image)
        except (OSError, ValueError) as e:  # a truncated or unreadable file: PIL's words
            raise ValueError(f"image {i} could not be read: {e}") from e
    raise ValueError(f"image {i} is a {type(image).__name__}: give a PIL.Image.Image or uint8 "
                     "pixels [3, H, W]")


def checked_tiles(item: Any, i: int, tiles_of: Any, side: int, arch: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """A tiled image given already (``item.pixels`` [n, 3, side, side], ``item.size`` (height,
    width)): its size a pair of positive ints, its tiles ``tiles_of((h, w))`` of uint8 pixels
    or finite float pixel values -> (the pixels on the host, (h, w)); refused by name as
    image ``i`` otherwise."""
    size = tuple(item.size)
    if len(size) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in size):
        raise ValueError(f"image {i}: {type(item).__name__}.size must be (height, width), got {item.size!r}")
    hw = (int(size[0]), int(size[1]))
    want = (tiles_of(hw), 3, side, side)
    px = item.pixels
    if not isinstance(px, torch.Tensor) or tuple(px.shape) != want \
            or not (px.dtype == torch.uint8 or px.is_floating_point()):
        shape = list(px.shape) if isinstance(px, torch.Tensor) else type(px).__name__
        raise ValueError(f"image {i}: an image of {hw[0]} x {hw[1]} has tiles {list(want)} (uint8 "
                         f"pixels or float pixel values) in {arch}, got {shape}")
    if px.is_floating_point():
        px = px.detach().to("cpu", torch.float32).contiguous()
        if not bool(torch.isfinite(px).all()):
            raise ValueError(f"image {i}: pixel values hold inf or NaN")
        return px, hw
    return px.detach().cpu().contiguous(), hw


def _resize_shortest(h: int, w: int, edge: int) -> tuple[int, int]:
    """transformers' get_resize_output_image_size (default_to_square False): the shorter
    side becomes ``edge``, the longer int(edge * long / short)."""
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(edge * long / short)
    return (new_long, edge) if w <= h else (edge, new_long)


def _center_crop(x: torch.Tensor, ch: int, cw: int) -> torch.Tensor:
    """transformers' center_crop: top = (H - ch) // 2; an image smaller than the crop is
    padded with zeros around it first (ceil of half the difference on the top / left)."""
    _, h, w = x.shape
    if h < ch or w < cw:
        nh, nw = max(h, ch), max(w, cw)
        top, left = -(-(nh - h) // 2), -(-(nw - w) // 2)
        padded = x.new_zeros((x.shape[0], nh, nw))
        padded[:, top:top + h, left:left + w] = x
        x, h, w = padded, nh, nw
    top, left = (h - ch) // 2, (w - cw) // 2
    return x[:, top:top + ch, left:left + cw]


def _pad_to_square(x: torch.Tensor, mean: tuple[float, ...] | None) -> torch.Tensor:
    """LlavaImageProcessor's do_pad: centered on a square of the longer side, the rest the
    mean color (int(m * 255) per channel)."""
    _, h, w = x.shape
    if h == w:
        return x
    side = max(h, w)
    color = [int(m * 255) for m in mean] if mean else [0, 0, 0]
    out = torch.tensor(color, dtype=x.dtype)[:, None, None].expand(3, side, side).clone()
    if w > h:
        top = (side - h) // 2
        out[:, top:top + h] = x
    else:
        left = (side - w) // 2
        out[:, :, left:left + w] = x
    return out


def preprocess(image: Any, proc: ImageProcessing) -> torch.Tensor:
    """A PIL image (or a uint8 [3, H, W] tensor) -> float32 pixel values [3, S, S]."""
    return normalize(resized_uint8(image, proc), proc)


def resized_uint8(image: Any, proc: ImageProcessing) -> torch.Tensor:
    """``preprocess``'s first half: the image padded, resized and cropped, still uint8
    [3, S, S] (what an engine may keep and normalize on the device)."""
    x = image if isinstance(image, torch.Tensor) else pil_to_uint8(image, proc.convert_rgb)
    if proc.pad_to_square:
        x = _pad_to_square(x, proc.mean)
    h, w = x.shape[1:]
    size = (_resize_shortest(h, w, proc.shortest_edge) if proc.shortest_edge is not None
            else proc.resize_hw)
    if size is not None and tuple(size) != (h, w):
        x = F.interpolate(x[None], size=tuple(size), mode=proc.resample, antialias=True,
                          align_corners=False)[0]
    if proc.crop_hw is not None:
        x = _center_crop(x, *proc.crop_hw)
    return x


def normalize(x: torch.Tensor, proc: ImageProcessing) -> torch.Tensor:
    """``preprocess``'s second half, on ``x``'s device: uint8 [3, S, S] (or a batch of them)
    -> float32, rescaled and normalized."""
    out = x.to(torch.float32)
    if proc.rescale_factor is not None:
        out = out * proc.rescale_factor
    if proc.mean is not None and proc.std is not None:
        mean = torch.tensor(proc.mean, dtype=torch.float32, device=x.device)[:, None, None]
        std = torch.tensor(proc.std, dtype=torch.float32, device=x.device)[:, None, None]
        out = (out - mean) / std
    return out.contiguous()
