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

from flashpage.config import ModelConfig
from flashpage.layers.activation import XIELU
from flashpage.layers.mlp import MLP
from flashpage.models.arcee import ArceeDecoderLayer, ArceeModel
from flashpage.models.common import DecoderStack, HFNames
from flashpage.models.llama import LlamaForCausalLM

NAMES = HFNames({
    "model.layers.{}.attention_layernorm": "model.layers.{}.input_layernorm",
    "model.layers.{}.feedforward_layernorm": "model.layers.{}.post_attention_layernorm",
    "model.layers.{}.mlp.up_proj": "model.layers.{}.mlp.c_fc",
    "model.layers.{}.mlp.down_proj": "model.layers.{}.mlp.c_proj",
    "model.layers.{}.mlp.act_fn": "model.layers.{}.mlp.act",
})
_BUFFERS = (".mlp.act.beta", ".mlp.act.eps")


class ApertusDecoderLayer(ArceeDecoderLayer):
    """Arcee's layer with xIELU in its MLP (another plain ``hidden_act`` as Arcee's) and no
    MLP biases."""

    def _mlp(self, config: ModelConfig) -> MLP:
        xielu = config.hidden_act == "xielu"
        mlp = MLP(config.hidden_size, config.intermediate_size,
                  "relu" if xielu else config.hidden_act, bias=False)
        if xielu:
            mlp.act = XIELU()  # type: ignore[assignment]
        return mlp


class ApertusModel(ArceeModel):
    layer_cls = ApertusDecoderLayer


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
