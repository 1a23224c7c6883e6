"""engine/media.py: image URLs as vLLM reads them. Data URLs decoded; http(s) URLs fetched
(only from allowed_media_domains when set, redirects included, within the byte and time
limits); file:// URLs read only under allowed_local_media_path (no escape by ``..`` or a
symlink); every failure a ValueError naming the image and what is wrong."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import os
import threading
import time

import pytest

from flashpage.engine.media import MediaPolicy, load_image
from tests.llava_checkpoint import smooth_image


def _png(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    smooth_image(20, 30, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.startswith("/redirect/"):
            self.send_response(302)
            self.send_header("Location", self.path[len("/redirect/"):])
            self.end_headers()
            return
        if self.path == "/slow.png":
            time.sleep(1.5)
        body = self.server.files.get(self.path.split("?")[0])  # type: ignore[attr-defined]
        if body is None:
            self.send_error(404, "no such image")
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
            self.wfile.write(body)


@pytest.fixture(scope="module")
def web():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.files = {"/a.png": _png(1), "/slow.png": _png(2), "/text.png": b"not an image"}  # type: ignore[attr-defined]
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _same(a, b) -> bool:
    return a.size == b.size and a.convert("RGB").tobytes() == b.convert("RGB").tobytes()


def test_data_http_and_file_urls_give_the_same_image(web, tmp_path):
    raw = _png(1)
    (tmp_path / "a.png").write_bytes(raw)
    want = load_image("data:image/png;base64," + base64.b64encode(raw).decode(), 0)
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path))
    assert _same(load_image(f"{web}/a.png", 0), want)
    assert _same(load_image(f"file://{tmp_path}/a.png", 0, policy), want)
    assert _same(load_image(f"{web}/redirect/{web}/a.png", 0), want)  # a redirect followed
    allowed = MediaPolicy(allowed_media_domains=["127.0.0.1"])
    assert _same(load_image(f"{web}/a.png", 0, allowed), want)


def test_bad_urls_are_named(web, tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(_png(1))
    (tmp_path / "secret.png").write_bytes(_png(3))
    os.symlink(tmp_path / "secret.png", tmp_path / "ok" / "link.png")
    root = str(tmp_path / "ok")
    files = MediaPolicy(allowed_local_media_path=root)
    only_local = MediaPolicy(allowed_media_domains=["127.0.0.1"])
    cases = [
        (f"{web}/missing.png", None, "HTTP 404"),
        (f"{web}/text.png", None, "image 3 could not be decoded"),
        ("http://127.0.0.1:1/a.png", None, "failed"),
        ("https://blocked.invalid/a.png", only_local, "host 'blocked.invalid' is not in allowed_media_domains"),
        (f"{web}/redirect/http://localhost:1/a.png", only_local, "redirected to host 'localhost'"),
        (f"{web}/a.png", MediaPolicy(max_bytes=100), "more than 100 bytes"),
        (f"{web}/slow.png", MediaPolicy(fetch_timeout=0.3), "timed out"),
        (f"file://{root}/a.png", None, "allowed_local_media_path (--allowed-local-media-path), which is not set"),
        (f"file://{root}/../secret.png", files, "is not under allowed_local_media_path"),
        (f"file://{root}/link.png", files, "is not under allowed_local_media_path"),
        (f"file://{root}/none.png", files, "could not be read"),
        (f"file://otherhost{root}/a.png", files, "got host 'otherhost'"),
        ("ftp://example.com/a.png", None, "a data URL (data:image/png;base64,...), an http(s) URL or a file://"),
        ("data:image/png;base64,@@@", None, "not valid base64"),
    ]
    for url, policy, needle in cases:
        with pytest.raises(ValueError, match=r"^image 3") as e:
            load_image(url, 3, policy)
        assert needle in str(e.value), (url, str(e.value))
    assert _same(load_image(f"file://{root}/a.png", 0, files), load_image(f"{web}/a.png", 0))


def test_policies_are_checked_when_made(tmp_path):
    with pytest.raises(ValueError, match="must be an existing folder"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="list of host names"):
        MediaPolicy(allowed_media_domains="example.com")  # type: ignore[arg-type]
    from flashpage.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="must be an existing folder"):
        EngineConfig(allowed_local_media_path=str(tmp_path / "none"))
    assert EngineConfig(allowed_media_domains=["A.example"]).media_policy.allowed_media_domains == ("a.example",)
