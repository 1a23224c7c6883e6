"""Llama 4's text model (Llama4ForCausalLM: Llama-4-Scout / Maverick's language part saved on
its own), on Llama's body, head and loading (models/llama.py), read by
``config._llama4_fields``. Its differences:

- two kinds of attention layer (``ModelConfig.nope_layers``, ``layer_types``): the rotary
  ones rotate interleaved pairs (transformers' complex form), L2-norm q and k per head
  AFTER rotary (``qk_l2_norm``: no weight, so the layer rotates them itself and hands them
  to attention rotated) and attend in chunks (``attention_chunk``: a query at p sees keys
  j <= p of its own chunk, j // C == p // C; the torch_native backend's mask, which the
  other backends refuse); the NoPE ones attend to the whole context, their q scaled by
  1 + attn_scale x log1p(floor((p + 1) / floor_scale)) (``nope_attn_temperature``);
- MoE layers (``is_moe_layer``: Llama4TextConfig's ``moe_layers``), ``Llama4MoE``: a router
  in the model's dtype picks each token's top-k experts by logit; each chosen expert reads
  the token scaled by sigmoid(its logit) (the input, not the output, as transformers does)
  and their outputs sum with a shared expert's; the others a dense MLP of
  ``intermediate_size_mlp`` (held as ``ModelConfig.intermediate_size``).

Checkpoint names are transformers' but for ``feed_forward`` (our ``mlp``, ``HFNames``) and the
routed experts, stored fused and transposed there (``experts.gate_up_proj`` [E, H, 2I],
``experts.down_proj`` [E, I, H]; ours ``FusedExperts``' [E, 2I, H] and [E, H, I]).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import ColumnParallelLinear, PendingNorm, VocabEmbedding
from flashpage.layers.mlp import GatedMLP
from flashpage.layers.moe import SYNC_FREE_MAX_TOKENS, FusedExperts
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, HFNames, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

# the routed experts' tensors, transposed between the checkpoint and FusedExperts
_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32, rounded once (transformers' Llama4TextL2Norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        self.attn.chunk_size = config.attention_chunk(layer_idx)
        rope = config.uses_rope(layer_idx)
        self.l2_eps = config.rms_norm_eps if config.qk_l2_norm and rope else None
        self.temperature = None if rope else config.nope_attn_temperature

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        if self.l2_eps is not None:
            q, k = l2_norm(q, self.l2_eps), l2_norm(k, self.l2_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scale = torch.log1p(torch.floor((positions[:n].float() + 1.0) / floor_scale)) \
                * attn_scale + 1.0
            q = (q * scale[:, None, None]).to(q.dtype)
        o = self.attn(q, k, v, md, positions=positions, rotary=None)
        return self.o_proj(o)


class Llama4MoE(nn.Module):
    """``router`` (hidden -> experts, the model's dtype), ``experts`` (FusedExperts of
    moe_intermediate_size), ``shared_expert`` (GatedMLP). forward takes [..., hidden] and
    keeps the shape: shared(x) + sum over the top-k experts e of expert_e(x * sigmoid(l_e))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.router = ColumnParallelLinear(config.hidden_size, config.n_routed_experts)
        self.router.quantizable = False  # (transformers' is a plain Linear too)
        self.experts = FusedExperts(config)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        n, k = x.shape[0], self.top_k
        top, ids = self.router(x).topk(k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)
        # each (token, expert) pair one row of its scaled input, weighted 1 afterwards
        rows = (x[:, None, :] * scores[..., None]).reshape(n * k, -1)
        ones = torch.ones(n * k, 1, dtype=torch.float32, device=x.device)
        routed = self.experts(rows, ones, ids.reshape(n * k, 1)).view(n, k, -1).sum(1)
        return (self.shared_expert(x) + routed).view(shape)


class Llama4DecoderLayer(PreNormDecoderLayer):
    self_attn: Llama4Attention

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Llama4Attention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp: nn.Module = (Llama4MoE(config) if config.is_moe_layer(layer_idx)
                               else LlamaMLP(h, config.intermediate_size))

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear] | None:
        if isinstance(self.mlp, LlamaMLP):  # the router and the shared expert both read x
            return self.self_attn.qkv_proj, self.mlp.gate_up_proj
        return None


class Llama4Model(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Llama4DecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama4ForCausalLM(LlamaForCausalLM):
    hf_names = HFNames({"model.layers.{}.feed_forward": "model.layers.{}.mlp"})

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config, max_positions)
        # the experts see top_k rows a token (Llama4MoE): CUDA graphs hold as many tokens as
        # keep those rows on the sync-free path
        self.max_graph_tokens = SYNC_FREE_MAX_TOKENS // max(config.num_experts_per_tok, 1)

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return Llama4Model(config, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Llama's, the routed experts' fused tensors transposed to FusedExperts' layout."""
        return super().load_weights(
            (name, t.transpose(1, 2) if name.endswith(_EXPERTS) else t) for name, t in weights)

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        for name, t in super().hf_weights():
            yield name, (t.transpose(1, 2) if name.endswith(_EXPERTS) else t)


__all__ = ["Llama4ForCausalLM"]
