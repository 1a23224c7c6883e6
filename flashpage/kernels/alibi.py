"""ALiBi (Press et al., "Train Short, Test Long"): a per-head linear position bias in place
of rotary, shared by the paged prefill and decode kernels and their references.

Query head h's score of key position j from query position i gains ``slopes[h] * (j - i)``
after sm_scale (and after a softcap, where a model had both): 0 on the diagonal, more
negative with distance. transformers' Bloom and Falcon add ``slopes[h] * j`` and MPT
``slopes[h] * (j - (L - 1))`` instead; each differs from ``(j - i)`` by a constant per
query row, which the softmax cancels, and ``(j - i)`` keeps the biases small near the
scores that matter (no large positive bias at long positions). ``slopes`` is an fp32 tensor
[Hq] on the query's device (layers/alibi.py makes it per family); the kernels scale it by
log2(e) for their base-2 softmax.
"""

from __future__ import annotations

import torch


def check_alibi(slopes: torch.Tensor | None, num_q_heads: int, device: torch.device) -> None:
    """A kernel's ``alibi_slopes`` argument: None, or fp32 [num_q_heads] contiguous on ``device``."""
    if slopes is None:
        return
    if (not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32
            or tuple(slopes.shape) != (num_q_heads,) or slopes.stride(0) != 1):
        raise ValueError(f"alibi_slopes must be a contiguous fp32 tensor [num_q_heads="
                         f"{num_q_heads}], got {getattr(slopes, 'dtype', type(slopes))} "
                         f"{tuple(getattr(slopes, 'shape', ()))}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on {slopes.device}, q on {device}")


def alibi_ref(scores: torch.Tensor, slopes: torch.Tensor | None, qpos: torch.Tensor | int,
              kpos: torch.Tensor) -> torch.Tensor:
    """``scores`` [Hq, ..., Lk] (fp32, after the scale) plus slopes[h] * (kpos - qpos), the
    positions broadcast over the trailing dims (qpos [Lq, 1], kpos [1, Lk] for a prefill's
    [Hq, Lq, Lk]; a scalar qpos and kpos [Lk] for a decode's [Hq, Lk])."""
    if slopes is None:
        return scores
    dist = (kpos - qpos).to(torch.float32)
    shape = (-1,) + (1,) * (scores.dim() - 1)
    return scores + slopes.to(scores.device, torch.float32).view(shape) * dist
