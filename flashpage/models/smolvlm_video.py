"""SmolVLM2's videos (SmolVLMForConditionalGeneration with a ``<video>`` token): a text
prompt's ``<video>`` written out, before it is tokenized, as SmolVLMProcessor writes it
(replace_video_token), each frame one tile of the image tower (models/idefics3.py)::

    <video> -> "You are provided the following series of {F in words} frames from a
                {duration H:MM:SS} [H:MM:SS] video.\\n"
               then for each frame: "\\nFrame from {MM:SS}:" <fake_token_around_image>
                   <global-img> <image> x N <fake_token_around_image>
               then "\\n\\n"

F in words is num2words' English cardinal ("three", "twenty-one"; ``number_words``).

Each frame's time (``frame_times``) is frames_indices[k] / fps from the video's metadata
(vLLM's (frames, metadata) pair; engine/video_io.py decodes a file into one), and the
duration the metadata's ``duration`` (whole seconds), else the last frame's time. Without
metadata, or where it leaves a key out, as transformers does for frames given without
metadata: fps 24 and frames_indices 0 .. F-1 (its warning's default), so frame k is at k / 24
seconds. A frames_indices of another length than the frames, a non-positive fps or a
negative duration is refused by name.

Frames (``video_frames``, SmolVLMVideoProcessor's resize): the longest edge resized to the
video processor's ``longest_edge`` (an odd short side made even), then to the tile's square
(no splitting), PIL's filter (LANCZOS by default; transformers resizes with torchvision, a
pixel or two apart); normalized under the video processor's mean and std (on the host, as
float pixel values, where they differ from the image processor's).

Frame sampling (``sample_video``; SmolVLMVideoProcessor's do_sample_frames, asked by its
video_preprocessor_config.json or by mm_processor_kwargs, engine-wide or a request's; off by
default, frames then taken as given): of a video of total_num_frames frames (its metadata's,
else its frame count) at the metadata's fps lasting its duration (both needed, as
transformers' sample_frames needs them), round(fps' x duration) frames (fps' the sampling
rate), at most num_frames, at least one, at linspace(start, end) floored and deduplicated:
0 .. total - 1, or 1 s in from each end (int(fps) .. int(total - fps)) where the duration
less 2 s is above num_frames x fps'. The picks become the metadata's frames_indices, so
the frames' times are transformers' (frame k at k / fps). The picks are frame numbers: a
video given with frames_indices (a file engine/video_io.py sampled already) gives the frames
it holds and is refused naming those it lacks (transformers indexes the frames it is given,
the same where they are the whole video). Sampling a sampled video again picks the same
frames.
"""

from __future__ import annotations

import numbers
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flashpage.engine.multimodal import (
    MultiModalInput,
    expand_beside_frames,
    video_items,
)
from flashpage.engine.prompt_embeds import digest
from flashpage.models.clip_image import normalize
from flashpage.models.idefics3_config import MAX_IMAGE_SIDE, Idefics3VisionConfig
from flashpage.models.llava import images_of
from flashpage.models.pil_resample import pil_resize

if TYPE_CHECKING:
    from flashpage.models.idefics3 import Idefics3ImageEncoder
    from flashpage.models.idefics3_config import FrameSampling

DEFAULT_FPS = 24.0  # transformers' fps for frames given without metadata
FAKE, GLOBAL, IMAGE = "<fake_token_around_image>", "<global-img>", "<image>"

_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")


def _below_1000(n: int) -> str:
    h, r = divmod(n, 100)
    if r < 20:
        rest = _ONES[r]
    else:
        rest = _TENS[r // 10] + (f"-{_ONES[r % 10]}" if r % 10 else "")
    if not h:
        return rest
    return f"{_ONES[h]} hundred" + (f" and {rest}" if r else "")


def number_words(n: int) -> str:
    """num2words(n) in English for 0 <= n < 1,000,000 ("one hundred and twenty-one", "one
    thousand and one", "one thousand, one hundred"): the frame count SmolVLMProcessor writes."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"a video of {n} frames: at most 999,999 are written out")
    t, r = divmod(n, 1000)
    if not t:
        return _below_1000(r)
    head = f"{_below_1000(t)} thousand"
    if not r:
        return head
    return f"{head} and {_below_1000(r)}" if r < 100 else f"{head}, {_below_1000(r)}"


def _number(v: Any) -> bool:
    """A real number (numpy's too: a decoder's metadata), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def frame_times(video: Any, frames: int, i: int) -> tuple[list[float], int]:
    """Video ``i``'s frames' times in seconds and its duration in whole seconds (module
    docstring); a ValueError names bad metadata."""
    meta = video[1] if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict) else {}
    fps = meta.get("fps")
    if fps is None:
        fps = DEFAULT_FPS
    elif not _number(fps) or not fps > 0:
        raise ValueError(f"video {i}: metadata fps must be a positive number, got {fps!r}")
    idx = meta.get("frames_indices")
    if idx is None:
        idx = range(frames)
    elif not isinstance(idx, (list, tuple, range)) and not hasattr(idx, "tolist"):
        raise ValueError(f"video {i}: metadata frames_indices must be a list of frame numbers, got "
                         f"{type(idx).__name__}")
    idx = list(idx.tolist() if hasattr(idx, "tolist") else idx)
    if len(idx) != frames:
        raise ValueError(f"video {i}: metadata frames_indices has {len(idx)} entries for its {frames} frames")
    if not all(_number(k) and k >= 0 for k in idx):
        raise ValueError(f"video {i}: metadata frames_indices must be frame numbers >= 0")
    times = [float(k) / float(fps) for k in idx]
    dur = meta.get("duration")
    if dur is None:
        return times, int(times[-1])
    if not _number(dur) or not dur >= 0:
        raise ValueError(f"video {i}: metadata duration must be a number of seconds >= 0, got {dur!r}")
    return times, int(dur)


