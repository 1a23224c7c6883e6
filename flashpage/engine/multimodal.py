"""Multimodal rows: prompt positions whose input embeddings an encoder gives (an image's
``<image>`` positions, an audio's ``<|AUDIO|>``: models/qwen2_audio.py), the rest of the
prompt embedded as tokens.

A model that takes such inputs has an encoder beside it (LLaVA's: models/llava.py
LlavaImageEncoder) with two hooks, the whole of what the engine asks of a family:

- ``prepare(ids, multi_modal_data) -> (ids, [MultiModalInput])``, on the host at
  admission (add_request): checks and preprocesses the data, expands each placeholder
  token to its rows' count (the prompt's ids then say where each input's rows go); Qwen2-VL's
  and Gemma 3's also take ``vision``, a request's own mm_processor_kwargs
  (config.request_mm_processing);
- ``encode([data]) -> [rows]``, on the device: a batch of inputs to their rows
  ``[length, hidden]``.

The request keeps its inputs (``Request.mm_inputs``). The model runner encodes an input the
first time a step schedules one of its positions (a step's pending inputs in batches of at
most max_num_batched_tokens rows, ``encode_pending``: the memory the engine reserved for an
encoder call; an input whose positions all came from the prefix cache is never encoded), keeps its
rows on the request (on the device; the pixel data is dropped), and gives the model each
step's slice of them as InputEmbeds, spliced over the token embeddings as a prompt given as
embeddings is (engine/prompt_embeds.py). Chunked prefill takes any slice of an input's rows;
a preempted request keeps them and recomputes from position 0 without encoding again.

Prefix caching: ``chain_digest`` of a request's inputs (each input's offset, length and
data digest) is spliced into its block-hash chain at the block holding the first input's
first position (kv_cache/prefix_cache.py, ``chain``): the blocks before it are plain text
blocks, shared with text-only requests and with requests of other images (a system prompt,
a conversation's earlier text turns), as vLLM does; from that block on, blocks are shared
only between requests with the same inputs at the same positions, so no block holding one
image's K/V (or text after it) reaches a request with another.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from flashpage.engine.media import MediaPolicy, load_image

if TYPE_CHECKING:
    from flashpage.engine.encoder_cache import EncoderCache


@dataclass(eq=False)
class MultiModalInput:
    """One input's rows in a request's prompt: positions ``[offset, offset + length)``.
    ``data``: what the encoder takes (LLaVA: an image's pixel values [3, S, S] on the host;
    LLaVA-NeXT: its tiles' and its size, models/llava_next.AnyResImage; Qwen2-VL: its patches
    and grid), None once encoded; ``rows``: the encoder's output [length, hidden] on the
    device, kept for the request's life (preemption recomputes from it); ``digest``: the
    data's identity; ``grid``: for a model with M-RoPE (Qwen2-VL), the rows' (t, h, w)
    grid, row-major, whose 3-D positions they take (engine/mrope.py; a video's t > 1);
    ``bidirectional``: its positions attend to each other both ways in the prefill
    (Gemma 3's images): a prompt chunk never ends inside it (engine/scheduler.py
    ``chunk_tokens``), and attention recomputes its query rows with that mask
    (attention/bidirectional.py)."""

    offset: int
    length: int
    digest: bytes
    data: Any
    rows: torch.Tensor | None = None
    grid: tuple[int, int, int] | None = None
    time_step: float | None = None  # a Qwen2.5-VL video's temporal position step (engine/mrope.py)
    bidirectional: bool = False
    # Qwen3-VL's deepstack features [length, k, hidden] on the device, kept with ``rows``:
    # row j's k-th is added to the hidden state of its position after decoder layer k
    # (models/common.DecoderStack; ``step_rows``' slice of them each step)
    deepstack: torch.Tensor | None = None


class MultiModalEncoder(Protocol):
    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]: ...

    # each input's rows, or (rows, deepstack features [length, k, hidden]): Qwen3-VL's
    def encode(self, data: list[Any]) -> Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]: ...

    # optional: activation_bytes(rows) -> the most bytes an encode call of inputs totalling
    # ``rows`` rows adds while it runs (LLMEngine reserves it beside the KV cache)


def placeholder_ids(encoder: Any) -> list[int]:
    """The ids a chat turn's image part becomes in a chat template that prints text (vLLM's
    "string" content format): the encoder's ``placeholder_ids`` (Qwen2-VL's
    <|vision_start|><|image_pad|><|vision_end|>), else its image token alone (``<image>``)."""
    ids = getattr(encoder, "placeholder_ids", None)
    return list(ids) if ids is not None else [encoder.config.image_token_id]


def enc_token_name(encoder: Any) -> str:
    """The image token's name in errors."""
    name = getattr(encoder, "token_name", None)
    if name is not None:
        return str(name)
    return "<|image_pad|>" if getattr(encoder, "placeholder_ids", None) is not None else "<image>"


