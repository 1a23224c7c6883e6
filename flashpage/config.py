"""Configuration: the one place a Hugging Face ``config.json`` is read.

``ModelConfig.from_hf`` turns the raw dict into a frozen dataclass and validates it;
everything downstream reads the dataclass, never the dict. ``EngineConfig`` holds the
serving knobs (cache, scheduler, backend).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from flashpage.engine.media import MediaPolicy
    from flashpage.models.gemma3_config import Gemma3VisionConfig
    from flashpage.models.idefics3_config import Idefics3VisionConfig
    from flashpage.models.internvl_config import InternVLVisionConfig
    from flashpage.models.pixtral_config import PixtralVisionConfig
    from flashpage.models.qwen2_audio_config import Qwen2AudioConfig

# Architectures we can run, by family. DeepSeek is parsed for ``inspect`` and MLA.
# decoder sequence classifiers: the body of the family, a ``score`` head over the last
# token's hidden state instead of the LM head (models/llama.py LlamaForSequenceClassification)
CLASSIFIER_ARCHITECTURES = {
    "LlamaForSequenceClassification",
    "MistralForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification",
}
LLAMA_FAMILY = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
} | CLASSIFIER_ARCHITECTURES
DEEPSEEK_FAMILY = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}
# the Llama body with mixture-of-experts MLPs (models/llama.py, layers/moe.SparseMoeBlock;
# OLMoE's attention is OLMo2's, models/olmoe.py; Granite MoE's body Granite's, its block
# models/granite.GraniteMoeBlock): _llama_moe_fields
LLAMA_MOE_FAMILY = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                    "OlmoeForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"}
# ... of which these have experts of intermediate_size in every layer (no dense layers)
_EVERY_LAYER_MOE = {"MixtralForCausalLM", "OlmoeForCausalLM", "GraniteMoeForCausalLM",
                    "GraniteMoeSharedForCausalLM"}
# models/gemma.py: Llama's shape with (1 + w) norms, scaled embeddings and GELU-tanh;
# Gemma 2/3 add post-norms, per-layer sliding windows and softcaps (_gemma_fields)
GEMMA_FAMILY = {"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"}
# the Llama body with one twist each (models/phi3.py, granite.py, olmo.py, olmo2.py,
# cohere.py (Cohere2 too), starcoder2.py, gpt_neox.py, phi.py, gptj.py, falcon.py, opt.py;
# _variant_fields)
LLAMA_VARIANTS = {"Phi3ForCausalLM", "GraniteForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM",
                  "CohereForCausalLM", "Cohere2ForCausalLM", "Starcoder2ForCausalLM",
                  "GPTNeoXForCausalLM", "PhiForCausalLM", "GPTJForCausalLM", "FalconForCausalLM",
                  "OPTForCausalLM"} | {
    # SmolLM3 (NoPE layers), Arcee (a ReLU^2 MLP), Ministral (per-layer windows), OLMo 3
    # (OLMo2 with per-layer windows): _families4_fields
    "SmolLM3ForCausalLM", "ArceeForCausalLM", "MinistralForCausalLM", "Olmo3ForCausalLM",
    # ERNIE 4.5 (interleaved rotary), Seed-OSS (o_proj's bias apart), EXAONE 4 (OLMo2's
    # post-norms, per-head q/k norms, NoPE on its full-attention layers)
    "Ernie4_5ForCausalLM", "SeedOssForCausalLM", "Exaone4ForCausalLM",
    # HunYuan dense (per-head q/k norms after rotary, a stretched rope base), Apertus
    # (xIELU in a non-gated MLP, per-head q/k norms)
    "HunYuanDenseV1ForCausalLM", "ApertusForCausalLM",
    # InternLM2 / 2.5 (renamed Llama tensors, a grouped fused wqkv: models/internlm2.py) and
    # InternLM3 (Llama's names, its own bias flags): _internlm_fields
    "InternLM2ForCausalLM", "InternLM3ForCausalLM"}
# the families whose AWQ / GPTQ (int4) checkpoints are read (models/int4_checkpoint.py):
# every linear one of our ColumnParallelLinear / RowParallelLinear, found by the file's
# module names (mapped through a family's HFNames), and on the Llama-body MoE families
# below the routed experts' per-expert modules (``experts.{e}.{gate,up,down}_proj``,
# Mixtral's ``w1 / w3 / w2``) into layers/moe.FusedExperts; fp8 checkpoints are read for
# these and DeepSeek / the other MoE families
INT4_MOE_FAMILY = {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}
INT4_CHECKPOINT_FAMILY = LLAMA_FAMILY | GEMMA_FAMILY | LLAMA_VARIANTS | INT4_MOE_FAMILY
# models/gpt2.py: learned absolute positions (wpe) instead of rotary, GPT-2's config names
# (n_embd, n_layer, n_head, n_positions, n_inner); GPT-BigCode (StarCoder 1, SantaCoder) with
# multi-query attention (_gpt2_fields)
GPT2_FAMILY = {"GPT2LMHeadModel", "GPTBigCodeForCausalLM"}
# models/bloom.py, mpt.py: ALiBi position biases instead of rotary (layers/alibi.py), q, k
# and v in one fused linear, LayerNorms, a GELU MLP, the head tied (_bloom_fields, _mpt_fields)
ALIBI_FAMILY = {"BloomForCausalLM", "MptForCausalLM"}
# models/gpt_oss.py: GPT-OSS, attention sinks, alternating windowed / full layers, YaRN, and
# mixture-of-experts MLPs with biases and a clamped SwiGLU; MXFP4 experts dequantized at
# load (_gpt_oss_fields)
GPT_OSS_FAMILY = {"GptOssForCausalLM"}
# models/glm.py: GLM-4-0414's predecessor GLM (the Llama layer) and GLM-4 (a norm after
# attention and after the MLP too), both rotating interleaved pairs of the first half of each
# head; GLM-4.5 / 4.6 (Glm4Moe): the Llama body with DeepSeek-V3's sigmoid-routed experts
# after first_k_dense_replace dense layers, rotary on halves of half the head (_glm_fields)
GLM_FAMILY = {"GlmForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM"}
# models/llama4.py: Llama 4's text model (chunked attention on its rotary layers, NoPE ones
# with temperature tuning, L2 q/k norms, sigmoid top-k MoE with a shared expert: _llama4_fields)
LLAMA4_FAMILY = {"Llama4ForCausalLM"}
# multimodal checkpoints ("*ForConditionalGeneration") whose language model is one of the
# families above: we serve the text model alone (text_config, its tensors under the
# wrapper's prefix; the vision tower's skipped at load: models/multimodal.py). Wrapper ->
# (the text_config model_types we run in it, the default one, the vision / projector
# modules' names). _text_config_of reads the config; ModelConfig.multimodal_architecture
# keeps the wrapper's name, ``architecture`` is the text model's.
MULTIMODAL_TEXT_ARCHITECTURES: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    # Gemma 3 4B / 12B / 27B: a SigLIP tower, projector mm_input_projection / mm_soft_emb_norm;
    # its images too (models/gemma3_config.py, gemma3_vision.py)
    "Gemma3ForConditionalGeneration": (("gemma3_text",), "gemma3_text",
                                       ("vision_tower", "multi_modal_projector")),
    # Llama 4 Scout / Maverick
    "Llama4ForConditionalGeneration": (("llama4_text",), "llama4_text",
                                       ("vision_model", "multi_modal_projector")),
    # Mistral Small 3.1 / 3.2 (a Pixtral tower over a Mistral text model): its images too
    "Mistral3ForConditionalGeneration": (("mistral", "ministral"), "mistral",
                                         ("vision_tower", "multi_modal_projector")),
    # LLaVA-1.5 style (a CLIP ViT tower, a 2-layer projector, a Llama / Mistral / Vicuna text
    # model): its images too (ModelConfig.vision, models/llava.py), the first family that
    # takes image input
    "LlavaForConditionalGeneration": (("llama", "mistral"), "llama",
                                      ("vision_tower", "multi_modal_projector")),
    # LLaVA-NeXT (llava-v1.6): LLaVA's tower and projector over any-res tiles, an
    # image_newline row after each row of the grid (models/llava_next.py)
    "LlavaNextForConditionalGeneration": (("llama", "mistral"), "llama",
                                          ("vision_tower", "multi_modal_projector", "image_newline")),
    # LLaVA-OneVision: LLaVA-NeXT's tiles on a SigLIP tower (no CLS row), too large a grid
    # pooled down (anyres_max_9), over a Qwen2 text model (models/llava_onevision.py)
    "LlavaOnevisionForConditionalGeneration": (("qwen2",), "qwen2",
                                               ("vision_tower", "multi_modal_projector", "image_newline")),
    # Qwen2-VL / Qwen2.5-VL (a ViT with 2-D rotary and a patch merger, models/qwen2_vl.py,
    # over a Qwen2 text model with M-RoPE: ModelConfig.mrope_section): their images too.
    # Published configs are flat (the text model's fields at the top level), transformers
    # 5's nest them under text_config: _qwen_vl_text_config reads both
    "Qwen2VLForConditionalGeneration": (("qwen2_vl_text", "qwen2_vl", "qwen2"), "qwen2_vl_text",
                                        ("visual",)),
    "Qwen2_5_VLForConditionalGeneration": (("qwen2_5_vl_text", "qwen2_5_vl", "qwen2"), "qwen2_5_vl_text",
                                           ("visual",)),
    # Qwen3-VL (dense): Qwen3-VL's tower (learned position embeddings, deepstack features
    # added to the first decoder layers' image rows: models/qwen3_vl.py) over a Qwen3 text
    # model with interleaved M-RoPE (ModelConfig.mrope_interleaved); its images and videos
    # (frames: models/qwen3_vl_video.py)
    "Qwen3VLForConditionalGeneration": (("qwen3_vl_text",), "qwen3_vl_text", ("visual",)),
    # Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B): the same tower over a Qwen3-MoE text model
    # (models/llama.py's routed experts; the checkpoint's fused expert tensors:
    # models/multimodal.qwen3_vl_moe_experts)
    "Qwen3VLMoeForConditionalGeneration": (("qwen3_vl_moe_text",), "qwen3_vl_moe_text", ("visual",)),
    # GLM-4.1V (GLM-4.1V-9B-Thinking / Base): Qwen2-VL's design (M-RoPE, a 2-D rotary ViT
    # with a patch merger) with GLM-4's text layers and its own tower (a learned position
    # table interpolated bicubically per grid, a downsample conv, a gated merger):
    # models/glm4v_config.py, glm4v.py
    "Glm4vForConditionalGeneration": (("glm4v_text",), "glm4v_text", ("visual",)),
    # GLM-4.5V: the same tower over GLM-4.5's MoE text model (Glm4MoeForCausalLM, rotary on
    # halves)
    "Glm4vMoeForConditionalGeneration": (("glm4v_moe_text",), "glm4v_moe_text", ("visual",)),
    # InternVL in transformers' layout (InternVL3-*-hf, InternVL3.5-*-HF): the InternViT tower,
    # pixel shuffle and a LayerNorm + 2-layer projector over a Qwen2 / Qwen3 / Llama text model
    # (InternVL3.5's Qwen3-MoE and GPT-OSS ones too); its images too (models/internvl_config.py,
    # internvl.py)
    "InternVLForConditionalGeneration": (("qwen2", "qwen3", "llama", "qwen3_moe", "gpt_oss"), "qwen2",
                                         ("vision_tower", "multi_modal_projector")),
    # the same model in OpenGVLab's remote-code layout (InternVL3-2B, InternVL3_5-8B, ...:
    # llm_config, vision_model. / mlp1. with a fused qkv; models/internvl_config.py reads it),
    # and over InternLM2 (InternVL2.5-8B) or InternLM3 (InternVL3-9B) text models
    "InternVLChatModel": (("qwen2", "qwen3", "llama", "qwen3_moe", "gpt_oss", "internlm2", "internlm3"), "qwen2",
                          ("vision_model", "mlp1")),
    # Idefics3 (Idefics3-8B-Llama3, SmolVLM-Instruct) and SmolVLM (SmolVLM-256M / 500M, SmolVLM2):
    # a SigLIP tower, pixel shuffle and one Linear over a Llama text model (Llama 3, SmolLM2);
    # its images too (models/idefics3_config.py, idefics3.py)
    "Idefics3ForConditionalGeneration": (("llama",), "llama", ("vision_model", "connector")),
    "SmolVLMForConditionalGeneration": (("llama",), "llama", ("vision_model", "connector")),
    # Qwen2-Audio (Qwen2-Audio-7B, -Instruct): a Whisper-style audio encoder, avg-pooled, and
    # one Linear over a Qwen2 text model; its audio too (ModelConfig.audio,
    # models/qwen2_audio_config.py, qwen2_audio.py)
    "Qwen2AudioForConditionalGeneration": (("qwen2",), "qwen2", ("audio_tower", "multi_modal_projector")),
}
# Qwen3-VL's tower, deepstack and interleaved M-RoPE (dense and MoE text models)
QWEN3_VL_ARCHITECTURES = frozenset({"Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"})
QWEN_VL_ARCHITECTURES = frozenset({"Qwen2VLForConditionalGeneration",
                                   "Qwen2_5_VLForConditionalGeneration"}) | QWEN3_VL_ARCHITECTURES
# GLM-4.1V / GLM-4.5V: a QwenVisionConfig of its own (models/glm4v_config.Glm4vVisionConfig),
# M-RoPE over GLM-4's interleaved pairs (GLM-4.5V: GLM-4.5's halves)
GLM4V_ARCHITECTURES = frozenset({"Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration"})
# the wrappers whose images we run (ModelConfig.vision): the others serve their text alone.
# Mistral3 (and LLaVA whose vision_config is "pixtral"): a Pixtral tower, read by
# models/pixtral_config.py, run by models/pixtral.py
IMAGE_ARCHITECTURES = frozenset({"LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                 "LlavaOnevisionForConditionalGeneration",
                                 "Mistral3ForConditionalGeneration",
                                 "Gemma3ForConditionalGeneration",
                                 "InternVLForConditionalGeneration", "InternVLChatModel",
                                 "Idefics3ForConditionalGeneration",
                                 "SmolVLMForConditionalGeneration"}) | QWEN_VL_ARCHITECTURES \
    | GLM4V_ARCHITECTURES
# the wrappers whose audio we run (ModelConfig.audio)
AUDIO_ARCHITECTURES = frozenset({"Qwen2AudioForConditionalGeneration"})
# LLaVA's relatives we do not run, each with why (a ConfigError says it rather than "not supported")
_UNSUPPORTED_IMAGE_ARCHITECTURES = {
    "LlavaNextVideoForConditionalGeneration":
        "LLaVA-NeXT-Video (video input, pooled frame features) is not supported yet; image-only "
        "LLaVA-NeXT (LlavaNextForConditionalGeneration) checkpoints are",
}
# architecture names of remote-code checkpoints that transformers' own class reads
_ARCH_ALIASES = {"MPTForCausalLM": "MptForCausalLM"}  # MosaicML's MPT files
SUPPORTED_ARCHITECTURES = (LLAMA_FAMILY | DEEPSEEK_FAMILY | LLAMA_MOE_FAMILY | GEMMA_FAMILY
                           | LLAMA_VARIANTS | GPT2_FAMILY | ALIBI_FAMILY | GPT_OSS_FAMILY
                           | GLM_FAMILY | LLAMA4_FAMILY)

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo": "OlmoForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "phi": "PhiForCausalLM",
    "gptj": "GPTJForCausalLM",
    "falcon": "FalconForCausalLM",
    "opt": "OPTForCausalLM",
    "bloom": "BloomForCausalLM",
    "mpt": "MptForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "arcee": "ArceeForCausalLM",
    "ministral": "MinistralForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "apertus": "ApertusForCausalLM",
    "internlm2": "InternLM2ForCausalLM",
    "internlm3": "InternLM3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    # multimodal wrappers (their text model alone: MULTIMODAL_TEXT_ARCHITECTURES)
    "gemma3": "Gemma3ForConditionalGeneration",
    "llama4": "Llama4ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "llava_next_video": "LlavaNextVideoForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration",
    "glm4v_moe": "Glm4vMoeForConditionalGeneration",
    "internvl": "InternVLForConditionalGeneration",
    "internvl_chat": "InternVLChatModel",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
}

DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2,
               "fp8": 1, "float8": 1, "fp8_e4m3": 1, "float8_e4m3fn": 1}
# EngineConfig.kv_cache_dtype: "auto" caches K/V in the model's dtype
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# EngineConfig.quantization (None: none): how weights are kept (layers/quant.py). "int4"
# and "rtn" (vLLM's name: RTN_NUM_BITS=4, RTN_GROUP_SIZE) quantize 16-bit weights to int4
# groups at load, round to nearest
QUANTIZATION_METHODS = ("fp8", "int4", "rtn")
ONLINE_INT4_METHODS = ("int4", "rtn")


# quantization_config.quant_method of the checkpoints we read (models/fp8_checkpoint.py):
# their linears are stored as float8_e4m3fn with their own scales
FP8_CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8")
# ... and those whose linears are 4-bit integers in groups (models/int4_checkpoint.py)
INT4_CHECKPOINT_METHODS = ("awq", "gptq")


def online_int4_group_size(method: str) -> int | None:
    """The group size ``method`` ("int4" / "rtn") quantizes to int4 with: RTN_GROUP_SIZE
    (default 128; -1: one group a row, None). "rtn" is vLLM's online round-to-nearest, whose
    RTN_NUM_BITS defaults to 8: only 4 is read here, anything else a ValueError."""
    if method == "rtn":
        bits = os.environ.get("RTN_NUM_BITS")
        if bits is None or bits.strip() != "4":
            shown = "RTN_NUM_BITS='8' (vLLM's default when unset)" if bits is None else f"RTN_NUM_BITS={bits!r}"
            raise ValueError(f"quantization='rtn' keeps 4-bit weights only, got {shown}: set "
                             "RTN_NUM_BITS=4, or use quantization='fp8' for 8-bit weights")
    raw = os.environ.get("RTN_GROUP_SIZE", "128")
    try:
        group = int(raw)
    except ValueError:
        group = 0
    if group == -1:
        return None
    if group < 8 or group % 8:
        raise ValueError(f"RTN_GROUP_SIZE must be a positive multiple of 8 or -1 (one group a "
                         f"row), got {raw!r}")
    return group


def int4_group_for(k: int, group: int | None) -> int | None:
    """The group size a K-wide linear gets under the online int4 methods: ``group`` where
    it divides K, else the largest power of two under it that does (SmolLM2's K = 576:
    64), else one group a row (None)."""
    if group is None or k % group == 0:
        return group
    g = 1 << (group.bit_length() - 1)
    while g >= 8 and k % g:
        g //= 2
    return g if g >= 8 else None


def check_quantization(method: str | None) -> None:
    """ValueError naming the allowed values unless ``method`` is None or one of them (and,
    for the online int4 methods, their environment's settings are readable)."""
    if method in ONLINE_INT4_METHODS:
        online_int4_group_size(method)
        return
    if method is not None and method not in QUANTIZATION_METHODS:
        allowed = ", ".join(repr(m) for m in QUANTIZATION_METHODS)
        hint = ""
        if method in FP8_CHECKPOINT_METHODS + INT4_CHECKPOINT_METHODS:
            hint = (f" ({method} checkpoints are read as they are, from their config's "
                    "quantization_config: no flag needed)")
        raise ValueError(f"quantization must be None or one of {allowed}, got {method!r}{hint}")


class ConfigError(ValueError):
    """A model config that cannot be used, with a message a user can act on."""


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling as HF writes it; ``rope_type`` is one of default, linear, llama3, yarn,
    longrope."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn (DeepSeek, GPT-OSS)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # yarn: round the correction range out to whole dims (transformers' default; GPT-OSS's
    # checkpoints say false)
    truncate: bool = True
    # longrope (Phi-3): one factor per rotated pair for sequences within
    # original_max_position_embeddings (short) and beyond it (long), and the factor cos and
    # sin are multiplied by (_longrope resolves it as transformers does when it is absent)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> RopeScaling | None:
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
            raise ConfigError(
                f"rope_scaling type {rope_type!r} is not supported "
                "(supported: default, linear, llama3, yarn, longrope)"
            )
        known = {f.name for f in fields(RopeScaling)}
        kwargs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                  for k, v in d.items() if k in known and v is not None}
        kwargs["rope_type"] = rope_type
        return RopeScaling(**kwargs)


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint whose linears are stored quantized, from HF's ``quantization_config``:
    float8_e4m3fn with their own scales (quant_method fp8 (HF / vLLM, DeepSeek-V3),
    compressed-tensors (llm-compressor, 8-bit float weights) or fbgemm_fp8; read by
    ``models/fp8_checkpoint.py``), or 4-bit integers in groups along K with a scale and a
    zero point each (quant_method awq (AutoAWQ's GEMM packing) or gptq (desc_act false);
    ``weight_strategy`` "group", ``bits`` 4, ``group_size`` None for one group per row; read
    by ``models/int4_checkpoint.py``). Anything else (bitsandbytes, int8, marlin ...) is a
    ConfigError.

    ``weight_strategy``: "tensor" (one scale per weight tensor), "channel" (one per output
    row) or "block" (one per ``block_size`` tile, rows x cols). ``activation_scheme``:
    "dynamic", or "static" (calibrated ``input_scale`` tensors, which we do not use:
    activations are quantized per token at run time). ``ignored``: the modules the config
    says are left unquantized, as written (names, or "re:" patterns)."""

    method: str
    weight_strategy: str
    block_size: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"
    ignored: tuple[str, ...] = ()
    bits: int = 8
    group_size: int | None = None  # int4: values per scale along K (None: the whole row)

    @property
    def is_int4(self) -> bool:
        return self.bits == 4

    def ignores(self, module: str) -> bool:
        """Whether ``module`` (a HF module path) is in the ignore list: the same name, a
        module above it, or a "re:" pattern matching it from its start."""
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.startswith(entry + "."):
                return True
        return False

    def block_unsupported(self, pieces: list[tuple[str, int]]) -> str | None:
        """Why a linear whose weight stacks ``pieces`` (HF module, rows) along N cannot keep
        this block-scaled checkpoint's e4m3 values and tile scales (None: it can; it is then
        dequantized at load, models/fp8_checkpoint.py): the block kernels' K tiles
        (kernels/fp8_block_ref.tile_k) need bk a multiple of 16, and a merged linear's
        scales stack along their N-block axis only where each piece's rows are a multiple
        of bn (else one tile would span two pieces under two scales)."""
        assert self.block_size is not None
        bn, bk = self.block_size
        if bk % 16:
            return f"no kernel for K blocks of {bk} (a multiple of 16 needed)"
        if len(pieces) > 1:
            for name, rows in pieces:
                if rows % bn:
                    return (f"{name} has {rows} rows, not a multiple of the {bn}-row blocks "
                            "its merged linear stacks")
        return None

    def describe(self) -> str:
        """One line: how the checkpoint's weights are stored and what loading makes of them."""
        if self.is_int4:
            group = f"groups of {self.group_size}" if self.group_size else "one group per row"
            text = f"int4 ({self.method}, {group}, fp16 scales and zero points)"
            return text + (f", {len(self.ignored)} module(s) left 16-bit" if self.ignored else "")
        scales = {"tensor": "per-tensor scales", "channel": "per-channel scales"}.get(
            self.weight_strategy, f"{self.block_size[0]}x{self.block_size[1]} block scales"
            if self.block_size else "block scales")
        text = f"fp8 e4m3 ({self.method}, {scales}, {self.activation_scheme} activations)"
        if self.ignored:
            text += f", {len(self.ignored)} module(s) left 16-bit"
        return text

    @staticmethod
    def from_dict(d: Any, where: str) -> CheckpointQuantization:
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: quantization_config must be a JSON object, got {d!r}")
        method = d.get("quant_method")
        if method is None:
            raise ConfigError(f"{where}: quantization_config has no quant_method")
        if method in INT4_CHECKPOINT_METHODS:
            return CheckpointQuantization._int4(d, method, where)
        if method not in FP8_CHECKPOINT_METHODS:
            raise ConfigError(
                f"{where}: quantization_config.quant_method {method!r} is not supported "
                f"(checkpoints read: fp8 weights, quant_method {', '.join(FP8_CHECKPOINT_METHODS)}; "
                f"4-bit {' and '.join(INT4_CHECKPOINT_METHODS)}; "
                "or load a 16-bit checkpoint, with quantization='fp8' for fp8 weights)")
        if method == "compressed-tensors":
            return CheckpointQuantization._compressed_tensors(d, where)
        ignored = _string_list(d, "modules_to_not_convert", where) + _string_list(
            d, "ignored_layers", where)
        if method == "fbgemm_fp8":
            # weight_scale [N, 1]; activation_scale_ub only clamps the dynamic activation scales
            return CheckpointQuantization(method, "channel", None, "dynamic", ignored)
        # "fp8": weight_block_size [bn, bk] with weight_scale_inv tiles, else per-tensor scales
        field_ = f"{where}: quantization_config"
        scheme = str(d.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"{field_}.activation_scheme must be 'dynamic' or 'static', "
                              f"got {d.get('activation_scheme')!r}")
        for key, ok in (("fmt", ("e4m3", None)), ("scale_fmt", ("float", "ue8m0", None)),
                        ("expert_dtype", ("fp8", None))):
            if d.get(key) not in ok:
                raise ConfigError(f"{field_}.{key} {d.get(key)!r} is not supported "
                                  f"(supported: {', '.join(repr(v) for v in ok if v)})")
        block = _block_size(d.get("weight_block_size"), f"{field_}.weight_block_size")
        return CheckpointQuantization(method, "block" if block else "tensor", block, scheme,
                                      ignored)

    @staticmethod
    def _int4(d: dict[str, Any], method: str, where: str) -> CheckpointQuantization:
        """AWQ (HF's AwqConfig or AutoAWQ's quant_config: bits / w_bit, group_size /
        q_group_size, zero_point, version) and GPTQ (bits, group_size, desc_act, sym,
        checkpoint_format); the values a layout other than the two we read would need are
        named as ConfigErrors."""
        f = f"{where}: quantization_config"
        bits_key = "w_bit" if "w_bit" in d and "bits" not in d else "bits"
        if d.get(bits_key) != 4:
            raise ConfigError(f"{f}.{bits_key} {d.get(bits_key)!r} is not supported "
                              f"({method} checkpoints are read at 4 bits)")
        g_key = "q_group_size" if "q_group_size" in d and "group_size" not in d else "group_size"
        g = d.get(g_key, -1 if method == "gptq" else None)
        if not isinstance(g, int) or isinstance(g, bool) or not (g == -1 or (g > 0 and g % 8 == 0)):
            raise ConfigError(f"{f}.{g_key} must be -1 (one group per row) or a positive "
                              f"multiple of 8, got {g!r}")
        if method == "awq":
            version = str(d.get("version", "gemm")).lower()
            if version != "gemm":
                raise ConfigError(f"{f}.version {d.get('version')!r} is not supported (AWQ's "
                                  "'gemm' packing is read; gemv / exllama / marlin ones are not)")
            if d.get("zero_point", True) is not True:
                raise ConfigError(f"{f}.zero_point {d.get('zero_point')!r} is not supported "
                                  "(AWQ checkpoints with zero points are read)")
        else:
            for key, ok in (("desc_act", (False, None)), ("is_marlin_format", (False, None)),
                            ("checkpoint_format", ("gptq", None)), ("sym", (True, False, None))):
                if d.get(key) not in ok:
                    why = {"desc_act": "act-order groups (g_idx) are not read",
                           "is_marlin_format": "marlin-packed weights are not read",
                           "checkpoint_format": "the 'gptq' packing is read",
                           "sym": "true or false"}[key]
                    raise ConfigError(f"{f}.{key} {d.get(key)!r} is not supported ({why})")
        ignored = _string_list(d, "modules_to_not_convert", where)
        return CheckpointQuantization(method, "group", None, "dynamic", ignored, 4,
                                      None if g == -1 else g)

    @staticmethod
    def _compressed_tensors(d: dict[str, Any], where: str) -> CheckpointQuantization:
        """llm-compressor's format: config_groups of weights (8-bit float, symmetric,
        strategy tensor / channel / block) and input_activations (dynamic or static)."""
        field_ = f"{where}: quantization_config"
        fmt = d.get("format")
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise ConfigError(f"{field_}.format {fmt!r} is not supported (fp8 checkpoints are "
                              "'float-quantized'; packed int4 / int8 / sparse ones are not read)")
        sparsity = d.get("sparsity_config")
        if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
            raise ConfigError(f"{field_}.sparsity_config (format {sparsity.get('format')!r}) "
                              "is not supported")
        groups = d.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ConfigError(f"{field_}.config_groups must be a non-empty object")
        found: set[tuple[str, tuple[int, int] | None, str]] = set()
        for name, g in groups.items():
            gf = f"{field_}.config_groups.{name}"
            w = g.get("weights") if isinstance(g, dict) else None
            if not isinstance(w, dict):
                raise ConfigError(f"{gf}.weights is missing")
            bits, kind = w.get("num_bits"), w.get("type", "int")
            if bits != 8 or kind != "float":
                raise ConfigError(f"{gf}.weights: {bits}-bit {kind} weights are not supported "
                                  "(only 8-bit float, fp8 e4m3)")
            if w.get("symmetric") is False:
                raise ConfigError(f"{gf}.weights.symmetric: asymmetric fp8 weights are not supported")
            if w.get("dynamic"):
                raise ConfigError(f"{gf}.weights.dynamic: dynamic weight scales are not supported")
            strategy = w.get("strategy", "tensor")
            if strategy not in ("tensor", "channel", "block"):
                raise ConfigError(f"{gf}.weights.strategy {strategy!r} is not supported "
                                  "(supported: 'tensor', 'channel', 'block')")
            block = (_block_size(w.get("block_structure"), f"{gf}.weights.block_structure",
                                 required=True) if strategy == "block" else None)
            a = g.get("input_activations")
            scheme = "dynamic"
            if isinstance(a, dict):
                if a.get("num_bits", 8) != 8 or a.get("type", "float") != "float":
                    raise ConfigError(f"{gf}.input_activations: {a.get('num_bits')}-bit "
                                      f"{a.get('type')} activations are not supported")
                scheme = "dynamic" if a.get("dynamic", True) else "static"
            found.add((strategy, block, scheme))
        if len({(s, b) for s, b, _ in found}) > 1:
            raise ConfigError(f"{field_}.config_groups: groups with different weight strategies "
                              f"({sorted(str(s) for s, _, _ in found)}) are not supported")
        strategy, block, _ = next(iter(found))
        scheme = "static" if any(s == "static" for _, _, s in found) else "dynamic"
        return CheckpointQuantization("compressed-tensors", strategy, block, scheme,
                                      _string_list(d, "ignore", where))


