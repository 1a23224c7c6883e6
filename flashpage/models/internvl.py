"""InternVL's images and videos in transformers' layout (InternVLForConditionalGeneration:
InternVL3-1B-hf .. 78B-hf, InternVL3.5-*-HF): the InternViT tower, pixel shuffle and the
projector, GotOcr2ImageProcessor's tiles and InternVLProcessor's prompt expansion.

The text model (Qwen2 / Qwen3 / Llama / ...; InternLM2 and InternLM3 in the remote-code
layout: models/internlm2.py) is served as any multimodal checkpoint's
(models/multimodal.py). Beside it the engine keeps an ``InternVLImageEncoder``.

Tiles (``tile_image``, GotOcr2ImageProcessor's crop_to_patches, which InternVLProcessor
turns on), S the tower's image_size::

    RGB uint8 [3, H, W]
      -> grid c x r among min_tiles <= c r <= max_tiles: the aspect ratio c / r nearest W / H,
         a tie to the later (more tiles) while the image's area exceeds half the grid's
      -> resized to (r S, c S) (antialiased bicubic: models/clip_image.py), cut row by row
      -> and, for more than one tile, the whole image resized to S x S last (the thumbnail)
    -> n tiles uint8 [n, 3, S, S] (normalized on the device by ``encode``)

Rows (``InternVLImageEncoder.forward``), P = S / patch, k = shuffle (1 / downsample_ratio)::

    tile -> patch conv -> [CLS | P^2 patches] + positions -> InternViT layers:
        x + lambda_1 * attn(norm1(x)) ; x + lambda_2 * mlp(norm2(x))     (norms: LayerNorm
        or RMSNorm; q / k RMSNorms over the whole width before the heads split)
    -> the feature layer's hidden state, CLS row dropped -> [P, P, Hv]
    -> pixel shuffle: each k x k block's features side by side -> [(P / k)^2, k^2 Hv]
    -> LayerNorm -> linear_1 -> act -> linear_2                     -> [(P / k)^2, H]

so an image is n (P / k)^2 rows (256 a tile in the published models: 448 / 14 = 32, k = 2).

Prompt expansion (``expand_internvl_images``), as InternVLProcessor does to the text: each
``<IMG_CONTEXT>`` placeholder (what InternVL's chat template writes for an image part)
becomes ``<img>``, the image's rows of ``<IMG_CONTEXT>``, ``</img>``; the rows take the
``<IMG_CONTEXT>`` positions (ids expanded so already are kept).

Videos (``expand_video_text``, ``expand_internvl_items``): a text prompt's ``<video>``
becomes, before it is tokenized (the encoder's ``expand_text``, LLMEngine.add_request), its
frames' text as InternVLProcessor writes it, so "FrameN: " is tokenized with the text around
it::

    <video> -> Frame1: <img>T x <IMG_CONTEXT></img>\nFrame2: <img>...</img> ...   (T = a tile's rows)

each frame one tile resized to S x S (no tiling) and normalized under the video processor's
steps, an input of its own (the frames' rows are apart). The remote-code layout joins the
frames without the newline (vLLM's form for it).

Weights: the tower's under ``model.vision_tower.`` (or ``vision_tower.``), the projector's
under ``model.multi_modal_projector.``; the layers past the feature layer, the mask token
and a final LayerNorm that is not read are skipped. OpenGVLab's remote-code layout
(InternVLChatModel: ``vision_model.`` with a fused ``attn.qkv``, ``mlp1.``) is renamed to
those on the way in (``from_remote_names``); its tiles may leave out the thumbnail
(use_thumbnail false).
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.engine.multimodal import (
    MultiModalInput,
    expand_beside_frames,
    token_runs,
    video_items,
)
from flashpage.engine.prompt_embeds import digest
from flashpage.layers.norm import RMSNorm
from flashpage.models.clip_image import (
    checked_tiles,
    normalize,
    pil_to_uint8,
    tile_given_image,
)
from flashpage.models.clip_vision import CLIPMLP, activation
from flashpage.models.internvl_config import InternVLVisionConfig
from flashpage.models.llava import images_of
from flashpage.models.llava_next import _resize

if TYPE_CHECKING:
    from flashpage.models.loader import ModelSource

logger = logging.getLogger(__name__)

NAME = "InternVL (InternVLForConditionalGeneration)"

# checkpoint prefix -> ours, tried in order
_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)
IMAGE_PREFIXES = tuple(p for p, _ in _PREFIXES)
_LAYER = re.compile(r"vision_tower\.encoder\.layer\.(\d+)\.")
# OpenGVLab's remote-code names (InternVLChatModel) -> transformers', in order (its
# convert_internvl_weights_to_hf's renames); the fused attn.qkv is cut in three apart
REMOTE_PREFIXES = ("vision_model.", "mlp1.")
_REMOTE_NAMES = (
    (r"^vision_model\.", "vision_tower."), (r"\.layers\.", ".layer."), (r"class_embedding$", "cls_token"),
    (r"position_embedding$", "position_embeddings"), (r"patch_embedding\.", "patch_embeddings.projection."),
    (r"\.ls(\d)$", r".lambda_\1"), (r"\.attn\.proj\.", ".attention.projection_layer."),
    (r"\.attn\.", ".attention."), (r"\.norm1\.", ".layernorm_before."), (r"\.norm2\.", ".layernorm_after."),
    (r"^mlp1\.0\.", "multi_modal_projector.layer_norm."), (r"^mlp1\.1\.", "multi_modal_projector.linear_1."),
    (r"^mlp1\.3\.", "multi_modal_projector.linear_2."),
)


def from_remote_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """An InternVLChatModel checkpoint's image tensors under transformers' names (each fused
    ``attn.qkv`` as q_proj, k_proj, v_proj: its rows in thirds); other names pass as they are."""
    for name, t in weights:
        if not name.startswith(REMOTE_PREFIXES):
            yield name, t
            continue
        ours = name
        for pat, rep in _REMOTE_NAMES:
            ours = re.sub(pat, rep, ours)
        if ".attention.qkv." in ours:
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3, dim=0), strict=True):
                yield ours.replace(".qkv.", f".{part}."), chunk
        else:
            yield ours, t


# ------------------------------------------------------------------ tiles
@lru_cache(maxsize=256)
def tile_grid(size: tuple[int, int], tile: int, lo: int, hi: int) -> tuple[int, int]:
    """GotOcr2's get_optimal_tiled_canvas: the (columns, rows) of tiles for an image of
    ``size`` (height, width) -> the grid among lo <= c r <= hi (by tile count, then columns)
    whose c / r is nearest the image's W / H; an equal one later in that order replaces it
    while the image's area is above half of its tiles'."""
    h, w = size
    grids = sorted(((c, r) for c in range(1, hi + 1) for r in range(1, hi + 1) if lo <= c * r <= hi),
                   key=lambda g: g[0] * g[1])
    aspect, area = w / h, w * h
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and area > 0.5 * tile * tile * c * r:
            best = (c, r)
    return best


def num_tiles(vc: InternVLVisionConfig, size: tuple[int, int]) -> int:
    """The tiles of an image of ``size`` (height, width): its grid's, plus the thumbnail when
    the grid has more than one."""
    c, r = tile_grid(size, vc.image_size, vc.min_tiles, vc.max_tiles)
    return c * r + (c * r > 1 and vc.thumbnail)


def num_image_rows(vc: InternVLVisionConfig, size: tuple[int, int]) -> int:
    """The rows (``<IMG_CONTEXT>`` positions) of an image of ``size`` (height, width)."""
    return num_tiles(vc, size) * vc.tokens_per_image


@dataclass(eq=False)
class InternVLImage:
    """One image tiled: its tiles [n, 3, S, S] (uint8 pixels, normalized on the device; or
    float pixel values given preprocessed), the image's size (height, width) and its rows.
    ``frame``: one frame of a video (one tile, normalized under the video processor's steps,
    which may differ from the image processor's)."""

    pixels: torch.Tensor
    size: tuple[int, int]
    rows: int
    frame: bool = False

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest(self.pixels), digest_size=32)
        h.update(struct.pack("<qq?", *self.size, self.frame))
        return h.digest()


