"""The image side of a checkpoint with a Pixtral vision tower, read from its files once:
Mistral3ForConditionalGeneration (Mistral Small 3.1 / 3.2: a patch merger and an RMSNorm in
its projector) and LlavaForConditionalGeneration whose vision_config.model_type is
"pixtral" (mistral-community/pixtral-12b: LLaVA's two-layer projector). config.py's
ModelConfig.vision holds the PixtralVisionConfig (its own module so the CLIP reader in
config.py and this one change apart); models/pixtral.py runs it.

Read from: vision_config (PixtralVisionConfig's fields and defaults), the wrapper's image
fields (image_token_index, vision_feature_layer, spatial_merge_size, projector_hidden_act,
multimodal_projector_bias, vision_feature_select_strategy), text_config.rms_norm_eps (the
projector's norm), preprocessor_config.json (PixtralImageProcessor's size / rescale /
normalize) and the tokenizer's files ([IMG_BREAK] / [IMG_END] ids, as PixtralProcessor
finds them by name).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from flashpage.config import ConfigError, pixel_steps, vit_section

_PIXTRAL_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
    num_channels=3, image_size=1024, patch_size=16, hidden_act="gelu")
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # PixtralImageProcessor's defaults
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# activations of the tower's MLP and the projector (transformers' ACT2FN names)
PIXTRAL_ACTS = ("gelu", "silu", "gelu_pytorch_tanh", "quick_gelu", "relu")
# Mistral's tekken ids of [IMG_BREAK] / [IMG_END] (beside [IMG] = 10), for a folder whose
# tokenizer files do not name them
_TEKKEN_IMG, _TEKKEN_BREAK, _TEKKEN_END = 10, 12, 13


@dataclass(frozen=True)
class PixtralProcessing:
    """PixtralImageProcessor's steps (models/pixtral_image.py): resize so the image fits
    ``longest_hw`` (aspect kept, never enlarged), each side then rounded up to a multiple of
    the prompt's patch (patch_size x spatial_merge_size, as PixtralProcessor asks);
    x * rescale_factor; (x - mean) / std."""

    longest_hw: tuple[int, int] | None  # None: do_resize false (sides still rounded up)
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    resample: str = "bicubic"
    convert_rgb: bool = True


@dataclass(frozen=True)
class PixtralVisionConfig:
    """A Pixtral tower and its projector. ``feature_layers``: indexes into the tower's
    hidden states (0: ln_pre's output, i: layer i's), made non-negative, concatenated along
    the width; ``projector``: "mistral3" (RMSNorm, patch merger, linear_1, act, linear_2)
    or "llava" (linear_1, act, linear_2); ``merge``: spatial_merge_size (1 under LLaVA)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    hidden_act: str
    rope_theta: float
    feature_layers: tuple[int, ...]
    projector: str
    merge: int
    projector_act: str
    projector_bias: bool
    norm_eps: float  # the projector's RMSNorm (mistral3): text_config.rms_norm_eps
    image_token_id: int
    break_token_id: int
    end_token_id: int
    processing: PixtralProcessing

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def prompt_patch(self) -> int:
        """Pixels per side of one prompt position: patch_size x merge."""
        return self.patch_size * self.merge

    @property
    def layers_run(self) -> int:
        """The tower's layers that must run: up to the deepest feature layer."""
        return max(self.feature_layers)


def _tokenizer_ids(folder: str | None) -> dict[str, int]:
    """The folder's added tokens (tokenizer.json's added_tokens, tokenizer_config.json's
    added_tokens_decoder): content -> id."""
    out: dict[str, int] = {}
    if folder is None:
        return out
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue  # the tokenizer's own loader names a broken file
        if not isinstance(d, dict):
            continue
        for t in d.get("added_tokens") or []:
            if isinstance(t, dict) and isinstance(t.get("id"), int) and isinstance(t.get("content"), str):
                out.setdefault(t["content"], t["id"])
        dec = d.get("added_tokens_decoder")
        if isinstance(dec, dict):
            for k, t in dec.items():
                if isinstance(t, dict) and isinstance(t.get("content"), str) and str(k).isdigit():
                    out.setdefault(t["content"], int(k))
    return out


