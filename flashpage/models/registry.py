"""Architecture name -> model class, imported lazily so a family loads only when used."""

from __future__ import annotations

import importlib

from torch import nn

from flashpage.config import ConfigError, ModelConfig

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "LlamaForSequenceClassification": ("flashpage.models.llama", "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("flashpage.models.llama", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("flashpage.models.llama", "LlamaForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("flashpage.models.llama", "LlamaForSequenceClassification"),
    "MixtralForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "Qwen2MoeForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "Qwen3MoeForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("flashpage.models.phi3", "Phi3ForCausalLM"),
    "GraniteForCausalLM": ("flashpage.models.granite", "GraniteForCausalLM"),
    "OlmoForCausalLM": ("flashpage.models.olmo", "OlmoForCausalLM"),
    "Olmo2ForCausalLM": ("flashpage.models.olmo2", "Olmo2ForCausalLM"),
    "OlmoeForCausalLM": ("flashpage.models.olmoe", "OlmoeForCausalLM"),
    "GraniteMoeForCausalLM": ("flashpage.models.granite", "GraniteMoeForCausalLM"),
    "GraniteMoeSharedForCausalLM": ("flashpage.models.granite", "GraniteMoeForCausalLM"),
    "CohereForCausalLM": ("flashpage.models.cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("flashpage.models.cohere", "CohereForCausalLM"),
    "Starcoder2ForCausalLM": ("flashpage.models.starcoder2", "Starcoder2ForCausalLM"),
    "GPT2LMHeadModel": ("flashpage.models.gpt2", "GPT2LMHeadModel"),
    "GPTBigCodeForCausalLM": ("flashpage.models.gpt2", "GPTBigCodeForCausalLM"),
    "GPTNeoXForCausalLM": ("flashpage.models.gpt_neox", "GPTNeoXForCausalLM"),
    "PhiForCausalLM": ("flashpage.models.phi", "PhiForCausalLM"),
    "GPTJForCausalLM": ("flashpage.models.gptj", "GPTJForCausalLM"),
    "FalconForCausalLM": ("flashpage.models.falcon", "FalconForCausalLM"),
    "OPTForCausalLM": ("flashpage.models.opt", "OPTForCausalLM"),
    "BloomForCausalLM": ("flashpage.models.bloom", "BloomForCausalLM"),
    "MptForCausalLM": ("flashpage.models.mpt", "MptForCausalLM"),
    "DeepseekV2ForCausalLM": ("flashpage.models.deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("flashpage.models.deepseek", "DeepseekForCausalLM"),
    "GemmaForCausalLM": ("flashpage.models.gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("flashpage.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("flashpage.models.gemma", "GemmaForCausalLM"),
    # the Llama body with per-layer NoPE (SmolLM3) or windows (Ministral): config only
    "SmolLM3ForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "MinistralForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    # interleaved rotary (ERNIE 4.5), o_proj's own bias (Seed-OSS): config only
    "Ernie4_5ForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "SeedOssForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
    "ArceeForCausalLM": ("flashpage.models.arcee", "ArceeForCausalLM"),
    "Olmo3ForCausalLM": ("flashpage.models.olmo2", "Olmo2ForCausalLM"),
    "Exaone4ForCausalLM": ("flashpage.models.olmo2", "Olmo2ForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("flashpage.models.hunyuan", "HunYuanDenseV1ForCausalLM"),
    "ApertusForCausalLM": ("flashpage.models.apertus", "ApertusForCausalLM"),
    "GptOssForCausalLM": ("flashpage.models.gpt_oss", "GptOssForCausalLM"),
    "GlmForCausalLM": ("flashpage.models.glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("flashpage.models.glm", "GlmForCausalLM"),
    "Glm4MoeForCausalLM": ("flashpage.models.glm", "GlmForCausalLM"),
    "Llama4ForCausalLM": ("flashpage.models.llama4", "Llama4ForCausalLM"),
    # InternLM2 / 2.5: Llama's body under its names, a grouped fused wqkv; InternLM3: Llama's
    # names, its bias flags in config only
    "InternLM2ForCausalLM": ("flashpage.models.internlm2", "InternLM2ForCausalLM"),
    "InternLM3ForCausalLM": ("flashpage.models.llama", "LlamaForCausalLM"),
}


def served_by(module: str, name: str) -> tuple[str, ...]:
    """The architectures whose model class is ``module``.``name``, sorted."""
    return tuple(sorted(arch for arch, home in _MODELS.items() if home == (module, name)))


def model_class(config: ModelConfig) -> type[nn.Module]:
    if config.architecture not in _MODELS:
        raise ConfigError(f"no model implementation for architecture {config.architecture!r}")
    module, name = _MODELS[config.architecture]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{config.architecture} is not available in this build: {e}") from e
