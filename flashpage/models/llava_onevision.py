"""LLaVA-OneVision (LlavaOnevisionForConditionalGeneration: llava-onevision-qwen2-0.5b /
7b / 72b): LLaVA-NeXT's any-res tiles (models/llava_next.py) on a SigLIP tower
(models/siglip_vision.py: no CLS row, vision_feature_layer -1 read before post_layernorm,
select strategy "full"), LLaVA's 2-layer GELU projector and image_newline, over a Qwen2
text model (models/multimodal.py).

An image's rows depend on how many images its prompt holds, as LlavaOnevisionProcessor
and the model decide (batch_num_images):

- one image: LLaVA-NeXT's tiling and packing (anyres_pixels, LlavaNextImageEncoder.pack)
  with anyres_max_N: an unpadded grid of r x c rows where sqrt(r c / (N side^2)) > 1.1 is
  interpolated (bilinear) down to floor(r / ratio) x floor(c / ratio) before its newlines
  (llava_next.pooled_grid)::

      base tile's side^2 rows, then r' x (c' + 1)

- several images: each one tile, the image padded to a square of the mean color
  (LlavaOnevisionImageProcessor's pad_to_square) and resized to S x S::

      side^2 rows, then image_newline                                  [side^2 + 1, H]

The request keeps each image as uint8 pixels [3, H, W] (``admit_image``: the server
decodes them on a worker thread before it knows how many a prompt holds) or as an
AnyResImage given (its tiles must be the ones its prompt's image count makes).

Videos (multi_modal_data {"video": frames}, vLLM's forms: engine/multimodal.video_items,
models/qwen2_vl_video.read_video), as get_video_features and LlavaOnevisionVideoProcessor
make them, each ``<video>`` (video_token_index) its rows::

    frames uint8 [F, 3, H, W] -> each resized to S x S (no aspect kept), normalized
    -> tower + projector -> [F, side, side, H] -> bilinear to ceil(side / 2) a side
    -> the frames' rows in order, then one image_newline     [F x ceil(side / 2)^2 + 1, H]
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from flashpage.engine.multimodal import MultiModalInput, token_runs, video_items
from flashpage.engine.prompt_embeds import digest
from flashpage.models.clip_image import is_pil_image, normalize, pil_to_uint8, preprocess
from flashpage.models.llava import expand_image_tokens
from flashpage.models.llava_next import (
    AnyResImage,
    LlavaNextImageEncoder,
    anyres_pixels,
    num_image_rows,
)

NAME = "LLaVA-OneVision (LlavaOnevisionForConditionalGeneration)"


def single_tile_pixels(image: Any, vc: Any) -> AnyResImage:
    """An image of a prompt of several (PIL or uint8 [3, H, W]) -> one tile [1, 3, S, S]:
    padded to a square of the mean color, resized, normalized (module docstring)."""
    x = image if isinstance(image, torch.Tensor) else pil_to_uint8(image, vc.processing.convert_rgb)
    px = preprocess(x, replace(vc.processing, pad_to_square=True))
    side = vc.image_size // vc.patch_size
    return AnyResImage(px[None], (int(x.shape[1]), int(x.shape[2])), side * side + 1)


@dataclass(eq=False)
class OnevisionVideo:
    """One video preprocessed: its frames resized, uint8 [F, 3, S, S] (host; normalized on
    the device by ``encode``), and its rows' count."""

    frames: torch.Tensor
    rows: int

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest(self.frames), digest_size=32)
        h.update(struct.pack("<q", -1))  # never an AnyResImage's
        return h.digest()


