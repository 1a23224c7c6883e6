"""Qwen3-VL's videos (dense and MoE): what differs from Qwen2-VL's (models/qwen2_vl_video.py
reads the frames; models/qwen2_vl.QwenImageEncoder runs them), after transformers 5.24's
Qwen3VLVideoProcessor, Qwen3VLProcessor and Qwen3VLModel.get_rope_index:

- the size: ``smart_resize_video`` bounds the pixels of the whole video (frames rounded to
  temporal patches x h x w between the video processor's shortest_edge and longest_edge,
  class defaults 128 and 768 merged 32 x 32 units), not each frame's; fewer than
  temporal_patch_size frames is an error (transformers': "t:1 must be larger than
  temporal_factor:2");
- the prompt: each ``<|video_pad|>`` becomes, per temporal patch (frame group) g,
  ``<{t_g:.1f} seconds><|vision_start|><|video_pad|> x rows<|vision_end|>`` (the timestamp as
  text, tokenized by the model's tokenizer; the chat template's own vision_start / vision_end
  around the video stay, as transformers' processor leaves them), t_g the mean of the group's
  first and last frame times (``timestamps``);
- the positions: each frame group is laid out as an image of one temporal step at the
  position after the text before it (get_rope_index splits video_grid_thw per frame group);
  so the engine keeps one input per frame group (``frame_groups``), each with grid (1, h, w)
  and its 2 frames, and engine/mrope.py needs nothing new. The tower attends within a frame
  group and adds the same position table to every one, so encoding the groups apart gives
  the rows (and deepstack features) of the whole video's pass.

The frames are taken as given, none dropped (vLLM's do_sample_frames false for frames already
sampled; transformers' own default would sample them down to 2 per second): their times are
``frames_indices`` / ``fps`` of the metadata given with them ((frames, {"fps": ...,
"frames_indices": [...]}): vLLM's form), else frame i at i / fps, fps the engine's
mm_processor_kwargs {"fps": ...} or transformers' default 24 (its processor's, for frames
without metadata).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flashpage.config import QwenImageProcessing

DEFAULT_FPS = 24.0  # Qwen3VLProcessor's, for frames without metadata


def smart_resize_video(frames: int, height: int, width: int, temporal: int, factor: int,
                       min_pixels: int, max_pixels: int, what: str = "frames") -> tuple[int, int]:
    """Qwen3VLVideoProcessor's smart_resize: (h, w) multiples of ``factor`` with the video's
    frames (rounded to ``temporal``) x h x w within [min_pixels, max_pixels], the aspect
    kept as near as they allow; a side under ``factor`` is scaled up first. A ValueError for
    fewer frames than ``temporal`` or an aspect ratio over 200 (``what`` names them:
    GLM-4.1V's images are sized by the same rule as ``temporal`` frames, models/glm4v.py)."""
    if frames < temporal:
        raise ValueError(f"{frames} frame(s): a video needs at least temporal_patch_size "
                         f"({temporal}) frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"{what} of {height} x {width}: the aspect ratio must be under 200, got "
                         f"{max(height, width) / min(height, width):.1f}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize_video(frames: torch.Tensor, proc: QwenImageProcessing, patch: int, merge: int, temporal: int
                 ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames uint8 [T, 3, H, W] -> (uint8 [T', 3, h, w] at smart_resize_video's size, T' the
    next multiple of ``temporal`` (the last frame repeated, as the processor's patchify pads),
    the grid (T' / temporal, h / patch, w / patch))."""
    t, _, h, w = frames.shape
    rh, rw = smart_resize_video(t, h, w, temporal, patch * merge, proc.min_pixels, proc.max_pixels)
    x = frames
    if (rh, rw) != (h, w):
        x = F.interpolate(x, size=(rh, rw), mode=proc.resample, antialias=True, align_corners=False)
    if pad := -x.shape[0] % temporal:
        x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
    return x.contiguous(), (x.shape[0] // temporal, rh // patch, rw // patch)


def video_metadata(meta: dict[str, Any] | None, frames: int, i: int) -> tuple[float | None, list[int] | None]:
    """A video's metadata ((frames, meta): vLLM's form) -> (its fps or None, the indices of
    the frames given in the source video or None); a ValueError names a bad field."""
    if meta is None:
        return None, None
    fps = meta.get("fps")
    if fps is not None and (not isinstance(fps, (int, float)) or isinstance(fps, bool) or not fps > 0):
        raise ValueError(f"video {i}: metadata fps must be a positive number, got {fps!r}")
    idx = meta.get("frames_indices")
    if idx is not None:
        idx = list(idx.tolist() if hasattr(idx, "tolist") else idx)
        if len(idx) != frames or not all(isinstance(j, int) and not isinstance(j, bool) and j >= 0 for j in idx):
            raise ValueError(f"video {i}: metadata frames_indices must be {frames} non-negative ints "
                             f"(one per frame given), got {len(idx)}")
    return (None if fps is None else float(fps)), idx


def timestamps(indices: list[int], fps: float, temporal: int) -> list[float]:
    """Qwen3VLProcessor._calculate_timestamps: the frames' indices padded to whole temporal
    patches with the last one, each patch's time the mean of its first and last frame's
    (index / fps), in seconds."""
    idx = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    times = [j / fps for j in idx]
    return [(times[g] + times[g + temporal - 1]) / 2 for g in range(0, len(times), temporal)]


def video_prompt(ids: list[int], videos: list[tuple[list[float], int]], pad: int, start: int, end: int,
                 tokenize: Callable[[str], list[int]]) -> list[int]:
    """A prompt's ids with its i-th ``pad`` (<|video_pad|>) made video i's frame groups
    (``videos[i]``: the groups' timestamps and each group's rows), each
    ``tokenize("<t seconds>") + [start] + [pad] * rows + [end]``. A prompt whose pads are
    already one run per frame group, of its rows each, is kept. A ValueError names a count
    that does not match."""
    runs: list[int] = []
    for j, t in enumerate(ids):
        if t == pad:
            if j and ids[j - 1] == pad:
                runs[-1] += 1
            else:
                runs.append(1)
    groups = [rows for times, rows in videos for _ in times]
    if len(runs) == len(groups) and any(r > 1 for r in runs) and runs == groups:
        return list(ids)
    if sum(runs) != len(videos):
        raise ValueError(f"the prompt has {sum(runs)} video token(s) (<|video_pad|>, id {pad}) but "
                         f"{len(videos)} video(s) were given: put one "
                         "<|vision_start|><|video_pad|><|vision_end|> in the prompt per video")
    out: list[int] = []
    it = iter(videos)
    for t in ids:
        if t != pad:
            out.append(t)
            continue
        times, rows = next(it)
        for s in times:
            out += [*tokenize(f"<{s:.1f} seconds>"), start, *[pad] * rows, end]
    return out
