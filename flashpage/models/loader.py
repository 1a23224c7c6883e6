"""Find a model's files and load its weights: HF safetensors (single or sharded; fp8 ones
through models/fp8_checkpoint.py, AWQ / GPTQ int4 ones through models/int4_checkpoint.py),
GGUF, or random.

``resolve_model`` decides what a ``model`` argument names; ``load_model`` builds the
module on the target device and fills it.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from flashpage.config import ConfigError, ModelConfig
from flashpage.layers.quant import quantize_model
from flashpage.models.registry import model_class


class ModelLoadError(RuntimeError):
    """A model's files are missing, unreadable or do not fit its config."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "random"
    path: str | None  # folder (hf), file (gguf), None (random)
    config: ModelConfig

    @property
    def tokenizer_path(self) -> str | None:
        return self.path


def resolve_model(model: str | None, random_config: str | None = None,
                  hf_overrides: dict[str, Any] | None = None) -> ModelSource:
    """None -> the default model (SmolLM2-135M-Instruct GGUF); a .gguf file; a HF folder;
    or, with ``random_config``, a config.json whose weights will be random. ``hf_overrides``
    (vLLM's) go over the config read (config.apply_hf_overrides)."""
    from flashpage.models.gguf_config import default_model_path, gguf_to_hf_config

    if random_config is not None:
        return ModelSource("random", None, ModelConfig.from_hf(random_config, hf_overrides))
    if model is None:
        model = default_model_path()
    if not os.path.exists(model):
        raise ModelLoadError(f"model path {model!r} does not exist")
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, "config.json")):
            return ModelSource("hf", model, ModelConfig.from_hf(model, hf_overrides))
        ggufs = sorted(glob.glob(os.path.join(model, "*.gguf")))
        if ggufs:
            model = ggufs[0]
        else:
            raise ModelLoadError(f"{model} has neither config.json nor a .gguf file")
    if model.endswith(".gguf"):
        try:
            cfg = gguf_to_hf_config(model)
        except ConfigError:
            raise
        except Exception as e:
            raise ModelLoadError(f"{model} is not a readable GGUF file: {e}") from e
        return ModelSource("gguf", model, ModelConfig.from_hf(cfg, hf_overrides))
    raise ModelLoadError(f"{model!r} is neither a model folder nor a .gguf file")


