"""AI2's OLMo (1) (OlmoForCausalLM: OLMo-1B/7B-hf, -0424 / -0724): Llama's layer, names and
loading (models/llama.py: merged ``qkv_proj`` / ``gate_up_proj``, neox rotary, SiLU-gated
MLP, models/common.PreNormDecoderLayer) with:

- LayerNorms with no weight and no bias (layers/norm.LayerNorm(elementwise_affine=False):
  mean-subtracted, in fp32, epsilon 1e-5 as transformers' OlmoLayerNorm) instead of
  RMSNorms: the checkpoint holds no norm tensors at all;
- ``clip_qkv``: q, k and v clamped to [-clip_qkv, clip_qkv] right after their projection
  (bias included), before rotary;
- a tied or untied head (``tie_word_embeddings``, Llama's handling).

The LayerNorms take the residual add as RMSNorm does (``norm(x, residual)``), but not the
one-row GEMV norm prologues, which compute RMSNorm (``norm_consumers`` stays None)."""

from __future__ import annotations

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import PendingNorm, VocabEmbedding
from flashpage.layers.norm import LayerNorm
from flashpage.models.common import DecoderStack, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


def _norm(config: ModelConfig) -> LayerNorm:
    return LayerNorm(config.hidden_size, config.rms_norm_eps, elementwise_affine=False)


class OlmoAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        self.clip_qkv = config.clip_qkv

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:  # q, k and v alike: one clamp over the merged output
            qkv = qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        o = self.attn(q, k, v, md, positions=positions, rotary=self.rotary_emb)
        return self.o_proj(o)


class OlmoDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = OlmoAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = _norm(config)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)


class OlmoModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            OlmoDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = _norm(config)


class OlmoForCausalLM(LlamaForCausalLM):
    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return OlmoModel(config, max_positions)
