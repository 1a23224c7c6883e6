"""LLaVA-NeXT (llava-v1.6, LlavaNextForConditionalGeneration): LLaVA's CLIP tower and
projector (models/llava.py) over an image cut into tiles at one of the checkpoint's
resolutions, the tiles' rows arranged back into the image's grid.

Preprocessing (``anyres_pixels``, LlavaNextImageProcessor's steps, in torch):

    RGB uint8 [3, H, W]
      -> best resolution (bh, bw) among image_grid_pinpoints (select_best_resolution: the
         most of the image's pixels kept, then the least padding)
      -> resized keeping its aspect ratio to fit (bh, bw), centered on zeros of (bh, bw)
      -> cut into (bh / S) x (bw / S) tiles of S x S, row by row
      and the whole image resized to S x S (no aspect kept), first
    -> each of the 1 + tiles through CLIP's steps (models/clip_image.py)  ->  [1 + n, 3, S, S]

Rows (``LlavaNextImageEncoder.pack``), side = S / patch:

    tower + projector on every tile -> [1 + n, side^2, H]
    base = tile 0's rows                                          [side^2, H]
    grid = tiles 1.. as a (gh * side) x (gw * side) map of rows, the padding's rows and
           columns cut off again (unpad: the image's aspect ratio, transformers' rounding),
           under LLaVA-OneVision's anyres_max_N a grid of too many rows interpolated down
           to about N tiles' (pooled_grid; models/llava_onevision.py)
    each grid row + image_newline                                 [r, c + 1, H]
    -> base, then the grid row by row                             [side^2 + r * (c + 1), H]

so an image's count of ``<image>`` positions depends on its size: ``num_image_rows`` computes
it on the host (the engine expands each placeholder to it at admission), as the model packs.
vision_feature_select_strategy "full" is refused at config time (the CLS row has no place in
the grid; transformers fails on it too).

Weights: LLaVA's names (models/llava.py) and ``image_newline`` (or ``model.image_newline``).
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.config import VisionConfig
from flashpage.engine.multimodal import MultiModalInput
from flashpage.engine.prompt_embeds import digest
from flashpage.models.clip_image import is_pil_image, pil_to_uint8, preprocess
from flashpage.models.llava import LlavaImageEncoder, expand_image_tokens, images_of

Resolution = tuple[int, int]  # (height, width)


def select_best_resolution(size: Resolution, candidates: tuple[Resolution, ...]) -> Resolution:
    """transformers' select_best_resolution: the candidate keeping the most of the image's
    pixels once it is scaled to fit, ties to the one wasting the fewest; the first of equals."""
    h, w = size
    best, best_eff, best_waste = candidates[0], -1, math.inf
    for ch, cw in candidates:
        scale = min(cw / w, ch / h)
        eff = min(int(w * scale) * int(h * scale), w * h)
        waste = ch * cw - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (ch, cw), eff, waste
    return best


def fit_size(size: Resolution, target: Resolution) -> Resolution:
    """transformers' get_patch_output_size: ``size`` scaled to fit ``target``, the side that
    limits exactly the target's, the other rounded up (never past the target's)."""
    h, w = size
    th, tw = target
    if tw / w < th / h:
        return min(math.ceil(h * (tw / w)), th), tw
    return th, min(math.ceil(w * (th / h)), tw)


def unpadded_grid(size: Resolution, grid_hw: Resolution) -> tuple[int, int, int, int]:
    """transformers' unpad_image on a feature map of ``grid_hw`` rows x columns for an image
    of ``size``: (first row, rows, first column, columns) kept."""
    h, w = size
    ch, cw = grid_hw
    if w / h > cw / ch:
        new_h = int(round(h * (cw / w), 7))
        pad = (ch - new_h) // 2
        return pad, ch - 2 * pad, 0, cw
    new_w = int(round(w * (ch / h), 7))
    pad = (cw - new_w) // 2
    return 0, ch, pad, cw - 2 * pad


def pooled_grid(vc: VisionConfig, r: int, c: int) -> Resolution:
    """The rows x columns an unpadded grid of r x c is packed as: itself, or under
    LLaVA-OneVision's anyres_max_N (vc.anyres_max) a grid of more than 1.1^2 x N tiles'
    rows shrunk by its ratio to N tiles' (transformers' floor rounding), which
    ``LlavaNextImageEncoder.pack`` interpolates bilinearly."""
    if not vc.anyres_max:
        return r, c
    side = vc.image_size // vc.patch_size
    ratio = math.sqrt(r * c / (vc.anyres_max * side ** 2))
    if ratio > 1.1:
        return int(r // ratio), int(c // ratio)
    return r, c


def num_image_rows(vc: VisionConfig, size: Resolution) -> int:
    """The rows (``<image>`` positions) of an image of ``size`` (height, width): the base
    tile's, then r x (c + 1) for the unpadded (and pooled: pooled_grid) grid and its
    newlines (module docstring)."""
    side = vc.image_size // vc.patch_size
    bh, bw = select_best_resolution(size, vc.grid_pinpoints)
    _, r, _, c = unpadded_grid(size, (bh // vc.image_size * side, bw // vc.image_size * side))
    r, c = pooled_grid(vc, r, c)
    return side * side + r * (c + 1)


@dataclass(eq=False)
class AnyResImage:
    """One image preprocessed: its tiles' pixel values [1 + n, 3, S, S] (float32, host; the
    whole image first), its size (height, width) and its rows' count."""

    pixels: torch.Tensor
    size: Resolution
    rows: int

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest(self.pixels), digest_size=32)
        h.update(struct.pack("<qq", *self.size))
        return h.digest()


