"""EncoderConfig.from_hf: an encoder's config.json (BERT, XLM-RoBERTa, ModernBERT, NomicBERT) read once,
checked with errors a user can act on (the encoder's counterpart of config.ModelConfig.from_hf).
Each family's fields are read by its own function; a field we do not run is a ConfigError
naming it, never a model that silently computes something else."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from flashpage.config import ConfigError, classifier_activation

# architecture -> (family, head): "bert" positions start at 0; "roberta" at padding_idx + 1;
# "modernbert": rotary positions, pre-norm, alternating global and sliding-window layers;
# "nomic_bert": rotary positions, post-norm, fused Wqkv, a gated MLP (nomic-embed-text-v1 / v1.5)
ENCODER_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "BertModel": ("bert", "embed"),
    "BertForSequenceClassification": ("bert", "classify"),
    "XLMRobertaModel": ("roberta", "embed"),
    "XLMRobertaForSequenceClassification": ("roberta", "classify"),
    "RobertaModel": ("roberta", "embed"),
    "RobertaForSequenceClassification": ("roberta", "classify"),
    "ModernBertModel": ("modernbert", "embed"),
    "ModernBertForSequenceClassification": ("modernbert", "classify"),
    "NomicBertModel": ("nomic_bert", "embed"),
}
# model_type -> the base architecture a config without ``architectures`` names
_MODEL_TYPES = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel", "roberta": "XLMRobertaModel",
                "modernbert": "ModernBertModel", "nomic_bert": "NomicBertModel"}
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    family: str  # "bert" | "roberta" | "modernbert" | "nomic_bert"
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
    # --- the rotary families (ModernBERT, NomicBERT); BERT's defaults below
    norm_bias: bool = True  # LayerNorms with a bias (ModernBERT's norm_bias: none)
    attention_bias: bool = True  # Wqkv / Wo biases (NomicBERT's qkv_proj_bias)
    mlp_bias: bool = True  # Wi / Wo biases (NomicBERT's mlp_fc1_bias: fc11 / fc12 / fc1)
    mlp_out_bias: bool = True  # NomicBERT's mlp_fc2_bias (fc2)
    gated_mlp: bool = False  # NomicBERT: fc2(fc11(x) * act(fc12(x))); else fc2(act(fc1(x)))
    rotary_dim: int = 0  # channels of each head rotated (NomicBERT's rotary_emb_fraction)
    rotary_interleaved: bool = False  # pairs (2i, 2i + 1) rather than (i, i + rotary_dim / 2)
    rope_theta: float = 0.0  # 0: learned absolute positions; else the global layers' rotary base
    local_rope_theta: float = 0.0  # the sliding-window layers' rotary base
    local_window: int = 0  # local_attention: a local layer's query sees keys within local_window // 2
    local_layers: tuple[bool, ...] = ()  # per layer: a sliding-window (local) layer
    classifier_pooling: str = "cls"  # ModernBERT's head pools "cls" or "mean" before its dense
    classifier_act: str = "gelu"  # ModernBERT's head activation (config.classifier_activation)
    classifier_bias: bool = True  # ModernBERT's head dense bias

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

    @property
    def position_limit(self) -> str:
        """What bounds a prompt's length, for errors: the field(s) of config.json."""
        if self.family == "nomic_bert":
            return f"n_positions and max_trained_positions: {self.max_position_embeddings}"
        offset = ", less the RoBERTa offset" if self.position_offset else ""
        return f"max_position_embeddings {self.max_position_embeddings}{offset}"

    def num_params(self) -> int:
        """Parameters of the model as the engine loads it (the head too, for a cross-encoder):
        its modules built on the meta device, which allocates nothing."""
        import torch

        from flashpage.encoder.model import encoder_class

        with torch.device("meta"):
            model = encoder_class(self)(self)
        return sum(p.numel() for p in model.parameters())

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
        fields = (_modernbert_fields(raw) if family == "modernbert" else _nomic_fields(raw)
                  if family == "nomic_bert" else _bert_fields(raw, family))
        if raw.get("is_decoder") or raw.get("add_cross_attention"):
            raise ConfigError("config.json: is_decoder / add_cross_attention: only encoders run here")
        labels = raw.get("id2label")
        num_labels = raw.get("num_labels", len(labels) if isinstance(labels, dict) else 2)
        if head == "embed":
            num_labels = 1
        elif not isinstance(num_labels, int) or num_labels < 1:
            raise ConfigError(f"config.json: num_labels must be a positive integer, got {num_labels!r}")
        return cls(architecture=arch, family=family, head=head, num_labels=num_labels,
                   labels=_labels(labels, num_labels) if head != "embed" else (),
                   score_activation=classifier_activation(raw, folder, num_labels), **fields)


