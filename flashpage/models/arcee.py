"""Arcee's AFM (ArceeForCausalLM): Llama's attention, norms, loading and pre-norm layer
(models/llama.py) with a non-gated MLP, ``up_proj`` -> ReLU squared (``hidden_act``
relu2) -> ``down_proj`` (transformers' NemotronMLP; ``mlp_bias`` on both). The MLP is
layers/mlp.MLP, whose linears are c_fc / c_proj: the checkpoint's up_proj / down_proj are
mapped to them (HFNames) at load and back in hf_weights, lora_targets and hf_name.

The layer's norms are RMSNorms, so the one-row GEMV norm prologues take them as Llama's
(``norm_consumers``: qkv_proj and c_fc)."""

from __future__ import annotations

from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.linear import ColumnParallelLinear, VocabEmbedding
from flashpage.layers.mlp import MLP
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, HFNames, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM

NAMES = HFNames({
    "model.layers.{}.mlp.up_proj": "model.layers.{}.mlp.c_fc",
    "model.layers.{}.mlp.down_proj": "model.layers.{}.mlp.c_proj",
})


class ArceeDecoderLayer(PreNormDecoderLayer):
    """Llama's pre-norm layer with a non-gated MLP (``_mlp``: Apertus's takes xIELU)."""

    self_attn: LlamaAttention
    mlp: MLP

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = self._mlp(config)

    def _mlp(self, config: ModelConfig) -> MLP:
        return MLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                   bias=config.mlp_bias)

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear] | None:
        return self.self_attn.qkv_proj, self.mlp.c_fc


class ArceeModel(DecoderStack):
    layer_cls: type[ArceeDecoderLayer] = ArceeDecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ArceeForCausalLM(LlamaForCausalLM):
    hf_names = NAMES

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return ArceeModel(config, max_positions)