def _checkpoint_quantization(d: dict[str, Any], arch: str,
                              where: str) -> CheckpointQuantization | None:
    if d.get("quantization_config") is None or arch in GPT_OSS_FAMILY:
        return None  # GPT-OSS's (MXFP4 experts, or a ConfigError): _gpt_oss_fields
    qc = CheckpointQuantization.from_dict(d["quantization_config"], where)
    if qc.is_int4 and arch not in INT4_CHECKPOINT_FAMILY:
        raise ConfigError(f"{where}: {qc.method} (int4) checkpoints are read for the dense Llama, "
                          "Gemma and Llama-variant families and Mixtral / Qwen2-MoE / Qwen3-MoE, "
                          f"not {arch} (DeepSeek's MLA and experts, OLMoE's and Granite MoE's "
                          "experts and GPT-2's Conv1D weights have no int4 reader)")
    return qc


def _positive_int(d: dict[str, Any], key: str, where: str, default: Any = None,
                  why: str = "") -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{where}: {key} must be a positive integer{why}, got {v!r}")
    return v


def _llama_moe_fields(d: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """The MoE fields of Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / Granite MoE under
    ModelConfig's names (DeepSeek's: ``n_routed_experts``, ``moe_intermediate_size``), validated.

    Mixtral: ``num_local_experts`` experts of ``intermediate_size`` in every layer, the top-k
    weights always renormalized. Qwen: ``num_experts`` (transformers 5 writes Qwen3-MoE's as
    ``num_local_experts``) of ``moe_intermediate_size``; layer i is MoE unless it is in
    ``mlp_only_layers`` or (i + 1) % ``decoder_sparse_step`` != 0, else a dense MLP of
    ``intermediate_size``; renormalized if ``norm_topk_prob``. Qwen2-MoE adds a shared expert
    of ``shared_expert_intermediate_size`` behind a sigmoid gate. OLMoE (_olmoe_fields) and
    Granite MoE (_granite_moe_fields): experts of ``intermediate_size`` in every layer, as
    Mixtral's."""
    layers = d["num_hidden_layers"]
    mixtral = arch == "MixtralForCausalLM"
    experts_key = "num_local_experts" if mixtral or "num_experts" not in d else "num_experts"
    experts = _positive_int(d, experts_key, where)
    top_k = _positive_int(d, "num_experts_per_tok", where)
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok ({top_k}) must be at most "
                          f"{experts_key} ({experts}): each token picks that many distinct experts")
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported for "
                          f"{arch} (supported: 'silu')")
    out: dict[str, Any] = dict(n_routed_experts=experts, num_experts_per_tok=top_k)
    if arch in _EVERY_LAYER_MOE:
        out["moe_intermediate_size"] = _positive_int(d, "intermediate_size", where)
        if arch == "OlmoeForCausalLM":
            return out | _olmoe_fields(d, where)
        if arch != "MixtralForCausalLM":
            return out | _granite_moe_fields(d, arch, where)
        return out | dict(norm_topk_prob=True)
    step = _positive_int(d, "decoder_sparse_step", where, default=1)
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in only):
        raise ConfigError(f"{where}: mlp_only_layers must be a list of layer indices in "
                          f"[0, {layers}), got {only!r}")
    dense = [i for i in range(layers) if i in only or (i + 1) % step]
    if dense:
        _positive_int(d, "intermediate_size", where,
                      why=f" (dense MLP in layer(s) {', '.join(map(str, dense[:4]))})")
    out |= dict(moe_intermediate_size=_positive_int(d, "moe_intermediate_size", where),
                decoder_sparse_step=step, mlp_only_layers=tuple(sorted(set(only))),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)))
    if arch == "Qwen2MoeForCausalLM":
        if d.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window is not supported for Qwen2-MoE (its "
                              "window is per layer, up to max_window_layers)")
        out["shared_expert_intermediate_size"] = _positive_int(
            d, "shared_expert_intermediate_size", where)
    return out


def _olmoe_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """OLMoE (OlmoeConfig's defaults where a field is absent): ``norm_topk_prob`` (false:
    the top-k softmax weights as they are), ``clip_qkv`` (q, k, v clamped to +-clip after
    the q/k norms; null: none), RMSNorms of ``rms_norm_eps`` 1e-5. Its q_norm spans
    hidden_size and its k_norm (hidden_size / heads) * kv_heads: a head_dim other than
    hidden_size / heads would not fit them (transformers' model would not build)."""
    heads = d["num_attention_heads"]
    if d["hidden_size"] % heads or d.get("head_dim") not in (None, d["hidden_size"] // heads):
        raise ConfigError(f"{where}: head_dim {d.get('head_dim')!r} with hidden_size "
                          f"{d['hidden_size']} over {heads} heads is not supported for "
                          "OlmoeForCausalLM (its q_norm spans hidden_size = heads * head_dim)")
    if d.get("sliding_window") is not None:
        raise ConfigError(f"{where}: sliding_window is not supported for OlmoeForCausalLM "
                          "(transformers' OLMoE masks no window; only its flash-attention "
                          "path would read one)")
    return dict(norm_topk_prob=_flag(d, "norm_topk_prob", False, where),
                clip_qkv=_positive(d, "clip_qkv", None, where),
                rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5))


def _granite_moe_fields(d: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """Granite MoE (GraniteMoeConfig's defaults where a field is absent): Granite's
    multipliers, routing as a softmax over the k best logits (the top-k softmax weights
    renormalized: ``norm_topk_prob``), and GraniteMoeShared's ``shared_intermediate_size``
    (0: no shared MLP), held as shared_expert_intermediate_size. transformers' attention
    reads no sliding_window here, and neither do we."""
    out = _granite_multipliers(d, where) | dict(norm_topk_prob=True, sliding_window=None)
    if arch == "GraniteMoeSharedForCausalLM":
        shared = d.get("shared_intermediate_size", 0)
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ConfigError(f"{where}: shared_intermediate_size must be an integer >= 0 "
                              f"(0: no shared MLP), got {shared!r}")
        out["shared_expert_intermediate_size"] = shared
    return out


def _granite_multipliers(d: dict[str, Any], where: str) -> dict[str, float]:
    """Granite's four scalars; absent: GraniteConfig's defaults, 1.0 each (the attention
    scale too)."""
    return {k: _positive_number(d, k, where, 1.0) for k in (
        "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")}


def _positive_number(d: dict[str, Any], key: str, where: str, default: float) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{where}: {key} must be a positive number, got {v!r}")
    return float(v)


def _variant_fields(d: dict[str, Any], arch: str, where: str, head_dim: int,
                    rope: dict[str, Any] | None) -> dict[str, Any]:
    """Phi-3's partial rotary and longrope, Granite's multipliers, Cohere's, Cohere2's and
    Starcoder2's LayerNorm fields, OLMo's clip_qkv (ModelConfig's names), validated; OLMo2
    needs none (its q/k norms are models/olmo2.py's own)."""
    if arch == "Starcoder2ForCausalLM":
        return _starcoder2_fields(d, where)
    if arch == "GPTNeoXForCausalLM":
        return _gpt_neox_fields(d, where)
    if arch == "PhiForCausalLM":
        return _phi_fields(d, where)
    if arch == "GPTJForCausalLM":
        return _gptj_fields(d, where)
    if arch == "FalconForCausalLM":
        return _falcon_fields(d, where)
    if arch == "OPTForCausalLM":
        return _opt_fields(d, where)
    if arch in _FAMILIES4:
        return _families4_fields(d, arch, where)
    if arch in ("InternLM2ForCausalLM", "InternLM3ForCausalLM"):
        return _internlm_fields(d, arch, where, rope)
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported for "
                          f"{arch} (supported: 'silu')")
    out: dict[str, Any] = {}
    if arch in ("CohereForCausalLM", "Cohere2ForCausalLM"):
        return _cohere_fields(d, arch, where, head_dim)
    if arch == "OlmoForCausalLM":
        # OlmoLayerNorm: no weight, no bias, transformers' fixed epsilon (held as rms_norm_eps)
        return dict(rms_norm_eps=1e-5, clip_qkv=_positive(d, "clip_qkv", None, where))
    if arch == "GraniteForCausalLM":
        if d.get("mlp_bias"):
            raise ConfigError(f"{where}: mlp_bias true is not supported for {arch} (the "
                              "gate/up/down projections have no bias here)")
        out.update(_granite_multipliers(d, where))
    if arch == "Phi3ForCausalLM":
        f = _partial_rotary(d, where, head_dim, "partial_rotary_factor", 1.0)
        out["partial_rotary_factor"] = f
        if rope and rope.get("rope_type", rope.get("type")) == "longrope":
            out["rope_scaling"] = _longrope(d, rope, where, int(head_dim * f))
    return out


