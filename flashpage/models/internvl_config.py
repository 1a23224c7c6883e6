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
InternVLProcessor puts around an image's ``<IMG_CONTEXT>`` rows, and of ``<video>``); for
videos InternVLVideoProcessor's file (processor_config.json's "video_processor", else
video_preprocessor_config.json: the frames' size, resample, rescale, mean and std).

The same model in OpenGVLab's remote-code layout (InternVLChatModel: InternVL3-2B,
InternVL3_5-8B, ...) is read through ``_from_remote``: llm_config as the text config,
InternVisionConfig's names (qkv_bias, qk_normalization, intern_vit_6b), select_layer,
ps_version "v2", the tiling from min_dynamic_patch / max_dynamic_patch /
dynamic_image_size / use_thumbnail, its chat code's transform (ImageNet's mean and std,
bicubic; its CLIP-style preprocessor_config.json is not read) and ``<IMG_CONTEXT>``'s id
from the tokenizer; its tensors are renamed at load (models/internvl.from_remote_names).
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
    # GotOcr2's thumbnail (the whole image as one more tile when there are several);
    # OpenGVLab's use_thumbnail may turn it off
    thumbnail: bool = True
    # OpenGVLab's remote-code layout (InternVLChatModel): its tensor names (vision_model.,
    # mlp1., a fused qkv) are mapped to transformers' at load (models/internvl.py)
    remote: bool = False
    # videos (models/internvl.py video_text): a prompt's video token (``token_texts``: the
    # texts of <img>, </img>, <IMG_CONTEXT> and it) becomes each frame's "FrameN:
    # <img>rows</img>", the frames joined by ``frame_sep`` (InternVLProcessor's "\n"; vLLM's
    # remote-code layout joins them with ""), each frame one tile resized to the tower's
    # square under ``video_processing`` (the image steps where None); ``video_token_id``:
    # the token it is in the -hf tokenizer (None: text, the remote-code layout's)
    token_texts: tuple[str, str, str, str] = ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")
    video_token_id: int | None = None
    frame_sep: str = "\n"
    video_processing: ImageProcessing | None = None

    @property
    def takes_video(self) -> bool:
        return True

    @property
    def frame_processing(self) -> ImageProcessing:
        return self.video_processing or self.processing

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


def _vocab(folder: str | None) -> tuple[dict[str, int], dict[str, Any]]:
    """The folder's tokenizer.json tokens (added tokens first, then the model's vocabulary)
    by their text, and its tokenizer_config.json object ({} where a file is missing or
    broken: the tokenizer's own loader names a broken file)."""
    vocab: dict[str, int] = {}
    tc: Any = {}
    if folder is None:
        return vocab, {}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                obj = json.load(f)
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(obj, dict):
            continue
        if name == "tokenizer_config.json":
            tc = obj
            continue
        for t in obj.get("added_tokens") or []:
            if isinstance(t, dict) and isinstance(t.get("id"), int) and isinstance(t.get("content"), str):
                vocab[t["content"]] = t["id"]
        model = obj.get("model")
        if isinstance(model, dict) and isinstance(model.get("vocab"), dict):
            for k, v in model["vocab"].items():
                if isinstance(v, int):
                    vocab.setdefault(k, v)
    return vocab, tc


def _special_ids(folder: str | None, image_token: int) -> tuple[int, int, tuple[str, str, str, str], int | None]:
    """The ids of the tokenizer's start / end image tokens (tokenizer_config.json names them,
    "<img>" / "</img>" by default; tokenizer.json's added tokens or vocabulary give their
    ids), else the published layout's: the two ids before <IMG_CONTEXT>'s; the texts of
    <img>, </img>, <IMG_CONTEXT> and the video token ("<video>" by default), and the video
    token's id (None where it is no token)."""
    vocab, tc = _vocab(folder)
    names = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
    keys = ("start_image_token", "end_image_token", "context_image_token", "video_token")
    for sub in (tc, tc.get("extra_special_tokens"), tc.get("model_specific_special_tokens")):
        if isinstance(sub, dict):
            for i, key in enumerate(keys):
                if isinstance(sub.get(key), str):
                    names[i] = sub[key]
    start, end = vocab.get(names[0]), vocab.get(names[1])
    texts = (names[0], names[1], names[2], names[3])
    if start is None or end is None:
        return image_token - 2, image_token - 1, texts, vocab.get(names[3])
    return start, end, texts, vocab.get(names[3])


