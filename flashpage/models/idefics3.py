"""Idefics3's and SmolVLM's images (Idefics3ForConditionalGeneration,
SmolVLMForConditionalGeneration): Idefics3ImageProcessor's tiles, the SigLIP tower, the
pixel-shuffle connector and Idefics3Processor's prompt expansion.

The text model (Llama: Llama 3 for Idefics3-8B, SmolLM2 for SmolVLM) is served as any
multimodal checkpoint's (models/multimodal.py: ``model.text_model.`` -> ``model.``).
Beside it the engine keeps an ``Idefics3ImageEncoder``.

Tiles (``tile_image``, Idefics3ImageProcessor's steps on uint8, PIL's resampler:
models/pil_resample.py), M = max_image_size (the tower's image_size)::

    RGB uint8 [3, H, W]
      -> the longest edge resized to size (an odd short side made even; below 4096)
      -> splitting: each side up to a multiple of M (the aspect kept, then rounded up)
           more than M x M: cut into rows x cols tiles row by row, then the whole resized
           to M x M last (the global image); exactly M x M: that one tile alone
         no splitting: resized to M x M, one tile
    -> tiles uint8 [n, 3, M, M] (normalized on the device by ``encode``)

Rows (``Idefics3ImageEncoder.forward``), P = M / patch, s = scale_factor::

    tile -> patch conv + positions -> SigLIP layers -> post_layernorm     [P^2, Hv]
    -> pixel shuffle (each s x s block's features side by side)          [(P / s)^2, s^2 Hv]
    -> connector.modality_projection.proj (no bias)                      [(P / s)^2, H]

The positions are Idefics3VisionEmbeddings' bucketed ones for a whole tile (the patch grid
mapped onto the table's, float32 as transformers computes them: the identity for most P,
not all, e.g. P = 19 or 25).

Prompt expansion (``expand_idefics3_images``), as Idefics3Processor (and SmolVLMProcessor)
writes each ``<image>``, N = image_seq_len::

    one tile:    <fake_token_around_image> <global-img> <image> x N <fake_token_around_image>
    r x c grid:  for each row: (<fake_token_around_image> <row_i_col_j> <image> x N) for each
                 column, then "\\n" ("\\n\\n" after the last row, merged with the global
                 image's "\\n"), then the one-tile form for the global image

The special tokens split the text, so the newlines are tokenized alone: their ids come from
the tokenizer's files (models/idefics3_config.py). Each tile's N rows are one
MultiModalInput (the tiles of one image are apart in the prompt).

SmolVLM2's videos (a ``<video>`` in a text prompt, each frame one tile and one input):
models/smolvlm_video.py, through this encoder's ``sample_videos`` (do_sample_frames, where a
request's videos come in: LLMEngine.add_request, LLM.chat, the server's chat), ``expand_text``
and ``prepare``.

Weights: the tower's under ``model.vision_model.``, the connector's under
``model.connector.`` (or either without ``model.``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flashpage.engine.multimodal import MultiModalInput, video_items
from flashpage.engine.prompt_embeds import digest
from flashpage.models.clip_image import (
    checked_tiles,
    normalize,
    pil_to_uint8,
    tile_given_image,
)
from flashpage.models.idefics3_config import (
    MAX_IMAGE_SIDE,
    Idefics3VisionConfig,
    with_processor_kwargs,
)
from flashpage.models.internvl import pixel_shuffle
from flashpage.models.llava import images_of
from flashpage.models.pil_resample import pil_resize
from flashpage.models.siglip_vision import SiglipEmbeddings, SiglipVisionTower

if TYPE_CHECKING:
    from flashpage.models.loader import ModelSource

# checkpoint prefix -> ours, tried in order
_PREFIXES = (
    ("model.vision_model.", "vision_model."),
    ("vision_model.", "vision_model."),
    ("model.connector.", "connector."),
    ("connector.", "connector."),
)
IMAGE_PREFIXES = tuple(p for p, _ in _PREFIXES)


# ------------------------------------------------------------------ tiles
def longest_edge_size(h: int, w: int, longest: int) -> tuple[int, int]:
    """Idefics3ImageProcessor's resize to ``size``: the longer side becomes ``longest``, the
    other int(its share), made even; then both scaled below MAX_IMAGE_SIDE."""
    aspect = w / h
    if w >= h:
        w, h = longest, int(longest / aspect)
        h += h % 2
    else:
        h, w = longest, int(longest * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    aspect = w / h
    if w >= h and w > MAX_IMAGE_SIDE:
        w, h = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
    elif h > w and h > MAX_IMAGE_SIDE:
        h, w = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * aspect)
    return max(h, 1), max(w, 1)


def tile_multiple_size(h: int, w: int, m: int) -> tuple[int, int]:
    """Idefics3ImageProcessor.resize_for_vision_encoder: the longer side up to a multiple of
    ``m``, the other int(its share) then up to one too."""
    aspect = w / h
    if w >= h:
        w = math.ceil(w / m) * m
        h = math.ceil(int(w / aspect) / m) * m
    else:
        h = math.ceil(h / m) * m
        w = math.ceil(int(h * aspect) / m) * m
    return h, w


def image_grid(vc: Idefics3VisionConfig, size: tuple[int, int]) -> tuple[int, int]:
    """(rows, cols) of an image of ``size`` (height, width): (0, 0) for one tile."""
    if not vc.splitting:
        return 0, 0
    h, w = tile_multiple_size(*longest_edge_size(*size, vc.longest_edge), vc.tile)
    return (h // vc.tile, w // vc.tile) if h > vc.tile or w > vc.tile else (0, 0)


def num_tiles(vc: Idefics3VisionConfig, size: tuple[int, int]) -> int:
    r, c = image_grid(vc, size)
    return r * c + 1


@dataclass(eq=False)
class Idefics3Image:
    """One image tiled: its tiles [n, 3, M, M] (uint8 pixels, normalized on the device; or
    float pixel values given preprocessed), the image's size (height, width) and its grid
    (rows, cols; (0, 0): one tile). Each tile is its own input, named by its own digest."""

    pixels: torch.Tensor
    size: tuple[int, int]
    grid: tuple[int, int]


def tile_image(image: Any, vc: Idefics3VisionConfig) -> Idefics3Image:
    """A PIL image (or uint8 [3, H, W]) -> its tiles, uint8 (module docstring)."""
    x = image if isinstance(image, torch.Tensor) else pil_to_uint8(image, vc.processing.convert_rgb)
    h, w = int(x.shape[1]), int(x.shape[2])
    m, f = vc.tile, vc.resample
    y = pil_resize(x, longest_edge_size(h, w, vc.longest_edge), f)
    r, c = image_grid(vc, (h, w))
    if not vc.splitting:
        tiles = [pil_resize(y, (m, m), f)]
    else:
        y = pil_resize(y, tile_multiple_size(int(y.shape[1]), int(y.shape[2]), m), f)
        tiles = [y[:, i * m:(i + 1) * m, j * m:(j + 1) * m] for i in range(r) for j in range(c)]
        tiles.append(pil_resize(y, (m, m), f) if tiles else y)
    return Idefics3Image(torch.stack(tiles).contiguous(), (h, w), (r, c))


def _image_ids(vc: Idefics3VisionConfig, grid: tuple[int, int]) -> tuple[list[int], list[int]]:
    """One image's expansion (module docstring) and where each tile's rows start in it."""
    n, img = vc.tokens_per_image, vc.image_token_id
    missing = [name for name, t in (("<fake_token_around_image>", vc.fake_token_id),
                                    ("<global-img>", vc.global_token_id)) if t is None]
    r, c = grid
    side = vc.row_col_side
    if r and (vc.row_col_ids is None or r > side or c > side
              or any(vc.row_col_ids[i * side + j] is None for i in range(r) for j in range(c))):
        missing.append(f"<row_1_col_1> .. <row_{r}_col_{c}>")
    if r and vc.newline_ids is None:
        missing.append("a byte-level \"\\n\"")
    if missing:
        raise ValueError(f"the tokenizer's files hold no {', '.join(missing)}: the image's prompt "
                         f"tokens (Idefics3Processor's) cannot be written")
    fake, glob = vc.fake_token_id, vc.global_token_id
    assert fake is not None and glob is not None
    out: list[int] = []
    starts: list[int] = []
    for i in range(r):
        for j in range(c):
            assert vc.row_col_ids is not None
            rc = vc.row_col_ids[i * side + j]
            assert rc is not None
            out += [fake, rc]
            starts.append(len(out))
            out += [img] * n
        nl = vc.newline_ids if i < r - 1 else vc.double_newline_ids
        assert nl is not None
        out += list(nl)
    out += [fake, glob]
    starts.append(len(out))
    out += [img] * n + [fake]
    return out, starts


def expanded_length(vc: Idefics3VisionConfig, grid: tuple[int, int]) -> int:
    """The prompt tokens one image's ``<image>`` becomes (``_image_ids``' length; each
    newline one token where the tokenizer's files do not say)."""
    r, c = grid
    n = vc.tokens_per_image + 3  # the global image's <fake> <global-img> rows <fake>
    if r:
        nl = len(vc.newline_ids or (0,))
        n += r * c * (vc.tokens_per_image + 2) + (r - 1) * nl + len(vc.double_newline_ids or (0,))
    return n