def sample_indices(total: int, fps: float, duration: float, s: FrameSampling) -> list[int]:
    """The frame numbers do_sample_frames picks of a video of ``total`` frames at ``fps``
    lasting ``duration`` seconds (module docstring)."""
    assert s.num_frames is not None and s.fps is not None
    n = max(1, min(int(round(s.fps * duration)), s.num_frames))
    start, end = 0, total - 1
    if duration - 2 > s.num_frames * s.fps:  # a second skipped at each end
        start, end = int(fps), min(int(total - fps), total - 1)
    if start >= end:
        start, end = 0, total - 1
    return sorted({int(k) for k in np.linspace(start, end, n, dtype=np.int64)})


def sample_video(video: Any, s: FrameSampling, i: int) -> Any:
    """Video ``i`` with its frames sampled as ``s`` says (module docstring): a (frames uint8
    (T, H, W, 3), metadata) pair, its frames_indices the picks; the video itself without
    sampling. A ValueError names a video without fps or duration, bad metadata, or picks
    it does not hold."""
    from flashpage.models.qwen2_vl_video import read_video

    if not s.sample:
        return video
    frames, _ = read_video(video, i)
    meta = video[1] if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict) else {}
    lacking = [k for k in ("fps", "duration") if meta.get(k) is None]
    if lacking:
        raise ValueError(f"video {i}: do_sample_frames picks frames by the video's fps and duration, but its "
                         f"metadata gives no {' or '.join(lacking)}: give (frames, {{'fps': ..., 'duration': ...}}), "
                         "or do_sample_frames false")
    frame_times(video, int(frames.shape[0]), i)  # fps, duration and frames_indices checked
    idx = meta.get("frames_indices")
    idx = list(range(frames.shape[0])) if idx is None else list(idx.tolist() if hasattr(idx, "tolist") else idx)
    total = meta.get("total_num_frames", frames.shape[0])
    if not _number(total) or int(total) != total or not total > max(idx):
        raise ValueError(f"video {i}: metadata total_num_frames must be a whole number above its frame numbers "
                         f"(frames_indices, up to {max(idx)}), got {total!r}")
    picks = sample_indices(int(total), float(meta["fps"]), float(meta["duration"]), s)
    held = {int(k): j for j, k in enumerate(idx)}
    missing = [k for k in picks if k not in held]
    if missing:
        raise ValueError(f"video {i}: do_sample_frames picks frame(s) {missing[:8]}{' ...' * (len(missing) > 8)} of "
                         f"its {int(total)}, which it does not hold (metadata frames_indices: a sample already); "
                         "give every frame (a file read with media_io_kwargs {\"video\": {\"num_frames\": -1}}), "
                         "or do_sample_frames false")
    kept = frames[[held[k] for k in picks]].permute(0, 2, 3, 1)
    return kept, {**meta, "frames_indices": picks, "total_num_frames": int(total)}


def video_text(vc: Idefics3VisionConfig, times: list[float], duration: int) -> str:
    """A video of frames at ``times`` (seconds) as SmolVLMProcessor writes it (module
    docstring)."""
    tile = f"{FAKE}{GLOBAL}{IMAGE * vc.tokens_per_image}{FAKE}"
    out = [f"You are provided the following series of {number_words(len(times))} frames from a "
           f"{timedelta(seconds=duration)} [H:MM:SS] video.\n"]
    for t in times:
        out.append(f"\nFrame from {int(t // 60):02d}:{int(t % 60):02d}:{tile}")
    return "".join(out) + "\n\n"


def expand_video_text(text: str, vc: Idefics3VisionConfig, videos: list[tuple[list[float], int]]) -> str:
    """``text`` with its i-th ``<video>`` made video i's text (``video_text``: (its frames'
    times, its duration)); a ValueError names a count of ``<video>`` other than the videos'."""
    parts = text.split("<video>")
    if len(parts) - 1 != len(videos):
        raise ValueError(f"the prompt has {len(parts) - 1} video placeholder(s) (<video>) but {len(videos)} "
                         "video(s) were given (put one <video> per video: each becomes its frames' text, "
                         "\"Frame from 00:00:\" and the frame's image tokens)")
    out = [parts[0]]
    for (times, dur), rest in zip(videos, parts[1:], strict=True):
        out += [video_text(vc, times, dur), rest]
    return "".join(out)


