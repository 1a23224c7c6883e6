"""Tencent's HunYuan dense (HunYuanDenseV1ForCausalLM, Hunyuan-0.5B ... 7B): Llama's body,
head and loading (models/llama.py) with per-head q/k RMSNorms applied AFTER rotary
(``query_layernorm`` / ``key_layernorm``, HF's names), where Qwen3's come before it. So the
layer rotates q and k itself (the rotary module: torch, or our rotary kernel when fused)
and hands them to attention already rotated (``rotary=None``: the backend writes the normed
K as it is, not by the fused rotary + cache-write kernel). Its "dynamic" rope with a fixed ``alpha`` is a plain rope of a stretched
base (config._families4_fields)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import PendingNorm, VocabEmbedding
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class HunYuanAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        assert self.rotary_emb is not None
        q, k = self.rotary_emb(positions, q, k)
        q = cast(torch.Tensor, self.query_layernorm(q))
        k = cast(torch.Tensor, self.key_layernorm(k))
        o = self.attn(q, k, v, md, positions=positions, rotary=None)
        return self.o_proj(o)


class HunYuanDecoderLayer(LlamaDecoderLayer):
    self_attn: HunYuanAttention

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        PreNormDecoderLayer.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = HunYuanAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)


class HunYuanModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HunYuanDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return HunYuanModel(config, max_positions)