def expand_idefics3_images(ids: list[int], vc: Idefics3VisionConfig, grids: list[tuple[int, int]]
                           ) -> tuple[list[int], list[int]]:
    """A prompt's ids with each ``<image>`` written as Idefics3Processor writes it for its
    image's grid (module docstring), and each tile's first row position (images side by side
    are <image><image>, as the chat template writes two image parts). A ValueError names a
    count that differs, and ids expanded already (a <fake_token_around_image> in them)."""
    tok = vc.image_token_id
    if vc.fake_token_id is not None and vc.fake_token_id in ids:
        raise ValueError(f"the prompt holds <fake_token_around_image> (id {vc.fake_token_id}) at position "
                         f"{ids.index(vc.fake_token_id)}: ids the processor expanded are not read; put one "
                         "<image> per image in the prompt: it is expanded here")
    n = ids.count(tok)
    if n != len(grids):
        raise ValueError(f"the prompt has {n} image token(s) (<image>, id {tok}) but {len(grids)} image(s) "
                         "were given (put one in the prompt per image)")
    out: list[int] = []
    starts: list[int] = []
    k = 0
    for t in ids:
        if t == tok:
            exp, at = _image_ids(vc, grids[k])
            k += 1
            starts += [len(out) + a for a in at]
            out += exp
        else:
            out.append(t)
    return out, starts


