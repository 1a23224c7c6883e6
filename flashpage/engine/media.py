"""Images by URL, as vLLM reads them: a chat message's ``image_url`` (on the server and in
``LLM.chat``) may be a base64 data URL, an http(s) URL (fetched) or a ``file://`` URL (read,
only under ``allowed_local_media_path``).

``MediaPolicy`` holds what a deployment allows (vLLM's flags of the same names):

- ``allowed_local_media_path``: the folder whose files ``file://`` URLs may name (None: no
  file URL is read). The path is resolved (symlinks, ``..``) before the check.
- ``allowed_media_domains``: the host names http(s) URLs may name, exactly (None: any);
  a redirect is followed only to an allowed host.
- ``fetch_timeout`` seconds a fetch may take (``FLASHPAGE_MEDIA_FETCH_TIMEOUT``, default 5,
  vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``), ``max_bytes`` an image's encoded bytes may hold
  (``FLASHPAGE_MEDIA_MAX_BYTES``, default 32 MiB; Pillow's decompression-bomb check guards
  the decoded size).

Every failure is a ValueError naming the image (its index in the request) and what is
wrong, which the server answers with a 400.
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

_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?(;[^,]*)?;base64,(.*)$", re.DOTALL)


@dataclass(frozen=True)
class MediaPolicy:
    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout: float = field(default_factory=envs.media_fetch_timeout)
    max_bytes: int = field(default_factory=envs.media_max_bytes)

    def __post_init__(self) -> None:
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


def data_url_bytes(url: str, i: int) -> bytes:
    m = _DATA_URL.match(url)
    if m is None:
        raise ValueError(f"image {i}: a data URL must be base64 (data:image/png;base64,...), got {url[:40]!r}")
    try:
        return base64.b64decode(m.group(3), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"image {i}: its data URL is not valid base64: {e}") from None


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host."""

    def __init__(self, policy: MediaPolicy, i: int) -> None:
        self.policy, self.i = policy, i

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        _check_host(newurl, self.policy, self.i, "redirected to")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _check_host(url: str, policy: MediaPolicy, i: int, how: str = "") -> None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"image {i}: {how + ' ' if how else ''}{url[:60]!r}: only http(s) URLs are fetched")
    host = (parts.hostname or "").lower()
    allowed = policy.allowed_media_domains
    if allowed is not None and host not in allowed:
        raise ValueError(f"image {i}: {how + ' ' if how else ''}host {host!r} is not in "
                         f"allowed_media_domains {list(allowed)}")


def _fetch(url: str, i: int, policy: MediaPolicy) -> bytes:
    _check_host(url, policy, i)
    opener = urllib.request.build_opener(_Redirects(policy, i))
    req = urllib.request.Request(url, headers={"User-Agent": "flashpage"})
    try:
        with opener.open(req, timeout=policy.fetch_timeout) as resp:
            raw = resp.read(policy.max_bytes + 1)
    except ValueError:
        raise
    except urllib.error.HTTPError as e:
        raise ValueError(f"image {i}: fetching {url[:80]!r} failed: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(f"image {i}: fetching {url[:80]!r} failed: {reason}") from None
    if len(raw) > policy.max_bytes:
        raise ValueError(f"image {i}: {url[:80]!r} holds more than {policy.max_bytes} bytes "
                         "(FLASHPAGE_MEDIA_MAX_BYTES)")
    return raw


def _read_file(url: str, i: int, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise ValueError(f"image {i}: file:// URLs are read only under allowed_local_media_path "
                         "(--allowed-local-media-path), which is not set")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"image {i}: a file:// URL names a file on this machine, got host {parts.netloc!r}")
    path = os.path.realpath(urllib.parse.unquote(parts.path))
    if os.path.commonpath([root, path]) != root:
        raise ValueError(f"image {i}: {path!r} is not under allowed_local_media_path {root!r}")
    try:
        size = os.path.getsize(path)
        if size > policy.max_bytes:
            raise ValueError(f"image {i}: {path!r} holds more than {policy.max_bytes} bytes "
                             "(FLASHPAGE_MEDIA_MAX_BYTES)")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"image {i}: {path!r} could not be read: {e.strerror or e}") from None


def load_image(url: str, i: int, policy: MediaPolicy | None = None) -> Any:
    """Image ``i`` of a request from its URL (module docstring) as a decoded PIL image; a
    ValueError naming what is wrong."""
    policy = policy or MediaPolicy()
    scheme = url.split(":", 1)[0].lower() if ":" in url[:12] else ""
    if scheme == "data":
        raw = data_url_bytes(url, i)
    elif scheme in ("http", "https"):
        raw = _fetch(url, i, policy)
    elif scheme == "file":
        raw = _read_file(url, i, policy)
    else:
        raise ValueError(f"image {i}: its url must be a data URL (data:image/png;base64,...), an "
                         f"http(s) URL or a file:// URL, got {url[:40]!r}")
    return decode_image_bytes(raw, i)