def tile_image(image: Any, vc: InternVLVisionConfig) -> InternVLImage:
    """A PIL image (or uint8 [3, H, W]) -> its tiles, uint8 (module docstring)."""
    proc = vc.processing
    x = image if isinstance(image, torch.Tensor) else pil_to_uint8(image, proc.convert_rgb)
    h, w = int(x.shape[1]), int(x.shape[2])
    s = vc.image_size
    c, r = tile_grid((h, w), s, vc.min_tiles, vc.max_tiles)
    canvas = _resize(x, (r * s, c * s), proc.resample)
    tiles = [canvas[:, i:i + s, j:j + s] for i in range(0, r * s, s) for j in range(0, c * s, s)]
    if len(tiles) > 1 and vc.thumbnail:
        tiles.append(_resize(x, (s, s), proc.resample))
    return InternVLImage(torch.stack(tiles).contiguous(), (h, w), len(tiles) * vc.tokens_per_image)


def expand_internvl_images(ids: list[int], vc: InternVLVisionConfig, rows: list[int]
                           ) -> tuple[list[int], list[int]]:
    """A prompt's ids with each ``<IMG_CONTEXT>`` made ``<img>``, its image's rows of
    ``<IMG_CONTEXT>`` and ``</img>`` (InternVLProcessor's), and each image's first row
    position. Ids expanded already (each run of ``<IMG_CONTEXT>`` its image's rows, between
    ``<img>`` and ``</img>``) are kept. A ValueError names a count that differs."""
    tok = vc.image_token_id
    runs = token_runs(ids, tok)
    if len(runs) == len(rows) and any(n > 1 for n in rows) and all(
            n == want and s > 0 and ids[s - 1] == vc.start_token_id and s + n < len(ids)
            and ids[s + n] == vc.end_token_id for (s, n), want in zip(runs, rows, strict=True)):
        return list(ids), [s for s, _ in runs]
    total = sum(n for _, n in runs)
    if total != len(rows):
        hint = " (put one <IMG_CONTEXT> per image: it is expanded here)" if runs and max(n for _, n in runs) > 1 \
            else " (put one in the prompt per image)"
        raise ValueError(f"the prompt has {total} image token(s) (<IMG_CONTEXT>, id {tok}) but "
                         f"{len(rows)} image(s) were given{hint}")
    out: list[int] = []
    starts: list[int] = []
    for t in ids:
        if t == tok:
            out.append(vc.start_token_id)
            starts.append(len(out))
            out.extend([tok] * rows[len(starts) - 1])
            out.append(vc.end_token_id)
        else:
            out.append(t)
    return out, starts


