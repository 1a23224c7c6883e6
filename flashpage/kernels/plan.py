"""Plan once, run per layer (FlashInfer's plan / run split).

The attention kernels' Python wrappers check every argument, pick a kernel, a tile config,
a split count, a grid and scratch buffers, and make TMA descriptors: ~100-250 us of host
time a call on an H200 host (run 134: cProfile of an 8B mixed step, 0.69 ms a layer for
the decode and prefill calls under the profiler). The layers of one step make the same call
but for their own q, caches and out, so a plan makes those choices once (over the step's
block tables and lengths) and ``run`` only launches; the engine's piecewise and eager steps
plan once per step (attention/triton.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# launch(q, key_cache, value_cache, out) -> anything (the prefill's lse, or None); a plan
# made with attention sinks launches as launch(q, key_cache, value_cache, out, sinks): each
# layer has its own (kernels/sinks.py), so they are a launch's argument, not the plan's
Launch = Callable[..., object]


def geometry(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             out: torch.Tensor | None) -> tuple:
    """What a plan counts on being the same from call to call: shapes, strides, dtypes, device."""
    return (q.shape, q.stride(), q.dtype, q.device, key_cache.shape, key_cache.stride(), key_cache.dtype,
            value_cache.shape, value_cache.stride(), value_cache.dtype,
            None if out is None else (out.shape, out.stride(), out.dtype, out.device))


class LaunchPlan:
    """A planned call: ``launch`` for tensors of ``geometry``; ``out_dim`` the output's head
    dimension (the value cache's)."""

    name = "plan"

    def __init__(self, launch: Launch, q: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, out: torch.Tensor | None) -> None:
        self._launch = launch
        self.geometry = geometry(q, key_cache, value_cache, out)
        self.out_dim = value_cache.shape[-1]

    def fits(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             out: torch.Tensor | None = None) -> bool:
        """Whether ``run`` takes these tensors (else plan again)."""
        return geometry(q, key_cache, value_cache, out) == self.geometry

    def run(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            out: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The planned call on these tensors -> out [q rows, Hq, out_dim] in q's dtype."""
        if not self.fits(q, key_cache, value_cache, out):
            raise ValueError(f"{self.name}.run: q, the caches or out differ in shape, strides, "
                             "dtype or device from the planned call")
        if out is None:
            out = q.new_empty(*q.shape[:2], self.out_dim)
        self.launch(q, key_cache, value_cache, out, sinks)
        return out

    def launch(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               out: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        """``run`` without its check, for a caller that has just asked ``fits``. ``sinks``:
        this call's (a plan made with sinks needs them; one made without takes none)."""
        if q.shape[0]:
            if sinks is None:
                self._launch(q, key_cache, value_cache, out)
            else:
                self._launch(q, key_cache, value_cache, out, sinks)


def planned(plans: dict, key: object, make: Callable[[], LaunchPlan], q: torch.Tensor,
            key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
            sinks: torch.Tensor | None = None) -> None:
    """Launch ``plans[key]`` on these tensors, planned first (``make()``) where it is missing
    or was planned for another geometry. Plans made during a CUDA-graph capture and outside
    one are kept apart: a plan's scratch (the decode's split buffers) must come from the
    graph's own pool to live as long as the graph (a capture's warm-up run plans first)."""
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        key = (key, "captured")
    plan = plans.get(key)
    if plan is None or not plan.fits(q, key_cache, value_cache, out):
        plan = plans[key] = make()
    plan.launch(q, key_cache, value_cache, out, sinks)
