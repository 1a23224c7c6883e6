"""GPT-OSS (GptOssForCausalLM): Llama's pre-norm layer with

- attention sinks: each layer's ``self_attn.sinks`` [heads] (fp32), a learned logit per
  query head in its softmax denominator (kernels/sinks.py, through the backend's ``sinks``);
- alternating windowed and full layers (``layer_types``; window ``sliding_window``, 128),
  biases on q/k/v/o, YaRN rope (layers/rotary.yarn_inv_freq);
- a mixture of experts in every layer (``mlp.router``, ``mlp.experts``): the router is a
  Linear with bias over the experts; the top-k of its logits, softmaxed over the k, weigh
  the chosen experts, each ``(up + 1) * glu`` of a gate/up projection with biases, where
  gate is clamped above and up both ways at ``swiglu_limit`` and glu = gate *
  sigmoid(alpha * gate), then a down projection plus its bias;
- RMSNorms whose weights stay fp32 (transformers keeps them so: the product is rounded once).

Parameter names are transformers' (q/k/v merged into ``qkv_proj`` as Llama's); released
checkpoints store the experts as MXFP4 blocks, dequantized at load (models/mxfp4.py).

The experts are a layers/moe.FusedExperts with biases and the clamped SwiGLU, so they take
its paths: the fused MoE kernel (kernels/fused_moe.py) up to SYNC_FREE_MAX_TOKENS tokens
when the engine turns it on (set_fused_moe), else the torch sync-free path; grouped by
expert past it. Their tensors are held in FusedExperts' layout, converted once at load
(:func:`experts_from_hf`; ``hf_weights`` converts back)::

    transformers (x @ W)                              ours (F.linear, x @ W.T)
    gate_up_proj       [E, hidden, 2I] interleaved    [E, 2I, hidden]  gate rows, then up
                       columns: gate, up, gate, ...
    gate_up_proj_bias  [E, 2I] interleaved            [E, 2I]          gate half, then up
    down_proj          [E, I, hidden]                 [E, hidden, I]
    down_proj_bias     [E, hidden]                    the same
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.kernels.fused_moe import ClampedSwiGLU
from flashpage.layers.attention import Attention
from flashpage.layers.fp32 import KeepFp32
from flashpage.layers.linear import (
    ColumnParallelLinear,
    PendingNorm,
    RowParallelLinear,
    VocabEmbedding,
)
from flashpage.layers.moe import FusedExperts
from flashpage.layers.norm import RMSNorm
from flashpage.layers.rotary import get_rope
from flashpage.models.common import DecoderStack, PreNormDecoderLayer
from flashpage.models.llama import LlamaForCausalLM
from flashpage.models.mxfp4 import mxfp4_weights


class GptOssRMSNorm(KeepFp32, RMSNorm):
    """An fp32 weight: norm(x) * w in fp32, rounded once to x's dtype (layers/ops.rms_norm)."""


class GptOssAttention(KeepFp32, nn.Module):
    """Llama's attention with biases and ``sinks`` [heads], kept fp32 (KeepFp32 keeps only
    this module's own tensors: the projections take the model dtype)."""

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_size, self.kv_size = h * d, kv * d
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, (h + 2 * kv) * d,
                                             bias=config.attention_bias)
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, bias=config.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.rotary_emb = get_rope(config, max_positions, layer_idx)
        self.attn = Attention(h, d, kv, d ** -0.5, layer_idx, config.attention_window(layer_idx),
                              sinks=self.sinks)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = q.shape[0]
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, md, positions=positions, rotary=self.rotary_emb))


class GptOssRouter(KeepFp32, nn.Module):
    """weight [E, hidden], bias [E], fp32 (choices among near-equal logits are made in fp32)
    -> (weights fp32 [N, k]: the softmax of the k largest logits, ids int64 [N, k])."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight, self.bias)
        top, ids = logits.topk(self.top_k, dim=-1)
        return top.softmax(dim=-1), ids


def _expert_tensor(name: str) -> str | None:
    """'gate_up_proj', 'gate_up_proj_bias' or 'down_proj' for ``...experts.<that>``."""
    parts = name.rsplit(".", 2)
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in (
            "gate_up_proj", "gate_up_proj_bias", "down_proj"):
        return parts[-1]
    return None


def experts_from_hf(name: str, t: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor (HF name) in our layout: the experts' as the module docstring's
    table says (gate and up de-interleaved, the weights transposed); others as they are."""
    kind = _expert_tensor(name)
    if kind is None:
        return t
    dims = 2 if kind == "gate_up_proj_bias" else 3
    if t.dim() != dims or (kind != "down_proj" and t.shape[-1] % 2):
        raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(t.shape)} is not GPT-OSS's "
                         f"({dims} dims{'' if kind == 'down_proj' else ', the last one even'})")
    if kind == "gate_up_proj":  # [E, H, 2I], columns (gate, up) pairs -> [E, 2I, H]
        e, h, two_i = t.shape
        return t.unflatten(-1, (two_i // 2, 2)).permute(0, 3, 2, 1).reshape(e, two_i, h)
    if kind == "gate_up_proj_bias":
        return t.unflatten(-1, (t.shape[-1] // 2, 2)).transpose(-1, -2).reshape(t.shape)
    return t.transpose(1, 2)


def experts_to_hf(name: str, t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`experts_from_hf` (our tensor, its HF name)."""
    kind = _expert_tensor(name)
    if kind == "gate_up_proj":
        e, two_i, h = t.shape
        return t.unflatten(1, (2, two_i // 2)).permute(0, 3, 2, 1).reshape(e, h, two_i)
    if kind == "gate_up_proj_bias":
        return t.unflatten(-1, (2, t.shape[-1] // 2)).transpose(-1, -2).reshape(t.shape)
    if kind == "down_proj":
        return t.transpose(1, 2)
    return t


class GptOssExperts(FusedExperts):
    """FusedExperts with per-expert biases on both projections and GPT-OSS's clamped SwiGLU
    (swiglu_alpha, swiglu_limit); tensors in FusedExperts' layout (the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, bias=True,
                         activation=ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit))


class GptOssMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = GptOssRouter(config)
        self.experts = GptOssExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        return self.experts(x, weights, ids).view(shape)


class GptOssDecoderLayer(PreNormDecoderLayer):
    self_attn: GptOssAttention
    mlp: GptOssMLP

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GptOssAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GptOssMLP(config)


class GptOssModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's head, q/k/v merging, loading and ``hf_weights`` over GPT-OSS's body; MXFP4
    expert tensors are dequantized on their way in (models/mxfp4.py), and the experts'
    converted to our layout (experts_from_hf; hf_weights: experts_to_hf)."""

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return GptOssModel(config, max_positions)

    def attention_layers(self) -> list[Attention]:
        return [cast(GptOssDecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        dtype = cast(GptOssDecoderLayer, self.model.layers[0]).mlp.experts.gate_up_proj.dtype
        # fp16 models dequantize through fp32 (an e8m0 scale may leave fp16's range)
        hf = mxfp4_weights(weights, torch.float32 if dtype == torch.float16 else dtype,
                           self.config.mxfp4_experts)
        return super().load_weights((name, experts_from_hf(name, t)) for name, t in hf)

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in super().hf_weights():
            yield name, experts_to_hf(name, t)