# ------------------------------------------------------------------ videos
def video_text(vc: InternVLVisionConfig, frames: int) -> str:
    """A video of ``frames`` frames as the prompt's text: InternVLProcessor's
    replace_video_token, each frame "FrameN: <img>" its tile's rows of <IMG_CONTEXT> "</img>",
    the frames joined by "\\n" (vLLM's remote-code layout: by nothing; ``frame_sep``)."""
    start, end, ctx, _ = vc.token_texts
    tile = f"{start}{ctx * vc.tokens_per_image}{end}"
    return vc.frame_sep.join(f"Frame{i + 1}: {tile}" for i in range(frames))


def video_frames(video: Any, vc: InternVLVisionConfig, i: int = 0) -> torch.Tensor:
    """Video ``i`` (vLLM's forms: engine/multimodal.video_items) -> its frames, each one tile
    resized to the tower's square (no aspect kept, no tiling: InternVLVideoProcessor's
    resize; vLLM's for the remote-code layout), uint8 [F, 3, S, S]; a ValueError names a
    bad video (models/qwen2_vl_video.read_video)."""
    from flashpage.models.qwen2_vl_video import read_video

    frames, _ = read_video(video, i)
    s = vc.image_size
    if tuple(frames.shape[2:]) != (s, s):
        frames = F.interpolate(frames, size=(s, s), mode=vc.frame_processing.resample, antialias=True,
                               align_corners=False)
    return frames.contiguous()


def expand_video_text(text: str, vc: InternVLVisionConfig, frame_counts: list[int]) -> str:
    """``text`` with its i-th video token made video i's frames' text (``video_text``), as
    InternVLProcessor does before tokenizing (the "FrameN: " text is tokenized with the
    text around it); a ValueError names a count of video tokens other than the videos'."""
    token = vc.token_texts[3]
    parts = text.split(token)
    if len(parts) - 1 != len(frame_counts):
        raise ValueError(f"the prompt has {len(parts) - 1} video placeholder(s) ({token}) but "
                         f"{len(frame_counts)} video(s) were given (put one {token} per video: each "
                         "becomes its frames' text, \"Frame1: <img>...</img>\", ...)")
    out = [parts[0]]
    for n, rest in zip(frame_counts, parts[1:], strict=True):
        out += [video_text(vc, n), rest]
    return "".join(out)