def _need(raw: dict[str, Any], key: str) -> int:
    v = raw.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {v!r}")
    return v


def _heads(raw: dict[str, Any], hidden_key: str, heads_key: str) -> tuple[int, int]:
    hidden, heads = _need(raw, hidden_key), _need(raw, heads_key)
    if hidden % heads:
        raise ConfigError(f"config.json: {hidden_key} {hidden} is not a multiple of "
                          f"{heads_key} {heads}")
    return hidden, heads


def _act(raw: dict[str, Any], key: str, default: str) -> str:
    act = raw.get(key, default)
    if act not in ACTIVATIONS:
        raise ConfigError(f"config.json: {key} {act!r} is not supported (one of {ACTIVATIONS})")
    return str(act)


def _pad(raw: dict[str, Any], default: int) -> int:
    pad = raw.get("pad_token_id", default)
    if pad is None:
        pad = default
    if not isinstance(pad, int) or pad < 0:
        raise ConfigError(f"config.json: pad_token_id must be a non-negative integer, got {pad!r}")
    return pad


def _bert_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """BERT / (XLM-)RoBERTa: learned absolute positions, post-LN layers, token types."""
    hidden, heads = _heads(raw, "hidden_size", "num_attention_heads")
    act = _act(raw, "hidden_act", "gelu")
    pos_type = raw.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ConfigError(f"config.json: position_embedding_type {pos_type!r} is not supported "
                          "(only absolute positions)")
    pad = _pad(raw, 1 if family == "roberta" else 0)
    max_pos = _need(raw, "max_position_embeddings")
    if family == "roberta" and max_pos <= pad + 1:
        raise ConfigError(f"config.json: max_position_embeddings {max_pos} leaves no position "
                          f"after RoBERTa's offset (pad_token_id {pad} + 1)")
    return dict(vocab_size=_need(raw, "vocab_size"), hidden_size=hidden,
                num_hidden_layers=_need(raw, "num_hidden_layers"), num_attention_heads=heads,
                intermediate_size=_need(raw, "intermediate_size"), max_position_embeddings=max_pos,
                type_vocab_size=raw.get("type_vocab_size", 2),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), hidden_act=act, pad_token_id=pad)


_MODERNBERT_THETA = {"full_attention": ("global_rope_theta", 160_000.0),
                     "sliding_attention": ("local_rope_theta", 10_000.0)}


