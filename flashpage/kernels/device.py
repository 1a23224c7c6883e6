"""What the Gluon kernels' ``*_unsupported`` checks ask of the device (imports no engine code)."""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, read once per device index (a launch path's checks
    ask on every call; torch's lookup costs a few us each)."""
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """A CUDA device's multiprocessor count, read once per device index (torch's
    get_device_properties cost ~12 us a call on the H200 hosts, twice a layer in a mixed step)."""
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)


def interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def sm90_reasons(t: torch.Tensor, capability: tuple[int, int] | None = None) -> list[str]:
    """[] if ``t``'s device is a Hopper (sm_90) GPU and the interpreter is off, else the reason.
    ``capability``: the device's compute capability (None: read from t's device; a CPU tensor
    or the interpreter count as none)."""
    if capability is None:
        capability = ((0, 0) if t.device.type != "cuda" or interpreting()
                      else cuda_capability(t.device))
    return [] if capability[0] == 9 else ["needs a Hopper (sm_90) GPU, not the interpreter"]
