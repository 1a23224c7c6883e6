"""MosaicML's MPT (MptForCausalLM: MPT-7B / 30B and their instruct / chat tunes), as
transformers runs it: Llama's pre-norm layer, head and loading (models/llama.py) under
MPT's names, with:

- ALiBi instead of rotary: every query head h adds m_h * (j - i) to its scores, MPT's slopes
  from ``attn_config.alibi_bias_max`` (layers/alibi.py; transformers adds m_h * (j - (L - 1)),
  the same up to a constant per query row, which the softmax cancels), one AlibiSlopes for
  all layers;
- ``attn.Wqkv`` holding q, k and v as [q | k | v] rows (our qkv_proj's order as it is),
  clamped to [-clip_qkv, clip_qkv] (``attn_config.clip_qkv``) after the projection, and
  ``attn.out_proj``; q.k scaled by ``attn_config.softmax_scale`` (else head_dim ** -0.5);
- LayerNorms (``norm_1`` before attention, ``norm_2`` before the MLP, ``norm_f`` at the end;
  ``layer_norm_epsilon``), no bias on them or any linear unless ``no_bias`` is false
  (``ModelConfig.attention_bias``: then every one has one, as in MosaicML's code;
  transformers' MPT never builds them);
- the MLP ``ffn.up_proj`` -> exact GELU -> ``ffn.down_proj`` (4 x d_model),
  the head tied to ``wte`` unless ``tie_word_embeddings`` is false, logits x ``logit_scale``.

LoRA targets: out_proj, up_proj and down_proj (LlamaForCausalLM's under MPT's names).
"""

from __future__ import annotations

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.alibi import AlibiSlopes
from flashpage.layers.linear import PendingNorm, VocabEmbedding
from flashpage.layers.mlp import MLP
from flashpage.layers.norm import LayerNorm
from flashpage.models.common import DecoderStack, HFNames, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM

MPT_NAMES = HFNames({
    "transformer.wte": "model.embed_tokens",
    "transformer.norm_f": "model.norm",
    "transformer.blocks.{}.norm_1": "model.layers.{}.input_layernorm",
    "transformer.blocks.{}.norm_2": "model.layers.{}.post_attention_layernorm",
    "transformer.blocks.{}.attn.Wqkv": "model.layers.{}.self_attn.qkv_proj",
    "transformer.blocks.{}.attn.out_proj": "model.layers.{}.self_attn.o_proj",
    "transformer.blocks.{}.attn": "model.layers.{}.self_attn",
    "transformer.blocks.{}.ffn.up_proj": "model.layers.{}.mlp.c_fc",
    "transformer.blocks.{}.ffn.down_proj": "model.layers.{}.mlp.c_proj",
    "transformer.blocks.{}.ffn": "model.layers.{}.mlp",
    "transformer.blocks.{}": "model.layers.{}",
})


def _norm(config: ModelConfig) -> LayerNorm:
    # no_bias covers the norms and the linears alike (attention_bias == mlp_bias here)
    return LayerNorm(config.hidden_size, config.rms_norm_eps, bias=config.attention_bias)


class MptAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int,
                 alibi: AlibiSlopes | None) -> None:
        super().__init__(config, layer_idx, max_positions, alibi=alibi)
        self.clip_qkv = config.clip_qkv
        if config.attention_multiplier is not None:  # attn_config.softmax_scale
            self.attn.scale = config.attention_multiplier

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:  # q, k and v alike: one clamp over Wqkv's output
            qkv = qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, md))  # no rotary: ALiBi is in attention


class MptBlock(PreNormDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int,
                 alibi: AlibiSlopes | None) -> None:
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = MptAttention(config, layer_idx, max_positions, alibi)
        self.post_attention_layernorm = _norm(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                       bias=config.mlp_bias)


class MptModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        alibi = AlibiSlopes.for_config(config)
        self.layers = nn.ModuleList(MptBlock(config, i, max_positions, alibi)
                                    for i in range(config.num_hidden_layers))
        self.norm = _norm(config)


class MptForCausalLM(LlamaForCausalLM):
    hf_names = MPT_NAMES

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return MptModel(config, max_positions)

    def _shards(self) -> dict[str, tuple[str, int, int]]:
        return {}  # nothing to stack: Wqkv is our qkv_proj as it is

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """Llama's, and Wqkv: our qkv_proj as it is (PEFT's default MPT target)."""
        out = super().lora_targets()
        self._qkv_target(out)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        scale = self.config.logit_scale
        return logits if scale == 1.0 else logits * scale
