"""Swiss AI's Apertus (ApertusForCausalLM, Apertus-8B / 70B): Llama's attention with Qwen3's
per-head q/k RMSNorms before rotary (``config.qk_norm``), loading and pre-norm layer
(models/llama.py), with

- a non-gated MLP, ``up_proj`` -> xIELU (``hidden_act`` xielu: layers/activation.XIELU,
  two learned scalars and two constant buffers a layer) -> ``down_proj``, no biases
  (layers/mlp.MLP; another plain ``hidden_act`` is read as Arcee's);
- the layer's norms named ``attention_layernorm`` / ``feedforward_layernorm``.

Checkpoint names map to ours through HFNames (the norms, up/down_proj -> c_fc / c_proj,
``act_fn`` -> ``act``). xIELU's ``beta`` / ``eps`` are buffers: loaded here and given back
by hf_weights under HF's names, as transformers saves them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flashpage.config import ModelConfig
from flashpage.layers.activation import XIELU
from flashpage.layers.linear import ColumnParallelLinear, VocabEmbedding
from flashpage.layers.mlp import MLP
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, HFNames, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM

NAMES = HFNames({
    "model.layers.{}.attention_layernorm": "model.layers.{}.input_layernorm",
    "model.layers.{}.feedforward_layernorm": "model.layers.{}.post_attention_layernorm",
    "model.layers.{}.mlp.up_proj": "model.layers.{}.mlp.c_fc",
    "model.layers.{}.mlp.down_proj": "model.layers.{}.mlp.c_proj",
    "model.layers.{}.mlp.act_fn": "model.layers.{}.mlp.act",
})
_BUFFERS = (".mlp.act.beta", ".mlp.act.eps")


class ApertusDecoderLayer(PreNormDecoderLayer):
    self_attn: LlamaAttention
    mlp: MLP

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(h, eps)
        xielu = config.hidden_act == "xielu"
        self.mlp = MLP(h, config.intermediate_size, "relu" if xielu else config.hidden_act,
                       bias=False)
        if xielu:
            self.mlp.act = XIELU()  # type: ignore[assignment]

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear] | None:
        return self.self_attn.qkv_proj, self.mlp.c_fc


class ApertusModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            ApertusDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ApertusForCausalLM(LlamaForCausalLM):
    hf_names = NAMES

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return ApertusModel(config, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        buffers = {n: b for n, b in self.named_buffers() if n.endswith(_BUFFERS)}
        found: set[str] = set()  # the loader expects every persistent buffer loaded too

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                ours = NAMES.to_ours(name)
                if ours in buffers:
                    buffers[ours].copy_(tensor.reshape(buffers[ours].shape))
                    found.add(ours)
                else:
                    yield name, tensor

        return super().load_weights(rest()) | found

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        yield from super().hf_weights()
        for name, b in self.named_buffers():
            if name.endswith(_BUFFERS):
                yield self.hf_name(name), b
