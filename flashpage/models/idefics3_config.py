"""The image side of an Idefics3 or SmolVLM checkpoint (Idefics3ForConditionalGeneration:
HuggingFaceM4/Idefics3-8B-Llama3, SmolVLM-Instruct; SmolVLMForConditionalGeneration:
SmolVLM-256M / 500M-Instruct, SmolVLM2), read from its files once. config.py's
ModelConfig.vision holds the Idefics3VisionConfig; models/idefics3.py runs it.

Read from: vision_config (Idefics3VisionConfig's / SmolVLMVisionConfig's fields and
defaults: a SigLIP tower), the wrapper's scale_factor and image_token_id,
preprocessor_config.json (Idefics3ImageProcessor / SmolVLMImageProcessor: the longest edge
resized to ``size``, tiles of ``max_image_size`` with image splitting, LANCZOS by default,
rescale, normalize), processor_config.json (image_seq_len) and the tokenizer's files (the
ids of ``<fake_token_around_image>``, ``<global-img>``, ``<row_r_col_c>`` and of "\\n" /
"\\n\\n" in its byte-level vocabulary: the prompt expansion works on ids). SmolVLM2's videos
(models/smolvlm_video.py): the tokenizer's ``<video>`` and video_preprocessor_config.json
(SmolVLMVideoProcessor: the frames' longest edge, mean / std, resample, and its frame
sampling: do_sample_frames, num_frames / video_sampling.max_frames, fps).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from flashpage.config import ConfigError, ImageProcessing, _json_object, pixel_steps, vit_section
from flashpage.models.internvl_config import _vocab
from flashpage.models.pil_resample import FILTERS

# Idefics3VisionConfig's defaults (SmolVLMVisionConfig's are the same)
_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
    num_channels=3, image_size=224, patch_size=32, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
_ACTS = ("gelu_pytorch_tanh", "gelu", "quick_gelu", "relu")
_RESAMPLE = {1: "lanczos", 2: "bilinear", 3: "bicubic"}  # PIL's codes
MAX_IMAGE_SIDE = 4096  # the processors' MAX_IMAGE_SIZE: a longer side is scaled below it
# byte-level BPE's "\n" and "\n\n" (GPT-2's byte alphabet: SmolLM2's and Llama 3's tokenizers)
_NL, _NL2 = "\u010a", "\u010a\u010a"


@dataclass(frozen=True)
class FrameSampling:
    """SmolVLMVideoProcessor's frame sampling (models/smolvlm_video.sample_video): with
    ``sample`` (do_sample_frames), at most ``num_frames`` frames at ``fps`` a second of the
    video; both are set whenever ``sample`` is."""

    sample: bool = False
    num_frames: int | None = None
    fps: float | None = None


def frame_sampling_of(d: dict[str, Any], where: str, base: FrameSampling) -> FrameSampling:
    """``base`` with ``d``'s do_sample_frames / num_frames / fps over it (the video
    processor's fields, or a processor call's kwargs); a ConfigError names a bad value, or
    sampling asked without both numbers (transformers' sample_frames needs them)."""
    sample = d.get("do_sample_frames", base.sample)
    if not isinstance(sample, bool):
        raise ConfigError(f"{where}: do_sample_frames must be true or false, got {sample!r}")
    n = d.get("num_frames", base.num_frames)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(f"{where}: num_frames must be an int >= 1, got {n!r}")
    fps = d.get("fps", base.fps)
    if fps is not None and (not isinstance(fps, (int, float)) or isinstance(fps, bool) or not fps > 0):
        raise ConfigError(f"{where}: fps must be a positive number, got {fps!r}")
    if sample and (n is None or fps is None):
        raise ConfigError(f"{where}: do_sample_frames needs num_frames (video_sampling max_frames) and fps, "
                          f"got num_frames {n!r} and fps {fps!r}")
    return FrameSampling(sample, n, None if fps is None else float(fps))


@dataclass(frozen=True)
class Idefics3VisionConfig:
    """The SigLIP tower (every layer, then post_layernorm), the connector (pixel shuffle by
    ``scale_factor``, one Linear without bias) and the processor: an image's longest edge
    resized to ``longest_edge``, then (``splitting``) a grid of ``tile`` x ``tile`` tiles
    and the whole image as one more, or (no splitting) the image as one tile; each tile
    ``tokens_per_image`` rows of ``image_token_id`` (<image>). ``fake_token_id``
    (<fake_token_around_image>), ``global_token_id`` (<global-img>), ``row_col_ids``
    (<row_r_col_c>, r and c from 1, row-major, ``row_col_side`` a side; None where the
    tokenizer lacks one) and ``newline_ids`` /
    ``double_newline_ids`` ("\\n" / "\\n\\n") are the tokens the processor writes around
    them; None where the tokenizer's files do not hold them (prepare then says so)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    scale_factor: int
    image_token_id: int
    longest_edge: int
    tile: int
    splitting: bool
    resample: str
    processing: ImageProcessing  # rescale, mean and std (clip_image.normalize)
    fake_token_id: int | None = None
    global_token_id: int | None = None
    row_col_ids: tuple[int | None, ...] | None = None
    row_col_side: int = 0
    newline_ids: tuple[int, ...] | None = None
    double_newline_ids: tuple[int, ...] | None = None
    architecture: str = "Idefics3ForConditionalGeneration"
    # SmolVLM2's videos (models/smolvlm_video.py): the tokenizer's <video> (None: no video
    # input), each frame's longest edge resized to ``video_longest_edge`` then to the tile's
    # square, under ``video_processing``'s steps (SmolVLMVideoProcessor's)
    video_token_id: int | None = None
    video_longest_edge: int = 4 * 364
    video_processing: ImageProcessing | None = None
    frame_sampling: FrameSampling = FrameSampling()

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        """The rows one tile gives: its patch grid pixel-shuffled, (side / scale_factor)^2."""
        return (self.patches_per_side // self.scale_factor) ** 2

    @property
    def grid_side(self) -> int:
        """The most tiles a side of an image's grid has: its longest edge in tiles."""
        return math.ceil(min(self.longest_edge, MAX_IMAGE_SIDE) / self.tile)


def _int(d: dict[str, Any], key: str, default: int, where: str, least: int = 1) -> int:
    v = d.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ConfigError(f"{where}: {key} must be an int >= {least}, got {v!r}")
    return v


def _edge(pc: dict[str, Any], key: str, default: int, where: str) -> int:
    """A processor field {"longest_edge": n} (the only form these processors read)."""
    v = pc.get(key, {"longest_edge": default})
    if not isinstance(v, dict) or set(v) != {"longest_edge"}:
        raise ConfigError(f"{where}: {key} must be {{\"longest_edge\": pixels}}, got {v!r}")
    return _int(v, "longest_edge", default, f"{where}: {key}")


def _processing(folder: str | None, image_size: int, arch: str
                ) -> tuple[ImageProcessing, int, int, bool, str]:
    """The image processor's steps -> (rescale / normalize, longest edge, tile, splitting,
    resample); transformers' defaults at the tower's size without a preprocessor_config.json
    (tiles of the tower's square, the longest edge 4 of them, LANCZOS, mean = std = 0.5)."""
    path = os.path.join(folder, "preprocessor_config.json") if folder else None
    half = (0.5, 0.5, 0.5)
    if path is None or not os.path.isfile(path):
        return ImageProcessing(None, None, None, 1 / 255, half, half), 4 * image_size, image_size, True, "lanczos"
    pc = {k: v for k, v in _json_object(path).items() if v is not None}  # null: the default
    kind = str(pc.get("image_processor_type", "Idefics3ImageProcessor")).removesuffix("Pil").removesuffix("Fast")
    if kind not in ("Idefics3ImageProcessor", "SmolVLMImageProcessor"):
        raise ConfigError(f"{path}: image_processor_type {kind!r} is not read in {arch} "
                          "(Idefics3ImageProcessor's and SmolVLMImageProcessor's tiles are)")
    tile = _edge(pc, "max_image_size", 364, path)
    if tile != image_size:
        raise ConfigError(f"{path}: max_image_size {tile}: tiles other than the vision tower's "
                          f"{image_size} x {image_size} (padded, positions bucketed) are not supported")
    if not pc.get("do_resize", True):
        raise ConfigError(f"{path}: do_resize false is not supported (the longest edge is resized to "
                          "size before the tiles are cut)")
    longest = _edge(pc, "size", 4 * 364, path)
    rescale, mean, std, mode, rgb = _pixel_steps(pc, path)
    splitting = pc.get("do_image_splitting", True)
    if not isinstance(splitting, bool):
        raise ConfigError(f"{path}: do_image_splitting must be true or false, got {splitting!r}")
    return ImageProcessing(None, None, None, rescale, mean, std, mode, False, rgb), longest, tile, splitting, mode


def _pixel_steps(pc: dict[str, Any], path: str) -> tuple[float | None, tuple[float, ...] | None,
                                                         tuple[float, ...] | None, str, bool]:
    """config.pixel_steps under Idefics3's / SmolVLM's processors' defaults (mean = std =
    0.5, LANCZOS; the modes models/pil_resample.py runs)."""
    half = (0.5, 0.5, 0.5)
    steps = pixel_steps(pc, path, mean_default=half, std_default=half, resample_default=1, resamples=_RESAMPLE)
    assert steps[3] in FILTERS
    return steps


def _video_processing(folder: str | None, tile: int, arch: str) -> tuple[ImageProcessing, int, FrameSampling]:
    """SmolVLMVideoProcessor's steps (video_preprocessor_config.json, else its class
    defaults): (rescale / normalize / resample, the longest edge frames are resized to before
    the tile's square, its frame sampling: video_sampling's max_frames / fps over the
    num_frames / fps fields, as its __init__ reads them; off by default)."""
    path = os.path.join(folder, "video_preprocessor_config.json") if folder else None
    half = (0.5, 0.5, 0.5)
    if path is None or not os.path.isfile(path):
        return ImageProcessing(None, None, None, 1 / 255, half, half, "lanczos"), 4 * 364, FrameSampling()
    pc = {k: v for k, v in _json_object(path).items() if v is not None}
    kind = str(pc.get("video_processor_type", "SmolVLMVideoProcessor")).removesuffix("Fast")
    if kind != "SmolVLMVideoProcessor":
        raise ConfigError(f"{path}: video_processor_type {kind!r} is not read in {arch} "
                          "(SmolVLMVideoProcessor's frames are)")
    if _edge(pc, "max_image_size", 364, path) != tile:
        raise ConfigError(f"{path}: max_image_size {pc.get('max_image_size')!r}: frames other than the "
                          f"vision tower's {tile} x {tile} are not supported")
    if not pc.get("do_resize", True):
        raise ConfigError(f"{path}: do_resize false is not supported (frames are resized to the tile)")
    sampling = pc.get("video_sampling")
    size = sampling.get("video_size") if isinstance(sampling, dict) and "video_size" in sampling else None
    longest = _edge({"size": size if size is not None else pc.get("size", {"longest_edge": 4 * 364})},
                    "size", 4 * 364, path)
    rescale, mean, std, mode, rgb = _pixel_steps(pc, path)
    fields: dict[str, Any] = {k: pc[k] for k in ("do_sample_frames", "num_frames", "fps") if k in pc}
    if isinstance(sampling, dict):
        fields.update({k: sampling[s] for k, s in (("num_frames", "max_frames"), ("fps", "fps")) if s in sampling})
    return (ImageProcessing(None, None, None, rescale, mean, std, mode, False, rgb), longest,
            frame_sampling_of(fields, path, FrameSampling()))


def _seq_len(folder: str | None) -> tuple[int | None, str | None]:
    """processor_config.json's image_seq_len (and the file), None without one."""
    path = os.path.join(folder, "processor_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return None, None
    pc = _json_object(path)
    if pc.get("image_seq_len") is None:
        return None, path
    return _int(pc, "image_seq_len", 1, path), path


def _token_ids(folder: str | None, side: int) -> dict[str, Any]:
    """The processor's tokens in the folder's tokenizer files (None each where missing):
    <row_r_col_c> up to ``side`` or 6 (the published tokenizers'), whichever is more."""
    vocab, _ = _vocab(folder)
    side = max(side, 6)
    rc = tuple(vocab.get(f"<row_{r}_col_{c}>") for r in range(1, side + 1) for c in range(1, side + 1))
    nl, nl2 = vocab.get(_NL), vocab.get(_NL2)
    return dict(fake_token_id=vocab.get("<fake_token_around_image>"), global_token_id=vocab.get("<global-img>"),
                row_col_ids=rc if any(t is not None for t in rc) else None, row_col_side=side,
                newline_ids=None if nl is None else (nl,),
                double_newline_ids=None if nl is None else ((nl2,) if nl2 is not None else (nl, nl)))


def idefics3_vision_config_of(d: dict[str, Any], arch: str, where: str, folder: str | None
                              ) -> Idefics3VisionConfig:
    """An Idefics3 / SmolVLM config's image side; a ConfigError names a bad field."""
    vc = d.get("vision_config") or {}
    vtype = vc.get("model_type") if isinstance(vc, dict) else None
    own = "smolvlm_vision" if arch == "SmolVLMForConditionalGeneration" else "idefics3_vision"
    # SmolVLM's first releases are Idefics3 checkpoints, and transformers 4.4x wrote the tower's
    # model_type as the wrapper's ("idefics3"): any of these names the same SigLIP tower
    vtype = vtype if vtype in ("idefics3_vision", "smolvlm_vision", "idefics3", "smolvlm") else own
    _, v = vit_section(d, arch, where, vtype, "a SigLIP tower", _DEFAULTS)
    if v["hidden_size"] % v["num_attention_heads"]:
        raise ConfigError(f"{where}: vision_config.hidden_size {v['hidden_size']} is not a multiple "
                          f"of num_attention_heads {v['num_attention_heads']}")
    if v["image_size"] % v["patch_size"]:
        raise ConfigError(f"{where}: vision_config.image_size {v['image_size']} is not a multiple "
                          f"of patch_size {v['patch_size']}")
    if v["hidden_act"] not in _ACTS:
        raise ConfigError(f"{where}: vision_config.hidden_act {v['hidden_act']!r} is not supported "
                          f"({', '.join(_ACTS)})")
    scale = _int(d, "scale_factor", 2, where)
    side = v["image_size"] // v["patch_size"]
    if side % scale:
        raise ConfigError(f"{where}: scale_factor {scale} must divide the tower's {side} x {side} "
                          "patch grid (pixel shuffle)")
    token = _int(d, "image_token_id", 128_257, where, 0)
    proc, longest, tile, splitting, resample = _processing(folder, v["image_size"], arch)
    rows = (side // scale) ** 2
    seq, path = _seq_len(folder)
    if seq is not None and seq != rows:
        raise ConfigError(f"{path}: image_seq_len {seq} (the processor's <image> per tile) differs from "
                          f"the {rows} rows a tile gives ((image_size / patch_size / scale_factor)^2)")
    cfg = Idefics3VisionConfig(
        v["hidden_size"], v["intermediate_size"], v["num_hidden_layers"], v["num_attention_heads"],
        v["num_channels"], v["image_size"], v["patch_size"], v["hidden_act"], float(v["layer_norm_eps"]),
        scale, token, longest, tile, splitting, resample, proc, architecture=arch)
    video: dict[str, Any] = {}
    if arch == "SmolVLMForConditionalGeneration":
        vid = _vocab(folder)[0].get("<video>")
        if vid is not None:
            vproc, vlong, sampling = _video_processing(folder, tile, arch)
            video = dict(video_token_id=vid, video_longest_edge=vlong, video_processing=vproc,
                         frame_sampling=sampling)
    return Idefics3VisionConfig(**{**cfg.__dict__, **_token_ids(folder, cfg.grid_side), **video})


def with_processor_kwargs(vc: Idefics3VisionConfig, kwargs: dict[str, Any]) -> Idefics3VisionConfig:
    """vLLM's ``mm_processor_kwargs`` over the image processor's file, as
    Idefics3Processor's call reads them: ``size`` {"longest_edge": n} (the image's longest
    edge before its tiles are cut), ``do_image_splitting`` and ``max_image_size`` (only the
    tower's own tile), engine-wide; SmolVLM2's video processor's ``do_sample_frames`` /
    ``num_frames`` / ``fps`` (its frame sampling), per request too
    (config.request_mm_processing); a ConfigError names a key or value it does not take."""
    where = "mm_processor_kwargs"
    video = ("do_sample_frames", "num_frames", "fps") if vc.video_token_id is not None else ()
    unknown = sorted(set(kwargs) - {"size", "do_image_splitting", "max_image_size", *video})
    if unknown:
        raise ConfigError(f"{where} {unknown}: {vc.architecture}'s image processor reads size, do_image_splitting "
                          "and max_image_size" + (" (its video processor do_sample_frames, num_frames and fps)"
                                                  if video else ""))
    longest = _edge(kwargs, "size", vc.longest_edge, where)
    if "max_image_size" in kwargs and _edge(kwargs, "max_image_size", vc.tile, where) != vc.tile:
        raise ConfigError(f"{where} max_image_size {kwargs['max_image_size']!r}: tiles other than the vision "
                          f"tower's {vc.tile} x {vc.tile} are not supported")
    split = kwargs.get("do_image_splitting", vc.splitting)
    if not isinstance(split, bool):
        raise ConfigError(f"{where} do_image_splitting must be true or false, got {split!r}")
    side = math.ceil(min(longest, MAX_IMAGE_SIDE) / vc.tile)
    if split and side > vc.row_col_side:
        raise ConfigError(f"{where} size longest_edge {longest}: grids of up to {side} x {side} tiles, but "
                          f"the tokenizer's <row_r_col_c> go to {vc.row_col_side}")
    sampling = frame_sampling_of(kwargs, where, vc.frame_sampling)
    return replace(vc, longest_edge=longest, splitting=split, frame_sampling=sampling)
