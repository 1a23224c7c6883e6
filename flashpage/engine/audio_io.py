"""Audio as vLLM takes it: ``multi_modal_data={"audio": item or [items]}``, an item being
``(waveform, sampling_rate)`` or a waveform alone (already at the model's rate), a waveform
a 1-D float array (numpy or torch; samples in [-1, 1]); and audio files, as a chat message's
``audio_url`` / ``input_audio`` parts give them (engine/media.py reads the URL), decoded here.

- ``audio_items`` / ``checked_waveform``: the items of a request, each checked (a number
  array of one channel, finite, a positive whole sampling rate) -> float32 at the model's
  rate, resampled where it was given at another.
- ``resample``: band-limited (windowed-sinc) resampling between any two whole rates whose
  reduced ratio keeps the filter small (every rate in common use); a ValueError where it
  would not. vLLM resamples with librosa (soxr): the same band limit, not the same
  samples to the last bit.
- ``decode_audio``: a file's bytes -> (mono float32, its rate): WAV (PCM 8 / 16 / 24 / 32
  bit) through the standard library's ``wave``, anything else (float WAV, MP3, FLAC, Ogg,
  AAC, ...) through PyAV (``pip install av``, imported only then); channels averaged (as
  librosa's mono load), integer samples scaled to [-1, 1) (x / 2^(bits - 1)).

Every failure is a ValueError naming the item (``audio 0``) and what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import wave
from typing import Any

import numpy as np
import torch

from flashpage.engine.media import MediaPolicy, given_bytes, read_url

MIN_RATE, MAX_RATE = 1_000, 192_000  # sampling rates taken (Hz)
MAX_DECODED_SECONDS = 3_600  # a file decoding to more is refused before it is all held
_ZEROS = 16  # the windowed sinc's zero crossings each side: ~ -80 dB stop band, a few taps
_ROLLOFF = 0.94  # the pass band's edge as a share of the lower Nyquist frequency
_MAX_FILTER = 1 << 22  # filter taps (phases x taps) a resampling may build
_CHUNK = 1 << 15  # output samples computed at once


def _is_rate(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _is_waveform(x: Any) -> bool:
    return isinstance(x, (np.ndarray, torch.Tensor))


def _is_item(x: Any) -> bool:
    """One audio: a waveform, or a tuple led by one (a (waveform, rate) pair; another
    length is refused by ``checked_waveform``)."""
    return _is_waveform(x) or (isinstance(x, tuple) and len(x) > 0 and _is_waveform(x[0]))


def audio_items(given: Any) -> list[Any]:
    """multi_modal_data["audio"] as a list of audios: one item (a waveform, a (waveform,
    rate) pair) or a list of them; a list of numbers is one waveform. What each holds is
    checked by ``checked_waveform``."""
    if _is_item(given):
        return [given]
    if isinstance(given, (list, tuple)) and given and all(_is_rate(v) for v in given):
        return [np.asarray(given, dtype=np.float32)]
    if isinstance(given, (list, tuple)):
        return list(given)
    return [given]


def checked_waveform(item: Any, i: int, rate: int) -> torch.Tensor:
    """Audio ``i`` (a waveform at ``rate``, or a (waveform, its rate) pair) as a float32 1-D
    tensor on the host at ``rate``, resampled where given at another; a ValueError names
    what is wrong."""
    src = rate
    if isinstance(item, tuple) and len(item) == 2 and _is_waveform(item[0]):
        item, src = item
        if not _is_rate(src):
            raise ValueError(f"audio {i}: its sampling rate must be a number of Hz (an int), got "
                             f"{type(src).__name__} {src!r}; give (waveform, 16000)")
        if not math.isfinite(float(src)) or float(src) != int(src) or not MIN_RATE <= int(src) <= MAX_RATE:
            raise ValueError(f"audio {i}: sampling rate {src!r} Hz is not taken: a whole number of Hz "
                             f"from {MIN_RATE} to {MAX_RATE}")
        src = int(src)
    elif isinstance(item, tuple):
        raise ValueError(f"audio {i}: a tuple must be (waveform, sampling_rate), got a tuple of {len(item)} "
                         f"({', '.join(type(v).__name__ for v in item)})")
    if isinstance(item, np.ndarray):
        if item.dtype == object or not (np.issubdtype(item.dtype, np.floating) or np.issubdtype(item.dtype, np.integer)):
            raise ValueError(f"audio {i}: samples of dtype {item.dtype} are not audio: give float samples in [-1, 1]")
        x = torch.from_numpy(np.ascontiguousarray(item))
    elif isinstance(item, torch.Tensor):
        x = item.detach().cpu()
    else:
        raise ValueError(f"audio {i} is a {type(item).__name__}: give a 1-D float waveform (numpy or torch) "
                         "or (waveform, sampling_rate)")
    if not x.is_floating_point():
        raise ValueError(f"audio {i}: integer samples ({str(x.dtype).replace('torch.', '')}) given: give float "
                         "samples in [-1, 1] (int16 PCM / 32768)")
    if x.dim() != 1:
        raise ValueError(f"audio {i} has shape {list(x.shape)}: give one channel, a 1-D waveform "
                         "(average the channels: x.mean(0))")
    if x.numel() == 0:
        raise ValueError(f"audio {i} is empty (0 samples)")
    x = x.to(torch.float32).contiguous()
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"audio {i}: its samples hold inf or NaN")
    return resample(x, src, rate, i) if src != rate else x


# ------------------------------------------------------------------ resampling
def _sinc_filter(up: int, down: int, zeros: int, rolloff: float) -> tuple[torch.Tensor, int]:
    """The polyphase filter taking a signal from ``down`` to ``up`` samples per unit (a
    reduced ratio): [up, taps] float64, row p the weights of input samples k0 - half .. for
    output phase p (its time p x down / up input samples past k0 = its floor), and half.

    h(t) = c x sinc(c t) x Hann(t / (zeros / c)), t in input samples, c = rolloff x
    min(1, up / down): a low-pass at the lower Nyquist frequency, zeros crossings each side."""
    c = rolloff * min(1.0, up / down)
    half = math.ceil(zeros / c)
    p = torch.arange(up, dtype=torch.float64)[:, None]
    frac = (p * down % up) / up  # the phase's offset past its floor, in input samples
    k = torch.arange(-half, half + 1, dtype=torch.float64)[None, :]
    t = k - frac  # each tap's input sample minus the output's time
    reach = zeros / c
    window = torch.where(t.abs() < reach, torch.cos(math.pi * t / (2 * reach)) ** 2, torch.zeros_like(t))
    return c * torch.sinc(c * t) * window, half


def resample(x: torch.Tensor, src: int, dst: int, i: int = 0) -> torch.Tensor:
    """A 1-D float32 waveform at ``src`` Hz at ``dst`` Hz: ceil(n x dst / src) samples, each
    the band-limited interpolation of the input at its time (the signal beyond the ends taken
    as silence); a ValueError where the reduced ratio needs too large a filter."""
    g = math.gcd(src, dst)
    up, down = dst // g, src // g
    c = _ROLLOFF * min(1.0, up / down)
    taps = 2 * math.ceil(_ZEROS / c) + 1
    if up * taps > _MAX_FILTER:
        raise ValueError(f"audio {i}: resampling {src} Hz to {dst} Hz (a ratio of {up}/{down} in lowest "
                         f"terms) would need a filter of {up} x {taps} taps: resample it to a common rate "
                         f"(e.g. {dst} Hz) first")
    h, half = _sinc_filter(up, down, _ZEROS, _ROLLOFF)
    n = x.shape[0]
    out_n = -(-n * up // down)
    # output m sits at input time m x down / up = k0 + frac (k0 its floor; frac phase
    # m mod up's): its taps are input samples k0 - half .. k0 + half, silence beyond the ends
    xp = torch.nn.functional.pad(x.to(torch.float64), (half, half + 1))
    j = torch.arange(h.shape[1])
    out = torch.empty(out_n, dtype=torch.float64)
    for s in range(0, out_n, _CHUNK):
        m = torch.arange(s, min(out_n, s + _CHUNK))
        k0 = (m * down) // up
        out[s:s + m.shape[0]] = (xp[k0[:, None] + j[None, :]] * h[m % up]).sum(1)
    return out.to(torch.float32)


# ------------------------------------------------------------------ files
def _av() -> Any:
    try:
        import av
    except ImportError:
        raise ValueError("decoding this audio file (not a PCM WAV) needs PyAV: pip install av (or "
                         "flashpage[video]); or give the waveform itself, (array, sampling_rate)") from None
    return av


def _pcm(raw: bytes, width: int, channels: int) -> np.ndarray:
    """Interleaved little-endian PCM -> float [frames, channels] in [-1, 1)."""
    if width == 1:  # unsigned 8-bit
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:  # 24-bit: sign-extend three bytes into an int32's upper ones
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = (b[:, 0] << 8) | (b[:, 1] << 16) | (b[:, 2] << 24)
        x = (v >> 8).astype(np.float32) / float(1 << 23)
    else:
        x = (np.frombuffer(raw, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    return x.reshape(-1, channels)


def _decode_wav(raw: bytes, i: int) -> tuple[np.ndarray, int] | None:
    """A PCM WAV's mono samples and rate; None for a file ``wave`` does not read (another
    format, or a float WAV: PyAV's)."""
    try:
        with wave.open(io.BytesIO(raw), "rb") as f:
            channels, width, rate, frames = f.getnchannels(), f.getsampwidth(), f.getframerate(), f.getnframes()
            if width not in (1, 2, 3, 4) or channels < 1:
                return None
            if frames > MAX_DECODED_SECONDS * max(rate, 1):
                raise ValueError(f"audio {i}: its {frames} frames at {rate} Hz are more than "
                                 f"{MAX_DECODED_SECONDS} s")
            data = f.readframes(frames)
    except (wave.Error, EOFError):
        return None
    usable = len(data) // (width * channels) * width * channels  # a file cut short: its whole frames
    return _pcm(data[:usable], width, channels).mean(axis=1), rate


