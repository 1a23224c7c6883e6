"""Chat messages' image parts (OpenAI's ``{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}``) for a model that takes images (LLaVA: models/llava.py).

Only data URLs are read: the server fetches nothing from the network (an http(s) URL is a
400 saying so). Each image is decoded (Pillow) and preprocessed to pixel values off the
event loop and off the engine thread (a worker thread), then handed to the engine as
``multi_modal_data``. In the conversation the chat template sees, each image part becomes
the template's image placeholder: a part ``{"type": "image"}`` where the template loops
over a message's content parts (llava-hf's templates), else the placeholder text (the
image token's, ``<image>``) on its own line before the message's text (vLLM's "string"
content format).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import re
from typing import Any

from flashpage.engine.multimodal import as_text_parts, template_reads_parts
from flashpage.server.protocol import APIError, ChatMessage, ImagePart, TextPart, bad_request

FIELD = "messages"
_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?(;[^,]*)?;base64,(.*)$", re.DOTALL)


def image_urls(messages: list[ChatMessage]) -> list[str]:
    """The url of every image part, in the conversation's order."""
    return [p.image_url.url for m in messages if isinstance(m.content, list)
            for p in m.content if isinstance(p, ImagePart)]


def decode_data_url(url: str, i: int) -> Any:
    """A data URL's image as a decoded PIL image; an APIError (400) naming what is wrong."""
    if re.match(r"^https?://", url, re.IGNORECASE):
        raise bad_request(f"image {i}: only data URLs (data:image/png;base64,...) are read: this "
                          "server fetches nothing from the network, so an http(s) URL cannot "
                          "be used; send the image's bytes as a base64 data URL", FIELD)
    m = _DATA_URL.match(url)
    if m is None:
        raise bad_request(f"image {i}: its url must be a base64 data URL "
                          f"(data:image/png;base64,...), got {url[:40]!r}", FIELD)
    try:
        raw = base64.b64decode(m.group(3), validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(f"image {i}: its data URL is not valid base64: {e}", FIELD) from None
    try:
        from PIL import Image
    except ImportError:
        raise bad_request("image input needs Pillow on the server (pip install pillow)", FIELD) from None
    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
    except Exception as e:  # Pillow's own words: UnidentifiedImageError, truncated files, bombs
        raise bad_request(f"image {i} could not be decoded: {e}", FIELD) from None
    return img


def pixel_values(encoder: Any, urls: list[str]) -> list[Any]:
    """Each url's image decoded and preprocessed (``encoder.pixel_values``)."""
    out = []
    for i, url in enumerate(urls):
        img = decode_data_url(url, i)
        try:
            out.append(encoder.pixel_values(img, i))
        except ValueError as e:
            raise bad_request(str(e), FIELD) from None
    return out


async def read_images(encoder: Any, urls: list[str]) -> list[Any]:
    """``pixel_values`` on a worker thread (decoding and resizing take milliseconds to
    seconds: not on the event loop, nor between the engine's steps)."""
    return await asyncio.get_running_loop().run_in_executor(None, pixel_values, encoder, urls)


def with_placeholders(conv: list[dict[str, Any]], messages: list[ChatMessage],
                      template: str | None, placeholder: str) -> list[dict[str, Any]]:
    """``conv`` (server/tool_choice.conversation's) with each message's image parts put back
    where the chat template reads them (module docstring)."""
    as_parts = template_reads_parts(template)
    out = []
    for d, m in zip(conv, messages, strict=True):
        if not isinstance(m.content, list) or not any(isinstance(p, ImagePart) for p in m.content):
            out.append(as_text_parts([d])[0] if as_parts else d)
            continue
        if as_parts:
            parts: list[dict[str, Any]] = [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                                           else {"type": "image"} for p in m.content]
            out.append({**d, "content": parts})
        else:
            n = sum(isinstance(p, ImagePart) for p in m.content)
            out.append({**d, "content": "\n".join([placeholder] * n + [d["content"]])})
    return out


__all__ = ["APIError", "decode_data_url", "image_urls", "read_images", "with_placeholders"]
