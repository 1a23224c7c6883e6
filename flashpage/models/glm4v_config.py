"""The config of a GLM-4.1V checkpoint (Glm4vForConditionalGeneration: GLM-4.1V-9B-Thinking,
GLM-4.1V-9B-Base) or a GLM-4.5V one (Glm4vMoeForConditionalGeneration: the same tower over
GLM-4.5's MoE text model), read once: its text model as a GLM-4 (GLM-4.5) config with M-RoPE
sections, and its image side as a ``Glm4vVisionConfig`` (a QwenVisionConfig: the engine handles
it as it does Qwen2-VL's, models/glm4v.py runs it).

Read from, as transformers 5.25's Glm4vConfig / Glm4vMoeConfig read them:

- ``text_config`` (Glm4vTextConfig's defaults under it; the top-level eos / tie / dtype over
  it; or, a flat config, the top level itself): GLM-4's layers (models/glm.py Glm4DecoderLayer: norms after attention and after the
  MLP, the merged gate_up_proj), q / k / v always biased and head_dim always hidden_size /
  heads (Glm4vTextAttention reads neither attention_bias nor head_dim), rotary on
  interleaved pairs of the first ``partial_rotary_factor`` of each head (the published
  configs' 0.5 where none is given: transformers' 1.0 would not fit the default sections)
  split among (t, h, w) by ``mrope_section`` (rope_scaling / rope_parameters; [8, 12, 12]);
  GLM-4.5V's (Glm4vMoeTextConfig's defaults): GLM-4.5's layers (models/glm.py: DeepSeek-V3's
  sigmoid routing after ``first_k_dense_replace`` dense layers), q / k / v biased with
  ``attention_bias`` (default true), ``head_dim`` where given, rotary on halves of the first
  half of each head (Glm4vMoeTextRotaryEmbedding: the sections, then the frequencies twice);
- ``vision_config`` (Glm4vVisionConfig's defaults): the tower's sizes, ``image_size`` /
  ``patch_size`` (the learned position table's side), ``rms_norm_eps``, ``attention_bias``
  (the qkv's), ``rope_parameters.rope_theta``;
- the wrapper's token ids (``<|image|>``, ``<|video|>``, ``<|begin_of_image|>`` ...);
- preprocessor_config.json (Glm4vImageProcessor: size {shortest_edge, longest_edge}, default
  112 x 112 to 28 x 28 x 15000 pixels over the image taken as 2 frames; mean / std CLIP's)
  and the video processor's (Glm4vVideoProcessor: 112 x 112 to 28 x 28 x 2 x 30000 pixels
  over the whole video; its frame sampling, ``Glm4vFrameSampling``: do_sample_frames, fps,
  max_duration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashpage.config import (
    _TOP_LEVEL_FIELDS,
    ConfigError,
    QwenVisionConfig,
    _positive_ints,
    _qwen_image_processing,
    _qwen_video_processing,
    video_processor_fields,
)

# Glm4vTextConfig's defaults (the published configs name them all)
_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151_552, hidden_size=4096, intermediate_size=13_696, num_hidden_layers=40,
    num_attention_heads=32, num_key_value_heads=2, max_position_embeddings=32_768,
    rms_norm_eps=1e-5, hidden_act="silu")
# Glm4vVisionConfig's
_VISION_DEFAULTS: dict[str, Any] = dict(
    depth=24, hidden_size=1536, num_heads=12, intermediate_size=13_696, out_hidden_size=4096,
    image_size=336, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
# Glm4vMoeTextConfig's
_MOE_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151_424, hidden_size=4096, intermediate_size=10_944, num_hidden_layers=46,
    num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=65_536, rms_norm_eps=1e-5,
    hidden_act="silu", attention_bias=True, moe_intermediate_size=1408, num_experts_per_tok=8,
    n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1,
    first_k_dense_replace=1, norm_topk_prob=True)
# Glm4vConfig's token ids (Glm4vMoeConfig's image / video tokens: 151363 / 151364)
_TOKENS = dict(image_token_id=151_343, video_token_id=151_344, image_start_token_id=151_339,
               image_end_token_id=151_340, video_start_token_id=151_341, video_end_token_id=151_342)
_MOE_TOKENS = {**_TOKENS, "image_token_id": 151_363, "video_token_id": 151_364}
MOE_ARCHITECTURE = "Glm4vMoeForConditionalGeneration"
# (neither text model has q / k norms, whatever use_qk_norm says)
_NOT_TEXT = ("rope_scaling", "rope_parameters", "model_type", "architectures", "head_dim",
             "attention_bias", "quantization_config", "use_qk_norm")
# Glm4vImageProcessor's class defaults (size shortest_edge / longest_edge) and
# Glm4vVideoProcessor's
IMAGE_BOUNDS = (112 * 112, 28 * 28 * 15_000)
VIDEO_BOUNDS = (112 * 112, 28 * 28 * 2 * 30_000)
_IMAGE_PROCESSORS = ("Glm4vImageProcessor", "Glm4vImageProcessorPil", "Glm4vImageProcessorFast")


@dataclass(frozen=True)
class Glm4vFrameSampling:
    """Glm4vVideoProcessor's frame sampling (models/glm4v_video.py): with ``sample``
    (do_sample_frames), ``fps`` frames a second of a video up to ``max_duration`` seconds
    long, else int(max_duration x fps) frames spread over it. Off unless the video
    processor's file or mm_processor_kwargs ask (do_sample_frames and fps; max_duration is
    the file's alone, as transformers' processor call ignores it). The class's own default,
    on, is not taken where its file does not name it: frames are then taken as given, as
    Qwen3-VL's are (a file engine/video_io.py decodes is sampled there already)."""

    sample: bool = False
    fps: float = 2.0
    max_duration: float = 300.0


