"""Attention among the positions of one multimodal input, both ways (Gemma 3's images).

Gemma 3 attends bidirectionally within an image during the prefill: transformers' mask
(its token_type_ids, Gemma3Model's create_masks_for_vision_model) lets a query at position
p see key j when ``j <= p`` or both sit in the same image, and its sliding layers keep
``j > p - window`` on top of that (AND). Every backend runs the causal part; this module
runs the rest, after the backend's pass, for the image rows alone: their K/V (and every
key before them) are in the paged cache by then (the backend wrote them), and the
scheduler made the step hold each image's rows up to its end (engine/scheduler.py
chunk_tokens), so a query reads the whole image's keys. The other rows are causal and keep
the backend's output; they read the image's K/V, which the layers computed with these rows.

Plain PyTorch (fp32 scores, attention/torch_native.masked_attention): an image of T rows
costs one [Hq, T, keys] product per layer, beside the prefill's own attention.
"""

from __future__ import annotations

import torch

from flashpage.attention.backend import AttentionMetadata
from flashpage.attention.torch_native import gather_paged, masked_attention


def image_mask(q_pos: int, rows: int, k_lo: int, k_hi: int, img_lo: int, img_hi: int,
               window: int | None, device: torch.device) -> torch.Tensor:
    """[rows, k_hi - k_lo] bool: query ``q_pos + i`` (inside the image [img_lo, img_hi))
    may see key ``k_lo + j``: causal or in the image, within the window."""
    qpos = torch.arange(q_pos, q_pos + rows, device=device)[:, None]
    kpos = torch.arange(k_lo, k_hi, device=device)[None, :]
    mask = (kpos <= qpos) | ((kpos >= img_lo) & (kpos < img_hi))
    if window is not None:
        mask &= kpos > qpos - window
    return mask


def attend_within_images(out: torch.Tensor, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                         md: AttentionMetadata, *, scale: float, sliding_window: int | None,
                         softcap: float | None, sinks: torch.Tensor | None = None) -> None:
    """``out`` [N, Hq, D] (the backend's output) with each row of ``md.bidirectional``'s
    runs recomputed under the image mask, in place. q [N, Hq, D]; the step's K/V already
    in ``kv_cache``. (No ALiBi: no model with image runs has it.)"""
    key_cache, value_cache = kv_cache
    for seq, row, rows, pos, img_lo, img_hi in md.bidirectional:
        if img_hi > md.seq_lens_cpu[seq]:
            raise RuntimeError(f"an image's positions [{img_lo}, {img_hi}) end past the step's "
                               f"context ({md.seq_lens_cpu[seq]}): the scheduler must not cut it")
        k_lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        table = md.block_tables[seq]
        kk = gather_paged(key_cache, table, img_hi)[k_lo:].to(q.dtype)  # [L, Hkv, D]
        vv = gather_paged(value_cache, table, img_hi)[k_lo:].to(q.dtype)
        mask = image_mask(pos, rows, k_lo, img_hi, img_lo, img_hi, sliding_window, q.device)
        o = masked_attention(q[row:row + rows].transpose(0, 1), kk.transpose(0, 1),
                             vv.transpose(0, 1), mask, scale, softcap, sinks=sinks)
        out[row:row + rows] = o.transpose(0, 1).to(out.dtype)
