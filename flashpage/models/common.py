"""What every decoder-only family here shares: the pre-norm layer with the residual add
fused into the next norm, and the embed -> layers -> final norm stack."""

from __future__ import annotations

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


class DecoderStack(nn.Module):
    """Subclasses set ``embed_tokens``, ``layers`` (of PreNormDecoderLayer) and ``norm``."""

    embed_tokens: VocabEmbedding
    layers: nn.ModuleList
    norm: nn.Module

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        x, _ = self.norm(x, residual)
        return x