def frame_sampling_of(d: dict[str, Any], where: str, base: Glm4vFrameSampling) -> Glm4vFrameSampling:
    """``base`` with ``d``'s do_sample_frames / fps / max_duration over it (the video
    processor's fields, or mm_processor_kwargs); a ConfigError names a bad value."""
    sample = d.get("do_sample_frames", base.sample)
    if sample is None:  # a file's null: the default
        sample = base.sample
    if not isinstance(sample, bool):
        raise ConfigError(f"{where}: do_sample_frames must be true or false, got {sample!r}")
    out = {}
    for key in ("fps", "max_duration"):
        v = d.get(key)
        v = getattr(base, key) if v is None else v
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise ConfigError(f"{where}: {key} must be a positive number, got {v!r}")
        out[key] = float(v)
    if sample and out["fps"] * out["max_duration"] < 1:
        raise ConfigError(f"{where}: do_sample_frames with fps {out['fps']:g} and max_duration "
                          f"{out['max_duration']:g} would pick no frame of a video longer than max_duration "
                          "(int(max_duration x fps) frames): their product must be at least 1")
    return Glm4vFrameSampling(sample, out["fps"], out["max_duration"])


@dataclass(frozen=True)
class Glm4vVisionConfig(QwenVisionConfig):
    """GLM-4.1V's image side: QwenVisionConfig's fields (variant "glm4v"; ``intermediate_size``
    the merger's gated MLP, each block's of ``out_hidden_size``; ``num_position_embeddings``
    the learned table's (image_size / patch_size)^2 entries; vision_start / vision_end the
    ``<|begin_of_image|>`` / ``<|end_of_image|>`` ids) and its own."""

    rms_norm_eps: float = 1e-5  # the tower's RMSNorms (post-conv, blocks, post-blocks)
    attention_bias: bool = False  # on the blocks' qkv (never on their proj)
    video_start_token_id: int = 151_341  # <|begin_of_video|>
    video_end_token_id: int = 151_342  # <|end_of_video|>
    frame_sampling: Glm4vFrameSampling = Glm4vFrameSampling()


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def glm4v_text_config(d: dict[str, Any], arch: str, where: str) -> tuple[dict[str, Any], str, tuple[int, ...]]:
    """A GLM-4.1V checkpoint's text model as a Glm4ForCausalLM config (GLM-4.5V's as a
    Glm4MoeForCausalLM one; module docstring), the ``where`` its errors name, and its M-RoPE
    sections."""
    moe = arch == MOE_ARCHITECTURE
    want_type = "glm4v_moe_text" if moe else "glm4v_text"
    tc = d.get("text_config")
    if tc is None:  # a flat config: the text model's fields at the top level (as Qwen2-VL's files)
        tc = {k: v for k, v in d.items() if k not in ("vision_config", *_TOKENS)}
    if not isinstance(tc, dict):
        raise ConfigError(f"{where}: {arch}'s text_config must be an object (its language model's config), "
                          f"got {tc!r}")
    tw = f"{where}: text_config" if "text_config" in d else where
    text_type = tc.get("model_type") or want_type
    if text_type != want_type and "text_config" in d:
        raise ConfigError(f"{where}: text_config.model_type {text_type!r} is not supported in {arch} "
                          f"(supported: {want_type})")
    if d.get("quantization_config") is not None or tc.get("quantization_config") is not None:
        raise ConfigError(f"{where}: quantized {arch} checkpoints (quantization_config) are not read yet; "
                          "the 16-bit checkpoint is, and --quantization fp8 / int4 quantizes its text "
                          "model at load")
    rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{tw}: rope_parameters must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ConfigError(f"{tw}: rope type {kind!r} is not supported with M-RoPE in {arch} (default is)")
    section = _positive_ints(rope.get("mrope_section", [8, 12, 12]), "mrope_section", tw)
    if len(section) != 3:
        raise ConfigError(f"{tw}: mrope_section must be 3 counts (t, h, w), got {list(section)}")
    text = {**(_MOE_TEXT_DEFAULTS if moe else _TEXT_DEFAULTS),
            **{k: v for k, v in tc.items() if k not in _NOT_TEXT}}
    heads: Any = text.get("num_attention_heads")
    width: Any = text.get("hidden_size")
    head_dim = tc.get("head_dim") if moe else None  # (Glm4vTextAttention reads none)
    if head_dim is None and _int(heads) and _int(width) and heads > 0:
        if width % heads:
            raise ConfigError(f"{tw}: hidden_size {width} is not a multiple of num_attention_heads {heads} "
                              f"({arch}'s heads are hidden_size / num_attention_heads wide without a head_dim)")
        head_dim = width // heads
    if "num_local_experts" in text:  # transformers 5's name
        text["n_routed_experts"] = text.pop("num_local_experts")
    family = "glm4_moe" if moe else "glm4"
    text.update(model_type=family, architectures=["Glm4MoeForCausalLM" if moe else "Glm4ForCausalLM"],
                attention_bias=tc.get("attention_bias", True) if moe else True,
                rope_theta=tc.get("rope_theta", rope.get("rope_theta", 10_000.0)),
                partial_rotary_factor=tc.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5)))
    if head_dim is not None:
        text["head_dim"] = head_dim
    for key in _TOP_LEVEL_FIELDS:
        if d.get(key) is not None:
            text[key] = d[key]
    return text, tw, section


