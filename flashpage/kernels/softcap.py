"""Attention logit softcapping (Gemma 2's ``attn_logit_softcapping``), shared by the
paged decode and prefill kernels: scores -> cap * tanh(scores / cap) before the softmax.

The kernels keep their scores in base 2 (s = scores * log2(e), for exp2), where the same
cap reads cap_log2 * tanh(s / cap_log2) with cap_log2 = cap * log2(e).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def softcap_log2(s, cap_log2):
    """Base-2 scores ``s`` softcapped at ``cap_log2`` (= cap * log2(e)). Triton has no tanh:
    tanh(x) = 2 / (1 + exp(-2x)) - 1 (at large -x exp overflows to inf: -1, as it should)."""
    return cap_log2 * (2.0 / (1.0 + tl.exp(-2.0 * s / cap_log2)) - 1.0)


def softcap_ref(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The torch form (natural-log scores), as transformers' Gemma 2 computes it."""
    return scores if cap is None else torch.tanh(scores / cap) * cap
