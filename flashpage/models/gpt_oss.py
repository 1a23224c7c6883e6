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
checkpoints store the experts as MXFP4 blocks (models/mxfp4.py). Where the fused MoE
kernel runs them (the engine on CUDA with the triton backend and FLASHPAGE_FUSED_MOE on;
envs.mxfp4) they stay MXFP4 (config.mxfp4_kernel: FusedExperts(mxfp4=True), 4.25 bits a
weight: gpt-oss-20b's experts 9.5 GiB instead of 36 in bf16), their rows re-laid out at
load (:func:`mxfp4_expert_from_hf`); elsewhere they are dequantized to the model dtype.

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
    MXFP4 (kept):
    gate_up_proj_blocks [E, 2I, hidden / 32, 16]      [E, 2I, hidden / 2]  gate rows, then up
                        rows interleaved: gate, up    (the rows de-interleaved; a row's
    gate_up_proj_scales [E, 2I, hidden / 32]          bytes as they are)  [E, 2I, hidden / 32]
    down_proj_blocks    [E, hidden, I / 32, 16]       [E, hidden, I / 2]
    down_proj_scales    [E, hidden, I / 32]           the same
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


def mxfp4_expert_from_hf(name: str, t: torch.Tensor, want: tuple[int, ...]) -> torch.Tensor:
    """A checkpoint's ``...experts.{gate_up,down}_proj_{blocks,scales}`` in the layout the
    fused kernel reads (the module docstring's table): ``want`` its shape there."""
    kind = name.rsplit(".", 1)[-1]
    if kind.endswith("_blocks"):
        if t.dim() != 4 or t.shape[-1] != 16:
            raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(t.shape)} is not MXFP4 "
                             "blocks [E, out, in / 32, 16]")
        t = t.flatten(-2)
    if t.dtype != torch.uint8 or tuple(t.shape) != want:
        raise ValueError(f"checkpoint tensor {name!r}: {t.dtype} {tuple(t.shape)} does not fit "
                         f"the model's MXFP4 experts (uint8 {want} in our layout)")
    if kind.startswith("gate_up_proj"):  # rows (gate, up) pairs -> gate rows, then up rows
        e, two_i, k = t.shape
        t = t.view(e, two_i // 2, 2, k).transpose(1, 2).reshape(e, two_i, k)
    return t


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
                         activation=ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit),
                         mxfp4=config.mxfp4_kernel)


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
    expert tensors are kept (config.mxfp4_kernel: re-laid out, mxfp4_expert_from_hf) or
    dequantized on their way in (models/mxfp4.py), and the 16-bit experts' converted to
    our layout (experts_from_hf; hf_weights: experts_to_hf)."""

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return GptOssModel(config, max_positions)

    def attention_layers(self) -> list[Attention]:
        return [cast(GptOssDecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def _experts(self) -> list[GptOssExperts]:
        return [cast(GptOssDecoderLayer, layer).mlp.experts for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = self._experts()[0]
        bias = experts.down_proj_bias
        assert bias is not None  # GPT-OSS's experts have biases
        if experts.mxfp4:
            kept: set[str] = set()
            weights = self._keep_mxfp4(weights, kept)
            return super().load_weights(weights) | kept
        # fp16 models dequantize through fp32 (an e8m0 scale may leave fp16's range)
        dtype = bias.dtype
        hf = mxfp4_weights(weights, torch.float32 if dtype == torch.float16 else dtype,
                           self.config.mxfp4_experts)
        return super().load_weights((name, experts_from_hf(name, t)) for name, t in hf)

    def _keep_mxfp4(self, weights: Iterable[tuple[str, torch.Tensor]],
                    kept: set[str]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's MXFP4 expert tensors copied into the experts' buffers (their
        names added to ``kept``); the other tensors passed on, in our layout."""
        buffers = {n: b for n, b in self.named_buffers() if n.endswith(_MXFP4_BUFFERS)}
        for name, t in weights:
            if name.endswith(("_blocks", "_scales")):
                if name not in buffers:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                     f"{type(self).__name__} (its MXFP4 experts hold "
                                     "experts.{gate_up,down}_proj_{blocks,scales})")
                buf = buffers[name]
                buf.copy_(mxfp4_expert_from_hf(name, t, tuple(buf.shape)))
                kept.add(name)
            elif _expert_tensor(name) in ("gate_up_proj", "down_proj"):
                raise ValueError(f"checkpoint tensor {name!r} is a 16-bit expert weight, but "
                                 "config.json's quantization_config says mxfp4 and the experts "
                                 "are held in MXFP4 (FLASHPAGE_MXFP4=dequant cannot help: the "
                                 "checkpoint and its config disagree)")
            else:
                yield name, experts_from_hf(name, t)

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Under HF's names, the 16-bit experts in transformers' layout; MXFP4-held experts
        dequantized to the model dtype (what transformers' dequantized copy holds), a layer
        at a time."""
        for name, t in super().hf_weights():
            yield name, experts_to_hf(name, t)
        for i, experts in enumerate(self._experts()):
            if experts.mxfp4:
                bias = experts.down_proj_bias
                assert bias is not None
                for proj in ("gate_up_proj", "down_proj"):
                    name = f"model.layers.{i}.mlp.experts.{proj}"
                    yield name, experts_to_hf(name, experts._weight(proj, bias.dtype))


_MXFP4_BUFFERS = ("proj_blocks", "proj_scales")
