"""engine/video_io.py: video files decoded with PyAV and sampled as vLLM samples them. Frames
written losslessly (FFV1 / Matroska, PNG / AVI) come back exactly at the sampled indices;
H.264 and MPEG-4 in MP4 come back each nearest its own frame; the metadata (source fps,
frame count, duration, indices) is vLLM's; num_frames and fps bound the sampling as vLLM's
loader does; data, http(s) and file:// URLs, paths and bytes give the same frames; bad input
(no video, empty, over the byte cap, a disallowed path or host, no PyAV, bad
media_io_kwargs) is a ValueError naming it."""

from __future__ import annotations

import base64
import contextlib
import http.server
import math
import sys
import threading

import numpy as np
import pytest

from flashpage.engine.media import MediaPolicy
from flashpage.engine.video_io import VideoSampling, decode_video, load_video, sample_indices
from tests.video_files import LOSSLESS, LOSSY, encode, nearest, pattern_frames

av = pytest.importorskip("av")


def _vllm_indices(total: int, duration: float, num_frames: int, fps: float) -> list[int]:
    """vLLM's VideoLoader sampling, written out from its rule (the reference)."""
    n = total if num_frames <= 0 else min(num_frames, total)
    if fps > 0:
        n = min(n, math.floor(duration * fps))
    n = max(1, n)
    if n == total:
        return list(range(total))
    return [int(v) for v in np.linspace(0, total - 1, n, dtype=int)]


def test_sampling_is_vllms():
    for total in (1, 2, 7, 31, 32, 33, 100, 301):
        for num_frames in (-1, 1, 2, 5, 32):
            for fps_src, fps in ((30.0, -1.0), (30.0, 2.0), (10.0, 0.5), (24.0, 100.0)):
                duration = total / fps_src
                got = sample_indices(total, duration, num_frames, fps)
                assert got == _vllm_indices(total, duration, num_frames, fps), (total, num_frames, fps)
                assert got == sorted(set(got)) and got[0] == 0 and got[-1] <= total - 1
    assert sample_indices(100, 10.0, 32, -1) == [int(v) for v in np.linspace(0, 99, 32)]
    assert sample_indices(100, 10.0, -1, 2.0) == [int(v) for v in np.linspace(0, 99, 20)]  # 2 a second
    assert sample_indices(100, 0.0, -1, 2.0) == [0]  # no duration known: one frame


@pytest.mark.parametrize("fmt,codec,pix", LOSSLESS)
def test_lossless_files_decode_to_the_written_frames(fmt, codec, pix):
    frames = pattern_frames(40, seed=1)
    raw = encode(frames, fmt, codec, pix, rate=20)
    for sampling, want in ((VideoSampling(), [int(v) for v in np.linspace(0, 39, 32)]),
                           (VideoSampling(5), [0, 9, 19, 29, 39]),
                           (VideoSampling(-1), list(range(40))),
                           (VideoSampling(-1, 3.0), [0, 7, 15, 23, 31, 39])):  # 2 s x 3 fps
        got, meta = decode_video(raw, 0, sampling)
        assert meta == {"total_num_frames": 40, "fps": 20.0, "duration": 2.0, "frames_indices": want,
                        "video_backend": "pyav"}
        assert got.dtype == np.uint8 and got.shape == (len(want), 32, 48, 3)
        assert np.array_equal(got, frames[want])


@pytest.mark.parametrize("fmt,codec,pix", LOSSY)
def test_mp4_frames_are_each_nearest_their_own(fmt, codec, pix):
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV build has no {codec} encoder")
    frames = pattern_frames(24, seed=2)
    got, meta = decode_video(encode(frames, fmt, codec, pix, rate=8), 0, VideoSampling(6))
    want = [0, 4, 9, 13, 18, 23]
    assert meta["frames_indices"] == want and meta["total_num_frames"] == 24
    assert meta["fps"] == 8.0 and meta["duration"] == 3.0
    assert nearest(got, frames) == want


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.server.files.get(self.path)  # type: ignore[attr-defined]
        if body is None:
            self.send_error(404, "no such video")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.wfile.write(body)


@pytest.fixture(scope="module")
def web():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    frames = pattern_frames(12, seed=3)
    server.files = {"/a.mkv": encode(frames), "/notes.txt": b"these are not frames"}  # type: ignore[attr-defined]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", frames
    server.shutdown()


def test_urls_paths_and_bytes_give_the_same_frames(web, tmp_path):
    base, frames = web
    raw = encode(frames)
    (tmp_path / "a.mkv").write_bytes(raw)
    files = MediaPolicy(allowed_local_media_path=str(tmp_path), media_io_kwargs={"video": {"num_frames": 4}})
    want = [0, 3, 7, 11]
    for source, kw in ((f"{base}/a.mkv", {}), (f"file://{tmp_path}/a.mkv", {}), (raw, {}),
                       (bytearray(raw), {}), ("data:video/x-matroska;base64," + base64.b64encode(raw).decode(), {}),
                       ("data:;base64," + base64.b64encode(raw).decode(), {}),
                       (str(tmp_path / "a.mkv"), {"allow_path": True})):
        got, meta = load_video(source, 2, files, **kw)
        assert meta["frames_indices"] == want, source
        assert np.array_equal(got, frames[want])
    got, meta = load_video(raw, 0)  # the default: 32 frames at most, here all 12
    assert meta["frames_indices"] == list(range(12)) and np.array_equal(got, frames)


