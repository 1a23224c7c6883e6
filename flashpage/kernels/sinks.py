"""Attention sinks (GPT-OSS): a learned logit per query head that joins each query's
softmax denominator and adds no value, shared by the paged prefill and decode kernels,
their references and the torch_native backend.

Query head h's weights become ``exp(s_j) / (exp(sink[h]) + sum_j' exp(s_j'))``: the sink is
one more "key" with score ``sink[h]`` (taken as it is: no scale, softcap or bias) whose
value is zero, so the weights of the real keys sum to less than one. A query that sees no
key gets a zero output. ``sinks`` is an fp32 tensor [Hq] on the query's device (one per
layer, a parameter: its address stays fixed for CUDA graphs); the kernels fold it into
their online-softmax state once, after the key loop (in base 2: times log2(e)), and a
split decode only in its split 0, so that the merge counts it once.
"""

from __future__ import annotations

import torch


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int, device: torch.device) -> None:
    """A kernel's ``sinks`` argument: None, or fp32 [num_q_heads] contiguous on ``device``."""
    if sinks is None:
        return
    if (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32
            or tuple(sinks.shape) != (num_q_heads,) or sinks.stride(0) != 1):
        raise ValueError(f"sinks must be a contiguous fp32 tensor [num_q_heads={num_q_heads}], "
                         f"got {getattr(sinks, 'dtype', type(sinks))} "
                         f"{tuple(getattr(sinks, 'shape', ()))}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device}, q on {device}")


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of ``scores`` [Hq, ..., Lk] (fp32, masked keys -inf) with
    sinks[h] in head h's denominator (None: the plain softmax). ``sinks`` [Hq], or already
    shaped to broadcast against ``scores[..., :1]`` (e.g. [Hkv, G, 1, 1] for grouped
    scores [Hkv, G, Lq, Lk]). A row of only -inf scores gets weights 0 with sinks (NaN
    without, as torch's softmax)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.to(scores.device, torch.float32)
    if sink.dim() == 1:
        sink = sink.view((-1,) + (1,) * (scores.dim() - 1))
    sink = sink.expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def sinks_lse(lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The log of a softmax denominator ``lse`` [Hq, ...] (natural log, -inf: no key) with
    head h's sink added: logaddexp(lse, sinks[h])."""
    if sinks is None:
        return lse
    sink = sinks.to(lse.device, torch.float32).view((-1,) + (1,) * (lse.dim() - 1))
    return torch.logaddexp(lse, sink.expand_as(lse))
