"""Video files as vLLM reads them: a video's bytes (a ``video_url`` chat part's URL read by
engine/media.py, a file, or bytes given offline) decoded with PyAV (``pip install av``; its
wheels bundle FFmpeg; imported only here, when a video file is read) into the frames the
models take, with vLLM's metadata::

    bytes of a video file (mp4, mkv, webm, avi, ...)
    -> frames uint8 (T, H, W, 3) (numpy), {"total_num_frames": N, "fps": source fps,
       "duration": N / fps, "frames_indices": [the T frames' indices in the file],
       "video_backend": "pyav"}

That pair is vLLM's (frames, metadata) form of multi_modal_data["video"], which
models/qwen2_vl_video.read_video reads: Qwen2.5-VL's temporal position step comes from the
sampled frames' rate (fps x T / N), Qwen3-VL's timestamps from frames_indices / fps.

Sampling (vLLM's VideoLoader, uniform; ``media_io_kwargs={"video": {...}}``,
``--media-io-kwargs``): ``num_frames`` frames (default 32, vLLM's VideoMediaIO default; -1:
every frame) at ``linspace(0, N - 1, n)`` rounded down; with ``fps`` > 0 also at most
floor(duration x fps) of them (the way to sample by time, as Qwen's processors do:
``{"num_frames": -1, "fps": 2}``); at least one; every frame when n reaches N.

The frame count is the container's where it keeps one (mp4, avi), else the packets counted
(mkv, webm); a frame the decoder does not give (a broken file) is left out and
frames_indices says which were read. Every failure is a ValueError naming the video and
what is wrong: no PyAV, bytes that are no video, no video stream, no frame decoded, frames
too large (a frame over Pillow's decompression-bomb size, or sampled frames over
MAX_DECODED_BYTES in all).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashpage.engine.media import MediaPolicy, given_bytes, read_local_file, read_url, url_scheme

DEFAULT_NUM_FRAMES = 32  # vLLM's VideoMediaIO default
MAX_FRAME_PIXELS = 89_478_485  # Pillow's MAX_IMAGE_PIXELS: a frame above it is refused, as an image is
MAX_DECODED_BYTES = 4 << 30  # the sampled frames' bytes (uint8 RGB) a video may decode to


@dataclass(frozen=True)
class VideoSampling:
    """How a video file is sampled (module docstring); -1: no bound."""

    num_frames: int = DEFAULT_NUM_FRAMES
    fps: float = -1.0

    @classmethod
    def of(cls, policy: MediaPolicy | None) -> VideoSampling:
        opts = (policy.media_io_kwargs or {}).get("video", {}) if policy is not None else {}
        return cls(int(opts.get("num_frames", DEFAULT_NUM_FRAMES)), float(opts.get("fps", -1.0)))


def sample_indices(total: int, duration: float, num_frames: int, fps: float) -> list[int]:
    """vLLM's uniform sampling: which of a video's ``total`` frames are read."""
    n = total
    if num_frames > 0:
        n = min(num_frames, total)
    if fps > 0:
        n = min(n, math.floor(duration * fps))
    n = max(1, n)
    if n >= total:
        return list(range(total))
    return np.linspace(0, total - 1, n).astype(np.int64).tolist()


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise ValueError("reading a video file needs PyAV: pip install av (or flashpage[video]); "
                         "or give the video's frames, a uint8 (T, H, W, 3) array") from None
    return av


def _open(av: Any, raw: bytes, i: int) -> Any:
    try:
        return av.open(io.BytesIO(raw), mode="r")
    except Exception as e:  # FFmpeg's own words: InvalidDataError, ...
        raise ValueError(f"video {i} could not be decoded (is it a video file?): {e}") from None


def _rate(stream: Any) -> float:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else 0.0


def decode_video(raw: bytes, i: int = 0, sampling: VideoSampling | None = None
                 ) -> tuple[np.ndarray, dict[str, Any]]:
    """Video ``i``'s encoded bytes -> (frames uint8 (T, H, W, 3), metadata) (module
    docstring); a ValueError naming what is wrong."""
    s = sampling or VideoSampling()
    if not raw:
        raise ValueError(f"video {i} is empty (0 bytes)")
    av = _av()
    with _open(av, raw, i) as container:
        if not container.streams.video:
            raise ValueError(f"video {i} holds no video stream")
        stream = container.streams.video[0]
        fps = _rate(stream)
        width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        total = int(stream.frames or 0)
        if total <= 0:  # a container without a frame count (mkv, webm): count the packets
            try:
                total = sum(1 for p in container.demux(stream) if p.size)
            except Exception as e:
                raise ValueError(f"video {i} could not be decoded: {e}") from None
    if total <= 0:
        raise ValueError(f"video {i} holds no frames")
    duration = total / fps if fps > 0 else 0.0
    want = sample_indices(total, duration, s.num_frames, s.fps)
    if width * height > MAX_FRAME_PIXELS:
        raise ValueError(f"video {i}: its frames of {width} x {height} pixels are over "
                         f"{MAX_FRAME_PIXELS} pixels (a decompression bomb?)")
    if len(want) * width * height * 3 > MAX_DECODED_BYTES:
        raise ValueError(f"video {i}: {len(want)} frames of {width} x {height} would decode to more "
                         f"than {MAX_DECODED_BYTES} bytes: sample fewer (media_io_kwargs "
                         "{\"video\": {\"num_frames\": ...}})")
    frames, got = _decode(av, raw, i, set(want), want[-1])
    if not frames:
        raise ValueError(f"video {i}: no frame could be decoded")
    if len({f.shape for f in frames}) > 1:
        raise ValueError(f"video {i}: its frames change size ({sorted({f.shape[:2] for f in frames})})")
    meta = {"total_num_frames": total, "fps": fps if fps > 0 else None, "duration": duration,
            "frames_indices": got, "video_backend": "pyav"}
    return np.stack(frames), meta


def _decode(av: Any, raw: bytes, i: int, want: set[int], last: int) -> tuple[list[np.ndarray], list[int]]:
    """The frames at ``want`` (decode order is display order for a decoder's output) as
    uint8 RGB arrays, and their indices."""
    frames: list[np.ndarray] = []
    got: list[int] = []
    with _open(av, raw, i) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        try:
            for k, frame in enumerate(container.decode(stream)):
                if k in want:
                    frames.append(frame.to_ndarray(format="rgb24"))
                    got.append(k)
                if k >= last:
                    break
        except Exception as e:  # a file cut short: the frames read so far, as vLLM's loader keeps
            if not frames:
                raise ValueError(f"video {i} could not be decoded: {e}") from None
    return frames, got


def video_bytes(source: str | bytes | bytearray | memoryview, i: int, policy: MediaPolicy | None,
                allow_path: bool = False) -> bytes:
    """A video's encoded bytes: given as bytes, or read from its URL (engine/media.py: data,
    http(s), file:// under allowed_local_media_path); ``allow_path`` (offline
    multi_modal_data): a string without a URL scheme is a local file the program names."""
    policy = policy or MediaPolicy()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return given_bytes(source, i, policy, "video")
    if allow_path and url_scheme(source) not in ("data", "http", "https", "file"):
        return read_local_file(os.path.realpath(source), f"video {i}", policy, "video")
    return read_url(source, i, policy, "video")


def load_video(source: str | bytes | bytearray | memoryview, i: int = 0, policy: MediaPolicy | None = None,
               allow_path: bool = False) -> tuple[np.ndarray, dict[str, Any]]:
    """Video ``i`` from its URL or bytes (``video_bytes``), decoded and sampled as the
    policy's media_io_kwargs say (``decode_video``)."""
    return decode_video(video_bytes(source, i, policy, allow_path), i, VideoSampling.of(policy))


def is_video_source(x: Any) -> bool:
    """A video given as a file (its path or URL, or its bytes) rather than as frames."""
    return isinstance(x, (str, bytes, bytearray, memoryview))


def decode_sources(given: Any, policy: MediaPolicy | None) -> Any:
    """multi_modal_data["video"] with each video given as a file (``is_video_source``)
    decoded to its (frames, metadata) pair; videos given as frames kept as they are."""
    from flashpage.engine.multimodal import video_items

    items = video_items(given)
    if not any(is_video_source(v) for v in items):
        return given
    return [load_video(v, k, policy, allow_path=True) if is_video_source(v) else v
            for k, v in enumerate(items)]
