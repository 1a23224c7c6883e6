"""PEFT-format LoRA adapters for the tiny test checkpoints, and their merged checkpoints.

``write_adapter`` writes what PEFT's ``save_pretrained`` writes (adapter_config.json and
adapter_model.safetensors with ``base_model.model.<module>.lora_A.weight`` [r, in] and
``.lora_B.weight`` [out, r]) with random A and B; ``merge_adapter`` writes the base
checkpoint with ``W + scaling * B @ A`` in every adapted linear, computed here from the
files alone (not through flashpage's loader), the model an adapter must behave as.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(base: Path) -> dict[str, tuple[int, int]]:
    """Short module name -> (in_features, out_features) of a Llama-family config."""
    cfg = json.loads((base / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def _path(layer: int, short: str) -> str:
    kind = "mlp" if short in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{kind}.{short}"


def write_adapter(out: Path, base: Path, *, r: int = 8, alpha: float = 16, seed: int = 0,
                  targets: tuple[str, ...] = ALL_TARGETS, std: float = 0.15,
                  use_rslora: bool = False, config_extra: dict | None = None,
                  layers: tuple[int, ...] | None = None) -> Path:
    """A random adapter for the checkpoint at ``base`` (all its layers unless ``layers``)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((base / "config.json").read_text())
    shapes = module_shapes(base)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers if layers is not None else range(cfg["num_hidden_layers"]):
        for short in targets:
            fin, fout = shapes[short]
            key = f"base_model.model.{_path(layer, short)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, fin, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, r, generator=g) * std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": use_rslora, "modules_to_save": None,
              "base_model_name_or_path": str(base)}
    config.update(config_extra or {})
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merge_adapter(base: Path, adapter: Path, out: Path) -> Path:
    """``base`` with the adapter merged into its weights (W += scaling * B @ A), every other
    file (config, tokenizer) copied."""
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for f in sorted(base.glob("*.safetensors")):
        weights = load_file(str(f))
        for key in list(weights):
            a = lora.get(f"base_model.model.{key.removesuffix('.weight')}.lora_A.weight")
            if a is not None and key.endswith(".weight"):
                b = lora[f"base_model.model.{key.removesuffix('.weight')}.lora_B.weight"]
                w = weights[key].double() + scaling * (b.double() @ a.double())
                weights[key] = w.to(weights[key].dtype)
        save_file(weights, str(out / f.name), metadata={"format": "pt"})
    return out


def write_named_adapter(out: Path, modules: dict[str, tuple[int, int]], *, r: int = 4,
                        alpha: float = 8, seed: int = 3, std: float = 0.2) -> Path:
    """A random adapter on modules named as a checkpoint names them (full path ->
    (in_features, out_features), in the order the random A and B are drawn), for the
    families whose modules are not Llama's; target_modules their last components."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for path, (fin, fout) in modules.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = torch.randn(r, fin, generator=g) * std
        tensors[f"base_model.model.{path}.lora_B.weight"] = torch.randn(fout, r, generator=g) * std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
        "lora_dropout": 0.0, "target_modules": sorted({p.split(".")[-1] for p in modules}),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "modules_to_save": None}))
    return out


def assert_adapter_gives_merged_tokens(base: Path, adapter: Path, tmp_path: Path,
                                       n_prompts: int = 3) -> None:
    """Our greedy tokens with the adapter (fp32, CPU) are transformers' on the checkpoint
    with it merged, and not those of the base checkpoint (the adapter does something)."""
    from flashpage import LoRARequest, SamplingParams
    from tests.conftest import cpu_llm, hf_greedy, random_prompts

    merged = merge_adapter(base, adapter, tmp_path / "merged")
    prompts = random_prompts(n_prompts, 4, 30, seed=11)
    rank = json.loads((adapter / "adapter_config.json").read_text())["r"]
    llm = cpu_llm(base, enable_lora=True, max_loras=1, max_lora_rank=rank)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert llm.engine.kv_manager.stats().blocks_used == 0
    assert got == hf_greedy(merged, prompts, 12)
    assert got != hf_greedy(base, prompts, 12)