def texts_of(data: Any) -> list[tuple[list[float], int]]:
    """Each video of multi_modal_data's (its frames read and checked) -> (times, duration)."""
    from flashpage.models.qwen2_vl_video import read_video

    return [frame_times(v, int(read_video(v, i)[0].shape[0]), i) for i, v in enumerate(video_items(data["video"]))]


def video_frames(video: Any, vc: Idefics3VisionConfig, i: int = 0) -> torch.Tensor:
    """Video ``i`` -> its frames, each one tile (module docstring): uint8 [F, 3, M, M], or
    float32 pixel values where the video processor normalizes otherwise than the image
    processor; a ValueError names a bad video (models/qwen2_vl_video.read_video)."""
    from flashpage.models.idefics3 import longest_edge_size
    from flashpage.models.qwen2_vl_video import read_video

    frames, _ = read_video(video, i)
    vp = vc.video_processing or vc.processing
    m = vc.tile
    h, w = int(frames.shape[2]), int(frames.shape[3])
    size = longest_edge_size(h, w, min(vc.video_longest_edge, MAX_IMAGE_SIDE))
    out = torch.stack([pil_resize(pil_resize(f, size, vp.resample), (m, m), vp.resample) for f in frames])
    ip = vc.processing
    if (vp.rescale_factor, vp.mean, vp.std) != (ip.rescale_factor, ip.mean, ip.std):
        return normalize(out, vp).float().contiguous()
    return out.contiguous()


def expand_items(ids: list[int], vc: Idefics3VisionConfig, grids: list[tuple[int, int]], frames: int
                 ) -> tuple[list[int], list[tuple[int, bool]]]:
    """A prompt with videos, written out already (``expand_video_text``: each frame a run of
    N ``<image>`` after <fake_token_around_image> <global-img>, before
    <fake_token_around_image>), and images (one ``<image>`` each): its ids with each image
    expanded (models/idefics3.py) and each tile's and frame's first row position with
    whether it is a frame, in prompt order. A ValueError names a run that is neither, or
    counts other than the items'."""
    from flashpage.models.idefics3 import _image_ids

    tok, n, fake, glob = vc.image_token_id, vc.tokens_per_image, vc.fake_token_id, vc.global_token_id
    if fake is None or glob is None:
        raise ValueError("the tokenizer's files hold no <fake_token_around_image> or <global-img>: a video's "
                         "prompt tokens (SmolVLMProcessor's) cannot be written")

    def is_frame(s: int, k: int) -> bool:  # <fake_token_around_image> <global-img>, N <image>, <fake...>
        return k == n and s >= 2 and ids[s - 2:s] == [fake, glob] and s + k < len(ids) and ids[s + k] == fake

    return expand_beside_frames(
        ids, tok, "<image>", is_frame,
        f"<fake_token_around_image> <global-img>, {n} x <image>, <fake_token_around_image> (written from <video>)",
        grids, frames, lambda grid: _image_ids(vc, grid))


def prepare_videos(enc: Idefics3ImageEncoder, ids: list[int], data: dict[str, Any]
                   ) -> tuple[list[int], list[MultiModalInput]]:
    """The encoder's ``prepare`` for a request with videos (its prompt's frames written out
    from the text already: the encoder's ``expand_text``): images tiled and expanded, each
    frame one input, in prompt order; a ValueError names what is wrong."""
    vc = enc.config
    unknown = sorted(set(data) - {"image", "video"})
    if unknown:
        raise ValueError(f"multi_modal_data {unknown}: {vc.architecture} takes \"image\" and \"video\"")
    if vc.video_token_id in ids:
        raise ValueError(f"the prompt's ids hold <video> (id {vc.video_token_id}), which is not expanded in "
                         "token ids: SmolVLMProcessor writes a video's frames as text (\"Frame from 00:00:\" and "
                         "the frame's image tokens), tokenized with the text around it; give the prompt as "
                         "text, or its ids with each frame written out so")
    images = images_of({"image": data["image"]}, batches=False) if "image" in data else []
    items = [enc.pixel_values(img, i) for i, img in enumerate(images)]
    frames = [f for i, v in enumerate(video_items(data["video"])) for f in video_frames(v, vc, i).unbind(0)]
    ids, marks = expand_items(ids, vc, [it.grid for it in items], len(frames))
    tiles = iter(t for it in items for t in it.pixels.unbind(0))
    queue = iter(frames)
    n = vc.tokens_per_image
    out = []
    for s, frame in marks:
        t = next(queue) if frame else next(tiles)
        out.append(MultiModalInput(s, n, digest(t), t))
    return ids, out
