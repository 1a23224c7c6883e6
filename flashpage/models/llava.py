"""LLaVA-1.5 style checkpoints (LlavaForConditionalGeneration): the image side.

The text model (Llama / Mistral / Vicuna) is served as any multimodal checkpoint's
(models/multimodal.py: its tensors renamed, its family's module). Beside it the engine
keeps a ``LlavaImageEncoder``: the CLIP tower (models/clip_vision.py) and the projector

    pixel values [n, 3, S, S] -> tower hidden states at vision_feature_layer (each
    [n, 1 + P, Hv], CLS row dropped under "default", concatenated along the width)
    -> linear_1 -> GELU -> linear_2 -> [n, tokens_per_image, H]   (H: the text model's)

whose rows replace the text model's embeddings at an image's ``<image>`` positions (the
engine's multimodal rows: engine/multimodal.py). ``expand_image_tokens`` does to a
prompt's ids what transformers' LlavaProcessor does to its text: each ``<image>`` token
(config image_token_index) becomes tokens_per_image of them.

Weights: the tower's under ``vision_tower.vision_model.`` (transformers 4's layout, the
published llava-hf files), ``vision_tower.`` (what transformers 5 saves) or either under
``model.``; the projector's under ``multi_modal_projector.`` (or ``model.``'s). The tower's
layers past the deepest feature layer and its post_layernorm are skipped (never read).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flashpage.config import VisionConfig
from flashpage.engine.multimodal import MultiModalInput, expand_tokens
from flashpage.engine.prompt_embeds import digest
from flashpage.models.clip_image import is_pil_image, preprocess
from flashpage.models.clip_vision import CLIPVisionTower, activation
from flashpage.models.siglip_vision import SiglipVisionTower

if TYPE_CHECKING:
    from flashpage.models.loader import ModelSource

logger = logging.getLogger(__name__)

# checkpoint prefix -> ours, tried in order
_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("model.image_newline", "image_newline"),  # LLaVA-NeXT's (models/llava_next.py)
    ("image_newline", "image_newline"),
)
IMAGE_PREFIXES = tuple(p for p, _ in _PREFIXES)
_LAYER = re.compile(r"vision_tower\.encoder\.layers\.(\d+)\.")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vc: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vc.hidden_size * len(vc.feature_layers), text_hidden,
                                  bias=vc.projector_bias)
        self.act = activation(vc.projector_act)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=vc.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaImageEncoder(nn.Module):
    """Pixel values -> the rows of an image's ``<image>`` positions (module docstring)."""

    def __init__(self, vc: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = vc
        self.vision_tower: CLIPVisionTower | SiglipVisionTower = (
            SiglipVisionTower(vc, vc.layers_run, post_norm=False) if vc.tower == "siglip" else CLIPVisionTower(vc))
        self.multi_modal_projector = LlavaMultiModalProjector(vc, text_hidden)

    @property
    def tokens_per_image(self) -> int:
        return self.config.tokens_per_image

    def num_rows(self, image: Any) -> int:
        """The rows (and so the prompt positions) of an image: the same for every one."""
        return self.config.tokens_per_image

    # the tower's tokens a row of output costs at most (LLaVA: 577 for 576; LLaVA-NeXT's
    # tiles give fewer rows than their tokens once unpadded)
    TOKENS_PER_ROW = 1.01

    def activation_bytes(self, rows: int) -> int:
        """The most an encode call of ``rows`` rows (or one image, if more) adds while it runs:
        per tower token its stream, the attention's and the MLP's intermediates (a generous
        sum: they are freed in turn), and each image's fp32 pixels."""
        vc = self.config
        rows = max(rows, self.config.tokens_per_image)
        tokens = int(rows * self.TOKENS_PER_ROW) + 1
        b = self.multi_modal_projector.linear_1.weight.element_size()
        per = (8 * vc.hidden_size + 4 * vc.intermediate_size) * b
        pixels = 3 * vc.image_size ** 2 * 4 * (-(-tokens // (vc.image_size // vc.patch_size) ** 2))
        return tokens * per + pixels

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, tokens_per_image, text hidden]"""
        vc = self.config
        feats = self.vision_tower(pixel_values, vc.feature_layers)
        assert isinstance(feats, list)
        if vc.select_strategy == "default":
            feats = [f[:, 1:] for f in feats]
        x = feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)
        return self.multi_modal_projector(x)

    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): a request's
        ``multi_modal_data`` ({"image": a PIL image, pixel values [3, S, S], or a list of
        them}) checked and preprocessed (models/clip_image.py), and its prompt's ids with
        each ``<image>`` expanded (expand_image_tokens); a ValueError names what is wrong."""
        pixels = [self.pixel_values(img, i) for i, img in enumerate(images_of(data))]
        vc = self.config
        ids, starts = expand_image_tokens(ids, vc.image_token_id, len(pixels), vc.tokens_per_image)
        return ids, [MultiModalInput(s, vc.tokens_per_image, digest(px), px)
                     for s, px in zip(starts, pixels, strict=True)]

    def pixel_values(self, image: Any, i: int = 0) -> torch.Tensor:
        """One image as float32 pixel values [3, S, S] on the host: a PIL image
        preprocessed, or pixel values given (checked: shape, dtype, finite)."""
        vc = self.config
        s = vc.image_size
        if is_pil_image(image):
            try:
                return preprocess(image, vc.processing)
            except (OSError, ValueError) as e:  # a truncated or unreadable file: PIL's words
                raise ValueError(f"image {i} could not be read: {e}") from e
        if isinstance(image, torch.Tensor):
            if not image.is_floating_point():
                raise ValueError(f"image {i}: a tensor image must be float pixel values "
                                 f"[3, {s}, {s}] (preprocessed), got dtype "
                                 f"{str(image.dtype).replace('torch.', '')}; pass a PIL image "
                                 "to have it preprocessed")
            if tuple(image.shape) != (3, s, s):
                raise ValueError(f"image {i}: pixel values must have shape [3, {s}, {s}] (this "
                                 f"model's vision tower), got {list(image.shape)}")
            px = image.detach().to("cpu", torch.float32).contiguous()
            if not bool(torch.isfinite(px).all()):
                raise ValueError(f"image {i}: pixel values hold inf or NaN")
            return px
        raise ValueError(f"image {i} is a {type(image).__name__}: give a PIL.Image.Image or float "
                         f"pixel values [3, {s}, {s}]")

    @torch.inference_mode()
    def encode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """The engine's multimodal hook (engine/multimodal.py): each image's pixel values
        [3, S, S] (host) -> its rows [tokens_per_image, H] on the device, in one batch."""
        from flashpage.models.multimodal import stack_to

        p = self.vision_tower.embeddings.patch_embedding.weight
        pixels = stack_to(data, p.device).to(p.dtype)  # one pinned asynchronous copy
        return list(self(pixels).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """Load the image tensors of a LLaVA checkpoint (any other name is ignored: the
        text model's loader reads those); returns the parameter names loaded."""
        from flashpage.models.multimodal import load_image_weights

        def unread(ours: str) -> bool:  # never read (module docstring)
            m = _LAYER.match(ours)
            return bool(m and int(m.group(1)) >= self.config.layers_run) \
                or ours.startswith(("vision_tower.post_layernorm.", "vision_tower.head.")) \
                or ours == "vision_tower.embeddings.position_ids"

        loaded, skipped = load_image_weights(self, weights, where, _PREFIXES, "LLaVA's vision tower or projector",
                                             "vision tower / projector", unread)
        if skipped:
            logger.info("LLaVA vision tower: %d tensor(s) past feature layer(s) %s skipped "
                        "(never read)", skipped, list(self.config.feature_layers))
        return loaded


def images_of(data: Any, batches: bool = True) -> list[Any]:
    """A request's ``multi_modal_data`` ({"image": an image or a list of them; with
    ``batches``, a 4-d tensor is a batch of pixel values}) -> its images in order; a
    ValueError names what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict such as {{\"image\": image}}, "
                         f"got {type(data).__name__}")
    unknown = sorted(set(data) - {"image"})
    if unknown:
        raise ValueError(f"multi_modal_data {unknown}: this model takes \"image\" only")
    if "image" not in data:
        raise ValueError("multi_modal_data has no \"image\"")
    given = data["image"]
    if batches and isinstance(given, torch.Tensor) and given.dim() == 4:
        images: list[Any] = list(given.unbind(0))
    elif isinstance(given, (list, tuple)):
        images = list(given)
    else:
        images = [given]
    if not images:
        raise ValueError("multi_modal_data[\"image\"] is an empty list")
    return images


def encoder_class(vc: VisionConfig) -> type[LlavaImageEncoder]:
    """The encoder of a LLaVA VisionConfig: LLaVA-1.5's one tile, LLaVA-NeXT's any-res tiles
    (grid_pinpoints: models/llava_next.py), LLaVA-OneVision's (anyres_max:
    models/llava_onevision.py)."""
    if vc.anyres_max:
        from flashpage.models.llava_onevision import LlavaOnevisionImageEncoder

        return LlavaOnevisionImageEncoder
    if vc.grid_pinpoints:
        from flashpage.models.llava_next import LlavaNextImageEncoder

        return LlavaNextImageEncoder
    return LlavaImageEncoder


def load_image_encoder(source: ModelSource, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> LlavaImageEncoder:
    """``source``'s (loader.ModelSource) image encoder in ``dtype`` on ``device``: its
    checkpoint's tensors, or random ones (a random_config source); its class: encoder_class."""
    from flashpage.models.multimodal import build_image_encoder

    vc = source.config.vision
    assert isinstance(vc, VisionConfig)
    enc = build_image_encoder(source, dtype, device, seed, lambda: encoder_class(vc)(vc, source.config.hidden_size),
                              IMAGE_PREFIXES)
    return enc.eval()


def expand_image_tokens(ids: list[int], image_token: int, num_images: int,
                        tokens_per_image: int | list[int]) -> tuple[list[int], list[int]]:
    """A prompt's ids with each ``<image>`` token made ``tokens_per_image`` of them (as
    LlavaProcessor; a list: image i's own count, LLaVA-NeXT's), and each image's first
    position in the result (engine/multimodal.expand_tokens: ids already expanded kept)."""
    counts = tokens_per_image if isinstance(tokens_per_image, list) else [tokens_per_image] * num_images
    assert len(counts) == num_images
    return expand_tokens(ids, image_token, counts, "<image>", "image")
