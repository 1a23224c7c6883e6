"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"), in the checkpoint format vLLM's ``MedusaModel`` reads.

A Medusa checkpoint is a folder with a ``config.json`` (``model_type`` "medusa",
``hidden_size``, ``vocab_size``, ``num_heads``: the heads, ``num_hidden_layers``: residual
blocks a head; the original release's ``medusa_num_heads`` / ``medusa_num_layers`` are read
too) and its weights (``*.safetensors`` or ``pytorch_model.bin``)::

    blocks.{h}.layers.{j}.weight  [H, H]    blocks.{h}.layers.{j}.bias  [H]
    lm_heads.{h}.weight           [V, H]

Head ``h`` reads the target's final hidden state x (after the final norm: what the
target's lm_head reads) at a position p and gives logits for token p + 2 + h::

    for j in range(num_hidden_layers):  x = x + SiLU(W_hj x + b_hj)
    logits_h = lm_heads_h(x)

engine/medusa.py drafts with them; this module reads, checks and loads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.config import ConfigError, ModelConfig, read_config_json

WHERE = "speculative_config method 'medusa'"


@dataclass(frozen=True)
class MedusaSpec:
    """A Medusa checkpoint's shape, read from its config.json."""

    path: str
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_layers: int  # residual blocks a head


def _int_field(d: dict[str, object], names: tuple[str, ...], cfg_path: str, default: int | None = None
               ) -> int:
    for name in names:
        v = d.get(name)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigError(f"{WHERE}: {cfg_path}: {name} must be an integer >= 0, got {v!r}")
        return v
    if default is None:
        raise ConfigError(f"{WHERE}: {cfg_path} has no {' / '.join(names)}")
    return default


def read_medusa_spec(path: str, target: ModelConfig, num_speculative_tokens: int) -> MedusaSpec:
    """The Medusa checkpoint at ``path`` for ``target``, drafting ``num_speculative_tokens``
    a step; a ConfigError names what does not fit (no config.json, another model_type, a
    hidden or vocabulary size other than the target's, more drafts than heads)."""
    try:
        cfg_path, d = read_config_json(os.path.join(path, "config.json"))
    except ConfigError as e:
        raise ConfigError(f"{WHERE}: the Medusa folder {path!r}: {e}") from None
    kind = d.get("model_type")
    if kind is not None and kind != "medusa":
        raise ConfigError(f"{WHERE}: {cfg_path} has model_type {kind!r}, not 'medusa'")
    hidden = _int_field(d, ("hidden_size",), cfg_path)
    if hidden != target.hidden_size:
        raise ConfigError(f"{WHERE}: the heads' hidden_size {hidden} differs from the target's "
                          f"{target.hidden_size}")
    vocab = _int_field(d, ("vocab_size",), cfg_path)
    if vocab != target.vocab_size:
        raise ConfigError(f"{WHERE}: the heads' vocab_size {vocab} differs from the target's "
                          f"{target.vocab_size}")
    if d.get("truncated_vocab_size") not in (None, vocab) or d.get("token_map") is not None:
        raise ConfigError(f"{WHERE}: {cfg_path}: heads over a truncated vocabulary "
                          "(truncated_vocab_size / token_map) are not supported")
    heads = _int_field(d, ("num_heads", "medusa_num_heads"), cfg_path)
    if heads < 1:
        raise ConfigError(f"{WHERE}: {cfg_path}: num_heads must be >= 1, got {heads}")
    layers = _int_field(d, ("num_hidden_layers", "medusa_num_layers"), cfg_path, default=1)
    if num_speculative_tokens > heads:
        raise ConfigError(f"{WHERE}: num_speculative_tokens {num_speculative_tokens} is more than "
                          f"the checkpoint's num_heads {heads} (one draft a head)")
    return MedusaSpec(path, hidden, vocab, heads, layers)


class MedusaHeads(nn.Module):
    """The first ``k`` heads of a Medusa checkpoint (parameters under the checkpoint's own
    names). ``forward(x)``: x [n, H] the target's final hidden states -> logits [k, n, V]
    (head h's row i: token p_i + 2 + h)."""

    def __init__(self, spec: MedusaSpec, k: int) -> None:
        super().__init__()
        h, v = spec.hidden_size, spec.vocab_size
        self.spec = spec
        self.blocks = nn.ModuleList()
        for _ in range(k):
            block = nn.Module()
            block.layers = nn.ModuleList(nn.Linear(h, h, bias=True) for _ in range(spec.num_layers))
            self.blocks.append(block)
        self.lm_heads = nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for block, head in zip(self.blocks, self.lm_heads, strict=True):
            y = x
            for lin in cast(nn.ModuleList, block.layers):
                y = y + F.silu(lin(y))
            out.append(head(y))
        return torch.stack(out)


def load_medusa(spec: MedusaSpec, k: int, dtype: torch.dtype, device: torch.device) -> MedusaHeads:
    """The first ``k`` heads of ``spec`` in ``dtype`` on ``device``; a ConfigError names a
    missing or misshapen tensor (the heads past ``k`` are not read)."""
    with torch.device("meta"):
        heads = MedusaHeads(spec, k)
    from flashpage.models.eagle import checkpoint_tensors

    tensors = {name.removeprefix("model."): t for name, t in checkpoint_tensors(spec.path, WHERE)}
    params = dict(heads.named_parameters())
    missing = sorted(n for n in params if n not in tensors)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ConfigError(f"{WHERE}: {spec.path}: {len(missing)} weight(s) of the Medusa heads missing "
                          f"from the checkpoint: {shown}")
    state = {}
    for name, p in params.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ConfigError(f"{WHERE}: {spec.path}: {name} has shape {tuple(t.shape)}, expected "
                              f"{tuple(p.shape)}")
        state[name] = t.to(device=device, dtype=dtype)
    heads.load_state_dict(state, assign=True)
    return heads.eval()


__all__ = ["MedusaHeads", "MedusaSpec", "load_medusa", "read_medusa_spec"]