def expand_internvl_items(ids: list[int], vc: InternVLVisionConfig, image_rows: list[int], frames: int
                          ) -> tuple[list[int], list[tuple[int, bool]]]:
    """A prompt with videos: its ids with each image's ``<IMG_CONTEXT>`` made ``<img>``, its
    rows, ``</img>``; the frames, written out already (``expand_video_text``: a run of a
    tile's rows between ``<img>`` and ``</img>``), kept; and each item's first row position
    with whether it is a frame, in prompt order. A ValueError names a run that is neither,
    or counts other than the items'."""
    tok, rows = vc.image_token_id, vc.tokens_per_image

    def is_frame(s: int, n: int) -> bool:  # <img>, a tile's rows, </img>
        return n == rows and s > 0 and ids[s - 1] == vc.start_token_id and s + n < len(ids) \
            and ids[s + n] == vc.end_token_id

    def image(r: int) -> tuple[list[int], list[int]]:  # <img>, its rows, </img>
        return [vc.start_token_id, *[tok] * r, vc.end_token_id], [1]

    return expand_beside_frames(ids, tok, "<IMG_CONTEXT>", is_frame,
                                f"<img>, {rows} x <IMG_CONTEXT>, </img> (written from the video's placeholder)",
                                image_rows, frames, image)


# ------------------------------------------------------------------ the tower
class InternVLVisionPatchEmbeddings(nn.Module):
    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        self.projection = nn.Conv2d(vc.num_channels, vc.hidden_size, kernel_size=vc.patch_size,
                                    stride=vc.patch_size)


class InternVLVisionEmbeddings(nn.Module):
    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.empty(1, 1, vc.hidden_size))
        self.patch_embeddings = InternVLVisionPatchEmbeddings(vc)
        self.position_embeddings = nn.Parameter(torch.empty(1, vc.patches_per_side ** 2 + 1, vc.hidden_size)) \
            if vc.position_embeddings else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, 1 + P^2, hidden] (the CLS row first, patches row-major)"""
        conv = self.patch_embeddings.projection
        x = conv(pixel_values.to(conv.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.position_embeddings if self.position_embeddings is not None else x


def _norm(vc: InternVLVisionConfig, dim: int) -> nn.Module:
    """transformers' NORM2FN: LayerNorm, or an RMSNorm in fp32 cast back before its weight."""
    return RMSNorm(dim, vc.layer_norm_eps) if vc.norm_type == "rms_norm" else nn.LayerNorm(dim, eps=vc.layer_norm_eps)


class InternVLVisionAttention(nn.Module):
    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        h = vc.hidden_size
        self.num_heads = vc.num_attention_heads
        self.head_dim = h // vc.num_attention_heads
        self.q_proj = nn.Linear(h, h, bias=vc.attention_bias)
        self.k_proj = nn.Linear(h, h, bias=vc.attention_bias)
        self.v_proj = nn.Linear(h, h, bias=vc.attention_bias)
        self.projection_layer = nn.Linear(h, h)
        # (InternViT-6B's) RMSNorms over the whole width, before the heads split
        self.q_norm = RMSNorm(h) if vc.qk_norm else None
        self.k_norm = RMSNorm(h) if vc.qk_norm else None

    def fuse(self) -> None:
        """After loading: q, k and v as one GEMM (the checkpoint's three Linears' rows
        stacked; transformers' names are what load_weights reads)."""
        if hasattr(self, "qkv"):
            return
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        h = q.weight.shape[1]
        with torch.device(q.weight.device):
            self.qkv = nn.Linear(h, 3 * h, bias=q.bias is not None, dtype=q.weight.dtype)
        with torch.no_grad():
            self.qkv.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
            if q.bias is not None:
                self.qkv.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))  # type: ignore[union-attr]
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        return self.projection_layer(o.transpose(1, 2).reshape(n, t, -1))


