"""The image side of an InternVL checkpoint in transformers' own layout
(InternVLForConditionalGeneration: OpenGVLab/InternVL3-1B-hf .. InternVL3-78B-hf,
InternVL3.5-*-HF), read from its files once. config.py's ModelConfig.vision holds the
InternVLVisionConfig (its own module, as Gemma 3's and Pixtral's); models/internvl.py runs it.

Read from: vision_config (InternVLVisionConfig's fields and defaults: the InternViT tower,
its norm kind, q/k norms, layer scale, absolute positions, a final LayerNorm unless
use_mean_pooling), the wrapper's fields (downsample_ratio, image_token_id,
vision_feature_layer, vision_feature_select_strategy, projector_hidden_act,
image_seq_length), preprocessor_config.json (GotOcr2ImageProcessor: tiles of the tower's
square, min_patches / max_patches, bicubic, rescale, normalize), processor_config.json
(image_seq_length) and the tokenizer's files (the ids of ``<img>`` / ``</img>``, which
InternVLProcessor puts around an image's ``<IMG_CONTEXT>`` rows).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from flashpage.config import ConfigError, ImageProcessing, _json_object, pixel_steps, vit_section

# InternVLVisionConfig's defaults (InternViT-300M-448px, InternVL3-1B .. 38B's tower)
_INTERNVIT_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
    num_channels=3, image_size=448, patch_size=14, hidden_act="gelu", layer_norm_eps=1e-6)
_ACTS = ("gelu", "gelu_pytorch_tanh", "quick_gelu", "relu")
# InternVL's published preprocessing (GotOcr2ImageProcessor as the -hf files set it): ImageNet's
# mean and std, bicubic, 1 .. 12 tiles
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class InternVLVisionConfig:
    """InternViT (``norm_type`` "layer_norm" or "rms_norm", q / k RMSNorms over the whole
    width under ``qk_norm``, per-channel layer scale, a CLS row and absolute positions),
    read at hidden state ``feature_layer`` (0: the embeddings, i: layer i's output;
    ``final_norm``: vision_feature_layer -1 with use_mean_pooling false, the tower's
    LayerNorm after the last layer), the CLS row dropped, pixel-shuffled by ``shuffle``
    (1 / downsample_ratio) a side and projected (LayerNorm, Linear, act, Linear).
    ``image_token_id``: <IMG_CONTEXT> (a prompt's placeholder and its rows' positions),
    ``start_token_id`` / ``end_token_id``: <img> / </img> around the rows; ``min_tiles`` /
    ``max_tiles``: GotOcr2ImageProcessor's min_patches / max_patches."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    norm_type: str
    qk_norm: bool
    attention_bias: bool
    position_embeddings: bool
    feature_layer: int
    final_norm: bool
    shuffle: int
    projector_act: str
    image_token_id: int
    start_token_id: int
    end_token_id: int
    min_tiles: int
    max_tiles: int
    processing: ImageProcessing

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """The rows one tile gives: its patch grid pixel-shuffled, (side / shuffle)^2."""
        return (self.patches_per_side // self.shuffle) ** 2

    @property
    def layers_run(self) -> int:
        """The tower's layers that must run (those past the feature layer are never read)."""
        return self.feature_layer


def _int(d: dict[str, Any], key: str, default: int, where: str, least: int = 0) -> int:
    v = d.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ConfigError(f"{where}: {key} must be an int >= {least}, got {v!r}")
    return v


def _square(v: Any, key: str, where: str) -> Any:
    """InternVLVisionConfig's image_size / patch_size: an int or [h, w] (squares only here)."""
    if isinstance(v, (list, tuple)):
        if len(v) != 2 or v[0] != v[1]:
            raise ConfigError(f"{where}: vision_config.{key} {list(v)!r}: only square tiles are read")
        return v[0]
    return v


def _flag(vc: dict[str, Any], key: str, default: bool, where: str) -> bool:
    v = vc.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: vision_config.{key} must be true or false, got {v!r}")
    return v


def _special_ids(folder: str | None, image_token: int) -> tuple[int, int]:
    """The ids of the tokenizer's start / end image tokens (tokenizer_config.json names them,
    "<img>" / "</img>" by default; tokenizer.json's added tokens or vocabulary give their
    ids), else the published layout's: the two ids before <IMG_CONTEXT>'s."""
    fallback = (image_token - 2, image_token - 1)
    if folder is None:
        return fallback
    names = ["<img>", "</img>"]
    tc_path = os.path.join(folder, "tokenizer_config.json")
    try:
        with open(tc_path, encoding="utf-8") as f:
            tc = json.load(f)
    except (OSError, json.JSONDecodeError):
        tc = {}
    if isinstance(tc, dict):
        for sub in (tc, tc.get("extra_special_tokens"), tc.get("model_specific_special_tokens")):
            if isinstance(sub, dict):
                for i, key in enumerate(("start_image_token", "end_image_token")):
                    if isinstance(sub.get(key), str):
                        names[i] = sub[key]
    try:
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
            tj = json.load(f)
    except (OSError, json.JSONDecodeError):
        return fallback  # the tokenizer's own loader names a broken file
    vocab: dict[str, int] = {}
    for t in (tj.get("added_tokens") or []) if isinstance(tj, dict) else []:
        if isinstance(t, dict) and isinstance(t.get("id"), int) and isinstance(t.get("content"), str):
            vocab[t["content"]] = t["id"]
    model = tj.get("model") if isinstance(tj, dict) else None
    if isinstance(model, dict) and isinstance(model.get("vocab"), dict):
        for k, v in model["vocab"].items():
            if isinstance(v, int):
                vocab.setdefault(k, v)
    start, end = vocab.get(names[0]), vocab.get(names[1])
    if start is None or end is None:
        return fallback
    return start, end


def _processing(folder: str | None, image_size: int, where: str) -> tuple[ImageProcessing, int, int]:
    """GotOcr2ImageProcessor's steps (each tile resized to the tower's square: bicubic,
    rescale, normalize) and its min_patches / max_patches; InternVL's published values
    without a preprocessor_config.json."""
    path = os.path.join(folder, "preprocessor_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return (ImageProcessing(None, (image_size, image_size), None, 1 / 255, _IMAGENET_MEAN, _IMAGENET_STD,
                                "bicubic"), 1, 12)
    pc = {k: v for k, v in _json_object(path).items() if v is not None}  # null: the default
    kind = str(pc.get("image_processor_type", "GotOcr2ImageProcessor"))
    if kind.removesuffix("Pil").removesuffix("Fast") != "GotOcr2ImageProcessor":
        raise ConfigError(f"{path}: image_processor_type {kind!r} is not read in InternVL "
                          "(GotOcr2ImageProcessor's tiles are)")
    if not pc.get("do_resize", True):
        raise ConfigError(f"{path}: do_resize false: tiles of any size would reach a tower that "
                          f"takes {image_size} x {image_size}")
    size = pc.get("size", {"height": 384, "width": 384})  # GotOcr2ImageProcessor's default
    if not (isinstance(size, dict) and size.get("height") == image_size and size.get("width") == image_size):
        raise ConfigError(f"{path}: size {size!r}: the vision tower takes {image_size} x {image_size} tiles")
    lo = _int(pc, "min_patches", 1, path, 1)
    hi = _int(pc, "max_patches", 12, path, 1)
    if lo > hi:
        raise ConfigError(f"{path}: min_patches {lo} is above max_patches {hi}")
    rescale, mean, std, resample, rgb = pixel_steps(pc, path)
    return ImageProcessing(None, (image_size, image_size), None, rescale, mean, std, resample, False, rgb), lo, hi


