"""NomicBERT (nomic-ai/nomic-embed-text-v1 / v1.5, nomic-bert-2048) in plain PyTorch, the
checkpoint's own parameter names kept (``emb_ln``, ``encoder.layers.N.attn.Wqkv``,
``mlp.fc11`` ...; a ``bert.`` prefix is dropped on load). Upstream it is trust_remote_code
(nomic's modeling_hf_nomic_bert.py, after Tri Dao's flash-attn BERT); this follows that
description:

    x = emb_ln(word_embeddings(ids) + token_type_embeddings(types))    (no position table)
    per layer (post-norm):
        x = norm1(x + out_proj(attn(Wqkv(x))))     rotary on q, k: the first rotary_dim
                                                   channels of each head, base
                                                   rotary_emb_base, rotate-half or interleaved
        x = norm2(x + fc2(fc11(x) * act(fc12(x))))  SwiGLU: act = SiLU (GeGLU: GELU, GLU:
                                                   sigmoid); a plain MLP: fc2(gelu(fc1(x)))
    hidden = x

Biases: Wqkv and out_proj by ``qkv_proj_bias``, fc11 / fc12 / fc1 by ``mlp_fc1_bias``, fc2
by ``mlp_fc2_bias``; LayerNorms always have theirs. Attention is bidirectional, scaled by
1 / sqrt(head_dim), over each prompt's own tokens. Unpadded as ModernBERT is (layers.Ragged):
per-token work on the real tokens only, attention on the padded view.
"""

from __future__ import annotations

import torch
from torch import nn

from flashpage.encoder.config import EncoderConfig
from flashpage.encoder.layers import Ragged, apply_rotary, rotary_cos_sin
from flashpage.encoder.model import Encoder, act


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.token_type_embeddings = (nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
                                      if cfg.type_vocab_size > 0 else None)

    def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids)
        return x if self.token_type_embeddings is None else x + self.token_type_embeddings(types)


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.interleaved = cfg.rotary_interleaved
        self.Wqkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)
        self.out_proj = nn.Linear(h, h, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ragged: Ragged) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        n, h = x.shape
        qkv = self.Wqkv(x).view(n, 3, self.heads, h // self.heads)  # "(three h d)"
        q = apply_rotary(qkv[:, 0], *rope, self.interleaved)
        k = apply_rotary(qkv[:, 1], *rope, self.interleaved)
        return self.out_proj(ragged.attention(torch.stack((q, k, qkv[:, 2]), dim=1)))


class GatedMLP(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.fc11 = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.fc12 = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.fc2 = nn.Linear(i, h, bias=cfg.mlp_out_bias)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc11(x) * act(self.act, self.fc12(x)))


class MLP(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_out_bias)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(act(self.act, self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp: nn.Module = GatedMLP(cfg) if cfg.gated_mlp else MLP(cfg)
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ragged: Ragged) -> torch.Tensor:
        x = self.norm1(x + self.attn(x, rope, ragged))
        return self.norm2(x + self.mlp(x))


class Stack(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))


class NomicBertEncoder(Encoder):
    """NomicBertModel: an embedding model (its pooler, if the checkpoint has one, unused)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.emb_ln = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = Stack(cfg)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                positions: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """[B, T] ids, types, positions, valid -> hidden [B, T, hidden]."""
        cfg = self.cfg
        b, t = input_ids.shape
        ragged = Ragged(b, t, valid, 0, input_ids.device)
        rope = rotary_cos_sin(ragged.flat(positions), cfg.rotary_dim, cfg.rope_theta, cfg.rotary_interleaved)
        x = self.emb_ln(self.embeddings(ragged.flat(input_ids), ragged.flat(token_type_ids)))
        for layer in self.encoder.layers:
            x = layer(x, rope, ragged)
        return ragged.padded(x)

    def classify(self, hidden: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        raise RuntimeError("this model has no classification head")
