"""What every decoder-only family here shares: the pre-norm layer with the residual add
fused into the next norm, the parallel layer (attention and MLP on the same input), the
embed -> layers -> final norm stack, and the map between a checkpoint's names and ours."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata
from flashpage.layers.linear import ColumnParallelLinear, PendingNorm, VocabEmbedding


class PreNormDecoderLayer(nn.Module):
    """Subclasses set ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``.

    The residual stream is carried beside the hidden state: each RMSNorm adds it in
    (``norm(x, residual)``), so no layer writes ``x + residual`` on its own.

    A family whose attention and MLP each begin with one linear names the two
    (``norm_consumers``); at one-row steps on our GEMV each norm is then handed to its
    linear unevaluated (``PendingNorm``) and computed inside the GEMV's prologue.
    """

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def norm_consumers(self) -> tuple[ColumnParallelLinear, ColumnParallelLinear] | None:
        """The first linear of self_attn and of mlp, where each consumes the normed
        input alone (None: the norms always run on their own)."""
        return None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        consumers = self.norm_consumers()
        if (consumers is not None and consumers[0].fuses_norm(x, self.input_layernorm)
                and consumers[1].fuses_norm(x, self.post_attention_layernorm)):
            if residual is None:
                pending = PendingNorm(x, None, self.input_layernorm, None)
                residual = x
            else:
                new_residual = torch.empty_like(x)
                pending = PendingNorm(x, residual, self.input_layernorm, new_residual)
                residual = new_residual
            x = self.self_attn(positions, pending, md)
            res_out = torch.empty_like(x)
            return self.mlp(PendingNorm(x, residual, self.post_attention_layernorm, res_out)), res_out
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class ParallelDecoderLayer(nn.Module):
    """Attention and the MLP both read the layer's input, normed, and both add to it
    (GPT-J's "parallel" layer)::

        x + attn(h) + mlp(h),  h = input_layernorm(x)          Cohere, Phi-1/1.5/2: one norm
        x + attn(input_layernorm(x)) + mlp(post_attention_layernorm(x))
                                                               GPT-NeoX (use_parallel_residual)

    Subclasses set ``input_layernorm``, ``self_attn``, ``mlp`` and
    ``post_attention_layernorm`` (None: the MLP reads h too).

    Returned as DecoderStack's pair whose sum the next norm adds, in transformers' order of
    the three-way sum (bf16 rounds each add): ``residual_first`` (Cohere's
    (x + attn) + mlp) -> (mlp, x + attn); else (attn + mlp) + x -> (attn + mlp, x)."""

    input_layernorm: nn.Module
    self_attn: nn.Module
    mlp: nn.Module
    post_attention_layernorm: nn.Module | None
    residual_first = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h_mlp = h if self.post_attention_layernorm is None else self.post_attention_layernorm(residual)
        attn = self.self_attn(positions, h, md)
        if self.residual_first:
            return self.mlp(h_mlp), residual + attn
        return attn + self.mlp(h_mlp), residual


class HFNames:
    """A checkpoint's module names <-> ours, for a family built on the Llama body whose
    checkpoints name its modules otherwise (GPT-NeoX's ``gpt_neox.layers.3.attention.dense``
    is our ``model.layers.3.self_attn.o_proj``). ``table``: HF module path -> ours, "{}"
    standing for a layer index, most specific first; each maps a name that starts with it
    (a whole path component), the rest kept; a name no entry matches is the same in both."""

    def __init__(self, table: dict[str, str]) -> None:
        self._to_ours = [(self._pattern(hf), ours) for hf, ours in table.items()]
        self._to_hf = [(self._pattern(ours), hf) for hf, ours in table.items()]

    @staticmethod
    def _pattern(path: str) -> re.Pattern[str]:
        return re.compile(re.escape(path).replace(r"\{\}", r"(\d+)") + r"(?=\.|$)")

    @staticmethod
    def _map(name: str, table: list[tuple[re.Pattern[str], str]]) -> str:
        for pattern, repl in table:
            if (m := pattern.match(name)) is not None:
                return repl.format(*m.groups()) + name[m.end():]
        return name

    def to_ours(self, name: str) -> str:
        return self._map(name, self._to_ours)

    def to_hf(self, name: str) -> str:
        return self._map(name, self._to_hf)


def regroup_qkv(t: torch.Tensor, kv_heads: int, head_dim: int, to_ours: bool) -> torch.Tensor:
    """A fused query_key_value's rows (a weight [rows, K] or bias [rows]) laid out per KV
    group, each group's q heads then its one k and one v head, to our qkv_proj's (all q
    heads, all k, all v: Llama's split), or back (``to_ours`` False)::

        checkpoint  [q0 .. q(g-1) k0 v0 | qg .. q(2g-1) k1 v1 | ...]   (head_dim rows each)
        ours        [q0 q1 ... | k0 k1 ... | v0 v1 ...]

    GPT-NeoX's and Falcon's MHA form is this with one q head a group ([q0 k0 v0 | ...]),
    Falcon-7B's MQA one group ([q0 .. q(h-1) k v], already ours), Falcon-40B's its
    ``num_kv_heads`` groups. ``t.shape[0]``: (heads + 2 kv_heads) x head_dim."""
    rest = t.shape[1:]
    per_group = t.shape[0] // (kv_heads * head_dim)  # q heads of a group, + 2
    if to_ours:
        g = t.reshape(kv_heads, per_group, head_dim, *rest)
        parts = [g[:, :-2], g[:, -2], g[:, -1]]
    else:
        q, k, v = t.split([t.shape[0] - 2 * kv_heads * head_dim, kv_heads * head_dim,
                           kv_heads * head_dim])
        parts = [torch.cat([q.reshape(kv_heads, per_group - 2, head_dim, *rest),
                            k.reshape(kv_heads, 1, head_dim, *rest),
                            v.reshape(kv_heads, 1, head_dim, *rest)], dim=1)]
    return torch.cat([p.reshape(-1, *rest) for p in parts]).contiguous()


# a fused query_key_value's tensors whose rows regroup_qkv moves: its weight and bias, and a
# quantized checkpoint's scales and zero points for them (models/fp8_checkpoint.py,
# int4_checkpoint.py: a row each, or a row of N-blocks for block scales)
FUSED_QKV_TENSORS = r"\.(weight|bias|weight_scale|w4_scales|w4_zeros)$"


def regroup_fused_qkv(name: str, t: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                      block_rows: int | None, layout: str) -> torch.Tensor:
    """One of a fused query_key_value's ``FUSED_QKV_TENSORS`` (GPT-NeoX's, Falcon's), its
    rows checked ((heads + 2 kv_heads) x head_dim, or that many rows in N-blocks of
    ``block_rows`` for a 2-D ``weight_scale``: block scales) and regrouped to ours
    (``regroup_qkv``). Block scales regroup with head_dim / block_rows rows a head, so only
    where a head is whole blocks (the family's ``fp8_block_unsupported`` dequantizes the
    weight otherwise and no block scales come); one KV group is ours already, as stored.
    ``layout`` says the rows in the error (``3 x 4 heads x 16``)."""
    want = (heads + 2 * kv_heads) * head_dim
    if name.endswith(".weight_scale") and t.dim() == 2:
        if block_rows is None:
            raise ValueError(f"{name}: 2-D scales {tuple(t.shape)} without a block size")
        if t.shape[0] != -(-want // block_rows):
            raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} does not have "
                             f"{-(-want // block_rows)} blocks of {block_rows} rows")
    elif t.shape[0] != want:
        raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} does not have {layout} = "
                         f"{want} rows")
    if kv_heads == 1:
        return t
    return regroup_qkv(t, kv_heads, t.shape[0] // (heads + 2 * kv_heads), to_ours=True)


def fused_qkv_block_unsupported(linear: str, kv_heads: int, head_dim: int,
                                block: tuple[int, int]) -> str | None:
    """A family's ``fp8_block_unsupported`` for its fused query_key_value (``linear``; models/
    fp8_checkpoint.py): its rows are regrouped head by head at load, so its block scales
    are kept only where each head's rows are whole blocks (or one KV group: not regrouped)."""
    if kv_heads > 1 and head_dim % block[0]:
        return (f"{linear}'s rows are regrouped head by head at load and head_dim "
                f"{head_dim} is not a multiple of the {block[0]}-row blocks")
    return None


@dataclass
class InputEmbeds:
    """A step's rows given as input embeddings (prompts given as embeddings,
    engine/prompt_embeds.py): ``rows`` int64 [m] on the device, rows of the flat batch;
    ``values`` [m, width] in the model's dtype, each what transformers' model takes as
    ``inputs_embeds`` (the output of its ``get_input_embeddings()``). The batch's other rows
    are looked up in the token embedding as always.

    ``deep_rows`` int64 [d] / ``deep_values`` [d, k, width]: Qwen3-VL's deepstack features of
    the step's image rows (engine/multimodal.py): ``deep_values[:, i]`` is added to those
    rows' hidden states after decoder layer i (``DecoderStack``), as transformers'
    Qwen3VLTextModel adds them."""

    rows: torch.Tensor
    values: torch.Tensor
    deep_rows: torch.Tensor | None = None
    deep_values: torch.Tensor | None = None

    def splice(self, x: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [tokens, width] (the looked-up rows) with ``rows`` replaced by ``values``
        (default: ours)."""
        return x.index_copy(0, self.rows, (self.values if values is None else values).to(x.dtype))


class DecoderStack(nn.Module):
    """Subclasses set ``embed_tokens``, ``layers`` (of PreNormDecoderLayer) and ``norm``.

    ``hidden_out``: a buffer each forward copies its final hidden states into (rows 0 .. n-1;
    None: not kept). A speculative MTP draft or EAGLE-1 head reads the target's there
    (models/mtp.py, models/eagle.py); a static buffer, so the CUDA graphs captured after it
    is set write it at each replay.

    ``aux_out``: likewise for an EAGLE-3 head, the residual stream entering each layer of
    ``aux_layers`` (x + residual, pre-norm), side by side: [rows, len(aux_layers) * H].
    Only a stack with it set takes the loop that copies them."""

    embed_tokens: VocabEmbedding
    layers: nn.ModuleList
    norm: nn.Module
    hidden_out: torch.Tensor | None = None
    aux_out: torch.Tensor | None = None
    aux_layers: tuple[int, ...] = ()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def from_inputs_embeds(self, values: torch.Tensor) -> torch.Tensor:
        """What the family does to transformers' ``inputs_embeds`` before the first layer
        (the same as to its looked-up rows, after the lookup): nothing here. Gemma's
        sqrt(hidden) scale lives in transformers' embedding module (5.x), so inputs_embeds
        are not scaled there, nor here; Granite multiplies them, BLOOM norms them."""
        return values

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata, inputs_embeds: InputEmbeds | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        if inputs_embeds is not None:
            x = inputs_embeds.splice(x, self.from_inputs_embeds(inputs_embeds.values))
        residual = None
        if inputs_embeds is not None and inputs_embeds.deep_values is not None:
            x, residual = self._layers_with_deepstack(positions, x, md, inputs_embeds)
        elif self.aux_out is None:
            for layer in self.layers:
                x, residual = layer(positions, x, residual, md)
        else:
            x, residual = self._layers_keeping_aux(positions, x, md)
        x, _ = self.norm(x, residual)
        if self.hidden_out is not None:
            self.hidden_out[:x.shape[0]].copy_(x)
        return x

    def _layers_with_deepstack(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata,
                               embeds: InputEmbeds) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers, layer i's output at ``embeds.deep_rows`` plus their i-th deepstack
        features for the first k layers (Qwen3-VL). A layer's hidden state is x + residual
        (the next norm adds them), so the features go into x; ``aux_out`` kept as
        ``_layers_keeping_aux`` keeps it."""
        rows, deep = embeds.deep_rows, embeds.deep_values
        assert rows is not None and deep is not None
        out, n, h = self.aux_out, x.shape[0], x.shape[-1]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if out is not None:
                for j, a in enumerate(self.aux_layers):
                    if a == i:
                        out[:n, j * h:(j + 1) * h].copy_(x if residual is None else x + residual)
            x, residual = layer(positions, x, residual, md)
            if i < deep.shape[1]:
                x = x.index_add(0, rows, deep[:, i].to(x.dtype))
        return x, residual

    def _layers_keeping_aux(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers, copying the stream entering each of ``aux_layers`` into ``aux_out``."""
        out, n = self.aux_out, x.shape[0]
        assert out is not None
        h = x.shape[-1]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            for j, a in enumerate(self.aux_layers):
                if a == i:
                    out[:n, j * h:(j + 1) * h].copy_(x if residual is None else x + residual)
            x, residual = layer(positions, x, residual, md)
        return x, residual