def _resize(x: torch.Tensor, hw: Resolution, mode: str) -> torch.Tensor:
    """uint8 [3, h, w] -> uint8 [3, *hw] (antialiased, PIL's filter: models/clip_image.py)."""
    if tuple(x.shape[1:]) == tuple(hw):
        return x
    return F.interpolate(x[None], size=tuple(hw), mode=mode, antialias=True, align_corners=False)[0]


def anyres_pixels(image: Any, vc: VisionConfig) -> AnyResImage:
    """A PIL image (or uint8 [3, H, W]) -> its tiles' pixel values (module docstring)."""
    proc = vc.processing
    x = image if isinstance(image, torch.Tensor) else pil_to_uint8(image, proc.convert_rgb)
    h, w = int(x.shape[1]), int(x.shape[2])
    s = vc.image_size
    bh, bw = select_best_resolution((h, w), vc.grid_pinpoints)
    nh, nw = fit_size((h, w), (bh, bw))
    canvas = x.new_zeros((3, bh, bw))
    top, left = (bh - nh) // 2, (bw - nw) // 2
    canvas[:, top:top + nh, left:left + nw] = _resize(x, (nh, nw), proc.resample)
    # the whole image first: LlavaNextImageProcessor resizes it to size (shortest_edge squared)
    base_hw = proc.resize_hw or ((proc.shortest_edge,) * 2 if proc.shortest_edge else (s, s))
    tiles = [_resize(x, base_hw, proc.resample)]
    tiles += [canvas[:, i:i + s, j:j + s] for i in range(0, bh, s) for j in range(0, bw, s)]
    pixels = torch.stack([preprocess(t.contiguous(), proc) for t in tiles])
    return AnyResImage(pixels, (h, w), num_image_rows(vc, (h, w)))