def glm4v_vision_config_of(d: dict[str, Any], arch: str, where: str, folder: str | None,
                           text_hidden: int) -> Glm4vVisionConfig:
    """A GLM-4.1V checkpoint's Glm4vVisionConfig (module docstring); a ConfigError names a
    bad field."""
    vc = d.get("vision_config") or {}
    if not isinstance(vc, dict):
        raise ConfigError(f"{where}: vision_config must be an object, got {vc!r}")
    w = f"{where}: vision_config"
    v = {k: default if vc.get(k) is None else vc[k] for k, default in _VISION_DEFAULTS.items()}
    for k, x in v.items():
        if not _int(x) or x < 1:
            raise ConfigError(f"{w}.{k} must be a positive int, got {x!r}")
    if v["hidden_size"] % v["num_heads"] or (v["hidden_size"] // v["num_heads"]) % 4:
        raise ConfigError(f"{w}: the heads' width {v['hidden_size']} / {v['num_heads']} must be a "
                          "multiple of 4 (2-D rotary on halves of h and w)")
    if v["image_size"] % v["patch_size"]:
        raise ConfigError(f"{w}.image_size {v['image_size']} is not a multiple of patch_size "
                          f"{v['patch_size']} (the learned position table is (image_size / patch_size)^2)")
    if vc.get("in_channels", 3) != 3:
        raise ConfigError(f"{w}.in_channels {vc.get('in_channels')!r}: only RGB (3) images are read")
    act = vc.get("hidden_act", "silu")
    if act not in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"):
        raise ConfigError(f"{w}.hidden_act {act!r} is not supported (silu, gelu, gelu_pytorch_tanh, quick_gelu)")
    if v["out_hidden_size"] != text_hidden:
        raise ConfigError(f"{w}: the merger's output (out_hidden_size {v['out_hidden_size']}) differs "
                          f"from the text model's hidden_size {text_hidden}")
    eps = vc.get("rms_norm_eps", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ConfigError(f"{w}.rms_norm_eps must be a positive number, got {eps!r}")
    bias = vc.get("attention_bias", False)
    if not isinstance(bias, bool):
        raise ConfigError(f"{w}.attention_bias must be true or false, got {bias!r}")
    rope = vc.get("rope_parameters") or {}
    theta = rope.get("rope_theta", 10_000.0) if isinstance(rope, dict) else 10_000.0
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise ConfigError(f"{w}.rope_parameters.rope_theta must be a positive number, got {theta!r}")
    tokens = {}
    for key, default in (_MOE_TOKENS if arch == MOE_ARCHITECTURE else _TOKENS).items():
        t = d.get(key, default)
        if not _int(t) or t < 0:
            raise ConfigError(f"{where}: {key} must be a token id, got {t!r}")
        tokens[key] = t
    sizes = dict(patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
                 spatial_merge_size=v["spatial_merge_size"])
    return Glm4vVisionConfig(
        "glm4v", v["depth"], v["hidden_size"], v["num_heads"], v["intermediate_size"], act, v["out_hidden_size"],
        v["patch_size"], v["temporal_patch_size"], v["spatial_merge_size"], 0, (), float(theta),
        tokens["image_token_id"], tokens["video_token_id"], tokens["image_start_token_id"],
        tokens["image_end_token_id"],
        processing=_qwen_image_processing(folder, sizes, where, _IMAGE_PROCESSORS, IMAGE_BOUNDS),
        video_processing=_qwen_video_processing(folder, where, bounds=VIDEO_BOUNDS),
        frame_sampling=frame_sampling_of(*video_processor_fields(folder, where), Glm4vFrameSampling()),
        num_position_embeddings=(v["image_size"] // v["patch_size"]) ** 2,
        rms_norm_eps=float(eps), attention_bias=bias,
        video_start_token_id=tokens["video_start_token_id"], video_end_token_id=tokens["video_end_token_id"])
