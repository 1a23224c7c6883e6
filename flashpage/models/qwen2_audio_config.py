"""The audio side of a Qwen2-Audio checkpoint (Qwen2AudioForConditionalGeneration:
Qwen/Qwen2-Audio-7B, Qwen2-Audio-7B-Instruct), read from its files once. config.py's
ModelConfig.audio holds the Qwen2AudioConfig; models/qwen2_audio.py runs it.

Read from: ``audio_config`` (Qwen2AudioEncoderConfig's fields and defaults: a Whisper-style
encoder), the wrapper's ``audio_token_index``, ``preprocessor_config.json``
(WhisperFeatureExtractor's: feature_size mel bins, sampling_rate, hop_length, n_fft,
chunk_length, padding_value, dither; models/audio_features.py computes the features; its
do_normalize is not read, as Qwen2AudioProcessor's call does not pass it on) and the tokenizer's files (the ids of ``<|audio_bos|>`` / ``<|audio_eos|>``, which
the chat template writes around each ``<|AUDIO|>``).

The encoder takes exactly one chunk's features: its ``max_source_positions`` positions are
the frames after the stride-2 conv, so chunk_length x sampling_rate / hop_length mel frames
must be 2 x max_source_positions (3,000 for Qwen2-Audio's 30 s at 16 kHz, hop 160); a
config where they differ is refused rather than cut.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from flashpage.config import ConfigError, _json_object

# Qwen2AudioConfig's audio_config defaults (Whisper-large-v3's encoder)
_DEFAULTS: dict[str, Any] = dict(
    num_mel_bins=128, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, d_model=1280,
    max_source_positions=1500, activation_function="gelu", scale_embedding=False)
_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "quick_gelu")
AUDIO_TOKEN = "<|AUDIO|>"
AUDIO_BOS, AUDIO_EOS = "<|audio_bos|>", "<|audio_eos|>"


@dataclass(frozen=True)
class AudioFeatures:
    """WhisperFeatureExtractor's settings (its defaults, Qwen2-Audio's feature_size 128):
    log-mel frames of ``n_fft`` samples every ``hop_length``, each audio padded with
    ``padding_value`` to chunk_length seconds (models/audio_features.py)."""

    feature_size: int = 128
    sampling_rate: int = 16_000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 30
    padding_value: float = 0.0

    @property
    def n_samples(self) -> int:
        """The samples of one chunk: the longest audio taken."""
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        """The mel frames of one chunk (3,000)."""
        return self.n_samples // self.hop_length


@dataclass(frozen=True)
class Qwen2AudioConfig:
    """Qwen2-Audio's encoder (conv1d x 2, positions, pre-LN layers, avg-pool by 2, a final
    LayerNorm) and projector (one Linear to the text model's width), its audio token and
    feature extraction."""

    d_model: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    num_mel_bins: int
    max_source_positions: int
    activation_function: str
    scale_embedding: bool
    audio_token_id: int
    features: AudioFeatures = field(default_factory=AudioFeatures)
    audio_bos_token_id: int | None = None
    audio_eos_token_id: int | None = None
    architecture: str = "Qwen2AudioForConditionalGeneration"

    @property
    def max_tokens_per_audio(self) -> int:
        """The prompt tokens of a whole chunk (750 for 30 s)."""
        return audio_token_count(self.features.n_samples, self.features)


def feature_frames(n: int, feats: AudioFeatures) -> int:
    """The mel frames of an audio of ``n`` samples that the processor's attention mask marks
    (WhisperFeatureExtractor's per-sample mask taken every hop_length samples: ceil(n / hop))."""
    return -(-min(n, feats.n_samples) // feats.hop_length)


def audio_token_count(n: int, feats: AudioFeatures) -> int:
    """The ``<|AUDIO|>`` tokens (encoder rows) of an audio of ``n`` samples at the model's
    rate, as Qwen2AudioProcessor counts them: L mel frames -> (L - 1) // 2 + 1 after the
    stride-2 conv -> (that - 2) // 2 + 1 after the pooling."""
    frames = feature_frames(n, feats)
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def _positive_int(d: dict[str, Any], key: str, where: str) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{where}.{key} must be a positive int, got {v!r}")
    return v


def _features(folder: str | None) -> AudioFeatures:
    """preprocessor_config.json's WhisperFeatureExtractor settings (its defaults without the
    file); a ConfigError names a bad one."""
    path = os.path.join(folder, "preprocessor_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        return AudioFeatures()
    pc = _json_object(path)
    kind = pc.get("feature_extractor_type", "WhisperFeatureExtractor")
    if kind != "WhisperFeatureExtractor":
        raise ConfigError(f"{path}: feature_extractor_type {kind!r}: Qwen2-Audio's features are "
                          "WhisperFeatureExtractor's (models/audio_features.py)")
    base = AudioFeatures()
    d = {k: pc.get(k, getattr(base, k)) for k in ("feature_size", "sampling_rate", "hop_length", "n_fft",
                                                   "chunk_length")}
    for k in d:
        _positive_int(d, k, path)
    pad = pc.get("padding_value", 0.0)
    if not isinstance(pad, (int, float)) or isinstance(pad, bool):
        raise ConfigError(f"{path}.padding_value must be a number, got {pad!r}")
    dither = pc.get("dither", 0.0)
    if dither not in (0, 0.0, None):
        raise ConfigError(f"{path}: dither {dither!r} (random noise added to the features) is not "
                          "supported: features here are exact; set it to 0.0")
    return AudioFeatures(**d, padding_value=float(pad))


def _token_ids(folder: str | None) -> dict[str, int | None]:
    """<|audio_bos|> / <|audio_eos|> in the folder's tokenizer files (None where missing)."""
    from flashpage.models.internvl_config import _vocab

    vocab, _ = _vocab(folder)
    return dict(audio_bos_token_id=vocab.get(AUDIO_BOS), audio_eos_token_id=vocab.get(AUDIO_EOS))


def qwen2_audio_config_of(d: dict[str, Any], arch: str, where: str, folder: str | None) -> Qwen2AudioConfig:
    """A Qwen2-Audio config's audio side; a ConfigError names a bad field."""
    ac = d.get("audio_config") or {}
    if not isinstance(ac, dict):
        raise ConfigError(f"{where}: audio_config must be an object, got {ac!r}")
    kind = ac.get("model_type", "qwen2_audio_encoder")
    if kind != "qwen2_audio_encoder":
        raise ConfigError(f"{where}: audio_config.model_type {kind!r} is not supported in {arch} "
                          "(its Whisper-style encoder, qwen2_audio_encoder, is)")
    a = {**_DEFAULTS, **{k: ac[k] for k in _DEFAULTS if ac.get(k) is not None}}
    w = f"{where}: audio_config"
    for k in ("num_mel_bins", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "d_model",
              "max_source_positions"):
        _positive_int(a, k, w)
    if a["d_model"] % a["encoder_attention_heads"]:
        raise ConfigError(f"{w}.d_model {a['d_model']} is not a multiple of encoder_attention_heads "
                          f"{a['encoder_attention_heads']}")
    if a["activation_function"] not in _ACTS:
        raise ConfigError(f"{w}.activation_function {a['activation_function']!r} is not supported "
                          f"({', '.join(_ACTS)})")
    if not isinstance(a["scale_embedding"], bool):
        raise ConfigError(f"{w}.scale_embedding must be true or false, got {a['scale_embedding']!r}")
    token = d.get("audio_token_index", d.get("audio_token_id", 151_646))
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ConfigError(f"{where}: audio_token_index must be a token id, got {token!r}")
    feats = _features(folder)
    pre = os.path.join(folder, "preprocessor_config.json") if folder else "the feature extractor"
    if feats.feature_size != a["num_mel_bins"]:
        raise ConfigError(f"{pre}: feature_size {feats.feature_size} differs from the encoder's "
                          f"audio_config.num_mel_bins {a['num_mel_bins']}")
    if feats.nb_max_frames != 2 * a["max_source_positions"]:
        raise ConfigError(f"{pre}: a chunk of {feats.chunk_length} s at {feats.sampling_rate} Hz is "
                          f"{feats.nb_max_frames} mel frames (hop {feats.hop_length}), but the encoder "
                          f"takes 2 x max_source_positions = {2 * a['max_source_positions']}")
    return Qwen2AudioConfig(a["d_model"], a["encoder_layers"], a["encoder_attention_heads"], a["encoder_ffn_dim"],
                            a["num_mel_bins"], a["max_source_positions"], a["activation_function"],
                            a["scale_embedding"], token, feats, **_token_ids(folder), architecture=arch)
