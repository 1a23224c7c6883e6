"""Find a model's files and load its weights: HF safetensors (single or sharded; fp8 ones
through models/fp8_checkpoint.py, AWQ / GPTQ int4 ones through models/int4_checkpoint.py),
GGUF (models/gguf_weights.py), or random.

``resolve_model`` decides what a ``model`` argument names; ``load_model`` builds the
module on the target device and fills it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

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


def iter_safetensors(folder: str, device: str = "cpu", keep: Callable[[str], bool] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a 16/32-bit checkpoint as stored (only those whose names ``keep``
    takes, the others never read); an fp8 one is a ModelLoadError (its values mean nothing
    without the scales that models/fp8_checkpoint.py applies, which a config.json without
    quantization_config does not ask for)."""
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt", device=device) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if keep is not None and not keep(name):
                        continue
                    t = f.get_tensor(name)
                    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                        raise ModelLoadError(
                            f"{path}: tensor {name} is {str(t.dtype).replace('torch.', '')} but "
                            f"{folder}/config.json has no quantization_config saying how to read it")
                    yield name, t
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path} is corrupt or not a safetensors file: {e}") from e


# ----------------------------------------------------------------------------- build + load
def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               max_positions: int | None = None, seed: int = 0,
               quantization: str | None = None,
               classifier_token_ids: list[int] | None = None,
               mxfp4_kernel: bool = False, fp8_moe_kernel: bool = False,
               int4_moe_kernel: bool = False) -> nn.Module:
    """The model of ``source`` in ``dtype`` on ``device``, its weights loaded (or random),
    then quantized per ``quantization`` (None, "fp8", "int4" / "rtn": layers/quant.
    quantize_model; routed experts too where ``fp8_moe_kernel`` / ``int4_moe_kernel`` says
    their fused kernel runs). An fp8
    checkpoint (config.json's quantization_config) keeps its e4m3 weights where our fp8
    linears can run them, with no flag (models/fp8_checkpoint.py); an AWQ / GPTQ one its
    4-bit weights (models/int4_checkpoint.py). A sequence classifier from a causal LM's
    checkpoint gets ``score`` from its LM head's rows at ``classifier_token_ids``
    (models/seq_cls_from_lm.py; the ids of config.classifier_from_token). ``mxfp4_kernel``:
    an MXFP4 checkpoint's experts (GPT-OSS's) stay MXFP4 for the fused MoE kernel
    (config.mxfp4_kernel; the engine's choice, envs.mxfp4) instead of being dequantized.
    ``fp8_moe_kernel``: a block-fp8 checkpoint's routed experts stay e4m3 with their block
    scales where their shapes allow (models/fp8_checkpoint.py; the engine's choice,
    envs.fp8_moe) instead of being dequantized, and quantization="fp8" quantizes 16-bit
    ones so. ``int4_moe_kernel``: an AWQ / GPTQ checkpoint's routed experts stay packed
    int4 where their groups allow (models/int4_checkpoint.py; the engine's choice,
    envs.int4_moe), and the online int4 methods quantize 16-bit ones so."""
    cls = model_class(source.config)
    config = source.config
    if mxfp4_kernel and config.mxfp4_experts:
        config = dataclasses.replace(config, mxfp4_kernel=True)
    with torch.device(device):
        model = cls(config, max_positions)  # type: ignore[call-arg]
    model.to(dtype)  # modules with KeepFp32 (rotary caches, MoE router) stay fp32
    if source.kind == "random":
        init_random_(model, seed)
    else:
        weights = checkpoint_weights(source, model, fp8_moe_kernel=fp8_moe_kernel,
                                     int4_moe_kernel=int4_moe_kernel)
        weights = adapt_weights(source, weights, classifier_token_ids)
        check_loaded(source, model, model.load_weights(weights))  # type: ignore[operator]
    # routed experts too where their fused kernel keeps them (the same choice as a
    # quantized checkpoint's: fp8_moe_kernel / int4_moe_kernel)
    quantize_model(model, quantization, experts=fp8_moe_kernel if quantization == "fp8"
                   else int4_moe_kernel)
    return model.eval()


def checkpoint_weights(source: ModelSource, model: nn.Module, *, fp8_moe_kernel: bool = False,
                       int4_moe_kernel: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
    """The (checkpoint name, tensor) pairs of ``source``'s files as ``model.load_weights``
    takes them: GGUF dequantized, an fp8 / int4 checkpoint's through its reader (which may
    set ``model``'s linears to hold them), else the safetensors as stored."""
    assert source.path is not None
    if source.kind == "gguf":
        from flashpage.models.gguf_weights import iter_gguf

        return iter_gguf(source.path, source.config)
    if (qc := source.config.quantization_config) is not None and qc.is_int4:
        from flashpage.models.int4_checkpoint import int4_checkpoint_weights

        return int4_checkpoint_weights(model, source.config, source.path,
                                       keep_experts=int4_moe_kernel)
    if qc is not None:
        from flashpage.models.fp8_checkpoint import fp8_checkpoint_weights

        return fp8_checkpoint_weights(model, source.config, source.path, keep_experts=fp8_moe_kernel)
    return iter_safetensors(source.path, "cpu")


def adapt_weights(source: ModelSource, weights: Iterable[tuple[str, torch.Tensor]],
                  classifier_token_ids: list[int] | None = None,
                  where: str | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors as the model's family reads them: a multimodal checkpoint's
    text model alone, a classifier's ``score`` from an LM head (LLMEngine.load_weights
    passes a caller's tensors through this too). ``where`` names them in errors (default:
    the checkpoint's path)."""
    where = where or source.path or "the weights"
    if source.config.multimodal_architecture:  # its text model's tensors alone
        from flashpage.models.multimodal import text_model_weights

        weights = text_model_weights(weights, source.config, where)
    if source.config.is_classifier:
        from flashpage.models.seq_cls_from_lm import score_from_lm_head

        weights = score_from_lm_head(weights, source.config, classifier_token_ids, where)
    return weights


def check_loaded(source: ModelSource, model: nn.Module, loaded: set[str]) -> None:
    """A ModelLoadError naming the checkpoint's tensors that ``loaded`` (what
    ``model.load_weights`` returned) lacks: every parameter and persistent buffer is due."""
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
    for name, b in model.named_buffers():  # MXFP4 experts (layers/moe.FusedExperts mxfp4)
        if b.dtype == torch.uint8 and name.endswith("proj_blocks"):
            g = gens.setdefault(b.device, torch.Generator(device=b.device).manual_seed(seed))
            b.random_(0, 256, generator=g)  # e2m1 values of RMS ~2.9 ...
        elif b.dtype == torch.uint8 and name.endswith("proj_scales"):
            b.fill_(127 - 7)  # ... times 2 ** -7: ~0.02, as the 16-bit weights
