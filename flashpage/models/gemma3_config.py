"""The image side of a Gemma 3 checkpoint (Gemma3ForConditionalGeneration: gemma-3-4b-it,
12b, 27b), read from its files once. config.py's ModelConfig.vision holds the
Gemma3VisionConfig (its own module, as Pixtral's); models/gemma3_vision.py runs it.

Read from: vision_config (SiglipVisionConfig's fields and defaults; its pooling head,
vision_use_head, is never run: Gemma 3 reads the last hidden state), the wrapper's image
fields (mm_tokens_per_image, image_token_index, boi_token_index, eoi_token_index),
preprocessor_config.json (Gemma3ImageProcessor: a resize to the tower's square, rescale,
normalize; its pan-and-scan settings, ``PanAndScan``) and the tokenizer's files (the ids of "\\n" .. "\\n\\n\\n\\n",
which the prompt expansion needs: engine/multimodal.py's hooks work on ids).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from flashpage.config import ConfigError, ImageProcessing, pixel_steps, vit_section

_SIGLIP_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6)
_SIGLIP_ACTS = ("gelu_pytorch_tanh", "gelu", "quick_gelu", "relu")
# Gemma3ImageProcessor's pan-and-scan keys (preprocessor_config.json's, mm_processor_kwargs')
PAN_AND_SCAN_KEYS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                     "pan_and_scan_min_ratio_to_activate")
# the published Gemma 3 tokenizer's ids of "\n", "\n\n", "\n\n\n", "\n\n\n\n" (for a folder
# whose tokenizer files do not hold them)
GEMMA3_NEWLINES = (107, 108, 109, 110)


@dataclass(frozen=True)
class PanAndScan:
    """Gemma3ImageProcessor's pan-and-scan (models/gemma3_pan_and_scan.py): with ``enabled``,
    an image whose long side is at least ``min_ratio_to_activate`` times its short side is
    also cut into 2 .. ``max_num_crops`` crops along its long side (none under
    ``min_crop_size`` pixels), each crop one more image of the prompt. The defaults are
    Gemma3Processor's, which it passes where preprocessor_config.json holds null."""

    enabled: bool = False
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2


def pan_and_scan_of(d: dict[str, Any], where: str, base: PanAndScan) -> PanAndScan:
    """``base`` with the pan-and-scan keys of ``d`` (a preprocessor_config.json, or
    mm_processor_kwargs) over it, null ones skipped; a ConfigError names a bad value."""
    on = d.get("do_pan_and_scan")
    if on is not None and not isinstance(on, bool):
        raise ConfigError(f"{where} do_pan_and_scan must be true or false, got {on!r}")
    ints = []
    for key, was in (("pan_and_scan_min_crop_size", base.min_crop_size),
                     ("pan_and_scan_max_num_crops", base.max_num_crops)):
        v = d.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"{where} {key} must be a positive int, got {v!r}")
        ints.append(was if v is None else v)
    r = d.get("pan_and_scan_min_ratio_to_activate")
    if r is not None and (not isinstance(r, (int, float)) or isinstance(r, bool)
                          or not 0 < r < float("inf")):
        raise ConfigError(f"{where} pan_and_scan_min_ratio_to_activate must be a positive "
                          f"number, got {r!r}")
    return PanAndScan(base.enabled if on is None else on, ints[0], ints[1],
                      base.min_ratio_to_activate if r is None else float(r))


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """Gemma 3's SigLIP tower, its projector (an average pool of the patch grid to
    ``tokens_per_image`` rows, a Gemma RMSNorm, a matmul) and its prompt tokens:
    ``image_token_id`` (<image_soft_token>, the rows' positions), ``boi_token_id``
    (<start_of_image>, what a prompt holds per image), ``eoi_token_id`` (<end_of_image>),
    ``newline_ids``: the ids of one to four newlines; ``pan_and_scan``: the image
    processor's crops (off unless preprocessor_config.json or mm_processor_kwargs turn
    them on)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    tokens_per_image: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    newline_ids: tuple[int, int, int, int]
    processing: ImageProcessing
    pan_and_scan: PanAndScan = PanAndScan()

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """The average pool's kernel (and stride) over the patch grid."""
        return self.patches_per_side // int(round(self.tokens_per_image ** 0.5))


def _token_id(d: dict[str, Any], keys: tuple[str, ...], default: int, where: str) -> int:
    t = next((d[k] for k in keys if d.get(k) is not None), default)
    if not isinstance(t, int) or isinstance(t, bool) or t < 0:
        raise ConfigError(f"{where}: {keys[0]} must be a token id, got {t!r}")
    return t


