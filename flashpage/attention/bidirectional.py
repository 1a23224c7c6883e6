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

Plain PyTorch: the step's image runs at once, planned once a step per window (``_plan``, on
the device, kept in the metadata's ``extra``: each run's key slots, padded to the longest, and
the mask),
then per layer one gather of K and V and one masked SDPA call over [runs, Hq, rows, keys];
with a softcap or sinks (no image model has them yet) run by run in fp32
(attention/torch_native.masked_attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    for seq, _, _, _, img_lo, img_hi in md.bidirectional:
        if img_hi > md.seq_lens_cpu[seq]:
            raise RuntimeError(f"an image's positions [{img_lo}, {img_hi}) end past the step's "
                               f"context ({md.seq_lens_cpu[seq]}): the scheduler must not cut it")
    if softcap is None and sinks is None:
        _attend_batched(out, q, key_cache, value_cache, _plan(md, sliding_window, key_cache.shape[1], q.device),
                        scale)
        return
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


def _plan(md: AttentionMetadata, window: int | None, block_size: int,
          device: torch.device) -> tuple[torch.Tensor, ...]:
    """The step's image runs as one batch, once a step per window (kept in ``md.extra``):
    (key slots [B * L] in the paged cache, keys [max(k_lo), img_hi) of each run padded to the
    longest L; mask [B, 1, T, L] (T: the most rows a run has; a padded query row sees its
    run's first key, so no row of the softmax is empty); the runs' query rows [B, T] in the
    step (padding repeats a run's first row); the real ones' flat indices in [B * T] and
    their rows in the step)."""
    key = f"bidirectional:{window}"
    plan = md.extra.get(key)
    if plan is not None:
        return plan
    # the sizes from the host list; the tensors built on the device (on the host, the
    # [B, T, L] mask's few ops took ~10 ms a plan at 26 images of 256 rows, run 242)
    k_lo_h = [0 if window is None else max(0, r[3] - window + 1) for r in md.bidirectional]
    L = max(r[5] - lo for r, lo in zip(md.bidirectional, k_lo_h, strict=True))
    T = max(r[2] for r in md.bidirectional)
    runs = torch.tensor([r for r in md.bidirectional], dtype=torch.long)  # [B, 6]
    # the real query rows: flat indices into the padded [B * T] and their rows in the step
    # (from the host: a boolean index on the device would wait for it, every layer)
    real = torch.tensor([(b * T + i, r[1] + i) for b, r in enumerate(md.bidirectional) for i in range(r[2])],
                        dtype=torch.long).T.contiguous()  # [2, rows]
    if device.type == "cuda":  # pinned: a pageable copy would wait for the queued work first
        runs = runs.pin_memory().to(device, non_blocking=True)
        real = real.pin_memory().to(device, non_blocking=True)
    else:
        runs, real = runs.to(device), real.to(device)
    seq, row, rows, pos, lo, hi = runs.unbind(1)
    k_lo = torch.zeros_like(pos) if window is None else (pos - window + 1).clamp_min(0)
    j = torch.arange(L, device=device)
    kpos = k_lo[:, None] + j  # [B, L]
    kvalid = kpos < hi[:, None]
    kpos = torch.minimum(kpos, hi[:, None] - 1)
    i = torch.arange(T, device=device)
    qpos = pos[:, None] + i  # [B, T]
    qvalid = i[None, :] < rows[:, None]
    seen = (kpos[:, None, :] <= qpos[:, :, None]) | ((kpos >= lo[:, None]) & (kpos < hi[:, None]))[:, None, :]
    if window is not None:
        seen &= kpos[:, None, :] > qpos[:, :, None] - window
    mask = (seen & kvalid[:, None, :]) | (~qvalid[:, :, None] & (j == 0)[None, None, :])
    tables = md.block_tables.index_select(0, seq.to(md.block_tables.device))  # [B, max blocks]
    kpos_d = kpos.to(tables.device)
    slots = tables.gather(1, kpos_d // block_size).long() * block_size + kpos_d % block_size
    qrows = torch.where(qvalid, row[:, None] + i, row[:, None])
    plan = (slots.reshape(-1).to(device), mask[:, None], qrows, real[0], real[1])
    md.extra[key] = plan
    return plan


def _attend_batched(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    plan: tuple[torch.Tensor, ...], scale: float) -> None:
    """Every image run's rows of ``out`` recomputed at once (``_plan``): one gather of K and
    V, one SDPA call (its masked kernels accumulate in fp32)."""
    slots, mask, qrows, src, dst = plan
    B, T = qrows.shape
    hkv, d = key_cache.shape[-2], key_cache.shape[-1]
    hq = q.shape[1]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        src = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
        x = src.flatten(0, 1).index_select(0, slots)
        x = x.view(cache.dtype) if x.dtype != cache.dtype else x
        # [B, Hq, L, D]: each KV head repeated for its query heads
        return x.to(q.dtype).view(B, -1, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)

    qq = q[qrows].transpose(1, 2)  # [B, Hq, T, D]
    o = F.scaled_dot_product_attention(qq, gather(key_cache), gather(value_cache), attn_mask=mask, scale=scale)
    out.index_copy_(0, dst, o.transpose(1, 2).reshape(B * T, hq, d).index_select(0, src).to(out.dtype))