# InternVisionConfig's defaults (OpenGVLab's remote code: InternViT-6B) where they differ from
# InternVLVisionConfig's, under their names there
_INTERNVIT_6B = dict(hidden_size=3200, intermediate_size=12_800, num_hidden_layers=48, num_attention_heads=25,
                     image_size=224, patch_size=14, norm_type="rms_norm", qk_normalization=True, qkv_bias=False)


def _from_remote(d: dict[str, Any], where: str, folder: str | None) -> tuple[dict[str, Any], int, int, bool]:
    """An InternVLChatModel config (OpenGVLab's remote code) in transformers' InternVLConfig
    fields (as its convert_internvl_weights_to_hf does), and its tiling: (min tiles, max
    tiles, the thumbnail) from min_dynamic_patch / max_dynamic_patch / dynamic_image_size /
    use_thumbnail (InternVLChatConfig's defaults: 1, 6, off, off). ``<IMG_CONTEXT>``'s id
    comes from the tokenizer's files (the published one without them)."""
    vc = d.get("vision_config") or {}
    if not isinstance(vc, dict):
        raise ConfigError(f"{where}: vision_config must be an object, got {vc!r}")
    vtype = vc.get("model_type", "intern_vit_6b")
    if vtype != "intern_vit_6b":
        raise ConfigError(f"{where}: vision_config.model_type {vtype!r} is not supported in InternVLChatModel "
                          "(the InternViT tower, intern_vit_6b, is)")
    ps = d.get("ps_version", "v1")
    if ps != "v2":
        raise ConfigError(f"{where}: ps_version {ps!r}: only pixel shuffle \"v2\" (InternVL2.5 and later, "
                          "transformers' InternVL) is read")
    v = {**_INTERNVIT_6B, **{k: x for k, x in vc.items() if x is not None}}
    force = d.get("force_image_size")
    if force is not None and force != v["image_size"]:
        raise ConfigError(f"{where}: force_image_size {force!r} differs from vision_config.image_size "
                          f"{v['image_size']!r} (positions interpolated to another size are not read)")
    hf_vc = {k: v[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "image_size", "patch_size", "norm_type") if k in v}
    for k in ("hidden_act", "layer_norm_eps", "num_channels"):
        if k in v:
            hf_vc[k] = v[k]
    hf_vc.update(model_type="internvl_vision", attention_bias=v["qkv_bias"], use_qk_norm=v["qk_normalization"],
                 use_absolute_position_embeddings=True, use_mean_pooling=True)
    llm: dict[str, Any] = d["llm_config"] if isinstance(d.get("llm_config"), dict) else {}
    vocab, _ = _vocab(folder)
    token = vocab.get("<IMG_CONTEXT>", 200_021 if llm.get("model_type") == "gpt_oss" else 151_667)
    out = {"vision_config": hf_vc, "vision_feature_layer": d.get("select_layer", -1),
           "downsample_ratio": d.get("downsample_ratio", 0.5), "image_token_id": token}
    lo = _int(d, "min_dynamic_patch", 1, where, 1)
    hi = _int(d, "max_dynamic_patch", 6, where, 1)
    if lo > hi:
        raise ConfigError(f"{where}: min_dynamic_patch {lo} is above max_dynamic_patch {hi}")
    dynamic = d.get("dynamic_image_size", False)
    thumbnail = d.get("use_thumbnail", False)
    for key, flag in (("dynamic_image_size", dynamic), ("use_thumbnail", thumbnail)):
        if not isinstance(flag, bool):
            raise ConfigError(f"{where}: {key} must be true or false, got {flag!r}")
    return out, (lo if dynamic else 1), (hi if dynamic else 1), bool(thumbnail)


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