def _decode_av(raw: bytes, i: int) -> tuple[np.ndarray, int]:
    av = _av()
    try:
        container = av.open(io.BytesIO(raw), mode="r")
    except Exception as e:  # FFmpeg's own words: InvalidDataError, ...
        raise ValueError(f"audio {i} could not be decoded (is it an audio file?): {e}") from None
    with container:
        if not container.streams.audio:
            raise ValueError(f"audio {i} holds no audio stream")
        stream = container.streams.audio[0]
        chunks: list[np.ndarray] = []
        rate = 0
        total = 0
        resampler = None
        try:
            for frame in container.decode(stream):
                rate = rate or int(frame.sample_rate)
                if resampler is None:  # planar float, channels kept: averaged below
                    resampler = av.AudioResampler(format="fltp", layout=frame.layout, rate=frame.sample_rate)
                for f in resampler.resample(frame):
                    a = f.to_ndarray()  # [channels, samples]
                    chunks.append(a.astype(np.float32).mean(axis=0))
                    total += a.shape[1]
                if rate and total > MAX_DECODED_SECONDS * rate:
                    raise ValueError(f"audio {i} decodes to more than {MAX_DECODED_SECONDS} s")
        except ValueError:
            raise
        except Exception as e:  # a file cut short: the samples decoded so far, as a video's frames
            if not chunks:
                raise ValueError(f"audio {i} could not be decoded: {e}") from None
    if not chunks or rate <= 0:
        raise ValueError(f"audio {i}: no audio could be decoded")
    return np.concatenate(chunks), rate


