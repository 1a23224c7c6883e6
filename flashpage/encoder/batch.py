"""An encoder batch: which waiting prompts go together, their padded inputs, their pooling.

Everything per token is a numpy or torch op over the whole batch, never a Python loop: a
batch of 128 prompts of 128 tokens is one ``np.concatenate`` and one masked store on the
host, ONE host-to-device copy (pinned, non-blocking: the host goes on while it lands), and
masks and positions made on the device from the lengths::

    packed [B, W + 1] int64 (pinned)      ids padded with pad_token_id | the prompt's length
      (a BERT pair adds W token-type columns before the length: [B, 2W + 1])
    -> device: ids [B, W], types [B, W], positions [B, W], valid [B, W] bool or None

``valid`` is None when every prompt has the batch's length (no padding): the model then
runs SDPA without a mask (CUDA: the flash kernel), and pooling needs no mask either.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# The batch is picked from this many budgets' worth of tokens at the head of the queue
# (see pick): enough to find prompts of like length, few enough that no request is passed
# over for long.
LOOKAHEAD = 4


def pick(lengths: Sequence[int], budget: int, seats: int) -> list[int]:
    """Which of the first waiting requests (``lengths``, in queue order, all of one priority)
    run together: the first (so nobody waits longer than in a plain queue), then the others
    nearest its length (ties: queue order) while the padded batch (requests x longest)
    fits ``budget`` tokens and ``seats`` requests. Indices, ascending (the batch keeps queue
    order). Padding a batch of like lengths wastes little; a queue of equal lengths gives the
    plain queue-order batch."""
    head = lengths[0]
    fit = max(1, min(seats, budget // head, len(lengths)))
    if all(lengths[i] == head for i in range(fit)):  # as many as fit, all of its length
        return list(range(fit))
    order = sorted(range(len(lengths)), key=lambda i: abs(lengths[i] - head))
    chosen: list[int] = []
    width = 0
    for i in order:
        w = max(width, lengths[i])
        if chosen and (w * (len(chosen) + 1) > budget or len(chosen) >= seats):
            break
        chosen.append(i)
        width = w
    return sorted(chosen)


def window(lengths: Iterable[int], budget: int, seats: int) -> list[int]:
    """The lengths ``pick`` chooses from: the head of the queue's, up to LOOKAHEAD budgets'
    worth of tokens (and seats), at least one. Stops reading ``lengths`` there."""
    out: list[int] = []
    tokens, limit, most = 0, LOOKAHEAD * budget, LOOKAHEAD * seats
    for length in lengths:
        if out and (tokens + length > limit or len(out) >= most):
            break
        tokens += length
        out.append(length)
    return out


@dataclass
class Inputs:
    """One forward's inputs on the device (shapes: module docstring)."""

    ids: torch.Tensor
    types: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None


@dataclass
class HostBatch:
    packed: torch.Tensor  # [B, W + 1] or [B, 2W + 1] int64, pinned when the device is CUDA
    width: int  # W
    padded: bool  # some prompt is shorter than W
    has_types: bool


def pack(prompts: Sequence[np.ndarray], pad_id: int, sep_id: int | None,
         pairs: Sequence[bool], pin: bool) -> HostBatch:
    """The host half: int64 id arrays -> ``packed`` (module docstring), pinned if ``pin``.
    ``pairs``: the rows that are a BERT pair (a cross-encoder's score request), whose
    second text is token type 1 from just after its first ``sep_id``."""
    lens = np.fromiter((len(p) for p in prompts), np.int64, len(prompts))
    b, w = len(prompts), int(lens.max())
    has_types = sep_id is not None and any(pairs)
    packed = torch.empty((b, 2 * w + 1 if has_types else w + 1), dtype=torch.int64, pin_memory=pin)
    out = packed.numpy()
    flat = np.concatenate(prompts)
    padded = int(lens.min()) < w
    valid = np.arange(w) < lens[:, None]
    if padded:
        out[:, :w] = pad_id
        out[:, :w][valid] = flat
    else:
        out[:, :w] = flat.reshape(b, w)
    if has_types:
        is_sep = (out[:, :w] == sep_id) & valid
        after = np.cumsum(is_sep, axis=1) - is_sep  # separators strictly before each column
        out[:, w: 2 * w] = (after > 0) & valid & np.asarray(pairs, dtype=bool)[:, None]
    out[:, -1] = lens
    return HostBatch(packed, w, padded, has_types)


def to_device(batch: HostBatch, device: torch.device, pad_id: int, roberta: bool) -> Inputs:
    """The device half: one copy of ``packed``, then types, positions and the valid mask
    made there (BERT: positions from 0; RoBERTa: HF's, counting non-pad tokens after
    padding_idx)."""
    dev = batch.packed.to(device, non_blocking=True)
    w = batch.width
    ids, lens = dev[:, :w], dev[:, -1]
    types = dev[:, w: 2 * w] if batch.has_types else torch.zeros_like(ids)
    arange = torch.arange(w, device=device)
    valid = arange[None, :] < lens[:, None] if batch.padded else None
    if roberta:
        real = ids != pad_id
        if valid is not None:
            real &= valid
        positions = torch.cumsum(real, 1) * real + pad_id
    else:
        positions = arange.expand(ids.shape[0], w)
    return Inputs(ids, types, positions, valid)


def pool(hidden: torch.Tensor, valid: torch.Tensor | None, kind: str) -> torch.Tensor:
    """[B, T, hidden] states and [B, T] valid mask (None: no padding) -> [B, hidden] fp32
    vectors, each prompt's own rows pooled as PoolingState pools them: mean (summed in fp32),
    cls (row 0), last."""
    if kind == "cls":
        return hidden[:, 0].float()
    if valid is None:
        return hidden[:, -1].float() if kind == "last" else hidden.float().mean(1)
    lens = valid.sum(1)
    if kind == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lens - 1].float()
    return (hidden.float() * valid[..., None]).sum(1) / lens[:, None]


def cut_and_normalize(pooled: torch.Tensor, dims: Sequence[int | None],
                      normalize: Sequence[bool]) -> torch.Tensor:
    """Each row's PoolingParams on the device, for the whole batch: the values past its
    ``dimensions`` zeroed (the host keeps only its first ``dimensions``), then L2-normalized
    where asked (the zeros do not count in the norm). [B, hidden] -> [B, hidden]."""
    if all(d is None for d in dims) and all(normalize):  # the usual case
        return torch.nn.functional.normalize(pooled, dim=1)
    hidden, dev, pin = pooled.shape[1], pooled.device, pooled.is_cuda  # pinned: no stream sync
    keep = torch.tensor([d or hidden for d in dims], pin_memory=pin).to(dev, non_blocking=True)
    cut = pooled * (torch.arange(hidden, device=dev)[None, :] < keep[:, None])
    unit = torch.nn.functional.normalize(cut, dim=1)
    wants = torch.tensor(list(normalize), pin_memory=pin).to(dev, non_blocking=True)
    return torch.where(wants[:, None], unit, cut)
