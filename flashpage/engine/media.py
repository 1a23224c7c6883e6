"""Images, videos and audio by URL, as vLLM reads them: a chat message's ``image_url``,
``video_url`` or ``audio_url`` (on the server and in ``LLM.chat``) may be a base64 data URL,
an http(s) URL (fetched) or a ``file://`` URL (read, only under ``allowed_local_media_path``).
A video's bytes are decoded by engine/video_io.py, an audio file's by engine/audio_io.py.

``MediaPolicy`` holds what a deployment allows (vLLM's flags of the same names):

- ``allowed_local_media_path``: the folder whose files ``file://`` URLs may name (None: no
  file URL is read). The path is resolved (symlinks, ``..``) before the check.
- ``allowed_media_domains``: the host names http(s) URLs may name, exactly (None: any);
  a redirect is followed only to an allowed host.
- ``fetch_timeout`` seconds a fetch may take (``FLASHPAGE_MEDIA_FETCH_TIMEOUT``, default 5,
  vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``), ``max_bytes`` an image's encoded bytes may hold
  (``FLASHPAGE_MEDIA_MAX_BYTES``, default 32 MiB; Pillow's decompression-bomb check guards
  the decoded size). A video's own: ``video_fetch_timeout`` (``FLASHPAGE_VIDEO_FETCH_TIMEOUT``,
  default 30, vLLM's ``VLLM_VIDEO_FETCH_TIMEOUT``) and ``video_max_bytes``
  (``FLASHPAGE_VIDEO_MAX_BYTES``, default 256 MiB). An audio file's fetch: ``audio_fetch_timeout``
  (``FLASHPAGE_AUDIO_FETCH_TIMEOUT``, default 10, vLLM's ``VLLM_AUDIO_FETCH_TIMEOUT``), its
  bytes under ``max_bytes`` as an image's. The byte caps hold for data URLs too.
- ``media_io_kwargs``: vLLM's ``--media-io-kwargs``, how a video file is sampled:
  ``{"video": {"num_frames": 32, "fps": -1}}`` (engine/video_io.py; those are the defaults).

Every failure is a ValueError naming the item (``image 0``, ``video 1``: its index in the
request) and what is wrong, which the server answers with a 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from flashpage import envs

_DATA_URL = re.compile(r"^data:([A-Za-z]+)?(/[A-Za-z0-9.+-]+)?(;[^,]*)?;base64,(.*)$", re.DOTALL)
MEDIA_IO_KEYS = {"video": {"num_frames", "fps"}}  # what media_io_kwargs may set (engine/video_io.py)


def check_media_io_kwargs(kwargs: Any) -> dict[str, dict[str, Any]]:
    """vLLM's ``media_io_kwargs`` ({"video": {"num_frames": 16}}) checked: a ValueError
    naming an unknown key or a bad value."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"media_io_kwargs must be a dict such as {{\"video\": {{\"num_frames\": 16}}}}, "
                         f"got {kwargs!r}")
    for modality, opts in kwargs.items():
        if modality not in MEDIA_IO_KEYS:
            raise ValueError(f"media_io_kwargs: {modality!r} is not read (only \"video\": "
                             f"{sorted(MEDIA_IO_KEYS['video'])})")
        if not isinstance(opts, dict):
            raise ValueError(f"media_io_kwargs[{modality!r}] must be a dict, got {opts!r}")
        unknown = sorted(set(opts) - MEDIA_IO_KEYS[modality])
        if unknown:
            raise ValueError(f"media_io_kwargs[{modality!r}]: unknown key(s) {unknown} (read: "
                             f"{sorted(MEDIA_IO_KEYS[modality])})")
        n = opts.get("num_frames", -1)
        if not isinstance(n, int) or isinstance(n, bool) or not (n == -1 or n > 0):
            raise ValueError(f"media_io_kwargs[\"video\"][\"num_frames\"] must be a positive int or -1 "
                             f"(every frame), got {n!r}")
        fps = opts.get("fps", -1)
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or not (fps == -1 or fps > 0):
            raise ValueError(f"media_io_kwargs[\"video\"][\"fps\"] must be a positive number or -1 "
                             f"(no fps cap), got {fps!r}")
    return {k: dict(v) for k, v in kwargs.items()}


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout: float = field(default_factory=envs.media_fetch_timeout)
    max_bytes: int = field(default_factory=envs.media_max_bytes)
    video_fetch_timeout: float = field(default_factory=envs.video_fetch_timeout)
    video_max_bytes: int = field(default_factory=envs.video_max_bytes)
    audio_fetch_timeout: float = field(default_factory=envs.audio_fetch_timeout)
    media_io_kwargs: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "media_io_kwargs", check_media_io_kwargs(self.media_io_kwargs))
        path = self.allowed_local_media_path
        if path is not None:
            if not isinstance(path, str) or not os.path.isdir(path):
                raise ValueError(f"allowed_local_media_path must be an existing folder, got {path!r}")
            object.__setattr__(self, "allowed_local_media_path", os.path.realpath(path))
        domains = self.allowed_media_domains
        if domains is not None:
            if isinstance(domains, str) or not all(isinstance(d, str) and d for d in domains):
                raise ValueError(f"allowed_media_domains must be a list of host names, got {domains!r}")
            object.__setattr__(self, "allowed_media_domains", tuple(d.lower() for d in domains))