class LlavaNextImageEncoder(LlavaImageEncoder):
    """Images -> the rows of their ``<image>`` positions, each its own count (module
    docstring); LLaVA's tower and projector, and image_newline."""

    # tiles' tokens over rows: the base tile's 576 rows and the grid's, unpadded (at most the
    # tiles' own), plus a newline a grid row; 2 bounds it with room
    TOKENS_PER_ROW = 2.0

    def __init__(self, vc: VisionConfig, text_hidden: int) -> None:
        super().__init__(vc, text_hidden)
        self.image_newline = nn.Parameter(torch.empty(text_hidden))

    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): a request's
        ``multi_modal_data`` ({"image": a PIL image or a list of them}) tiled and
        preprocessed, each ``<image>`` expanded to its image's rows; a ValueError names
        what is wrong."""
        items = [self.pixel_values(img, i) for i, img in enumerate(images_of(data))]
        ids, starts = expand_image_tokens(ids, self.config.image_token_id, len(items),
                                          [it.rows for it in items])
        return ids, [MultiModalInput(s, it.rows, it.digest(), it)
                     for s, it in zip(starts, items, strict=True)]

    def num_rows(self, pixels: Any) -> int:
        return pixels.rows

    def pixel_values(self, image: Any, i: int = 0) -> AnyResImage:  # type: ignore[override]
        """One image tiled and preprocessed (anyres_pixels) on the host; one given so
        already (the server's, read off its event loop) is kept."""
        if isinstance(image, AnyResImage):
            return self._checked(image, i)
        if is_pil_image(image):
            try:
                return anyres_pixels(image, self.config)
            except (OSError, ValueError) as e:  # a truncated or unreadable file: PIL's words
                raise ValueError(f"image {i} could not be read: {e}") from e
        if isinstance(image, torch.Tensor):
            raise ValueError(f"image {i}: LLaVA-NeXT takes PIL images, not pixel values: its "
                             "tiles and row count follow the image's own size, which a "
                             f"tensor of shape {list(image.shape)} does not say")
        raise ValueError(f"image {i} is a {type(image).__name__}: give a PIL.Image.Image")

    def _checked(self, item: AnyResImage, i: int) -> AnyResImage:
        """An AnyResImage given (the server's, or a caller's): its tiles and rows as this
        model's preprocessing makes them for its size, float and finite (else a ValueError:
        a wrong count would fail the engine's step, not the request)."""
        vc = self.config
        size = tuple(item.size)
        if len(size) != 2 or not all(isinstance(x, int) and x > 0 for x in size):
            raise ValueError(f"image {i}: AnyResImage.size must be (height, width), got {item.size!r}")
        bh, bw = select_best_resolution((size[0], size[1]), vc.grid_pinpoints)
        s = vc.image_size
        want = (1 + bh // s * (bw // s), 3, s, s)
        px = item.pixels
        if not isinstance(px, torch.Tensor) or tuple(px.shape) != want or not px.is_floating_point():
            shape = list(px.shape) if isinstance(px, torch.Tensor) else type(px).__name__
            raise ValueError(f"image {i}: an image of {size[0]} x {size[1]} has float tiles "
                             f"{list(want)} in this model, got {shape}")
        px = px.detach().to("cpu", torch.float32).contiguous()
        if not bool(torch.isfinite(px).all()):
            raise ValueError(f"image {i}: pixel values hold inf or NaN")
        return AnyResImage(px, (size[0], size[1]), num_image_rows(vc, (size[0], size[1])))

    def pack(self, feats: torch.Tensor, size: Resolution) -> torch.Tensor:
        """One image's tiles' rows [1 + gh * gw, side^2, H] -> its rows (module docstring)."""
        vc = self.config
        side = vc.image_size // vc.patch_size
        bh, bw = select_best_resolution(size, vc.grid_pinpoints)
        gh, gw = bh // vc.image_size, bw // vc.image_size
        hidden = feats.shape[-1]
        grid = feats[1:].view(gh, gw, side, side, hidden).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(gh * side, gw * side, hidden)
        r0, r, c0, c = unpadded_grid(size, (gh * side, gw * side))
        grid = grid[r0:r0 + r, c0:c0 + c]
        if (pooled := pooled_grid(vc, r, c)) != (r, c):
            r = pooled[0]
            grid = F.interpolate(grid.permute(2, 0, 1)[None], list(pooled), mode="bilinear")[0].permute(1, 2, 0)
        newline = self.image_newline.to(grid.dtype).expand(r, 1, hidden)
        return torch.cat([feats[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])

    @torch.inference_mode()
    def encode(self, data: list[AnyResImage]) -> list[torch.Tensor]:  # type: ignore[override]
        """The engine's multimodal hook (engine/multimodal.py): images (AnyResImage) -> their
        rows [rows, H] on the device; every tile of the batch through the tower at once."""
        from flashpage.models.multimodal import to_device

        p = self.vision_tower.embeddings.patch_embedding.weight
        pixels = to_device(torch.cat([d.pixels for d in data]), p.device).to(p.dtype)  # pinned, asynchronous
        feats = self(pixels)
        out, i = [], 0
        for d in data:
            n = d.pixels.shape[0]
            out.append(self.pack(feats[i:i + n], d.size))
            i += n
        return out
