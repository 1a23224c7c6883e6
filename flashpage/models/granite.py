"""IBM Granite (GraniteForCausalLM, Granite 3.x dense): the Llama body and names
(models/llama.py) with four scalars from config.json: embeddings x embedding_multiplier,
each attention and MLP output x residual_multiplier before its residual add, the
attention scale attention_multiplier (instead of head_dim ** -0.5), logits /
logits_scaling.

The multipliers sit inside the modules (the embedding, the attention's and the MLP's
outputs), so the pre-norm layer, its fused residual-add norms and its one-row GEMV
norm prologues (models/common.PreNormDecoderLayer) are Llama's unchanged."""

from __future__ import annotations

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import ColumnParallelLinear, PendingNorm, VocabEmbedding
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GraniteEmbedding(VocabEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, multiplier: float) -> None:
        super().__init__(vocab_size, hidden_size)
        self.multiplier = multiplier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.multiplier


class GraniteAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        assert config.attention_multiplier is not None
        self.attn.scale = config.attention_multiplier
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        return super().forward(positions, x, md) * self.residual_multiplier


class GraniteMLP(LlamaMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteDecoderLayer(PreNormDecoderLayer):
    self_attn: GraniteAttention
    mlp: GraniteMLP

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GraniteAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GraniteMLP(config)

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear]:
        return self.self_attn.qkv_proj, self.mlp.gate_up_proj


class GraniteModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = GraniteEmbedding(config.vocab_size, config.hidden_size,
                                             config.embedding_multiplier)
        self.layers = nn.ModuleList(
            GraniteDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GraniteForCausalLM(LlamaForCausalLM):
    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return GraniteModel(config, max_positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.config.logits_scaling
