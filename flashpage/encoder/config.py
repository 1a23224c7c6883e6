"""EncoderConfig.from_hf: a BERT / XLM-RoBERTa config.json read once, checked with errors a
user can act on (the encoder's counterpart of config.ModelConfig.from_hf)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from flashpage.config import ConfigError, classifier_activation

# architecture -> (family, head): "bert" positions start at 0; "roberta" at padding_idx + 1
ENCODER_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "embed"),
    "BertForSequenceClassification": ("bert", "classify"),
    "XLMRobertaModel": ("roberta", "embed"),
    "XLMRobertaForSequenceClassification": ("roberta", "classify"),
    "RobertaModel": ("roberta", "embed"),
    "RobertaForSequenceClassification": ("roberta", "classify"),
}
_MODEL_TYPES = {"bert": "bert", "xlm-roberta": "roberta", "roberta": "roberta"}
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    family: str  # "bert" | "roberta"
    head: str  # "embed" (the hidden states are pooled) | "classify" (a cross-encoder's head)
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    num_labels: int  # classify only (1 for the others)
    labels: tuple[str, ...] = ()  # config.json's id2label, in id order (classify only)
    # what turns a classifier's logits into its outputs (config.classifier_activation, the rule
    # decoder classifiers follow too): "softmax" over several labels, "sigmoid" of one (vLLM's
    # and sentence-transformers' default), "identity" where the checkpoint's
    # sentence-transformers config says Identity or problem_type says regression
    score_activation: str = "sigmoid"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def position_offset(self) -> int:
        """RoBERTa's positions start after its padding index (pad 1 -> first position 2)."""
        return self.pad_token_id + 1 if self.family == "roberta" else 0

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt the position table covers (XLM-R: 514 - 2 = 512)."""
        return self.max_position_embeddings - self.position_offset

    def num_params(self) -> int:
        """Parameters of the model as the engine loads it (the head too, for a cross-encoder)."""
        h, i, n = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        embed = (self.vocab_size + self.max_position_embeddings + max(self.type_vocab_size, 1)) * h + 2 * h
        layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h
        head = 0
        if self.head == "classify":
            head = h * h + h + h * self.num_labels + self.num_labels
        return embed + n * layer + head

    def report(self, dtype_bytes: int) -> dict[str, Any]:
        """What ``flashpage inspect`` says of an encoder: its shape and weights, and that it
        has no KV cache (each prompt is read whole in one forward; nothing is kept)."""
        return {"architecture": self.architecture, "encoder_only": True,
                "task": "embed" if self.head == "embed" else "score (cross-encoder)",
                "hidden_size": self.hidden_size, "num_layers": self.num_hidden_layers,
                "num_heads": self.num_attention_heads, "max_prompt_len": self.max_prompt_len,
                "num_labels": self.num_labels if self.head == "classify" else None,
                "params": self.num_params(), "weight_bytes": self.num_params() * dtype_bytes,
                "kv_cache": None}

    @classmethod
    def from_hf(cls, config: str | dict[str, Any]) -> EncoderConfig:
        """From a config.json path, a folder holding one, or its dict."""
        folder = None
        if isinstance(config, str):
            path = config
            if os.path.isdir(path):
                folder, path = path, os.path.join(path, "config.json")
            try:
                with open(path) as f:
                    raw = json.load(f)
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot read {path}: {e}") from e
        else:
            raw = dict(config)
        arch = encoder_architecture(raw)
        if arch is None:
            raise ConfigError(f"not an encoder config we run (architectures {raw.get('architectures')}, "
                              f"model_type {raw.get('model_type')!r}); encoders: {sorted(ENCODER_ARCHITECTURES)}")
        family, head = ENCODER_ARCHITECTURES[arch]

        def need(key: str) -> int:
            v = raw.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"config.json: {key} must be a positive integer, got {v!r}")
            return v

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        if hidden % heads:
            raise ConfigError(f"config.json: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads}")
        act = raw.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported (one of {ACTIVATIONS})")
        pos_type = raw.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ConfigError(f"config.json: position_embedding_type {pos_type!r} is not supported "
                              "(only absolute positions)")
        if raw.get("is_decoder") or raw.get("add_cross_attention"):
            raise ConfigError("config.json: is_decoder / add_cross_attention: only encoders run here")
        labels = raw.get("id2label")
        num_labels = raw.get("num_labels", len(labels) if isinstance(labels, dict) else 2)
        if head == "embed":
            num_labels = 1
        elif not isinstance(num_labels, int) or num_labels < 1:
            raise ConfigError(f"config.json: num_labels must be a positive integer, got {num_labels!r}")
        pad = raw.get("pad_token_id", 1 if family == "roberta" else 0)
        if not isinstance(pad, int) or pad < 0:
            raise ConfigError(f"config.json: pad_token_id must be a non-negative integer, got {pad!r}")
        max_pos = need("max_position_embeddings")
        if family == "roberta" and max_pos <= pad + 1:
            raise ConfigError(f"config.json: max_position_embeddings {max_pos} leaves no position "
                              f"after RoBERTa's offset (pad_token_id {pad} + 1)")
        return cls(architecture=arch, family=family, head=head, vocab_size=need("vocab_size"),
                   hidden_size=hidden, num_hidden_layers=need("num_hidden_layers"),
                   num_attention_heads=heads, intermediate_size=need("intermediate_size"),
                   max_position_embeddings=max_pos, type_vocab_size=raw.get("type_vocab_size", 2),
                   layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), hidden_act=act,
                   pad_token_id=pad, num_labels=num_labels,
                   labels=_labels(labels, num_labels) if head != "embed" else (),
                   score_activation=classifier_activation(raw, folder, num_labels))


def _labels(id2label: Any, n: int) -> tuple[str, ...]:
    """id2label's names in id order ("LABEL_i" where it names none, as transformers does)."""
    names = id2label if isinstance(id2label, dict) else {}
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(n))


def encoder_architecture(raw: dict[str, Any]) -> str | None:
    """The encoder architecture a config dict names (its ``architectures``, else its
    model_type as the base model), or None for any other model."""
    archs = raw.get("architectures") or []
    for a in archs:
        if a in ENCODER_ARCHITECTURES:
            return str(a)
    if archs:
        return None
    family = _MODEL_TYPES.get(str(raw.get("model_type")))
    if family is None:
        return None
    return "BertModel" if family == "bert" else "XLMRobertaModel"


def is_encoder_model(model: str | None) -> bool:
    """Whether ``model`` (a folder or config.json) is one the encoder path runs. Cheap: reads
    config.json only; anything unreadable is left to the decoder path's errors."""
    if not model:
        return False
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not path.endswith(".json") or not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and encoder_architecture(raw) is not None
