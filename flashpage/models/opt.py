"""Meta's OPT (OPTForCausalLM: facebook/opt-125m ... 66b): Llama's attention, head and
loading (models/llama.py: q/k/v_proj stacked into ``qkv_proj``) under OPT's names
(models/common.HFNames), over learned absolute positions as GPT-2's (models/gpt2.py)::

    x = project_in(embed_tokens[token]) + embed_positions[position + 2]
    layers.N (do_layer_norm_before, 125m, 1.3b and up):
        x += self_attn(self_attn_layer_norm(x))     q/k/v_proj -> out_proj
        x += fc2(relu(fc1(final_layer_norm(x))))
    layers.N (do_layer_norm_before false, 350m):
        x = self_attn_layer_norm(x + self_attn(x))
        x = final_layer_norm(x + fc2(relu(fc1(x))))
    final_layer_norm (pre-LN only) -> project_out -> lm_head (tied to embed_tokens)

- ``embed_positions`` has max_position_embeddings + 2 rows and position p reads row
  p + 2 (ModelConfig.position_offset: fairseq kept rows 0 and 1 for padding), so
  max_position_embeddings is a hard limit on max_model_len, checked when the model is
  built, as GPT-2's n_positions;
- no rotary: LlamaAttention builds none (ModelConfig.uses_rope is False with learned
  positions) and the backend writes K and V as the projections give them; q.k is scaled
  by head_dim ** -0.5 in the kernel where transformers scales q (bias included) first;
- LayerNorms of epsilon 1e-5 with bias, or with neither weight nor bias
  (``layer_norm_elementwise_affine`` false); ``enable_bias`` on q/k/v/out_proj, fc1, fc2;
- ``word_embed_proj_dim`` != hidden_size (350m: 512 of 1024): embeddings (and the head)
  of that width, ``project_in`` / ``project_out`` (no bias) around the layers. They run
  once a token and stay 16-bit under quantization (as the head; a pre-quantized file that
  quantized them has them dequantized at load);
- post-LN layers (``do_layer_norm_before`` false) carry no residual: each norm takes the
  add of its sublayer's output and input (``norm(f(x), x)``) and the layer returns
  (x, None); pre-LN layers are models/common.PreNormDecoderLayer.

Our names are Llama's (``model.layers.N.self_attn.o_proj``, ``mlp.c_fc``,
``input_layernorm``); the checkpoint's (``model.decoder.layers.N.self_attn.out_proj``,
``fc1``, ``self_attn_layer_norm``) come back from ``hf_weights``, ``lora_targets`` and
``hf_name``. The Hub's files (facebook/opt-*) name tensors as OPTModel does, without
``model.`` (``decoder.layers.0.fc1.weight``): read as transformers reads them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ConfigError, ModelConfig
from flashpage.layers.linear import ColumnParallelLinear, VocabEmbedding
from flashpage.layers.mlp import MLP
from flashpage.layers.norm import LayerNorm
from flashpage.models.common import DecoderStack, HFNames, InputEmbeds, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM


class _OPTNames(HFNames):
    """The Hub's ``decoder.*`` names (facebook/opt-*'s files) read as ``model.decoder.*``."""

    def to_ours(self, name: str) -> str:
        return super().to_ours(f"model.{name}" if name.startswith("decoder.") else name)


NAMES = _OPTNames({
    "model.decoder.final_layer_norm": "model.norm",
    "model.decoder.layers.{}.self_attn.out_proj": "model.layers.{}.self_attn.o_proj",
    "model.decoder.layers.{}.self_attn_layer_norm": "model.layers.{}.input_layernorm",
    "model.decoder.layers.{}.final_layer_norm": "model.layers.{}.post_attention_layernorm",
    "model.decoder.layers.{}.fc1": "model.layers.{}.mlp.c_fc",
    "model.decoder.layers.{}.fc2": "model.layers.{}.mlp.c_proj",
    "model.decoder.layers.{}": "model.layers.{}",  # self_attn.q_proj, k_proj, v_proj
    "model.decoder": "model",  # embed_tokens, embed_positions, project_in, project_out
})


def _build(layer: nn.Module, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
    h, eps, affine = config.hidden_size, config.rms_norm_eps, config.norm_elementwise_affine
    layer.input_layernorm = LayerNorm(h, eps, elementwise_affine=affine)
    layer.self_attn = LlamaAttention(config, layer_idx, max_positions)
    layer.post_attention_layernorm = LayerNorm(h, eps, elementwise_affine=affine)
    layer.mlp = MLP(h, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)


class OPTPreNormLayer(PreNormDecoderLayer):
    """do_layer_norm_before: x + attn(ln1(x)), then + mlp(ln2(...)), residual carried."""

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        _build(self, config, layer_idx, max_positions)


class OPTPostNormLayer(nn.Module):
    """do_layer_norm_before false: x = ln1(x + attn(x)); x = ln2(x + mlp(x)). Each norm
    takes its add (``norm(f(x), x)``, the fused kernel's residual add); the layer hands
    the next the whole hidden state and no residual."""

    input_layernorm: LayerNorm
    self_attn: LlamaAttention
    post_attention_layernorm: LayerNorm
    mlp: MLP

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        _build(self, config, layer_idx, max_positions)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, None]:
        if residual is not None:
            x = x + residual
        x, _ = self.input_layernorm(self.self_attn(positions, x, md), x)
        x, _ = self.post_attention_layernorm(self.mlp(x), x)
        return x, None


class OPTDecoder(DecoderStack):
    """embed_tokens [vocab, word_embed_proj_dim], embed_positions [max_pos + 2, hidden],
    project_in / project_out where the two widths differ, the layers, and ``norm`` (the
    final LayerNorm) only where ``config.final_norm``."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        n = config.max_position_embeddings
        if max_positions > n:
            raise ConfigError(
                f"max_model_len {max_positions} is past {config.architecture}'s "
                f"max_position_embeddings ({n}): its learned position embeddings "
                f"(embed_positions) have no row for later positions; use max_model_len <= {n}")
        h = config.hidden_size
        width = config.word_embed_proj_dim or h
        self.position_offset = config.position_offset
        self.embed_tokens = VocabEmbedding(config.vocab_size, width)
        self.embed_positions = VocabEmbedding(n + config.position_offset, h)
        self.project_in: ColumnParallelLinear | None = None
        self.project_out: ColumnParallelLinear | None = None
        if width != h:
            self.project_in = ColumnParallelLinear(width, h)
            self.project_out = ColumnParallelLinear(h, width)
            self.project_in.quantizable = self.project_out.quantizable = False
        layer = OPTPreNormLayer if config.do_layer_norm_before else OPTPostNormLayer
        self.layers = nn.ModuleList(layer(config, i, max_positions)
                                    for i in range(config.num_hidden_layers))
        self.final_norm = config.final_norm
        if config.final_norm:
            self.norm = LayerNorm(h, config.rms_norm_eps,
                                  elementwise_affine=config.norm_elementwise_affine)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata, inputs_embeds: InputEmbeds | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if inputs_embeds is not None:  # [.., word_embed_proj_dim], before project_in (as HF)
            x = inputs_embeds.splice(x)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + self.position_offset)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        if self.final_norm:
            x, _ = self.norm(x, residual)
        elif residual is not None:  # pre-LN without its final norm (_remove_final_layer_norm)
            x = x + residual
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTForCausalLM(LlamaForCausalLM):
    hf_names = NAMES

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return OPTDecoder(config, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF's (name, tensor) pairs, the Hub's ``decoder.*`` names read as ``model.decoder.*``."""
        return super().load_weights((f"model.{name}" if name.startswith("decoder.") else name, t)
                                    for name, t in weights)