# ------------------------------------------------------------------ the tower
def bucketed_positions(p: int) -> torch.Tensor:
    """Idefics3VisionEmbeddings' position ids of a whole p x p patch grid (every patch
    attended), as transformers computes them in float32: [p * p] int64."""
    # float32 whatever the default dtype (transformers' under its float32 default)
    boundaries = torch.arange(1 / p, 1.0, 1 / p, dtype=torch.float32, device="cpu")
    step = 1.0 / torch.tensor([p], dtype=torch.float32, device="cpu")
    frac = torch.clamp(torch.arange(p, dtype=torch.float32, device="cpu")[None] * step[:, None], max=1.0 - 1e-6)
    b = torch.bucketize(frac, boundaries, right=True)[0]
    return (b[:, None] * p + b[None, :]).reshape(-1)


class Idefics3VisionEmbeddings(SiglipEmbeddings):
    """SigLIP's patch conv and position table (the checkpoint's names), each patch's row of
    the table taken at its bucketed position (``bucketed_positions``)."""

    def __init__(self, vc: Idefics3VisionConfig) -> None:
        super().__init__(vc)
        ids = bucketed_positions(vc.patches_per_side).to(self.position_embedding.weight.device)
        self.position_ids: torch.Tensor
        self.register_buffer("position_ids", ids, persistent=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, M, M] -> [n, P*P, hidden]"""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        pos = self.position_embedding.weight[self.position_ids]
        return x.flatten(2).transpose(1, 2).contiguous() + pos


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, vc: Idefics3VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(vc.hidden_size * vc.scale_factor ** 2, text_hidden, bias=False)


class Idefics3Connector(nn.Module):
    def __init__(self, vc: Idefics3VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.scale_factor = vc.scale_factor
        self.modality_projection = Idefics3SimpleMLP(vc, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, P*P, Hv] -> [n, (P / s)^2, H] (Idefics3Connector.pixel_shuffle: InternVL's)"""
        n, seq, c = x.shape
        p = math.isqrt(seq)
        x = pixel_shuffle(x.reshape(n, p, p, c), self.scale_factor)
        return self.modality_projection.proj(x.reshape(n, -1, x.shape[-1]))


