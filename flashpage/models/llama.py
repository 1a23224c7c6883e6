"""The Llama family: Llama 2/3/3.1, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), and their
*ForSequenceClassification (the same body, a ``score`` head instead of the LM head); and the
same body with mixture-of-experts MLPs (``layers/moe.SparseMoeBlock`` where
``config.is_moe_layer``): Mixtral, Qwen2-MoE (plus a gated shared expert), Qwen3-MoE.

Parameter names are HF's, except two merged projections: ``qkv_proj`` holds q_proj,
k_proj and v_proj stacked, ``gate_up_proj`` holds gate_proj and up_proj (one GEMM each
instead of five, and SiLU·mul reads its [N, 2I] input without a copy). ``load_weights``
takes HF's names and places each tensor in its slice; ``hf_weights`` gives them back.
Routed experts are fused per layer (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I], transformers 5's names); checkpoints hold one tensor per expert
(``mlp.experts.{e}.gate_proj.weight`` ...; Mixtral's ``block_sparse_moe.experts.{e}.w1``
(gate) / ``w3`` (up) / ``w2`` (down), renamed on load as transformers 5 does).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.layers.alibi import AlibiSlopes
from flashpage.layers.attention import Attention
from flashpage.layers.linear import (
    ColumnParallelLinear,
    PendingNorm,
    RowParallelLinear,
    VocabEmbedding,
    _ParallelLinear,
)
from flashpage.layers.mlp import GatedMLP
from flashpage.layers.moe import (
    EXPERT_NAME,
    SYNC_FREE_MAX_TOKENS,
    SparseMoeBlock,
    load_expert_weight,
)
from flashpage.layers.norm import RMSNorm
from flashpage.layers.quant import dequantized_parameters
from flashpage.layers.rotary import get_rope
from flashpage.models.common import DecoderStack, HFNames, InputEmbeds, PreNormDecoderLayer

_MIXTRAL = re.compile(r"^(?P<layer>model\.layers\.\d+)\.block_sparse_moe\.(?P<rest>.+)$")
_MIXTRAL_EXPERT = re.compile(r"^experts\.(\d+)\.(w[123])\.")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _moe_name(name: str) -> str:
    """Mixtral's names as transformers 5 loads them: block_sparse_moe -> mlp, its experts'
    w1 / w2 / w3 -> gate_proj / down_proj / up_proj; any other name as it is."""
    m = _MIXTRAL.match(name)
    if m is None:
        return name
    rest = _MIXTRAL_EXPERT.sub(lambda e: f"experts.{e[1]}.{_MIXTRAL_PROJ[e[2]]}.", m["rest"])
    return f"{m['layer']}.mlp.{rest}"


class LlamaAttention(nn.Module):
    q_norm: nn.Module  # with config.qk_norm: norm_cls's (Cohere's: per-head LayerNorms)
    k_norm: nn.Module

    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int,
                 norm_cls: type[RMSNorm] = RMSNorm, alibi: AlibiSlopes | None = None) -> None:
        """``norm_cls``: the q/k norms' class (Qwen3's RMSNorm; Gemma 3's GemmaRMSNorm);
        ``alibi``: the model's ALiBi slopes where ``config.alibi`` (no rotary then)."""
        super().__init__()
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_size, self.kv_size = h * d, kv * d
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, (h + 2 * kv) * d,
                                             bias=config.attention_bias)
        # HF biases o_proj with q/k/v (Llama, Granite, OLMo2), but for Qwen2's (and Seed-OSS's
        # own attention_out_bias)
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = norm_cls(d, config.rms_norm_eps)
            self.k_norm = norm_cls(d, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        # None: no positional embedding in this layer (Cohere2's full-attention layers), or
        # ALiBi's biases in attention instead (Falcon-RW, MPT)
        self.rotary_emb = (get_rope(config, max_positions, layer_idx)
                           if config.uses_rope(layer_idx) else None)
        if config.alibi and alibi is None:
            raise ValueError(f"{config.architecture} uses ALiBi: pass the model's AlibiSlopes")
        # head_dim ** -0.5 and one window for all layers but in Gemma (its attention is this)
        self.attn = Attention(h, d, kv, config.attention_scale, layer_idx,
                              config.attention_window(layer_idx), config.attn_logit_softcapping,
                              alibi=alibi)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PendingNorm,
                md: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        o = self.attn(q, k, v, md, positions=positions, rotary=self.rotary_emb)
        return self.o_proj(o)


class LlamaMLP(GatedMLP):
    """gate_up_proj (HF's gate_proj and up_proj merged), SiLU·mul, down_proj."""


class LlamaDecoderLayer(PreNormDecoderLayer):
    self_attn: LlamaAttention
    mlp: LlamaMLP | SparseMoeBlock
    def __init__(self, config: ModelConfig, layer_idx: int, max_positions: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, max_positions)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (SparseMoeBlock(config) if config.is_moe_layer(layer_idx)
                    else LlamaMLP(config.hidden_size, config.intermediate_size))

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear] | None:
        if isinstance(self.mlp, SparseMoeBlock):
            return None  # the router and the shared expert both read the normed input
        return self.self_attn.qkv_proj, self.mlp.gate_up_proj