def _processing(folder: str | None, image_size: int, where: str) -> PixtralProcessing:
    path = os.path.join(folder, "preprocessor_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return PixtralProcessing((image_size, image_size), 1 / 255, _CLIP_MEAN, _CLIP_STD)
    with open(path, encoding="utf-8") as f:
        try:
            pc = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(pc, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    kind = pc.get("image_processor_type", "PixtralImageProcessor")
    if not str(kind).startswith("PixtralImageProcessor"):
        raise ConfigError(f"{path}: image_processor_type {kind!r} is not read for a Pixtral tower "
                          "(PixtralImageProcessor is)")
    if pc.get("do_center_crop"):
        raise ConfigError(f"{path}: do_center_crop is not supported for a Pixtral tower")
    longest: tuple[int, int] | None = None
    if pc.get("do_resize", True):
        size = pc.get("size", {"longest_edge": 1024})
        if isinstance(size, dict) and "longest_edge" in size:
            edge = size["longest_edge"]
            if not isinstance(edge, int) or isinstance(edge, bool) or edge <= 0:
                raise ConfigError(f"{path}: size.longest_edge must be a positive int, got {edge!r}")
            longest = (edge, edge)
        elif isinstance(size, dict) and all(isinstance(size.get(k), int) and size[k] > 0
                                            for k in ("height", "width")):
            longest = (size["height"], size["width"])
        else:
            raise ConfigError(f"{path}: size must be {{\"longest_edge\": n}} or "
                              f"{{\"height\": h, \"width\": w}}, got {size!r}")
    return PixtralProcessing(longest, *pixel_steps(pc, path))


def _positive_int(v: Any, key: str, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{where}: {key} must be a positive int, got {v!r}")
    return v


def pixtral_vision_config_of(d: dict[str, Any], arch: str, where: str,
                             folder: str | None) -> PixtralVisionConfig:
    """A Mistral3 / LLaVA-with-Pixtral checkpoint's PixtralVisionConfig (module docstring);
    a ConfigError names what is not read."""
    vc, v = vit_section(d, arch, where, "pixtral", "a Pixtral tower", _PIXTRAL_DEFAULTS)
    heads = v["num_attention_heads"]
    if v["hidden_size"] % heads or (v["hidden_size"] // heads) % 4:
        raise ConfigError(f"{where}: vision_config.hidden_size {v['hidden_size']} / "
                          f"num_attention_heads {heads} must be a head size divisible by 4 (the "
                          "2-D rotary splits it into height and width halves of pairs)")
    if vc.get("head_dim") not in (None, v["hidden_size"] // heads):
        raise ConfigError(f"{where}: vision_config.head_dim {vc['head_dim']!r} is not hidden_size / "
                          "num_attention_heads, which Pixtral's attention uses")
    if v["hidden_act"] not in PIXTRAL_ACTS:
        raise ConfigError(f"{where}: vision_config.hidden_act {v['hidden_act']!r} is not supported "
                          f"({', '.join(PIXTRAL_ACTS)})")
    rope = vc.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: vision_config.rope_parameters must be an object, got {rope!r}")
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConfigError(f"{where}: vision_config.rope_parameters.rope_type "
                          f"{rope.get('rope_type')!r}: Pixtral's 2-D (axial) rotary is read")
    theta = rope.get("rope_theta", vc.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{where}: vision_config rope_theta must be a positive number, got {theta!r}")

    layers = v["num_hidden_layers"]
    mistral3 = arch == "Mistral3ForConditionalGeneration"
    raw_layer = d.get("vision_feature_layer", -1)
    if mistral3 and not isinstance(raw_layer, int):
        raise ConfigError(f"{where}: vision_feature_layer {raw_layer!r}: a list is not supported in "
                          f"{arch} (its projector's norm is the width of one layer)")
    given = raw_layer if isinstance(raw_layer, list) else [raw_layer]
    feature: list[int] = []
    for lay in given:
        if not isinstance(lay, int) or isinstance(lay, bool) or not -(layers + 1) <= lay <= layers:
            raise ConfigError(f"{where}: vision_feature_layer {raw_layer!r}: each must be an int in "
                              f"[{-(layers + 1)}, {layers}] (the tower's {layers + 1} hidden states)")
        feature.append(lay if lay >= 0 else layers + 1 + lay)
    if not feature:
        raise ConfigError(f"{where}: vision_feature_layer is an empty list")
    if not mistral3 and d.get("vision_feature_select_strategy", "default") != "full":
        raise ConfigError(f"{where}: vision_feature_select_strategy "
                          f"{d.get('vision_feature_select_strategy', 'default')!r} with a Pixtral "
                          "tower: only \"full\" is read (\"default\" would drop the first patch "
                          "of the batch, not a CLS row: Pixtral has none)")
    merge = _positive_int(d.get("spatial_merge_size", 2), "spatial_merge_size", where) if mistral3 else 1
    act = d.get("projector_hidden_act", "gelu")
    if act not in PIXTRAL_ACTS:
        raise ConfigError(f"{where}: projector_hidden_act {act!r} is not supported "
                          f"({', '.join(PIXTRAL_ACTS)})")
    tc = d.get("text_config")
    tc = tc if isinstance(tc, dict) else {}
    eps = tc.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
        raise ConfigError(f"{where}: text_config.rms_norm_eps must be a positive number, got {eps!r}")

    img = d.get("image_token_index", d.get("image_token_id", _TEKKEN_IMG if mistral3 else 10))
    if not isinstance(img, int) or isinstance(img, bool) or img < 0:
        raise ConfigError(f"{where}: image_token_index must be a token id, got {img!r}")
    named = _tokenizer_ids(folder)
    brk, end = named.get("[IMG_BREAK]"), named.get("[IMG_END]")
    if brk is None or end is None:
        if img != _TEKKEN_IMG:
            raise ConfigError(f"{where}: the tokenizer files beside it name no [IMG_BREAK] / "
                              f"[IMG_END] token, and image_token_index {img} is not Mistral's "
                              "tekken [IMG] (10), whose [IMG_BREAK] 12 and [IMG_END] 13 would "
                              "be assumed")
        brk, end = _TEKKEN_BREAK, _TEKKEN_END
    return PixtralVisionConfig(
        v["hidden_size"], v["intermediate_size"], layers, heads, v["patch_size"], v["hidden_act"],
        float(theta), tuple(feature), "mistral3" if mistral3 else "llava", merge, act,
        bool(d.get("multimodal_projector_bias", not mistral3)), float(eps), img, brk, end,
        _processing(folder, v["image_size"], where))