def _video_processing(folder: str | None, image_size: int, where: str) -> ImageProcessing | None:
    """InternVLVideoProcessor's steps as transformers finds its settings (processor_config.json's
    "video_processor", else video_preprocessor_config.json): each frame resized to ``size``
    (which must be the tower's square; the class default is 384 x 384), rescale, normalize
    (its defaults: bicubic, CLIP's mean and std). None without either file: the frames take
    the image processor's steps. Frames are taken as given (do_sample_frames is not read:
    the published files turn it off)."""
    pc: dict[str, Any] | None = None
    if folder:
        proc = os.path.join(folder, "processor_config.json")
        nested = _json_object(proc).get("video_processor") if os.path.isfile(proc) else None
        if isinstance(nested, dict):
            pc, where = nested, proc
        elif os.path.isfile(path := os.path.join(folder, "video_preprocessor_config.json")):
            pc, where = _json_object(path), path
    if pc is None:
        return None
    pc = {k: v for k, v in pc.items() if v is not None}  # null: the default
    kind = str(pc.get("video_processor_type", "InternVLVideoProcessor"))
    if kind.removesuffix("Fast") != "InternVLVideoProcessor":
        raise ConfigError(f"{where}: video_processor_type {kind!r} is not read in InternVL "
                          "(InternVLVideoProcessor's frames are)")
    if not pc.get("do_resize", True):
        raise ConfigError(f"{where}: the video processor's do_resize false: frames of any size would "
                          f"reach a tower that takes {image_size} x {image_size}")
    if pc.get("do_center_crop"):
        raise ConfigError(f"{where}: the video processor's do_center_crop is not read")
    size = pc.get("size", {"height": 384, "width": 384})  # InternVLVideoProcessor's default
    if not (isinstance(size, dict) and size.get("height") == image_size and size.get("width") == image_size):
        raise ConfigError(f"{where}: the video processor's size {size!r}: the vision tower takes "
                          f"{image_size} x {image_size} frames")
    rescale, mean, std, resample, rgb = pixel_steps(pc, where)
    return ImageProcessing(None, (image_size, image_size), None, rescale, mean, std, resample, False, rgb)


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
    """An InternVLForConditionalGeneration config's image side (an InternVLChatModel one's:
    _from_remote first); a ConfigError names a bad field."""
    remote = arch == "InternVLChatModel"
    if remote:
        d, lo, hi, thumbnail = _from_remote(d, where, folder)
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
    if remote:  # its chat code's transform, whatever preprocessor_config.json says: ImageNet's, bicubic
        processing = _processing(None, v["image_size"], where)[0]
    else:
        processing, lo, hi = _processing(folder, v["image_size"], where)
        thumbnail = True
    tokens = (side // shuffle) ** 2
    seq = None if remote else _seq_length(d, folder, where)
    if seq is not None and seq != tokens:
        raise ConfigError(f"{where}: image_seq_length {seq} (the processor's <IMG_CONTEXT> per tile) "
                          f"differs from the {tokens} rows a tile gives ((image_size / patch_size x "
                          "downsample_ratio)^2)")
    start, end, texts, video_id = _special_ids(folder, token)
    if remote:  # vLLM's form for this layout: "<video>" as text, frames joined without a newline
        texts, video_id, sep, video_processing = (texts[0], texts[1], texts[2], "<video>"), None, "", None
    else:
        sep, video_processing = "\n", _video_processing(folder, v["image_size"], where)
    if video_id in (token, start, end):
        raise ConfigError(f"{where}: the tokenizer's video token {texts[3]!r} is one of <img>, </img>, "
                          "<IMG_CONTEXT>")
    if len({token, start, end}) != 3:
        raise ConfigError(f"{where}: <img> ({start}), </img> ({end}) and <IMG_CONTEXT> ({token}) must be "
                          "three tokens")
    return InternVLVisionConfig(
        v["hidden_size"], v["intermediate_size"], layers, v["num_attention_heads"], v["num_channels"],
        v["image_size"], v["patch_size"], v["hidden_act"], float(v["layer_norm_eps"]), norm,
        _flag(vc, "use_qk_norm", False, where), _flag(vc, "attention_bias", False, where),
        _flag(vc, "use_absolute_position_embeddings", True, where), feature,
        raw_layer == -1 and not _flag(vc, "use_mean_pooling", True, where), shuffle, act, token,
        start, end, lo, hi, processing, thumbnail, remote, texts, video_id, sep, video_processing)