class LlamaModel(DecoderStack):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, max_positions) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # With MoE layers, CUDA graphs hold up to this many tokens: past it the experts' grouped
    # path reads its per-expert counts back to the host (layers/moe.FusedExperts).
    max_graph_tokens: int | None = None
    # A family whose checkpoints name our modules otherwise (GPT-NeoX, Phi): their names
    # are mapped to ours at load and back in hf_weights, lora_targets and hf_name
    hf_names: HFNames | None = None
    supports_prompt_embeds = True  # forward takes inputs_embeds

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        if config.n_routed_experts:
            self.max_graph_tokens = SYNC_FREE_MAX_TOKENS
        self.model: DecoderStack = self._decoder(
            config, max_positions or config.max_position_embeddings)
        # as wide as the token embeddings (OPT-350m's word_embed_proj_dim, not hidden_size)
        self.lm_head = ColumnParallelLinear(config.word_embed_proj_dim or config.hidden_size,
                                            config.vocab_size, bias=config.lm_head_bias)
        self.lm_head.quantizable = False  # logits stay 16-bit under quantization="fp8"
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _decoder(self, config: ModelConfig, max_positions: int) -> DecoderStack:
        """The body (a family on the Llama head and loading overrides it)."""
        return LlamaModel(config, max_positions)

    def fp8_block_unsupported(self, linear: str, block: tuple[int, int]) -> str | None:
        """Why the checkpoint's module ``linear`` (its name there) cannot keep a
        block-scaled fp8 checkpoint's tiles beyond what ``CheckpointQuantization.
        block_unsupported`` says (None: it can; GPT-NeoX's regrouped query_key_value)."""
        return None

    def attention_layers(self) -> list[Attention]:
        return [cast(LlamaDecoderLayer, layer).self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata, inputs_embeds: InputEmbeds | None = None) -> torch.Tensor:
        """``inputs_embeds``: rows given as embeddings (a prompt's, engine/prompt_embeds.py)."""
        if inputs_embeds is None:
            return self.model(input_ids, positions, md)
        return self.model(input_ids, positions, md, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def hf_name(self, name: str) -> str:
        """Our parameter or module path under the checkpoint's names."""
        return name if self.hf_names is None else self.hf_names.to_hf(name)

    def _shards(self) -> dict[str, tuple[str, int, int]]:
        """HF suffix -> (our suffix, row offset, rows) for the merged projections."""
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
            c.intermediate_size
        out = {}
        # weight_scale: an fp8 checkpoint's per-row scales (models/fp8_checkpoint.py; block
        # scales: rows of N-blocks, load_weights divides by bn);
        # w4_scales / w4_zeros: an int4 one's per-group rows (models/int4_checkpoint.py)
        q4 = ("w4_scales", "w4_zeros")
        for kind in ("weight", "bias", "weight_scale", *q4):
            out[f"self_attn.q_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", 0, q)
            out[f"self_attn.k_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", q, kv)
            out[f"self_attn.v_proj.{kind}"] = (f"self_attn.qkv_proj.{kind}", q + kv, kv)
        for kind in ("weight", "weight_scale", *q4):
            out[f"mlp.gate_proj.{kind}"] = (f"mlp.gate_up_proj.{kind}", 0, inter)
            out[f"mlp.up_proj.{kind}"] = (f"mlp.gate_up_proj.{kind}", inter, inter)
            if shared := c.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert
                out[f"mlp.shared_expert.gate_proj.{kind}"] = (
                    f"mlp.shared_expert.gate_up_proj.{kind}", 0, shared)
                out[f"mlp.shared_expert.up_proj.{kind}"] = (
                    f"mlp.shared_expert.gate_up_proj.{kind}", shared, shared)
        return out

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """The linears a LoRA adapter may adapt (flashpage/lora/): HF module path ->
        (our linear's module path, its output row offset, rows). q/k/v_proj are slices of
        qkv_proj, gate/up_proj of gate_up_proj; a non-gated MLP's c_fc / c_proj (under the
        family's own names: hf_name). Not the MoE layers' routed experts."""
        hidden, inter = self.config.hidden_size, self.config.intermediate_size
        modules = dict(self.named_modules())
        out: dict[str, tuple[str, int, int]] = {}
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}"
            for hf, (ours, off, rows) in self._shards().items():
                if hf.endswith(".weight"):
                    out[f"{p}.{hf.removesuffix('.weight')}"] = (
                        f"{p}.{ours.removesuffix('.weight')}", off, rows)
            out[f"{p}.self_attn.o_proj"] = (f"{p}.self_attn.o_proj", 0, hidden)
            out[f"{p}.mlp.down_proj"] = (f"{p}.mlp.down_proj", 0, hidden)
            out[f"{p}.mlp.c_fc"] = (f"{p}.mlp.c_fc", 0, inter)
            out[f"{p}.mlp.c_proj"] = (f"{p}.mlp.c_proj", 0, hidden)
        return {self.hf_name(hf): t for hf, t in out.items() if t[0] in modules}

    def lora_b_to_ours(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """An adapter's lora_B [out, r] for HF module ``module`` with its rows in our
        linear's order (the identity here; families that regroup a fused linear's rows at
        load regroup lora_B the same way)."""
        return b

    def _qkv_target(self, out: dict[str, tuple[str, int, int]]) -> None:
        """Add every layer's whole qkv_proj, under the checkpoint's name for it, to
        ``lora_targets``' ``out`` (families whose fused q/k/v linear is one module on disk)."""
        c = self.config
        rows = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        for i in range(c.num_hidden_layers):
            ours = f"model.layers.{i}.self_attn.qkv_proj"
            out[self.hf_name(ours)] = (ours, 0, rows)

    def _split_name(self, name: str) -> tuple[str, int, int] | None:
        """model.layers.N.<HF piece> -> (merged parameter name, row offset, rows), or None."""
        parts = name.split(".")
        if len(parts) < 5 or parts[1] != "layers":
            return None
        shard = self._shards().get(".".join(parts[3:]))
        return None if shard is None else (".".join(parts[:3] + [shard[0]]), shard[1], shard[2])

    def _pieces(self, merged: str) -> list[str]:
        """The HF names that make up merged parameter ``merged``."""
        parts = merged.split(".")
        prefix, sub = ".".join(parts[:3]), ".".join(parts[3:])
        return [f"{prefix}.{hf}" for hf, (ours, _, _) in self._shards().items() if ours == sub]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (HF name, tensor) pairs into the parameters; returns the names loaded.

        A merged parameter counts as loaded once all its HF pieces have arrived; a piece
        that never arrives is reported under its HF name by the loader."""
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        # the per-row scales of linears that hold an fp8 checkpoint's weights (hold_fp8), the
        # per-group scales and zeros of those that hold an int4 one's (hold_int4; routed
        # experts': FusedExperts.hold_int4)
        params.update((n, b) for n, b in self.named_buffers()
                      if n.endswith((".weight_scale", ".w4_scales", ".w4_zeros", "_w4_scales",
                                     "_w4_zeros")))
        loaded: set[str] = set()
        # merged param -> HF pieces still missing
        pending = {n: set(self._pieces(n)) for n in params if n.split(".")[1:2] == ["layers"]
                   and self._pieces(n)}
        expert_pieces: dict[str, set[tuple[int, str]]] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.hf_names is not None:
                name = self.hf_names.to_ours(name)
            name = _moe_name(name)  # Mixtral's expert names as transformers 5 reads them
            if (m := EXPERT_NAME.match(name)) is not None:  # one expert's piece of the fused
                load_expert_weight(params, m, tensor, expert_pieces, loaded)
                continue
            if name == "rope_freqs":  # GGUF: Llama 3.1 scaling as frequency factors
                for layer in self.model.layers:
                    rotary = cast(LlamaDecoderLayer, layer).self_attn.rotary_emb
                    if rotary is not None:
                        rotary.set_frequency_factors(tensor)
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            split = self._split_name(name)
            if split is not None:
                target, offset, rows = split
                param = params[target]
                if target.endswith(".weight_scale") and param.dim() == 2:
                    # block scales (hold_fp8(block)): the pieces' rows are whole N-blocks
                    block = cast(_ParallelLinear, self.get_submodule(
                        target.removesuffix(".weight_scale"))).weight_block
                    assert block is not None
                    offset, rows = offset // block[0], rows // block[0]
                if tensor.shape[0] != rows or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                                     f"rows {offset}:{offset + rows} of {target} {tuple(param.shape)}")
                param.data[offset:offset + rows].copy_(tensor)
                pending[target].discard(name)
                if not pending[target]:
                    loaded.add(target)
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {self.hf_name(name)!r} has no place in "
                                 f"{type(self).__name__}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{self.hf_name(name)}: checkpoint shape {tuple(tensor.shape)} "
                                 f"!= {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        # under the checkpoint's names (GPT-J's transformer.h.N.attn.v_proj, OPT's
        # model.decoder.layers.N.self_attn.v_proj; not ours)
        self.missing_pieces = sorted(self.hf_name(p) for ps in pending.values() for p in ps)
        return loaded

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The parameters under HF's names (the merged ones split back into their pieces)."""
        for name, data in dequantized_parameters(self):  # fp8 weights back in 16 bits
            pieces = self._pieces(name) if name.split(".")[1:2] == ["layers"] else []
            if not pieces:
                yield self.hf_name(name), data
            for hf in pieces:
                _, off, rows = self._split_name(hf)  # type: ignore[misc]
                yield self.hf_name(hf), data[off:off + rows]


class LlamaForSequenceClassification(LlamaForCausalLM):
    """HF's Llama / Mistral / Qwen2 / Qwen3 ForSequenceClassification: the decoder body and
    ``score`` = Linear(hidden, num_labels, bias=False) (checkpoint key ``score.weight``; no
    lm_head), read at the last prompt token (flashpage/pooling.py PoolingState with a head).

    ``compute_logits`` gives the score logits [n, num_labels]: the engine samples its
    pooling requests' one ignored greedy token from them (a label id, never read), so the
    sampler and the captured graphs need no vocabulary-wide head."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        self.score = ColumnParallelLinear(config.hidden_size, config.num_labels)
        self.score.quantizable = False  # the head stays 16-bit under quantization="fp8"

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Pooled hidden states [n, hidden] -> score logits [n, num_labels]."""
        return self.score(hidden)
