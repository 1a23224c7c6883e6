"""Read a PEFT LoRA adapter folder and check it against the model it is meant for.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ``bias``, ...) and ``adapter_model.safetensors`` with, per adapted linear,

    base_model.model.<HF module path>.lora_A.weight   [r, in_features]
    base_model.model.<HF module path>.lora_B.weight   [out_features, r]

so that the linear computes ``W x + scaling * B (A x)``, ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). Module paths are HF's
(``model.layers.3.self_attn.q_proj``); the model says which it takes and their shapes
(``lora_targets``: q/k/v and gate/up are slices of our fused linears, see manager.py).

Anything this engine would not apply as the adapter's trainer did is a ValueError naming
it: a bias, ``modules_to_save``, DoRA, embedding or LM-head adapters, per-module rank or
alpha patterns, an unknown module, a shape that does not fit, a rank over
``max_lora_rank``, a missing file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from flashpage.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# What a model's LoRA targets never include: PEFT adapters of these need layers we lack.
_EMBEDDING_MODULES = ("embed_tokens", "lm_head", "wte", "word_embeddings")


@dataclass(frozen=True)
class TargetShape:
    """One HF linear the model can adapt: ``in_features`` -> ``out_features``."""

    in_features: int
    out_features: int


@dataclass
class LoRAAdapter:
    """A checked adapter on the host: per HF module path, A [r, in] and B [out, r] in
    fp32, ``scaling`` already folded into B (so the delta is B (A x))."""

    request: LoRARequest
    rank: int
    scaling: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.modules.values())


def _fail(req: LoRARequest, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {req.lora_name!r} ({req.lora_path}): {what}")


def read_config(req: LoRARequest) -> dict:
    path = req.lora_path
    if not os.path.isdir(path):
        raise _fail(req, "the path does not exist or is not a folder")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise _fail(req, f"no {CONFIG_FILE} in the folder (not a PEFT adapter)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(req, f"{CONFIG_FILE} is not readable JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(req, f"{CONFIG_FILE} is not a JSON object")
    return cfg


def _check_config(req: LoRARequest, cfg: dict, targets: dict[str, TargetShape],
                  max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling, or a ValueError naming what this engine cannot apply."""
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _fail(req, f"peft_type {peft_type!r} is not LORA")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(req, f"r (the rank) must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _fail(req, f"rank r={r} is larger than max_lora_rank={max_rank} "
                         "(start the engine with a larger max_lora_rank)")
    alpha = cfg.get("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _fail(req, f"lora_alpha must be a number, got {alpha!r}")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise _fail(req, f"bias={bias!r} is not supported (only 'none': the adapter may not "
                         "train the base model's biases)")
    if cfg.get("lora_bias"):
        raise _fail(req, "lora_bias=true (a bias on lora_B) is not supported")
    if cfg.get("modules_to_save"):
        raise _fail(req, f"modules_to_save {cfg['modules_to_save']} is not supported (whole "
                         "modules trained beside the adapter)")
    if cfg.get("use_dora"):
        raise _fail(req, "use_dora=true (DoRA) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _fail(req, f"{key} (a rank or alpha per module) is not supported")
    # fan_in_fan_out: PEFT keeps lora_A / lora_B as nn.Linear weights either way (it only
    # transposes the merged delta for GPT-2's Conv1D), so the shapes below stay the check.
    tm = cfg.get("target_modules")
    if isinstance(tm, list):
        short = sorted({p.rsplit(".", 1)[-1] for p in targets})
        for name in tm:
            if any(e in str(name).split(".") for e in _EMBEDDING_MODULES):
                raise _fail(req, f"target module {name!r}: embedding and LM-head adapters are "
                                 "not supported")
            if not any(p == name or p.endswith("." + str(name)) for p in targets):
                raise _fail(req, f"unknown target module {name!r} (this model takes "
                                 f"{', '.join(short)})")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def _module_of(req: LoRARequest, key: str) -> tuple[str, str]:
    """A tensor name -> (HF module path, "A" | "B"); a ValueError for anything else."""
    name = key.removeprefix(_PREFIX)
    for kind in ("A", "B"):
        for suffix in (f".lora_{kind}.weight", f".lora_{kind}.default.weight"):
            if name.endswith(suffix):
                return name[: -len(suffix)], kind
    if "lora_embedding_" in name:
        raise _fail(req, f"tensor {key!r}: embedding adapters are not supported")
    if "lora_magnitude_vector" in name:
        raise _fail(req, f"tensor {key!r}: DoRA is not supported")
    if ".lora_B." in name and name.endswith(".bias"):
        raise _fail(req, f"tensor {key!r}: a bias on lora_B is not supported")
    raise _fail(req, f"unexpected tensor {key!r} (want <module>.lora_A.weight / .lora_B.weight)")


def load_adapter(req: LoRARequest, targets: dict[str, TargetShape], max_rank: int) -> LoRAAdapter:
    """Read and check ``req``'s folder against ``targets`` (HF module path -> shape)."""
    cfg = read_config(req)
    r, scaling = _check_config(req, cfg, targets, max_rank)
    wpath = os.path.join(req.lora_path, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        if os.path.isfile(os.path.join(req.lora_path, "adapter_model.bin")):
            raise _fail(req, f"only {WEIGHTS_FILE} is read (found adapter_model.bin: save the "
                             "adapter with safe_serialization=True)")
        raise _fail(req, f"no {WEIGHTS_FILE} in the folder")
    from safetensors import SafetensorError, safe_open

    pieces: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(wpath, framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                module, kind = _module_of(req, key)
                pieces.setdefault(module, {})[kind] = f.get_tensor(key)
    except (SafetensorError, OSError) as e:
        raise _fail(req, f"{WEIGHTS_FILE} is corrupt or not a safetensors file: {e}") from None
    if not pieces:
        raise _fail(req, f"{WEIGHTS_FILE} holds no lora_A / lora_B tensors")
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in sorted(pieces.items()):
        if module.rsplit(".", 1)[-1] in _EMBEDDING_MODULES:
            raise _fail(req, f"module {module!r}: embedding and LM-head adapters are not supported")
        shape = targets.get(module)
        if shape is None:
            short = sorted({p.rsplit(".", 1)[-1] for p in targets})
            raise _fail(req, f"module {module!r} is not one this model can adapt (it takes "
                             f"{', '.join(short)} in each of its layers)")
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise _fail(req, f"module {module!r} has no {missing}.weight")
        a, b = ab["A"], ab["B"]
        want_a, want_b = (r, shape.in_features), (shape.out_features, r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise _fail(req, f"module {module!r}: lora_A {tuple(a.shape)} / lora_B "
                             f"{tuple(b.shape)} do not fit the base model (want {want_a} / "
                             f"{want_b} for r={r})")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise _fail(req, f"module {module!r}: lora weights must be floating point, got "
                             f"{a.dtype} / {b.dtype}")
        modules[module] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoRAAdapter(req, r, scaling, modules)
