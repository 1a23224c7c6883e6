"""M-RoPE positions (Qwen2-VL): a prompt's 3-D (t, h, w) positions and what each step takes.

Text tokens have three equal components (M-RoPE is then 1-D rope at that position); an
image's rows, a grid (t, h, w) of merged patches in row-major order, start at the position
``p`` the next text token would have had and take ``(p + t_i, p + h_i, p + w_i)``; the text
after it continues from the image's largest component + 1 (``p + max(t, h, w)``), so an
image of n rows moves every later position by ``max(t, h, w) - n`` (<= 0). Past the prompt,
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
    ``inputs`` giving each image's offset and grid (its length t x h x w)."""
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
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, mi.offset:mi.offset + mi.length] = cur + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        cur += max(t, h, w)
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
