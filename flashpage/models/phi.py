"""Microsoft's Phi-1 / Phi-1.5 / Phi-2 (PhiForCausalLM): Llama's attention, head and loading
(models/llama.py: q/k/v_proj stacked into ``qkv_proj``) under Phi's names
(models/common.HFNames), with:

- ONE LayerNorm with bias a layer (``layer_norm_eps``), whose output attention and the MLP
  both read (models/common.ParallelDecoderLayer): x + attn(h) + mlp(h);
- a bias on q, k, v and ``dense`` (our o_proj);
- rotary on the first ``partial_rotary_factor`` of each head (Phi-2: 0.4, neox halves);
- ``qk_layernorm``: a LayerNorm with bias over each head of q and of k (one head_dim-wide
  weight shared by the heads), before rotary;
- the non-gated MLP ``fc1`` -> GELU (``gelu_new``) -> ``fc2``, biased (layers/mlp.MLP,
  our c_fc / c_proj);
- ``final_layernorm`` (our model.norm) and an LM head WITH a bias (``lm_head.bias``,
  ModelConfig.lm_head_bias), added by ``lm_head`` in compute_logits and so in every logits
  path (sampling, prompt logprobs, CUDA graphs, drafts)."""

from __future__ import annotations

from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.linear import VocabEmbedding
from flashpage.layers.mlp import MLP
from flashpage.layers.norm import LayerNorm
from flashpage.models.common import DecoderStack, HFNames, ParallelDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM

NAMES = HFNames({
    "model.final_layernorm": "model.norm",
    "model.layers.{}.self_attn.dense": "model.layers.{}.self_attn.o_proj",
    "model.layers.{}.self_attn.q_layernorm": "model.layers.{}.self_attn.q_norm",
    "model.layers.{}.self_attn.k_layernorm": "model.layers.{}.self_attn.k_norm",
    "model.layers.{}.mlp.fc1": "model.layers.{}.mlp.c_fc",
    "model.layers.{}.mlp.fc2": "model.layers.{}.mlp.c_proj",
})


class PhiAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        if config.qk_norm:  # LayerNorms with bias, not Qwen3's RMSNorms
            self.q_norm = LayerNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = LayerNorm(self.head_dim, config.rms_norm_eps)


class PhiDecoderLayer(ParallelDecoderLayer):
    """One norm; summed (attn + mlp) + x, as transformers does."""

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PhiAttention(config, layer_idx, max_positions)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                       bias=config.mlp_bias)
        self.post_attention_layernorm = None


class PhiModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(PhiDecoderLayer(config, i, max_positions)
                                    for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps)


class PhiForCausalLM(LlamaForCausalLM):
    hf_names = NAMES

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return PhiModel(config, max_positions)