def video_rows(vc: Any, num_frames: int) -> int:
    """A video's rows: each frame's pooled grid, then one newline (module docstring)."""
    return num_frames * math.ceil(vc.image_size // vc.patch_size / 2) ** 2 + 1


def video_frames(video: Any, vc: Any, i: int = 0) -> OnevisionVideo:
    """A video (vLLM's forms) -> its frames resized to the tower's square (uint8)."""
    from flashpage.models.qwen2_vl_video import read_video

    frames, _ = read_video(video, i)
    s = vc.image_size
    if tuple(frames.shape[2:]) != (s, s):
        frames = F.interpolate(frames, size=(s, s), mode=vc.processing.resample, antialias=True,
                               align_corners=False)
    return OnevisionVideo(frames.contiguous(), video_rows(vc, int(frames.shape[0])))


def expand_items(ids: list[int], image_token: int, video_token: int, image_rows: list[int],
                 video_rows_: list[int]) -> tuple[list[int], list[int]]:
    """A prompt's ids with each ``<image>`` and ``<video>`` made its item's rows, and each
    item's first position, in prompt order (so the inputs are ordered by it). Ids whose
    images are expanded already (no video given) are kept; a ValueError names a count of
    placeholders that differs from the items'."""
    if not video_rows_:
        return expand_image_tokens(ids, image_token, len(image_rows), image_rows)
    n_img, n_vid = ids.count(image_token), ids.count(video_token)
    if n_vid != len(video_rows_) or n_img != len(image_rows):
        expanded = [n for _, n in token_runs(ids, video_token)]
        hint = " (put one <video> per video: it is expanded here)" if expanded and max(expanded) > 1 else ""
        raise ValueError(f"the prompt has {n_vid} video token(s) (<video>, id {video_token}) and {n_img} "
                         f"image token(s) but {len(video_rows_)} video(s) and {len(image_rows)} image(s) "
                         f"were given{hint}")
    out: list[int] = []
    starts: list[int] = []
    imgs, vids = iter(image_rows), iter(video_rows_)
    for t in ids:
        if t in (image_token, video_token):
            starts.append(len(out))
            out.extend([t] * next(imgs if t == image_token else vids))
        else:
            out.append(t)
    return out, starts


class LlavaOnevisionImageEncoder(LlavaNextImageEncoder):
    """Images and videos -> the rows of their ``<image>`` / ``<video>`` positions (module
    docstring)."""

    # tower tokens over rows: a pooled grid keeps about anyres_max of up to 36 tiles'
    # (llava-onevision's 6 x 6 pinpoints: 37 x 729 tokens for 7,371 rows); 4 bounds it
    TOKENS_PER_ROW = 4.0

    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): the images of
        ``multi_modal_data`` ({"image": a PIL image, uint8 pixels [3, H, W], an
        AnyResImage, or a list of them}) tiled as their count says and its videos
        ({"video": frames, or a list of videos}) resized (module docstring), each
        ``<image>`` / ``<video>`` expanded to its item's rows, the inputs in prompt order; a
        ValueError names what is wrong."""
        from flashpage.models.llava import images_of

        vc = self.config
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{\"image\": image}} or "
                             f"{{\"video\": frames}}, got {type(data).__name__}")
        unknown = sorted(set(data) - {"image", "video"})
        if unknown or not data:
            raise ValueError(f"multi_modal_data {unknown or '{}'}: {NAME} takes \"image\" and \"video\"")
        images = images_of({"image": data["image"]}, batches=False) if "image" in data else []
        videos = [video_frames(v, vc, i) for i, v in enumerate(video_items(data["video"]))] \
            if "video" in data else []
        if "video" in data and not videos:
            raise ValueError("multi_modal_data[\"video\"] is an empty list")
        items: list[Any] = [self.tiles(img, i, len(images) == 1) for i, img in enumerate(images)]
        assert vc.video_token_id is not None
        ids, starts = expand_items(ids, vc.image_token_id, vc.video_token_id, [it.rows for it in items],
                                   [v.rows for v in videos])
        # in prompt order: an item's kind by the token at its start
        queue_i, queue_v = iter(items), iter(videos)
        ordered = [next(queue_v if ids[s] == vc.video_token_id else queue_i) for s in starts]
        return ids, [MultiModalInput(s, it.rows, it.digest(), it)
                     for s, it in zip(starts, ordered, strict=True)]

    video_token_name = "<video>"

    @property
    def video_placeholder_ids(self) -> list[int]:
        """What a chat's video part becomes in the prompt (LLM.chat, the server's video_url
        parts): the <video> token, which ``prepare`` expands to the video's rows."""
        assert self.config.video_token_id is not None
        return [self.config.video_token_id]

    def rows_of(self, images: list[Any]) -> list[int]:
        """The rows of each of one prompt's images (``admit_image``'s, or any ``prepare``
        takes), as ``prepare`` counts them: the server's length check and usage."""
        side = self.config.image_size // self.config.patch_size
        if len(images) != 1:
            return [side * side + 1] * len(images)
        (image,) = images
        if isinstance(image, AnyResImage):
            return [image.rows]
        x = self.admit_image(image)
        return [num_image_rows(self.config, (int(x.shape[1]), int(x.shape[2])))]

    def admit_image(self, image: Any, i: int = 0) -> Any:
        """What a request keeps of an image before its prompt's image count is known (the
        server's, on a worker thread): a PIL image decoded to uint8 [3, H, W]; a uint8
        tensor or an AnyResImage checked later, in ``prepare``."""
        if is_pil_image(image):
            try:
                return pil_to_uint8(image, self.config.processing.convert_rgb)
            except (OSError, ValueError) as e:  # a truncated or unreadable file: PIL's words
                raise ValueError(f"image {i} could not be read: {e}") from e
        self._uint8_checked(image, i)
        return image

    def pixel_values(self, image: Any, i: int = 0) -> AnyResImage:  # type: ignore[override]
        """One image alone in its prompt, tiled (``tiles``; ``flashpage inspect``'s count)."""
        return self.tiles(image, i, True)

    def tiles(self, image: Any, i: int, alone: bool) -> AnyResImage:
        """Image ``i`` tiled as the only image of its prompt (``alone``) or as one of
        several (one tile); an AnyResImage given is checked against that."""
        vc = self.config
        if isinstance(image, AnyResImage):
            if alone:
                return self._checked(image, i)
            s = vc.image_size
            px = image.pixels
            if not isinstance(px, torch.Tensor) or tuple(px.shape) != (1, 3, s, s) \
                    or not px.is_floating_point():
                shape = list(px.shape) if isinstance(px, torch.Tensor) else type(px).__name__
                raise ValueError(f"image {i}: an image among several of a prompt is one float tile "
                                 f"[1, 3, {s}, {s}] in {NAME}, got {shape}")
            px = px.detach().to("cpu", torch.float32).contiguous()
            if not bool(torch.isfinite(px).all()):
                raise ValueError(f"image {i}: pixel values hold inf or NaN")
            side = s // vc.patch_size
            return AnyResImage(px, tuple(image.size), side * side + 1)  # type: ignore[arg-type]
        x = self.admit_image(image, i)
        try:
            return anyres_pixels(x, vc) if alone else single_tile_pixels(x, vc)
        except (OSError, ValueError) as e:
            raise ValueError(f"image {i} could not be read: {e}") from e

    @staticmethod
    def _uint8_checked(image: Any, i: int) -> None:
        if isinstance(image, torch.Tensor):
            if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3 or 0 in image.shape:
                raise ValueError(f"image {i}: a tensor image must be uint8 pixels [3, H, W] (its "
                                 f"tiles and row count follow its size), got {list(image.shape)} "
                                 f"{str(image.dtype).replace('torch.', '')}")
            return
        raise ValueError(f"image {i} is a {type(image).__name__}: give a PIL.Image.Image or uint8 "
                         "pixels [3, H, W]")

    @torch.inference_mode()
    def encode(self, data: list[Any]) -> list[torch.Tensor]:  # type: ignore[override]
        """The engine's multimodal hook: images (AnyResImage) and videos (OnevisionVideo)
        -> their rows [rows, H] on the device; every tile and frame of the batch through
        the tower at once."""
        p = self.vision_tower.embeddings.patch_embedding.weight
        parts = []
        for d in data:
            if isinstance(d, OnevisionVideo):
                parts.append(normalize(d.frames.to(p.device, non_blocking=True), self.config.processing))
            else:
                parts.append(d.pixels.to(p.device, non_blocking=True))
        feats = self(torch.cat(parts).to(p.dtype))
        out, i = [], 0
        for d, x in zip(data, parts, strict=True):
            n = x.shape[0]
            out.append(self.pack_video(feats[i:i + n]) if isinstance(d, OnevisionVideo)
                       else self.pack(feats[i:i + n], d.size))
            i += n
        return out

    def pack_video(self, feats: torch.Tensor) -> torch.Tensor:
        """A video's frames' rows [F, side^2, H] -> its rows (module docstring)."""
        side = self.config.image_size // self.config.patch_size
        n, _, hidden = feats.shape
        grid = feats.view(n, side, side, hidden).permute(0, 3, 1, 2)
        half = math.ceil(side / 2)
        pooled = F.interpolate(grid, size=[half, half], mode="bilinear").permute(0, 2, 3, 1)
        return torch.cat([pooled.reshape(-1, hidden), self.image_newline.to(feats.dtype)[None]])

    def pack(self, feats: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """One image's tiles' rows -> its rows: one tile (an image among several) its rows
        and image_newline, else LLaVA-NeXT's packing with anyres_max pooling."""
        if feats.shape[0] == 1:
            return torch.cat([feats[0], self.image_newline.to(feats.dtype)[None]])
        return super().pack(feats, size)
