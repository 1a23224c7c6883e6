"""Whisper's log-mel features (WhisperFeatureExtractor's, which Qwen2-Audio's processor
uses), in torch on any device, equal to transformers' to float32 rounding::

    waveform (mono float32 at the model's rate, n <= chunk_length x rate samples)
      -> padded with padding_value to chunk_length x rate samples (30 s: 480,000)
      -> |STFT|^2: periodic Hann window of n_fft (400), hop_length (160), centred (reflect
         padding), the last frame dropped                            [n_fft / 2 + 1, 3000]
      -> Slaney mel filters (feature_size bins, 0 - 8 kHz, Slaney-normalized)   [128, 3000]
      -> log10(max(x, 1e-10)), floored at its maximum - 8, then (x + 4) / 4

Every audio is padded to the whole chunk before the STFT, as the processor pads it (padding
"max_length"): the padding's frames are silence's, which the encoder's convolutions read at
the audio's end, and the maximum is the whole chunk's. The processor's attention mask marks
ceil(n / hop_length) frames (models/qwen2_audio_config.feature_frames).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from flashpage.models.qwen2_audio_config import AudioFeatures

MEL_MAX_HZ = 8000.0  # Whisper's filters span 0 - 8 kHz whatever the sampling rate


def _hz_to_mel(f: np.ndarray | float) -> np.ndarray:
    """Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    mel = 3.0 * f / 200.0
    log_step = 27.0 / np.log(6.4)
    above = f >= 1000.0
    return np.where(above, 15.0 + np.log(np.maximum(f, 1e-12) / 1000.0) * log_step, mel)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f = 200.0 * m / 3.0
    log_step = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(log_step * (m - 15.0)), f)


@lru_cache(maxsize=8)
def mel_filters(n_fft: int, n_mels: int, sampling_rate: int) -> np.ndarray:
    """[n_fft / 2 + 1, n_mels] float64: triangular filters whose corners are n_mels + 2
    points evenly spaced on Slaney's mel scale over 0 - 8 kHz, each scaled by 2 / its width in
    Hz (Slaney's area normalization); rows are the STFT's bins at k x rate / n_fft Hz."""
    bins = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    corners = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(MEL_MAX_HZ), n_mels + 2))
    width = np.diff(corners)
    rel = corners[None, :] - bins[:, None]  # [bins, n_mels + 2]
    rising = -rel[:, :-2] / width[:-1]
    falling = rel[:, 2:] / width[1:]
    tri = np.maximum(0.0, np.minimum(rising, falling))
    return tri * (2.0 / (corners[2:] - corners[:-2]))[None, :]


def prepared_waveforms(waves: list[torch.Tensor], feats: AudioFeatures, device: torch.device) -> torch.Tensor:
    """[B, n_samples] float32 on ``device``: each waveform padded with padding_value to the
    whole chunk."""
    out = torch.full((len(waves), feats.n_samples), feats.padding_value, dtype=torch.float32, device=device)
    for i, w in enumerate(waves):
        x = w.to(device=device, dtype=torch.float32)[:feats.n_samples]
        out[i, :x.shape[0]] = x
    return out


def log_mel(waves: list[torch.Tensor], feats: AudioFeatures, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, feature_size, nb_max_frames] float32 on ``device``: each waveform's features
    (module docstring)."""
    dev = torch.device(device)
    x = prepared_waveforms(waves, feats, dev)
    window = torch.hann_window(feats.n_fft, device=dev)  # periodic
    spec = torch.stft(x, feats.n_fft, feats.hop_length, window=window, center=True, pad_mode="reflect",
                      return_complex=True)
    power = spec[..., :-1].abs() ** 2  # [B, bins, frames]
    filters = torch.from_numpy(mel_filters(feats.n_fft, feats.feature_size, feats.sampling_rate)).to(
        dev, torch.float32)
    mel = filters.T @ power
    logs = torch.clamp(mel, min=1e-10).log10()
    top = logs.amax(dim=(1, 2), keepdim=True)
    logs = torch.maximum(logs, top - 8.0)
    return (logs + 4.0) / 4.0
