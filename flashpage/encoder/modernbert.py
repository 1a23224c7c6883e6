"""ModernBERT (answerdotai/ModernBERT-*, Alibaba's gte-modernbert, nomic's modernbert-embed)
in plain PyTorch, HF parameter names kept (a ``ModernBertForSequenceClassification``
checkpoint's ``model.`` prefix is dropped on load).

Against BERT: no position table but rotary embeddings (one base for the global layers,
another for the local ones), no token types, pre-norm layers (layer 0 has no attn_norm: the
embeddings' norm stands for it) and a final_norm, a GeGLU MLP (``Wi`` gives input and gate
halves, ``act(input) * gate``), LayerNorms without bias (``norm_bias``), and every
``global_attn_every_n_layers``-th layer global while the others see only the keys within
``local_attention // 2`` positions (HF: ``|q - k| <= local_attention // 2``)::

    x = norm(tok_embeddings(ids))
    per layer:  x += Wo(attn(attn_norm(x)))          rotary on q, k; global or local mask
                x += Wo(act(Wi_in(mlp_norm(x))) * Wi_gate(mlp_norm(x)))
    hidden = final_norm(x)

Unpadded (layers.Ragged): a padded batch [B, T] (right-padded; ``valid`` [B, T] marks each
prompt's own tokens, None when all B have length T) is flattened to its N real tokens once,
and every per-token op (embeddings, norms, Wqkv, rotary, Wo, the MLP) runs on [N, hidden];
only attention scatters q, k, v into [B, heads, T, d] for SDPA (a [B, 1, 1, T] key mask; a
local layer's [B, 1, T, T] band and keys, or for a long batch its queries in blocks against
the keys each block's window reaches) and gathers its N rows back. Padding costs attention
nothing but its masked columns, and padded rows never reach a linear layer. The last hidden
states go back to [B, T, hidden] (zeros past each prompt) for pooling.
"""

from __future__ import annotations

import torch
from torch import nn

from flashpage.encoder.config import EncoderConfig
from flashpage.encoder.layers import Ragged, apply_rotary, rotary_cos_sin
from flashpage.encoder.model import Encoder, act


def _norm(cfg: EncoderConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = _norm(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(ids))


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.Wqkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)
        self.Wo = nn.Linear(h, h, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ragged: Ragged,
                local: bool) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        n, h = x.shape
        qkv = self.Wqkv(x).view(n, 3, self.heads, h // self.heads)
        q, k = apply_rotary(qkv[:, 0], *rope, False), apply_rotary(qkv[:, 1], *rope, False)
        return self.Wo(ragged.attention(torch.stack((q, k, qkv[:, 2]), dim=1), local))


class MLP(nn.Module):
    """GeGLU: Wi's first half activated, times its second half (HF's ``chunk(2)``)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(act(self.act, inp) * gate)


class Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig, index: int) -> None:
        super().__init__()
        # layer 0 reads the embeddings' norm directly (HF: attn_norm = Identity, no weights)
        self.attn_norm = _norm(cfg) if index else None
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = MLP(cfg)
        self.local = cfg.local_layers[index]

    def forward(self, x: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
                ragged: Ragged) -> torch.Tensor:
        kind = "local" if self.local else "global"
        y = x if self.attn_norm is None else self.attn_norm(x)
        x = x + self.attn(y, ropes[kind], ragged, self.local)
        return x + self.mlp(self.mlp_norm(x))


class Head(nn.Module):
    """ModernBertPredictionHead: norm(act(dense(pooled)))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.norm = _norm(cfg)
        self.act = cfg.classifier_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(act(self.act, self.dense(x)))


class ModernBertEncoder(Encoder):
    """ModernBertModel, and for ModernBertForSequenceClassification its head and classifier."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = _norm(cfg)
        self.head: Head | None = None
        self.classifier: nn.Linear | None = None
        if cfg.head == "classify":
            self.head = Head(cfg)
            self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                positions: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """[B, T] ids, (types: none here), positions, valid -> hidden [B, T, hidden]."""
        cfg = self.cfg
        b, t = input_ids.shape
        ragged = Ragged(b, t, valid, cfg.local_window, input_ids.device)
        pos = ragged.flat(positions)
        ropes = {"global": rotary_cos_sin(pos, cfg.head_dim, cfg.rope_theta, False),
                 "local": rotary_cos_sin(pos, cfg.head_dim, cfg.local_rope_theta, False)}
        x = self.embeddings(ragged.flat(input_ids))
        for layer in self.layers:
            x = layer(x, ropes, ragged)
        return ragged.padded(self.final_norm(x))

    def classify(self, hidden: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """classifier_pooling ("cls": the first token; "mean": each prompt's own rows), then
        head and classifier: hidden [B, T, hidden] -> logits [B, labels]."""
        if self.head is None or self.classifier is None:
            raise RuntimeError("this model has no classification head")
        if self.cfg.classifier_pooling == "cls":
            pooled = hidden[:, 0]
        elif valid is None:
            pooled = hidden.mean(1)
        else:
            pooled = (hidden * valid[..., None]).sum(1) / valid.sum(1, keepdim=True).to(hidden.dtype)
        return self.classifier(self.head(pooled))