def _modernbert_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """ModernBERT (answerdotai/ModernBERT-*, gte-modernbert, modernbert-embed): rotary
    positions of two bases, every ``global_attn_every_n_layers``-th layer global and the
    others a sliding window of ``local_attention`` tokens (transformers 5 writes the same as
    ``layer_types`` and ``rope_parameters``; either form is read), pre-norm layers with a
    GeGLU MLP, LayerNorms with or without bias (``norm_bias``), no token types. Fields its
    modeling code does not read (``position_embedding_type``, ``type_vocab_size``,
    ``reference_compile`` ...) are ignored as transformers ignores them."""
    hidden, heads = _heads(raw, "hidden_size", "num_attention_heads")
    if (hidden // heads) % 2:
        raise ConfigError(f"config.json: head size {hidden // heads} (hidden_size / "
                          "num_attention_heads) must be even for rotary embeddings")
    layers = _need(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is None:
        every = raw.get("global_attn_every_n_layers", 3)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"config.json: global_attn_every_n_layers must be a positive "
                              f"integer, got {every!r}")
        types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in _MODERNBERT_THETA for t in types)):
        raise ConfigError(f"config.json: layer_types must list num_hidden_layers ({layers}) of "
                          f"{sorted(_MODERNBERT_THETA)}, got {types!r}")
    if raw.get("rope_scaling") is not None:
        raise ConfigError(f"config.json: rope_scaling {raw['rope_scaling']!r} is not supported "
                          "(ModernBERT runs its default rotary embeddings only)")
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config.json: rope_parameters must be a dict, got {rope!r}")
    theta: dict[str, float] = {}
    for kind, (key, default) in _MODERNBERT_THETA.items():
        params = rope.get(kind) or {}
        if not isinstance(params, dict) or params.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: rope_parameters[{kind!r}] {params!r} is not supported "
                              "(only rope_type 'default')")
        value = params.get("rope_theta", raw.get(key))
        if value is None:  # an old config's local_rope_theta null: the global base
            value = theta.get("full_attention", default)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"config.json: {key} must be a positive number, got {value!r}")
        theta[kind] = float(value)
    window = raw.get("local_attention", 128)
    if "sliding_attention" in types and (not isinstance(window, int) or isinstance(window, bool)
                                         or window < 2):
        raise ConfigError(f"config.json: local_attention must be an integer of at least 2, got {window!r}")
    pooling = raw.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ConfigError(f"config.json: classifier_pooling {pooling!r} is not supported (cls or mean)")
    return dict(vocab_size=_need(raw, "vocab_size"), hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, intermediate_size=_need(raw, "intermediate_size"),
                max_position_embeddings=_need(raw, "max_position_embeddings"), type_vocab_size=0,
                layer_norm_eps=float(raw.get("norm_eps", 1e-5)),
                hidden_act=_act(raw, "hidden_activation", "gelu"), pad_token_id=_pad(raw, 50283),
                norm_bias=bool(raw.get("norm_bias", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                rope_theta=theta["full_attention"], local_rope_theta=theta["sliding_attention"],
                local_window=window if isinstance(window, int) else 0,
                local_layers=tuple(t == "sliding_attention" for t in types),
                classifier_pooling=pooling, classifier_act=_act(raw, "classifier_activation", "gelu"),
                classifier_bias=bool(raw.get("classifier_bias", False)))


# NomicBERT's activation_function -> (gated MLP, the activation): GLU's sigmoid, SwiGLU's
# SiLU, GeGLU's and the plain MLP's exact GELU (its modeling code passes F.gelu for every
# gelu name, so gelu_new is exact there too)
_NOMIC_ACTS = {"swiglu": (True, "silu"), "geglu": (True, "gelu"), "glu": (True, "sigmoid"),
               "gelu": (False, "gelu"), "gelu_new": (False, "gelu"), "gelu_fast": (False, "gelu"),
               "gelu_pytorch_tanh": (False, "gelu")}
# fields of nomic's config (a GPT2Config) whose only value we run, with that value
_NOMIC_FIXED = {"prenorm": False, "parallel_block": False, "use_rms_norm": False, "causal": False,
                "rotary_emb_scale_base": None, "rotary_head_dim": False}


def _nomic_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """NomicBERT (nomic-embed-text-v1 / v1.5, nomic-bert-2048; trust_remote_code upstream,
    GPT-2 field names): rotary embeddings over ``rotary_emb_fraction`` of each head
    (``rotary_emb_base``, ``rotary_emb_interleaved``), post-norm layers with a fused
    ``Wqkv``, a SwiGLU (or GeGLU / GLU / plain GELU) MLP, optional biases
    (``qkv_proj_bias``, ``mlp_fc1_bias``, ``mlp_fc2_bias``), token types. Prompts are
    capped at ``max_trained_positions`` (2048) as vLLM caps them, so its dynamic-NTK
    ``rotary_scaling_factor``, which applies only past that length, never does."""
    for key, want in _NOMIC_FIXED.items():
        if raw.get(key) is not None and raw[key] != want:
            raise ConfigError(f"config.json: {key} {raw[key]!r} is not supported (only {want!r})")
    hidden, heads = _heads(raw, "n_embd", "n_head")
    if raw.get("num_heads_kv") not in (None, heads):
        raise ConfigError(f"config.json: num_heads_kv {raw['num_heads_kv']!r} is not supported "
                          f"(only n_head's {heads}: no grouped-query attention)")
    act_name = raw.get("activation_function", "gelu_new")
    if act_name not in _NOMIC_ACTS:
        raise ConfigError(f"config.json: activation_function {act_name!r} is not supported "
                          f"(one of {sorted(_NOMIC_ACTS)})")
    gated, act_fn = _NOMIC_ACTS[act_name]
    inner = raw.get("n_inner")
    if inner is None:
        inner = int(8 * hidden / 3) if gated else 4 * hidden
    elif not isinstance(inner, int) or isinstance(inner, bool) or inner < 1:
        raise ConfigError(f"config.json: n_inner must be a positive integer, got {inner!r}")
    if gated:  # nomic's gated MLP rounds its width up to a multiple of 256
        inner = -(-inner // 256) * 256
    head_dim = hidden // heads
    fraction = raw.get("rotary_emb_fraction", 0.0)
    rotary = head_dim * fraction if isinstance(fraction, int | float) and not isinstance(fraction, bool) else 0
    if not 0 < rotary <= head_dim or rotary != int(rotary) or int(rotary) % 2:
        raise ConfigError(f"config.json: rotary_emb_fraction {fraction!r} is not supported: it must "
                          f"rotate an even number of a head's {head_dim} channels, at least 2 "
                          "(0, learned absolute positions, is not run)")
    base = raw.get("rotary_emb_base", 10_000)
    if not isinstance(base, int | float) or isinstance(base, bool) or base <= 0:
        raise ConfigError(f"config.json: rotary_emb_base must be a positive number, got {base!r}")
    vocab = _need(raw, "vocab_size")
    multiple = raw.get("pad_vocab_size_multiple", 1) or 1
    if not isinstance(multiple, int) or multiple < 1:
        raise ConfigError(f"config.json: pad_vocab_size_multiple must be a positive integer, got {multiple!r}")
    vocab = -(-vocab // multiple) * multiple  # as NomicBertModel pads it
    trained = _need({"max_trained_positions": 2048, **raw}, "max_trained_positions")
    positions = _need({"n_positions": 1024, **raw}, "n_positions")
    types = raw.get("type_vocab_size", 2)
    if not isinstance(types, int) or isinstance(types, bool) or types < 0:
        raise ConfigError(f"config.json: type_vocab_size must be a non-negative integer, got {types!r}")
    return dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=_need(raw, "n_layer"),
                num_attention_heads=heads, intermediate_size=inner,
                max_position_embeddings=min(positions, trained),
                type_vocab_size=types, layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
                hidden_act=act_fn, pad_token_id=_pad(raw, 0),
                attention_bias=bool(raw.get("qkv_proj_bias", True)),
                mlp_bias=bool(raw.get("mlp_fc1_bias", True)),
                mlp_out_bias=bool(raw.get("mlp_fc2_bias", True)), gated_mlp=gated,
                rope_theta=float(base), rotary_dim=int(rotary),
                rotary_interleaved=bool(raw.get("rotary_emb_interleaved", False)))


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
    return _MODEL_TYPES.get(str(raw.get("model_type")))


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
