"""Start-up timing of ``kernels/gemv.skinny_linear`` against the path a linear runs
otherwise (cuBLAS; for fp8 weights the W8A8 ``_scaled_mm`` of layers/quant.py), per
weight shape and row count: ``layers/linear.tune_skinny_gemms`` routes each layer by it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashpage.kernels.gemv import CANDIDATES, GemvConfig, skinny_linear


def pick_config(w: torch.Tensor, m: int, silu_mul: bool = False, iters: int = 20, *,
                scale: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                baseline: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[GemvConfig | None, dict[str, float]]:
    """Time cuBLAS (``baseline``, default ``F.linear``; with the SiLU·mul kernel before it
    when ``silu_mul``) against every candidate at ``m`` rows of ``dtype`` (default w's),
    each call on a cold L2 as in a real decode step. fp8 weights: ``scale`` as
    ``skinny_linear`` takes it, ``baseline`` the path the layer runs otherwise (W8A8
    ``_scaled_mm``, layers/quant.py). Returns the fastest candidate, or None when the
    baseline is as fast, and the times (us)."""
    from flashpage.kernels.silu_mul import silu_and_mul

    n, k = w.shape
    x = torch.randn(m, 2 * k if silu_mul else k, device=w.device, dtype=dtype or w.dtype)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=w.device)
    linear = baseline or (lambda a: torch.nn.functional.linear(a, w))

    def cublas() -> torch.Tensor:
        return linear(silu_and_mul(x) if silu_mul else x)

    def timed(fn) -> float:
        fn()  # compile / warm up
        ts = []
        for _ in range(iters):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) * 1e3)
        ts.sort()
        return ts[len(ts) // 2]

    times = {"cublas": timed(cublas)}
    best: GemvConfig | None = None
    for cfg in CANDIDATES:
        times[cfg.name] = timed(lambda cfg=cfg: skinny_linear(x, w, config=cfg, silu_mul=silu_mul,
                                                              scale=scale))
        if times[cfg.name] < times["cublas"] * 0.97 and (best is None or times[cfg.name] < times[best.name]):
            best = cfg
    return best, times