def decode_audio(raw: bytes, i: int = 0) -> tuple[np.ndarray, int]:
    """Audio ``i``'s file bytes -> (mono float32 samples, its sampling rate) (module
    docstring); a ValueError naming what is wrong."""
    if not raw:
        raise ValueError(f"audio {i} is empty (0 bytes)")
    got = _decode_wav(raw, i) if raw[:4] == b"RIFF" else None
    x, rate = got if got is not None else _decode_av(raw, i)
    if x.size == 0:
        raise ValueError(f"audio {i} holds no samples")
    return np.ascontiguousarray(x, dtype=np.float32), int(rate)


def audio_bytes(source: str | bytes | bytearray | memoryview, i: int, policy: MediaPolicy | None) -> bytes:
    """An audio file's bytes: given as bytes (the media byte cap held), or read from its URL
    (engine/media.py: data, http(s), file:// under allowed_local_media_path)."""
    policy = policy or MediaPolicy()
    if isinstance(source, (bytes, bytearray, memoryview)):
        return given_bytes(source, i, policy, "audio")
    return read_url(source, i, policy, "audio")


def load_audio(source: str | bytes | bytearray | memoryview, i: int = 0,
               policy: MediaPolicy | None = None) -> tuple[np.ndarray, int]:
    """Audio ``i`` from its URL or bytes, decoded: (mono float32 samples, their rate)."""
    return decode_audio(audio_bytes(source, i, policy), i)


# OpenAI's input_audio formats and what else an FFmpeg build reads; the format is a hint
# (the bytes say what they are), checked to be a name
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "aac", "m4a", "webm", "pcm16")


def input_audio_bytes(data: Any, fmt: Any, i: int, policy: MediaPolicy | None) -> bytes:
    """An ``input_audio`` part's ``data`` (base64 of a file) and ``format`` checked and
    decoded to the file's bytes, within the media byte cap; a ValueError naming audio ``i``."""
    policy = policy or MediaPolicy()
    if not isinstance(data, str) or not data:
        raise ValueError(f"audio {i}: input_audio needs \"data\", the file's bytes in base64")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in INPUT_AUDIO_FORMATS):
        raise ValueError(f"audio {i}: input_audio format {fmt!r} is not one of {', '.join(INPUT_AUDIO_FORMATS)}")
    if fmt is not None and fmt.lower() == "pcm16":
        raise ValueError(f"audio {i}: input_audio format \"pcm16\" (headerless samples, no rate) is not read: "
                         "send a WAV file")
    if len(data) * 3 // 4 > policy.max_bytes + 3:
        raise ValueError(f"audio {i}: its input_audio data holds more than {policy.max_bytes} bytes "
                         "(FLASHPAGE_MEDIA_MAX_BYTES)")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"audio {i}: its input_audio data is not valid base64: {e}") from None


def load_input_audio(data: Any, fmt: Any, i: int = 0, policy: MediaPolicy | None = None) -> tuple[np.ndarray, int]:
    """An ``input_audio`` part decoded: (mono float32 samples, their rate)."""
    return decode_audio(input_audio_bytes(data, fmt, i, policy), i)
