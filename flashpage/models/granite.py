"""IBM Granite (GraniteForCausalLM, Granite 3.x dense): the Llama body and names
(models/llama.py) with four scalars from config.json: embeddings x embedding_multiplier,
each attention and MLP output x residual_multiplier before its residual add, the
attention scale attention_multiplier (instead of head_dim ** -0.5), logits /
logits_scaling.

The multipliers sit inside the modules (the embedding, the attention's and the MLP's
outputs), so the pre-norm layer, its fused residual-add norms and its one-row GEMV
norm prologues (models/common.PreNormDecoderLayer) are Llama's unchanged.

Granite MoE (GraniteMoeForCausalLM, Granite 3.0 1B-A400M / 3B-A800M) and GraniteMoeShared:
the same body with ``GraniteMoeBlock`` as every layer's MLP (so no norm prologues: the
router reads the normed input beside the experts). Its checkpoints name it differently
from ours (``_GRANITE_MOE_NAMES``): the layer's ``block_sparse_moe`` holds
``router.layer.weight`` [E, H] and the experts fused on disk, ``input_linear.weight``
[E, 2I, H] (gate rows, then up: transformers 5 only renames it ``experts.gate_up_proj``)
and ``output_linear.weight`` [E, H, I]; GraniteMoeShared's ``shared_mlp`` beside it,
``input_linear`` [2S, H] (gate, then up) and ``output_linear`` [H, S]. Ours are the
block's ``mlp.router.weight``, ``mlp.experts.{gate_up,down}_proj`` (layers/moe.py) and
``mlp.shared_mlp.{gate_up,down}_proj.weight`` (layers/mlp.GatedMLP); ``hf_weights`` gives
the checkpoint's names back."""

from __future__ import annotations

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.linear import ColumnParallelLinear, PendingNorm, VocabEmbedding
from flashpage.layers.mlp import GatedMLP
from flashpage.layers.moe import FusedExperts, MoEGate
from flashpage.layers.norm import RMSNorm
from flashpage.models.common import DecoderStack, HFNames, PreNormDecoderLayer
from flashpage.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GraniteEmbedding(VocabEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, multiplier: float) -> None:
        super().__init__(vocab_size, hidden_size)
        self.multiplier = multiplier

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.multiplier


class GraniteAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__(config, layer_idx, max_positions)
        assert config.attention_multiplier is not None
        self.attn.scale = config.attention_multiplier
        self.residual_multiplier = config.residual_multiplier

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        return super().forward(positions, x, md) * self.residual_multiplier


class GraniteMLP(LlamaMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size)
        self.residual_multiplier = config.residual_multiplier

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        return super().forward(x) * self.residual_multiplier


class GraniteMoeBlock(nn.Module):
    """Granite MoE's MLP: ``router`` (softmax over the k best logits = the top-k softmax
    weights renormalized, MoEGate), ``experts`` (FusedExperts of intermediate_size) and,
    for GraniteMoeShared, ``shared_mlp`` (GatedMLP of shared_intermediate_size, not gated)
    added to them; the sum x residual_multiplier. forward takes [..., hidden] and keeps
    the shape."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = MoEGate(config)
        self.experts = FusedExperts(config)
        shared = config.shared_expert_intermediate_size
        self.shared_mlp = GatedMLP(config.hidden_size, shared) if shared else None
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = self.router(x)
        out = self.experts(x, weights, ids)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(x)
        return (out * self.residual_multiplier).view(shape)


class GraniteDecoderLayer(PreNormDecoderLayer):
    self_attn: GraniteAttention
    mlp: GraniteMLP | GraniteMoeBlock

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GraniteAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GraniteMoeBlock(config) if config.n_routed_experts else GraniteMLP(config)

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear] | None:
        if isinstance(self.mlp, GraniteMoeBlock):
            return None  # the router and the shared MLP both read the normed input
        return self.self_attn.qkv_proj, self.mlp.gate_up_proj


class GraniteModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = GraniteEmbedding(config.vocab_size, config.hidden_size,
                                             config.embedding_multiplier)
        self.embedding_multiplier = config.embedding_multiplier
        self.layers = nn.ModuleList(
            GraniteDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def from_inputs_embeds(self, values: torch.Tensor) -> torch.Tensor:
        """transformers multiplies inputs_embeds by embedding_multiplier, as looked-up rows."""
        return values * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        return GraniteModel(config, max_positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.config.logits_scaling


# Granite MoE's checkpoint names -> ours (its MoE block sits under our ``mlp``)
_GRANITE_MOE_NAMES = HFNames({
    "model.layers.{}.block_sparse_moe.router.layer": "model.layers.{}.mlp.router",
    "model.layers.{}.block_sparse_moe.input_linear.weight": "model.layers.{}.mlp.experts.gate_up_proj",
    "model.layers.{}.block_sparse_moe.output_linear.weight": "model.layers.{}.mlp.experts.down_proj",
    "model.layers.{}.shared_mlp.input_linear": "model.layers.{}.mlp.shared_mlp.gate_up_proj",
    "model.layers.{}.shared_mlp.output_linear": "model.layers.{}.mlp.shared_mlp.down_proj",
})


class GraniteMoeForCausalLM(GraniteForCausalLM):
    """Granite MoE and GraniteMoeShared: GraniteForCausalLM whose layers hold a
    GraniteMoeBlock (config.n_routed_experts), loading the checkpoint's names
    (``_GRANITE_MOE_NAMES``, as ``hf_names``; transformers 5's in-memory ``block_sparse_moe.router.weight``
    and ``block_sparse_moe.experts.*`` load too, through Mixtral's rename to ``mlp``)."""

    hf_names = _GRANITE_MOE_NAMES
