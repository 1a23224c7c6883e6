"""Cohere's Command-R / Command-R+ / Aya (CohereForCausalLM) and Command R7B / Command A
(Cohere2ForCausalLM): Llama's projections, names and loading (models/llama.py: merged
``qkv_proj`` / ``gate_up_proj``, SiLU-gated MLP) with:

- LayerNorms without bias (layers/norm.LayerNorm: mean-subtracted, in fp32) instead of
  RMSNorms, and ONE norm a layer, whose output both attention and the MLP read
  (models/common.ParallelDecoderLayer)::

      x -> input_layernorm -> h;   x + attn(h) + mlp(h)

- logits x ``logit_scale`` (Command-R: 1/16), the head tied to the embeddings;
- rotary on interleaved pairs (x[2i], x[2i + 1]), transformers' Cohere rotate_half
  (config.rope_interleaved; our rotary kernels' is_neox=False);
- Command-R+'s ``use_qk_norm``: a LayerNorm on each head of q and of k, with its own
  weights per head ([heads, head_dim]), before rotary.

Command R7B / Command A (Cohere2ForCausalLM) are this very model, their differences all
in ModelConfig and read by LlamaAttention: layers of two kinds (``config.layer_types``),
sliding ones attending within ``sliding_window`` with rotary as above, full-attention
ones to the whole context with no positional embedding at all (NoPE:
``config.uses_rope`` is False there, so the layer has no ``rotary_emb`` and q and k go to
the cache unrotated); no q/k norms.

No norm here is an RMSNorm, so the one-row GEMV norm prologues are not used
(``norm_consumers`` stays None; ``fuses_norm`` takes RMSNorms only); with our kernels on,
the LayerNorms (q/k's per-head ones too) run kernels/layer_norm.py."""

from __future__ import annotations

import torch
from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.linear import VocabEmbedding
from flashpage.layers.mlp import GatedMLP
from flashpage.layers.norm import LayerNorm
from flashpage.models.common import DecoderStack, ParallelDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM


class CohereAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        if config.qk_norm:  # per-head weights, not Qwen3's one head_dim-wide RMSNorm
            self.q_norm = LayerNorm((self.num_heads, self.head_dim), config.rms_norm_eps,
                                    bias=False)
            self.k_norm = LayerNorm((self.num_kv_heads, self.head_dim), config.rms_norm_eps,
                                    bias=False)


class CohereDecoderLayer(ParallelDecoderLayer):
    """One norm whose output attention and the MLP both read; summed as transformers
    does, (x + attn) + mlp."""

    residual_first = True

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=False)
        self.self_attn = CohereAttention(config, layer_idx, max_positions)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act)
        self.post_attention_layernorm = None


class CohereModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            CohereDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=False)


class CohereForCausalLM(LlamaForCausalLM):
    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return CohereModel(config, max_positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.config.logit_scale