class Idefics3ImageEncoder(nn.Module):
    """Images -> the rows of their tiles' ``<image>`` positions (module docstring)."""

    token_name = "<image>"

    # tiles per tower call: a tile is P^2 tower tokens (1,024 in SmolVLM-256M / 676 in
    # Idefics3-8B) for N rows, so an encode batch of max_num_batched_tokens rows runs in
    # slices of this many
    MAX_TOWER_TILES = 16

    def __init__(self, vc: Idefics3VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = vc
        self.vision_model = SiglipVisionTower(vc)
        self.vision_model.embeddings = Idefics3VisionEmbeddings(vc)
        self.connector = Idefics3Connector(vc, text_hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, M, M] -> [n, tokens_per_image, text hidden]"""
        x = self.vision_model(pixel_values)
        assert isinstance(x, torch.Tensor)
        return self.connector(x)

    def activation_bytes(self, rows: int) -> int:
        """The most an encode call of ``rows`` rows (at least one tile) adds while it runs:
        per tower token of one slice (MAX_TOWER_TILES tiles at most) its stream and the
        attention's and MLP's intermediates, the slice's shuffled features, the output rows,
        and each tile's fp32 pixels."""
        vc = self.config
        tiles = max(1, -(-rows // vc.tokens_per_image))
        per_call = min(tiles, self.MAX_TOWER_TILES)
        tokens = per_call * vc.patches_per_side ** 2
        w = self.connector.modality_projection.proj.weight
        b = w.element_size()
        per = (8 * vc.hidden_size + 4 * vc.intermediate_size) * b
        shuffled = per_call * vc.tokens_per_image * (2 * vc.hidden_size * vc.scale_factor ** 2 + w.shape[0]) * b
        out = tiles * vc.tokens_per_image * w.shape[0] * b
        return tokens * per + shuffled + out + tiles * 3 * vc.image_size ** 2 * 4

    # ------------------------------------------------------------ the engine's hooks
    @property
    def video_placeholder_text(self) -> str | None:
        """What a chat template that prints text writes for a video part (LLM.chat); None:
        no video input (Idefics3, SmolVLM without a <video> token)."""
        return "<video>" if self.config.video_token_id is not None else None

    video_token_name = "<video>"

    def sample_videos(self, data: Any, kwargs: Any = None) -> Any:
        """multi_modal_data with each video's frames sampled where SmolVLM2's video
        processor is asked to (do_sample_frames: its file, the engine's or the request's
        mm_processor_kwargs ``kwargs``; models/smolvlm_video.sample_video), before the frames'
        text is written; as given otherwise. A ValueError names what is wrong."""
        vc = self.config
        if not isinstance(data, dict) or "video" not in data or vc.video_token_id is None:
            return data
        from flashpage.models.smolvlm_video import sample_video

        s = with_processor_kwargs(vc, kwargs).frame_sampling if isinstance(kwargs, dict) and kwargs \
            else vc.frame_sampling
        if not s.sample:
            return data
        return {**data, "video": [sample_video(v, s, i) for i, v in enumerate(video_items(data["video"]))]}

    def expand_text(self, text: str, data: Any) -> str:
        """A text prompt with multi_modal_data, before it is tokenized (LLMEngine.add_request):
        each ``<video>`` made its video's text as SmolVLMProcessor writes it
        (models/smolvlm_video.py)."""
        return self.expand_videos(text, data)

    def expand_videos(self, text: str, data: Any) -> str:
        """``text`` with each ``<video>`` made its video's frames' text (LLM.chat's rendered
        template too)."""
        if not isinstance(data, dict) or "video" not in data or self.config.video_token_id is None:
            return text
        from flashpage.models.smolvlm_video import expand_video_text, texts_of

        return expand_video_text(text, self.config, texts_of(data))

    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): the images of
        ``multi_modal_data`` ({"image": a PIL image, uint8 pixels [3, H, W], an
        Idefics3Image, or a list of them}) tiled, each ``<image>`` expanded
        (expand_idefics3_images); each tile's rows one input; SmolVLM2's videos ({"video":
        frames, or a list of videos}) each frame one input (models/smolvlm_video.py). A
        ValueError names what is wrong."""
        vid = self.config.video_token_id
        if vid is not None and isinstance(data, dict) and "video" in data:
            from flashpage.models.smolvlm_video import prepare_videos

            return prepare_videos(self, ids, data)
        if vid is not None and vid in ids:
            raise ValueError(f"the prompt has video tokens (<video>, id {vid}) but no video was given "
                             "(multi_modal_data={\"video\": frames})")
        items = [self.pixel_values(img, i) for i, img in enumerate(images_of(data, batches=False))]
        ids, starts = expand_idefics3_images(ids, self.config, [it.grid for it in items])
        tiles = [t for it in items for t in it.pixels.unbind(0)]
        n = self.config.tokens_per_image
        return ids, [MultiModalInput(s, n, digest(t), t) for s, t in zip(starts, tiles, strict=True)]

    def num_rows(self, item: Idefics3Image) -> int:
        """The prompt tokens an image takes once its ``<image>`` is expanded: its tiles'
        rows and the tokens around them (``flashpage inspect``'s figure)."""
        return expanded_length(self.config, item.grid)

    def rows_of(self, images: list[Any]) -> list[int]:
        """The prompt positions each of one prompt's images takes once its ``<image>`` is
        expanded (the server's length check and usage)."""
        return [expanded_length(self.config, self.pixel_values(im, i).grid) for i, im in enumerate(images)]

    def admit_image(self, image: Any, i: int = 0) -> Idefics3Image:
        """What a request keeps of an image (the server's, tiled on a worker thread)."""
        return self.pixel_values(image, i)

    def pixel_values(self, image: Any, i: int = 0) -> Idefics3Image:
        """One image tiled on the host (tile_image): a PIL image or uint8 pixels [3, H, W];
        an Idefics3Image given is checked (its tiles as its size makes them, finite)."""
        if isinstance(image, Idefics3Image):
            return self._checked(image, i)
        return tile_given_image(image, i, lambda im: tile_image(im, self.config))

    def _checked(self, item: Idefics3Image, i: int) -> Idefics3Image:
        vc = self.config
        px, hw = checked_tiles(item, i, lambda hw: num_tiles(vc, hw), vc.tile, vc.architecture)
        return Idefics3Image(px, hw, image_grid(vc, hw))

    @torch.inference_mode()
    def encode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """The engine's multimodal hook: tiles (uint8 [3, M, M], normalized here on the
        device, or float pixel values) -> rows [N, H] on the device, in tower calls of at
        most MAX_TOWER_TILES tiles."""
        from flashpage.models.multimodal import stack_to

        w = self.vision_model.embeddings.patch_embedding.weight
        proc = self.config.processing
        out: list[torch.Tensor] = []
        for i in range(0, len(data), self.MAX_TOWER_TILES):
            batch = data[i:i + self.MAX_TOWER_TILES]
            if all(x.dtype == torch.uint8 for x in batch):  # one pinned copy, normalized here
                pixels = normalize(stack_to(batch, w.device), proc)
            else:
                pixels = torch.stack([normalize(x.to(w.device), proc) if x.dtype == torch.uint8
                                      else x.to(w.device) for x in batch])
            out += list(self(pixels.to(w.dtype)).unbind(0))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """The tower's and connector's tensors (the text model's are ignored)."""
        from flashpage.models.multimodal import load_image_weights

        loaded, _ = load_image_weights(self, weights, where, _PREFIXES,
                                       f"{self.config.architecture}'s vision tower or connector",
                                       "vision tower / connector")
        return loaded


def load_image_encoder(source: ModelSource, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> Idefics3ImageEncoder:
    """``source``'s image encoder in ``dtype`` on ``device``: its checkpoint's tensors, or
    random ones (a random_config source)."""
    from flashpage.models.multimodal import build_image_encoder

    vc = source.config.vision
    assert isinstance(vc, Idefics3VisionConfig)
    enc = build_image_encoder(source, dtype, device, seed,
                              lambda: Idefics3ImageEncoder(vc, source.config.hidden_size), IMAGE_PREFIXES)
    return enc.eval()
