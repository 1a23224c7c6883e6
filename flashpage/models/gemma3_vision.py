"""Gemma 3's images (Gemma3ForConditionalGeneration: gemma-3-4b-it / 12b / 27b): the SigLIP
tower, the projector, the prompt expansion and the rows' bidirectional attention.

The text model is served as any multimodal checkpoint's (models/multimodal.py: Gemma 3's
text layers, models/gemma.py). Beside it the engine keeps a ``Gemma3ImageEncoder``::

    pixel values [n, 3, S, S] -> SigLIP tower (models/siglip_vision.py) -> post_layernorm
    -> [n, P*P, Hv] as a P x P grid -> avg pool (P / sqrt(T)) -> [n, T, Hv]
    -> Gemma RMSNorm (x (1 + w), fp32) -> @ mm_input_projection_weight [Hv, H] -> [n, T, H]

(P = image_size / patch_size, T = mm_tokens_per_image: 64 x 64 patches pooled 4 x 4 to 256
rows on the published models; no class token, no pooling head: transformers'
Gemma3Model.get_image_features reads the tower's last_hidden_state.) Its rows replace the
embeddings at an image's <image_soft_token> positions, unscaled: Gemma's sqrt(hidden)
multiplies the looked-up token rows only (models/gemma.py GemmaModel.embed; transformers
scales inside its embedding module and scatters the image rows after it).

Prompt expansion (``expand_gemma3_images``), as Gemma3Processor does to the text: each
<start_of_image> becomes "\\n\\n<start_of_image>" + T x <image_soft_token> +
"<end_of_image>\\n\\n". On ids, a "\\n\\n" next to a newline token of the prompt is merged
with it as the tokenizer would have cut the joined text ("\\n" + "\\n\\n" -> "\\n\\n\\n",
"\\n\\n" + "\\n\\n" -> "\\n\\n\\n\\n"), as vLLM does; the ids come from the tokenizer's files
(models/gemma3_config.py). With pan-and-scan on (preprocessor_config.json's or a request's
mm_processor_kwargs do_pan_and_scan), a wide or tall image is its whole and a few crops,
each an image of T rows, in Gemma3Processor's text around them (models/gemma3_pan_and_scan.py).

Attention: Gemma 3 attends bidirectionally among the T positions of one image during the
prefill (transformers' token_type_ids mask: a query in an image sees every key of its own
image, the rest causally, and the sliding layers' window still applies). Each input is
marked ``bidirectional`` (engine/multimodal.MultiModalInput): the scheduler never ends a
prompt chunk inside one (a chunk may start inside one, after a prefix-cache hit: the cached
K/V were computed with the whole image), and each attention layer recomputes the image
rows' outputs with that mask (attention/bidirectional.py) after the backend's causal pass.

Weights: the tower's under ``vision_tower.vision_model.`` (the published files),
``vision_tower.`` (transformers 5) or either under ``model.``; the projector's under
``multi_modal_projector.``. The SigLIP pooling head (vision_use_head) is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.engine.multimodal import MultiModalInput, token_runs
from flashpage.engine.prompt_embeds import digest
from flashpage.models.clip_image import is_pil_image, normalize, pil_to_uint8, resized_uint8
from flashpage.models.gemma3_config import Gemma3VisionConfig
from flashpage.models.gemma3_pan_and_scan import PanScanImage, crop_boxes, texts_ids
from flashpage.models.llava import images_of
from flashpage.models.multimodal import stack_to
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
)
IMAGE_PREFIXES = tuple(p for p, _ in _PREFIXES)


class _NormWeight(nn.Module):
    """Gemma3RMSNorm's parameter (the checkpoint's w; the projector multiplies by 1 + w)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, vc: Gemma3VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = vc
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vc.hidden_size, text_hidden))
        # the checkpoint's w (Gemma3RMSNorm multiplies by 1 + w, in fp32)
        self.mm_soft_emb_norm = _NormWeight(vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, P*P, Hv] -> [n, T, H]"""
        vc = self.config
        n, _, hv = x.shape
        p = vc.patches_per_side
        grid = x.transpose(1, 2).reshape(n, hv, p, p)
        pooled = F.avg_pool2d(grid, vc.pool, vc.pool).flatten(2).transpose(1, 2)
        y = pooled.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + vc.layer_norm_eps)
        normed = (y * (1.0 + self.mm_soft_emb_norm.weight.float())).to(x.dtype)
        return torch.matmul(normed, self.mm_input_projection_weight).to(x.dtype)


class Gemma3ImageEncoder(nn.Module):
    """Pixel values -> the rows of an image's <image_soft_token> positions (module docstring)."""

    def __init__(self, vc: Gemma3VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = vc
        self.vision_tower = SiglipVisionTower(vc)
        self.multi_modal_projector = Gemma3MultiModalProjector(vc, text_hidden)
        # text -> the model tokenizer's ids, without special tokens (the engine sets it):
        # pan-and-scan's text around an image's crops (models/gemma3_pan_and_scan.py)
        self.tokenize: Callable[[str], list[int]] | None = None
        self._texts: tuple[list[int], list[int], list[int]] | None = None
        # the most rows one image may take (the engine sets its max_model_len): a request's
        # pan-and-scan settings that would cut an image into more crops are refused before
        # any is resized (each is S x S pixels on the host)
        self.max_rows: int | None = None

    # the id a chat template's image part becomes (engine/multimodal.placeholder_ids), and
    # the name of the rows' token in errors (enc_token_name)
    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        return (self.config.boi_token_id,)

    token_name = "<image_soft_token>"

    def num_rows(self, image: Any) -> int:
        """The rows of an admitted image (``admit_image``'s): T, or T for each of a
        pan-and-scan'd image's whole and crops."""
        n = len(image.images) if isinstance(image, PanScanImage) else 1
        return n * self.config.tokens_per_image

    def image_rows(self, image: Any) -> int:
        """The rows an image takes in the prompt under the engine's settings, admitted or
        not (``flashpage inspect``, the server's count): its crops' too with pan-and-scan
        on (Gemma3Processor's text around them not counted)."""
        if isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and image.dim() == 3:
            h, w = image.shape[1:]
        elif is_pil_image(image):
            w, h = image.size
        else:
            return self.num_rows(image)
        return (1 + len(crop_boxes(h, w, self.config.pan_and_scan))) * self.config.tokens_per_image

    # images per tower call: an image is P*P = 4096 tower tokens for 256 rows (16 times
    # LLaVA's), so an encode batch of max_num_batched_tokens rows runs in slices of this many
    MAX_TOWER_IMAGES = 8

    def activation_bytes(self, rows: int) -> int:
        """The most an encode call of ``rows`` rows (at least one image) adds while it runs:
        per tower token of one slice (MAX_TOWER_IMAGES images at most) its stream and the
        attention's and MLP's intermediates (SDPA's fused kernels keep no score matrix on
        CUDA), the slice's output rows, and each image's fp32 pixels."""
        vc = self.config
        images = max(1, -(-rows // vc.tokens_per_image))
        per_call = min(images, self.MAX_TOWER_IMAGES)
        tokens = per_call * vc.patches_per_side ** 2
        b = self.multi_modal_projector.mm_input_projection_weight.element_size()
        per = (8 * vc.hidden_size + 4 * vc.intermediate_size) * b
        out = images * vc.tokens_per_image * self.multi_modal_projector.mm_input_projection_weight.shape[1] * b
        return tokens * per + out + images * 3 * vc.image_size ** 2 * 4

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, tokens_per_image, text hidden]"""
        x = self.vision_tower(pixel_values)
        assert isinstance(x, torch.Tensor)
        return self.multi_modal_projector(x)

    def prepare(self, ids: list[int], data: Any, vision: Gemma3VisionConfig | None = None
                ) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): the images
        checked and preprocessed, each <start_of_image> expanded (expand_gemma3_images);
        a pan-and-scan'd image is its whole and its crops, an input each; each input
        attends bidirectionally within itself (module docstring). ``vision``: the
        request's own pan-and-scan settings (its mm_processor_kwargs,
        config.request_mm_processing; None: the engine's)."""
        admitted = [self.admit_image(img, i, vision) for i, img in enumerate(images_of(data))]
        ids, starts = self._expand(ids, admitted)
        pixels = [px for a in admitted for px in (a.images if isinstance(a, PanScanImage) else [a])]
        t = self.config.tokens_per_image
        return ids, [MultiModalInput(s, t, digest(px), px, bidirectional=True)
                     for s, px in zip(starts, pixels, strict=True)]

    def _expand(self, ids: list[int], admitted: list[Any]) -> tuple[list[int], list[int]]:
        crops = [a.num_crops if isinstance(a, PanScanImage) else 0 for a in admitted]
        if any(crops) and self._texts is None:
            if self.tokenize is None:
                raise ValueError("pan-and-scan crops need the model's tokenizer (Gemma3Processor's "
                                 "text around them is part of the prompt)")
            self._texts = texts_ids(self.tokenize)
        return expand_gemma3_images(ids, self.config, len(admitted), crops, self._texts)

    def prompt_length(self, ids: list[int], images: list[Any]) -> int:
        """The length ``ids`` will have once expanded for ``images`` (``admit_image``'s:
        the server's length check and usage; ``len(ids)`` when prepare would refuse them:
        its error comes from there)."""
        try:
            return len(self._expand(ids, images)[0])
        except ValueError:
            return len(ids)

    def admit_image(self, image: Any, i: int = 0, vision: Gemma3VisionConfig | None = None
                    ) -> torch.Tensor | PanScanImage:
        """What a request keeps of an image (the server prepares it on a worker thread): a
        PIL image or a uint8 [3, H, W] tensor resized to uint8 [3, S, S], normalized on the
        device by ``encode`` (a quarter of fp32's bytes to hash and copy), or, where
        pan-and-scan (``vision``'s, else the engine's) cuts it, its whole and its crops so
        resized (a PanScanImage, kept as given once admitted: with pan-and-scan on, even an
        image it leaves whole is one, of no crops, so that a second admission never cuts
        the resized square); float pixel values [3, S, S] given, checked (shape, dtype,
        finite) and kept (one image: they cannot be cut)."""
        s = self.config.image_size
        if isinstance(image, PanScanImage):  # admitted already (the server's)
            if not image.images or any(not isinstance(x, torch.Tensor) or x.dtype != torch.uint8
                                       or tuple(x.shape) != (3, s, s) for x in image.images):
                raise ValueError(f"image {i}: a PanScanImage holds uint8 [3, {s}, {s}] images")
            return image
        if is_pil_image(image) or (isinstance(image, torch.Tensor) and image.dtype == torch.uint8):
            if isinstance(image, torch.Tensor) and (image.dim() != 3 or image.shape[0] != 3
                                                    or 0 in image.shape):
                raise ValueError(f"image {i}: a uint8 tensor image must be [3, H, W] pixels, got "
                                 f"{list(image.shape)}")
            proc = self.config.processing
            pas = (vision or self.config).pan_and_scan
            try:
                x = image.detach().cpu() if isinstance(image, torch.Tensor) else image
                if not pas.enabled:
                    return resized_uint8(x, proc).contiguous()
                # cut on the image's own pixels (RGB), as Gemma3ImageProcessor does
                x = x if isinstance(x, torch.Tensor) else pil_to_uint8(x, proc.convert_rgb)
            except (OSError, ValueError) as e:
                raise ValueError(f"image {i} could not be read: {e}") from e
            boxes = crop_boxes(x.shape[1], x.shape[2], pas)
            rows = (1 + len(boxes)) * self.config.tokens_per_image
            if self.max_rows is not None and rows > self.max_rows:
                raise ValueError(f"image {i}: pan-and-scan cuts it into {len(boxes)} crops, {rows} rows "
                                 f"with the whole image, more than max_model_len {self.max_rows}; "
                                 "lower pan_and_scan_max_num_crops")
            return PanScanImage([resized_uint8(x[:, t:b, l:r].contiguous(), proc).contiguous()
                                 for t, b, l, r in [(0, x.shape[1], 0, x.shape[2]), *boxes]])
        if isinstance(image, torch.Tensor):
            if not image.is_floating_point() or tuple(image.shape) != (3, s, s):
                raise ValueError(f"image {i}: a tensor image must be uint8 pixels [3, H, W] or float "
                                 f"pixel values [3, {s}, {s}] (preprocessed), got {list(image.shape)} "
                                 f"{str(image.dtype).replace('torch.', '')}")
            px = image.detach().to("cpu", torch.float32).contiguous()
            if not bool(torch.isfinite(px).all()):
                raise ValueError(f"image {i}: pixel values hold inf or NaN")
            return px
        raise ValueError(f"image {i} is a {type(image).__name__}: give a PIL.Image.Image, uint8 "
                         f"pixels [3, H, W] or float pixel values [3, {s}, {s}]")

    def pixel_values(self, image: Any, i: int = 0) -> torch.Tensor:
        """One image as float32 pixel values [3, S, S] on the host (``admit_image``, then
        normalized as Gemma3ImageProcessor does); a pan-and-scan'd image's whole one."""
        x = self.admit_image(image, i)
        if isinstance(x, PanScanImage):
            x = x.images[0]
        return normalize(x, self.config.processing) if x.dtype == torch.uint8 else x

    @torch.inference_mode()
    def encode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """The engine's multimodal hook: images (``admit_image``'s: uint8 [3, S, S],
        normalized here on the device, or float pixel values) -> rows [T, H] on the device,
        in tower calls of at most MAX_TOWER_IMAGES images."""
        w = self.vision_tower.embeddings.patch_embedding.weight
        out: list[torch.Tensor] = []
        for i in range(0, len(data), self.MAX_TOWER_IMAGES):
            batch = data[i:i + self.MAX_TOWER_IMAGES]
            if all(x.dtype == torch.uint8 for x in batch):  # one pinned copy, normalized here
                pixels = normalize(stack_to(batch, w.device), self.config.processing)
            else:  # float pixel values given (any uint8 ones beside them normalized alone)
                pixels = torch.stack([normalize(x.to(w.device), self.config.processing) if x.dtype == torch.uint8
                                      else x.to(w.device) for x in batch])
            out += list(self(pixels.to(w.dtype)).unbind(0))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """The tower's and projector's tensors (the text model's are ignored); the SigLIP
        pooling head's are skipped (never read)."""
        from flashpage.models.multimodal import load_image_weights

        def unread(ours: str) -> bool:
            return ours.startswith("vision_tower.head.") or ours == "vision_tower.embeddings.position_ids"

        loaded, skipped = load_image_weights(self, weights, where, _PREFIXES,
                                             "Gemma 3's vision tower or projector",
                                             "vision tower / projector", unread)
        if skipped:
            logger.info("Gemma 3 vision tower: %d tensor(s) of the SigLIP pooling head skipped "
                        "(never read)", skipped)
        return loaded


def expand_gemma3_images(ids: list[int], vc: Gemma3VisionConfig, num_images: int,
                         crops: Sequence[int] = (),
                         texts: tuple[list[int], list[int], list[int]] | None = None
                         ) -> tuple[list[int], list[int]]:
    """A prompt's ids with each <start_of_image> expanded as Gemma3Processor expands it
    (module docstring) and each image's first <image_soft_token> position (a pan-and-scan'd
    one's: its whole's, then each crop's). ``crops``: each image's crops (none given: 0
    each); ``texts``: the ids of pan-and-scan's text pieces (gemma3_pan_and_scan.texts_ids),
    needed where an image has crops. A ValueError names a count of <start_of_image> that
    differs from ``num_images`` and a prompt that holds <image_soft_token> itself (the
    expansion is ours to do)."""
    soft = token_runs(ids, vc.image_token_id)
    if soft:
        raise ValueError(f"the prompt holds <image_soft_token> (id {vc.image_token_id}) at position "
                         f"{soft[0][0]}: put one <start_of_image> (id {vc.boi_token_id}) per image "
                         "in the prompt; it is expanded to the image's rows here")
    n = ids.count(vc.boi_token_id)
    if n != num_images:
        raise ValueError(f"the prompt has {n} <start_of_image> token(s) (id {vc.boi_token_id}) but "
                         f"{num_images} image(s) were given: put one in the prompt per image")
    nl1, nl2, nl3, nl4 = vc.newline_ids
    out: list[int] = []
    starts: list[int] = []

    def push_nl2() -> None:  # "\n\n" after what is there, merged as the tokenizer would
        if out and out[-1] == nl1:
            out[-1] = nl3
        elif out and out[-1] == nl2:
            out[-1] = nl4
        else:
            out.append(nl2)

    def image() -> None:  # <start_of_image>, its rows, <end_of_image>
        out.append(vc.boi_token_id)
        starts.append(len(out))
        out.extend([vc.image_token_id] * vc.tokens_per_image)
        out.append(vc.eoi_token_id)

    pending = False  # a "\n\n" after <end_of_image>, to merge with the next token
    image_index = 0
    for t in ids:
        if pending:
            pending = False
            if t == nl1:
                out.append(nl3)
                continue
            if t == nl2:
                out.append(nl4)
                continue
            out.append(nl2)
        if t == vc.boi_token_id:
            k = crops[image_index] if crops else 0
            image_index += 1
            if k:  # "Here is the original image " FULL " and here are some crops ..." FULL ...
                if texts is None:
                    raise ValueError("pan-and-scan crops need the ids of their prompt text")
                original, first, between = texts
                out.extend(original)  # its "\n\n" included; the prompt's text before kept as is
                image()
                for j in range(k):
                    out.extend(first if j == 0 else between)
                    image()
            else:
                push_nl2()
                image()
            pending = True
        else:
            out.append(t)
    if pending:
        out.append(nl2)
    return out, starts


def load_image_encoder(source: ModelSource, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> Gemma3ImageEncoder:
    """``source``'s image encoder in ``dtype`` on ``device``: its checkpoint's tensors, or
    random ones (a random_config source)."""
    from flashpage.models.multimodal import build_image_encoder

    vc = source.config.vision
    assert isinstance(vc, Gemma3VisionConfig)
    enc = build_image_encoder(source, dtype, device, seed, lambda: Gemma3ImageEncoder(vc, source.config.hidden_size),
                              IMAGE_PREFIXES)
    if source.kind == "random":
        with torch.no_grad():
            enc.multi_modal_projector.mm_soft_emb_norm.weight.zero_()  # 1 + 0
    return enc.eval()
