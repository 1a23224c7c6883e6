"""A tiny random Qwen2-Audio checkpoint (transformers' Qwen2AudioForConditionalGeneration
saved as fp32 safetensors, WhisperFeatureExtractor's preprocessor_config.json with 128 mel
bins beside it, a byte-level BPE tokenizer with the processor's special tokens and
Qwen2-Audio-7B-Instruct's chat template), shared by the engine, server and inspect tests.

The encoder: Whisper's shape at d_model 32, 2 layers of 2 heads, 1,500 positions (the 30 s
chunk); the text model a tiny Qwen2. An audio of n samples at 16 kHz is
((ceil(n / 160) - 1) // 2 + 1) // 2 prompt tokens (25 a second)."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import numpy as np
import torch

# Qwen2-Audio-7B-Instruct's chat template (its tokenizer_config.json's): each content part
# holding an "audio" or "audio_url" key becomes "Audio k: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and "
    "message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if 'audio' in content or 'audio_url' in "
    "content %}{% set audio_count.value = audio_count.value + 1 %}Audio {{ audio_count.value }}: "
    "<|audio_bos|><|AUDIO|><|audio_eos|>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
SPECIAL = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|im_start|>", "<|im_end|>"]
RATE = 16_000
_AUDIO = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=128,
              max_source_positions=1500)
_TEXT = dict(model_type="qwen2", vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)


def build_tokenizer(path: Path) -> None:
    """A byte-level BPE (GPT-2's byte alphabet, no BOS added: Qwen's way) with the
    processor's special tokens and Qwen2-Audio's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.byte_tokenizer import SPECIALS, _corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus() + ["What is that sound? Audio 1: say it\n"] * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def hf_processor(path: Path):
    """transformers' Qwen2AudioProcessor on the folder's tokenizer and feature extractor."""
    import transformers

    return transformers.Qwen2AudioProcessor(
        feature_extractor=transformers.WhisperFeatureExtractor.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path))


def build_tiny_qwen2_audio(path: Path, seed: int = 0, text: dict | None = None, audio: dict | None = None,
                           features: dict | None = None) -> Path:
    """Save a tiny Qwen2-Audio checkpoint under ``path``; ``text`` / ``audio``: text_config /
    audio_config fields over ours; ``features``: WhisperFeatureExtractor's arguments."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    config = transformers.Qwen2AudioConfig(audio_config={**_AUDIO, **(audio or {})},
                                           text_config={**_TEXT, **(text or {})},
                                           audio_token_index=int(tok.convert_tokens_to_ids("<|AUDIO|>")))
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5) if n.endswith(".weight") else p.normal_(0, 0.1)
            elif "language_model" in n or "projector" in n or "lm_head" in n or "embed" in n:
                p.normal_(0, 0.2)
            elif "audio_tower" in n:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    transformers.WhisperFeatureExtractor(**{"feature_size": 128, **(features or {})}).save_pretrained(path)
    return path


def hf_qwen2_audio(path: Path, dtype=torch.float32, device: str = "cpu"):
    import transformers

    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation="eager").to(device)
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_inputs(proc, text: str, audios: list[np.ndarray]) -> dict:
    """The processor's input_ids (and features with their mask) for one prompt."""
    if not audios:
        return dict(proc.tokenizer([text], return_tensors="pt"))
    return dict(proc(text=[text], audio=audios, sampling_rate=RATE, return_tensors="pt"))


def hf_greedy(model, inputs: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on a processor's ``inputs`` (one prompt), EOS ignored:
    the new tokens."""
    dev = model.device
    kw = {k: v.to(dev) for k, v in inputs.items()
          if k in ("input_ids", "attention_mask", "input_features", "feature_attention_mask")}
    with torch.no_grad():
        out = model.generate(**kw, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, kw["input_ids"].shape[1]:].tolist()


def tone(seconds: float, seed: int = 0, rate: int = RATE) -> np.ndarray:
    """float32 mono: a few random tones and a little noise, ``seconds`` long at ``rate``."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(round(seconds * rate))) / rate
    x = sum(rng.uniform(0.1, 0.4) * np.sin(2 * np.pi * rng.uniform(100, 3000) * t + rng.uniform(0, 6))
            for _ in range(3))
    return (x + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)


def wav_bytes(x: np.ndarray, rate: int = RATE, width: int = 2, channels: int = 1) -> bytes:
    """``x`` (mono float in [-1, 1]) as a PCM WAV file of ``width`` bytes a sample, the
    same samples in each of ``channels`` channels."""
    scale = {1: 127, 2: 32767, 3: (1 << 23) - 1, 4: (1 << 31) - 1}[width]
    q = np.round(np.clip(x, -1, 1) * scale).astype(np.int64)
    q = np.repeat(q[:, None], channels, axis=1).reshape(-1)
    if width == 1:
        raw = (q + 128).astype(np.uint8).tobytes()
    elif width == 3:
        u = (q & 0xFFFFFF).astype(np.uint32)
        raw = np.stack([u & 0xFF, (u >> 8) & 0xFF, (u >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    else:
        raw = q.astype("<i2" if width == 2 else "<i4").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(raw)
    return buf.getvalue()
