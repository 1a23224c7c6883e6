"""Google's Gemma text families: Gemma (1), Gemma 2 and Gemma 3 (Gemma3ForCausalLM, the
text-only model of the 1B size and of gemma-3-*-it's language part saved on its own).

All three are Llama's layer (models/llama.py: merged ``qkv_proj`` / ``gate_up_proj``,
HF's names otherwise, the same load_weights) with these differences:

- every RMSNorm multiplies by (1 + weight): the 1 is added to the checkpoint's weight at
  load, in fp32, and kept there (layers/norm.GemmaRMSNorm: a bf16 1 + w would keep ~8 bits
  of a small w), the product taken in fp32 before the one rounding, as transformers does;
  our RMSNorm kernel takes that rounding from the fp32 weight (the GEMV's norm prologue,
  whose weight must be x's dtype, steps aside in 16-bit models); ``hf_weights`` takes
  the 1 off again;
- the embeddings are scaled by sqrt(hidden_size), rounded to the model dtype first (as
  transformers does), and the LM head is tied to them;
- the MLP is GELU-tanh(gate) * up (``gelu_pytorch_tanh``);
- Gemma 2/3 (``Gemma2DecoderLayer``) wrap attention and MLP in a norm each side::

      x -> input_layernorm -> attn -> post_attention_layernorm -> + residual
        -> pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm -> + residual

  and their attention takes per-layer windows (config.layer_types), the scale
  query_pre_attn_scalar ** -0.5 and Gemma 2's attn_logit_softcapping (ModelConfig
  attention_window / attention_scale, read by LlamaAttention); Gemma 2 caps the logits
  (final_logit_softcapping); Gemma 3 normalizes q and k per head (1 + w too) and its
  sliding layers rotate with their own base (rope_local_theta, layers/rotary.get_rope).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import ColumnParallelLinear, VocabEmbedding
from flashpage.layers.mlp import GatedMLP
from flashpage.layers.norm import GemmaRMSNorm
from flashpage.models.common import DecoderStack, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM


def is_gemma_norm(name: str) -> bool:
    """Whether parameter ``name`` is one of the (1 + weight) norms' weights."""
    return name.endswith(("norm.weight", "layernorm.weight"))


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (transformers multiplies by the scale as a tensor of
    the model's dtype: a bf16 model's sqrt(2304) is 48.0, not 48.0000...)."""
    return float(torch.tensor(value, dtype=dtype).item())


class GemmaDecoderLayer(PreNormDecoderLayer):
    """Gemma 1's layer: Llama's with a GELU-tanh MLP (the norms' 1 + w folded at load)."""

    self_attn: LlamaAttention
    mlp: GatedMLP

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_positions, GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GatedMLP(h, config.intermediate_size, act=config.hidden_act)

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear] | None:
        return self.self_attn.qkv_proj, self.mlp.gate_up_proj


class Gemma2DecoderLayer(GemmaDecoderLayer):
    """Gemma 2/3's layer: a norm on each side of attention and of the MLP ("sandwich"),
    the residual added after the post-norms (carried into the next pre-norm's fused add)."""

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def norm_consumers(self) -> None:
        """None: this forward runs each norm on its own (no GEMV norm prologue yet)."""
        return None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, md))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.normalizer = config.hidden_size**0.5
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        layer = GemmaDecoderLayer if config.model_type == "gemma" else Gemma2DecoderLayer
        self.layers = nn.ModuleList(
            layer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * _in_dtype(self.normalizer, x.dtype)


class GemmaForCausalLM(LlamaForCausalLM):
    """GemmaForCausalLM, Gemma2ForCausalLM and Gemma3ForCausalLM (config.model_type says
    which layer): Llama's loading, LoRA targets and head, with the differences above."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions)
        self.final_softcap = config.final_logit_softcapping

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return GemmaModel(config, max_positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's, with each norm weight w loaded as 1 + w (computed in fp32)."""
        return super().load_weights(
            (name, t.float() + 1.0 if is_gemma_norm(name) else t) for name, t in weights)

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """HF's names and values: each norm weight as w = ours - 1 (in fp32, kept there)."""
        for name, t in super().hf_weights():
            yield name, ((t.float() - 1.0).to(t.dtype) if is_gemma_norm(name) else t)
