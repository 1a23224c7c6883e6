"""The model's own sampling defaults (vLLM's ``--generation-config``): a checkpoint's
``generation_config.json``, where its authors recommend how to sample (Qwen2.5: temperature
0.7, top_p 0.8, top_k 20, repetition_penalty 1.05) and list the tokens that end a turn.

``generation_config``: ``"auto"`` (the default, as vLLM's): the model folder's file, if any;
``"vllm"``: no sampling defaults (SamplingParams' own; the name is vLLM's); a folder: its
``generation_config.json``. ``override_generation_config``: values over the file's.

What is read, as vLLM reads it: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` (defaults for what a request leaves unset: ``LLM.generate`` without
SamplingParams, a server request without the field) and ``max_new_tokens`` (a server-wide cap
on max_tokens). ``eos_token_id`` (one or a list, from the model's file, "vllm" included, as
vLLM) joins the engine's end-of-sequence tokens: Llama-3-Instruct's first checkpoints end
their turns with ``<|eot_id|>``, named only there.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from flashpage.config import ConfigError

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_KEYS = (*SAMPLING_KEYS, "max_new_tokens")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, float | int] = field(default_factory=dict)  # the SAMPLING_KEYS given
    max_tokens: int | None = None  # max_new_tokens: every request's cap
    eos_token_ids: tuple[int, ...] = ()
    source: str | None = None  # the file read (None: none)

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments for a request that sets nothing."""
        kw: dict[str, Any] = dict(self.sampling)
        if self.max_tokens is not None:
            kw["max_tokens"] = self.max_tokens
        return kw


def load_generation_defaults(setting: str, model_dir: str | None,
                             overrides: dict[str, Any] | None = None) -> GenerationDefaults:
    """The defaults ``setting`` names (module docstring); a ConfigError names a file or value
    that cannot be used."""
    if not isinstance(setting, str) or not setting:
        raise ConfigError(f"generation_config must be 'auto', 'vllm' or a folder, got {setting!r}")
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError(f"override_generation_config must be a JSON object, got {overrides!r}")
    raw: dict[str, Any] = {}
    path = None
    folder = model_dir if setting in ("auto", "vllm") else setting
    if setting not in ("auto", "vllm") and not os.path.isdir(setting):
        raise ConfigError(f"generation_config {setting!r} is not a folder (or 'auto' / 'vllm')")
    if folder is not None and os.path.isfile(os.path.join(folder, "generation_config.json")):
        path = os.path.join(folder, "generation_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
    # "vllm" too: the model's own end-of-turn tokens stay (unless overridden)
    eos = (overrides or {}).get("eos_token_id", raw.get("eos_token_id"))
    if setting == "vllm":
        raw = {}
    raw = {**raw, **(overrides or {})}
    where = (path if setting != "vllm" else None) or "override_generation_config"
    if overrides and where != "override_generation_config":
        where += " (with override_generation_config)"
    values: dict[str, Any] = {}
    for key in _KEYS:
        v = raw.get(key)
        if v is None:
            continue
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        if key in ("top_k", "max_new_tokens"):
            ok = ok and float(v).is_integer()
            v = int(v) if ok else v
        if not ok:
            raise ConfigError(f"{where}: {key} must be a number, got {v!r}")
        values[key] = v
    eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in eos_ids):
        raise ConfigError(f"{where}: eos_token_id must be token ids, got {eos!r}")
    max_tokens = values.pop("max_new_tokens", None)
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"{where}: max_new_tokens must be >= 1, got {max_tokens}")
    defaults = GenerationDefaults(values, max_tokens, eos_ids, path)
    from flashpage.sampling_params import SamplingParams

    try:  # a value no request could run with is the file's mistake, said once, now
        SamplingParams(**defaults.sampling_kwargs())
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    return defaults
