"""BERT / XLM-RoBERTa encoders in plain PyTorch (other families: encoder_class), HF parameter names kept (so a checkpoint's
state dict loads after dropping its ``bert.`` / ``roberta.`` prefix).

One forward takes a padded batch::

    input_ids, token_type_ids, positions : [B, T] int64   (pad rows past each prompt's length)
    valid                                : [B, T] bool    True for a prompt's own tokens
    -> hidden                            : [B, T, hidden] the last layer's output (post-LN)

Attention is bidirectional, through torch's SDPA: with a key-padding mask when the
prompts' lengths differ (CUDA: the memory-efficient kernel), without one when they do not
(CUDA: flash). Padded query rows compute garbage nobody reads.
"""

from __future__ import annotations

import glob
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.config import ConfigError
from flashpage.encoder.config import EncoderConfig

logger = logging.getLogger("flashpage")


class Encoder(nn.Module):
    """What the engine calls on every family's model (this file's BERT / RoBERTa,
    modernbert.py's ModernBERT)."""

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                positions: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """[B, T] ids, types, positions, valid (None: no padding) -> hidden [B, T, hidden]."""
        raise NotImplementedError

    def classify(self, hidden: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """A classifier's head on the last hidden states [B, T, hidden] -> logits [B, labels]."""
        raise NotImplementedError


def act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return F.gelu(x)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    if name == "sigmoid":  # NomicBERT's GLU
        return torch.sigmoid(x)
    if name == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {name!r}")  # config.py lets only known ones through


class Embeddings(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(positions))
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, h = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, heads, T, head_dim]
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                             split(self.value(x)), attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, h)


class DenseLayerNorm(nn.Module):
    """BERT's post-LN residual: LayerNorm(dense(x) + residual) (HF's *SelfOutput / *Output)."""

    def __init__(self, cfg: EncoderConfig, d_in: int) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)  # HF's name: attention.self.query
        self.output = DenseLayerNorm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act(self.act, self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseLayerNorm(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Stack(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))


class Pooler(nn.Module):
    """BERT's pooler: tanh(dense(hidden of [CLS]))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class RobertaClassificationHead(nn.Module):
    """RoBERTa's head on <s>: out_proj(tanh(dense(hidden)))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.num_labels)


class EncoderModel(Encoder):
    """Embeddings, post-LN layers and, for a cross-encoder, its classification head."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Stack(cfg)
        self.pooler: Pooler | None = None
        self.classifier: nn.Module | None = None
        if cfg.head == "classify":
            if cfg.family == "bert":
                self.pooler = Pooler(cfg)
                self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
            else:
                self.classifier = RobertaClassificationHead(cfg)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                positions: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """[B, T] ids, types, positions, valid (None: no padding) -> hidden [B, T, hidden]."""
        x = self.embeddings(input_ids, token_type_ids, positions)
        # [B, 1, 1, T]: every query row sees its own prompt's keys
        mask = None if valid is None else valid[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def classify(self, hidden: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """The head on each prompt's first token ([CLS] / <s>): hidden [B, T, hidden] (and
        the valid mask, unused here) -> logits [B, labels]."""
        if self.classifier is None:
            raise RuntimeError("this model has no classification head")
        first = hidden[:, 0]
        if self.pooler is not None:  # BERT
            return self.classifier(torch.tanh(self.pooler.dense(first)))
        head = self.classifier
        assert isinstance(head, RobertaClassificationHead)
        return head.out_proj(torch.tanh(head.dense(first)))


# ----------------------------------------------------------------------------- loading
# a family's base-model prefix in its *For* checkpoints (dropped on load)
_PREFIXES = {"bert": ("bert.", "roberta."), "roberta": ("bert.", "roberta."), "modernbert": ("model.",),
             "nomic_bert": ("bert.",)}


def encoder_class(cfg: EncoderConfig) -> type[Encoder]:
    """The module a family runs as: ``cls(cfg)`` offers forward(ids, types, positions, valid)
    -> hidden [B, T, hidden] and classify(hidden, valid) -> logits [B, labels]."""
    if cfg.family == "modernbert":
        from flashpage.encoder.modernbert import ModernBertEncoder

        return ModernBertEncoder
    if cfg.family == "nomic_bert":
        from flashpage.encoder.nomic_bert import NomicBertEncoder

        return NomicBertEncoder
    return EncoderModel


def checkpoint_state(folder: str, prefixes: tuple[str, ...] = _PREFIXES["bert"]) -> dict[str, torch.Tensor]:
    """The folder's weights (safetensors files, else pytorch_model.bin) under our names:
    the base model's prefix (one of ``prefixes``) dropped, old ``LayerNorm.gamma/beta`` renamed."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            state.update(load_file(f))
    elif os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        state = torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu",
                           weights_only=True)
    else:
        raise ConfigError(f"{folder} holds no *.safetensors nor pytorch_model.bin")
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        for p in prefixes:
            if k.startswith(p):
                k = k[len(p):]
                break
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[k] = v
    return out


def load_encoder(cfg: EncoderConfig, folder: str | None, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> Encoder:
    """The model with the folder's weights (``folder`` None: random, for benchmarks), in
    ``dtype`` on ``device``. Missing or misshapen weights: a ConfigError naming them; weights
    we do not use (masked-LM heads, position_ids buffers, an unused pooler) are skipped."""
    torch.manual_seed(seed)
    model = encoder_class(cfg)(cfg)
    if folder is None:
        with torch.no_grad():
            for m in model.modules():
                for n, p in m.named_parameters(recurse=False):
                    if isinstance(m, nn.LayerNorm):
                        p.fill_(1.0 if n == "weight" else 0.0)
                    else:
                        p.normal_(0, 0.02)
    else:
        ours = model.state_dict()
        state = checkpoint_state(folder, _PREFIXES[cfg.family])
        missing = [k for k in ours if k not in state]
        if missing:
            raise ConfigError(f"{folder}: the checkpoint lacks {len(missing)} weights "
                              f"{cfg.architecture} needs, e.g. {missing[:3]}")
        for k, want in ours.items():
            if state[k].shape != want.shape:
                raise ConfigError(f"{folder}: weight {k} has shape {tuple(state[k].shape)}, "
                                  f"config.json implies {tuple(want.shape)}")
        skipped = sorted(k for k in state if k not in ours)
        if skipped:
            logger.info("encoder: %d checkpoint tensors not used (e.g. %s)", len(skipped), skipped[:3])
        model.load_state_dict({k: state[k] for k in ours})
    return model.to(device=device, dtype=dtype).eval()