# ----------------------------------------------------------------------------- safetensors
def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is corrupt: {e}") from e
        files = sorted({os.path.join(folder, v) for v in weight_map.values()})
        missing = [p for p in files if not os.path.isfile(p)]
        if missing:
            raise ModelLoadError(f"shard(s) named in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    return files


def iter_safetensors(folder: str, device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a 16/32-bit checkpoint as stored; an fp8 one is a ModelLoadError
    (its values mean nothing without the scales that models/fp8_checkpoint.py applies,
    which a config.json without quantization_config does not ask for)."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt", device=device) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    t = f.get_tensor(name)
                    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                        raise ModelLoadError(
                            f"{path}: tensor {name} is {str(t.dtype).replace('torch.', '')} but "
                            f"{folder}/config.json has no quantization_config saying how to read it")
                    yield name, t
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is corrupt or not a safetensors file: {e}") from e


# ----------------------------------------------------------------------------- GGUF
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rope pairs -> HF's halves)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# GGML block types dequantized in torch here (the default model's Q4_1 and Q8_0 tensors:
# 0.93 s in gguf's numpy code, 0.47 s here): name -> bytes per block of 32 values.
_TORCH_QUANTS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def dequantize_gguf(data: np.ndarray, qtype: str) -> torch.Tensor | None:
    """A GGUF tensor's raw data (as models/gguf_file gives it) as fp32, flat, for F32,
    F16, Q4_0, Q4_1 and Q8_0 (blocks of 32 values, an fp16 scale d first; Q4_1 an fp16
    minimum m after it; 4-bit quants low nibbles first): d * q (Q4_0: d * (q - 8); Q4_1:
    d * q + m), the arithmetic of gguf.quants, so the result is equal to the bit. None for
    any other type."""
    # np.array copies out of the read-only memory map (torch wants writable arrays).
    if qtype == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(-1)
    if qtype == "F16":
        return torch.from_numpy(np.array(data)).reshape(-1).float()
    if qtype not in _TORCH_QUANTS:
        return None
    blocks = torch.from_numpy(np.array(data).reshape(-1)).view(-1, _TORCH_QUANTS[qtype])
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if qtype == "Q8_0":
        return (d * blocks[:, 2:].contiguous().view(torch.int8).float()).reshape(-1)
    qs = blocks[:, 4:] if qtype == "Q4_1" else blocks[:, 2:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).float()
    if qtype == "Q4_0":
        return (d * (q - 8.0)).reshape(-1)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(-1)


def iter_gguf(path: str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    from flashpage.models.gguf_config import open_gguf

    # llama.cpp permutes q/k rows only for Llama-style models (llama, mistral); Qwen2 and
    # Qwen3 are converted as they are (their rope is neox-style in llama.cpp too).
    permuted = config.model_type in ("llama", "mistral")
    try:
        reader = open_gguf(path)
    except Exception as e:
        raise ModelLoadError(f"{path} is corrupt or not a GGUF file: {e}") from e
    for t in reader.tensors:
        if t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        elif t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                raise ModelLoadError(f"{path}: unknown GGUF tensor {t.name!r}")
            name = f"model.layers.{layer}.{_GGUF_LAYER_NAMES[rest]}"
        elif t.name == "rope_freqs.weight":
            # llama.cpp stores Llama 3.1's rope scaling as per-frequency factors.
            name = "rope_freqs"
        else:
            raise ModelLoadError(f"{path}: unknown GGUF tensor {t.name!r}")
        shape = tuple(int(x) for x in reversed(t.shape))
        w = dequantize_gguf(t.data, t.tensor_type.name)
        if w is None:  # another type: gguf's numpy dequantizer
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type "
                                     f"{t.tensor_type.name}") from e
            w = torch.from_numpy(np.array(arr, dtype=np.float32))
        w = w.reshape(shape)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute_rope(w, config.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute_rope(w, config.num_key_value_heads)
        yield name, w


# ----------------------------------------------------------------------------- build + load
def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               max_positions: int | None = None, seed: int = 0,
               quantization: str | None = None,
               classifier_token_ids: list[int] | None = None) -> nn.Module:
    """The model of ``source`` in ``dtype`` on ``device``, its weights loaded (or random),
    then quantized per ``quantization`` (None or "fp8": layers/quant.quantize_model). An fp8
    checkpoint (config.json's quantization_config) keeps its e4m3 weights where our fp8
    linears can run them, with no flag (models/fp8_checkpoint.py); an AWQ / GPTQ one its
    4-bit weights (models/int4_checkpoint.py). A sequence classifier from a causal LM's
    checkpoint gets ``score`` from its LM head's rows at ``classifier_token_ids``
    (models/seq_cls_from_lm.py; the ids of config.classifier_from_token)."""
    cls = model_class(source.config)
    with torch.device(device):
        model = cls(source.config, max_positions)  # type: ignore[call-arg]
    model.to(dtype)  # modules with KeepFp32 (rotary caches, MoE router) stay fp32
    if source.kind == "random":
        init_random_(model, seed)
    else:
        assert source.path is not None
        weights: Iterable[tuple[str, torch.Tensor]]
        if source.kind == "gguf":
            weights = iter_gguf(source.path, source.config)
        elif (qc := source.config.quantization_config) is not None and qc.is_int4:
            from flashpage.models.int4_checkpoint import int4_checkpoint_weights

            weights = int4_checkpoint_weights(model, source.config, source.path)
        elif qc is not None:
            from flashpage.models.fp8_checkpoint import fp8_checkpoint_weights

            weights = fp8_checkpoint_weights(model, source.config, source.path)
        else:
            weights = iter_safetensors(source.path, "cpu")
        if source.config.is_classifier:
            from flashpage.models.seq_cls_from_lm import score_from_lm_head

            weights = score_from_lm_head(weights, source.config, classifier_token_ids, source.path)
        loaded = model.load_weights(weights)  # type: ignore[operator]
        # Parameters and persistent buffers (e.g. DeepSeek-V3's e_score_correction_bias).
        expected = set(model.state_dict().keys())
        if source.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            # Merged parameters (qkv_proj, gate_up_proj): name the checkpoint's own tensors.
            pieces: Callable[[str], list[str]] = getattr(model, "_pieces", lambda name: [])
            # under the checkpoint's names where the family's differ from ours (GPT-NeoX, Phi)
            hf_name: Callable[[str], str] = getattr(model, "hf_name", lambda name: name)
            missing = sorted({hf_name(m) for m in missing if not pieces(m)}
                             | set(getattr(model, "missing_pieces", [])))
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            hint = ""
            if "score.weight" in missing and not source.config.classifier_from_token:
                hint = ("; a causal LM served as a classifier gets score.weight from its LM head "
                        "with hf_overrides' classifier_from_token (e.g. [\"no\", \"yes\"])")
            raise ModelLoadError(f"{source.path}: {len(missing)} weight(s) missing from the "
                                 f"checkpoint: {shown}{hint}")
    quantize_model(model, quantization)
    return model.eval()


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the model's real shape, for benchmarks: N(0, 0.02), norms at 1."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if (name.endswith("norm.weight") or "layernorm" in name
                or (".ln_" in name and name.endswith(".weight"))):  # GPT-2's ln_1, ln_2, ln_f
            p.fill_(1.0)
        else:
            g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            p.normal_(0.0, 0.02, generator=g)
