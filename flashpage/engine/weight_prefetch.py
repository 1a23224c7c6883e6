"""Weights into L2 while HBM idles: decode steps of few sequences.

At batch 1 a decode step is bound by reading the weights, but HBM streams them only
inside the GEMMs. Between two GEMMs run small kernels (rotary + cache write, attention
over a short context, the split merge, RMSNorm, SiLU·mul) that read a few MB and leave
HBM idle for microseconds: ~10 µs per layer around attention on the 8B shape. Here the
next projection's weights are asked into L2 during that window (o_proj is 32 MB on the
8B shape: the 50 MB L2 holds it), on a side stream so that nothing on the main stream
waits for it, and the GEMM then finds its weights in L2 instead of HBM.

Wiring: after the GEMM *before* a target projection (``_ParallelLinear.after_gemm``),
the side stream waits for the main stream, then launches ``kernels/l2_prefetch`` (a few
µs: the copy engine does the rest in the background). The side stream rejoins the main
stream at the end of the step, inside the captured graph. Only graphs of at most
``max_batch`` sequences prefetch (above that the GEMMs stop being weight-bound and a
prefetch only competes with attention for HBM).

Targets, each optionally capped in MB (``FLASHPAGE_L2_PREFETCH``, see flashpage/envs.py):
``o_proj`` after qkv_proj (during rotary + attention), ``gate_up`` after o_proj (during
the residual RMSNorm), ``down`` after gate_up_proj (during SiLU·mul), ``qkv`` (the next
layer's) after down_proj (during the next input RMSNorm).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from flashpage.kernels.l2_prefetch import can_prefetch, prefetch_l2
from flashpage.layers.linear import _ParallelLinear

logger = logging.getLogger("flashpage")

TARGETS = ("o_proj", "gate_up", "down", "qkv")


def parse_spec(spec: str) -> dict[str, int | None]:
    """"o_proj,down:8" -> {"o_proj": None, "down": 8 MiB}; "0"/"" -> {}; "1" -> o_proj."""
    spec = spec.strip()
    if spec in ("", "0"):
        return {}
    if spec == "1":
        return {"o_proj": None}
    out: dict[str, int | None] = {}
    for item in spec.split(","):
        name, _, mb = item.strip().partition(":")
        if name not in TARGETS:
            raise ValueError(f"FLASHPAGE_L2_PREFETCH: unknown target {name!r} "
                             f"(one of {', '.join(TARGETS)}, each optionally ':MB')")
        try:
            out[name] = int(float(mb) * 2**20) if mb else None
        except ValueError:
            raise ValueError(f"FLASHPAGE_L2_PREFETCH: {item!r}: the cap after ':' must be "
                             "a number of MB") from None
    return out


class WeightPrefetcher:
    """Issues the prefetches while ``active`` (a decode-graph capture of few sequences)."""

    def __init__(self, device: torch.device, max_batch: int) -> None:
        self.device = device
        self.max_batch = max_batch
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.active = False
        self.issued = 0  # prefetch launches in the last active forward
        self._forked = False

    def prefetch(self, weight: torch.Tensor, max_bytes: int | None) -> None:
        if not self.active or self.stream is None:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if prefetch_l2(weight, max_bytes):
                self.issued += 1
        self._forked = True

    @contextlib.contextmanager
    def step(self, batch: int) -> Iterator[None]:
        """Around one forward (eager warm-up or graph capture) of ``batch`` sequences: on
        if the batch is small enough; the side stream rejoins before the block ends."""
        self.active = batch <= self.max_batch
        self.issued = 0
        try:
            yield
        finally:
            if self._forked:
                torch.cuda.current_stream(self.device).wait_stream(self.stream)  # type: ignore[arg-type]
                self._forked = False
            self.active = False


def _pairs(model: nn.Module, targets: dict[str, int | None]
           ) -> list[tuple[_ParallelLinear, torch.Tensor, int | None]]:
    """(linear whose GEMM comes first, weight to prefetch after it, byte cap)."""
    inner = getattr(model, "model", model)
    layers = list(getattr(inner, "layers", []))
    out: list[tuple[_ParallelLinear, torch.Tensor, int | None]] = []

    def proj(layer: nn.Module, part: str, name: str) -> _ParallelLinear | None:
        mod = getattr(getattr(layer, part, None), name, None)
        return mod if isinstance(mod, _ParallelLinear) else None

    for i, layer in enumerate(layers):
        qkv, o = proj(layer, "self_attn", "qkv_proj"), proj(layer, "self_attn", "o_proj")
        gate_up, down = proj(layer, "mlp", "gate_up_proj"), proj(layer, "mlp", "down_proj")
        nxt = proj(layers[i + 1], "self_attn", "qkv_proj") if i + 1 < len(layers) else None
        for name, before, target in (("o_proj", qkv, o), ("gate_up", o, gate_up),
                                     ("down", gate_up, down), ("qkv", down, nxt)):
            if name in targets and before is not None and target is not None:
                out.append((before, target.weight, targets[name]))
    return out


def attach(model: nn.Module, spec: str, max_batch: int, device: torch.device
           ) -> WeightPrefetcher | None:
    """Wire prefetches into ``model``'s linears per ``spec``; None when nothing applies
    (spec off, no CUDA Hopper device, or a model without these projections)."""
    targets = parse_spec(spec)
    if not targets or not can_prefetch(device):
        return None
    prefetcher = WeightPrefetcher(device, max_batch)
    pairs = _pairs(model, targets)
    if not pairs:
        return None
    for before, weight, cap in pairs:
        before.after_gemm = partial(prefetcher.prefetch, weight, cap)
    logger.info("L2 weight prefetch in decode graphs of <= %d sequences: %s (%d linears)",
                max_batch, ", ".join(targets), len(pairs))
    return prefetcher


def detach(model: nn.Module) -> None:
    for mod in model.modules():
        if isinstance(mod, _ParallelLinear):
            mod.after_gemm = None


__all__ = ["TARGETS", "WeightPrefetcher", "attach", "detach", "parse_spec"]
