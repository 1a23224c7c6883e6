"""Programmatic dependent launch (PDL) for the decode-path kernels (Hopper and newer).

In a stream (or a CUDA graph) a kernel normally starts only once the kernel before it
has finished: at batch 1 a decode step is ~290 small kernels, each paying its whole
launch latency. A kernel launched with PDL (``launch_pdl=True``, which sets
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) may be scheduled while the one
before it still runs, once every program of that one has executed
``griddepcontrol.launch_dependents`` (or exited). So its launch and prologue overlap the
previous kernel's tail.

The rule that keeps it correct: a PDL kernel executes ``griddepcontrol.wait``
(``gdc_wait``, which returns once the previous grid has completed and its memory is
visible) before touching any global memory a previous kernel may write *or read*. Reads
after writes are the obvious hazard; writes after reads are the other one (the graph's
memory pool hands a buffer the previous kernel still reads to the next one as its
output). So our kernels wait at the start, and only then let their own dependents
launch (``pdl_prologue``). The wait is transitive: a kernel that waited completes only
after the kernel it waited on did.

Before the wait a kernel may *load* what no kernel of the step writes, and that is where
PDL pays most: weights and norm weights, the cos/sin table, and the step's inputs
(positions, slot mapping, sequence lengths, block tables: copied in before the step's
first kernel, which is never a PDL launch, so complete before any of ours can start).
``gemv_row`` requests its weight rows there, RMSNorm its weight, rotary its positions,
cos/sin and slots, paged decode its sequence length and first block ids: the DRAM round
trip then overlaps the previous kernel instead of following it. Never a store.

Both are inline PTX: the interpreter (TRITON_INTERPRET=1) cannot run them, and the
kernels compile them only under their ``PDL`` constexpr, which launchers set from
``pdl_enabled`` (or an explicit ``pdl=`` argument, honoured only where PDL exists).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flashpage import envs

_CAPABILITY_MAJOR: dict[int, int] = {}


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with PDL: an NVIDIA GPU of compute
    capability 9 or newer, not the Triton interpreter."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    major = _CAPABILITY_MAJOR.get(idx)
    if major is None:
        major = _CAPABILITY_MAJOR[idx] = torch.cuda.get_device_capability(idx)[0]
    return major >= 9


def pdl_enabled(device: torch.device, in_auto: bool = True) -> bool:
    """PDL for a kernel on ``device`` per FLASHPAGE_PDL (read at every call, so a benchmark
    may flip it between runs): "all" every kernel, "auto" (the default) those that call
    with ``in_auto`` (the ones that did not time slower with it), "0" none; and only where
    ``pdl_supported``."""
    mode = envs.pdl()
    return (mode == "all" or (mode == "auto" and in_auto)) and pdl_supported(device)


def resolve_pdl(pdl: bool | None, device: torch.device, in_auto: bool = True) -> bool:
    """A launcher's ``pdl`` argument: None decides from the device and FLASHPAGE_PDL;
    True asks for PDL regardless of the variable, but only where it is supported."""
    if pdl is None:
        return pdl_enabled(device, in_auto)
    return bool(pdl) and pdl_supported(device)


def pdl_launch_kwargs(pdl: bool) -> dict[str, bool]:
    """The launch keyword to pass beside ``PDL=pdl``: ``{"launch_pdl": True}`` or ``{}``."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Call first in a kernel: with PDL, wait for the previous grid, then let the next
    grid launch (its programs wait in turn before touching memory)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
