"""GLM-4.1V's frame sampling (Glm4vVideoProcessor's do_sample_frames; models/glm4v_config.py
Glm4vFrameSampling: asked by its video processor's file or by mm_processor_kwargs,
engine-wide or a request's; off by default, frames then taken as given).

Of a video of N frames (its metadata's total_num_frames, else the frames given) at the
metadata's fps, lasting its duration (the metadata's; where it gives none, or 0,
round((N - 1) / fps) + 1 seconds), sampled at fps' frames a second:

- up to max_duration seconds: max(1, floor(duration x fps')) frames, the i-th at frame
  ceil(i x fps / fps');
- longer: int(max_duration x fps') frames at frame ceil(t x fps) for t over linspace(0,
  duration) (both ends in), or every frame where that is N or more;

each capped at N - 1, repeats dropped (the first kept), and the last repeated once where an
odd count is left (a whole frame group of 2). The picks become the metadata's
frames_indices, so the prompt's times are transformers' (each group's first frame's index /
fps, in whole seconds: models/glm4v.py). The picks are frame numbers: a video given with
frames_indices (a file engine/video_io.py sampled already) gives the frames it holds and is
refused naming those it lacks (transformers indexes the frames it is given, the same where
they are the whole video). Sampling needs the video's fps (transformers refuses a video
without one); sampling a sampled video again picks the same frames.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from flashpage.models.glm4v_config import Glm4vFrameSampling


def sample_indices(total: int, fps: float, duration: float | None, s: Glm4vFrameSampling) -> list[int]:
    """The frame numbers do_sample_frames picks of a video of ``total`` frames at ``fps``
    lasting ``duration`` seconds (None or 0: from its frame count; module docstring)."""
    last = total - 1
    if not duration:
        duration = round(last / fps) + 1
    if duration <= s.max_duration:
        # (i x fps) / fps', in this order: the same float, so the same ceiling, as transformers'
        picks = [min(last, math.ceil(i * fps / s.fps)) for i in range(max(1, math.floor(duration * s.fps)))]
    else:
        n = int(s.max_duration * s.fps)
        picks = list(range(total)) if n >= total else \
            [min(last, math.ceil(t * fps)) for t in np.linspace(0, duration, n).tolist()]
    out = list(dict.fromkeys(picks))
    if len(out) % 2:
        out.append(out[-1])
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def sample_video(video: Any, s: Glm4vFrameSampling, i: int) -> Any:
    """Video ``i`` (models/qwen2_vl_video.py's forms) with its frames sampled as ``s`` says
    (module docstring): a (frames uint8 (T, H, W, 3), metadata) pair, its frames_indices the
    picks; the video itself without sampling. A ValueError names a video without fps, bad
    metadata, or picks it does not hold."""
    from flashpage.models.qwen2_vl_video import read_video
    from flashpage.models.qwen3_vl_video import video_metadata

    if not s.sample:
        return video
    meta = video[1] if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict) else {}
    frames, _ = read_video(video, i)  # fps checked
    if meta.get("fps") is None:
        raise ValueError(f"video {i}: do_sample_frames picks frames by the video's fps ({s.fps:g} a second of it), "
                         "but its metadata gives none: give (frames, {'fps': ..., 'total_num_frames': ...}), "
                         "or do_sample_frames false")
    fps = float(meta["fps"])
    _, idx = video_metadata(meta, int(frames.shape[0]), i)  # frames_indices checked
    idx = list(range(frames.shape[0])) if idx is None else idx
    total = meta.get("total_num_frames")
    total = frames.shape[0] if total is None else total
    if not _number(total) or int(total) != total or not total > max(idx):
        raise ValueError(f"video {i}: metadata total_num_frames must be a whole number above its frame numbers "
                         f"(frames_indices, up to {max(idx)}), got {total!r}")
    duration = meta.get("duration")
    if duration is not None and (not _number(duration) or not duration >= 0):
        raise ValueError(f"video {i}: metadata duration must be a number of seconds >= 0, got {duration!r}")
    picks = sample_indices(int(total), fps, None if duration is None else float(duration), s)
    held = {k: j for j, k in enumerate(idx)}
    missing = [k for k in dict.fromkeys(picks) if k not in held]
    if missing:
        raise ValueError(f"video {i}: do_sample_frames picks frame(s) {missing[:8]}{' ...' * (len(missing) > 8)} of "
                         f"its {int(total)}, which it does not hold (metadata frames_indices: a sample already); "
                         "give every frame (a file read with media_io_kwargs {\"video\": {\"num_frames\": -1}}), "
                         "or do_sample_frames false")
    kept = frames[[held[k] for k in picks]].permute(0, 2, 3, 1)
    return kept, {**meta, "frames_indices": picks, "total_num_frames": int(total)}