def _newline_ids(folder: str | None) -> tuple[int, int, int, int]:
    """The ids of "\\n" * k (k = 1 .. 4) in the folder's tokenizer.json (its vocabulary and
    added tokens), else Gemma 3's published ones."""
    path = os.path.join(folder, "tokenizer.json") if folder else None
    if path is None or not os.path.isfile(path):
        return GEMMA3_NEWLINES
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError):
        return GEMMA3_NEWLINES  # the tokenizer's own loader names a broken file
    vocab: dict[str, int] = {}
    model = d.get("model") if isinstance(d, dict) else None
    if isinstance(model, dict) and isinstance(model.get("vocab"), dict):
        vocab.update({k: v for k, v in model["vocab"].items() if isinstance(v, int)})
    for t in (d.get("added_tokens") or []) if isinstance(d, dict) else []:
        if isinstance(t, dict) and isinstance(t.get("id"), int) and isinstance(t.get("content"), str):
            vocab.setdefault(t["content"], t["id"])
    ids = [vocab.get("\n" * k) for k in range(1, 5)]
    if any(i is None for i in ids):
        return GEMMA3_NEWLINES
    return ids[0], ids[1], ids[2], ids[3]  # type: ignore[return-value]


def _processing(folder: str | None, image_size: int, where: str) -> tuple[ImageProcessing, PanAndScan]:
    """Gemma3ImageProcessor's steps: resize to size (the tower's square; bilinear by
    default), rescale, normalize (mean = std = 0.5 by default); and its pan-and-scan
    settings (the file's where not null, else Gemma3Processor's defaults, as vLLM reads
    them; transformers' Gemma3Processor itself passes its own defaults over the file's, so
    there the file's do_pan_and_scan true takes effect only through the image processor
    alone or a processor call's do_pan_and_scan=True)."""
    path = os.path.join(folder, "preprocessor_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return ImageProcessing(None, (image_size, image_size), None, 1 / 255, (0.5,) * 3, (0.5,) * 3,
                               "bilinear"), PanAndScan()
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    pc = {k: v for k, v in raw.items() if v is not None}  # null: the processor's default
    kind = str(pc.get("image_processor_type", "Gemma3ImageProcessor"))
    if kind.removesuffix("Pil").removesuffix("Fast") != "Gemma3ImageProcessor":
        raise ConfigError(f"{path}: image_processor_type {kind!r} is not read in Gemma 3 "
                          "(Gemma3ImageProcessor is)")
    pas = pan_and_scan_of(pc, f"{path}:", PanAndScan())
    pc.setdefault("resample", 2)  # Gemma3ImageProcessor's BILINEAR
    pc.setdefault("image_mean", [0.5, 0.5, 0.5])
    pc.setdefault("image_std", [0.5, 0.5, 0.5])
    rescale, mean, std, resample, rgb = pixel_steps(pc, path)
    size = pc.get("size", {"height": 224, "width": 224}) if pc.get("do_resize", True) else None
    if size is None:
        raise ConfigError(f"{path}: do_resize false: images of any size would reach a tower "
                          f"that takes {image_size} x {image_size}")
    if not (isinstance(size, dict) and size.get("height") == image_size and size.get("width") == image_size):
        raise ConfigError(f"{path}: size {size!r}: the vision tower takes {image_size} x {image_size}")
    return ImageProcessing(None, (image_size, image_size), None, rescale, mean, std, resample,
                           False, rgb), pas


def gemma3_vision_config_of(d: dict[str, Any], arch: str, where: str, folder: str | None
                            ) -> Gemma3VisionConfig:
    """A Gemma3ForConditionalGeneration config's image side; a ConfigError names a bad field."""
    vc, v = vit_section(d, arch, where, "siglip_vision_model", "a SigLIP tower", _SIGLIP_DEFAULTS)
    if v["hidden_size"] % v["num_attention_heads"]:
        raise ConfigError(f"{where}: vision_config.hidden_size {v['hidden_size']} is not a multiple "
                          f"of num_attention_heads {v['num_attention_heads']}")
    if v["image_size"] % v["patch_size"]:
        raise ConfigError(f"{where}: vision_config.image_size {v['image_size']} is not a multiple "
                          f"of patch_size {v['patch_size']}")
    if v["hidden_act"] not in _SIGLIP_ACTS:
        raise ConfigError(f"{where}: vision_config.hidden_act {v['hidden_act']!r} is not supported "
                          f"({', '.join(_SIGLIP_ACTS)})")
    tokens = d.get("mm_tokens_per_image", 256)
    side = v["image_size"] // v["patch_size"]
    per_side = int(round(tokens ** 0.5)) if isinstance(tokens, int) and tokens > 0 else 0
    if per_side * per_side != tokens or side % per_side:
        raise ConfigError(f"{where}: mm_tokens_per_image {tokens!r} must be a square whose side "
                          f"divides the tower's {side} x {side} patch grid (image_size / patch_size)")
    image = _token_id(d, ("image_token_index", "image_token_id"), 262_144, where)
    boi = _token_id(d, ("boi_token_index", "boi_token_id"), 255_999, where)
    eoi = _token_id(d, ("eoi_token_index", "eoi_token_id"), 256_000, where)
    if len({image, boi, eoi}) != 3:
        raise ConfigError(f"{where}: image_token_index {image}, boi_token_index {boi} and "
                          f"eoi_token_index {eoi} must differ")
    return Gemma3VisionConfig(
        v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"], v["num_attention_heads"],
        v["num_channels"], v["image_size"], v["patch_size"], v["hidden_act"],
        float(v["layer_norm_eps"]), tokens, image, boi, eoi, _newline_ids(folder),
        *_processing(folder, v["image_size"], where))
