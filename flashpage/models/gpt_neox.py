"""EleutherAI's GPT-NeoX / Pythia (GPTNeoXForCausalLM): Llama's attention, head and loading
(models/llama.py) under GPT-NeoX's names (models/common.HFNames), with:

- LayerNorms with bias (layers/norm.LayerNorm, ``layer_norm_eps``);
- ``use_parallel_residual`` (Pythia, 20B: true): attention and the MLP both read the
  layer's input, each through its own norm (models/common.ParallelDecoderLayer)::

      x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x))

  else the pre-norm layer (models/common.PreNormDecoderLayer);
- the fused ``attention.query_key_value`` [3 x hidden, hidden] (with ``dense``, biased
  unless ``attention_bias`` is false), whose rows go head by head, each head's q, k and v
  together::

      checkpoint rows  [q0 k0 v0 | q1 k1 v1 | ...]   (each a head_dim-row block)
      our qkv_proj     [q0 q1 ... | k0 k1 ... | v0 v1 ...]

  de-interleaved at load (models/common.regroup_qkv, one q head a group) and interleaved
  back in ``hf_weights``; so its q, k, v split as Llama's and none of the kernels change;
- rotary on the first ``rotary_pct`` of each head (neox halves), base ``rotary_emb_base``;
- the non-gated MLP ``dense_h_to_4h`` -> GELU (``hidden_act``) -> ``dense_4h_to_h``,
  biased (layers/mlp.MLP, our c_fc / c_proj);
- an untied ``embed_out`` head unless ``tie_word_embeddings``.

Our names are Llama's (``model.layers.N.self_attn.qkv_proj``); the checkpoint's
(``gpt_neox.layers.N.attention.query_key_value``) come back from ``hf_weights``,
``lora_targets`` and ``hf_name``. LoRA targets: query_key_value (the whole qkv_proj, an
adapter's lora_B rows regrouped as the weight's: fused_qkv.lora_b_to_ours), dense,
dense_h_to_4h and dense_4h_to_h."""

from __future__ import annotations

import re

from torch import nn

from flashpage.config import ModelConfig
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

NAMES = HFNames({
    "gpt_neox.embed_in": "model.embed_tokens",
    "gpt_neox.final_layer_norm": "model.norm",
    "embed_out": "lm_head",
    "gpt_neox.layers.{}.attention.query_key_value": "model.layers.{}.self_attn.qkv_proj",
    "gpt_neox.layers.{}.attention.dense": "model.layers.{}.self_attn.o_proj",
    "gpt_neox.layers.{}.attention": "model.layers.{}.self_attn",
    "gpt_neox.layers.{}.mlp.dense_h_to_4h": "model.layers.{}.mlp.c_fc",
    "gpt_neox.layers.{}.mlp.dense_4h_to_h": "model.layers.{}.mlp.c_proj",
    "gpt_neox.layers.{}": "model.layers.{}",  # input_layernorm, post_attention_layernorm
})
# older checkpoints (Pythia's) hold the causal mask buffers transformers ignores too
_MASK_BUFFERS = re.compile(r"^gpt_neox\.layers\.\d+\.attention\.(bias|masked_bias)$")
_QKV = re.compile(r"\.attention\.query_key_value" + FUSED_QKV_TENSORS)


def _build(layer: nn.Module, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
    h, eps = config.hidden_size, config.rms_norm_eps
    layer.input_layernorm = LayerNorm(h, eps)
    layer.self_attn = LlamaAttention(config, layer_idx, max_positions)
    layer.post_attention_layernorm = LayerNorm(h, eps)
    layer.mlp = MLP(h, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)


class GPTNeoXParallelLayer(ParallelDecoderLayer):
    """use_parallel_residual: each branch its own norm of x; summed (attn + mlp) + x, as
    transformers' mlp + attn + x."""

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        _build(self, config, layer_idx, max_positions)


class GPTNeoXSequentialLayer(PreNormDecoderLayer):
    """use_parallel_residual false: x + attn(ln1(x)), then + mlp(ln2(...))."""

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        _build(self, config, layer_idx, max_positions)


class GPTNeoXModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        layer = GPTNeoXParallelLayer if config.use_parallel_residual else GPTNeoXSequentialLayer
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer(config, i, max_positions)
                                    for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps)


class GPTNeoXForCausalLM(FusedQKVForCausalLM):
    hf_names = NAMES
    qkv_tensor = _QKV

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return GPTNeoXModel(config, max_positions)

    def _skipped(self, name: str) -> bool:
        return _MASK_BUFFERS.match(name) is not None
