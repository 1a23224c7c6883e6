"""M-RoPE positions (Qwen2-VL): a prompt's 3-D (t, h, w) positions and what each step takes.

Text tokens have three equal components (M-RoPE is then 1-D rope at that position); an
image's rows, a grid (t, h, w) of merged patches in row-major order, start at the position
``p`` the next text token would have had and take ``(p + t_i, p + h_i, p + w_i)``; the text
after it continues from the image's largest component + 1 (``p + max(t, h, w)``), so an
image of n rows moves every later position by ``max(t, h, w) - n`` (<= 0). A video is such a
grid with t > 1 (one step per temporal patch of frames); Qwen2.5-VL's temporal component is
``int(t_i x time_step)`` (time_step = tokens_per_second x temporal_patch_size / fps,
transformers' second_per_grid_ts scaling, in fp32 as transformers computes it), and the text
after it continues from the largest component + 1 as for an image (the rule of Qwen's release,
vLLM's and transformers' through 5.2; transformers 5.24 continues from ``p + max(h, w)``
instead, which differs only where a video's temporal extent exceeds its height and width:
there it gives text positions the video's rows already hold, and a first decode position that
does not follow the prompt's last). Past the prompt,
token i's position is ``i + delta`` (delta: the prompt's last position + 1 - its length),
its three components equal: decode steps carry 1-D positions, as any model's (the CUDA
graphs' position buffer among them).

A request with images keeps its prompt's positions ([3, prompt length] int64, on the host)
and its delta (``prompt_positions``, at admission). Each step the model runner asks
``step_positions`` for the tokens it schedules, any chunk of the prompt (chunked prefill, a
prefix-cache hit's first uncached token, a preempted request's recompute): 1-D positions
where the chunk's three components agree, else the chunk's [3, n]; a step holding any 3-D
column gives the model positions [3, num_tokens] (layers/rotary.MRotaryEmbedding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from flashpage.engine.multimodal import MultiModalInput


def prompt_positions(num_tokens: int, inputs: list[MultiModalInput]) -> tuple[np.ndarray, int]:
    """A prompt's 3-D positions int64 [3, num_tokens] and its delta (module docstring),
    ``inputs`` giving each image's or video's offset and grid (its length t x h x w)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cur = 0  # the next position
    at = 0  # the next token
    for mi in sorted(inputs, key=lambda m: m.offset):
        assert mi.grid is not None, "an M-RoPE input without its grid"
        t, h, w = mi.grid
        if t * h * w != mi.length:
            raise ValueError(f"an image's grid {mi.grid} holds {t * h * w} rows, its positions {mi.length}")
        n_text = mi.offset - at
        out[:, at:mi.offset] = np.arange(cur, cur + n_text)
        cur += n_text
        ts = np.arange(t)
        if mi.time_step is not None:  # fp32, truncated: transformers' (arange(t) * interval).long()
            ts = (ts.astype(np.float32) * np.float32(mi.time_step)).astype(np.int64)
        tt, hh, ww = np.meshgrid(ts, np.arange(h), np.arange(w), indexing="ij")
        out[:, mi.offset:mi.offset + mi.length] = cur + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        cur += max(int(ts[-1]), h - 1, w - 1) + 1
        at = mi.offset + mi.length
    out[:, at:] = np.arange(cur, cur + num_tokens - at)
    cur += num_tokens - at
    return out, cur - num_tokens


def step_positions(prompt: np.ndarray, delta: int, start: int, end: int
                   ) -> tuple[np.ndarray, np.ndarray | None]:
    """Positions ``[start, end)`` of a request whose prompt's 3-D positions are ``prompt``
    [3, P]: (1-D int64 [n], the component every text token has; [3, n] where the range holds
    an image's 3-D positions, else None)."""
    p = prompt.shape[1]
    if start >= p:
        return np.arange(start + delta, end + delta, dtype=np.int64), None
    three = np.empty((3, end - start), dtype=np.int64)
    cut = min(end, p)
    three[:, :cut - start] = prompt[:, start:cut]
    three[:, cut - start:] = np.arange(cut + delta, end + delta)
    if (three[0] == three[1]).all() and (three[1] == three[2]).all():
        return three[0].copy(), None
    return three[0].copy(), three