def _internlm_fields(d: dict[str, Any], arch: str, where: str,
                     rope: dict[str, Any] | None) -> dict[str, Any]:
    """InternLM2 / 2.5 and InternLM3 (their remote code's configs; defaults where absent):
    Llama's fields, a SiLU gated MLP, and

    - InternLM2: ``bias`` (InternLM2Config's default true) on the fused wqkv and on wo, none
      on the MLP;
    - InternLM3: ``qkv_bias`` (default false) on q/k/v, ``bias`` (default false) on o_proj
      and the MLP (true there: a ConfigError, the gated MLP has no bias here);
    - rope_scaling "linear" as Llama's; "dynamic" (NTK by sequence length: the plain rope
      up to max_position_embeddings, a larger base past it) read as the plain rope, which
      is the same within max_position_embeddings (the engine's default max_model_len)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported for "
                          f"{arch} (supported: 'silu')")
    out: dict[str, Any]
    if arch == "InternLM2ForCausalLM":
        out = dict(attention_bias=_flag(d, "bias", True, where), mlp_bias=False)
    else:
        if _flag(d, "bias", False, where):
            raise ConfigError(f"{where}: bias true is not supported for {arch} (it biases the "
                              "gate/up/down projections, which have no bias here)")
        out = dict(attention_bias=_flag(d, "qkv_bias", False, where), attention_out_bias=False,
                   mlp_bias=False)
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind == "dynamic":
        factor = rope.get("factor") if isinstance(rope, dict) else None
        if not isinstance(factor, int | float) or isinstance(factor, bool) or factor < 1:
            raise ConfigError(f"{where}: rope_scaling 'dynamic' needs a factor >= 1, got {factor!r}")
        out["rope_scaling"] = None
    elif kind not in ("default", "linear"):
        raise ConfigError(f"{where}: rope_scaling type {kind!r} is not supported for {arch} "
                          "(its remote code reads 'linear' and 'dynamic')")
    return out


def _flag(d: dict[str, Any], key: str, default: bool, where: str) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{where}: {key} must be true or false, got {v!r}")
    return v


def _cohere_fields(d: dict[str, Any], arch: str, where: str, head_dim: int) -> dict[str, Any]:
    """Command-R / Aya (CohereConfig's defaults where a field is absent): LayerNorms without
    bias of ``layer_norm_eps`` (held as rms_norm_eps: the norms' epsilon), logits x
    ``logit_scale``, rotary on interleaved pairs, the head tied to the embeddings, and
    Command-R+'s per-head q/k LayerNorms (``use_qk_norm``).

    Command R7B / Command A (Cohere2Config's defaults): the same, without q/k norms, and
    layers of two kinds (``layer_types``, else every ``sliding_window_pattern``-th (4)
    layer full attention): sliding ones attend within ``sliding_window`` with rotary,
    full-attention ones to the whole context with no positional embedding at all (NoPE).
    head_dim is hidden_size / num_attention_heads, whatever config.json says (as
    transformers' Cohere2Config sets it): another value is a ConfigError."""
    scale = d.get("logit_scale", 0.0625)
    if (not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale)
            or scale == 0):
        raise ConfigError(f"{where}: logit_scale must be a finite non-zero number, got {scale!r}")
    out = dict(rms_norm_eps=_positive_number(d, "layer_norm_eps", where, 1e-5),
               logit_scale=float(scale), rope_interleaved=True,
               qk_norm=_flag(d, "use_qk_norm", False, where),
               tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where))
    if arch == "CohereForCausalLM":
        return out
    if out["qk_norm"]:
        raise ConfigError(f"{where}: use_qk_norm true is not supported for {arch} (transformers' "
                          "Cohere2 has no q/k norms)")
    if head_dim != d["hidden_size"] // d["num_attention_heads"]:
        raise ConfigError(f"{where}: head_dim {head_dim} is not supported for {arch}: transformers "
                          f"uses hidden_size / num_attention_heads = "
                          f"{d['hidden_size'] // d['num_attention_heads']}")
    window = d.get("sliding_window", 4096)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        # transformers' Cohere2 would neither window nor rotate any layer without one
        raise ConfigError(f"{where}: sliding_window must be a positive integer for {arch}, "
                          f"got {window!r}")
    types = _layer_types(d, where, d.get("sliding_window_pattern", 4))
    return out | dict(sliding_window=window, layer_types=types,
                      nope_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"))


def _starcoder2_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """StarCoder2 (Starcoder2Config's defaults where a field is absent): LayerNorms with bias
    of ``norm_epsilon`` (held as rms_norm_eps), ``use_bias`` on q/k/v/o and on the MLP's
    c_fc / c_proj, a GELU (``hidden_act``) between them, the head tied to the embeddings.
    The sliding window is read as every family's (``sliding_window``)."""
    act = _plain_act(d, "Starcoder2ForCausalLM", where, "gelu_pytorch_tanh")
    bias = _flag(d, "use_bias", True, where)
    return dict(rms_norm_eps=_positive_number(d, "norm_epsilon", where, 1e-5), hidden_act=act,
                attention_bias=bias, mlp_bias=bias,
                tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where))


# GPT2Config's, GPTBigCodeConfig's and GPTJConfig's names (their attribute_map) -> ModelConfig's
_GPT2_NAMES = (("n_embd", "hidden_size"), ("n_layer", "num_hidden_layers"),
               ("n_head", "num_attention_heads"))


_GPT2_MODEL_TYPES = {"GPT2LMHeadModel": "gpt2", "GPTBigCodeForCausalLM": "gpt_bigcode",
                     "GPTJForCausalLM": "gptj"}


def _gpt2_names(d: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """GPT-2's (GPT-BigCode's, GPT-J's) config.json with the common names added (a new dict): hidden_size from
    ``n_embd``, num_hidden_layers from ``n_layer``, num_attention_heads from ``n_head``,
    max_position_embeddings from ``n_positions`` (GPT2Config's 1024 when absent) and
    intermediate_size from ``n_inner`` (null: 4 * n_embd), and model_type from ``arch``
    where the file has none; a bad field is named as the file writes it (a common name the
    file uses instead is read too)."""
    out = dict(d)
    out["model_type"] = d.get("model_type") or _GPT2_MODEL_TYPES[arch]
    for theirs, ours in (*_GPT2_NAMES, ("n_positions", "max_position_embeddings")):
        key = theirs if theirs in d or ours not in d else ours
        out[ours] = _positive_int(d, key, where, 1024 if theirs == "n_positions" else None)
    hidden, heads = out["hidden_size"], out["num_attention_heads"]
    if hidden % heads:
        raise ConfigError(f"{where}: n_embd ({hidden}) is not a multiple of n_head ({heads})")
    inner = d.get("n_inner")
    out["intermediate_size"] = 4 * hidden if inner is None else _positive_int(
        d, "n_inner", where, why=" or null (4 * n_embd)")
    out.pop("head_dim", None)  # n_embd / n_head, whatever else the file says
    return out


def _gpt2_fields(d: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """GPT-2 and GPT-BigCode (their configs' defaults where a field is absent): learned
    positions, LayerNorms with bias of ``layer_norm_epsilon``, biases on every linear, the
    MLP's ``activation_function`` (GPT-2: gelu_new, BigCode: gelu_pytorch_tanh), the head
    tied to wte; GPT-2's attention scales (``scale_attn_weights`` false: q.k unscaled;
    ``scale_attn_by_inverse_layer_idx``: / (layer + 1)); BigCode's ``multi_query`` (one
    KV head). ``d``: _gpt2_names' dict."""
    gpt2 = arch == "GPT2LMHeadModel"
    act = _plain_act(d, arch, where, "gelu_new" if gpt2 else "gelu_pytorch_tanh",
                     "activation_function")
    unsupported = {"add_cross_attention": "cross-attention layers (an encoder-decoder's) are not "
                                          "built here"}
    if gpt2:
        # transformers applies it on its eager path only (q.k of fp32-upcast q and k)
        unsupported["reorder_and_upcast_attn"] = (
            "its upcast q.k is not reproduced (hf_overrides={'reorder_and_upcast_attn': "
            "False} runs the model as transformers' sdpa path does)")
    for key, why in unsupported.items():
        if _flag(d, key, False, where):
            raise ConfigError(f"{where}: {key} true is not supported for {arch}: {why}")
    if d.get("quantization_config") is not None:
        raise ConfigError(f"{where}: quantization_config (a pre-quantized checkpoint) is not read "
                          f"for {arch}; load a 16/32-bit one (quantization='fp8' or 'int4' "
                          "quantizes it at load)")
    mqa = not gpt2 and _flag(d, "multi_query", True, where)
    return dict(rms_norm_eps=_positive_number(d, "layer_norm_epsilon", where, 1e-5),
                hidden_act=act, attention_bias=True, mlp_bias=True, learned_positions=True,
                num_key_value_heads=1 if mqa else d["num_attention_heads"],
                tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where),
                scale_attn_weights=_flag(d, "scale_attn_weights", True, where),
                scale_attn_by_inverse_layer_idx=gpt2 and _flag(
                    d, "scale_attn_by_inverse_layer_idx", False, where))


def _plain_act(d: dict[str, Any], arch: str, where: str, default: str,
               key: str = "hidden_act") -> str:
    """A non-gated MLP's activation, ``d[key]`` (``default`` where absent or null; GPT-2's
    key is activation_function, Falcon's activation), one of PLAIN_ACTIVATIONS."""
    from flashpage.layers.activation import PLAIN_ACTIVATIONS

    act = d.get(key) or default
    if act not in PLAIN_ACTIVATIONS:
        raise ConfigError(f"{where}: {key} {act!r} is not supported for {arch} "
                          f"(supported: {', '.join(PLAIN_ACTIVATIONS)})")
    return str(act)


def _whole_heads(d: dict[str, Any], where: str) -> int:
    """head_dim of a family that has none but hidden_size / num_attention_heads."""
    h, heads = d["hidden_size"], d["num_attention_heads"]
    if d.get("head_dim") not in (None, h // heads) or h % heads:
        raise ConfigError(f"{where}: hidden_size ({h}) must be num_attention_heads ({heads}) "
                          f"x head_dim{'' if d.get('head_dim') is None else ' ' + repr(d['head_dim'])}"
                          " (this family's heads split the hidden state)")
    return int(h // heads)


def _partial_rotary(d: dict[str, Any], where: str, head_dim: int, legacy: str,
                    default: float) -> float:
    """The fraction of each head that rotary rotates: ``partial_rotary_factor`` (at the top
    or, as transformers 5 writes it, in rope_parameters), else the older ``legacy`` key
    (GPT-NeoX's rotary_pct), else ``default``; it must give an even width >= 2."""
    params = d.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    key = ("partial_rotary_factor" if "partial_rotary_factor" in d or
           "partial_rotary_factor" in params or legacy not in d else legacy)
    f = d.get(key, params.get(key, default))
    if (not isinstance(f, int | float) or isinstance(f, bool) or not 0 < f <= 1
            or int(head_dim * f) < 2 or int(head_dim * f) % 2):
        raise ConfigError(f"{where}: {key} must be in (0, 1] and give an even rotary width of "
                          f"at least 2 of head_dim {head_dim}, got {f!r}")
    return float(f)


def _gpt_neox_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """GPT-NeoX / Pythia (GPTNeoXConfig's defaults where a field is absent): LayerNorms with
    bias of ``layer_norm_eps``, ``attention_bias`` on query_key_value and dense, a biased
    dense_h_to_4h -> ``hidden_act`` -> dense_4h_to_h MLP, ``use_parallel_residual``, rotary
    on the first ``rotary_pct`` of each head (neox halves) with base ``rotary_emb_base``,
    an untied ``embed_out`` unless ``tie_word_embeddings``."""
    arch = "GPTNeoXForCausalLM"
    head_dim = _whole_heads(d, where)
    if d.get("num_key_value_heads") not in (None, d["num_attention_heads"]):
        raise ConfigError(f"{where}: num_key_value_heads {d['num_key_value_heads']!r} is not "
                          f"read for {arch} (its heads are all query, key and value heads)")
    params = d.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    theta = params.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", 10000.0)))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{where}: rotary_emb_base (the rope theta) must be a positive "
                          f"number, got {theta!r}")
    return dict(rms_norm_eps=_positive_number(d, "layer_norm_eps", where, 1e-5),
                hidden_act=_plain_act(d, arch, where, "gelu"),
                attention_bias=_flag(d, "attention_bias", True, where), mlp_bias=True,
                use_parallel_residual=_flag(d, "use_parallel_residual", True, where),
                partial_rotary_factor=_partial_rotary(d, where, head_dim, "rotary_pct", 0.25),
                rope_theta=float(theta), head_dim=head_dim,
                tie_word_embeddings=_flag(d, "tie_word_embeddings", False, where))


def _phi_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """Phi-1 / 1.5 / 2 (PhiConfig's defaults where a field is absent): one LayerNorm with
    bias (``layer_norm_eps``) feeding attention and the MLP in parallel, biased q/k/v/dense,
    fc1 -> ``hidden_act`` (gelu_new) -> fc2 with biases, rotary on the first
    ``partial_rotary_factor`` (0.5) of each head, ``qk_layernorm`` (a LayerNorm with bias
    over each head of q and k), an LM head with a bias."""
    arch = "PhiForCausalLM"
    head_dim = _whole_heads(d, where)
    return dict(rms_norm_eps=_positive_number(d, "layer_norm_eps", where, 1e-5),
                hidden_act=_plain_act(d, arch, where, "gelu_new"),
                attention_bias=True, mlp_bias=True, lm_head_bias=True,
                qk_norm=_flag(d, "qk_layernorm", False, where),
                partial_rotary_factor=_partial_rotary(d, where, head_dim, "partial_rotary_factor",
                                                      0.5),
                tie_word_embeddings=_flag(d, "tie_word_embeddings", False, where))


def _gptj_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """GPT-J (GPTJConfig's defaults where a field is absent; ``d``: _gpt2_names' dict): one
    LayerNorm with bias (``layer_norm_epsilon``) feeding attention and the MLP in parallel,
    q/k/v/out_proj without bias, rotary on the first ``rotary_dim`` (64) dims of each head on
    interleaved pairs (rotate_every_two) with base 10000, fc_in -> ``activation_function``
    (gelu_new) -> fc_out with biases, an LM head with a bias, untied unless
    ``tie_word_embeddings``."""
    arch = "GPTJForCausalLM"
    head_dim = d["hidden_size"] // d["num_attention_heads"]
    rot = d.get("rotary_dim", 64)
    if (not isinstance(rot, int) or isinstance(rot, bool) or rot < 2 or rot % 2
            or rot > head_dim):
        # null: transformers rotates n_embd dims of each head_dim-wide head (a shape error)
        raise ConfigError(f"{where}: rotary_dim must be an even integer from 2 to head_dim "
                          f"({head_dim}) for {arch}, got {rot!r}")
    for key in ("rope_scaling", "rope_parameters", "rope_theta"):
        if d.get(key) is not None:
            raise ConfigError(f"{where}: {key} is not read for {arch}: its rotary has base "
                              "10000 and no scaling, as transformers' GPT-J")
    act = _plain_act(d, arch, where, "gelu_new", "activation_function")
    factor = rot / head_dim
    while int(head_dim * factor) < rot:  # rotary_dim = int(head_dim * factor) exactly
        factor = math.nextafter(factor, 2.0)
    return dict(rms_norm_eps=_positive_number(d, "layer_norm_epsilon", where, 1e-5),
                hidden_act=act, attention_bias=False, mlp_bias=True, lm_head_bias=True,
                rope_interleaved=True, partial_rotary_factor=factor, rope_theta=10000.0,
                rope_scaling=None, tie_word_embeddings=_flag(d, "tie_word_embeddings", False, where))


def _falcon_names(d: dict[str, Any], where: str) -> dict[str, Any]:
    """Falcon's config.json with the common names added (a new dict): hidden_size from the
    old ``n_embed`` where the file has it (FalconConfig reads it so), intermediate_size
    from ``ffn_hidden_size`` (null: 4 x hidden_size)."""
    out = dict(d)
    if d.get("n_embed") is not None:
        out["hidden_size"] = _positive_int(d, "n_embed", where)
    hidden = out.get("hidden_size")
    ffn = d.get("ffn_hidden_size")
    if ffn is None:
        out["intermediate_size"] = 4 * hidden if isinstance(hidden, int) else None
    else:
        out["intermediate_size"] = _positive_int(d, "ffn_hidden_size", where,
                                                 why=" or null (4 x hidden_size)")
    return out


def _falcon_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """Falcon (FalconConfig's defaults where a field is absent; ``d``: _falcon_names'
    dict): LayerNorms with bias (``layer_norm_epsilon``), ``bias`` on query_key_value,
    dense and the MLP's dense_h_to_4h -> ``activation`` (gelu) -> dense_4h_to_h, rotary
    on whole heads (neox halves, rope_parameters' theta), the head tied unless
    ``tie_word_embeddings`` is false. Its layer, as transformers' FalconDecoderLayer:

    - ``new_decoder_architecture`` (40B / 180B / Falcon2-11B): parallel, ``num_kv_heads``
      KV heads, ``num_ln_in_parallel_attn`` norms (null: 2, ln_attn and ln_mlp; 1: one);
    - else (7B): ``multi_query`` -> one KV head (else every head its own);
      ``parallel_attn`` -> one input_layernorm feeding both, else sequential
      (input_layernorm, then post_attention_layernorm after attention's residual add).

    ``alibi`` (Falcon-RW): ALiBi position biases instead of rotary (layers/alibi.py). The
    combinations transformers' own layer cannot run (it would fail on a missing norm or a
    head-count reshape) are ConfigErrors."""
    arch = "FalconForCausalLM"
    alibi = _flag(d, "alibi", False, where)
    head_dim = _whole_heads(d, where)
    heads = d["num_attention_heads"]
    new = _flag(d, "new_decoder_architecture", False, where)
    parallel = _flag(d, "parallel_attn", True, where)
    kv = d.get("num_kv_heads")
    if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1
                           or heads % kv):
        raise ConfigError(f"{where}: num_kv_heads must be a positive divisor of "
                          f"num_attention_heads ({heads}) or null, got {kv!r}")
    lns = d.get("num_ln_in_parallel_attn")
    if lns not in (None, 1, 2) or isinstance(lns, bool):
        raise ConfigError(f"{where}: num_ln_in_parallel_attn must be 1, 2 or null, got {lns!r}")
    if new:
        if not parallel:
            raise ConfigError(f"{where}: parallel_attn false is not supported with "
                              "new_decoder_architecture true (transformers' Falcon layer then "
                              "has no norm for the MLP)")
        kv_heads, norms = kv or heads, lns or 2
    else:
        if lns == 2 and parallel:
            raise ConfigError(f"{where}: num_ln_in_parallel_attn 2 needs new_decoder_"
                              "architecture true (transformers' Falcon-7B layer reads one "
                              "input_layernorm)")
        mqa = _flag(d, "multi_query", True, where)
        if not mqa and kv not in (None, heads):
            raise ConfigError(f"{where}: num_kv_heads {kv} is not supported with multi_query "
                              f"false and new_decoder_architecture false: every one of the "
                              f"{heads} heads has its own k and v there")
        kv_heads, norms = (1 if mqa else heads), 1 if parallel else 2
    act = _plain_act(d, arch, where, "gelu", "activation")
    bias = _flag(d, "bias", False, where)
    return dict(rms_norm_eps=_positive_number(d, "layer_norm_epsilon", where, 1e-5),
                hidden_act=act, attention_bias=bias, mlp_bias=bias, head_dim=head_dim,
                num_key_value_heads=kv_heads, use_parallel_residual=new or parallel,
                parallel_norms=norms, alibi=alibi,
                tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where))


def _no_checkpoint_quantization(d: dict[str, Any], arch: str, where: str) -> None:
    if d.get("quantization_config") is not None:
        raise ConfigError(f"{where}: quantization_config (a pre-quantized checkpoint) is not read "
                          f"for {arch}; load a 16/32-bit one (quantization='fp8' or 'int4' "
                          "quantizes it at load)")


def _bloom_names(d: dict[str, Any], where: str) -> dict[str, Any]:
    """Bloom's config.json with the common names added (a new dict), BloomConfig's defaults
    where a field is absent: hidden_size (the old ``n_embed`` where the file has it, 64),
    num_hidden_layers from ``n_layer`` (2), num_attention_heads from ``n_head`` (8),
    vocab_size (250880), intermediate_size 4 x hidden_size (transformers' BloomMLP; the
    files' ``n_inner`` is read by nothing)."""
    out = dict(d)
    out["model_type"] = d.get("model_type") or "bloom"
    for theirs, ours, default in (("n_embed", "hidden_size", 64), ("n_layer", "num_hidden_layers", 2),
                                  ("n_head", "num_attention_heads", 8)):
        key = theirs if theirs in d or ours not in d else ours
        out[ours] = _positive_int(d, key, where, default)
    out["vocab_size"] = _positive_int(d, "vocab_size", where, 250880)
    out["intermediate_size"] = 4 * out["hidden_size"]
    return out


def _bloom_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """Bloom (BloomConfig's defaults where a field is absent; ``d``: _bloom_names' dict):
    ALiBi with Bloom's slopes, LayerNorms with bias (``layer_norm_epsilon``) on the
    embeddings (word_embeddings_layernorm), before attention and the MLP and at the end,
    biased query_key_value (its rows head by head, [q k v] each) and dense, the MLP
    dense_h_to_4h -> GELU (tanh form) -> dense_4h_to_h with biases, the head tied unless
    ``tie_word_embeddings`` is false. ``apply_residual_connection_post_layernorm`` (the
    normed input as the residual) is a ConfigError; ``pretraining_tp`` / ``slow_but_exact``
    only reorder transformers' sums and are not read."""
    arch = "BloomForCausalLM"
    if _flag(d, "apply_residual_connection_post_layernorm", False, where):
        raise ConfigError(f"{where}: apply_residual_connection_post_layernorm true is not "
                          f"supported for {arch} (its residual is the normed input; no "
                          "published Bloom uses it)")
    _no_checkpoint_quantization(d, arch, where)
    head_dim = _whole_heads(d, where)
    return dict(rms_norm_eps=_positive_number(d, "layer_norm_epsilon", where, 1e-5),
                hidden_act="gelu_new", attention_bias=True, mlp_bias=True, head_dim=head_dim,
                num_key_value_heads=d["num_attention_heads"], alibi=True,
                tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where))


# MptConfig's names (its attribute_map) -> ModelConfig's
_MPT_NAMES = (("d_model", "hidden_size", 2048), ("n_heads", "num_attention_heads", 16),
              ("n_layers", "num_hidden_layers", 24), ("max_seq_len", "max_position_embeddings", 2048))


def _mpt_names(d: dict[str, Any], where: str) -> dict[str, Any]:
    """MPT's config.json with the common names added (a new dict), MptConfig's defaults
    where a field is absent: hidden_size from ``d_model``, num_attention_heads from
    ``n_heads``, num_hidden_layers from ``n_layers``, max_position_embeddings from
    ``max_seq_len``, vocab_size (50368), intermediate_size 4 x d_model (transformers' MptMLP,
    whatever ``expansion_ratio`` says: another ratio is a ConfigError)."""
    out = dict(d)
    out["model_type"] = d.get("model_type") or "mpt"
    for theirs, ours, default in _MPT_NAMES:
        key = theirs if theirs in d or ours not in d else ours
        out[ours] = _positive_int(d, key, where, default)
    out["vocab_size"] = _positive_int(d, "vocab_size", where, 50368)
    ratio = d.get("expansion_ratio", 4)
    if ratio != 4 or isinstance(ratio, bool):
        raise ConfigError(f"{where}: expansion_ratio {ratio!r} is not supported for "
                          "MptForCausalLM: transformers' MPT MLP is 4 x d_model wide")
    out["intermediate_size"] = 4 * out["hidden_size"]
    out.pop("head_dim", None)
    return out


def _mpt_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """MPT (MptConfig's and MptAttentionConfig's defaults where a field is absent; ``d``:
    _mpt_names' dict): ALiBi with MPT's slopes (``attn_config.alibi_bias_max``), Wqkv
    ([q | k | v] rows) and out_proj, up_proj -> exact GELU -> down_proj, LayerNorms
    (``layer_norm_epsilon``), none of them with a bias unless ``no_bias`` is false (then
    all of them, as MosaicML's code builds them); q, k and v clamped to
    [-clip_qkv, clip_qkv] (``attn_config.clip_qkv``); q.k scaled by
    ``attn_config.softmax_scale`` (null: head_dim ** -0.5); logits x ``logit_scale`` (a
    number or "inv_sqrt_d_model"; null: 1); the head tied unless ``tie_word_embeddings``.

    ConfigErrors name what transformers' MPT does not run as MosaicML's: a prefix LM
    (``prefix_lm``), attention within sequence ids (``attn_uses_sequence_id``), q/k
    LayerNorms (``qk_ln``: transformers drops them), multi-query or grouped attention
    (``attn_type``), learned positions without ALiBi (``alibi`` false). (transformers' MPT
    builds no biases whatever ``no_bias`` says: a checkpoint with them is read here as
    MosaicML's code reads it.)"""
    arch = "MptForCausalLM"
    raw = d.get("attn_config")
    attn: dict[str, Any] = {} if raw is None else raw
    if not isinstance(attn, dict):
        raise ConfigError(f"{where}: attn_config must be an object or null, got {raw!r}")
    w = f"{where}: attn_config"
    for key, why in (("prefix_lm", "a prefix LM attends bidirectionally within its prefix"),
                     ("attn_uses_sequence_id", "attention is not limited to sequence ids here"),
                     ("qk_ln", "transformers' MPT has no q/k LayerNorms (it would drop them)")):
        if _flag(attn, key, False, w):
            raise ConfigError(f"{w}.{key} true is not supported for {arch}: {why}")
    if not _flag(attn, "alibi", True, w):
        raise ConfigError(f"{w}.alibi false is not supported for {arch}: only ALiBi MPTs are "
                          "read (transformers' MPT has no learned position embeddings)")
    attn_type = attn.get("attn_type", "multihead_attention")
    if attn_type != "multihead_attention":
        raise ConfigError(f"{w}.attn_type {attn_type!r} is not supported for {arch} "
                          "(supported: 'multihead_attention', transformers' one)")
    _no_checkpoint_quantization(d, arch, where)
    scale = d.get("logit_scale")
    if scale == "inv_sqrt_d_model":
        scale = d["hidden_size"] ** -0.5
    elif scale is not None:
        scale = _positive_number(d, "logit_scale", where, 1.0)
    softmax_scale = attn.get("softmax_scale")
    return dict(rms_norm_eps=_positive_number(d, "layer_norm_epsilon", where, 1e-5),
                hidden_act="gelu", attention_bias=not _flag(d, "no_bias", True, where),
                mlp_bias=not _flag(d, "no_bias", True, where),
                head_dim=_whole_heads(d, where), num_key_value_heads=d["num_attention_heads"],
                alibi=True, alibi_bias_max=_positive_number(attn, "alibi_bias_max", w, 8.0),
                clip_qkv=_positive(attn, "clip_qkv", None, w),
                attention_multiplier=None if softmax_scale is None else _positive_number(
                    attn, "softmax_scale", w, 1.0),
                logit_scale=1.0 if scale is None else float(scale),
                tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where))


def _opt_names(d: dict[str, Any], where: str) -> dict[str, Any]:
    """OPT's config.json with intermediate_size added (a new dict) from ``ffn_dim``
    (OPTConfig's 3072 where absent), the name a bad value is reported under."""
    key = "ffn_dim" if "ffn_dim" in d or "intermediate_size" not in d else "intermediate_size"
    return {**d, "intermediate_size": _positive_int(d, key, where, 3072)}


def _opt_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """OPT (OPTConfig's defaults where a field is absent): learned positions read at
    position + 2 (``embed_positions`` has max_position_embeddings + 2 rows), LayerNorms
    with bias (nn.LayerNorm's fixed epsilon 1e-5; none of their parameters with
    ``layer_norm_elementwise_affine`` false), ``enable_bias`` on q/k/v/out_proj and on fc1 /
    fc2, ``activation_function`` (relu) between those, ``do_layer_norm_before`` (false:
    each norm after its residual add, OPT-350m), the final norm unless that is false or
    ``_remove_final_layer_norm``, embeddings of ``word_embed_proj_dim`` (projected in and
    out where it is not hidden_size), the head tied to them unless ``tie_word_embeddings``
    is false."""
    arch = "OPTForCausalLM"
    head_dim = _whole_heads(d, where)
    if d.get("num_key_value_heads") not in (None, d["num_attention_heads"]):
        raise ConfigError(f"{where}: num_key_value_heads {d['num_key_value_heads']!r} is not "
                          f"read for {arch} (its heads are all query, key and value heads)")
    act = _plain_act(d, arch, where, "relu", "activation_function")
    proj = d.get("word_embed_proj_dim")
    proj = d["hidden_size"] if proj is None else _positive_int(
        d, "word_embed_proj_dim", where, why=" or null (hidden_size)")
    bias = _flag(d, "enable_bias", True, where)
    before = _flag(d, "do_layer_norm_before", True, where)
    return dict(rms_norm_eps=1e-5, hidden_act=act, attention_bias=bias, mlp_bias=bias,
                learned_positions=True, position_offset=2, head_dim=head_dim,
                do_layer_norm_before=before,
                final_norm=before and not _flag(d, "_remove_final_layer_norm", False, where),
                norm_elementwise_affine=_flag(d, "layer_norm_elementwise_affine", True, where),
                word_embed_proj_dim=proj,
                tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where))


def _longrope(d: dict[str, Any], rope: dict[str, Any], where: str, rot_dim: int) -> RopeScaling:
    """longrope's fields, validated, with the attention factor resolved as transformers
    does: the config's ``attention_factor``, else sqrt(1 + ln(s) / ln(original)) for
    s = ``factor`` (else max_position_embeddings / original_max_position_embeddings) > 1,
    else 1. Which factor list a model uses is models/phi3.py's choice (max_model_len)."""
    f = f"{where}: rope_scaling"
    original = rope.get("original_max_position_embeddings",
                        d.get("original_max_position_embeddings"))
    if not isinstance(original, int) or isinstance(original, bool) or original <= 1:
        raise ConfigError(f"{f}: longrope needs original_max_position_embeddings, an integer "
                          f"> 1 (the pretraining length), got {original!r}")
    lists: dict[str, Any] = {}
    for key in ("short_factor", "long_factor"):
        v = rope.get(key)
        if (not isinstance(v, list | tuple) or len(v) != rot_dim // 2 or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and x > 0 for x in v)):
            shown = f"{len(v)} values" if isinstance(v, list | tuple) else repr(v)
            raise ConfigError(f"{f}.{key} must be a list of {rot_dim // 2} positive numbers "
                              f"(one per rotated pair of the {rot_dim} rotary dims), got {shown}")
        lists[key] = tuple(float(x) for x in v)
    factor = rope.get("factor")
    if factor is None:
        factor = (d.get("max_position_embeddings") or 2048) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    elif not isinstance(attention, int | float) or isinstance(attention, bool) or attention <= 0:
        raise ConfigError(f"{f}.attention_factor must be a positive number, got {attention!r}")
    return RopeScaling(rope_type="longrope", original_max_position_embeddings=original,
                       attention_factor=float(attention), **lists)


def classifier_labels(d: dict[str, Any], where: str) -> tuple[int, tuple[str, ...]]:
    """A sequence classifier's label count (``num_labels``, else id2label's size, else 2 as
    transformers' default) and names in id order ("LABEL_i" where id2label names none, as
    transformers does); a ConfigError for a count that is not a positive integer or an
    id2label that does not fit it."""
    id2label = d.get("id2label")
    if id2label is not None and not isinstance(id2label, dict):
        raise ConfigError(f"{where}: id2label must be an object of label id -> name, got {id2label!r}")
    n = d.get("num_labels", len(id2label) if id2label else 2)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"{where}: num_labels must be a positive integer, got {n!r}")
    names = id2label or {}
    bad = [k for k in names if not str(k).lstrip("-").isdigit() or not 0 <= int(k) < n]
    if bad:
        raise ConfigError(f"{where}: id2label names label id(s) {bad[:3]} outside the "
                          f"{n} labels [0, {n})")
    return n, tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(n))


