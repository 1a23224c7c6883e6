"""GPT-2 (GPT2LMHeadModel) and GPT-BigCode (GPTBigCodeForCausalLM: StarCoder 1,
SantaCoder): pre-LN blocks over learned absolute positions, under HF's names::

    x = transformer.wte[token] + transformer.wpe[position]
    transformer.h.N:  x += attn(ln_1(x))   c_attn (q, k, v in one linear) -> c_proj
                      x += mlp(ln_2(x))    c_fc -> GELU (activation_function) -> c_proj
    transformer.ln_f -> lm_head (tied to wte)

LayerNorms with bias (layers/norm.LayerNorm) and a bias on every linear. The residual
stream is carried as models/common.PreNormDecoderLayer carries it (``norm(x, residual)``
adds it in); the blocks keep GPT-2's names (ln_1, attn, ln_2, mlp) rather than Llama's,
so checkpoints and LoRA adapters name our modules as they are.

No rotary: the attention layer is called without one (layers/attention.Attention), and
the backend writes K and V to the cache as the projections give them. Positions enter
once, in the embed step: the engine hands the model each token's position (the same
tensor the CUDA graphs replay from), and wpe's row for it is added to the token's
embedding. wpe has ``n_positions`` rows, so a max_model_len past it is a ConfigError at
construction (max_model_len defaults to n_positions).

BigCode's ``multi_query`` (StarCoder, SantaCoder) caches one K and one V head for all
query heads (MQA: config.num_key_value_heads = 1).

Checkpoint layouts, made ours at load (``load_weights``) and given back (``hf_weights``):

- GPT-2's c_attn / c_proj / c_fc are Conv1D, weights stored [in, out]: transposed;
- BigCode's are nn.Linear [out, in]. With multi_query, c_attn's rows are [q (n_embd),
  k (head_dim), v (head_dim)], our order; without it they go head by head, [q_h, k_h,
  v_h] for each head h (transformers' view(.., heads, 3 * head_dim)), and are regrouped
  into [all q, all k, all v];
- GPT-2 files from the Hub name tensors without ``transformer.`` (``h.0.attn.c_attn.weight``)
  and may hold each layer's causal-mask buffer (``h.N.attn.bias``, ``h.N.attn.masked_bias``),
  which is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.config import ConfigError, ModelConfig
from flashpage.layers.attention import Attention
from flashpage.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabEmbedding
from flashpage.layers.mlp import MLP
from flashpage.layers.norm import LayerNorm
from flashpage.layers.quant import dequantized_parameters
from flashpage.models.common import InputEmbeds

# the Conv1D weights of a GPT-2 block, stored [in, out]
_CONV1D = re.compile(r"^transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
# buffers older files hold: a layer's causal mask (GPT-2), the model's (BigCode)
_MASKS = re.compile(r"^transformer\.(h\.\d+\.attn\.(bias|masked_bias)|bias)$")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_size, self.kv_size = h * d, kv * d
        self.c_attn = ColumnParallelLinear(config.hidden_size, (h + 2 * kv) * d, bias=True)
        self.c_proj = RowParallelLinear(h * d, config.hidden_size, bias=True)
        scale = config.attention_scale if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        self.attn = Attention(h, d, kv, scale, layer_idx)

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.c_proj(self.attn(q, k, v, md))  # no rotary: x holds the positions


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) in and out, their sum the hidden state (PreNormDecoderLayer's)."""
        if residual is None:
            residual = x
            x = self.ln_1(x)
        else:
            x, residual = self.ln_1(x, residual)
        x, residual = self.ln_2(self.attn(x, md), residual)
        return self.mlp(x), residual


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        n = config.max_position_embeddings
        if max_positions > n:
            raise ConfigError(
                f"max_model_len {max_positions} is past {config.architecture}'s n_positions "
                f"({n}): its learned position embeddings (wpe) have no row for later "
                f"positions; use max_model_len <= {n}")
        self.wte = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = VocabEmbedding(n, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata, inputs_embeds: InputEmbeds | None = None) -> torch.Tensor:
        x = self.wte(input_ids)
        if inputs_embeds is not None:  # transformers adds wpe to inputs_embeds too
            x = inputs_embeds.splice(x)
        x = x + self.wpe(positions)
        residual = None
        for block in self.h:
            x, residual = block(x, residual, md)
        x, _ = self.ln_f(x, residual)
        return x


