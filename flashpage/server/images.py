"""Chat messages' image parts (OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``)
for a model that takes images (LLaVA: models/llava.py), and video parts (vLLM's
``{"type": "video_url", "video_url": {"url": ...}}``) for one that takes videos (Qwen2-VL /
Qwen2.5-VL / Qwen3-VL, LLaVA-OneVision).

The url is a base64 data URL, an http(s) URL (fetched, from the hosts
``--allowed-media-domains`` names if given) or a ``file://`` URL under
``--allowed-local-media-path`` (engine/media.py; anything else a 400 naming it). Each image
is fetched, decoded (Pillow) and preprocessed to pixel values off the event loop and off
the engine thread (a worker thread), then handed to the engine as ``multi_modal_data``. In
the conversation the chat template sees, each image part becomes the template's image
placeholder: a part ``{"type": "image"}`` where the template loops over a message's content
parts (llava-hf's templates), else the placeholder text (the image token's, ``<image>``) on
its own line before the message's text (vLLM's "string" content format).

An audio part (vLLM's ``{"type": "audio_url", "audio_url": {"url": ...}}`` by the same URL
rules, ``FLASHPAGE_AUDIO_FETCH_TIMEOUT``; OpenAI's ``{"type": "input_audio", "input_audio":
{"data": base64, "format": "wav"}}``) for a model that takes audio (Qwen2-Audio) is decoded by
engine/audio_io.py and admitted by the encoder (resampled to its rate, its length checked)
on a worker thread; its placeholder is the template's audio part (Qwen2-Audio's "Audio k:
<|audio_bos|><|AUDIO|><|audio_eos|>").

A video's url is read under the same rules (its own byte cap and timeout,
``FLASHPAGE_VIDEO_MAX_BYTES`` / ``FLASHPAGE_VIDEO_FETCH_TIMEOUT``), decoded and sampled by
engine/video_io.py (PyAV; ``--media-io-kwargs``) and, where the encoder has ``admit_video``
(Qwen's), resized, on the same worker thread; its placeholder is the template's video one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from flashpage.engine import multimodal
from flashpage.engine.media import MediaPolicy
from flashpage.server.protocol import (
    APIError,
    AudioURLPart,
    ChatMessage,
    ImagePart,
    InputAudioPart,
    TextPart,
    VideoPart,
    bad_request,
)

FIELD = "messages"


def image_urls(messages: list[ChatMessage]) -> list[str]:
    """The url of every image part, in the conversation's order."""
    return [p.image_url.url for m in messages if isinstance(m.content, list)
            for p in m.content if isinstance(p, ImagePart)]


def video_urls(messages: list[ChatMessage]) -> list[str]:
    """The url of every video part, in the conversation's order."""
    return [p.video_url.url for m in messages if isinstance(m.content, list)
            for p in m.content if isinstance(p, VideoPart)]


def audio_parts(messages: list[ChatMessage]) -> list[AudioURLPart | InputAudioPart]:
    """Every audio part (audio_url, input_audio), in the conversation's order."""
    return [p for m in messages if isinstance(m.content, list)
            for p in m.content if isinstance(p, (AudioURLPart, InputAudioPart))]


def read_audio_parts(encoder: Any, parts: list[AudioURLPart | InputAudioPart],
                     policy: MediaPolicy | None = None) -> list[Any]:
    """Each audio part read and decoded (engine/audio_io.py) and admitted by the encoder (its
    waveform at the model's rate, its length checked); a 400 naming what is wrong."""
    from flashpage.engine.audio_io import load_audio, load_input_audio

    out = []
    for i, p in enumerate(parts):
        try:
            pair = load_audio(p.audio_url.url, i, policy) if isinstance(p, AudioURLPart) else \
                load_input_audio(p.input_audio.data, p.input_audio.format, i, policy)
            out.append(encoder.admit_audio(pair, i))
        except ValueError as e:
            raise bad_request(str(e), FIELD) from None
    return out


