"""Zhipu's GLM families: GLM (GlmForCausalLM, GLM-4-9B-chat-hf), GLM-4 (Glm4ForCausalLM,
GLM-4-9B / 32B-0414) and GLM-4.5 / 4.6 (Glm4MoeForCausalLM, GLM-4.5-Air ... GLM-4.6).

All three are Llama's body (models/llama.py: merged ``qkv_proj``, HF's names otherwise,
the same load_weights) with rotary over the first ``partial_rotary_factor`` (0.5) of each
head and no bias on o_proj (config._glm_fields). Beyond that:

- GLM / GLM-4 rotate interleaved pairs (x[2i], x[2i + 1]) and their checkpoints hold
  the MLP's gate and up projections merged already (``mlp.gate_up_proj``, gate rows
  first: our parameter, loaded and given back as it is);
- GLM-4's layer norms each block's output too, before its residual add::

      x -> input_layernorm -> attn -> post_self_attn_layernorm -> + residual
        -> post_attention_layernorm -> mlp -> post_mlp_layernorm -> + residual

  (Gemma 2's sandwich under other names), the residual carried into the next norm's add;
- GLM-4.5 (Glm4Moe) rotates halves (Llama's layout), norms q and k per head before rotary
  with ``use_qk_norm`` (Qwen3's), and from layer ``first_k_dense_replace`` on its MLP is
  DeepSeek-V3's MoE (layers/moe.DeepseekMoE: sigmoid routing with
  ``e_score_correction_bias``, group-limited top-k, shared experts), the layers before a
  dense MLP. Its multi-token-prediction layers (``num_nextn_predict_layers`` of them, after
  ``num_hidden_layers`` in the checkpoint) are skipped when the model loads; with
  speculative_config method "mtp" the first is loaded apart as the draft (models/mtp.py,
  engine/mtp.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import ColumnParallelLinear, VocabEmbedding
from flashpage.layers.moe import DeepseekMoE
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4DecoderLayer(PreNormDecoderLayer):
    """GLM-4's layer: Llama's with a norm after attention and one after the MLP."""

    self_attn: LlamaAttention
    mlp: LlamaMLP

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_positions)
        self.post_self_attn_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)  # the MLP's pre-norm (HF's name)
        self.mlp = LlamaMLP(h, config.intermediate_size)
        self.post_mlp_layernorm = RMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(positions, x, md))
        x, residual = self.post_attention_layernorm(x, residual)
        return self.post_mlp_layernorm(self.mlp(x)), residual


class Glm4MoeDecoderLayer(PreNormDecoderLayer):
    """GLM-4.5's layer: Llama's attention (per-head q/k norms with use_qk_norm), then the
    MoE from first_k_dense_replace on, else a dense MLP."""

    self_attn: LlamaAttention

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp: nn.Module = (DeepseekMoE(config) if config.is_moe_layer(layer_idx)
                               else LlamaMLP(h, config.intermediate_size))

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear] | None:
        if isinstance(self.mlp, LlamaMLP):  # the router and shared experts both read the MoE's
            return self.self_attn.qkv_proj, self.mlp.gate_up_proj
        return None


class GlmModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        layer = _LAYERS[config.architecture]
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


_LAYERS: dict[str, type[PreNormDecoderLayer]] = {
    "GlmForCausalLM": LlamaDecoderLayer, "Glm4ForCausalLM": Glm4DecoderLayer,
    "Glm4MoeForCausalLM": Glm4MoeDecoderLayer}


class GlmForCausalLM(LlamaForCausalLM):
    """GlmForCausalLM, Glm4ForCausalLM and Glm4MoeForCausalLM (the architecture says which
    layer): Llama's head, loading and LoRA targets, with the differences above."""

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return GlmModel(config, max_positions)

    @property
    def _moe(self) -> bool:
        return self.config.architecture == "Glm4MoeForCausalLM"

    def _shards(self) -> dict[str, tuple[str, int, int]]:
        """Llama's, but GLM / GLM-4's dense MLPs hold gate_up_proj merged on disk (nothing to
        stack there), and GLM-4.5's shared experts stack gate_proj / up_proj as its dense
        MLPs do."""
        out = super()._shards()
        if not self._moe:
            return {hf: t for hf, t in out.items() if not hf.startswith("mlp.")}
        shared = self.config.moe_intermediate_size * self.config.n_shared_experts
        for kind in ("weight", "weight_scale", "w4_scales", "w4_zeros"):
            if shared:
                out[f"mlp.shared_experts.gate_proj.{kind}"] = (
                    f"mlp.shared_experts.gate_up_proj.{kind}", 0, shared)
                out[f"mlp.shared_experts.up_proj.{kind}"] = (
                    f"mlp.shared_experts.gate_up_proj.{kind}", shared, shared)
        return out

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """Llama's; GLM / GLM-4's adapters name the merged gate_up_proj itself."""
        out = super().lora_targets()
        if not self._moe:
            for i in range(self.config.num_hidden_layers):
                p = f"model.layers.{i}.mlp.gate_up_proj"
                out[p] = (p, 0, 2 * self.config.intermediate_size)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's, with GLM-4.5's routers' correction biases (buffers) loaded too and its
        multi-token-prediction layers skipped."""
        if not self._moe:
            return super().load_weights(weights)
        biases = {n: b for n, b in self.named_buffers() if n.endswith(".e_score_correction_bias")}
        loaded: set[str] = set()

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                layer = _LAYER.match(name)
                if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
                    continue  # a multi-token-prediction layer: models/mtp.py loads it (a draft)
                if name in biases:
                    if biases[name].shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                         f"{tuple(biases[name].shape)}")
                    biases[name].copy_(tensor)
                    loaded.add(name)
                    continue
                if ".shared_experts." in name and tensor.numel() == 0:
                    continue  # transformers writes a zero-width shared MLP when there is none
                yield name, tensor

        return super().load_weights(rest()) | loaded

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Llama's (GLM-4.5's routers' correction biases too)."""
        yield from super().hf_weights()
        for name, b in self.named_buffers():
            if name.endswith(".e_score_correction_bias"):
                yield name, b


__all__ = ["GlmForCausalLM"]
