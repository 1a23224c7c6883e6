"""Small video files written with PyAV for the video-file tests (engine/video_io.py): frames
of distinct patterns (each frame's index readable from its pixels), encoded losslessly
(FFV1 in Matroska, PNG in AVI: decoded frames equal the written ones exactly) or lossily
(H.264 / MPEG-4 in MP4: each decoded frame nearest its own written frame)."""

from __future__ import annotations

import io

import numpy as np

# (container format, codec, pixel format): lossless first
LOSSLESS = (("matroska", "ffv1", "bgr0"), ("avi", "png", "rgb24"))
LOSSY = (("mp4", "libx264", "yuv420p"), ("mp4", "mpeg4", "yuv420p"))


def pattern_frames(n: int, h: int = 32, w: int = 48, seed: int = 0) -> np.ndarray:
    """uint8 (n, h, w, 3): frame k a smooth gradient shifted by k, a bar k/n of the width wide
    and a level of k in blue, so frames differ everywhere and resize smoothly."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=3)
    y, x = np.mgrid[0:h, 0:w]
    out = np.empty((n, h, w, 3), np.uint8)
    for k in range(n):
        out[k, ..., 0] = (base[0] + 3 * x + 2 * y + 9 * k) % 256
        out[k, ..., 1] = np.where(x < (k + 1) * w // (n + 1), 230, 25)
        out[k, ..., 2] = (base[2] + 200 * k // max(1, n - 1)) % 256
    return out


def encode(frames: np.ndarray, fmt: str = "matroska", codec: str = "ffv1", pix_fmt: str = "bgr0",
           rate: int = 10) -> bytes:
    """``frames`` (T, H, W, 3) encoded as a ``fmt`` file at ``rate`` frames a second."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def nearest(decoded: np.ndarray, frames: np.ndarray) -> list[int]:
    """For each decoded frame, the index of the written frame nearest it (mean abs error)."""
    d = decoded.astype(np.int32)[:, None]
    f = frames.astype(np.int32)[None]
    return np.abs(d - f).mean(axis=(2, 3, 4)).argmin(axis=1).tolist()
