"""Qwen2-Audio's audio input (Qwen2AudioForConditionalGeneration: Qwen2-Audio-7B and its
Instruct): the Whisper-style encoder, the projector and Qwen2AudioProcessor's prompt
expansion. The text model (Qwen2) is served as any multimodal checkpoint's
(models/multimodal.py: ``language_model.model.`` / ``model.language_model.`` -> ``model.``);
beside it the engine keeps a ``Qwen2AudioEncoder``.

An audio (engine/audio_io.py: a float waveform at the model's 16 kHz, resampled where given
at another rate; at most chunk_length, 30 s) -> its rows, L its mel frames (ceil(n / hop))::

    log-mel features of the whole 30 s chunk (models/audio_features.py)      [128, 3000]
    -> frames [0, L + 2): the audio's, and the padding's the convolutions read at its end
    -> conv1 (k 3, pad 1) + GELU -> conv2 (k 3, stride 2, pad 1) + GELU     [T, d_model]
    -> T = (L - 1) // 2 + 1 rows kept, + embed_positions[:T]
    -> encoder layers (pre-LN: LayerNorm, attention, residual; LayerNorm, fc1, act, fc2,
       residual; q scaled by head_dim^-0.5 before the product, k without bias)
    -> average of each pair of rows (T // 2 rows) -> layer_norm -> multi_modal_projector.linear
                                                                         [T // 2, text hidden]

transformers runs every audio over all 1,500 positions with the padding's keys masked; rows
past T never reach the kept ones (the convolutions read frames up to L + 1, the attention
only the kept keys), so the encoder runs over the audio's own T rows alone: the same rows,
shorter sequences. Audios of equal length run as one batch (no mask), others apart.

Prompt (``prepare``): each ``<|AUDIO|>`` becomes T // 2 of them, as Qwen2AudioProcessor
writes it (num_audio_tokens from its feature attention mask: models/qwen2_audio_config
.audio_token_count); ids with each audio's run written out already are kept. The chat
template puts ``<|audio_bos|>`` / ``<|audio_eos|>`` around it; the rows are the
``<|AUDIO|>`` positions'. Each audio is one MultiModalInput named by its waveform's digest
(prefix caching and the encoder cache, engine/multimodal.py).

Weights: ``audio_tower.`` and ``multi_modal_projector.`` (published files), or under
``model.`` (transformers 5's).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flashpage.engine.audio_io import audio_items, checked_waveform
from flashpage.engine.multimodal import MultiModalInput, expand_tokens
from flashpage.engine.prompt_embeds import digest
from flashpage.models.audio_features import log_mel
from flashpage.models.clip_vision import activation
from flashpage.models.qwen2_audio_config import (
    AUDIO_BOS,
    AUDIO_EOS,
    AUDIO_TOKEN,
    Qwen2AudioConfig,
    audio_token_count,
    feature_frames,
)

if TYPE_CHECKING:
    from flashpage.models.loader import ModelSource

logger = logging.getLogger(__name__)

_PREFIXES = (
    ("model.audio_tower.", "audio_tower."),
    ("audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)
AUDIO_PREFIXES = tuple(p for p, _ in _PREFIXES)


def _act(name: str) -> nn.Module:
    if name == "gelu_new":  # transformers' NewGELU: the tanh form
        return nn.GELU(approximate="tanh")
    return activation(name)


class AudioAttention(nn.Module):
    def __init__(self, ac: Qwen2AudioConfig) -> None:
        super().__init__()
        d = ac.d_model
        self.heads = ac.encoder_attention_heads
        self.scaling = (d // self.heads) ** -0.5
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, h, d // h).transpose(1, 2)

        # q scaled before the product, as transformers does (rounded in the model's dtype)
        q, k, v = split(self.q_proj(x) * self.scaling), split(self.k_proj(x)), split(self.v_proj(x))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, d))


class AudioEncoderLayer(nn.Module):
    def __init__(self, ac: Qwen2AudioConfig) -> None:
        super().__init__()
        d = ac.d_model
        self.self_attn = AudioAttention(ac)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ac.encoder_ffn_dim)
        self.fc2 = nn.Linear(ac.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _act(ac.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # transformers' clamp against fp16 overflow
            big = torch.finfo(torch.float16).max - 1000
            x = x.clamp(-big, big)
        return x


class AudioTower(nn.Module):
    """transformers' Qwen2AudioEncoder (parameter names kept), run over each audio's own rows
    (module docstring)."""

    def __init__(self, ac: Qwen2AudioConfig) -> None:
        super().__init__()
        d = ac.d_model
        self.conv1 = nn.Conv1d(ac.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(ac.max_source_positions, d)
        self.layers = nn.ModuleList(AudioEncoderLayer(ac) for _ in range(ac.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, feats: torch.Tensor, frames: int) -> torch.Tensor:
        """Features [B, mel, >= frames + 2 or all] of audios of ``frames`` mel frames each ->
        their pooled rows [B, T // 2, d_model] (T = (frames - 1) // 2 + 1)."""
        w = self.conv1.weight
        x = feats[..., :min(feats.shape[-1], frames + 2)].to(w.dtype)
        x = torch.nn.functional.gelu(self.conv1(x))
        x = torch.nn.functional.gelu(self.conv2(x))
        t = (frames - 1) // 2 + 1
        # (scale_embedding is read but not applied: transformers' forward never applies it)
        x = (x[..., :t].transpose(1, 2) + self.embed_positions.weight[:t]).contiguous()
        for layer in self.layers:
            x = layer(x)
        pairs = t // 2
        x = x[:, :2 * pairs].reshape(x.shape[0], pairs, 2, x.shape[-1]).mean(2)
        return self.layer_norm(x)


class Qwen2AudioProjector(nn.Module):
    def __init__(self, ac: Qwen2AudioConfig, text_hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(ac.d_model, text_hidden)


class Qwen2AudioEncoder(nn.Module):
    """Audios -> the rows of their ``<|AUDIO|>`` positions (module docstring)."""

    token_name = AUDIO_TOKEN
    modality = "audio"
    # audios per tower call (each at most 1,500 rows of d_model)
    MAX_AUDIOS_PER_CALL = 4

    def __init__(self, ac: Qwen2AudioConfig, text_hidden: int) -> None:
        super().__init__()
        self.config = ac
        self.audio_tower = AudioTower(ac)
        self.multi_modal_projector = Qwen2AudioProjector(ac, text_hidden)

    # ------------------------------------------------------------ the engine's hooks
    @property
    def placeholder_ids(self) -> list[int]:
        """<|audio_bos|><|AUDIO|><|audio_eos|> (the chat template's), without the markers
        the tokenizer's files lack."""
        ac = self.config
        return [t for t in (ac.audio_bos_token_id, ac.audio_token_id, ac.audio_eos_token_id) if t is not None]

    def placeholder_text(self, k: int) -> str:
        """What a chat template that prints text gets for the conversation's ``k``-th audio
        part (1-based), as vLLM writes it for Qwen2-Audio."""
        return f"Audio {k}: {AUDIO_BOS}{AUDIO_TOKEN}{AUDIO_EOS}"

    def waveforms(self, data: Any) -> list[torch.Tensor]:
        """A request's multi_modal_data {"audio": ...} -> each audio as a float32 waveform at
        the model's rate, checked (engine/audio_io.py) and within one chunk; a ValueError
        names what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{\"audio\": (waveform, 16000)}}, "
                             f"got {type(data).__name__}")
        unknown = sorted(set(data) - {"audio"})
        if unknown:
            raise ValueError(f"multi_modal_data {unknown}: this model takes \"audio\" only")
        if "audio" not in data:
            raise ValueError("multi_modal_data has no \"audio\"")
        items = audio_items(data["audio"])
        if not items:
            raise ValueError("multi_modal_data[\"audio\"] is an empty list")
        return [self.admit_audio(item, i) for i, item in enumerate(items)]

    def admit_audio(self, item: Any, i: int = 0) -> torch.Tensor:
        """One audio as a request keeps it: float32 at the model's rate, at least one token's
        samples and at most one chunk's (a ValueError otherwise)."""
        f = self.config.features
        x = checked_waveform(item, i, f.sampling_rate)
        n = x.shape[0]
        if n > f.n_samples:
            raise ValueError(f"audio {i} is {n / f.sampling_rate:.2f} s long ({n} samples at "
                             f"{f.sampling_rate} Hz): {self.config.architecture} takes up to "
                             f"{f.chunk_length} s ({f.n_samples} samples) an audio; cut it into "
                             "chunks, each its own audio")
        if audio_token_count(n, f) < 1:
            least = 2 * f.hop_length + 1
            raise ValueError(f"audio {i} is too short: {n} samples at {f.sampling_rate} Hz give no audio "
                             f"token (at least {least} samples, {least / f.sampling_rate * 1000:.1f} ms)")
        return x

    def num_rows(self, waveform: torch.Tensor) -> int:
        """The ``<|AUDIO|>`` tokens (rows) of an admitted audio."""
        return audio_token_count(waveform.shape[0], self.config.features)

    def rows_of(self, items: list[Any]) -> list[int]:
        """The prompt positions each of one prompt's audios takes (the server's count)."""
        return [self.num_rows(self.admit_audio(x, i)) for i, x in enumerate(items)]

    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): the audios of
        ``multi_modal_data`` checked and resampled, each ``<|AUDIO|>`` expanded to its rows'
        count (ids written out already kept); a ValueError names what is wrong."""
        waves = self.waveforms(data)
        counts = [self.num_rows(w) for w in waves]
        ac = self.config
        ids, starts = expand_tokens(ids, ac.audio_token_id, counts, AUDIO_TOKEN, "audio")
        return ids, [MultiModalInput(s, n, digest(w), w) for s, n, w in zip(starts, counts, waves, strict=True)]

    def activation_bytes(self, rows: int) -> int:
        """The most an encode call of ``rows`` rows (at least one audio) adds while it runs:
        a tower call's features and STFT (per audio), its tokens' stream, attention and MLP
        intermediates and the attention's scores (where SDPA's math path holds them), and
        the output rows."""
        ac = self.config
        f = ac.features
        per_audio_rows = ac.max_tokens_per_audio
        audios = min(max(1, -(-rows // per_audio_rows)), self.MAX_AUDIOS_PER_CALL)
        tokens = audios * ac.max_source_positions
        w = self.multi_modal_projector.linear.weight
        b = w.element_size()
        per = (8 * ac.d_model + 4 * ac.encoder_ffn_dim) * b
        scores = audios * ac.encoder_attention_heads * ac.max_source_positions ** 2 * 4
        feats = audios * (f.n_samples * 4 + (f.n_fft // 2 + 1) * (f.nb_max_frames + 1) * 16
                          + 2 * f.feature_size * f.nb_max_frames * 4)
        out = max(rows, per_audio_rows) * w.shape[0] * b
        return tokens * per + scores + feats + out

    def forward(self, feats: torch.Tensor, frames: int) -> torch.Tensor:
        """Features [B, mel, 3000] of audios of ``frames`` frames each -> [B, rows, text hidden]."""
        return self.multi_modal_projector.linear(self.audio_tower(feats, frames))

    @torch.inference_mode()
    def encode(self, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """The engine's multimodal hook: waveforms (host, float32 at the model's rate) -> rows
        [tokens, H] on the device; features computed there, audios of one length batched."""
        w = self.audio_tower.conv1.weight
        f = self.config.features
        out: list[torch.Tensor | None] = [None] * len(data)
        by_frames: dict[int, list[int]] = {}
        for i, x in enumerate(data):
            by_frames.setdefault(feature_frames(x.shape[0], f), []).append(i)
        for frames, idx in by_frames.items():
            for s in range(0, len(idx), self.MAX_AUDIOS_PER_CALL):
                batch = idx[s:s + self.MAX_AUDIOS_PER_CALL]
                feats = log_mel([data[i] for i in batch], f, w.device)
                rows = self(feats, frames)
                for i, r in zip(batch, rows.unbind(0), strict=True):
                    out[i] = r
        assert all(r is not None for r in out)
        return [r for r in out if r is not None]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """The encoder's and projector's tensors (the text model's are ignored)."""
        from flashpage.models.multimodal import load_image_weights

        loaded, _ = load_image_weights(self, weights, where, _PREFIXES,
                                       f"{self.config.architecture}'s audio encoder or projector",
                                       "audio encoder / projector")
        return loaded


def load_image_encoder(source: ModelSource, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> Qwen2AudioEncoder:
    """``source``'s audio encoder in ``dtype`` on ``device``: its checkpoint's tensors, or
    random ones (a random_config source). (The name the engine's loader calls for every
    multimodal encoder: models/multimodal.py.)"""
    from flashpage.models.multimodal import build_image_encoder

    ac = source.config.audio
    assert isinstance(ac, Qwen2AudioConfig)
    enc = build_image_encoder(source, dtype, device, seed,
                              lambda: Qwen2AudioEncoder(ac, source.config.hidden_size), AUDIO_PREFIXES)
    return enc.eval()