async def read_audios(encoder: Any, parts: list[AudioURLPart | InputAudioPart],
                      policy: MediaPolicy | None = None) -> list[Any]:
    """``read_audio_parts`` on a worker thread (a fetch, a decode and a resampling)."""
    return await asyncio.get_running_loop().run_in_executor(None, read_audio_parts, encoder, parts, policy)


def read_video_urls(encoder: Any, urls: list[str], policy: MediaPolicy | None = None,
                    vision: Any = None) -> list[Any]:
    """Each url's video read, decoded and sampled (engine/video_io.py: frames and metadata)
    and, where the encoder has ``admit_video``, preprocessed as a request keeps it; a 400
    naming what is wrong."""
    from flashpage.engine.video_io import load_video

    out = []
    admit = getattr(encoder, "admit_video", None)
    for i, url in enumerate(urls):
        try:
            video: Any = load_video(url, i, policy)
            if admit is not None:
                video = admit(video, i) if vision is None else admit(video, i, vision)
        except ValueError as e:
            raise bad_request(str(e), FIELD) from None
        out.append(video)
    return out


async def read_videos(encoder: Any, urls: list[str], policy: MediaPolicy | None = None,
                      vision: Any = None) -> list[Any]:
    """``read_video_urls`` on a worker thread (a fetch and a decode take up to seconds)."""
    return await asyncio.get_running_loop().run_in_executor(None, read_video_urls, encoder, urls, policy,
                                                            vision)


def decode_data_url(url: str, i: int, policy: MediaPolicy | None = None) -> Any:
    """Image ``i``'s url read and decoded (a PIL image); an APIError (400) naming what is
    wrong (engine/media.py's reading, which LLM.chat shares)."""
    try:
        return multimodal.decode_data_url(url, i, policy)
    except ValueError as e:
        raise bad_request(str(e), FIELD) from None


def pixel_values(encoder: Any, urls: list[str], policy: MediaPolicy | None = None,
                 vision: Any = None) -> list[Any]:
    """Each url's image read, decoded and preprocessed (``encoder.admit_image``: what a
    request keeps of it, where the encoder has one, else ``pixel_values``); ``vision``: the
    request's processing settings (its mm_processor_kwargs; None: the server's)."""
    out = []
    prepare = getattr(encoder, "admit_image", None) or encoder.pixel_values
    for i, url in enumerate(urls):
        img = decode_data_url(url, i, policy)
        try:
            out.append(prepare(img, i) if vision is None else prepare(img, i, vision))
        except ValueError as e:
            raise bad_request(str(e), FIELD) from None
    return out


async def read_images(encoder: Any, urls: list[str], policy: MediaPolicy | None = None,
                      vision: Any = None) -> list[Any]:
    """``pixel_values`` on a worker thread (fetching, decoding and resizing take milliseconds
    to seconds: not on the event loop, nor between the engine's steps)."""
    return await asyncio.get_running_loop().run_in_executor(None, pixel_values, encoder, urls, policy,
                                                            vision)


def _kind(p: Any) -> str:
    if isinstance(p, VideoPart):
        return "video"
    return "audio" if isinstance(p, (AudioURLPart, InputAudioPart)) else "image"


def with_placeholders(conv: list[dict[str, Any]], messages: list[ChatMessage],
                      template: str | None, placeholder: str,
                      video_placeholder: str | None = None,
                      audio_placeholder: Any = None) -> list[dict[str, Any]]:
    """``conv`` (server/tool_choice.conversation's) with each message's image, video and
    audio parts put back where the chat template reads them (engine/multimodal.place_images)."""
    parts: list[multimodal.Parts | None] = [
        [("text", p.text) if isinstance(p, TextPart) else (_kind(p), None) for p in m.content]
        if isinstance(m.content, list) else None for m in messages]
    return multimodal.place_images(conv, parts, template, placeholder, video_placeholder, audio_placeholder)


__all__ = ["APIError", "audio_parts", "decode_data_url", "image_urls", "read_audios", "read_images",
           "read_videos", "video_urls", "with_placeholders"]