def classifier_activation(d: dict[str, Any], folder: str | None, num_labels: int) -> str:
    """What turns a sequence classifier's logits into its outputs (vLLM's rule, after
    transformers' loss for ``problem_type``): a sentence-transformers CrossEncoder's
    ``activation_fn`` (config_sentence_transformers.json, or config.json's
    ``sbert_ce_default_activation_function``) of Identity -> "identity"; problem_type
    "regression" -> "identity", "multi_label_classification" -> "sigmoid" (each label on
    its own); else "softmax" over the labels, "sigmoid" for one label."""
    name = d.get("sbert_ce_default_activation_function")
    if name is None and folder:
        try:
            with open(os.path.join(folder, "config_sentence_transformers.json"), encoding="utf-8") as f:
                name = json.load(f).get("activation_fn")
        except (OSError, ValueError, AttributeError):
            name = None
    if isinstance(name, str) and name.rsplit(".", 1)[-1] == "Identity":
        return "identity"
    problem = d.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if num_labels == 1 else "softmax"


def apply_hf_overrides(d: dict[str, Any], overrides: Any) -> dict[str, Any]:
    """vLLM's ``hf_overrides``: ``overrides``' fields over config.json's ``d`` (a new dict),
    a dict value merged into a dict field key by key (``{"rope_scaling": {"factor": 4.0}}``
    keeps the other rope_scaling fields), anything else replacing the field; a ConfigError
    for overrides that are not a dict of field names."""
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ConfigError(f"hf_overrides must be a dict of config.json fields, got {overrides!r}")
    out = dict(d)
    for k, v in overrides.items():
        old = out.get(k)
        out[k] = apply_hf_overrides(old, v) if isinstance(v, dict) and isinstance(old, dict) else v
    return out


CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")


def classifier_from_token(d: dict[str, Any], where: str) -> tuple[tuple[str, ...], str]:
    """vLLM's fields for a classifier made from a causal LM's head (hf_overrides):
    ``classifier_from_token`` (the tokens) and ``method``; ``is_original_qwen3_reranker``
    means "from_2_way_softmax" (Qwen3-Reranker's P(yes) over [no, yes]). Without a method,
    two tokens are a 2-way softmax and one its row (bge-reranker-v2-gemma's "Yes")."""
    tokens = d.get("classifier_from_token")
    method = d.get("method")
    if d.get("is_original_qwen3_reranker"):
        method = "from_2_way_softmax"
    if tokens is None:
        if d.get("is_original_qwen3_reranker"):
            raise ConfigError(f"{where}: is_original_qwen3_reranker needs classifier_from_token "
                              '(Qwen3-Reranker\'s: ["no", "yes"])')
        return (), ""
    if (not isinstance(tokens, list) or not tokens
            or not all(isinstance(t, str) and t for t in tokens)):
        raise ConfigError(f"{where}: classifier_from_token must be a non-empty list of token "
                          f"strings, got {tokens!r}")
    if method is None:
        method = "from_2_way_softmax" if len(tokens) == 2 else "no_post_processing"
    if method not in CLASSIFIER_METHODS:
        raise ConfigError(f"{where}: method must be one of {', '.join(CLASSIFIER_METHODS)}, "
                          f"got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ConfigError(f"{where}: method from_2_way_softmax needs two classifier_from_token "
                          f"([negative, positive]), got {tokens!r}")
    return tuple(tokens), method


def _string_list(d: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    v = d.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{where}: quantization_config.{key} must be a list of module names, "
                          f"got {v!r}")
    return tuple(v)


def _block_size(v: Any, field_: str, required: bool = False) -> tuple[int, int] | None:
    if v is None and not required:
        return None
    if (not isinstance(v, list | tuple) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
        raise ConfigError(f"{field_} must be two positive integers [rows, cols], got {v!r}")
    return int(v[0]), int(v[1])


# HF's layer_types entries (Gemma 2/3, Cohere2): a layer attends within sliding_window, or to all
LAYER_TYPES = ("sliding_attention", "full_attention")
# the GELU of Gemma's MLP: the tanh approximation ("gelu" in Gemma 1 configs means it too)
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)


def _layer_types(d: dict[str, Any], where: str, pattern: Any) -> tuple[str, ...]:
    """Each layer's LAYER_TYPES entry: config.json's ``layer_types``, else transformers'
    rule for the older ``sliding_window_pattern`` (Gemma 2/3, Cohere2): every
    ``pattern``-th layer (1-based) attends to all, the others within the window."""
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise ConfigError(f"{where}: sliding_window_pattern must be a positive integer, "
                              f"got {pattern!r}")
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if (not isinstance(types, list | tuple) or len(types) != n
            or any(t not in LAYER_TYPES for t in types)):
        raise ConfigError(f"{where}: layer_types must list one of {', '.join(LAYER_TYPES)} for "
                          f"each of the {n} layers, got {types!r}")
    return tuple(types)


def _positive(d: dict[str, Any], key: str, default: Any, where: str) -> float | None:
    """``d[key]`` (``default`` when absent; null stays None) as a positive number."""
    v = d.get(key, default)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{where}: {key} must be a positive number or null, got {v!r}")
    return float(v)


def _gemma_fields(d: dict[str, Any], where: str, model_type: str) -> dict[str, Any]:
    """What Gemma 1/2/3 read beyond Llama's fields, with transformers' defaults where a
    field is absent: the activation, per-layer window types, the attention scale, the
    softcaps, and Gemma 3's two rope bases (old configs: rope_theta, rope_local_base_freq,
    rope_scaling, sliding_window_pattern; transformers >= 5: rope_parameters keyed by
    layer type, layer_types)."""
    if d.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention (an embedding model's encoder) "
                          "is not supported: Gemma runs as a causal LM here")
    act_key = "hidden_act" if model_type == "gemma" else "hidden_activation"
    act = d.get(act_key) or "gelu_pytorch_tanh"
    if model_type == "gemma" and act == "gelu":  # as transformers reads Gemma 1's configs
        act = "gelu_pytorch_tanh"
    if act not in GEMMA_ACTIVATIONS:
        raise ConfigError(f"{where}: {act_key} {act!r} is not supported for {model_type} "
                          f"(supported: {', '.join(GEMMA_ACTIVATIONS)})")
    out: dict[str, Any] = {"hidden_act": act}
    if model_type == "gemma":
        return {**out, "sliding_window": None}
    window = d.get("sliding_window", 4096)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ConfigError(f"{where}: sliding_window must be a positive integer or null, got {window!r}")
    # Gemma 2 alternates from a sliding layer 0; Gemma 3 every `pattern`-th is global
    pattern = 2 if model_type == "gemma2" else d.get(
        "sliding_window_pattern", d.get("_sliding_window_pattern", 6))
    caps = (50.0, 30.0) if model_type == "gemma2" else (None, None)
    out.update(
        sliding_window=window, layer_types=_layer_types(d, where, pattern),
        query_pre_attn_scalar=_positive(d, "query_pre_attn_scalar", 256, where),
        attn_logit_softcapping=_positive(d, "attn_logit_softcapping", caps[0], where),
        final_logit_softcapping=_positive(d, "final_logit_softcapping", caps[1], where))
    if model_type == "gemma3_text":
        out.update(qk_norm=True, **_rope_by_layer_type(
            d, where, "Gemma 3", 1_000_000.0, "rope_local_base_freq", 10_000.0))
    return out


def _rope_by_layer_type(d: dict[str, Any], where: str, family: str, full_theta: float,
                        local_key: str, local_theta: float) -> dict[str, Any]:
    """rope_theta, rope_scaling (the full-attention layers') and rope_local_theta (the
    sliding layers' base, their rope the default one) of a family whose two layer kinds
    rotate by two ropes (Gemma 3, OLMo 3): transformers >= 5's rope_parameters keyed by
    layer type, else the old rope_theta (``full_theta`` when absent) with rope_scaling for
    the full layers and ``local_key`` (``local_theta`` when absent) for the sliding ones.
    rope_scaling is returned as the dict HF writes (None: the default rope)."""
    rp = d.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    else:
        full = {"rope_theta": d.get("rope_theta", full_theta), **(d.get("rope_scaling") or {})}
        local = {"rope_theta": d.get(local_key, local_theta)}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConfigError(f"{where}: the sliding layers' rope must be the default one "
                          f"({family}'s), got {local!r}")
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    return dict(rope_theta=float(full.get("rope_theta", full_theta)),
                rope_local_theta=float(local.get("rope_theta", local_theta)),
                rope_scaling=scaling if scaling.get(
                    "rope_type", scaling.get("type", "default")) != "default" else None)


def _hunyuan_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """HunYuan dense's rope (see _families4_fields) and eps; its rope dict is read before
    RopeScaling (which has no "dynamic"), so from here rope_scaling is None."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = _rope_theta(d, where, 10_000.0)
    out: dict[str, Any] = dict(rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5))
    if kind == "dynamic":
        alpha = rope.get("alpha")
        if not alpha:
            raise ConfigError(f"{where}: rope type 'dynamic' without an alpha (NTK scaling by "
                              "sequence length) is not supported for HunYuanDenseV1ForCausalLM")
        if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
            raise ConfigError(f"{where}: rope alpha must be a positive number, got {alpha!r}")
        dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        return out | dict(rope_theta=theta * float(alpha) ** (dim / (dim - 2)), rope_scaling=None)
    return out | dict(rope_theta=theta, rope_scaling=RopeScaling.from_dict(
        rope if kind != "default" else None))


_FAMILIES4 = {"SmolLM3ForCausalLM", "ArceeForCausalLM", "MinistralForCausalLM", "Olmo3ForCausalLM",
              "Ernie4_5ForCausalLM", "SeedOssForCausalLM", "Exaone4ForCausalLM",
              "HunYuanDenseV1ForCausalLM", "ApertusForCausalLM"}


def _gpt_oss_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """GPT-OSS (GptOssConfig's defaults where a field is absent): ``num_local_experts``
    experts of ``intermediate_size`` in every layer, top ``num_experts_per_tok`` of the
    router's logits softmaxed over the k (no renormalization to choose: they sum to 1);
    the experts' clamped SwiGLU (``swiglu_alpha`` 1.702, ``swiglu_limit`` 7.0); attention
    sinks in every layer; ``layer_types`` (absent: sliding, full, sliding, ... from layer
    0) with ``sliding_window`` (128) on the sliding ones; biases on q/k/v/o
    (``attention_bias``, default true); head_dim 64; RMSNorm eps 1e-5; rope base 150000
    with GptOssConfig's YaRN (factor 32 over 4096 positions, beta 32 / 1, ``truncate``
    false) when the config has no rope fields. ``quantization_config``: none, or quant_method
    mxfp4 (the experts' weights as MXFP4 blocks: kept so for the fused MoE kernel, or
    dequantized at load; models/gpt_oss.py); any other is a ConfigError."""
    n = d["num_hidden_layers"]
    experts = _positive_int(d, "num_local_experts", where, default=d.get("num_experts", 128))
    top_k = _positive_int(d, "num_experts_per_tok", where, default=4)
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok ({top_k}) must be at most "
                          f"num_local_experts ({experts})")
    inter = _positive_int(d, "intermediate_size", where, default=2880)
    kv_heads = _positive_int(d, "num_key_value_heads", where, default=8)
    if d["num_attention_heads"] % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads ({d['num_attention_heads']}) is not a "
                          f"multiple of num_key_value_heads ({kv_heads})")
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    t = _layer_types({**d, "layer_types": types}, where, None)
    head_dim = d.get("head_dim", 64)
    if head_dim is None:
        head_dim = d["hidden_size"] // d["num_attention_heads"]
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ConfigError(f"{where}: head_dim must be a positive integer, got {head_dim!r}")
    theta = _rope_theta(d, where, 150_000.0)
    rope = d.get("rope_scaling")
    if rope is None:
        params = d.get("rope_parameters")
        if params is None and "rope_theta" not in d:
            params = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                          truncate=False, original_max_position_embeddings=4096)
        rope = {k: v for k, v in (params or {}).items() if k != "rope_theta"}
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_scaling must be a JSON object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = RopeScaling.from_dict(rope) if kind != "default" else None
    if scaling is not None and scaling.rope_type == "yarn":
        orig = rope.get("original_max_position_embeddings")
        if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
            raise ConfigError(f"{where}: yarn rope scaling needs original_max_position_embeddings "
                              f"(a positive integer), got {orig!r}")
        if not isinstance(rope.get("truncate", True), bool):
            raise ConfigError(f"{where}: rope truncate must be true or false, got "
                              f"{rope.get('truncate')!r}")
        _positive_number(rope, "factor", where + " rope_scaling", 1.0)
    mxfp4 = False
    qc = d.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method != "mxfp4":
            raise ConfigError(f"{where}: quantization_config {qc!r} is not supported for "
                              "GptOssForCausalLM (read: quant_method 'mxfp4', the released "
                              "checkpoints' experts; or a 16-bit checkpoint)")
        mxfp4 = True
    limit = d.get("swiglu_limit", 7.0)
    return dict(
        n_routed_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
        intermediate_size=inter, num_key_value_heads=kv_heads, layer_types=t,
        sliding_window=_windows(t, d, "GptOssForCausalLM", where, 128), head_dim=head_dim,
        attention_bias=_flag(d, "attention_bias", True, where), attention_sinks=True,
        rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5), rope_theta=theta,
        rope_scaling=scaling, swiglu_alpha=_positive_number(d, "swiglu_alpha", where, 1.702),
        swiglu_limit=_positive_number(d, "swiglu_limit", where, 7.0) if limit is not None
        else math.inf, mxfp4_experts=mxfp4,
        max_position_embeddings=_positive_int(d, "max_position_embeddings", where, 131072),
        tie_word_embeddings=_flag(d, "tie_word_embeddings", False, where))


def _rope_theta(d: dict[str, Any], where: str, default: float) -> float:
    """config.json's rope_theta (transformers >= 5: rope_parameters'), else ``default``: the
    family's config class's (SmolLM3's 2e6, OLMo 3's 5e5), not Llama's 1e4."""
    v = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", default))
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {v!r}")
    return float(v)


def _windows(types: tuple[str, ...], d: dict[str, Any], arch: str, where: str,
             default: Any) -> int | None:
    """The window of ``types``' sliding_attention layers: ``sliding_window`` (``default``
    where absent), a positive integer wherever a layer is sliding; None where none is."""
    if "sliding_attention" not in types:
        return None
    window = d.get("sliding_window", default)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{where}: sliding_window must be a positive integer for {arch} "
                          f"(layer_types has sliding_attention layers), got {window!r}")
    return window


def _families4_fields(d: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """SmolLM3, Arcee, Ministral and OLMo 3 (their config classes' defaults where a field is
    absent), each the Llama (OLMo 3: OLMo2) body with one difference:

    - SmolLM3: no positional embedding on the layers whose ``no_rope_layers`` entry is 0
      (absent: every ``no_rope_layer_interval``-th (4) layer, 1-based), held as
      nope_layers; with ``use_sliding_window``, windows on its NoPE layers (``layer_types``,
      as SmolLM3Config derives them); rope_theta 2e6, the head tied.
    - Arcee (AFM): a non-gated MLP, up_proj -> ``hidden_act`` (relu2: ReLU squared) ->
      down_proj (``mlp_bias``); RMSNorm eps 1e-5.
    - Ministral: Mistral with ``layer_types`` (absent: every layer sliding when there is a
      ``sliding_window``, 4096 when absent); no bias on q/k/v/o whatever attention_bias says
      (transformers' Ministral has none).
    - OLMo 3: OLMo2 with ``layer_types`` (absent: every 4th layer full, the others within
      ``sliding_window``, 4096), each kind its own rope (_rope_by_layer_type); eps 1e-5.
    - ERNIE 4.5 (dense): rotary on interleaved pairs (x[2i], x[2i + 1]), Cohere's layout;
      ``use_bias`` (on q/k/v/o and the MLP: a ConfigError, the gated MLP has no bias);
      head_dim 128, rope_theta 5e5, eps 1e-5 and a tied head by default.
    - Seed-OSS: q/k/v biased by ``attention_bias`` (default true), o_proj by
      ``attention_out_bias`` (default false); head_dim 128 by default; ``mlp_bias`` a
      ConfigError.
    - EXAONE 4: OLMo2's layer (post-norms) with Qwen3's per-head q/k RMSNorms (qk_norm) and
      no biases; with a ``sliding_window``, ``layer_types`` (absent: every
      ``sliding_window_pattern``-th (4) layer full) whose full-attention layers take no
      positional embedding (NoPE) and sliding ones rotate and window; without one, every
      layer full and rotating; eps 1e-5.
    - HunYuan dense: per-head q/k RMSNorms after rotary (models/hunyuan.py); its rope
      "dynamic" with a fixed ``alpha`` is the default rope of base rope_theta x alpha **
      (head_dim / (head_dim - 2)) (transformers' ntk_alpha); "dynamic" without alpha (NTK
      by sequence length) is a ConfigError; eps 1e-5.
    - Apertus: Arcee's non-gated MLP with xIELU (``hidden_act`` xielu, or a plain one), no
      MLP bias whatever mlp_bias says (transformers' has none), per-head q/k norms
      (qk_norm) before rotary; without any rope field, ApertusConfig's llama3 rope (base
      1.2e7, factor 8 over 8192); eps 1e-5."""
    if arch == "ApertusForCausalLM":
        from flashpage.layers.activation import PLAIN_ACTIVATIONS

        act = d.get("hidden_act") or "xielu"
        if act != "xielu" and act not in PLAIN_ACTIVATIONS:
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported for {arch} "
                              f"(supported: xielu, {', '.join(PLAIN_ACTIVATIONS)})")
        out: dict[str, Any] = dict(hidden_act=act, mlp_bias=False, qk_norm=True,
                                   rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5))
        if not any(k in d for k in ("rope_parameters", "rope_scaling", "rope_theta")):
            out.update(rope_theta=12_000_000.0, rope_scaling=RopeScaling.from_dict(dict(
                rope_type="llama3", factor=8.0, original_max_position_embeddings=8192,
                low_freq_factor=1.0, high_freq_factor=4.0)))
        return out
    if arch == "ArceeForCausalLM":
        return dict(hidden_act=_plain_act(d, arch, where, "relu2"),
                    mlp_bias=_flag(d, "mlp_bias", False, where),
                    rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5))
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported for "
                          f"{arch} (supported: 'silu')")
    n = d["num_hidden_layers"]
    if arch in ("Ernie4_5ForCausalLM", "SeedOssForCausalLM"):
        ernie = arch == "Ernie4_5ForCausalLM"
        key = "use_bias" if ernie else "mlp_bias"
        if _flag(d, key, False, where):
            raise ConfigError(f"{where}: {key} true is not supported for {arch} (the "
                              "gate/up/down projections have no bias here)")
        head_dim = d.get("head_dim", 128)
        if head_dim is None:
            head_dim = d["hidden_size"] // d["num_attention_heads"]
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise ConfigError(f"{where}: head_dim must be a positive integer, got {head_dim!r}")
        if ernie:
            return dict(head_dim=head_dim, rope_interleaved=True, attention_bias=False,
                        rope_theta=_rope_theta(d, where, 500_000.0),
                        rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5),
                        tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where))
        return dict(head_dim=head_dim, attention_bias=_flag(d, "attention_bias", True, where),
                    attention_out_bias=_flag(d, "attention_out_bias", False, where))
    if arch == "HunYuanDenseV1ForCausalLM":
        return _hunyuan_fields(d, where)
    if arch == "Exaone4ForCausalLM":
        eps = _positive_number(d, "rms_norm_eps", where, 1e-5)
        out = dict(qk_norm=True, attention_bias=False, rms_norm_eps=eps)
        if d.get("sliding_window", 4096) is None:  # transformers: no window, rotary everywhere
            t = _layer_types({**d, "layer_types": d.get("layer_types") or [
                "full_attention"] * n}, where, None)
            _windows(t, d, arch, where, 4096)  # a sliding layer without a window: an error
            return out | dict(layer_types=t, sliding_window=None)
        t = _layer_types(d, where, d.get("sliding_window_pattern", 4))
        return out | dict(layer_types=t, sliding_window=_windows(t, d, arch, where, 4096),
                          nope_layers=tuple(i for i, k in enumerate(t) if k == "full_attention"))
    if arch == "MinistralForCausalLM":
        types = d.get("layer_types")
        if types is None:
            kind = "full_attention" if d.get("sliding_window", 4096) is None else "sliding_attention"
            types = [kind] * n
        t = _layer_types({**d, "layer_types": types}, where, None)
        return dict(layer_types=t, sliding_window=_windows(t, d, arch, where, 4096),
                    attention_bias=False)
    if arch == "Olmo3ForCausalLM":
        t = _layer_types(d, where, 4)
        rope = _rope_by_layer_type(d, where, "OLMo 3", 500_000.0, "rope_theta", 500_000.0)
        return dict(layer_types=t, sliding_window=_windows(t, d, arch, where, 4096),
                    rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5),
                    rope_theta=rope["rope_theta"], rope_local_theta=rope["rope_local_theta"],
                    rope_scaling=RopeScaling.from_dict(rope["rope_scaling"]))
    # SmolLM3
    if _flag(d, "mlp_bias", False, where):
        raise ConfigError(f"{where}: mlp_bias true is not supported for {arch} (the "
                          "gate/up/down projections have no bias here)")
    roped = d.get("no_rope_layers")
    if roped is None:
        every = _positive_int(d, "no_rope_layer_interval", where, default=4)
        roped = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(roped, list | tuple) or len(roped) < n or any(
            not isinstance(v, int) or v not in (0, 1) for v in roped):
        raise ConfigError(f"{where}: no_rope_layers must list 1 (rotary) or 0 (NoPE) for each "
                          f"of the {n} layers, got {roped!r}")
    windowed = _flag(d, "use_sliding_window", False, where)
    types = d.get("layer_types")
    if types is None:
        types = ["sliding_attention" if windowed and d.get("sliding_window") is not None
                 and not roped[i] else "full_attention" for i in range(n)]
    t = _layer_types({**d, "layer_types": types}, where, None)
    if "sliding_attention" in t and not windowed:
        raise ConfigError(f"{where}: layer_types has sliding_attention layers but "
                          f"use_sliding_window is false for {arch} (transformers' attention "
                          "paths disagree on those layers: sdpa windows them, flash-attention "
                          "does not)")
    return dict(nope_layers=tuple(i for i in range(n) if not roped[i]), layer_types=t,
                sliding_window=_windows(t, d, arch, where, None),
                rope_theta=_rope_theta(d, where, 2_000_000.0),
                tie_word_embeddings=_flag(d, "tie_word_embeddings", True, where))


