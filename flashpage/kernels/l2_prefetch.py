"""Bring a tensor's bytes into the GPU's L2 cache, fire and forget (Hopper and newer).

Hopper's bulk-copy (TMA) unit takes ``cp.async.bulk.prefetch.L2.global [addr], size``: one
instruction asks for ``size`` bytes (a multiple of 16, from a 16-byte aligned address) to
be fetched into L2, and the issuing thread moves on at once. The kernel issues one such
instruction per ``CHUNK`` bytes from a handful of programs and exits in a few
microseconds, while the copy engine streams the bytes in the background: it holds no SM
while HBM works, so it can run beside other kernels without taking their place.

A prefetch is a hint. Nothing reads its result, nothing depends on it for correctness,
and the hardware may drop it; what it changes is where a later read finds the bytes.
Imports nothing from the engine.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

CHUNK = 64 * 1024  # bytes per prefetch instruction
BLOCK = 128  # instructions per program (one per thread of 4 warps)
# (Few programs funnel every request through a few SMs' copy engines: the H200 run of
# 2026-11-30 saw ~1 TB/s that way. FLASHPAGE_L2_PREFETCH_GRID="CHUNK_KB:LANES" spreads
# them over more programs, for the benchmark's sweep.)


@triton.jit
def _l2_prefetch_kernel(base, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = idx.to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - start, CHUNK)
    # lanes past the end carry a zero predicate and issue nothing
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; } // $0",
        "=r,l,r,r",
        [base + start, size.to(tl.int32), (size > 0).to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


def can_prefetch(device: torch.device) -> bool:
    """True on a CUDA device of capability 9.0 or newer outside the Triton interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _grid_setting() -> tuple[int, int]:
    text = os.environ.get("FLASHPAGE_L2_PREFETCH_GRID", "")
    if not text:
        return CHUNK, BLOCK
    kb, _, lanes = text.partition(":")
    return int(kb) * 1024, int(lanes or BLOCK)


def prefetch_l2(t: torch.Tensor, max_bytes: int | None = None, chunk: int | None = None,
                lanes: int | None = None) -> int:
    """Ask for the first ``max_bytes`` (default: all) of contiguous tensor ``t`` in L2.

    Returns the bytes asked for: 0 where the device cannot (CPU, interpreter, pre-Hopper).
    Launches on the current stream and never waits for the bytes to arrive."""
    if not can_prefetch(t.device):
        return 0
    if not t.is_contiguous():
        raise ValueError("prefetch_l2 needs a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max_bytes)
    nbytes -= nbytes % 16
    if nbytes <= 0 or t.data_ptr() % 16:
        return 0
    env_chunk, env_lanes = _grid_setting()
    chunk, lanes = chunk or env_chunk, lanes or env_lanes
    if chunk % 16 or lanes & (lanes - 1):
        raise ValueError(f"chunk must be a multiple of 16 and lanes a power of two: {chunk}, {lanes}")
    grid = (triton.cdiv(nbytes, chunk * lanes),)
    _l2_prefetch_kernel[grid](t.data_ptr(), nbytes, CHUNK=chunk, BLOCK=lanes,
                              num_warps=max(1, min(4, lanes // 32)))
    return nbytes


__all__ = ["CHUNK", "can_prefetch", "prefetch_l2"]