class GPT2LMHeadModel(nn.Module):
    conv1d = True  # c_attn / c_proj / c_fc weights stored [in, out]

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config, max_positions or config.max_position_embeddings)
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size)
        self.lm_head.quantizable = False  # logits stay 16-bit under quantization="fp8"
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        # BigCode without multi_query: c_attn's rows head by head in the checkpoint
        self.per_head_qkv = not self.conv1d and config.num_key_value_heads > 1

    def attention_layers(self) -> list[Attention]:
        return [cast(GPT2Block, block).attn.attn for block in self.transformer.h]

    supports_prompt_embeds = True  # forward takes inputs_embeds

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata, inputs_embeds: InputEmbeds | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            return self.transformer(input_ids, positions, md)
        return self.transformer(input_ids, positions, md, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def _regroup_qkv(self, t: torch.Tensor, to_hf: bool) -> torch.Tensor:
        """c_attn rows (or bias) [q_h, k_h, v_h] per head h <-> [all q, all k, all v]."""
        heads, d = self.config.num_attention_heads, self.config.head_dim
        split = (3, heads, d) if to_hf else (heads, 3, d)
        return t.unflatten(0, split).transpose(0, 1).reshape(t.shape)

    def _ours(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Checkpoint tensor ``name`` in our layout."""
        if self.conv1d and _CONV1D.match(name):
            return t.t()
        if self.per_head_qkv and name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            return self._regroup_qkv(t, to_hf=False)
        return t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (HF name, tensor) pairs into the parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = f"transformer.{name}"  # the Hub's GPT-2 files: GPT2Model's names
            if _MASKS.match(name) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[name]
            conv1d = self.conv1d and _CONV1D.match(name) is not None
            want = tuple(param.shape[::-1] if conv1d else param.shape)
            if tuple(tensor.shape) != want:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {want}"
                                 + (" (a Conv1D weight, stored [in, out])" if conv1d else ""))
            param.data.copy_(self._ours(name, tensor))
            loaded.add(name)
        return loaded

    def hf_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The parameters under HF's names and in HF's layouts (Conv1D weights [in, out],
        BigCode's per-head c_attn rows)."""
        for name, data in dequantized_parameters(self):  # fp8 / int4 weights back in 16 bits
            if self.conv1d and _CONV1D.match(name):
                data = data.t()
            elif self.per_head_qkv and name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
                data = self._regroup_qkv(data, to_hf=True)
            yield name, data

    def lora_targets(self) -> dict[str, tuple[str, int, int]]:
        """The linears a LoRA adapter may adapt (flashpage/lora/), under their own names
        (PEFT's fan_in_fan_out for GPT-2's Conv1D changes no adapter shape; BigCode's
        per-head c_attn takes its lora_B rows regrouped as the weight's, lora_b_to_ours)."""
        c = self.config
        qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        out: dict[str, tuple[str, int, int]] = {}
        for i in range(c.num_hidden_layers):
            for sub, rows in (("attn.c_attn", qkv), ("attn.c_proj", c.hidden_size),
                              ("mlp.c_fc", c.intermediate_size), ("mlp.c_proj", c.hidden_size)):
                path = f"transformer.h.{i}.{sub}"
                out[path] = (path, 0, rows)
        return out

    def lora_b_to_ours(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """lora_B of BigCode's per-head c_attn in our [all q, all k, all v] row order."""
        if self.per_head_qkv and module.endswith("attn.c_attn"):
            return self._regroup_qkv(b, to_hf=False)
        return b


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    conv1d = False  # nn.Linear weights, [out, in] as ours
