"""Audio files and resampling (engine/audio_io.py): PCM WAVs of 8 / 16 / 24 / 32 bits and
their channels decoded to the written samples (averaged to mono), a float WAV, FLAC and MP3
through PyAV (lossless ones exactly, MP3 close), input_audio's base64; resampling keeps a
tone below the lower Nyquist frequency (to 1e-3 of its amplitude), removes one above it,
gives ceil(n x new / old) samples, and refuses a ratio whose filter would be too large; bad
bytes, empty files and a missing PyAV are refused by name."""

from __future__ import annotations

import base64
import io
import sys

import numpy as np
import pytest
import torch

from flashpage.engine import audio_io
from flashpage.engine.audio_io import decode_audio, input_audio_bytes, load_input_audio, resample
from tests.qwen2_audio_checkpoint import tone, wav_bytes


def _sine(freq: float, rate: int, seconds: float = 0.25) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return np.sin(2 * np.pi * freq * t).astype(np.float32)


@pytest.mark.parametrize("width, channels", [(1, 1), (2, 2), (3, 1), (4, 3)])
def test_pcm_wav_decodes_to_its_samples(width, channels):
    x = tone(0.05, 3) * 0.8
    got, rate = decode_audio(wav_bytes(x, 11_025, width, channels), 0)
    assert rate == 11_025 and got.dtype == np.float32 and got.shape == x.shape
    # written as round(x (2^(b-1) - 1)), read as / 2^(b-1): within two steps of the format
    assert np.abs(got - x).max() <= 2.0 / (1 << (8 * width - 1)) + 1e-7  # (and float32 rounding)


def _av_file(x: np.ndarray, rate: int, fmt: str, codec: str, sample_fmt: str, layout: str = "stereo") -> bytes:
    """``x`` in both channels of a ``fmt`` file written by PyAV."""
    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate, layout=layout)
        planar = sample_fmt.endswith("p")
        chans = 2 if layout == "stereo" else 1
        data = np.stack([x] * chans) if planar else np.repeat(x[:, None], chans, 1).reshape(1, -1)
        scale = {"s16": 32767, "s16p": 32767}.get(sample_fmt)
        arr = (np.round(data * scale).astype(np.int16) if scale else data.astype(np.float32))
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(arr), format=sample_fmt, layout=layout)
        frame.sample_rate = rate
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def test_pyav_formats():
    """A float WAV (which the wave module does not read) and FLAC decode exactly; MP3 (a
    lossy codec with its own delay) to the written tone's level and length."""
    x = tone(0.5, 4) * 0.5
    got, rate = decode_audio(_av_file(x, 16_000, "wav", "pcm_f32le", "flt"), 1)
    assert rate == 16_000 and np.array_equal(got, x)
    got, rate = decode_audio(_av_file(x, 16_000, "flac", "flac", "s16"), 2)
    assert rate == 16_000 and np.abs(got - x).max() <= 1 / 32767 + 1e-6
    s = _sine(440, 44_100, 0.5) * 0.5
    got, rate = decode_audio(_av_file(s, 44_100, "mp3", "libmp3lame", "fltp", "mono"), 3)
    assert rate == 44_100 and abs(len(got) - len(s)) < 3000
    assert abs(np.sqrt((got ** 2).mean()) - np.sqrt((s ** 2).mean())) < 0.02


def test_bad_files_and_input_audio_are_refused_by_name(monkeypatch):
    with pytest.raises(ValueError, match="audio 0 is empty"):
        decode_audio(b"")
    with pytest.raises(ValueError, match="audio 2 could not be decoded"):
        decode_audio(b"this is no audio file at all" * 10, 2)
    raw = wav_bytes(tone(0.1, 1))
    x, rate = load_input_audio(base64.b64encode(raw).decode(), "wav", 0)
    assert rate == 16_000 and len(x) == 1600
    with pytest.raises(ValueError, match="audio 1: its input_audio data is not valid base64"):
        input_audio_bytes("not base64!!", "wav", 1, None)
    with pytest.raises(ValueError, match="input_audio format 'midi' is not one of"):
        input_audio_bytes("AAAA", "midi", 0, None)
    with pytest.raises(ValueError, match="needs \"data\""):
        input_audio_bytes(None, "wav", 0, None)
    monkeypatch.setitem(sys.modules, "av", None)  # no PyAV: a float WAV names the package
    with pytest.raises(ValueError, match="needs PyAV: pip install av"):
        decode_audio(b"RIFF" + b"\0" * 60, 0)
    assert decode_audio(raw)[1] == 16_000  # a PCM WAV needs none


@pytest.mark.parametrize("src, dst, freq", [(44_100, 16_000, 3000.0), (8_000, 16_000, 1000.0),
                                            (48_000, 16_000, 5000.0), (22_050, 16_000, 440.0)])
def test_resample_keeps_a_tone_below_nyquist(src, dst, freq):
    x = torch.from_numpy(_sine(freq, src))
    y = resample(x, src, dst)
    ref = _sine(freq, dst)
    assert y.shape[0] == -(-x.shape[0] * dst // src) == ref.shape[0]
    edge = 100  # the ends see silence past them
    assert np.abs(y.numpy()[edge:-edge] - ref[edge:-edge]).max() < 1e-3


def test_resample_removes_what_the_new_rate_cannot_hold(monkeypatch):
    y = resample(torch.from_numpy(_sine(12_000, 48_000)), 48_000, 16_000)  # above 8 kHz
    assert np.abs(y.numpy()[100:-100]).max() < 1e-3
    monkeypatch.setattr(audio_io, "_MAX_FILTER", 1000)  # a ratio of 16000/44101 needs more taps
    with pytest.raises(ValueError, match="audio 3: resampling 44101 Hz to 16000 Hz .* resample it to a common rate"):
        resample(torch.zeros(100), 44_101, 16_000, 3)