def _seq_length(d: dict[str, Any], folder: str | None, where: str) -> int | None:
    """The processor's image_seq_length (processor_config.json, else config.json's), None
    where neither says it."""
    path = os.path.join(folder, "processor_config.json") if folder else None
    if path is not None and os.path.isfile(path):
        pc = _json_object(path)
        if pc.get("image_seq_length") is not None:
            return _int(pc, "image_seq_length", 256, path, 1)
    if d.get("image_seq_length") is not None:
        return _int(d, "image_seq_length", 256, where, 1)
    return None


def internvl_vision_config_of(d: dict[str, Any], arch: str, where: str, folder: str | None
                              ) -> InternVLVisionConfig:
    """An InternVLForConditionalGeneration config's image side; a ConfigError names a bad field."""
    raw = d.get("vision_config") or {}
    if isinstance(raw, dict):  # image_size / patch_size as [h, w]: one side
        raw = {**raw, **{k: _square(raw[k], k, where) for k in ("image_size", "patch_size") if k in raw}}
    vc, v = vit_section({**d, "vision_config": raw}, arch, where, "internvl_vision", "the InternViT tower",
                        _INTERNVIT_DEFAULTS)
    if v["hidden_size"] % v["num_attention_heads"]:
        raise ConfigError(f"{where}: vision_config.hidden_size {v['hidden_size']} is not a multiple "
                          f"of num_attention_heads {v['num_attention_heads']}")
    if v["image_size"] % v["patch_size"]:
        raise ConfigError(f"{where}: vision_config.image_size {v['image_size']} is not a multiple "
                          f"of patch_size {v['patch_size']}")
    if v["hidden_act"] not in _ACTS:
        raise ConfigError(f"{where}: vision_config.hidden_act {v['hidden_act']!r} is not supported "
                          f"({', '.join(_ACTS)})")
    norm = vc.get("norm_type") or "layer_norm"
    if norm not in ("layer_norm", "rms_norm"):
        raise ConfigError(f"{where}: vision_config.norm_type {norm!r} is not \"layer_norm\" or \"rms_norm\"")
    layers = v["num_hidden_layers"]
    raw_layer = d.get("vision_feature_layer", -1)
    if not isinstance(raw_layer, int) or isinstance(raw_layer, bool) or not -(layers + 1) <= raw_layer <= layers:
        raise ConfigError(f"{where}: vision_feature_layer {raw_layer!r} must be an int in "
                          f"[{-(layers + 1)}, {layers}] (the tower's {layers + 1} hidden states; "
                          "InternVLModel reads one)")
    feature = raw_layer if raw_layer >= 0 else layers + 1 + raw_layer
    if feature == 0:
        raise ConfigError(f"{where}: vision_feature_layer {raw_layer}: the embeddings, no layer's output, "
                          "is not read")
    strategy = d.get("vision_feature_select_strategy", "default")
    if strategy != "default":
        raise ConfigError(f"{where}: vision_feature_select_strategy {strategy!r} in {arch}: the CLS "
                          "row would leave a patch grid that is not square (transformers' "
                          "InternVLModel fails on it too); \"default\" is read")
    ratio = d.get("downsample_ratio", 0.5)
    side = v["image_size"] // v["patch_size"]
    shuffle = round(1 / ratio) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) \
        and 0 < ratio <= 1 else 0
    if not shuffle or abs(shuffle * ratio - 1) > 1e-9 or side % shuffle:
        raise ConfigError(f"{where}: downsample_ratio {ratio!r} must be 1 / k for an int k dividing the "
                          f"tower's {side} x {side} patch grid (pixel shuffle)")
    act = d.get("projector_hidden_act", "gelu")
    if act not in _ACTS:
        raise ConfigError(f"{where}: projector_hidden_act {act!r} is not supported ({', '.join(_ACTS)})")
    token = _int(d, "image_token_id", 151_667, where)
    processing, lo, hi = _processing(folder, v["image_size"], where)
    tokens = (side // shuffle) ** 2
    seq = _seq_length(d, folder, where)
    if seq is not None and seq != tokens:
        raise ConfigError(f"{where}: image_seq_length {seq} (the processor's <IMG_CONTEXT> per tile) "
                          f"differs from the {tokens} rows a tile gives ((image_size / patch_size x "
                          "downsample_ratio)^2)")
    start, end = _special_ids(folder, token)
    if len({token, start, end}) != 3:
        raise ConfigError(f"{where}: <img> ({start}), </img> ({end}) and <IMG_CONTEXT> ({token}) must be "
                          "three tokens")
    return InternVLVisionConfig(
        v["hidden_size"], v["intermediate_size"], layers, v["num_attention_heads"], v["num_channels"],
        v["image_size"], v["patch_size"], v["hidden_act"], float(v["layer_norm_eps"]), norm,
        _flag(vc, "use_qk_norm", False, where), _flag(vc, "attention_bias", False, where),
        _flag(vc, "use_absolute_position_embeddings", True, where), feature,
        raw_layer == -1 and not _flag(vc, "use_mean_pooling", True, where), shuffle, act, token,
        start, end, lo, hi, processing)
