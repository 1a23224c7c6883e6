"""A video as multi_modal_data gives it (vLLM's forms, engine/multimodal.video_items) read
into what Qwen2-VL's preprocessing takes (models/qwen2_vl_image.resize_video):

    frames uint8 (T, H, W, 3) as a numpy array or a torch tensor | a list of frames (PIL
    images, or uint8 (H, W, 3) arrays / tensors) | either with its metadata, (frames, {"fps":
    ..., "frames_indices": ..., "total_num_frames": ...})
    -> frames uint8 [T, 3, H, W] (a torch tensor), the frame rate of the frames given or None

No file is decoded here: a video file (a video_url chat part, or a path, URL or bytes in
multi_modal_data) reaches this as the (frames, metadata) pair engine/video_io.py decodes it
to; LLM.chat also reads a list of image URLs as frames (engine/multimodal.chat_images).

The frame rate sets Qwen2.5-VL's temporal positions (engine/mrope.py): transformers'
``VideoMetadata.sampled_fps`` -- fps x len(frames_indices) / total_num_frames where the
metadata says which frames were sampled, else its fps; without one the engine's
mm_processor_kwargs {"fps": ...}, else transformers' default 24.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flashpage.models.clip_image import is_pil_image, pil_to_uint8

DEFAULT_FPS = 24.0  # transformers' VideoMetadata.sampled_fps without an fps


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def _frame(f: Any, i: int, j: int) -> torch.Tensor:
    """Frame j of video i -> uint8 [3, H, W]."""
    if is_pil_image(f):
        return pil_to_uint8(f, True)
    if isinstance(f, np.ndarray):
        f = torch.from_numpy(np.ascontiguousarray(f))
    if isinstance(f, torch.Tensor):
        if f.dtype != torch.uint8 or f.dim() != 3 or f.shape[2] != 3:
            raise ValueError(f"video {i}: frame {j} must be uint8 RGB (H, W, 3), got "
                             f"{_dtype_name(f)} {list(f.shape)}")
        return f.permute(2, 0, 1)
    raise ValueError(f"video {i}: frame {j} is a {type(f).__name__}: give PIL images or uint8 "
                     "(H, W, 3) arrays")


def _fps(meta: dict[str, Any], i: int) -> float | None:
    fps = meta.get("fps")
    if fps is None:
        return None
    if not isinstance(fps, (int, float)) or isinstance(fps, bool) or not fps > 0:
        raise ValueError(f"video {i}: metadata fps must be a positive number, got {fps!r}")
    idx, total = meta.get("frames_indices"), meta.get("total_num_frames")
    if idx is not None and isinstance(total, int) and total > 0:
        return len(idx) / total * float(fps)
    return float(fps)


def read_video(video: Any, i: int) -> tuple[torch.Tensor, float | None]:
    """Video ``i`` (module docstring) -> (frames uint8 [T, 3, H, W], its frame rate or None);
    a ValueError names what is wrong (a dtype, a shape, frames of different sizes, none)."""
    fps = None
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict):
        video, meta = video
        fps = _fps(meta, i)
    if isinstance(video, np.ndarray):
        if video.dtype != np.uint8:
            raise ValueError(f"video {i}: frames must be uint8 (T, H, W, 3), got {video.dtype} "
                             f"{list(video.shape)}")
        video = torch.from_numpy(np.ascontiguousarray(video))
    if isinstance(video, torch.Tensor):
        if video.dtype != torch.uint8 or video.dim() != 4 or video.shape[3] != 3:
            raise ValueError(f"video {i}: frames must be uint8 (T, H, W, 3), got "
                             f"{_dtype_name(video)} {list(video.shape)}")
        frames = video.permute(0, 3, 1, 2)
    elif isinstance(video, (list, tuple)):
        fs = [_frame(f, i, j) for j, f in enumerate(video)]
        sizes = sorted({tuple(f.shape[1:]) for f in fs})
        if len(sizes) > 1:
            raise ValueError(f"video {i}: its frames differ in size ({', '.join(f'{h} x {w}' for h, w in sizes)})")
        frames = torch.stack(fs) if fs else torch.empty(0, 3, 0, 0, dtype=torch.uint8)
    else:
        raise ValueError(f"video {i} is a {type(video).__name__}: give its frames, a uint8 (T, H, W, 3) "
                         "array, a list of PIL images, or a video file's path, URL or bytes")
    if frames.shape[0] == 0:
        raise ValueError(f"video {i} has no frames")
    if min(frames.shape[2:]) == 0:
        raise ValueError(f"video {i}: its frames are empty ({frames.shape[2]} x {frames.shape[3]})")
    return frames.contiguous(), fps
