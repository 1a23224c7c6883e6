"""OLMoE (OlmoeForCausalLM): Llama's pre-norm layer with OLMo2's attention (q_norm / k_norm
RMSNorms over the whole q and k projections, models/olmo2.py), q, k and v clamped to
+-``clip_qkv`` after those norms where the config sets it, and a mixture of experts in
every layer: ``layers/moe.SparseMoeBlock`` (``mlp.gate``, ``mlp.experts``; no shared
expert), softmax top-k weights divided by their sum only if ``norm_topk_prob``.

Names, loading and ``hf_weights`` are Llama's (models/llama.py): checkpoints hold one
tensor per expert (``mlp.experts.{e}.gate_proj.weight`` ...), fused on load."""

from __future__ import annotations

from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.linear import VocabEmbedding
from flashpage.layers.moe import SparseMoeBlock
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, PreNormDecoderLayer
from flashpage.models.llama import LlamaForCausalLM
from flashpage.models.olmo2 import Olmo2Attention


class OlmoeDecoderLayer(PreNormDecoderLayer):
    """No ``norm_consumers``: the router reads the normed input beside the experts."""

    self_attn: Olmo2Attention
    mlp: SparseMoeBlock

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Olmo2Attention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config)


class OlmoeModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            OlmoeDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class OlmoeForCausalLM(LlamaForCausalLM):
    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return OlmoeModel(config, max_positions)
