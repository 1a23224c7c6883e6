"""DeepSeek-V2/V3: multi-head latent attention (MLA) and mixture-of-experts layers.

Parameter names are transformers' (``model.layers.N.self_attn.kv_a_proj_with_mqa`` ...),
so checkpoints load by name. Layer N's MLP is the MoE when N >= ``first_k_dense_replace``
and N % ``moe_layer_freq`` == 0 (DeepSeek's rule; every released checkpoint has
``moe_layer_freq`` 1), else a dense SiLU MLP of ``intermediate_size``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import ColumnParallelLinear, VocabEmbedding
from flashpage.layers.mla_attention import MLAAttention, MLARotaryEmbedding
from flashpage.layers.moe import (
    EXPERT_NAME,
    SYNC_FREE_MAX_TOKENS,
    DeepseekMLP,
    DeepseekMoE,
    load_expert_weight,
)
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, InputEmbeds, PreNormDecoderLayer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# The dense MLPs' and shared experts' gate_proj / up_proj: rows of their gate_up_proj (and
# an fp8 checkpoint's per-row scales, models/fp8_checkpoint.py, rows of its weight_scale).
_GATE_UP = re.compile(r"^(?P<prefix>.+)\.(?P<proj>gate|up)_proj\.(?P<kind>weight|weight_scale)$")


class DeepseekDecoderLayer(PreNormDecoderLayer):
    self_attn: MLAAttention
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: MLARotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config, layer_idx, rotary_emb)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (DeepseekMoE(config) if config.is_moe_layer(layer_idx)
                               else DeepseekMLP(config.hidden_size, config.intermediate_size))


class DeepseekModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # One cos/sin cache for all layers: [max_positions, rope] fp32 each would add up.
        self.rotary_emb = MLARotaryEmbedding(config, max_positions)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, self.rotary_emb)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (the differences live in the config:
    q_lora_rank, routing method, rope layout)."""

    # Decode steps are capturable: the MoE runs sync-free up to SYNC_FREE_MAX_TOKENS (the
    # engine's largest graph batch) and MLA decode has static shapes (layers/mla_attention).
    supports_cuda_graphs = True
    # Whole prompt steps are not: MLA expands each request's latents to its context length, a
    # host value per step (layers/mla_attention), and the MoE's prompt path counts tokens per
    # expert on the host past SYNC_FREE_MAX_TOKENS. Piecewise graphs (MLA's attend eager between
    # the pieces) hold up to that many tokens (tests/models/test_deepseek.py on the CPU,
    # tests/engine/test_mla_triton.py captured on the GPU).
    supports_prefill_graphs = False
    supports_piecewise_graphs = True
    max_graph_tokens = SYNC_FREE_MAX_TOKENS

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        if not config.is_mla:
            raise ValueError(f"{config.architecture} config has no kv_lora_rank")
        if config.raw.get("mlp_bias"):
            raise ValueError("DeepSeek MLPs with mlp_bias are not supported")
        self.config = config
        self.model = DeepseekModel(config, max_positions or config.max_position_embeddings)
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size)
        self.lm_head.quantizable = False  # logits stay 16-bit under quantization="fp8"
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[MLAAttention]:
        return [cast(DeepseekDecoderLayer, layer).self_attn for layer in self.model.layers]

    supports_prompt_embeds = True  # forward takes inputs_embeds

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata, inputs_embeds: InputEmbeds | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            return self.model(input_ids, positions, md)
        return self.model(input_ids, positions, md, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (HF name, tensor) pairs into parameters and persistent buffers (V3's
        ``e_score_correction_bias``); returns the names loaded. Per-expert tensors go into
        their slice of the fused expert weights, which count as loaded once complete."""
        targets = self.state_dict(keep_vars=True)
        loaded: set[str] = set()
        expert_pieces: dict[str, set[tuple[int, str]]] = {}
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
                continue  # V3's multi-token-prediction layer: models/mtp.py loads it (a draft)
            m = EXPERT_NAME.match(name)
            if m and name not in targets:
                load_expert_weight(targets, m, tensor, expert_pieces, loaded)
                continue
            if ".shared_experts." in name and tensor.numel() == 0 and name not in targets:
                continue  # transformers writes a zero-width shared MLP when there is none
            g = _GATE_UP.match(name)
            if g and name not in targets and f"{g['prefix']}.gate_up_proj.{g['kind']}" in targets:
                self._load_gate_up(targets, g, tensor, expert_pieces, loaded)
                continue
            if name not in targets:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            target = targets[name]
            loader = getattr(target, "weight_loader", None)
            if loader is not None:
                loader(target, tensor.to(target.dtype))
            else:
                if target.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} "
                                     f"!= {tuple(target.shape)}")
                target.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def _load_gate_up(self, targets: dict[str, torch.Tensor], m: re.Match[str], tensor: torch.Tensor,
                      pieces: dict[str, set[tuple[int, str]]], loaded: set[str]) -> None:
        """``...{gate,up}_proj.weight`` (or ``.weight_scale``) of a dense MLP or the shared
        experts -> rows [:I] / [I:] of its ``gate_up_proj``'s (loaded once both have arrived)."""
        fused = f"{m['prefix']}.gate_up_proj.{m['kind']}"
        param = targets[fused]
        inter = param.shape[0] // 2
        dst = param.data[:inter] if m["proj"] == "gate" else param.data[inter:]
        if dst.shape != tensor.shape:
            raise ValueError(f"{m.string}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
        dst.copy_(tensor)
        got = pieces.setdefault(fused, set())
        got.add((0, m["proj"]))
        if len(got) == 2:
            loaded.add(fused)


__all__ = ["DeepseekForCausalLM"]
