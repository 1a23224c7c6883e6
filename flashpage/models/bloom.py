"""BigScience's Bloom (BloomForCausalLM): Falcon's sequential layer (models/falcon.py, on
Llama's attention, head and loading) under Bloom's names, with:

- ALiBi instead of rotary: every query head h adds m_h * (j - i) to its scores, Bloom's
  geometric slopes (layers/alibi.py; transformers adds m_h * j, the same up to a constant per
  query row, which the softmax cancels), one AlibiSlopes for all layers;
- ``word_embeddings_layernorm``: a LayerNorm on the token embeddings before the first layer;
- LayerNorms with bias (``layer_norm_epsilon``): input_layernorm before attention,
  post_attention_layernorm before the MLP (each after its residual add), ``ln_f`` at the end;
- the fused ``self_attention.query_key_value`` (biased), its rows head by head, [q k v] for
  each head (transformers' view(.., heads, 3, head_dim)), regrouped into our qkv_proj ([all
  q | all k | all v]) at load and back in ``hf_weights`` (models/fused_qkv.py);
- ``dense`` (biased), the MLP dense_h_to_4h -> GELU (tanh form, bloom_gelu) -> dense_4h_to_h
  with biases, the head tied to word_embeddings unless ``tie_word_embeddings`` is false.

LoRA targets: dense, dense_h_to_4h and dense_4h_to_h, not query_key_value (its rows are
not one slice of ours)."""

from __future__ import annotations

import re

import torch
from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.alibi import AlibiSlopes
from flashpage.layers.linear import VocabEmbedding
from flashpage.layers.norm import LayerNorm
from flashpage.models.common import FUSED_QKV_TENSORS, DecoderStack, HFNames
from flashpage.models.falcon import FalconSequentialLayer
from flashpage.models.fused_qkv import FusedQKVForCausalLM

_QKV = re.compile(r"\.self_attention\.query_key_value" + FUSED_QKV_TENSORS)

BLOOM_NAMES = HFNames({
    "transformer.word_embeddings_layernorm": "model.embed_layernorm",
    "transformer.word_embeddings": "model.embed_tokens",
    "transformer.ln_f": "model.norm",
    "transformer.h.{}.self_attention.query_key_value": "model.layers.{}.self_attn.qkv_proj",
    "transformer.h.{}.self_attention.dense": "model.layers.{}.self_attn.o_proj",
    "transformer.h.{}.self_attention": "model.layers.{}.self_attn",
    "transformer.h.{}.mlp.dense_h_to_4h": "model.layers.{}.mlp.c_fc",
    "transformer.h.{}.mlp.dense_4h_to_h": "model.layers.{}.mlp.c_proj",
    "transformer.h.{}": "model.layers.{}",  # input_layernorm, post_attention_layernorm, mlp
})


class BloomModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        alibi = AlibiSlopes.for_config(config)
        self.layers = nn.ModuleList(FalconSequentialLayer(config, i, max_positions, alibi)
                                    for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_layernorm(self.embed_tokens(input_ids))
        assert isinstance(x, torch.Tensor)
        return x

    def from_inputs_embeds(self, values: torch.Tensor) -> torch.Tensor:
        """transformers norms inputs_embeds (word_embeddings_layernorm), as looked-up rows."""
        x = self.embed_layernorm(values)
        assert isinstance(x, torch.Tensor)
        return x


class BloomForCausalLM(FusedQKVForCausalLM):
    qkv_tensor = _QKV
    hf_names = BLOOM_NAMES

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return BloomModel(config, max_positions)
