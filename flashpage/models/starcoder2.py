"""BigCode's StarCoder2 (Starcoder2ForCausalLM): Llama's attention and loading
(models/llama.py: merged ``qkv_proj``, neox rotary) and pre-norm layer
(models/common.PreNormDecoderLayer), with:

- LayerNorms with bias (layers/norm.LayerNorm, ``norm_epsilon``) instead of RMSNorms;
- ``use_bias``: a bias on q, k, v and o_proj, and on the MLP's two linears;
- a non-gated MLP under HF's names, ``c_fc`` -> GELU (``hidden_act``, gelu_pytorch_tanh)
  -> ``c_proj`` (layers/mlp.MLP);
- one ``sliding_window`` for every layer, the head tied to the embeddings.

The LayerNorms take the residual add as RMSNorm does (``norm(x, residual)``; with our
kernels on, fused in kernels/layer_norm.py), but not the one-row GEMV norm prologues,
which compute RMSNorm (``norm_consumers`` stays None)."""

from __future__ import annotations

from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.linear import VocabEmbedding
from flashpage.layers.mlp import MLP
from flashpage.layers.norm import LayerNorm
from flashpage.models.common import DecoderStack, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM


class Starcoder2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                       bias=config.mlp_bias)


class Starcoder2Model(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Starcoder2DecoderLayer(config, i, max_positions)
                                    for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return Starcoder2Model(config, max_positions)