def decode_image_bytes(raw: bytes, i: int) -> Any:
    """An image's encoded bytes as a decoded PIL image; a ValueError naming what is wrong."""
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("image input needs Pillow (pip install pillow)") from None
    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
    except Exception as e:  # Pillow's own words: UnidentifiedImageError, truncated files, bombs
        raise ValueError(f"image {i} could not be decoded: {e}") from None
    return img


_EXAMPLES = {"image": "data:image/png;base64,...", "video": "data:video/mp4;base64,...",
             "audio": "data:audio/wav;base64,..."}


def data_url_bytes(url: str, i: int, kind: str = "image") -> bytes:
    """A base64 data URL's bytes (its media type, where given, ``kind``/...: image/png for
    an image, video/mp4 for a video, audio/wav for an audio); a ValueError naming item ``i``
    of ``kind``."""
    example = _EXAMPLES[kind]
    m = _DATA_URL.match(url)
    if m is None:
        raise ValueError(f"{kind} {i}: a data URL must be base64 ({example}), got {url[:40]!r}")
    if m.group(1) is not None and m.group(1).lower() != kind:
        raise ValueError(f"{kind} {i}: a data URL of type {(m.group(1) + (m.group(2) or ''))!r} given "
                         f"as {'a' if kind == 'video' else 'an'} {kind} ({example})")
    try:
        return base64.b64decode(m.group(4), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{kind} {i}: its data URL is not valid base64: {e}") from None


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host."""

    def __init__(self, policy: MediaPolicy, who: str) -> None:
        self.policy, self.who = policy, who

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        _check_host(newurl, self.policy, self.who, "redirected to")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_host(url: str, policy: MediaPolicy, who: str, how: str = "") -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{who}: {how + ' ' if how else ''}{url[:60]!r}: only http(s) URLs are fetched")
    host = (parts.hostname or "").lower()
    allowed = policy.allowed_media_domains
    if allowed is not None and host not in allowed:
        raise ValueError(f"{who}: {how + ' ' if how else ''}host {host!r} is not in "
                         f"allowed_media_domains {list(allowed)}")


def _limits(policy: MediaPolicy, kind: str) -> tuple[int, float, str]:
    """(the most bytes, the fetch timeout, the variable naming the byte cap) for ``kind``."""
    if kind == "video":
        return policy.video_max_bytes, policy.video_fetch_timeout, "FLASHPAGE_VIDEO_MAX_BYTES"
    if kind == "audio":
        return policy.max_bytes, policy.audio_fetch_timeout, "FLASHPAGE_MEDIA_MAX_BYTES"
    return policy.max_bytes, policy.fetch_timeout, "FLASHPAGE_MEDIA_MAX_BYTES"


def given_bytes(raw: bytes | bytearray | memoryview, i: int, policy: MediaPolicy, kind: str) -> bytes:
    """A ``kind`` file's bytes given as such (not a URL), held to the byte cap its URL
    would be (``_limits``)."""
    limit, _, env = _limits(policy, kind)
    raw = bytes(raw)
    if len(raw) > limit:
        raise ValueError(f"{kind} {i}: {len(raw)} bytes given, more than {limit} ({env})")
    return raw


def _fetch(url: str, who: str, policy: MediaPolicy, kind: str) -> bytes:
    _check_host(url, policy, who)
    max_bytes, timeout, var = _limits(policy, kind)
    opener = urllib.request.build_opener(_Redirects(policy, who))
    req = urllib.request.Request(url, headers={"User-Agent": "flashpage"})
    try:
        with opener.open(req, timeout=timeout) as resp:
            raw = resp.read(max_bytes + 1)
    except ValueError:
        raise
    except urllib.error.HTTPError as e:
        raise ValueError(f"{who}: fetching {url[:80]!r} failed: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(f"{who}: fetching {url[:80]!r} failed: {reason}") from None
    if len(raw) > max_bytes:
        raise ValueError(f"{who}: {url[:80]!r} holds more than {max_bytes} bytes ({var})")
    return raw


def read_local_file(path: str, who: str, policy: MediaPolicy, kind: str) -> bytes:
    """A local file's bytes within the byte cap of ``kind`` (no folder check: ``_read_file``'s)."""
    max_bytes, _, var = _limits(policy, kind)
    try:
        size = os.path.getsize(path)
        if size > max_bytes:
            raise ValueError(f"{who}: {path!r} holds more than {max_bytes} bytes ({var})")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{who}: {path!r} could not be read: {e.strerror or e}") from None


def _read_file(url: str, who: str, policy: MediaPolicy, kind: str) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise ValueError(f"{who}: file:// URLs are read only under allowed_local_media_path "
                         "(--allowed-local-media-path), which is not set")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{who}: a file:// URL names a file on this machine, got host {parts.netloc!r}")
    path = os.path.realpath(urllib.parse.unquote(parts.path))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"{who}: {path!r} is not under allowed_local_media_path {root!r}")
    return read_local_file(path, who, policy, kind)


def url_scheme(url: str) -> str:
    """A URL's scheme, lower case ("" where it has none)."""
    return url.split(":", 1)[0].lower() if ":" in url[:12] else ""


