"""Image input through a Pixtral vision tower: Mistral3ForConditionalGeneration (Mistral
Small 3.1 / 3.2) and LlavaForConditionalGeneration with a "pixtral" vision_config
(pixtral-12b). The text model is served as any multimodal checkpoint's
(models/multimodal.py); beside it the engine keeps a ``PixtralImageEncoder``:

    pixel values [3, H, W] per image, each at its own size (models/pixtral_image.py)
    -> patch_conv (a linear over p x p patches) -> ln_pre (RMSNorm)
    -> layers: x + attn(attention_norm(x)), x + SwiGLU(ffn_norm(x)); 2-D rotary (each
       head's rotated pairs split: even pairs turn with the patch's row, odd with its
       column), attention within one image only
    -> hidden states at vision_feature_layer [h * w, Hv] (h, w: patches per side)
    -> Mistral3: RMSNorm, patch merger (each merge x merge block of patches' rows side by
       side, as F.unfold lays them, -> merging_layer), linear_1, act, linear_2
       LLaVA:    linear_1, act, linear_2
    -> the image's rows [H / P * (W / P + 1), H_text]   (P: patch_size x merge)

The prompt (PixtralProcessor's rule, ``expand_image_tokens``): an image's one ``[IMG]``
becomes H / P rows of W / P ``[IMG]`` each followed by ``[IMG_BREAK]``, the last of them
``[IMG_END]``. The break and end tokens are text in the middle of the image's span; the
encoder's rows cover the whole span (one MultiModalInput per image, the break / end rows
the text model's own embeddings of those ids), so the engine's hook sees one input of
rows like any other.

Weights: ``vision_tower.`` / ``multi_modal_projector.`` (transformers 4's names and what 5
saves), or either under ``model.`` (transformers 5's modules). Layers past the deepest
feature layer are skipped (never read).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.engine.multimodal import MultiModalInput
from flashpage.engine.prompt_embeds import digest
from flashpage.models.clip_image import is_pil_image
from flashpage.models.llava import images_of
from flashpage.models.multimodal import to_device
from flashpage.models.pixtral_config import PixtralVisionConfig
from flashpage.models.pixtral_image import preprocess, resized_size

if TYPE_CHECKING:
    from flashpage.models.loader import ModelSource

logger = logging.getLogger(__name__)

_PREFIXES = (
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)
IMAGE_PREFIXES = tuple(p for p, _ in _PREFIXES)
_LAYER = re.compile(r"vision_tower\.transformer\.layers\.(\d+)\.")
_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "silu": F.silu, "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class RMSNorm(nn.Module):
    """transformers' PixtralRMSNorm / Mistral3RMSNorm: in fp32, weight x the input's dtype."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class PixtralAttention(nn.Module):
    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        d = vc.hidden_size
        self.heads, self.head_dim = vc.num_attention_heads, vc.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """x [N, Hv] (the images' patches one after another), cos / sin [N, head_dim]."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.heads, self.head_dim)
        v = self.v_proj(x).view(n, self.heads, self.head_dim)
        c, s = cos[:, None], sin[:, None]
        q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            outs.append(F.scaled_dot_product_attention(
                qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]
            )[0].transpose(0, 1))  # one image's patches see that image's alone
        return self.o_proj(torch.cat(outs).reshape(n, -1))


class PixtralMLP(nn.Module):
    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=False)
        self.up_proj = nn.Linear(vc.hidden_size, vc.intermediate_size, bias=False)
        self.down_proj = nn.Linear(vc.intermediate_size, vc.hidden_size, bias=False)
        self.act = _ACTS[vc.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralLayer(nn.Module):
    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(vc.hidden_size, 1e-5)
        self.attention = PixtralAttention(vc)
        self.ffn_norm = RMSNorm(vc.hidden_size, 1e-5)
        self.feed_forward = PixtralMLP(vc)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(vc) for _ in range(vc.layers_run))


class PixtralVisionTower(nn.Module):
    """transformers' PixtralVisionModel, its layers up to the deepest feature layer."""

    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.config = vc
        p = vc.patch_size
        self.patch_conv = nn.Conv2d(3, vc.hidden_size, p, p, bias=False)  # run as a linear
        self.ln_pre = RMSNorm(vc.hidden_size, 1e-5)
        self.transformer = PixtralTransformer(vc)

    def rotary(self, grids: list[tuple[int, int]], dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] of the images' patches (row-major within each image)."""
        dev, d = self.patch_conv.weight.device, self.config.head_dim
        # in fp32 whatever the weights' dtype (not a buffer: .to(bf16) would round it)
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        rows, cols = [], []
        for h, w in grids:
            rows.append(torch.arange(h, device=dev).repeat_interleave(w))
            cols.append(torch.arange(w, device=dev).repeat(h))
        # rotated pairs 0, 2, 4, ... turn with the patch's row, 1, 3, 5, ... with its column
        f = torch.cat([torch.cat(rows)[:, None].float() * inv[0::2],
                       torch.cat(cols)[:, None].float() * inv[1::2]], dim=-1)
        f = torch.cat([f, f], dim=-1)
        return f.cos().to(dtype), f.sin().to(dtype)

    def forward(self, pixels: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Each image's pixel values [3, H, W] -> the hidden states at feature_layers (each
        [N, Hv], N: all images' patches), the images' patch grids (h, w)."""
        p = self.config.patch_size
        wt = self.patch_conv.weight
        grids, patches = [], []
        for px in pixels:
            h, w = px.shape[1] // p, px.shape[2] // p
            grids.append((h, w))
            patches.append(px[:, :h * p, :w * p].reshape(3, h, p, w, p)
                           .permute(1, 3, 0, 2, 4).reshape(h * w, 3 * p * p))
        x = self.ln_pre(F.linear(torch.cat(patches).to(wt.dtype), wt.flatten(1)))
        cos, sin = self.rotary(grids, x.dtype)
        lengths = [h * w for h, w in grids]
        wanted = self.config.feature_layers
        states = {0: x} if 0 in wanted else {}  # only the feature layers' are kept
        for i, layer in enumerate(self.transformer.layers, start=1):
            x = layer(x, cos, sin, lengths)
            if i in wanted:
                states[i] = x
        return [states[i] for i in wanted], grids


class PatchMerger(nn.Module):
    def __init__(self, vc: PixtralVisionConfig) -> None:
        super().__init__()
        self.merge = vc.merge
        self.merging_layer = nn.Linear(vc.hidden_size * vc.merge ** 2, vc.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """[N, Hv] -> [N / merge^2, Hv]: each merge x merge block's rows laid side by side
        channel-major (F.unfold's order, as Mistral3PatchMerger)."""
        m, d = self.merge, x.shape[-1]
        out = []
        for rows, (h, w) in zip(x.split([h * w for h, w in grids]), grids, strict=True):
            g = rows.view(h // m, m, w // m, m, d).permute(0, 2, 4, 1, 3)
            out.append(g.reshape((h // m) * (w // m), d * m * m))
        return self.merging_layer(torch.cat(out))


class PixtralProjector(nn.Module):
    def __init__(self, vc: PixtralVisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.kind = vc.projector
        if vc.projector == "mistral3":
            self.norm = RMSNorm(vc.hidden_size, vc.norm_eps)
            self.patch_merger = PatchMerger(vc)
        self.linear_1 = nn.Linear(vc.hidden_size * len(vc.feature_layers), text_hidden,
                                  bias=vc.projector_bias)
        self.act = _ACTS[vc.projector_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=vc.projector_bias)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        if self.kind == "mistral3":
            x = self.patch_merger(self.norm(x), grids)
        return self.linear_2(self.act(self.linear_1(x)))


class PixtralImageEncoder(nn.Module):
    """Pixel values -> the rows of an image's span, [IMG_BREAK] / [IMG_END] included
    (module docstring). ``text_embed``: the text model's embedding of token ids."""

    def __init__(self, vc: PixtralVisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = vc
        self.vision_tower = PixtralVisionTower(vc)
        self.multi_modal_projector = PixtralProjector(vc, text_hidden)
        self.text_embed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def grid(self, pixels: torch.Tensor) -> tuple[int, int]:
        """An image's prompt rows and columns (of [IMG]): its size / (patch x merge)."""
        P = self.config.prompt_patch
        return pixels.shape[1] // P, pixels.shape[2] // P

    def num_rows(self, pixels: torch.Tensor) -> int:
        """The rows (and so the prompt positions) of an image: its [IMG] rows, each ended
        by an [IMG_BREAK] (the last by [IMG_END])."""
        h, w = self.grid(pixels)
        return h * (w + 1)

    def activation_bytes(self, rows: int) -> int:
        """The most an encode call of ``rows`` rows (or one image at longest_edge, if more)
        adds while it runs: per patch (merge x merge a row) its stream, the attention's and the
        MLP's intermediates and its fp32 pixels (a generous sum: they are freed in turn)."""
        vc = self.config
        longest = vc.processing.longest_hw
        if longest is not None:
            rows = max(rows, (longest[0] // vc.prompt_patch) * (longest[1] // vc.prompt_patch + 1))
        patches = rows * vc.merge ** 2
        b = self.multi_modal_projector.linear_1.weight.element_size()
        h, i = vc.hidden_size, vc.intermediate_size
        per = (8 * h + 4 * i) * b + 2 * h * 4 + 3 * vc.patch_size ** 2 * 4
        return patches * per

    def image_rows(self, image: Any) -> int:
        """The positions an image's span takes in the prompt (h * (w + 1)), without running
        anything heavy: the server's length check before admission. 1 for an image that
        prepare would refuse (its error comes from there)."""
        P = self.config.prompt_patch
        try:
            if is_pil_image(image):
                h, w = resized_size(image.size[1], image.size[0], self.config.processing, P)
            else:
                h, w = image.shape[1], image.shape[2]
        except (ValueError, AttributeError, IndexError):
            return 1
        return h // P * (w // P + 1) or 1

    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): a request's
        ``multi_modal_data`` ({"image": a PIL image, pixel values [3, H, W], or a list of
        them}) checked and preprocessed, and its prompt's ids with each [IMG] expanded
        (expand_image_tokens); a ValueError names what is wrong."""
        images = images_of(data, batches=False)  # a tensor here is one image's pixel values
        pixels = [self.pixel_values(img, i) for i, img in enumerate(images)]
        grids = [self.grid(px) for px in pixels]
        ids, starts = expand_image_tokens(ids, self.config, grids)
        return ids, [MultiModalInput(s, self.num_rows(px), digest(px), px)
                     for s, px in zip(starts, pixels, strict=True)]

    def pixel_values(self, image: Any, i: int = 0) -> torch.Tensor:
        """One image as float32 pixel values [3, H, W] on the host: a PIL image
        preprocessed, or pixel values given (checked: float, sides multiples of the
        prompt's patch, finite)."""
        P = self.config.prompt_patch
        if is_pil_image(image):
            try:
                return preprocess(image, self.config.processing, P)
            except (OSError, ValueError) as e:  # a truncated or unreadable file: PIL's words
                raise ValueError(f"image {i} could not be read: {e}") from e
        if isinstance(image, torch.Tensor):
            if not image.is_floating_point():
                raise ValueError(f"image {i}: a tensor image must be float pixel values [3, H, W] "
                                 f"(preprocessed), got dtype {str(image.dtype).replace('torch.', '')}; "
                                 "pass a PIL image to have it preprocessed")
            if image.dim() != 3 or image.shape[0] != 3 or image.shape[1] % P or image.shape[2] % P \
                    or image.shape[1] == 0 or image.shape[2] == 0:
                raise ValueError(f"image {i}: pixel values must have shape [3, H, W] with H and W "
                                 f"positive multiples of {P} (patch_size x spatial_merge_size), "
                                 f"got {list(image.shape)}")
            px = image.detach().to("cpu", torch.float32).contiguous()
            if not bool(torch.isfinite(px).all()):
                raise ValueError(f"image {i}: pixel values hold inf or NaN")
            return px
        raise ValueError(f"image {i} is a {type(image).__name__}: give a PIL.Image.Image or float "
                         "pixel values [3, H, W]")

    @torch.inference_mode()
    def encode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """The engine's multimodal hook: each image's pixel values [3, H, W] (host) -> its
        span's rows [h * (w + 1), H_text] on the device, all images in one tower pass."""
        wt = self.vision_tower.patch_conv.weight
        pixels = [to_device(px, wt.device).to(wt.dtype) for px in data]  # pinned: no wait for the queue
        feats, grids = self.vision_tower(pixels)
        x = feats[0] if len(feats) == 1 else torch.cat(feats, dim=-1)
        rows = self.multi_modal_projector(x, grids)
        vc = self.config
        assert self.text_embed is not None, "the encoder was built without the text embedding"
        brk, end = self.text_embed(to_device(torch.tensor([vc.break_token_id, vc.end_token_id]),
                                             wt.device)).to(rows.dtype)
        out = []
        for r, px in zip(rows.split([a * b for a, b in map(self.grid, pixels)]), pixels, strict=True):
            h, w = self.grid(px)
            span = torch.empty(h, w + 1, r.shape[-1], dtype=r.dtype, device=r.device)
            span[:, :w] = r.view(h, w, -1)
            span[:, w] = brk
            span[-1, w] = end
            out.append(span.view(h * (w + 1), -1))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """Load the image tensors of a checkpoint (any other name is ignored: the text
        model's loader reads those); returns the parameter names loaded."""
        from flashpage.models.multimodal import load_image_weights

        def unread(ours: str) -> bool:  # never read (module docstring)
            m = _LAYER.match(ours)
            return bool(m and int(m.group(1)) >= self.config.layers_run)

        loaded, skipped = load_image_weights(self, weights, where, _PREFIXES,
                                             "the Pixtral vision tower or its projector",
                                             "vision tower / projector", unread)
        if skipped:
            logger.info("Pixtral vision tower: %d tensor(s) past feature layer(s) %s skipped "
                        "(never read)", skipped, list(self.config.feature_layers))
        return loaded


def load_image_encoder(source: ModelSource, dtype: torch.dtype, device: torch.device,
                       text_model: nn.Module, seed: int = 0) -> PixtralImageEncoder:
    """``source``'s Pixtral image encoder in ``dtype`` on ``device`` (its checkpoint's
    tensors, or random ones for a random_config source), its break / end rows read from
    ``text_model``'s token embedding."""
    from flashpage.config import ConfigError
    from flashpage.models.multimodal import build_image_encoder

    vc = source.config.vision
    assert isinstance(vc, PixtralVisionConfig)
    embed = getattr(getattr(text_model, "model", None), "embed_tokens", None)
    if not isinstance(embed, nn.Module):
        raise ConfigError(f"{source.config.multimodal_architecture}: its text model "
                          f"({source.config.architecture}) has no model.embed_tokens, which the "
                          "image's [IMG_BREAK] / [IMG_END] rows are read from")
    enc = build_image_encoder(source, dtype, device, seed, lambda: PixtralImageEncoder(vc, source.config.hidden_size),
                              IMAGE_PREFIXES, zero_norm_biases=False)  # RMSNorms: no biases
    enc.text_embed = lambda ids: embed(ids)  # a function, not a submodule: not the encoder's weights
    return enc.eval()


def image_span(vc: PixtralVisionConfig, h: int, w: int) -> list[int]:
    """An image's ids in the prompt: h rows of w [IMG] then [IMG_BREAK], the last [IMG_END]."""
    span = ([vc.image_token_id] * w + [vc.break_token_id]) * h
    span[-1] = vc.end_token_id
    return span


def expand_image_tokens(ids: list[int], vc: PixtralVisionConfig, grids: list[tuple[int, int]]
                        ) -> tuple[list[int], list[int]]:
    """A prompt's ids with each image's one [IMG] made its span (image_span, as
    PixtralProcessor), and each span's first position. Ids already expanded (they hold
    [IMG_BREAK] / [IMG_END]) are kept when each image's span is there in order, its
    grid's. A ValueError names a count or a span that does not match the images."""
    img, brk, end = vc.image_token_id, vc.break_token_id, vc.end_token_id
    if brk in ids or end in ids:  # expanded already: check each span where it sits
        starts: list[int] = []
        i = 0
        for k, (h, w) in enumerate(grids):
            s = next((j for j in range(i, len(ids)) if ids[j] in (img, brk, end)), None)
            span = image_span(vc, h, w)
            if s is None or ids[s:s + len(span)] != span:
                raise ValueError(f"the prompt's ids hold image tokens already expanded, but image "
                                 f"{k}'s span there is not its {h} rows of {w} [IMG] (id {img}) "
                                 f"each ending in [IMG_BREAK] (id {brk}), the last [IMG_END] "
                                 f"(id {end}); give one [IMG] per image to have it expanded")
            starts.append(s)
            i = s + len(span)
        if any(t in (img, brk, end) for t in ids[i:]):
            raise ValueError(f"the prompt's ids hold more image spans than the {len(grids)} "
                             "image(s) given")
        return list(ids), starts
    count = ids.count(img)
    if count != len(grids):
        raise ValueError(f"the prompt has {count} image token(s) ([IMG], id {img}) but "
                         f"{len(grids)} image(s) were given: put one [IMG] in the prompt per image")
    out: list[int] = []
    starts = []
    k = 0
    for t in ids:
        if t == img:
            starts.append(len(out))
            out.extend(image_span(vc, *grids[k]))
            k += 1
        else:
            out.append(t)
    return out, starts
