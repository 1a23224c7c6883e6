"""Attention backends by name, imported lazily, and the choice among them.

A forced backend (argument or FLASHPAGE_ATTENTION_BACKEND) that cannot run stops with
its reasons; it never silently falls back. The default is the fastest backend that can
run this model here: ours (``triton``) on CUDA, ``torch_native`` elsewhere. ``flex``
(PyTorch's FlexAttention over the same paged cache) runs only when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

from flashpage import envs

if TYPE_CHECKING:
    from flashpage.attention.backend import AttentionBackend
    from flashpage.config import ModelConfig

BACKENDS: dict[str, tuple[str, str]] = {
    "torch_native": ("flashpage.attention.torch_native", "TorchNativeBackend"),
    "triton": ("flashpage.attention.triton", "TritonBackend"),
    "flex": ("flashpage.attention.flex", "FlexBackend"),  # a peer's kernel, for comparison
}
# Preference order for the default choice, by device type. On the CPU the Triton
# interpreter can run our kernels, but only when asked for: it is for tests, not speed.
PREFERENCE = {"cuda": ["triton", "torch_native"], "cpu": ["torch_native"]}


class BackendUnavailable(RuntimeError):
    """A requested attention backend cannot run this model on this device."""


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise BackendUnavailable(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def backend_reasons(name: str, config: ModelConfig, device: torch.device,
                    dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None) -> list[str]:
    """Why backend ``name`` cannot run here (empty: it can); ``kv_cache_dtype`` None: the
    model's dtype."""
    try:
        cls = backend_class(name)
    except ImportError as e:
        return [f"cannot import it: {e}"]
    return cls.unsupported_reasons(config, device, dtype, kv_cache_dtype=kv_cache_dtype or dtype)


def select_backend(requested: str | None, config: ModelConfig, device: torch.device,
                   dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None
                   ) -> tuple[type[AttentionBackend], str]:
    """The backend class to use and a sentence saying why."""
    requested = requested or envs.attention_backend()
    if requested:
        reasons = backend_reasons(requested, config, device, dtype, kv_cache_dtype)
        if reasons:
            raise BackendUnavailable(
                f"attention backend {requested!r} cannot run {config.architecture} "
                f"({config.attention_kind}) on {device.type} in {str(dtype).replace('torch.', '')}: "
                + "; ".join(reasons))
        return backend_class(requested), f"{requested} (requested)"
    skipped: list[str] = []
    for name in PREFERENCE.get(device.type, ["torch_native"]):
        reasons = backend_reasons(name, config, device, dtype, kv_cache_dtype)
        if not reasons:
            why = f"{name} (default on {device.type}"
            why += f"; skipped {', '.join(skipped)})" if skipped else ")"
            return backend_class(name), why
        skipped.append(f"{name}: {reasons[0]}")
    raise BackendUnavailable("no attention backend can run this model: " + "; ".join(skipped))


def backend_report(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                   kv_cache_dtype: torch.dtype | None = None) -> list[dict[str, object]]:
    """Every backend, whether it can run this model here and why not; the default marked."""
    try:
        default: str | None = select_backend(None, config, device, dtype, kv_cache_dtype)[0].name
    except BackendUnavailable:
        default = None
    return [{"name": name, "can_run": not reasons, "reasons": reasons, "default": name == default}
            for name in BACKENDS
            for reasons in [backend_reasons(name, config, device, dtype, kv_cache_dtype)]]