MODALITIES = ("image", "video", "audio")  # what limit_mm_per_prompt may name (audio: Qwen2-Audio's)


def check_limits(limits: Any) -> dict[str, int]:
    """vLLM's ``limit_mm_per_prompt`` ({"image": 2}; None: no limit) checked: a ValueError
    naming a bad key or count."""
    if limits is None:
        return {}
    if not isinstance(limits, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict such as {{\"image\": 2}}, got {limits!r}")
    for k, v in limits.items():
        if k not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {k!r} (use {', '.join(MODALITIES)})")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"limit_mm_per_prompt[{k!r}] must be a non-negative int, got {v!r}")
    return dict(limits)


def count_items(data: Any, modality: str) -> int:
    """How many items of ``modality`` a request's multi_modal_data holds (a list, or one
    item; a 4-d tensor is a batch of images, one video: ``video_items``)."""
    if not isinstance(data, dict) or modality not in data:
        return 0
    given = data[modality]
    if modality == "video":
        return len(video_items(given))
    if modality == "audio":
        from flashpage.engine.audio_io import audio_items

        return len(audio_items(given))
    if isinstance(given, torch.Tensor):
        return given.shape[0] if given.dim() == 4 else 1
    return len(given) if isinstance(given, (list, tuple)) else 1


def _is_video_metadata_pair(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], dict)


def _is_frame_stack(x: Any) -> bool:
    """One video given whole: an array / tensor of frames (T, H, W, 3), or a (frames,
    metadata) pair."""
    return _is_video_metadata_pair(x) or (hasattr(x, "ndim") and hasattr(x, "shape") and x.ndim == 4)


def video_items(given: Any) -> list[Any]:
    """vLLM's forms of multi_modal_data["video"] as a list of videos: one video (an array /
    tensor of frames (T, H, W, 3), a (frames, metadata) pair, a list of frames: PIL images
    or (H, W, 3) arrays, or a video file: its path or URL, or its bytes, engine/video_io.py),
    or a list of videos (each an array, a pair, a list of frames or a file).
    What each video holds is checked where it is read (models/qwen2_vl_video.py)."""
    if _is_frame_stack(given) or _is_file(given):
        return [given]
    if isinstance(given, (list, tuple)):
        if given and all(not _is_frame(v) for v in given):
            return list(given)
        return [given]
    return [given]


def _is_file(x: Any) -> bool:
    return isinstance(x, (str, bytes, bytearray, memoryview))


def _is_frame(x: Any) -> bool:
    """One frame of a video given as a list of frames: a PIL image or an (H, W, 3) array;
    anything else in a list is a video of its own (frames, a file, an encoder's admitted
    video: the server's, server/images.py)."""
    return type(x).__module__.startswith("PIL.") or (hasattr(x, "ndim") and x.ndim == 3)


def token_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token`` in ``ids``: where a prompt's placeholders
    (expanded or not) sit (models/llava.py, qwen2_vl.py)."""
    runs: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def expand_tokens(ids: list[int], token: int, counts: list[int], name: str, what: str
                  ) -> tuple[list[int], list[int]]:
    """A prompt's ids with its k-th ``token`` (``name``: its text, ``what``: the item kind in
    errors) made ``counts[k]`` of them, as a processor writes it (LlavaProcessor's
    <image>, Qwen2AudioProcessor's <|AUDIO|>), and each item's first position in the
    result. Ids already expanded (the runs of ``token`` exactly the items' counts) are kept
    as they are. A ValueError names a count that does not match the items'."""
    runs = token_runs(ids, token)  # (start, length) of each run of the token
    total = sum(n for _, n in runs)
    if len(runs) == len(counts) and any(c > 1 for c in counts) \
            and all(n == c for (_, n), c in zip(runs, counts, strict=True)):
        return list(ids), [s for s, _ in runs]  # expanded already
    if total != len(counts):
        raise ValueError(
            f"the prompt has {total} {what} token(s) ({name}, id {token}) but "
            f"{len(counts)} {what}(s) were given: put one {name} in the prompt per {what}")
    out: list[int] = []
    starts: list[int] = []
    for t in ids:
        if t == token:
            starts.append(len(out))
            out.extend([token] * counts[len(starts) - 1])
        else:
            out.append(t)
    return out, starts


def expand_beside_frames(ids: list[int], token: int, name: str, is_frame: Callable[[int, int], bool],
                         frame_form: str, images: list[Any], frames: int,
                         expand_image: Callable[[Any], tuple[list[int], list[int]]]
                         ) -> tuple[list[int], list[tuple[int, bool]]]:
    """A prompt whose videos' frames are written out already (InternVL's, SmolVLM2's: each
    frame's text around a tile's run of ``token``) and whose images are one ``token`` each:
    the ids with each image made ``expand_image(image)`` (its ids, its inputs' first rows
    within them), the frames kept, and each input's first row position with whether it is a
    frame, in prompt order. ``is_frame(start, length)``: whether a run is a written-out
    frame (``frame_form`` says what one looks like, ``name`` the token's text). A ValueError
    names a run that is neither, or counts other than the items' (``frames`` frames in all,
    ``images`` the images)."""
    marks: list[tuple[int, int, bool]] = []  # (start, length, frame)
    for s, n in token_runs(ids, token):
        if is_frame(s, n):
            marks.append((s, n, True))
        elif n == 1:
            marks.append((s, n, False))
        else:
            raise ValueError(f"the prompt has a run of {n} {name} (id {token}) at position {s}: with a "
                             f"video, an image is one {name} (expanded here) and a frame {frame_form}")
    n_frames = sum(f for _, _, f in marks)
    n_images = len(marks) - n_frames
    if n_frames != frames or n_images != len(images):
        hint = " (a text prompt's <video> is written out as its frames here; in token ids write them out)" \
            if n_frames == 0 else ""
        raise ValueError(f"the prompt has {n_frames} video frame(s) and {n_images} image token(s) "
                         f"({name}, id {token}) but {frames} frame(s) (the videos') and "
                         f"{len(images)} image(s) were given{hint}")
    out: list[int] = []
    starts: list[tuple[int, bool]] = []
    given = iter(images)
    last = 0
    for s, n, frame in marks:
        out += ids[last:s]
        if frame:
            starts.append((len(out), True))
            out += ids[s:s + n]
        else:
            exp, at = expand_image(next(given))
            starts += [(len(out) + a, False) for a in at]
            out += exp
        last = s + n
    out += ids[last:]
    return out, starts


def bidirectional_runs(inputs: list[MultiModalInput], start: int, end: int
                       ) -> list[tuple[int, int, int, int]]:
    """For a step computing positions ``[start, end)``: each bidirectional input's
    (first position within the step's range, rows, the input's first position, its end)."""
    out = []
    for mi in overlapping(inputs, start, end):
        if mi.bidirectional:
            a, b = max(start, mi.offset), min(end, mi.offset + mi.length)
            out.append((a, b - a, mi.offset, mi.offset + mi.length))
    return out


def chain_digest(inputs: list[MultiModalInput]) -> bytes:
    """32 bytes naming a request's inputs where they sit: the root of its prefix-cache
    chain (module docstring)."""
    h = hashlib.blake2b(b"multimodal", digest_size=32)
    for mi in inputs:
        h.update(struct.pack("<qq", mi.offset, mi.length) + mi.digest)
    return h.digest()


def encode_pending(encoder: MultiModalEncoder, inputs: list[MultiModalInput], max_rows: int | None = None,
                   cache: EncoderCache | None = None) -> None:
    """Encode ``inputs`` (not yet encoded) in batches of at most ``max_rows`` rows (None: one
    batch; an input longer than that alone), so that the encoder's activations stay within
    what the engine reserved for them (LLMEngine._encoder_bytes); each input keeps its rows
    and drops its data. Inputs of the same data (digest and length: one image in two
    requests) are encoded once and share the rows; with ``cache`` (engine/encoder_cache.py)
    an input encoded before takes its rows from there, and what is encoded now is kept."""
    same: dict[tuple[bytes, int], list[MultiModalInput]] = {}
    todo: list[MultiModalInput] = []
    for mi in inputs:
        key = (mi.digest, mi.length)
        if key in same:
            same[key].append(mi)
            continue
        hit = cache.get(key) if cache is not None else None
        if hit is not None:
            mi.rows, mi.deepstack, mi.data = hit[0], hit[1], None
            continue
        same[key] = [mi]
        todo.append(mi)
    batches: list[list[MultiModalInput]] = []
    rows_in = 0
    for mi in todo:
        if not batches or (max_rows is not None and rows_in + mi.length > max_rows):
            batches.append([])
            rows_in = 0
        batches[-1].append(mi)
        rows_in += mi.length
    for batch in batches:
        rows = encoder.encode([mi.data for mi in batch if mi.data is not None])
        if len(rows) != len(batch):
            raise RuntimeError(f"the encoder gave {len(rows)} outputs for {len(batch)} inputs")
        for mi, out in zip(batch, rows, strict=True):
            r: torch.Tensor
            deep: torch.Tensor | None = None
            if isinstance(out, tuple):  # with its deepstack features (Qwen3-VL)
                r, deep = out
            else:
                r = out
            if r.shape[0] != mi.length or (deep is not None and deep.shape[0] != mi.length):
                raise RuntimeError(f"the encoder gave {r.shape[0]} rows for an input of {mi.length} positions")
            key = (mi.digest, mi.length)
            if cache is not None:  # its own storage, not a view holding the whole batch's output
                r, deep = _own(r), None if deep is None else _own(deep)
                cache.put(key, r, deep)
            for m in same[key]:
                m.rows, m.deepstack, m.data = r, deep, None


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied where it is a view into a larger tensor (a batch's output split per
    input): a kept view would keep the whole of it."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def overlapping(inputs: list[MultiModalInput], start: int, end: int) -> list[MultiModalInput]:
    """The inputs with a position in ``[start, end)``."""
    return [mi for mi in inputs if mi.offset < end and start < mi.offset + mi.length]


def step_rows(inputs: list[MultiModalInput], start: int, end: int, deepstack: bool = False
              ) -> list[tuple[int, torch.Tensor]]:
    """The rows a step computing positions ``[start, end)`` takes from ``inputs`` (each
    encoded): (the first one's index within the step, the rows); ``deepstack``: their
    deepstack features' slices instead ([m, k, hidden]), of the inputs that have them."""
    out = []
    for mi in overlapping(inputs, start, end):
        src = mi.deepstack if deepstack else mi.rows
        if deepstack and src is None:
            continue
        assert src is not None
        a, b = max(start, mi.offset), min(end, mi.offset + mi.length)
        out.append((a - start, src[a - mi.offset:b - mi.offset]))
    return out


# a chat template that walks a message's content parts: a loop over (any variable's)
# ['content'] / .content, or a selectattr over it (llava-hf's); a filter such as
# ``content | trim`` prints a string and does not count
_CONTENT = r"""\w+(\[\s*['"]content['"]\s*\]|\.content)"""
_LOOPS_PARTS = re.compile(rf"for\s+\w+\s+in\s+{_CONTENT}|{_CONTENT}\s*\|\s*selectattr")


def template_reads_parts(template: object) -> bool:
    """Whether a chat template loops over a message's content parts (vLLM's "openai"
    content format) rather than printing it as a string: such a template must be given
    ``[{"type": "text", "text": ...}]`` (a string would be walked character by character,
    its text lost) and shows an image part's placeholder itself."""
    return isinstance(template, str) and _LOOPS_PARTS.search(template) is not None


def as_text_parts(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message whose content is a string, with it as one text part."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m.get("content"), str) else m for m in conversation]


# --------------------------------------------------------------- chat image parts


def decode_data_url(url: str, i: int, policy: MediaPolicy | None = None) -> Any:
    """Image ``i``'s url (a base64 data URL, an http(s) URL or, under the policy's
    allowed_local_media_path, a file:// URL: engine/media.py) decoded (a PIL image); a
    ValueError naming what is wrong."""
    return load_image(url, i, policy)


# a message's content parts as the template sees them: ("text", its text), ("image", None),
# ("video", None) or ("audio", None)
Parts = list[tuple[str, str | None]]
_MEDIA = ("image", "video", "audio")


def place_images(conv: list[dict[str, Any]], parts: list[Parts | None], template: str | None,
                 placeholder: str, video_placeholder: str | None = None,
                 audio_placeholder: Callable[[int], str] | None = None) -> list[dict[str, Any]]:
    """``conv`` with each message's image (video, audio) parts (``parts[i]``: message i's
    parts in order, None for a message of plain text) put where the chat template reads
    them: a part ``{"type": "image"}`` / ``{"type": "video"}`` / ``{"type": "audio",
    "audio": ""}`` where the template loops over content parts (llava-hf's and Qwen's
    templates; Qwen2-Audio's tests ``'audio' in content``), else the placeholder texts
    (``<image>``; ``video_placeholder`` for a video; ``audio_placeholder(k)`` for the
    conversation's k-th audio, 1-based: "Audio k: <|audio_bos|><|AUDIO|><|audio_eos|>") on
    their own lines before the message's text, in the parts' order (vLLM's "string"
    content format)."""
    as_parts = template_reads_parts(template)
    out = []
    audios = 0
    for d, ps in zip(conv, parts, strict=True):
        if ps is None or not any(kind in _MEDIA for kind, _ in ps):
            out.append(as_text_parts([d])[0] if as_parts else d)
        elif as_parts:
            out.append({**d, "content": [{"type": "text", "text": text} if kind == "text"
                                         else {"type": "audio", "audio": ""} if kind == "audio"
                                         else {"type": kind} for kind, text in ps]})
        else:
            marks = []
            for kind, _ in ps:
                if kind == "audio":
                    audios += 1
                    marks.append(audio_placeholder(audios) if audio_placeholder is not None else placeholder)
                elif kind != "text":
                    marks.append(placeholder if kind == "image" else video_placeholder or placeholder)
            text = d["content"] if isinstance(d.get("content"), str) else \
                "".join(t or "" for kind, t in ps if kind == "text")
            out.append({**d, "content": "\n".join([*marks, text])})
    return out


def _video(video: Any, n: int, first: int, policy: MediaPolicy | None) -> Any:
    """A "video" part's video (the ``n``-th of the conversation): a URL (a string) read and
    decoded as a video file (engine/video_io.py, as video_url parts are), a list of image URLs
    read as frames (engine/media.py, as image_url parts are); frames given as objects kept as
    they are (models/qwen2_vl_video.py checks them)."""
    if isinstance(video, str):
        from flashpage.engine.video_io import load_video

        return load_video(video, n, policy)
    if isinstance(video, (list, tuple)) and video and all(isinstance(f, str) for f in video):
        return [decode_data_url(u, first + k, policy) for k, u in enumerate(video)]
    return video


def chat_audio(part: dict[str, Any], kind: str, n: int, where: str, policy: MediaPolicy | None) -> Any:
    """An ``audio_url`` part's audio (``{"audio_url": {"url": ...}}`` or the url as a string:
    a data, http(s) or file:// URL read as engine/media.py says) or an ``input_audio`` part's
    (``{"input_audio": {"data": base64 of a file, "format": "wav"}}``), decoded
    (engine/audio_io.py): (mono float32 samples, their rate); ``n``: its index in the
    conversation's audios. A ValueError names what is wrong."""
    from flashpage.engine.audio_io import load_audio, load_input_audio

    if kind == "audio_url":
        url = part.get("audio_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ValueError(f"{where}: audio_url needs a url string")
        return load_audio(url, n, policy)
    given = part.get("input_audio")
    if not isinstance(given, dict):
        raise ValueError(f"{where}: input_audio needs {{\"data\": base64, \"format\": \"wav\"}}")
    return load_input_audio(given.get("data"), given.get("format"), n, policy)


def chat_images(conversation: list[dict[str, Any]], policy: MediaPolicy | None = None
                ) -> tuple[list[dict[str, Any]], list[Parts | None], list[Any], list[Any], list[Any]]:
    """An LLM.chat conversation whose messages may hold image, video or audio parts --
    OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` (or the url as a string;
    read as engine/media.py says under ``policy``), vLLM's ``{"type": "image_pil",
    "image_pil": PIL.Image}``, ``{"type": "video_url", "video_url": {"url": ...}}`` (a video
    file, read as image URLs are and decoded by engine/video_io.py: its sampled frames and
    metadata), ``{"type": "video", "video": frames}`` (an array (T, H, W, 3), a list of PIL
    images, a list of image URLs read as frames, or one URL: a video file), and
    ``{"type": "audio_url", "audio_url": {"url": ...}}`` / OpenAI's ``{"type": "input_audio",
    "input_audio": {"data": ..., "format": "wav"}}`` (an audio file, ``chat_audio``) -> (the
    conversation with each content list's text joined, each message's parts, the images in
    order, the videos in order, the audios in order: (samples, rate) pairs); a ValueError
    names a part of another type."""
    conv: list[dict[str, Any]] = []
    parts: list[Parts | None] = []
    images: list[Any] = []
    videos: list[Any] = []
    audios: list[Any] = []
    frames = 0  # frames read from URLs so far (their index in errors)
    for i, msg in enumerate(conversation):
        content = msg.get("content")
        if not isinstance(content, list):
            conv.append(msg)
            parts.append(None)
            continue
        ps: Parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                ps.append(("text", str(part.get("text", ""))))
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"message {i}: content part {j}: image_url needs a url string")
                images.append(decode_data_url(url, len(images), policy))
                ps.append(("image", None))
            elif kind == "image_pil":
                images.append(part.get("image_pil"))
                ps.append(("image", None))
            elif kind == "video":
                video = part.get("video")
                if video is None:
                    raise ValueError(f"message {i}: content part {j}: a video part needs \"video\": its frames")
                videos.append(_video(video, len(videos), frames, policy))
                frames += len(video) if isinstance(video, (list, tuple)) else 0
                ps.append(("video", None))
            elif kind == "video_url":
                from flashpage.engine.video_io import load_video

                url = part.get("video_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"message {i}: content part {j}: video_url needs a url string")
                videos.append(load_video(url, len(videos), policy))
                ps.append(("video", None))
            elif kind in ("audio_url", "input_audio"):
                assert isinstance(part, dict)
                audios.append(chat_audio(part, kind, len(audios), f"message {i}: content part {j}", policy))
                ps.append(("audio", None))
            else:
                raise ValueError(f"message {i}: content part {j} has type {kind!r}: text, "
                                 "image_url, image_pil, video_url, video, audio_url and input_audio "
                                 "parts are read")
        conv.append({**msg, "content": "".join(t or "" for k, t in ps if k == "text")})
        parts.append(ps)
    return conv, parts, images, videos, audios
