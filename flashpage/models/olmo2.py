"""OLMo 2 (Olmo2ForCausalLM): Llama's projections and names (models/llama.py) with the
norms moved. No pre-norms: each block's output is RMS-normed before its residual add
(``post_attention_layernorm`` after attention, ``post_feedforward_layernorm`` after the
MLP), and q_norm / k_norm are RMSNorms over the WHOLE q and k projections (hidden-wide,
``heads * head_dim``, not per head as Qwen3's), before rotary. OLMoE's attention is this one
(models/olmoe.py), with its ``clip_qkv`` clamp after the norms.

OLMo 3 is this model with windows on its ``layer_types`` sliding layers and a rope per layer
kind (config only); EXAONE 4 this layer with Llama's attention and per-head q/k norms
(``config.qk_norm``) and NoPE on its full-attention layers (``config.nope_layers``).

The residual stream keeps DecoderStack's convention: a layer returns (x, residual)
whose sum is the hidden state, and the final norm adds them; no norm here can take the
add (each norms a block's output, not the sum), so the layer adds on its own and the
fused GEMV norm prologues are not used."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import PendingNorm, VocabEmbedding
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv  # OLMoE's; None for OLMo2

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = cast(torch.Tensor, self.q_norm(q))
        k = cast(torch.Tensor, self.k_norm(k))
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        o = self.attn(q, k, v, md, positions=positions, rotary=self.rotary_emb)
        return self.o_proj(o)


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        # EXAONE 4 (config.qk_norm): Llama's attention with Qwen3's per-head q/k norms
        self.self_attn = (LlamaAttention(config, layer_idx, max_positions) if config.qk_norm
                          else Olmo2Attention(config, layer_idx, max_positions))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = x if residual is None else residual + x
        attn = self.self_attn(positions, hidden, md)
        hidden = hidden + cast(torch.Tensor, self.post_attention_layernorm(attn))
        return cast(torch.Tensor, self.post_feedforward_layernorm(self.mlp(hidden))), hidden


class Olmo2Model(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Olmo2ForCausalLM(LlamaForCausalLM):
    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return Olmo2Model(config, max_positions)
