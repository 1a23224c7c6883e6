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
from typing import Any

from flashpage.engine import multimodal
from flashpage.server.protocol import APIError, ChatMessage, ImagePart, TextPart, bad_request

FIELD = "messages"


def image_urls(messages: list[ChatMessage]) -> list[str]:
    """The url of every image part, in the conversation's order."""
    return [p.image_url.url for m in messages if isinstance(m.content, list)
            for p in m.content if isinstance(p, ImagePart)]


def decode_data_url(url: str, i: int) -> Any:
    """A data URL's image as a decoded PIL image; an APIError (400) naming what is wrong
    (engine/multimodal.py's decoding, which LLM.chat shares)."""
    try:
        return multimodal.decode_data_url(url, i)
    except ValueError as e:
        raise bad_request(str(e), FIELD) from None


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
    where the chat template reads them (engine/multimodal.place_images)."""
    parts: list[multimodal.Parts | None] = [
        [("text", p.text) if isinstance(p, TextPart) else ("image", None) for p in m.content]
        if isinstance(m.content, list) else None for m in messages]
    return multimodal.place_images(conv, parts, template, placeholder)


__all__ = ["APIError", "decode_data_url", "image_urls", "read_images", "with_placeholders"]