def read_url(url: str, i: int, policy: MediaPolicy | None = None, kind: str = "image") -> bytes:
    """Item ``i`` of ``kind`` ("image", "video" or "audio") of a request: its URL's bytes (module
    docstring), within the policy's rules and ``kind``'s byte cap and timeout; a ValueError
    naming what is wrong."""
    policy = policy or MediaPolicy()
    who = f"{kind} {i}"
    scheme = url_scheme(url)
    if scheme == "data":
        raw = data_url_bytes(url, i, kind)
        max_bytes, _, var = _limits(policy, kind)
        if len(raw) > max_bytes:
            raise ValueError(f"{who}: its data URL holds more than {max_bytes} bytes ({var})")
        return raw
    if scheme in ("http", "https"):
        return _fetch(url, who, policy, kind)
    if scheme == "file":
        return _read_file(url, who, policy, kind)
    example = _EXAMPLES[kind]
    raise ValueError(f"{who}: its url must be a data URL ({example}), an http(s) URL or a file:// "
                     f"URL, got {url[:40]!r}")


def load_image(url: str, i: int, policy: MediaPolicy | None = None) -> Any:
    """Image ``i`` of a request from its URL (module docstring) as a decoded PIL image; a
    ValueError naming what is wrong."""
    return decode_image_bytes(read_url(url, i, policy, "image"), i)
