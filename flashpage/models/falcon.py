"""TII's Falcon (FalconForCausalLM): Llama's attention, head and loading (models/llama.py)
under Falcon's names (models/common.HFNames), with:

- LayerNorms with bias (``layer_norm_epsilon``) and a layer of one of three forms
  (ModelConfig.use_parallel_residual, parallel_norms; models/common's layers)::

      Falcon-40B / 180B (new_decoder_architecture):  x + attn(ln_attn(x)) + mlp(ln_mlp(x))
      Falcon-7B, Falcon2-11B (parallel_attn / one norm): x + attn(h) + mlp(h), h = ln(x)
      parallel_attn false:   x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm)

- the fused ``self_attention.query_key_value``, its rows laid out per KV group (the
  group's q heads, then its k and v head; models/common.regroup_qkv)::

      new_decoder_architecture  num_kv_heads groups   [q.. k v | q.. k v | ...]
      multi_query (7B)          one group             [q0 .. q(h-1) k v]
      neither                   a group a head        [q0 k0 v0 | q1 k1 v1 | ...]

  regrouped into our qkv_proj ([q | k | v], Llama's split) at load and back in
  ``hf_weights``; so the KV cache holds num_kv_heads heads (one for MQA) and none of the
  kernels change. A quantized checkpoint's scales and zero points for it (fp8 / AWQ /
  GPTQ: models/fp8_checkpoint.py, int4_checkpoint.py) are regrouped with its rows, its
  block scales only where a head is whole blocks (``fp8_block_unsupported``; MQA's one
  group is not regrouped at all);
- rotary on whole heads (neox halves), ``bias`` on query_key_value, dense and the MLP;
- the non-gated MLP ``dense_h_to_4h`` -> GELU (``activation``) -> ``dense_4h_to_h`` (our
  c_fc / c_proj), ``ln_f`` (our model.norm), the head tied to word_embeddings unless
  ``tie_word_embeddings`` is false.

LoRA targets: dense, dense_h_to_4h and dense_4h_to_h, not query_key_value (its rows are
not one slice of ours).

Falcon-RW (``alibi``: the sequential 7B-style layer, every head its own k and v) adds ALiBi
biases in attention instead of rotary: transformers' slopes rounded to bf16 and scaled by
head_dim ** -0.5 with the scores (layers/alibi.py), one AlibiSlopes for all layers."""

from __future__ import annotations

import re

from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.alibi import AlibiSlopes
from flashpage.layers.linear import VocabEmbedding
from flashpage.layers.mlp import MLP
from flashpage.layers.norm import LayerNorm
from flashpage.models.common import (
    FUSED_QKV_TENSORS,
    DecoderStack,
    HFNames,
    ParallelDecoderLayer,
    PreNormDecoderLayer,
)
from flashpage.models.fused_qkv import FusedQKVForCausalLM
from flashpage.models.llama import LlamaAttention

_QKV = re.compile(r"\.self_attention\.query_key_value" + FUSED_QKV_TENSORS)


def falcon_names(config: ModelConfig) -> HFNames:
    """Falcon's names for ``config``'s layer form: ln_attn / ln_mlp where a parallel layer
    has two norms, else input_layernorm (and post_attention_layernorm) as ours."""
    table = {
        "transformer.word_embeddings": "model.embed_tokens",
        "transformer.ln_f": "model.norm",
        "transformer.h.{}.self_attention.query_key_value": "model.layers.{}.self_attn.qkv_proj",
        "transformer.h.{}.self_attention.dense": "model.layers.{}.self_attn.o_proj",
        "transformer.h.{}.self_attention": "model.layers.{}.self_attn",
        "transformer.h.{}.mlp.dense_h_to_4h": "model.layers.{}.mlp.c_fc",
        "transformer.h.{}.mlp.dense_4h_to_h": "model.layers.{}.mlp.c_proj",
    }
    if config.use_parallel_residual and config.parallel_norms == 2:
        table["transformer.h.{}.ln_attn"] = "model.layers.{}.input_layernorm"
        table["transformer.h.{}.ln_mlp"] = "model.layers.{}.post_attention_layernorm"
    table["transformer.h.{}"] = "model.layers.{}"  # input_layernorm, post_attention_layernorm, mlp
    return HFNames(table)


def _build(layer: nn.Module, config: ModelConfig, layer_idx: int, max_positions: int,
           alibi: AlibiSlopes | None) -> None:
    h, eps = config.hidden_size, config.rms_norm_eps
    layer.input_layernorm = LayerNorm(h, eps)
    layer.self_attn = LlamaAttention(config, layer_idx, max_positions, alibi=alibi)
    layer.mlp = MLP(h, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)


class FalconParallelLayer(ParallelDecoderLayer):
    """new_decoder_architecture or parallel_attn: (attn + mlp) + x, as transformers'
    (mlp + attn) + x; the MLP reads its own norm of x where there are two."""

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int,
                 alibi: AlibiSlopes | None = None) -> None:
        super().__init__()
        _build(self, config, layer_idx, max_positions, alibi)
        self.post_attention_layernorm = (LayerNorm(config.hidden_size, config.rms_norm_eps)
                                         if config.parallel_norms == 2 else None)


class FalconSequentialLayer(PreNormDecoderLayer):
    """parallel_attn false (7B form): x + attn(ln(x)), then + mlp(post_attention_layernorm)."""

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int,
                 alibi: AlibiSlopes | None = None) -> None:
        super().__init__()
        _build(self, config, layer_idx, max_positions, alibi)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)


class FalconModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        layer = FalconParallelLayer if config.use_parallel_residual else FalconSequentialLayer
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        alibi = AlibiSlopes.for_config(config)  # Falcon-RW's, shared by every layer
        self.layers = nn.ModuleList(layer(config, i, max_positions, alibi)
                                    for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps)


class FalconForCausalLM(FusedQKVForCausalLM):
    qkv_tensor = _QKV

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        self.hf_names = falcon_names(config)
        super().__init__(config, max_positions)

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return FalconModel(config, max_positions)