def _glm_fields(d: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """GLM, GLM-4 and GLM-4.5 / 4.6 MoE (GlmConfig's, Glm4Config's, Glm4MoeConfig's defaults
    where a field is absent); models/glm.py.

    - All three: rotary on the first ``partial_rotary_factor`` (default 0.5) of each head,
      o_proj without a bias, a gated SiLU MLP, max_position_embeddings 131072.
    - GLM / GLM-4: rotary on interleaved pairs (x[2i], x[2i + 1]); q/k/v biased unless
      ``attention_bias`` is false; head_dim 128, 2 KV heads, eps 1.5625e-7 and eos
      151329 / 151336 / 151338 by default; the checkpoint's ``mlp.gate_up_proj`` merged.
    - GLM-4.5 (Glm4Moe): rotary on halves (Llama's); q/k/v biased only with
      ``attention_bias``; per-head q/k RMSNorms before rotary with ``use_qk_norm``; layers
      from ``first_k_dense_replace`` (default 1) on hold ``n_routed_experts`` experts of
      ``moe_intermediate_size`` routed as DeepSeek-V3's (sigmoid, ``e_score_correction_bias``,
      ``n_group`` / ``topk_group``, ``norm_topk_prob`` default true, ``routed_scaling_factor``)
      beside ``n_shared_experts`` (default 1) shared ones, the layers before them a dense MLP
      of ``intermediate_size``; eps 1e-5 and 8 KV heads by default. Its multi-token-prediction
      layers (``num_nextn_predict_layers``, after the last layer) are not read."""
    moe = arch == "Glm4MoeForCausalLM"
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported for "
                          f"{arch} (supported: 'silu')")
    heads, n = d["num_attention_heads"], d["num_hidden_layers"]
    kv = _positive_int(d, "num_key_value_heads", where, default=8 if moe else 2)
    if heads % kv:
        raise ConfigError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv})")
    head_dim = d.get("head_dim", None if moe else 128)
    if head_dim is None:
        head_dim = d["hidden_size"] // heads
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ConfigError(f"{where}: head_dim must be a positive integer, got {head_dim!r}")
    out: dict[str, Any] = dict(
        num_key_value_heads=kv, head_dim=head_dim, rope_interleaved=not moe,
        partial_rotary_factor=_partial_rotary(d, where, head_dim, "partial_rotary_factor", 0.5),
        attention_bias=_flag(d, "attention_bias", not moe, where), attention_out_bias=False,
        rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5 if moe else 1.5625e-7),
        max_position_embeddings=_positive_int(d, "max_position_embeddings", where, 131072))
    if not moe:
        if "eos_token_id" not in d:
            out["eos_token_id"] = (151329, 151336, 151338)
        return out
    experts = _positive_int(d, "n_routed_experts", where, default=d.get("num_local_experts", 128))
    top_k = _positive_int(d, "num_experts_per_tok", where, default=8)
    groups = _positive_int(d, "n_group", where, default=1)
    if experts % groups or experts // groups < 2:
        raise ConfigError(f"{where}: n_group ({groups}) must split n_routed_experts ({experts}) "
                          "into equal groups of at least 2 (a group is ranked by its best two)")
    topk_group = _positive_int(d, "topk_group", where, default=1)
    if topk_group > groups:
        raise ConfigError(f"{where}: topk_group ({topk_group}) must be at most n_group ({groups})")
    if top_k > topk_group * (experts // groups):
        raise ConfigError(f"{where}: num_experts_per_tok ({top_k}) must be at most the "
                          f"{topk_group * (experts // groups)} experts of the topk_group "
                          f"({topk_group}) groups kept")
    shared = d.get("n_shared_experts", 1)
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ConfigError(f"{where}: n_shared_experts must be an integer >= 0, got {shared!r}")
    dense = d.get("first_k_dense_replace", 1)
    if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense <= n:
        raise ConfigError(f"{where}: first_k_dense_replace must be an integer in [0, {n}] "
                          f"(num_hidden_layers), got {dense!r}")
    if dense:
        _positive_int(d, "intermediate_size", where,
                      why=f" (dense MLP in the first {dense} layer(s))")
    return out | dict(
        qk_norm=_flag(d, "use_qk_norm", False, where), n_routed_experts=experts,
        num_experts_per_tok=top_k, moe_intermediate_size=_positive_int(
            d, "moe_intermediate_size", where, default=1408),
        n_shared_experts=shared, first_k_dense_replace=dense, mlp_only_layers=tuple(range(dense)),
        decoder_sparse_step=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=groups,
        topk_group=topk_group, norm_topk_prob=_flag(d, "norm_topk_prob", True, where),
        routed_scaling_factor=_positive_number(d, "routed_scaling_factor", where, 1.0))


def _llama4_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """Llama 4's text model (Llama4ForCausalLM, Llama4TextConfig's defaults where a field is
    absent); models/llama4.py.

    - layer i rotates q and k (interleaved pairs, all dims) where ``no_rope_layers[i]`` is 1
      (absent: all but every ``no_rope_layer_interval``-th (4), 1-based), and those layers
      attend in chunks (``layer_types`` "chunked_attention", absent: derived so): a query at
      p sees keys j <= p with j // ``attention_chunk_size`` == p // it (null: no chunks);
      the others take no positional embedding (NoPE) and attend to all;
    - with ``use_qk_norm`` (default true) the rotary layers' q and k are L2-normed per head
      after rotary (no weight, eps rms_norm_eps);
    - with ``attn_temperature_tuning`` (default true) the NoPE layers' q at position p is
      scaled by 1 + ``attn_scale`` x log(1 + floor((p + 1) / ``floor_scale``));
    - layers in ``moe_layers`` (absent: every ``interleave_moe_layer_step``-th, 1-based) hold
      ``num_local_experts`` experts of ``intermediate_size``, top-``num_experts_per_tok`` by
      router logit, each expert's input scaled by the sigmoid of its logit, beside a shared
      expert of ``intermediate_size``; the others a dense MLP of ``intermediate_size_mlp``;
    - head_dim 128, 8 KV heads, rope base 5e5, eps 1e-5 by default; ``attention_bias`` on
      q/k/v and o_proj alike."""
    arch = "Llama4ForCausalLM"
    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {d.get('hidden_act')!r} is not supported for "
                          f"{arch} (supported: 'silu')")
    n, heads = d["num_hidden_layers"], d["num_attention_heads"]
    kv = d.get("num_key_value_heads", 8)
    kv = heads if kv is None else kv
    if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0 or heads % kv:
        raise ConfigError(f"{where}: num_key_value_heads must be a positive integer dividing "
                          f"num_attention_heads ({heads}), got {kv!r}")
    head_dim = d.get("head_dim", 128)
    head_dim = d["hidden_size"] // heads if head_dim is None else head_dim
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ConfigError(f"{where}: head_dim must be a positive integer, got {head_dim!r}")
    experts = _positive_int(d, "num_local_experts", where, default=16)
    top_k = _positive_int(d, "num_experts_per_tok", where, default=1)
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok ({top_k}) must be at most "
                          f"num_local_experts ({experts})")
    moe_layers = d.get("moe_layers")
    if moe_layers is None:
        step = _positive_int(d, "interleave_moe_layer_step", where, default=1)
        moe_layers = list(range(step - 1, n, step))
    elif not isinstance(moe_layers, list | tuple) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n for i in moe_layers):
        raise ConfigError(f"{where}: moe_layers must list layer indices in [0, {n}), "
                          f"got {moe_layers!r}")
    roped = d.get("no_rope_layers")
    if not roped:  # (transformers derives an empty list too)
        every = _positive_int(d, "no_rope_layer_interval", where, default=4)
        roped = [int((i + 1) % every != 0) for i in range(n)]
    elif not isinstance(roped, list | tuple) or len(roped) != n or any(
            not isinstance(v, int) or isinstance(v, bool) or v not in (0, 1) for v in roped):
        raise ConfigError(f"{where}: no_rope_layers must list 1 (rotary) or 0 (NoPE) for each "
                          f"of the {n} layers, got {roped!r}")
    chunk = d.get("attention_chunk_size", 8192)
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0):
        raise ConfigError(f"{where}: attention_chunk_size must be a positive integer or null, "
                          f"got {chunk!r}")
    types = d.get("layer_types")
    if types is None:
        types = ["chunked_attention" if r and chunk is not None else "full_attention"
                 for r in roped]
    kinds = ("chunked_attention", "full_attention")
    if not isinstance(types, list | tuple) or len(types) != n or any(t not in kinds for t in types):
        raise ConfigError(f"{where}: layer_types must list one of {', '.join(kinds)} for each "
                          f"of the {n} layers, got {types!r}")
    if chunk is None and "chunked_attention" in types:
        raise ConfigError(f"{where}: layer_types has chunked_attention layers but "
                          "attention_chunk_size is null")
    dense = [i for i in range(n) if i not in moe_layers]
    out: dict[str, Any] = dict(
        num_key_value_heads=kv, head_dim=head_dim, rope_interleaved=True,
        rope_theta=_rope_theta(d, where, 500_000.0),
        rms_norm_eps=_positive_number(d, "rms_norm_eps", where, 1e-5),
        attention_bias=_flag(d, "attention_bias", False, where),
        max_position_embeddings=_positive_int(d, "max_position_embeddings", where, 131072),
        nope_layers=tuple(i for i in range(n) if not roped[i]), layer_types=tuple(types),
        sliding_window=None,
        attention_chunk_size=chunk, qk_l2_norm=_flag(d, "use_qk_norm", True, where),
        n_routed_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=_positive_int(d, "intermediate_size", where, default=8192),
        shared_expert_intermediate_size=_positive_int(d, "intermediate_size", where,
                                                      default=8192),
        mlp_only_layers=tuple(dense), decoder_sparse_step=1,
        intermediate_size=_positive_int(
            d, "intermediate_size_mlp", where, default=16384,
            why=f" (dense MLP in layer(s) {', '.join(map(str, dense[:4]))})") if dense else 0)
    tuning = d.get("attn_temperature_tuning", True)
    # Llama-4-Scout / Maverick's published config.json say 4 (an integer read for its truth,
    # as vLLM and transformers before 5 read it); transformers 5 types it a bool
    if tuning is None:
        tuning = True
    if not isinstance(tuning, int) or (not isinstance(tuning, bool) and tuning < 0):
        raise ConfigError(f"{where}: attn_temperature_tuning must be true, false or a "
                          f"non-negative integer, got {tuning!r}")
    if tuning:
        out["nope_attn_temperature"] = (_positive_number(d, "floor_scale", where, 8192.0),
                                        _positive_number(d, "attn_scale", where, 0.1))
    return out


# The text configs' class defaults (Gemma3TextConfig, Llama4TextConfig, MistralConfig,
# MinistralConfig) for the fields our reader needs and the family readers do not default
# themselves: transformers fills a text_config's absent fields from them, and published
# configs rely on it (gemma-3-4b-it's text_config names 6 fields: no vocab_size, heads, ...)
_TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    # LlamaConfig's (LLaVA-1.5's text_config names only what differs: vocab_size, ...)
    "llama": dict(vocab_size=32_000, hidden_size=4096, intermediate_size=11_008,
                  num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                  rms_norm_eps=1e-6),
    "gemma3_text": dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=256, max_position_embeddings=131_072, rms_norm_eps=1e-6),
    # Qwen2Config's (LLaVA-OneVision's text_config)
    "qwen2": dict(vocab_size=151_936, hidden_size=4096, intermediate_size=22_016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  max_position_embeddings=32_768, rms_norm_eps=1e-6, rope_theta=10_000.0),
    # Qwen3Config's (an InternVL3.5 text_config)
    "qwen3": dict(vocab_size=151_936, hidden_size=4096, intermediate_size=22_016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                  max_position_embeddings=32_768, rms_norm_eps=1e-6, rope_theta=10_000.0),
    # Qwen3MoeConfig's and GptOssConfig's sizes (InternVL3.5's MoE text_configs; the expert
    # counts are left to the file: transformers 4 names them num_experts, 5 num_local_experts)
    "qwen3_moe": dict(vocab_size=151_936, hidden_size=2048, intermediate_size=6144,
                      moe_intermediate_size=768, num_hidden_layers=24, num_attention_heads=32,
                      num_key_value_heads=4, max_position_embeddings=32_768, rms_norm_eps=1e-6,
                      rope_theta=10_000.0),
    "gpt_oss": dict(vocab_size=201_088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                    max_position_embeddings=131_072, rms_norm_eps=1e-5),
    # InternLM2Config's and InternLM3Config's (InternVL2.5-8B's / InternVL3-9B's llm_config)
    "internlm2": dict(vocab_size=103_168, hidden_size=4096, intermediate_size=11_008,
                      num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, rope_theta=10_000.0),
    "internlm3": dict(vocab_size=128_512, hidden_size=4096, intermediate_size=11_008,
                      num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, rope_theta=10_000.0),
    "llama4_text": dict(vocab_size=202_048, hidden_size=5120, num_hidden_layers=48,
                        num_attention_heads=40),
    "mistral": dict(vocab_size=32_000, hidden_size=4096, intermediate_size=14_336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=131_072, rms_norm_eps=1e-6, sliding_window=4096),
    "ministral": dict(vocab_size=32_000, hidden_size=4096, intermediate_size=14_336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=131_072, rms_norm_eps=1e-6, sliding_window=4096),
}
# Fields of the whole model that config.json may hold at its top level beside text_config,
# read from there first (then text_config's): tie_word_embeddings (transformers 5 ties the
# head by the top-level flag alone; 4.x read text_config's, which a top-level one agrees with
# in the published files), the dtype (from_pretrained's dtype="auto" reads the top level),
# and the generation ids (Gemma 3's top-level eos_token_id [1, 106] adds <end_of_turn>).
_TOP_LEVEL_FIELDS = ("tie_word_embeddings", "torch_dtype", "dtype", "bos_token_id", "eos_token_id")


def _text_config_of(d: dict[str, Any], arch: str, where: str) -> tuple[dict[str, Any], str]:
    """The text model's config of a multimodal checkpoint (MULTIMODAL_TEXT_ARCHITECTURES):
    ``text_config`` with its class's defaults under it and the whole model's fields
    (_TOP_LEVEL_FIELDS) over it, its ``architectures`` the text family's; and the ``where``
    its errors name. The vision config is not read. A quantized checkpoint
    (quantization_config) is a ConfigError: fp8 ones are read for the Qwen-VL families alone
    (_vl_checkpoint_quantization), whose towers' weights are left 16-bit or dequantized at
    load (models/qwen2_vl.load_image_encoder); these families' towers and projectors have
    no fp8 reader."""
    model_types, default_type, _ = MULTIMODAL_TEXT_ARCHITECTURES[arch]
    key = "llm_config" if arch == "InternVLChatModel" else "text_config"  # OpenGVLab's remote-code name
    tc = d.get(key)
    if not isinstance(tc, dict):
        raise ConfigError(f"{where}: {arch} needs a {key} object (its language model's "
                          f"config), got {tc!r}")
    text_type = tc.get("model_type") or default_type
    if text_type not in model_types:
        raise ConfigError(f"{where}: {key}.model_type {text_type!r} is not supported in "
                          f"{arch} (supported: {', '.join(model_types)})")
    if d.get("quantization_config") is not None or tc.get("quantization_config") is not None:
        raise ConfigError(f"{where}: quantized {arch} checkpoints (quantization_config) are not "
                          "read yet (fp8 ones are for the Qwen-VL families: Qwen2-VL, Qwen2.5-VL, "
                          "Qwen3-VL, Qwen3-VL-MoE); the 16-bit checkpoint is, and --quantization "
                          "fp8 / int4 quantizes its text model at load")
    text = {**_TEXT_CONFIG_DEFAULTS[text_type], **tc, "model_type": text_type,
            "architectures": [_MODEL_TYPE_TO_ARCH[text_type]]}
    for top in _TOP_LEVEL_FIELDS:
        # (InternVLChatModel's language model ties by its llm_config alone: the remote code
        # ties nothing at the top level)
        if d.get(top) is not None and not (arch == "InternVLChatModel" and top == "tie_word_embeddings"):
            text[top] = d[top]
    return text, f"{where}: {key}"


# CLIPVisionConfig's defaults under a LLaVA vision_config (LlavaConfig's own: CLIP ViT-L/14-336)
_CLIP_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
    num_channels=3, image_size=336, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5)
_OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_VISION_ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "relu")
# SiglipVisionConfig's defaults (a LLaVA-OneVision vision_config given), and LlavaOnevisionConfig's
# own when it has none (siglip-so400m-patch14-384)
_SIGLIP_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
_ONEVISION_SIGLIP: dict[str, Any] = {**_SIGLIP_VISION_DEFAULTS, **dict(
    hidden_size=1152, intermediate_size=4304, patch_size=14, image_size=384, num_hidden_layers=26,
    num_attention_heads=16)}
# LlavaOnevisionConfig's default image_grid_pinpoints: 1 .. 6 tiles of 384 a side, either way
_ONEVISION_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]
# LlavaNextConfig's default image_grid_pinpoints (llava-v1.6's, for a 336 tower)
_LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
_PIL_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's codes -> torch interpolate's modes


@dataclass(frozen=True)
class ImageProcessing:
    """How an image becomes pixel values (CLIPImageProcessor's steps, and LLaVA's optional
    pad-to-square first: models/clip_image.py): from the checkpoint's
    preprocessor_config.json, else CLIP's defaults at the tower's image size."""

    shortest_edge: int | None  # resize so the shorter side is this (None: to resize_hw)
    resize_hw: tuple[int, int] | None  # or to exactly (height, width); neither: no resize
    crop_hw: tuple[int, int] | None  # center crop (None: none)
    rescale_factor: float | None  # x * factor (None: none)
    mean: tuple[float, ...] | None  # (x - mean) / std per channel (None: no normalize)
    std: tuple[float, ...] | None
    resample: str = "bicubic"  # torch interpolate's mode, antialiased as PIL's
    pad_to_square: bool = False  # LlavaImageProcessor's do_pad (background: mean x 255)
    convert_rgb: bool = True


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA checkpoint's image side (LlavaConfig beside its text_config): the CLIP ViT
    tower (models/clip_vision.py), the projector, the image token and preprocessing.
    ``feature_layers``: indexes into the tower's hidden states (0: the embeddings after
    pre_layrnorm, i: layer i's output; vision_feature_layer made non-negative), their rows
    concatenated along the width; ``select_strategy`` "default" drops the CLS row, "full"
    keeps it. LLaVA-NeXT's (LlavaNextConfig) too: ``grid_pinpoints`` then says how an
    image is tiled (models/llava_next.py)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str
    projector_bias: bool
    image_token_id: int
    processing: ImageProcessing
    # LLaVA-NeXT's image_grid_pinpoints: the (height, width) an image's tiles may cover, each
    # a multiple of image_size (models/llava_next.py); () for LLaVA-1.5's one tile
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    # the tower: "clip" (models/clip_vision.py, a CLS row first) or "siglip"
    # (models/siglip_vision.py, no CLS row: LLaVA-OneVision's)
    tower: str = "clip"
    # LLaVA-OneVision's vision_aspect_ratio "anyres_max_N": N (a grid of more than 1.1^2 x N
    # tiles' rows is pooled down to about N tiles'; an image among several of one prompt is
    # one tile: models/llava_onevision.py); 0 for LLaVA-NeXT
    anyres_max: int = 0
    # LLaVA-OneVision's <video> (video_token_index): each becomes a video's frames' pooled
    # rows and a newline; None where videos are not taken
    video_token_id: int | None = None

    @property
    def tokens_per_image(self) -> int:
        """The rows one tile gives (LLaVA-1.5: one image's, each at one ``<image>``
        position): (image / patch)^2, and CLIP's CLS row too under "full"."""
        return (self.image_size // self.patch_size) ** 2 + (self.select_strategy == "full" and self.tower == "clip")

    @property
    def layers_run(self) -> int:
        """The tower's layers that must run: up to the deepest feature layer (the others,
        and post_layernorm, are never read)."""
        return max(self.feature_layers)


def _hw(v: Any, key: str, where: str) -> tuple[int, int]:
    """A preprocessor_config.json size ({"height", "width"} or one int) as (h, w)."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v, v
    if isinstance(v, dict) and all(isinstance(v.get(k), int) and v[k] > 0 for k in ("height", "width")):
        return v["height"], v["width"]
    raise ConfigError(f"{where}: {key} must be {{\"height\": h, \"width\": w}} or an int, got {v!r}")


_IMAGE_PROCESSORS = ("CLIPImageProcessor", "LlavaImageProcessor", "LlavaNextImageProcessor",
                     "LlavaOnevisionImageProcessor")


def _pinpoints(v: Any, key: str, where: str, image_size: int) -> tuple[tuple[int, int], ...]:
    """LLaVA-NeXT's image_grid_pinpoints: [[height, width], ...], each a multiple of the
    tower's image size (a tile's)."""
    ok = isinstance(v, list) and v and all(
        isinstance(p, (list, tuple)) and len(p) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in p) for p in v)
    if not ok:
        raise ConfigError(f"{where}: {key} must be a non-empty list of [height, width] pairs of "
                          f"positive ints, got {v!r}")
    out = tuple((int(h), int(w)) for h, w in v)
    bad = [list(p) for p in out if p[0] % image_size or p[1] % image_size]
    if bad:
        raise ConfigError(f"{where}: {key} {bad} are not multiples of the vision tower's image "
                          f"size {image_size} (each resolution is cut into tiles of that size)")
    return out


def pixel_steps(pc: dict[str, Any], where: str, *, mean_default: tuple[float, ...] = _OPENAI_CLIP_MEAN,
                std_default: tuple[float, ...] = _OPENAI_CLIP_STD, resample_default: int = 3,
                resamples: dict[int, str] = _PIL_RESAMPLE
                ) -> tuple[float | None, tuple[float, ...] | None, tuple[float, ...] | None, str, bool]:
    """An image processor config's per-pixel steps, as CLIPImageProcessor,
    Qwen2VLImageProcessor and PixtralImageProcessor read them (Idefics3's / SmolVLM's with
    their defaults: mean = std = 0.5, LANCZOS among ``resamples``) -> (rescale_factor or
    None, mean, std (None without do_normalize; CLIP's defaults), the resample mode, convert
    to RGB); a ConfigError names a bad field."""
    resample = pc.get("resample", resample_default)
    if resample not in resamples:
        known = ", ".join(f"{k}: {v}" for k, v in resamples.items())
        raise ConfigError(f"{where}: resample {resample!r} is not supported ({known})")
    norm = pc.get("do_normalize", True)
    mean = tuple(pc.get("image_mean", mean_default)) if norm else None
    std = tuple(pc.get("image_std", std_default)) if norm else None
    for name, vals in (("image_mean", mean), ("image_std", std)):
        if vals is not None and (len(vals) != 3 or not all(isinstance(x, (int, float)) for x in vals)):
            raise ConfigError(f"{where}: {name} must be 3 numbers, got {list(vals)!r}")
    if std is not None and any(x == 0 for x in std):
        raise ConfigError(f"{where}: image_std has a zero")
    rescale = float(pc.get("rescale_factor", 1 / 255)) if pc.get("do_rescale", True) else None
    return rescale, mean, std, resamples[resample], bool(pc.get("do_convert_rgb", True))


def _image_processing(folder: str | None, image_size: int, where: str,
                      pinpoints: tuple[tuple[int, int], ...] = ()) -> ImageProcessing:
    """The folder's preprocessor_config.json (CLIPImageProcessor / LlavaImageProcessor /
    LlavaNextImageProcessor fields; transformers' defaults for those it leaves out), or
    CLIP's defaults at ``image_size`` without one. With ``pinpoints`` (LLaVA-NeXT) the
    steps are each tile's, and do_pad (LlavaNextImageProcessor's padding of a batch's
    tile counts) does not pad an image to a square."""
    path = os.path.join(folder, "preprocessor_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return ImageProcessing(image_size, None, (image_size, image_size), 1 / 255,
                               _OPENAI_CLIP_MEAN, _OPENAI_CLIP_STD)
    pc = _json_object(path)
    kind = str(pc.get("image_processor_type", "CLIPImageProcessor"))
    if kind.removesuffix("Pil").removesuffix("Fast") not in _IMAGE_PROCESSORS:
        raise ConfigError(f"{path}: image_processor_type {kind!r} is not read "
                          f"({', '.join(_IMAGE_PROCESSORS)} are)")
    if pinpoints and pc.get("image_grid_pinpoints") is not None \
            and _pinpoints(pc["image_grid_pinpoints"], "image_grid_pinpoints", path, image_size) != pinpoints:
        raise ConfigError(f"{path}: image_grid_pinpoints {pc['image_grid_pinpoints']!r} differ from "
                          f"config.json's {[list(p) for p in pinpoints]!r} (the tiles the model packs)")
    onevision = kind.startswith("LlavaOnevision")
    if onevision:  # LlavaOnevisionImageProcessor's defaults: a resize to 384 x 384, no crop
        pc = {"size": {"height": 384, "width": 384}, **{k: v for k, v in pc.items() if v is not None}}
        pc.setdefault("do_center_crop", False)
    shortest: int | None = None
    resize_hw: tuple[int, int] | None = None
    if pc.get("do_resize", True):
        size = pc.get("size", {"shortest_edge": 224})
        if isinstance(size, dict) and "shortest_edge" in size:
            shortest = size["shortest_edge"]
            if not isinstance(shortest, int) or shortest <= 0:
                raise ConfigError(f"{path}: size.shortest_edge must be a positive int, got {shortest!r}")
        elif isinstance(size, int) and not isinstance(size, bool):
            shortest = size  # an int is a shortest edge to CLIP (default_to_square False)
        else:
            resize_hw = _hw(size, "size", path)
    crop = _hw(pc.get("crop_size", 224), "crop_size", path) if pc.get("do_center_crop", True) else None
    rescale, mean, std, resample, rgb = pixel_steps(pc, path)
    out_hw = crop or resize_hw
    if out_hw is None or out_hw != (image_size, image_size):
        raise ConfigError(f"{path}: its images come out {out_hw or 'of any size'} (crop_size / "
                          f"size) but the vision tower takes {image_size} x {image_size}")
    return ImageProcessing(
        shortest, resize_hw, crop, rescale, mean, std, resample,
        bool(pc.get("do_pad", False)) and not pinpoints and not kind.startswith("LlavaNext") and not onevision,
        rgb)


def vit_section(d: dict[str, Any], arch: str, where: str, model_type: str, tower: str,
                defaults: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ViT tower's vision_config (CLIP's, Pixtral's, SigLIP's): (the raw object, its
    ``defaults``' fields with the config's over them), checked alike: an object, of
    ``model_type`` (absent means it; ``tower`` names it in the error), the tower's sizes
    positive ints, RGB input. A ConfigError names what is wrong."""
    vc = d.get("vision_config") or {}
    if not isinstance(vc, dict):
        raise ConfigError(f"{where}: vision_config must be an object, got {vc!r}")
    vtype = vc.get("model_type", model_type)
    if vtype != model_type:
        raise ConfigError(f"{where}: vision_config.model_type {vtype!r} is not supported in {arch} "
                          f"({tower}, {model_type}, is)")
    v = {**defaults, **{k: vc[k] for k in defaults if vc.get(k) is not None}}
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_channels", "image_size", "patch_size"):
        if not isinstance(v[k], int) or isinstance(v[k], bool) or v[k] <= 0:
            raise ConfigError(f"{where}: vision_config.{k} must be a positive int, got {v[k]!r}")
    if v["num_channels"] != 3:
        raise ConfigError(f"{where}: vision_config.num_channels {v['num_channels']}: only RGB (3) "
                          "images are read")
    return vc, v


