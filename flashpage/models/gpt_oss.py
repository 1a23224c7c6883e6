"""GPT-OSS (GptOssForCausalLM): Llama's pre-norm layer with

- attention sinks: each layer's ``self_attn.sinks`` [heads] (fp32), a learned logit per
  query head in its softmax denominator (kernels/sinks.py, through the backend's ``sinks``);
- alternating windowed and full layers (``layer_types``; window ``sliding_window``, 128),
  biases on q/k/v/o, YaRN rope (layers/rotary.yarn_inv_freq);
- a mixture of experts in every layer (``mlp.router``, ``mlp.experts``): the router is a
  Linear with bias over the experts; the top-k of its logits, softmaxed over the k, weigh
  the chosen experts, each ``(up + 1) * glu`` of an interleaved gate/up projection with
  biases (``gate_up_proj`` [E, hidden, 2I]: even columns gate, odd up) where gate is clamped
  above and up both ways at ``swiglu_limit`` and glu = gate * sigmoid(alpha * gate), then
  ``down_proj`` [E, I, hidden] plus its bias;
- RMSNorms whose weights stay fp32 (transformers keeps them so: the product is rounded once).

Parameter names are transformers' (q/k/v merged into ``qkv_proj`` as Llama's); released
checkpoints store the experts as MXFP4 blocks, dequantized at load (models/mxfp4.py).

The experts run here, not through layers/moe.FusedExperts or the fused MoE kernel
(kernels/fused_moe.py): those have neither biases nor this activation, and keep gate and
up in two halves rather than interleaved. The paths are FusedExperts' (sync-free up to
SYNC_FREE_MAX_TOKENS tokens, for CUDA graphs; grouped by expert past it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.attention import Attention
from flashpage.layers.fp32 import KeepFp32
from flashpage.layers.linear import (
    ColumnParallelLinear,
    PendingNorm,
    RowParallelLinear,
    VocabEmbedding,
)
from flashpage.layers.moe import SYNC_FREE_MAX_TOKENS
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


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[..., 2I] with gate in the even columns and up in the odd ones -> [..., I]:
    (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit)."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """All experts' weights in transformers' layout (x @ W)::

        gate_up_proj       [E, hidden, 2I]   columns interleaved: gate, up, gate, up, ...
        gate_up_proj_bias  [E, 2I]
        down_proj          [E, I, hidden]
        down_proj_bias     [E, hidden]
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.n_routed_experts
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e
        self.alpha, self.limit = config.swiglu_alpha, config.swiglu_limit
        self.sync_free_max_tokens = SYNC_FREE_MAX_TOKENS
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], weights fp32 [N, k], ids int64 [N, k] -> sum_k weights * expert_k(x)."""
        if x.shape[0] <= self.sync_free_max_tokens:
            n, k = ids.shape
            ys = self._gathered(x, ids) if 3 * n * k <= self.num_experts else self._all_experts(x, ids)
            return (ys * weights[..., None]).to(x.dtype).sum(1)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"MoE over {x.shape[0]} tokens syncs with the host and cannot be captured in a "
                f"CUDA graph; capture at most {self.sync_free_max_tokens} tokens")
        return self.forward_grouped(x, weights, ids)

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pair with its own expert's weights: -> [N, k, hidden]."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        xs = x[:, None, :].expand(n, k, x.shape[1]).reshape(n * k, 1, x.shape[1])
        h = torch.bmm(xs, self.gate_up_proj.index_select(0, flat))
        h = h + self.gate_up_proj_bias.index_select(0, flat)[:, None]
        y = torch.bmm(clamped_swiglu(h, self.alpha, self.limit), self.down_proj.index_select(0, flat))
        y = y + self.down_proj_bias.index_select(0, flat)[:, None]
        return y.view(n, k, x.shape[1])

    def _all_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, then each token's k picked: -> [N, k, hidden]."""
        n, k = ids.shape
        h = torch.matmul(x, self.gate_up_proj) + self.gate_up_proj_bias[:, None]  # [E, N, 2I]
        y = torch.bmm(clamped_swiglu(h, self.alpha, self.limit), self.down_proj)
        y = y + self.down_proj_bias[:, None]  # [E, N, hidden]
        rows = ids * n + torch.arange(n, device=x.device)[:, None]  # row of (expert, token)
        return y.reshape(-1, x.shape[1]).index_select(0, rows.reshape(-1)).view(n, k, x.shape[1])

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
        """Same contract as :meth:`forward`; one matmul pair per used expert, one host sync."""
        n, k = ids.shape
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
        token = order // k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one sync
        xs = x.index_select(0, token)
        ys = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            seg = xs[start:start + c]
            h = seg @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            ys[start:start + c] = (clamped_swiglu(h, self.alpha, self.limit) @ self.down_proj[e]
                                   + self.down_proj_bias[e])
            start += c
        ys = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)


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
    expert tensors are dequantized on their way in (models/mxfp4.py)."""

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return GptOssModel(config, max_positions)

    def attention_layers(self) -> list[Attention]:
        return [cast(GptOssDecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        dtype = cast(GptOssDecoderLayer, self.model.layers[0]).mlp.experts.gate_up_proj.dtype
        # fp16 models dequantize through fp32 (an e8m0 scale may leave fp16's range)
        return super().load_weights(mxfp4_weights(
            weights, torch.float32 if dtype == torch.float16 else dtype, self.config.mxfp4_experts))