def test_bad_videos_are_named(web, tmp_path, monkeypatch):
    base, frames = web
    root = tmp_path / "ok"
    root.mkdir()
    raw = encode(frames)
    (root / "a.mkv").write_bytes(raw)
    (root / "empty.mkv").write_bytes(b"")
    (root / "text.mkv").write_bytes(b"this is not a video at all" * 10)
    (tmp_path / "secret.mkv").write_bytes(raw)
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(frames[0]).save(png, format="PNG")
    (root / "still.png").write_bytes(png.getvalue())
    audio = io.BytesIO()
    with av.open(audio, mode="w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        f = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        f.sample_rate = 8000
        for p in [*s.encode(f), *s.encode()]:
            c.mux(p)
    (root / "sound.wav").write_bytes(audio.getvalue())
    files = MediaPolicy(allowed_local_media_path=str(root))
    small = MediaPolicy(allowed_local_media_path=str(root), video_max_bytes=100)
    only_local = MediaPolicy(allowed_media_domains=["127.0.0.1"])
    cases = [
        (f"file://{root}/text.mkv", files, "could not be decoded"),
        (f"file://{root}/empty.mkv", files, "is empty (0 bytes)"),
        (f"file://{root}/sound.wav", files, "holds no video stream"),
        (f"file://{root}/a.mkv", small, "more than 100 bytes (FLASHPAGE_VIDEO_MAX_BYTES)"),
        (raw, small, "more than 100 (FLASHPAGE_VIDEO_MAX_BYTES)"),
        (f"file://{root}/a.mkv", None, "allowed_local_media_path (--allowed-local-media-path), which is not set"),
        (f"file://{root}/../secret.mkv", files, "is not under allowed_local_media_path"),
        (f"file://{root}/none.mkv", files, "could not be read"),
        ("https://blocked.invalid/a.mkv", only_local, "host 'blocked.invalid' is not in allowed_media_domains"),
        (f"{base}/missing.mkv", None, "HTTP 404"),
        (f"{base}/notes.txt", None, "could not be decoded"),
        ("data:image/png;base64," + base64.b64encode(raw).decode(), None, "of type 'image/png' given as a video"),
        ("data:video/mp4;base64,@@", None, "not valid base64"),
        ("clip.mp4", None, "a data URL (data:video/mp4;base64,...), an http(s) URL or a file://"),
        (b"", None, "is empty"),
    ]
    for source, policy, needle in cases:
        with pytest.raises(ValueError, match=r"^video 5") as e:
            load_video(source, 5, policy)
        assert needle in str(e.value), (source, str(e.value))
    # a still image is a one-frame "video" to FFmpeg, as to vLLM's loaders: its one frame
    one, meta = load_video(f"file://{root}/still.png", 0, files)
    assert one.shape == (1, 32, 48, 3) and meta["frames_indices"] == [0]
    # an offline path names a file the program chose: read without the folder check, but capped
    assert load_video(str(tmp_path / "secret.mkv"), 0, None, allow_path=True)[0].shape[0] == 12
    with pytest.raises(ValueError, match="video 0: .*more than 100 bytes"):
        load_video(str(tmp_path / "secret.mkv"), 0, small, allow_path=True)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV missing: the package named
    with pytest.raises(ValueError, match="needs PyAV: pip install av"):
        load_video(raw, 0)


def test_media_io_kwargs_are_checked():
    from flashpage.config import ConfigError, EngineConfig

    assert VideoSampling.of(MediaPolicy(media_io_kwargs={"video": {"num_frames": -1, "fps": 2}})) == \
        VideoSampling(-1, 2.0)
    assert VideoSampling.of(None) == VideoSampling(32, -1.0)
    for kw, needle in (({"audio": {}}, "'audio' is not read"),
                       ({"video": {"frames": 3}}, "unknown key(s) ['frames']"),
                       ({"video": {"num_frames": 0}}, "positive int or -1"),
                       ({"video": {"fps": "2"}}, "positive number or -1"),
                       ({"video": 16}, "must be a dict"),
                       ([16], "must be a dict such as")):
        with pytest.raises(ValueError) as e:
            MediaPolicy(media_io_kwargs=kw)  # type: ignore[arg-type]
        assert needle in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="unknown key"):
        EngineConfig(media_io_kwargs={"video": {"frames": 3}})


def test_media_io_kwargs_flag_reaches_the_policy():
    from flashpage.cli import build_parser
    from flashpage.config import EngineConfig

    args = build_parser().parse_args(["serve", "m", "--media-io-kwargs", '{"video": {"num_frames": 8, "fps": 1}}'])
    assert args.media_io_kwargs == {"video": {"num_frames": 8, "fps": 1}}
    policy = EngineConfig(media_io_kwargs=args.media_io_kwargs).media_policy
    assert VideoSampling.of(policy) == VideoSampling(8, 1.0)