def _vision_config_of(d: dict[str, Any], arch: str, where: str, folder: str | None) -> VisionConfig:
    """A LLaVA checkpoint's VisionConfig: vision_config (CLIP's fields, LlavaConfig's
    defaults under them; LLaVA-OneVision's: SigLIP's), the top-level image fields,
    preprocessor_config.json (folder)."""
    onevision = arch == "LlavaOnevisionForConditionalGeneration"
    if onevision:
        vc, v = vit_section(d, arch, where, "siglip_vision_model", "a SigLIP tower",
                            _SIGLIP_VISION_DEFAULTS if d.get("vision_config") else _ONEVISION_SIGLIP)
    else:
        vc, v = vit_section(d, arch, where, "clip_vision_model", "a CLIP ViT tower", _CLIP_VISION_DEFAULTS)
    if v["hidden_size"] % v["num_attention_heads"]:
        raise ConfigError(f"{where}: vision_config.hidden_size {v['hidden_size']} is not a multiple "
                          f"of num_attention_heads {v['num_attention_heads']}")
    # SigLIP's conv drops a remainder (so400m: 384 / 14 -> 27 x 27 patches); CLIP's
    # positions count every patch and must match
    if v["image_size"] % v["patch_size"] and not onevision:
        raise ConfigError(f"{where}: vision_config.image_size {v['image_size']} is not a multiple "
                          f"of patch_size {v['patch_size']}")
    if v["hidden_act"] not in _VISION_ACTS:
        raise ConfigError(f"{where}: vision_config.hidden_act {v['hidden_act']!r} is not supported "
                          f"({', '.join(_VISION_ACTS)})")
    layers = v["num_hidden_layers"]
    raw_layer = d.get("vision_feature_layer", -1 if onevision else -2)
    given = raw_layer if isinstance(raw_layer, list) else [raw_layer]
    feature: list[int] = []
    for lay in given:
        if not isinstance(lay, int) or isinstance(lay, bool) or not -(layers + 1) <= lay <= layers:
            raise ConfigError(f"{where}: vision_feature_layer {raw_layer!r}: each must be an int in "
                              f"[{-(layers + 1)}, {layers}] (the tower's {layers + 1} hidden states)")
        feature.append(lay if lay >= 0 else layers + 1 + lay)
    if not feature:
        raise ConfigError(f"{where}: vision_feature_layer is an empty list")
    strategy = d.get("vision_feature_select_strategy", "full" if onevision else "default")
    if strategy not in ("default", "full"):
        raise ConfigError(f"{where}: vision_feature_select_strategy {strategy!r} is not "
                          "\"default\" or \"full\"")
    act = d.get("projector_hidden_act", "gelu")
    if act not in _VISION_ACTS:
        raise ConfigError(f"{where}: projector_hidden_act {act!r} is not supported "
                          f"({', '.join(_VISION_ACTS)})")
    token = d.get("image_token_index", d.get("image_token_id", 151_646 if onevision else 32000))
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ConfigError(f"{where}: image_token_index must be a token id, got {token!r}")
    pinpoints: tuple[tuple[int, int], ...] = ()
    if arch == "LlavaNextForConditionalGeneration":
        if strategy != "default":
            raise ConfigError(f"{where}: vision_feature_select_strategy {strategy!r} in {arch}: "
                              "its tiles' rows are arranged into a grid of (image / patch)^2 "
                              "per tile, which CLIP's CLS row does not fit (transformers' "
                              "LlavaNextModel fails on it too); \"default\" is read")
        pinpoints = _pinpoints(d.get("image_grid_pinpoints", _LLAVA_NEXT_PINPOINTS),
                               "image_grid_pinpoints", where, v["image_size"])
    anyres_max = 0
    if onevision:
        if strategy != "full":
            raise ConfigError(f"{where}: vision_feature_select_strategy {strategy!r} in {arch}: its "
                              "SigLIP tower has no CLS row, so \"default\" would drop a patch's "
                              "row and the tiles' rows no longer fill their grid (transformers' "
                              "LlavaOnevisionModel fails on it too); \"full\" is read")
        pinpoints = _pinpoints(d.get("image_grid_pinpoints") or _ONEVISION_PINPOINTS,
                               "image_grid_pinpoints", where, v["image_size"])
        ratio = d.get("vision_aspect_ratio", "anyres_max_9")
        m = re.fullmatch(r"anyres_max_([1-9][0-9]*)", ratio) if isinstance(ratio, str) else None
        if m is None:
            raise ConfigError(f"{where}: vision_aspect_ratio {ratio!r} is not read; \"anyres_max_N\" "
                              "(N a positive int: the tiles a grid is pooled down to) is")
        anyres_max = int(m.group(1))
        video = d.get("video_token_index", d.get("video_token_id", 151_647))
        if not isinstance(video, int) or isinstance(video, bool) or video < 0 or video == token:
            raise ConfigError(f"{where}: video_token_index must be a token id other than the image "
                              f"token's, got {video!r}")
    return VisionConfig(
        v["hidden_size"], v["intermediate_size"], layers, v["num_attention_heads"],
        v["num_channels"], v["image_size"], v["patch_size"], v["hidden_act"],
        float(v["layer_norm_eps"]), tuple(feature), strategy, act,
        bool(d.get("multimodal_projector_bias", True)), token,
        _image_processing(folder, v["image_size"], where, pinpoints), pinpoints,
        "siglip" if onevision else "clip", anyres_max, video if onevision else None)


# Qwen2VLTextConfig's / Qwen2_5_VLTextConfig's defaults (the published configs name them all)
_QWEN_VL_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=152_064, hidden_size=8192, intermediate_size=29_568, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=32_768,
    rms_norm_eps=1e-5, rope_theta=1_000_000.0, bos_token_id=151_643, eos_token_id=151_645)
# Qwen3VLTextConfig's (a Qwen3 text model: q / k norms, head_dim apart from the width)
_QWEN3_VL_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151_936, hidden_size=4096, intermediate_size=22_016, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=128_000,
    rms_norm_eps=1e-6, rope_theta=500_000.0)
# Qwen3VLMoeTextConfig's (a Qwen3-MoE text model; head_dim hidden_size / heads when absent)
_QWEN3_VL_MOE_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151_936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
    num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128_000,
    rms_norm_eps=1e-6, rope_theta=500_000.0, num_experts=60, num_experts_per_tok=4,
    moe_intermediate_size=1408, decoder_sparse_step=1)
# the vision config's fields that are no text model's (a flat config holds both)
_QWEN_VL_NOT_TEXT = ("vision_config", "text_config", "architectures", "model_type",
                     "image_token_id", "video_token_id", "vision_start_token_id",
                     "vision_end_token_id", "vision_token_id", "rope_scaling", "rope_parameters")


def _positive_ints(v: Any, key: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not v or not all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
        raise ConfigError(f"{where}: {key} must be a list of positive ints, got {v!r}")
    return tuple(v)


# A multimodal checkpoint's language-model prefixes (models/multimodal._TEXT_PREFIXES) as
# the text model's module names: what its quantization_config's ignore list is matched on
_VL_IGNORE_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head", "lm_head"))
_IGNORE_KEYS = ("modules_to_not_convert", "ignored_layers", "ignore")


def _vl_checkpoint_quantization(qc: Any, arch: str, where: str) -> dict[str, Any]:
    """A Qwen-VL checkpoint's ``quantization_config`` as its text model's: fp8 ones
    (FP8_CHECKPOINT_METHODS; Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE), their ignore
    lists' language-model names also written as the text model's (``model.language_model.layers.0.mlp.gate`` ->
    ``model.layers.0.mlp.gate``; "re:" patterns too); the tower's entries stay as written
    (its weights are read by models/qwen2_vl.load_image_encoder, e4m3 ones dequantized:
    models/fp8_checkpoint.fp8_tower_weights). Anything else is a ConfigError."""
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in FP8_CHECKPOINT_METHODS:
        raise ConfigError(f"{where}: {arch} checkpoints quantized with {method!r} are not read "
                          f"(fp8 ones are: quant_method {', '.join(FP8_CHECKPOINT_METHODS)}); "
                          "the 16-bit checkpoint is, and --quantization fp8 / int4 quantizes "
                          "its text model at load")
    out = dict(qc)
    for key in _IGNORE_KEYS:
        entries = out.get(key)
        if not isinstance(entries, list):
            continue  # (CheckpointQuantization.from_dict names a malformed one)
        extra = []
        for e in entries:
            if not isinstance(e, str):
                continue
            body, pre = (e[3:], "re:") if e.startswith("re:") else (e, "")
            for theirs, ours in _VL_IGNORE_PREFIXES:
                for t, o in ((theirs, ours), (re.escape(theirs), re.escape(ours))) if pre else \
                        ((theirs, ours),):
                    if body.startswith(t):
                        extra.append(pre + o + body[len(t):])
        out[key] = list(dict.fromkeys([*entries, *extra]))
    return out


def _qwen_vl_text_config(d: dict[str, Any], arch: str, where: str
                         ) -> tuple[dict[str, Any], str, tuple[int, ...]]:
    """A Qwen2-VL / Qwen2.5-VL checkpoint's text model as a Qwen2 config (text_config, or
    the top level of a flat published config), its ``where``, and its M-RoPE sections
    (rope_scaling {"type": "mrope", "mrope_section": [...]} or transformers 5's
    rope_parameters; Qwen2VLTextConfig's [16, 24, 24] when absent). Qwen3-VL's: a Qwen3
    config (Qwen3VLTextConfig's defaults; sections [24, 20, 20] when absent, always
    interleaved: transformers' Qwen3VLTextRotaryEmbedding reads no mrope_interleaved).
    Qwen3-VL-MoE's: a Qwen3-MoE config (Qwen3VLMoeTextConfig's defaults), its top-k weights
    always renormalized (transformers' Qwen3VLMoeTextTopKRouter reads no norm_topk_prob;
    the published configs say true)."""
    model_types, default_type, _ = MULTIMODAL_TEXT_ARCHITECTURES[arch]
    nested = d.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise ConfigError(f"{where}: text_config must be an object, got {nested!r}")
    tc = nested if nested is not None else {k: v for k, v in d.items() if k != "text_config"}
    text_where = f"{where}: text_config" if nested is not None else where
    text_type = (nested or {}).get("model_type") or default_type
    if text_type not in model_types:
        raise ConfigError(f"{where}: text_config.model_type {text_type!r} is not supported in "
                          f"{arch} (supported: {', '.join(model_types)})")
    qc = d.get("quantization_config") if d.get("quantization_config") is not None else \
        tc.get("quantization_config")
    if qc is not None:
        qc = _vl_checkpoint_quantization(qc, arch, where)
    rope = tc.get("rope_scaling") or tc.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{text_where}: rope_scaling must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ConfigError(f"{text_where}: rope type {kind!r} is not supported with M-RoPE in {arch} "
                          "(mrope / default are)")
    v3 = arch in QWEN3_VL_ARCHITECTURES
    moe = arch == "Qwen3VLMoeForConditionalGeneration"
    section = _positive_ints(rope.get("mrope_section", [24, 20, 20] if v3 else [16, 24, 24]),
                             "mrope_section", text_where)
    defaults = _QWEN3_VL_MOE_TEXT_DEFAULTS if moe else _QWEN3_VL_TEXT_DEFAULTS if v3 else _QWEN_VL_TEXT_DEFAULTS
    theta = tc.get("rope_theta", rope.get("rope_theta", defaults["rope_theta"]))
    family = "qwen3_moe" if moe else "qwen3" if v3 else "qwen2"
    given = {k: v for k, v in tc.items() if k not in _QWEN_VL_NOT_TEXT}
    if moe and "num_local_experts" in given:  # transformers 5 writes num_experts so
        given["num_experts"] = given.pop("num_local_experts")
    text = {**defaults, **given,
            "model_type": family, "architectures": [_MODEL_TYPE_TO_ARCH[family]], "rope_theta": theta}
    if moe:
        text["norm_topk_prob"] = True
    text.pop("quantization_config", None)
    if qc is not None:
        text["quantization_config"] = qc
    for key in _TOP_LEVEL_FIELDS:
        if d.get(key) is not None:
            text[key] = d[key]
    return text, text_where, section


@dataclass(frozen=True)
class QwenImageProcessing:
    """Qwen2VLImageProcessor's steps (models/qwen2_vl_image.py): smart_resize to multiples
    of patch_size x merge_size with min_pixels <= h x w <= max_pixels, rescale, normalize,
    patches [grid_h x grid_w, 3 x temporal_patch_size x patch x patch]."""

    min_pixels: int
    max_pixels: int
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    resample: str = "bicubic"
    convert_rgb: bool = True


@dataclass(frozen=True)
class QwenVisionConfig:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint's image side (models/qwen2_vl.py,
    qwen3_vl.py). ``variant``: "qwen2_vl" (LayerNorm blocks, fc1 / fc2 MLP of
    ``hidden_act``, full attention), "qwen2_5_vl" (RMSNorm blocks, gated MLP, window
    attention but in ``fullatt_block_indexes``) or "qwen3_vl" (LayerNorm blocks, a learned
    position embedding of ``num_position_embeddings`` interpolated to each grid, deepstack
    mergers after ``deepstack_visual_indexes``). ``hidden_size``: the tower's width;
    ``out_hidden_size``: the merger's output (the text model's hidden size)."""

    variant: str
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    processing: QwenImageProcessing
    # Qwen2VLVideoProcessor's bounds and steps (its own defaults differ from the image
    # processor's): None = the image processor's (a config built by hand)
    video_processing: QwenImageProcessing | None = None
    # Qwen2.5-VL: a video's temporal M-RoPE index is grid index x second_per_grid x
    # tokens_per_second (engine/mrope.py); 0 for Qwen2-VL (the grid index itself)
    tokens_per_second: float = 0.0
    # vLLM's mm_processor_kwargs {"fps": ...}: the frame rate of a video given as frames
    # without its own (None: transformers' default, 24)
    video_fps: float | None = None
    # Qwen3-VL: the learned position table's entries (a square side^2) and the tower blocks
    # after which a deepstack merger takes features (models/qwen3_vl.py)
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def patch_dim(self) -> int:
        """One patch's values: 3 x temporal_patch_size x patch_size^2 (1176 for 14 / 2)."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2


_QWEN_VISION_ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu")


_QWEN_IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil",
                          "Qwen2_5_VLImageProcessor")