class InternVLVisionLayer(nn.Module):
    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        self.attention = InternVLVisionAttention(vc)
        self.mlp = CLIPMLP(vc)
        self.layernorm_before = _norm(vc, vc.hidden_size)
        self.layernorm_after = _norm(vc, vc.hidden_size)
        self.lambda_1 = nn.Parameter(torch.empty(vc.hidden_size))
        self.lambda_2 = nn.Parameter(torch.empty(vc.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x + lambda * f(x) as one pass each (addcmul), not a product then a sum
        x = torch.addcmul(x, self.lambda_1, self.attention(self.layernorm_before(x)))
        return torch.addcmul(x, self.lambda_2, self.mlp(self.layernorm_after(x)))


class InternVLVisionEncoder(nn.Module):
    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(InternVLVisionLayer(vc) for _ in range(vc.layers_run))


class InternVLVisionTower(nn.Module):
    """transformers' InternVLVisionModel up to the feature layer (names kept), and its final
    LayerNorm where the features are read after it (``final_norm``)."""

    def __init__(self, vc: InternVLVisionConfig) -> None:
        super().__init__()
        self.embeddings = InternVLVisionEmbeddings(vc)
        self.encoder = InternVLVisionEncoder(vc)
        self.layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps) if vc.final_norm else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> the feature layer's hidden state [n, 1 + P^2, hidden]"""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x) if self.layernorm is not None else x


class InternVLMultiModalProjector(nn.Module):
    def __init__(self, vc: InternVLVisionConfig, text_hidden: int) -> None:
        super().__init__()
        width = vc.hidden_size * vc.shuffle ** 2
        self.layer_norm = nn.LayerNorm(width)  # torch's default eps, as transformers'
        self.linear_1 = nn.Linear(width, text_hidden)
        self.act = activation(vc.projector_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


def pixel_shuffle(x: torch.Tensor, k: int) -> torch.Tensor:
    """InternVLModel.pixel_shuffle at scale 1 / k: [n, P, P, C] -> [n, P / k, P / k, k^2 C],
    each output position's k x k block of features side by side (transformers' views and
    transposes, so the channel order is theirs)."""
    n, a, b, c = x.shape
    x = x.reshape(n, a, b // k, c * k).permute(0, 2, 1, 3)
    x = x.reshape(n, b // k, a // k, c * k * k).permute(0, 2, 1, 3)
    return x


class InternVLImageEncoder(nn.Module):
    """Images -> the rows of their ``<IMG_CONTEXT>`` positions (module docstring)."""

    token_name = "<IMG_CONTEXT>"

    @property
    def video_token_name(self) -> str:
        return self.config.token_texts[3]

    # tiles per tower call: a tile is P^2 + 1 = 1,025 tower tokens for 256 rows, so an encode
    # batch of max_num_batched_tokens rows runs in slices of this many
    MAX_TOWER_TILES = 16

    def __init__(self, vc: InternVLVisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = vc
        self.vision_tower = InternVLVisionTower(vc)
        self.multi_modal_projector = InternVLMultiModalProjector(vc, text_hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, tokens_per_image, text hidden]"""
        vc = self.config
        x = self.vision_tower(pixel_values)[:, 1:]
        p = vc.patches_per_side
        x = pixel_shuffle(x.reshape(x.shape[0], p, p, -1), vc.shuffle)
        return self.multi_modal_projector(x.reshape(x.shape[0], -1, x.shape[-1]))

    def activation_bytes(self, rows: int) -> int:
        """The most an encode call of ``rows`` rows (at least one image's tile) adds while it
        runs: per tower token of one slice (MAX_TOWER_TILES tiles at most) its stream and the
        attention's and MLP's intermediates, the slice's shuffled features, the output rows,
        and each tile's pixels (fp32 on the way to the tower)."""
        vc = self.config
        tiles = max(1, -(-rows // vc.tokens_per_image))
        per_call = min(tiles, self.MAX_TOWER_TILES)
        tokens = per_call * (vc.patches_per_side ** 2 + 1)
        w = self.multi_modal_projector.linear_2.weight
        b = w.element_size()
        per = (8 * vc.hidden_size + 4 * vc.intermediate_size) * b
        shuffled = per_call * vc.tokens_per_image * (3 * vc.hidden_size * vc.shuffle ** 2 + 2 * w.shape[0]) * b
        out = tiles * vc.tokens_per_image * w.shape[0] * b
        return tokens * per + shuffled + out + tiles * 3 * vc.image_size ** 2 * 4

    # ------------------------------------------------------------ the engine's hooks
    def expand_text(self, text: str, data: Any) -> str:
        """A text prompt with multi_modal_data, before it is tokenized (LLMEngine.add_request):
        each video token made its video's frames' text (``expand_video_text``), as
        InternVLProcessor does; the remote-code layout's "<image>" (vLLM's placeholder for
        it, several tokens) made <IMG_CONTEXT>."""
        vc = self.config
        if vc.remote:
            text = text.replace("<image>", vc.token_texts[2])
        return self.expand_videos(text, data)

    def expand_videos(self, text: str, data: Any) -> str:
        """``text`` with each video token made its video's frames' text (``expand_video_text``;
        LLM.chat's rendered template too)."""
        if not isinstance(data, dict) or "video" not in data:
            return text
        from flashpage.models.qwen2_vl_video import read_video

        counts = [int(read_video(v, i)[0].shape[0]) for i, v in enumerate(video_items(data["video"]))]
        return expand_video_text(text, self.config, counts)

    @property
    def video_placeholder_text(self) -> str:
        """What a chat template that prints text writes for a video part (LLM.chat)."""
        return self.config.token_texts[3]

    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): the images of
        ``multi_modal_data`` ({"image": a PIL image, uint8 pixels [3, H, W], an
        InternVLImage, or a list of them}) tiled, each ``<IMG_CONTEXT>`` expanded
        (expand_internvl_images); its videos ({"video": frames, or a list of videos}) one
        tile a frame, each frame an input of its own (the frames' rows are apart: "FrameN: "
        text between them), its prompt's frames written out from the text already
        (``expand_text``); a ValueError names what is wrong."""
        vc = self.config
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{\"image\": image}} or "
                             f"{{\"video\": frames}}, got {type(data).__name__}")
        unknown = sorted(set(data) - {"image", "video"})
        if unknown or not data:
            raise ValueError(f"multi_modal_data {unknown or '{}'}: {NAME} takes \"image\" and \"video\"")
        images = images_of({"image": data["image"]}, batches=False) if "image" in data else []
        items = [self.pixel_values(img, i) for i, img in enumerate(images)]
        video = vc.video_token_id
        if video is not None and video in ids:
            if "video" not in data:
                raise ValueError(f"the prompt has video tokens ({self.video_token_name}, id {video}) but no "
                                 "video was given (multi_modal_data={\"video\": frames})")
            raise ValueError(f"the prompt's ids hold {self.video_token_name} (id {video}), which is not expanded "
                             "in token ids: InternVLProcessor writes a video's frames as text (\"Frame1: "
                             "<img>...</img>\"), tokenized with the text around it; give the prompt as text, "
                             "or its ids with each frame written out so")
        if "video" not in data:
            ids, starts = expand_internvl_images(ids, vc, [it.rows for it in items])
            return ids, [MultiModalInput(s, it.rows, it.digest(), it) for s, it in zip(starts, items, strict=True)]
        videos = [video_frames(v, vc, i) for i, v in enumerate(video_items(data["video"]))]
        frames = [InternVLImage(f[None], (vc.image_size, vc.image_size), vc.tokens_per_image, True)
                  for v in videos for f in v]
        ids, marks = expand_internvl_items(ids, vc, [it.rows for it in items], len(frames))
        queue_i, queue_f = iter(items), iter(frames)
        ordered = [(s, next(queue_f if frame else queue_i)) for s, frame in marks]
        return ids, [MultiModalInput(s, it.rows, it.digest(), it) for s, it in ordered]

    def num_rows(self, item: InternVLImage) -> int:
        return item.rows

    def rows_of(self, images: list[Any]) -> list[int]:
        """The prompt positions each of one prompt's images (``admit_image``'s) takes once
        its placeholder is expanded: its rows and ``<img>`` / ``</img>`` (the server's length
        check and usage)."""
        return [self.pixel_values(im, i).rows + 2 for i, im in enumerate(images)]

    def admit_image(self, image: Any, i: int = 0) -> InternVLImage:
        """What a request keeps of an image (the server's, tiled on a worker thread)."""
        return self.pixel_values(image, i)

    def pixel_values(self, image: Any, i: int = 0) -> InternVLImage:
        """One image tiled on the host (tile_image): a PIL image or uint8 pixels [3, H, W];
        an InternVLImage given is checked (its tiles as its size makes them, finite)."""
        vc = self.config
        if isinstance(image, InternVLImage):
            return self._checked(image, i)
        return tile_given_image(image, i, lambda im: tile_image(im, vc))

    def _checked(self, item: InternVLImage, i: int) -> InternVLImage:
        vc = self.config
        px, hw = checked_tiles(item, i, lambda hw: num_tiles(vc, hw), vc.image_size, NAME)
        return InternVLImage(px, hw, px.shape[0] * vc.tokens_per_image)

    @torch.inference_mode()
    def encode(self, data: list[InternVLImage]) -> list[torch.Tensor]:
        """The engine's multimodal hook: images and frames (InternVLImage) -> their rows
        [rows, H] on the device: every tile of the batch copied at once (pinned), normalized
        there (a frame under the video processor's steps), through the tower in slices of at
        most MAX_TOWER_TILES tiles."""
        from flashpage.models.multimodal import to_device

        w = self.vision_tower.embeddings.patch_embeddings.projection.weight
        vc = self.config

        def proc(d: InternVLImage) -> Any:  # a video's frames: the video processor's steps
            return vc.frame_processing if d.frame else vc.processing

        if all(d.pixels.dtype == torch.uint8 for d in data):
            dev = to_device(torch.cat([d.pixels for d in data]), w.device)
            if len({id(proc(d)) for d in data}) == 1:
                pixels = normalize(dev, proc(data[0]))
            else:  # frames beside images: each under its own steps
                parts = dev.split([d.pixels.shape[0] for d in data])
                pixels = torch.cat([normalize(x, proc(d)) for d, x in zip(data, parts, strict=True)])
        else:  # float pixel values given (uint8 tiles beside them normalized alone)
            pixels = torch.cat([normalize(to_device(d.pixels, w.device), proc(d)) if d.pixels.dtype == torch.uint8
                                else d.pixels.to(w.device) for d in data])
        pixels = pixels.to(w.dtype)
        feats = torch.cat([self(pixels[i:i + self.MAX_TOWER_TILES])
                           for i in range(0, pixels.shape[0], self.MAX_TOWER_TILES)])
        out, i = [], 0
        for d in data:
            n = d.pixels.shape[0]
            out.append(feats[i:i + n].reshape(-1, feats.shape[-1]))
            i += n
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """The tower's and projector's tensors (the text model's are ignored); those never
        read (module docstring) are skipped."""
        from flashpage.models.multimodal import load_image_weights

        def unread(ours: str) -> bool:
            m = _LAYER.match(ours)
            return bool(m and int(m.group(1)) >= self.config.layers_run) \
                or ours == "vision_tower.embeddings.mask_token" \
                or (ours.startswith("vision_tower.layernorm.") and not self.config.final_norm)

        if self.config.remote:
            weights = from_remote_names(weights)
        loaded, skipped = load_image_weights(self, weights, where, _PREFIXES,
                                             "InternVL's vision tower or projector",
                                             "vision tower / projector", unread)
        if skipped:
            logger.info("InternVL vision tower: %d tensor(s) never read (past feature layer %d, "
                        "the mask token) skipped", skipped, self.config.feature_layer)
        return loaded


def load_image_encoder(source: ModelSource, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> InternVLImageEncoder:
    """``source``'s image encoder in ``dtype`` on ``device``: its checkpoint's tensors, or
    random ones (a random_config source)."""
    from flashpage.models.multimodal import build_image_encoder

    vc = source.config.vision
    assert isinstance(vc, InternVLVisionConfig)
    enc = build_image_encoder(source, dtype, device, seed, lambda: InternVLImageEncoder(vc, source.config.hidden_size),
                              REMOTE_PREFIXES if vc.remote else IMAGE_PREFIXES)
    if source.kind == "random":
        with torch.no_grad():
            for n, p in enc.named_parameters():
                if ".lambda_" in n:
                    p.fill_(0.1)  # layer_scale_init_value
    for m in enc.modules():
        if isinstance(m, InternVLVisionAttention):
            m.fuse()
    return enc.eval()