def _qwen_image_processing(folder: str | None, vc: dict[str, Any], where: str,
                           kinds: tuple[str, ...] = _QWEN_IMAGE_PROCESSORS,
                           bounds: tuple[int, int] = (56 * 56, 28 * 28 * 1280)) -> QwenImageProcessing:
    """The folder's preprocessor_config.json (Qwen2VLImageProcessor's fields: min_pixels /
    max_pixels or size {shortest_edge, longest_edge}; transformers' defaults for those it
    leaves out), checked against the tower's patch sizes. ``kinds``: the image_processor_type
    names read (the first the default), ``bounds``: the class's default pixel bounds
    (GLM-4.1V's Glm4vImageProcessor: models/glm4v_config.py)."""
    path = os.path.join(folder, "preprocessor_config.json") if folder else None
    pc = _json_object(path) if path is not None and os.path.isfile(path) else {}
    where = path or where
    kind = pc.get("image_processor_type", kinds[0])
    if kind not in kinds:
        raise ConfigError(f"{where}: image_processor_type {kind!r} is not read ({kinds[0]} is)")
    raw_size = pc.get("size")
    size: dict[str, Any] = raw_size if isinstance(raw_size, dict) else {}
    lo: Any = pc.get("min_pixels", size.get("shortest_edge", bounds[0]))
    hi: Any = pc.get("max_pixels", size.get("longest_edge", bounds[1]))
    for key, v in (("min_pixels", lo), ("max_pixels", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{where}: {key} must be a positive int, got {v!r}")
    if lo > hi:
        raise ConfigError(f"{where}: min_pixels {lo} is above max_pixels {hi}")
    for key, ours in (("patch_size", vc["patch_size"]), ("temporal_patch_size", vc["temporal_patch_size"]),
                      ("merge_size", vc["spatial_merge_size"])):
        if key in pc and pc[key] != ours:
            raise ConfigError(f"{where}: {key} {pc[key]!r} differs from the vision tower's {ours}")
    if not pc.get("do_resize", True):
        raise ConfigError(f"{where}: do_resize false is not read (images must become multiples "
                          "of patch_size x merge_size)")
    return QwenImageProcessing(lo, hi, *pixel_steps(pc, where))


# Qwen2VLVideoProcessor's class defaults: 128 to 768 merged units of 28 x 28 per frame
QWEN_VIDEO_MIN_PIXELS = 128 * 28 * 28
QWEN_VIDEO_MAX_PIXELS = 768 * 28 * 28
# Qwen3VLVideoProcessor's: 128 to 768 merged units of 32 x 32, over the whole video's frames
# (models/qwen3_vl_video.smart_resize_video), mean / std 0.5
QWEN3_VIDEO_MIN_PIXELS = 128 * 32 * 32
QWEN3_VIDEO_MAX_PIXELS = 768 * 32 * 32


def video_processor_fields(folder: str | None, where: str) -> tuple[dict[str, Any], str]:
    """A Qwen-VL checkpoint's video processor's fields as transformers finds them:
    processor_config.json's "video_processor", else video_preprocessor_config.json, else
    (older checkpoints) preprocessor_config.json; {} and ``where`` without any. With the file
    read (the name errors give)."""
    if folder:
        proc = os.path.join(folder, "processor_config.json")
        nested = _json_object(proc).get("video_processor") if os.path.isfile(proc) else None
        if isinstance(nested, dict):
            return nested, proc
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return _json_object(path), path
    return {}, where


def _qwen_video_processing(folder: str | None, where: str, v3: bool = False,
                           bounds: tuple[int, int] | None = None) -> QwenImageProcessing:
    """Qwen2VLVideoProcessor's settings as transformers finds them: processor_config.json's
    "video_processor", else video_preprocessor_config.json, else (older checkpoints)
    preprocessor_config.json; its min_pixels / max_pixels or size {shortest_edge,
    longest_edge}, the class defaults (QWEN_VIDEO_*) for those left out. ``v3``:
    Qwen3VLVideoProcessor's (QWEN3_VIDEO_* and mean / std 0.5 by default). ``bounds``: other
    default bounds (GLM-4.1V's Glm4vVideoProcessor: CLIP's mean / std)."""
    pc, where = video_processor_fields(folder, where)
    raw_size = pc.get("size")
    size: dict[str, Any] = raw_size if isinstance(raw_size, dict) else {}
    if bounds is None:
        bounds = (QWEN3_VIDEO_MIN_PIXELS, QWEN3_VIDEO_MAX_PIXELS) if v3 else \
            (QWEN_VIDEO_MIN_PIXELS, QWEN_VIDEO_MAX_PIXELS)
    lo: Any = pc.get("min_pixels", size.get("shortest_edge", bounds[0]))
    hi: Any = pc.get("max_pixels", size.get("longest_edge", bounds[1]))
    if v3:
        pc = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, **pc}
    for key, v in (("video min_pixels", lo), ("video max_pixels", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{where}: {key} must be a positive int, got {v!r}")
    if lo > hi:
        raise ConfigError(f"{where}: the video processor's min_pixels {lo} is above its max_pixels {hi}")
    return QwenImageProcessing(lo, hi, *pixel_steps(pc, where))


def _qwen_vision_config_of(d: dict[str, Any], arch: str, where: str, folder: str | None,
                           text_hidden: int) -> QwenVisionConfig:
    """A Qwen2-VL / Qwen2.5-VL checkpoint's QwenVisionConfig: vision_config (transformers'
    names and the published files' older ones: embed_dim, in_chans), the top-level token
    ids, preprocessor_config.json (folder)."""
    vc = d.get("vision_config") or {}
    if not isinstance(vc, dict):
        raise ConfigError(f"{where}: vision_config must be an object, got {vc!r}")
    w = f"{where}: vision_config"
    v25 = arch == "Qwen2_5_VLForConditionalGeneration"
    v3 = arch in QWEN3_VL_ARCHITECTURES
    if v3:  # Qwen3VLVisionConfig's (and Qwen3VLMoeVisionConfig's) defaults
        width = vc.get("hidden_size", 1152)
        inter = vc.get("intermediate_size", 4304)
        out = vc.get("out_hidden_size", 3584)
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
    elif v25:
        width = vc.get("hidden_size", 3584)
        inter = vc.get("intermediate_size", 3420)
        out = vc.get("out_hidden_size", 3584)
        act = vc.get("hidden_act", "silu")
    else:  # Qwen2VLVisionConfig: embed_dim is the tower's width, hidden_size the merger's output
        width = vc.get("embed_dim", 1280)
        ratio = vc.get("mlp_ratio", 4)
        if not isinstance(ratio, (int, float)) or ratio <= 0:
            raise ConfigError(f"{w}.mlp_ratio must be a positive number, got {ratio!r}")
        inter = int(width * ratio) if isinstance(width, int) else width
        out = vc.get("hidden_size", 3584)
        act = vc.get("hidden_act", "quick_gelu")
    v = dict(depth=vc.get("depth", 27 if v3 else 32), hidden_size=width, num_heads=vc.get("num_heads", 16),
             intermediate_size=inter, out_hidden_size=out, patch_size=vc.get("patch_size", 16 if v3 else 14),
             temporal_patch_size=vc.get("temporal_patch_size", 2),
             spatial_merge_size=vc.get("spatial_merge_size", 2),
             window_size=vc.get("window_size", 112) if v25 else 0)
    for k, x in v.items():
        if not isinstance(x, int) or isinstance(x, bool) or x < (0 if k == "window_size" else 1):
            raise ConfigError(f"{w}.{k} must be a positive int, got {x!r}")
    if v["hidden_size"] % v["num_heads"] or (v["hidden_size"] // v["num_heads"]) % 4:
        raise ConfigError(f"{w}: the heads' width {v['hidden_size']} / {v['num_heads']} must be a "
                          "multiple of 4 (2-D rotary on halves of h and w)")
    channels = vc.get("in_channels", vc.get("in_chans", 3))
    if channels != 3:
        raise ConfigError(f"{w}.in_channels {channels!r}: only RGB (3) images are read")
    if act not in _QWEN_VISION_ACTS:
        raise ConfigError(f"{w}.hidden_act {act!r} is not supported ({', '.join(_QWEN_VISION_ACTS)})")
    if out != text_hidden:
        raise ConfigError(f"{w}: the merger's output ({'out_hidden_size' if v25 or v3 else 'hidden_size'} "
                          f"{out}) differs from the text model's hidden_size {text_hidden}")
    full: tuple[int, ...] = ()
    if v25:
        raw_full = vc.get("fullatt_block_indexes", [7, 15, 23, 31])
        if not isinstance(raw_full, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < v["depth"] for i in raw_full):
            raise ConfigError(f"{w}.fullatt_block_indexes must be block indexes in [0, "
                              f"{v['depth']}), got {raw_full!r}")
        full = tuple(raw_full)
    if v25 and v["window_size"] % (v["patch_size"] * v["spatial_merge_size"]):
        raise ConfigError(f"{w}.window_size {v['window_size']} is not a multiple of patch_size x "
                          f"spatial_merge_size ({v['patch_size'] * v['spatial_merge_size']})")
    rope = vc.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    tps: Any = vc.get("tokens_per_second", 4) if v25 else 0  # Qwen2_5_VLVisionConfig's default
    if not isinstance(tps, (int, float)) or isinstance(tps, bool) or tps < 0:
        raise ConfigError(f"{w}.tokens_per_second must be a non-negative number, got {tps!r}")
    tps = float(tps)
    tokens = {}
    for key, default in (("image_token_id", 151_655), ("video_token_id", 151_656),
                         ("vision_start_token_id", 151_652), ("vision_end_token_id", 151_653)):
        t = d.get(key, default)
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ConfigError(f"{where}: {key} must be a token id, got {t!r}")
        tokens[key] = t
    positions: int = 0
    deep: tuple[int, ...] = ()
    if v3:
        positions, deep = _qwen3_vision_fields(vc, w, v["depth"])
    return QwenVisionConfig("qwen3_vl" if v3 else "qwen2_5_vl" if v25 else "qwen2_vl", v["depth"], width,
                            v["num_heads"], inter, act, out, v["patch_size"], v["temporal_patch_size"],
                            v["spatial_merge_size"], v["window_size"], full, theta,
                            processing=_qwen_image_processing(folder, v, where),
                            video_processing=_qwen_video_processing(folder, where, v3),
                            tokens_per_second=tps, num_position_embeddings=positions,
                            deepstack_visual_indexes=deep, **tokens)


def _qwen3_vision_fields(vc: dict[str, Any], w: str, depth: int) -> tuple[int, tuple[int, ...]]:
    """Qwen3VLVisionConfig's num_position_embeddings (a square: transformers interpolates a
    side x side table) and deepstack_visual_indexes (distinct block indexes)."""
    n = vc.get("num_position_embeddings", 2304)
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or math.isqrt(n) ** 2 != n:
        raise ConfigError(f"{w}.num_position_embeddings must be a positive square int (a side x side "
                          f"table), got {n!r}")
    raw = vc.get("deepstack_visual_indexes", [8, 16, 24])
    if not isinstance(raw, (list, tuple)) or len(set(raw)) != len(raw) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth for i in raw):
        raise ConfigError(f"{w}.deepstack_visual_indexes must be distinct block indexes in [0, {depth}), "
                          f"got {raw!r}")
    return n, tuple(raw)


def _image_config_of(d: dict[str, Any], arch: str, where: str, folder: str | None
                     ) -> (VisionConfig | PixtralVisionConfig | Gemma3VisionConfig | InternVLVisionConfig
                           | Idefics3VisionConfig):
    """The image side of an IMAGE_ARCHITECTURES checkpoint: a Pixtral tower's
    (models/pixtral_config.py: Mistral3, LLaVA with vision_config.model_type "pixtral"),
    Gemma 3's SigLIP tower's (models/gemma3_config.py), InternVL's InternViT
    (models/internvl_config.py), else LLaVA's CLIP tower's (_vision_config_of)."""
    vc = d.get("vision_config")
    if arch == "Gemma3ForConditionalGeneration":
        from flashpage.models.gemma3_config import gemma3_vision_config_of

        return gemma3_vision_config_of(d, arch, where, folder)
    if arch in ("InternVLForConditionalGeneration", "InternVLChatModel"):
        from flashpage.models.internvl_config import internvl_vision_config_of

        return internvl_vision_config_of(d, arch, where, folder)
    if arch in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        from flashpage.models.idefics3_config import idefics3_vision_config_of

        return idefics3_vision_config_of(d, arch, where, folder)
    if arch == "Mistral3ForConditionalGeneration" or \
            (isinstance(vc, dict) and vc.get("model_type") == "pixtral"):
        from flashpage.models.pixtral_config import pixtral_vision_config_of

        return pixtral_vision_config_of(d, arch, where, folder)
    return _vision_config_of(d, arch, where, folder)


def read_config_json(source: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """A ``config.json`` (the file or its folder) -> (its path, its object); a ConfigError
    names a missing file, bad JSON or a value other than an object."""
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json at {path}")
    return path, _json_object(path)


def _json_object(path: str) -> dict[str, Any]:
    """The JSON object in file ``path``; a ConfigError for bad JSON or another value."""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return d


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    # the norms' epsilon (Cohere's, Starcoder2's, GPT-2's, GPT-NeoX's, Phi's LayerNorms' too)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v
    # o_proj's bias where a family sets it apart from q/k/v's (Seed-OSS's attention_out_bias);
    # None: with attention_bias, but for Qwen2 / Qwen2-MoE (none): o_proj_bias
    attention_out_bias: bool | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on each head of q and k
    sliding_window: int | None = None
    # Gemma 2/3, Cohere2: each layer's LAYER_TYPES entry (attention_window); (): every layer
    # as sliding_window says
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float | None = None  # Gemma 2/3: scores scaled by its -1/2 power
    attn_logit_softcapping: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rope base (no scaling)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    # MLA (DeepSeek-V2/V3)
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE: DeepSeek-V2/V3's names, every family's meaning (config._llama_moe_fields maps
    # Mixtral's num_local_experts, Qwen's num_experts to n_routed_experts; Mixtral's
    # intermediate_size to moe_intermediate_size); which layers are MoE: is_moe_layer
    n_routed_experts: int | None = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1  # Qwen MoE: layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # the one shared expert beside the routed ones: Qwen2-MoE's (sigmoid-gated),
    # GraniteMoeShared's shared_mlp (shared_intermediate_size; not gated)
    shared_expert_intermediate_size: int = 0
    # Phi-3: rotary on the first rotary_dim = int(head_dim * partial_rotary_factor) dims of a head
    partial_rotary_factor: float = 1.0
    # Granite: embeddings x embedding_multiplier; each attention / MLP output x
    # residual_multiplier before its residual add; attention scale attention_multiplier
    # (None: head_dim ** -0.5); logits / logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Cohere: logits x logit_scale; rotary on interleaved pairs (x[2i], x[2i + 1]), GPT-J's
    # layout, instead of halves (x[i], x[i + rot_dim / 2])
    logit_scale: float = 1.0
    rope_interleaved: bool = False
    # the layers that take no positional embedding at all (NoPE: q and k unrotated;
    # uses_rope): Cohere2's full-attention layers (layer_types), SmolLM3's no_rope_layers zeros
    nope_layers: tuple[int, ...] = ()
    # Starcoder2: the MLP's c_fc / c_proj have a bias (use_bias, with attention_bias); GPT-2's,
    # GPT-NeoX's and Phi's MLPs (under their names) always
    mlp_bias: bool = False
    # OLMo (1): q, k and v clamped to [-clip_qkv, clip_qkv] after their projections; OLMoE:
    # after its q/k norms (None: not clamped)
    clip_qkv: float | None = None
    # GPT-2, GPT-BigCode, OPT: learned absolute position embeddings (wpe: max_position_embeddings
    # rows, so a hard limit on max_model_len) added to the token embeddings; no rotary
    learned_positions: bool = False
    # OPT: position p reads the learned row p + position_offset (2: its embed_positions has
    # max_position_embeddings + 2 rows)
    position_offset: int = 0
    # OPT: False (OPT-350m): post-LN, each LayerNorm after its residual add, x = norm(x + f(x))
    do_layer_norm_before: bool = True
    # a norm after the last layer (OPT: none with do_layer_norm_before false or
    # _remove_final_layer_norm)
    final_norm: bool = True
    # OPT's layer_norm_elementwise_affine: False: its LayerNorms have no weight and no bias
    norm_elementwise_affine: bool = True
    # OPT: the token embeddings' (and the LM head's) width, projected in to hidden_size and
    # out from it (project_in / project_out) where it differs (OPT-350m: 512 of 1024)
    word_embed_proj_dim: int | None = None
    # GPT-2: q.k scaled by head_dim ** -0.5 unless scale_attn_weights is false (then 1), and
    # also by 1 / (layer + 1) with scale_attn_by_inverse_layer_idx (BigCode reads the first)
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    # GPT-NeoX: attention reads input_layernorm(x), the MLP post_attention_layernorm(x), both
    # added to x (models/common.ParallelDecoderLayer); False: the MLP after attention.
    # Falcon: its parallel layer (new_decoder_architecture or parallel_attn), norms below
    use_parallel_residual: bool = False
    lm_head_bias: bool = False  # Phi-1/1.5/2, GPT-J: the LM head has a bias
    # ALiBi (Bloom, MPT, Falcon-RW): per-head linear position biases in attention instead of
    # rotary (layers/alibi.py); MPT's slopes follow alibi_bias_max (None: Bloom's sequence)
    alibi: bool = False
    alibi_bias_max: float | None = None
    # Falcon: the norms of a parallel layer (use_parallel_residual): 2 (ln_attn for attention,
    # ln_mlp for the MLP, both of x: Falcon-40B/180B, as GPT-NeoX's) or 1 whose output both
    # read (Falcon-7B, Falcon2-11B)
    parallel_norms: int = 2
    # GPT-OSS: the checkpoint's experts are MXFP4 (quantization_config quant_method mxfp4:
    # ..._blocks / ..._scales tensors), read by models/mxfp4.py: kept in MXFP4 for the fused
    # MoE kernel where it runs, else dequantized to the model dtype at load
    mxfp4_experts: bool = False
    # not from config.json: set by the loader (models/loader.load_model's mxfp4_kernel, the
    # engine's choice: envs.mxfp4) when the experts are held in MXFP4 (layers/moe.FusedExperts
    # mxfp4) rather than dequantized
    mxfp4_kernel: bool = False
    # GPT-OSS: a learned logit per query head in each softmax denominator (attention sinks,
    # kernels/sinks.py); its experts' clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate)
    # with gate <= limit and |up| <= limit (models/gpt_oss.py)
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # fp8 / int4 checkpoints (HF quantization_config): how their weights are stored; None: 16/32-bit
    quantization_config: CheckpointQuantization | None = None
    # a sequence classifier (CLASSIFIER_ARCHITECTURES; 0 for any other model): its labels
    # (id2label's names in id order) and what turns its logits into probabilities
    # (classifier_activation: "softmax", "sigmoid" or "identity")
    num_labels: int = 0
    labels: tuple[str, ...] = ()
    score_activation: str = "softmax"
    # a classifier built at load from a causal LM's head (vLLM's hf_overrides
    # classifier_from_token / method; models/seq_cls_from_lm.py): the tokens whose LM head
    # rows make ``score`` and how ("from_2_way_softmax": one label, row[1] - row[0];
    # "no_post_processing": one label per token, its row); () for a checkpoint's own head
    classifier_from_token: tuple[str, ...] = ()
    classifier_method: str = ""
    # vLLM's use_pad_token: LLM.score joins a pair by the tokenizer's pair encoding (True, a
    # cross-encoder's way) or as the one text text_1 + text_2 (False: the default of a
    # classifier made from an LM head, whose prompt template the user splits between them)
    use_pad_token: bool = True
    # Llama 4: its "chunked_attention" layers (layer_types) see the keys of their query's
    # chunk alone (attention_chunk); q and k L2-normed per head after rotary on the rotary
    # layers (qk_l2_norm, no weight); on the NoPE layers q x 1 + attn_scale x
    # log1p(floor((p + 1) / floor_scale)) (nope_attn_temperature: (floor_scale, attn_scale))
    attention_chunk_size: int | None = None
    qk_l2_norm: bool = False
    nope_attn_temperature: tuple[float, float] | None = None
    # a multimodal checkpoint served as its text model alone (MULTIMODAL_TEXT_ARCHITECTURES):
    # the wrapper's architecture ("Gemma3ForConditionalGeneration"; "" for any other model);
    # ``architecture``, ``model_type`` and every field above are the text model's, ``raw`` its
    # text_config (with the top-level fields _text_config_of reads)
    multimodal_architecture: str = ""
    # a multimodal checkpoint whose images we run (IMAGE_ARCHITECTURES): its vision tower,
    # projector, image token and preprocessing (VisionConfig); None for any other model
    # (Qwen2-VL / Qwen2.5-VL: QwenVisionConfig, models/qwen2_vl.py)
    # (Pixtral towers: models/pixtral_config.PixtralVisionConfig)
    # (Gemma 3's SigLIP tower: models/gemma3_config.Gemma3VisionConfig; InternVL's InternViT:
    # models/internvl_config.InternVLVisionConfig)
    vision: (VisionConfig | QwenVisionConfig | PixtralVisionConfig | Gemma3VisionConfig
             | InternVLVisionConfig | Idefics3VisionConfig | None) = None
    # a multimodal checkpoint whose audio we run (AUDIO_ARCHITECTURES: Qwen2-Audio): its
    # encoder, projector, audio token and feature extraction
    # (models/qwen2_audio_config.Qwen2AudioConfig); None for any other model
    audio: Qwen2AudioConfig | None = None
    # M-RoPE (Qwen2-VL): the rotated pairs' split among the (t, h, w) position components
    # (layers/rotary.MRotaryEmbedding, engine/mrope.py); (): 1-D rope
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL's interleaved layout: pair i by t, h, w in turn (i % 3) while each component
    # has pairs left, then by t (layers/rotary.MRotaryEmbedding); False: contiguous sections
    mrope_interleaved: bool = False
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ loading
    @staticmethod
    def from_hf(source: str | os.PathLike[str] | dict[str, Any],
                hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
        """Read a HF ``config.json`` (a path to the file or its folder, or the dict), with
        ``hf_overrides`` (vLLM's) over it: apply_hf_overrides."""
        if isinstance(source, dict):
            d = dict(source)
            where = "config"
        else:
            where, d = read_config_json(source)
        if hf_overrides is not None:
            d = apply_hf_overrides(d, hf_overrides)
            where = f"{where} with hf_overrides"
        return ModelConfig._from_dict(d, where, None if where == "config" else os.path.dirname(where))

    @property
    def pair_family(self) -> str:
        """How LLM.score joins a pair (encoder/engine.py join_pair): the tokenizer's pair
        encoding ("decoder"), or text_1 + text_2 as one text ("concat", use_pad_token false)."""
        return "decoder" if self.use_pad_token else "concat"

    @property
    def is_classifier(self) -> bool:
        """A sequence classifier (LLM.classify, /classify; one label: LLM.score too)."""
        return self.architecture in CLASSIFIER_ARCHITECTURES

    @staticmethod
    def _from_dict(d: dict[str, Any], where: str, folder: str | None = None) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), "")
        arch = _ARCH_ALIASES.get(arch, arch)
        if arch in _UNSUPPORTED_IMAGE_ARCHITECTURES:
            raise ConfigError(f"{where}: {arch}: {_UNSUPPORTED_IMAGE_ARCHITECTURES[arch]}")
        if arch in QWEN_VL_ARCHITECTURES:
            text, text_where, section = _qwen_vl_text_config(d, arch, where)
            cfg = ModelConfig._from_dict(text, text_where, folder)
            if 2 * sum(section) != cfg.rotary_dim:
                raise ConfigError(f"{text_where}: mrope_section {list(section)} sums to "
                                  f"{sum(section)}, not half the rotary width ({cfg.rotary_dim} / 2)")
            qv = _qwen_vision_config_of(d, arch, where, folder, cfg.hidden_size)
            if len(qv.deepstack_visual_indexes) > cfg.num_hidden_layers:
                raise ConfigError(f"{where}: vision_config.deepstack_visual_indexes has "
                                  f"{len(qv.deepstack_visual_indexes)} entries (each added after one "
                                  f"decoder layer) but the text model has {cfg.num_hidden_layers} layers")
            return replace(cfg, multimodal_architecture=arch, mrope_section=section,
                           mrope_interleaved=arch in QWEN3_VL_ARCHITECTURES, vision=qv)
        if arch in GLM4V_ARCHITECTURES:
            from flashpage.models.glm4v_config import glm4v_text_config, glm4v_vision_config_of

            text, text_where, section = glm4v_text_config(d, arch, where)
            cfg = ModelConfig._from_dict(text, text_where, folder)
            if 2 * sum(section) != cfg.rotary_dim:
                raise ConfigError(f"{text_where}: mrope_section {list(section)} sums to "
                                  f"{sum(section)}, not half the rotary width ({cfg.rotary_dim} / 2: "
                                  "head_dim x partial_rotary_factor)")
            return replace(cfg, multimodal_architecture=arch, mrope_section=section,
                           vision=glm4v_vision_config_of(d, arch, where, folder, cfg.hidden_size))
        if arch in MULTIMODAL_TEXT_ARCHITECTURES:
            text, text_where = _text_config_of(d, arch, where)
            vision = _image_config_of(d, arch, where, folder) if arch in IMAGE_ARCHITECTURES \
                else None
            audio = None
            if arch in AUDIO_ARCHITECTURES:
                from flashpage.models.qwen2_audio_config import qwen2_audio_config_of

                audio = qwen2_audio_config_of(d, arch, where, folder)
            return replace(ModelConfig._from_dict(text, text_where, folder),
                           multimodal_architecture=arch, vision=vision, audio=audio)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{where}: architecture {arch or d.get('model_type')!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}; with image input: "
                f"{', '.join(sorted(IMAGE_ARCHITECTURES))}; with audio input: "
                f"{', '.join(sorted(AUDIO_ARCHITECTURES))}; their text model alone: "
                f"{', '.join(sorted(set(MULTIMODAL_TEXT_ARCHITECTURES) - IMAGE_ARCHITECTURES - AUDIO_ARCHITECTURES))}"
            )
        if arch in GPT2_FAMILY or arch == "GPTJForCausalLM":
            d = _gpt2_names(d, arch, where)
        elif arch == "FalconForCausalLM":
            d = _falcon_names(d, where)
        elif arch == "OPTForCausalLM":
            d = _opt_names(d, where)
        elif arch == "BloomForCausalLM":
            d = _bloom_names(d, where)
        elif arch == "MptForCausalLM":
            d = _mpt_names(d, where)
        required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
        if arch in LLAMA_FAMILY | LLAMA_VARIANTS | {"GlmForCausalLM", "Glm4ForCausalLM"}:
            required.append("intermediate_size")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ConfigError(f"{where}: missing required field(s): {', '.join(missing)}")
        for k in required:
            if not isinstance(d[k], int) or d[k] <= 0:
                raise ConfigError(f"{where}: {k} must be a positive integer, got {d[k]!r}")

        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        # MLA caches one latent shared by all heads: num_key_value_heads means nothing there
        # (transformers' DeepseekV3Config defaults it to 128 whatever the head count).
        if d.get("kv_lora_rank") is None and heads % kv_heads != 0:
            raise ConfigError(
                f"{where}: num_attention_heads ({heads}) is not a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        eos = d.get("eos_token_id")
        eos_t: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        model_type = d.get("model_type", "")
        sliding = d.get("sliding_window")
        if (model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
                and not d.get("use_sliding_window", False)):
            sliding = None
        # transformers >= 5 writes rope_theta and the scaling under rope_parameters.
        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        if (model_type == "phi3" and isinstance(rope_scaling, dict)
                and rope_scaling.get("rope_type", rope_scaling.get("type")) in ("su", "yarn")):
            rope_scaling = {**rope_scaling, "rope_type": "longrope"}  # Phi3Config's old names
        if (arch != "Phi3ForCausalLM" and isinstance(rope_scaling, dict)
                and rope_scaling.get("rope_type", rope_scaling.get("type")) == "longrope"):
            raise ConfigError(f"{where}: rope_scaling type 'longrope' is read for "
                              f"Phi3ForCausalLM only, not {arch}")
        num_labels, activation = 0, "softmax"
        labels: tuple[str, ...] = ()
        from_token, method = classifier_from_token(d, where)
        if arch in CLASSIFIER_ARCHITECTURES:
            if from_token:  # the head's labels are the tokens' (vLLM sets num_labels so too)
                n = 1 if method == "from_2_way_softmax" else len(from_token)
                d = {**d, "num_labels": n, "id2label": None if n == 1 else dict(enumerate(from_token))}
            num_labels, labels = classifier_labels(d, where)
            activation = classifier_activation(d, folder, num_labels)
        moe = _llama_moe_fields(d, arch, where) if arch in LLAMA_MOE_FAMILY else {}
        variant = (_variant_fields(d, arch, where, head_dim, rope_scaling)
                   if arch in LLAMA_VARIANTS else
                   _gpt2_fields(d, arch, where) if arch in GPT2_FAMILY else
                   _bloom_fields(d, where) if arch == "BloomForCausalLM" else
                   _mpt_fields(d, where) if arch == "MptForCausalLM" else
                   _gpt_oss_fields(d, where) if arch in GPT_OSS_FAMILY else
                   _glm_fields(d, arch, where) if arch in GLM_FAMILY else
                   _llama4_fields(d, where) if arch == "Llama4ForCausalLM" else {})
        # Qwen2-MoE names its q/k/v bias qkv_bias (on unless set false, as Qwen2's)
        bias = (d.get("qkv_bias", True) if model_type == "qwen2_moe"
                else d.get("attention_bias", model_type == "qwen2"))
        hidden_act = d.get("hidden_act", "silu")
        gemma: dict[str, Any] = {}
        if arch in GEMMA_FAMILY:
            gemma = _gemma_fields(d, where, model_type)
            hidden_act, sliding = gemma.pop("hidden_act"), gemma.pop("sliding_window")
            rope_theta = gemma.pop("rope_theta", rope_theta)
            rope_scaling = gemma.pop("rope_scaling", rope_scaling)
        return replace(ModelConfig(
            architecture=arch,
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size") or 0,
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings") or 2048,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            # (a family reader's own, HunYuan's "dynamic" alpha rope, replaces it: not parsed)
            rope_scaling=None if "rope_scaling" in variant else RopeScaling.from_dict(rope_scaling),
            hidden_act=hidden_act,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch in GEMMA_FAMILY)),
            attention_bias=bool(bias),
            qk_norm=gemma.pop("qk_norm", model_type in ("qwen3", "qwen3_moe")),
            sliding_window=sliding,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_t,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            kv_lora_rank=d.get("kv_lora_rank"),
            q_lora_rank=d.get("q_lora_rank"),
            qk_nope_head_dim=d.get("qk_nope_head_dim") or 0,
            qk_rope_head_dim=d.get("qk_rope_head_dim") or 0,
            v_head_dim=d.get("v_head_dim") or 0,
            n_routed_experts=d.get("n_routed_experts"),
            n_shared_experts=d.get("n_shared_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok") or 0,
            moe_intermediate_size=d.get("moe_intermediate_size") or 0,
            first_k_dense_replace=d.get("first_k_dense_replace") or 0,
            moe_layer_freq=d.get("moe_layer_freq") or 1,
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            topk_method=d.get("topk_method") or "greedy",
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            scoring_func=d.get("scoring_func") or "softmax",
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            quantization_config=_checkpoint_quantization(d, arch, where),
            num_labels=num_labels,
            labels=labels,
            score_activation=activation,
            classifier_from_token=from_token if arch in CLASSIFIER_ARCHITECTURES else (),
            classifier_method=method if arch in CLASSIFIER_ARCHITECTURES else "",
            use_pad_token=bool(d.get("use_pad_token", not from_token)),
            raw=d,
            **gemma,
        ), **moe, **variant)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the mixture of experts: DeepSeek's rule
        (``first_k_dense_replace``, ``moe_layer_freq``), else Qwen's (``mlp_only_layers``,
        ``decoder_sparse_step``; Mixtral: every layer)."""
        if not self.n_routed_experts:
            return False
        if self.architecture in DEEPSEEK_FAMILY:
            return layer >= self.first_k_dense_replace and layer % max(self.moe_layer_freq, 1) == 0
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    # --------------------------------------------------------------- attention
    def attention_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to the whole context)."""
        if self.layer_types and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    def attention_chunk(self, layer: int) -> int | None:
        """The chunk of layer ``layer``'s chunked local attention (Llama 4): a query at p
        sees keys j <= p with j // chunk == p // chunk; None: no chunks."""
        if self.layer_types and self.layer_types[layer] == "chunked_attention":
            return self.attention_chunk_size
        return None

    @property
    def o_proj_bias(self) -> bool:
        """Whether o_proj has a bias: ``attention_out_bias`` where set, else with q/k/v's
        (``attention_bias``; Llama, Granite, OLMo2), but never for Qwen2 / Qwen2-MoE."""
        if self.attention_out_bias is not None:
            return self.attention_out_bias
        return self.attention_bias and self.model_type not in ("qwen2", "qwen2_moe")

    def uses_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates q and k (all but ``nope_layers``, and none with
        learned positions or ALiBi)."""
        return not self.learned_positions and not self.alibi and layer not in self.nope_layers

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by: query_pre_attn_scalar ** -0.5 (Gemma 2/3), else head_dim's."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rotary rotates (Phi-4-mini: 3/4 of them)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def attention_kind(self) -> str:
        """MLA if ``kv_lora_rank`` is set (whatever the head counts say), else MHA/MQA/GQA."""
        if self.is_mla:
            return "MLA"
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        if self.num_key_value_heads == 1:
            return "MQA"
        return "GQA"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (for MLA: all heads share the one latent)."""
        if self.is_mla:
            return self.num_attention_heads
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """Number of cached scalars per token per layer."""
        if self.is_mla:
            assert self.kv_lora_rank is not None
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_key_value_heads * self.head_dim

    @property
    def mha_values_per_token_per_layer(self) -> int:
        """Cached scalars per token per layer of the MHA form of the same model."""
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            return self.num_attention_heads * (qk + self.v_head_dim)
        return 2 * self.num_attention_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: str = "bfloat16", per_layer: bool = False) -> int:
        nbytes = dtype_bytes(dtype)
        per = self.kv_values_per_token_per_layer * nbytes
        return per if per_layer else per * self.num_hidden_layers


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the paged K/V cache for EngineConfig.kv_cache_dtype."""
    import torch

    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def dtype_bytes(dtype: str) -> int:
    key = str(dtype).replace("torch.", "").lower()
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of float32, float16, bfloat16, fp8")
    return DTYPE_BYTES[key]


@dataclass
class EngineConfig:
    """Serving knobs. Defaults follow vLLM's where a user would expect them."""

    model: str | None = None
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: sized from memory
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's --kv-offloading-size: GiB of host (CPU) memory for a second tier of the prefix
    # cache (engine/kv_offload.py): blocks the GPU pool evicts are copied there and loaded
    # back on a later prefix hit instead of recomputed; 0: off. Backend: "native" only.
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    # Fraction of KV blocks that admission leaves free for running requests to grow into:
    # 1% cut recomputation from preemption from 38% to 15% of the tokens in the memory
    # benchmark (benchmarks/results/memory.md) for 0.4% more steps.
    kv_watermark: float = 0.01
    # vLLM's long_prefill_token_threshold: at most this many of a prompt's tokens a step
    # (0: up to the whole budget), so several long prompts advance side by side and none
    # takes the budget alone for many steps
    long_prefill_token_threshold: int = 0
    # vLLM's --disable-hybrid-kv-cache-manager: a model whose layers mix a sliding window
    # with full attention keeps one block table for all of them (every layer holds every
    # token) instead of KV cache groups that give the windowed layers' blocks back
    disable_hybrid_kv_cache_manager: bool = False
    attention_backend: str | None = None
    enforce_eager: bool = False
    # vLLM's enable_sleep_mode: LLM.sleep(level) gives the weights' (level 1: kept on the host)
    # and the KV cache's device memory back, LLM.wake_up(tags) takes it again
    # (engine/sleep.py)
    enable_sleep_mode: bool = False
    # Schedule and prepare step N+1 while the device runs step N (its sampled tokens feed
    # step N+1 on the device); None: on for CUDA, off on the CPU, where nothing overlaps.
    async_scheduling: bool | None = None
    # "auto": K/V cached in the model's dtype; "fp8" / "fp8_e4m3": float8_e4m3fn with scale
    # 1 (as vLLM's default), half the bytes per token of bf16 (MLA: the latent cache)
    kv_cache_dtype: str = "auto"
    # None: weights as loaded; "fp8": attention and dense-MLP linears quantized at load to
    # float8_e4m3fn with per-output-row scales (vLLM's --quantization fp8; layers/quant.py)
    quantization: str | None = None
    seed: int = 0
    # A Jinja chat template (the text, or a file holding it) instead of the tokenizer's own:
    # vLLM's --chat-template, for models whose template is missing or not the one wanted
    chat_template: str | None = None
    # embeddings: how a prompt's hidden states are pooled ("last", "mean", "cls"); None: the
    # model folder's sentence-transformers Pooling config, else "last" (flashpage/pooling.py)
    pooling_type: str | None = None
    # speculative decoding, as vLLM's speculative_config: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}, or a draft
    # model's, {"model": PATH, "num_speculative_tokens": k}, or the checkpoint's own MTP
    # layer's, {"method": "mtp", "num_speculative_tokens": k}, or an EAGLE head's,
    # {"method": "eagle" | "eagle3", "model": PATH, "num_speculative_tokens": k} (a dict or
    # its JSON text; engine/spec_decode.py, engine/draft_model.py, engine/mtp.py,
    # engine/eagle.py); None: off
    speculative_config: dict[str, Any] | str | None = None
    # LoRA adapters (vLLM's enable_lora / max_loras / max_lora_rank; flashpage/lora/): requests
    # may name a PEFT adapter; a step runs at most max_loras distinct ones (its slots), each of
    # rank <= max_lora_rank
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # vLLM's scheduling_policy: "fcfs" (arrival order), or "priority" (each request's
    # priority, lower first, ties by arrival; a higher priority may preempt a lower one)
    scheduling_policy: str = "fcfs"
    # vLLM's --generation-config: "auto" (the model folder's generation_config.json: its
    # recommended sampling defaults and end-of-turn tokens), "vllm" (no sampling defaults)
    # or a folder; override_generation_config: values over it (flashpage/generation_config.py)
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    # vLLM's hf_overrides: fields over the model's config.json before it is read
    # (config.apply_hf_overrides), e.g. {"architectures": ["Qwen3ForSequenceClassification"],
    # "classifier_from_token": ["no", "yes"]} to serve a causal LM as a reranker
    hf_overrides: dict[str, Any] | None = None
    # vLLM's enable_prompt_embeds: a prompt may be given as its input embeddings
    # ({"prompt_embeds": tensor [tokens, hidden]}, the server's prompt_embeds field) instead
    # of token ids (engine/prompt_embeds.py)
    enable_prompt_embeds: bool = False
    # vLLM's: the folder file:// image URLs may name (None: none), the hosts http(s) image
    # URLs may name (None: any) (engine/media.py)
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    # vLLM's media_io_kwargs: how a video file is sampled ({"video": {"num_frames": 32,
    # "fps": -1}}: engine/video_io.py)
    media_io_kwargs: dict[str, Any] | None = None
    # vLLM's limit_mm_per_prompt: the most items of a modality one prompt may hold
    # ({"image": 2}; None: no limit); {"image": 0} serves an image model's text alone (its
    # tower never loaded; Qwen2-VL, which takes videos too: {"image": 0, "video": 0})
    limit_mm_per_prompt: dict[str, int] | None = None
    # vLLM's mm_processor_kwargs: the processors' settings over the checkpoint's (Qwen2-VL:
    # {"min_pixels": ..., "max_pixels": ..., "fps": ...}); with_mm_processor_kwargs reads them
    mm_processor_kwargs: dict[str, Any] | None = None
    # the encoder outputs kept for later requests of the same image, in rows
    # (engine/encoder_cache.py; None: max_num_batched_tokens' worth, 0: none kept)
    mm_encoder_cache_tokens: int | None = None
    # vLLM's trust_remote_code, for the tokenizer only: a checkpoint whose tokenizer is its own
    # Python (tokenizer_config.json's auto_map: InternLM2's tokenization_internlm2.py) loads
    # only when set; the model's code is always flashpage's (engine/tokenizer.py)
    trust_remote_code: bool = False

    @property
    def media_policy(self) -> MediaPolicy:
        """What image and video URLs may be read, and how a video is sampled (engine/media.py); a
        ConfigError naming a bad field."""
        from flashpage.engine.media import MediaPolicy

        try:
            return MediaPolicy(self.allowed_local_media_path,
                               None if self.allowed_media_domains is None else tuple(self.allowed_media_domains),
                               media_io_kwargs=self.media_io_kwargs)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def __post_init__(self) -> None:
        from flashpage.engine.scheduler import check_scheduling_policy

        _ = self.media_policy  # a bad folder or domain list named now
        from flashpage.engine.multimodal import check_limits

        try:
            check_limits(self.limit_mm_per_prompt)
        except ValueError as e:
            raise ConfigError(str(e)) from None

        check_scheduling_policy(self.scheduling_policy)
        n = self.mm_encoder_cache_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(f"mm_encoder_cache_tokens must be an int >= 0 (0: no encoder cache), got {n!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        check_quantization(self.quantization)
        if self.hf_overrides is not None:
            apply_hf_overrides({}, self.hf_overrides)  # not a dict: named now
        if self.speculative_config is not None:
            from flashpage.engine.spec_decode import SpeculativeConfig

            SpeculativeConfig.parse(self.speculative_config)  # a bad one named now
            if self.enable_prompt_embeds:
                raise ConfigError("enable_prompt_embeds does not work with speculative_config: "
                                  "drafters read the prompt's token ids, which an embeds prompt has none of")
        if self.pooling_type is not None and self.pooling_type not in ("last", "mean", "cls"):
            raise ValueError(f"pooling_type must be last, mean or cls, got {self.pooling_type!r}")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: off), "
                             f"got {t!r}")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        size = self.kv_offloading_size
        if (not isinstance(size, (int, float)) or isinstance(size, bool) or not size >= 0
                or size == float("inf")):
            raise ValueError(f"kv_offloading_size must be a number of GiB >= 0 (0: off), got {size!r}")
        if self.kv_offloading_backend != "native":
            raise ValueError(f"kv_offloading_backend must be 'native' (the only one here; vLLM's "
                             f"lmcache is not), got {self.kv_offloading_backend!r}")
        if size and not self.enable_prefix_caching:
            raise ConfigError("kv_offloading_size (--kv-offloading-size) is a second tier of the "
                              "prefix cache, which is off (enable_prefix_caching=False, "
                              "--no-prefix-caching): turn one on or the other off")
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs > 256 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two from 1 to 256, got {bs!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


def _internvl_tiles(vc: Any, kwargs: dict[str, Any], arch: str) -> Any:
    """InternVL's tiling under mm_processor_kwargs, as InternVLProcessor's call reads them:
    ``min_patches`` / ``max_patches`` (the tiles of an image's grid, positive ints, min <=
    max) and ``crop_to_patches`` (false: one tile, the image resized to it); or by vLLM's
    names for the remote-code layout, ``min_dynamic_patch`` / ``max_dynamic_patch`` /
    ``dynamic_image_size``."""
    aliases = {"min_dynamic_patch": "min_patches", "max_dynamic_patch": "max_patches",
               "dynamic_image_size": "crop_to_patches"}
    unknown = sorted(set(kwargs) - {"min_patches", "max_patches", "crop_to_patches", *aliases})
    if unknown:
        raise ConfigError(f"mm_processor_kwargs {unknown}: {arch}'s image processor reads min_patches, "
                          "max_patches and crop_to_patches (min_dynamic_patch, max_dynamic_patch and "
                          "dynamic_image_size, vLLM's names for them)")
    both = sorted(k for k, ours in aliases.items() if k in kwargs and ours in kwargs)
    if both:
        raise ConfigError(f"mm_processor_kwargs: give {both[0]} or {aliases[both[0]]}, not both")
    kwargs = {aliases.get(k, k): v for k, v in kwargs.items()}
    lo, hi = kwargs.get("min_patches", vc.min_tiles), kwargs.get("max_patches", vc.max_tiles)
    for key, v in (("min_patches", lo), ("max_patches", hi)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"mm_processor_kwargs {key} must be a positive int, got {v!r}")
    if lo > hi:
        raise ConfigError(f"mm_processor_kwargs: min_patches {lo} is above max_patches {hi}")
    crop = kwargs.get("crop_to_patches", True)
    if not isinstance(crop, bool):
        raise ConfigError(f"mm_processor_kwargs crop_to_patches must be true or false, got {crop!r}")
    return replace(vc, min_tiles=lo if crop else 1, max_tiles=hi if crop else 1)


def with_mm_processor_kwargs(mc: ModelConfig, kwargs: dict[str, Any] | None) -> ModelConfig:
    """``mc`` with vLLM's ``mm_processor_kwargs`` over its processors' settings: Qwen2-VL's
    ``min_pixels`` / ``max_pixels`` (ints, min <= max; the image's and the video's, as
    transformers' processor call; or ``size`` {shortest_edge, longest_edge}, the same two), ``fps`` (a video's frame rate where it gives none:
    Qwen2.5-VL's temporal positions, engine/mrope.py); InternVL's ``min_patches`` /
    ``max_patches`` / ``crop_to_patches`` (_internvl_tiles); Gemma 3's ``do_pan_and_scan``
    and ``pan_and_scan_*`` crop settings (models/gemma3_config.pan_and_scan_of); Idefics3's /
    SmolVLM's ``size`` / ``do_image_splitting`` and SmolVLM2's ``do_sample_frames`` / ``num_frames``
    / ``fps`` (idefics3_config.with_processor_kwargs); GLM-4.1V's ``do_sample_frames`` / ``fps``
    (its video processor's frame sampling, ``fps`` the rate it samples at:
    models/glm4v_config.frame_sampling_of) beside its pixel bounds; a ConfigError names a key
    the model's processor does not read, or a model that takes no images."""
    if not kwargs:
        return mc
    if not isinstance(kwargs, dict):
        raise ConfigError(f"mm_processor_kwargs must be a dict, got {kwargs!r}")
    arch = mc.multimodal_architecture or mc.architecture
    if mc.audio is not None:
        raise ConfigError(f"mm_processor_kwargs {sorted(kwargs)}: {arch}'s feature extractor reads none "
                          "here (its settings are preprocessor_config.json's)")
    if mc.vision is None:
        raise ConfigError(f"mm_processor_kwargs {sorted(kwargs)} given, but {arch} takes no images here")
    if type(mc.vision).__name__ == "Gemma3VisionConfig":  # Gemma3ImageProcessor's pan-and-scan
        from flashpage.models.gemma3_config import PAN_AND_SCAN_KEYS, pan_and_scan_of

        unknown = sorted(set(kwargs) - set(PAN_AND_SCAN_KEYS))
        if unknown:
            raise ConfigError(f"mm_processor_kwargs {unknown}: {arch}'s image processor reads "
                              f"{', '.join(PAN_AND_SCAN_KEYS)}")
        gv: Any = mc.vision
        pas = pan_and_scan_of(kwargs, "mm_processor_kwargs", gv.pan_and_scan)
        return mc if pas == gv.pan_and_scan else replace(mc, vision=replace(gv, pan_and_scan=pas))
    if type(mc.vision).__name__ == "InternVLVisionConfig":  # InternVLProcessor's tiling bounds
        return replace(mc, vision=_internvl_tiles(mc.vision, kwargs, arch))
    if type(mc.vision).__name__ == "Idefics3VisionConfig":  # Idefics3Processor's size / splitting
        from flashpage.models.idefics3_config import with_processor_kwargs

        return replace(mc, vision=with_processor_kwargs(mc.vision, kwargs))  # type: ignore[arg-type]
    if not isinstance(mc.vision, QwenVisionConfig):
        raise ConfigError(f"mm_processor_kwargs {sorted(kwargs)}: {arch}'s image processor reads none "
                          "(Qwen2-VL's reads min_pixels / max_pixels)")
    glm = mc.vision.variant == "glm4v"  # Glm4vVideoProcessor's frame sampling (models/glm4v_config.py)
    unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels", "fps", "size", *(("do_sample_frames",) if glm else ())})
    if unknown:
        raise ConfigError(f"mm_processor_kwargs {unknown}: {arch}'s processors read min_pixels, "
                          "max_pixels, size and fps" + (
                              " (the rate its video processor samples at) and do_sample_frames (its "
                              "max_duration is its video processor's file's, as transformers' processor "
                              "call ignores it)" if glm else ""))
    if "size" in kwargs:  # transformers' form (Qwen3-VL's usual one): the same two bounds
        size = kwargs["size"]
        if not isinstance(size, dict) or not size or set(size) - {"shortest_edge", "longest_edge"}:
            raise ConfigError(f"mm_processor_kwargs size must be {{\"shortest_edge\": min pixels, "
                              f"\"longest_edge\": max pixels}}, got {size!r}")
        both = sorted({"min_pixels", "max_pixels"} & set(kwargs))
        if both:
            raise ConfigError(f"mm_processor_kwargs: give size or {' / '.join(both)}, not both")
        kwargs = {k: v for k, v in kwargs.items() if k != "size"}
        if "shortest_edge" in size:
            kwargs["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            kwargs["max_pixels"] = size["longest_edge"]
    timing: dict[str, Any] = {}
    if glm:  # fps: the rate do_sample_frames samples at, as Glm4vVideoProcessor reads it
        from flashpage.models.glm4v_config import frame_sampling_of

        vision: Any = mc.vision
        timing["frame_sampling"] = frame_sampling_of(kwargs, "mm_processor_kwargs", vision.frame_sampling)
    else:
        fps = kwargs.get("fps", mc.vision.video_fps)
        if fps is not None and (not isinstance(fps, (int, float)) or isinstance(fps, bool) or not fps > 0):
            raise ConfigError(f"mm_processor_kwargs fps must be a positive number, got {fps!r}")
        timing["video_fps"] = None if fps is None else float(fps)
    procs = []
    # as transformers' processor call: the bounds given are the image's and the video's
    for proc in (mc.vision.processing, mc.vision.video_processing or mc.vision.processing):
        lo, hi = kwargs.get("min_pixels", proc.min_pixels), kwargs.get("max_pixels", proc.max_pixels)
        for key, v in (("min_pixels", lo), ("max_pixels", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"mm_processor_kwargs {key} must be a positive int, got {v!r}")
        if lo > hi:
            raise ConfigError(f"mm_processor_kwargs: min_pixels {lo} is above max_pixels {hi}")
        procs.append(replace(proc, min_pixels=lo, max_pixels=hi))
    return replace(mc, vision=replace(mc.vision, processing=procs[0], video_processing=procs[1], **timing))


def request_mm_processing(mc: ModelConfig, kwargs: Any, modalities: Iterable[str]
                          ) -> QwenVisionConfig | Gemma3VisionConfig | None:
    """vLLM's per-request ``mm_processor_kwargs`` (a prompt's, or a chat request's field)
    over the engine's (``mc``: the ModelConfig the encoder was built from, the engine-wide
    kwargs applied): the vision config this request's images / videos are preprocessed
    with (Qwen2-VL's pixel bounds, GLM-4.1V's frame sampling too, Gemma 3's pan-and-scan), or
    None where they change nothing (the engine's own settings given again). Checked as
    the engine-wide ones are (``with_mm_processor_kwargs``, the same ConfigErrors), and a
    max_pixels above the engine's for a modality the request holds (``modalities``) is
    refused: the engine reserved the encoder's activation memory for its own bound
    (QwenImageEncoder.activation_bytes), which rows from a larger image would pass.
    SmolVLM2's do_sample_frames / num_frames / fps alone: None (its encoder's sample_videos
    reads them where a request's videos come in)."""
    new = with_mm_processor_kwargs(mc, kwargs).vision
    old = mc.vision
    if new is old or new == old:
        return None
    from flashpage.models.gemma3_config import Gemma3VisionConfig

    if isinstance(new, Gemma3VisionConfig):  # pan-and-scan: more images, no bound to pass
        return new
    from flashpage.models.idefics3_config import Idefics3VisionConfig

    if isinstance(new, Idefics3VisionConfig) and isinstance(old, Idefics3VisionConfig) \
            and replace(new, frame_sampling=old.frame_sampling) == old:
        # SmolVLM2's frame sampling alone: the request's videos sampled before their text is
        # written (Idefics3ImageEncoder.sample_videos); their frames preprocessed as the engine's
        return None
    if not isinstance(new, QwenVisionConfig) or not isinstance(old, QwenVisionConfig):
        # InternVL's tiling bounds: read from the engine's config only (never ignored here)
        raise ConfigError(f"mm_processor_kwargs {sorted(kwargs)} per request: {mc.multimodal_architecture}'s "
                          "encoder reads them engine-wide only (LLM(mm_processor_kwargs=...), "
                          "--mm-processor-kwargs)")
    key = "size longest_edge" if isinstance(kwargs, dict) and "size" in kwargs else "max_pixels"
    for modality, was, now in (("image", old.processing, new.processing),
                               ("video", old.video_processing or old.processing,
                                new.video_processing or new.processing)):
        if modality in modalities and now.max_pixels > was.max_pixels:
            raise ConfigError(
                f"mm_processor_kwargs {key} {now.max_pixels} is above this engine's {modality} max_pixels "
                f"{was.max_pixels}: the encoder's memory was reserved for {modality}s up to that many "
                f"pixels; raise the engine-wide bound (LLM(mm_processor_kwargs={{\"max_pixels\": "
                f"{now.max_pixels}}}), --mm-processor-kwargs) to allow it")
    return new
