"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints (transformers' *ForConditionalGeneration
saved as fp32 safetensors, a Qwen2VLImageProcessor's preprocessor_config.json beside them,
and a tiny tokenizer with <|vision_start|> <|image_pad|> <|vision_end|> <|video_pad|> as
special tokens and Qwen's chat template), shared by the model, engine and server tests.

The tower: 14-pixel patches merged 2 x 2, images resized to multiples of 28 with at most
28 x 28 x 24 pixels (so at most 24 rows each); 3 blocks. Qwen2.5-VL's windows are 56 pixels
(2 x 2 merged units) with block 1 the only full-attention one, so an image of 3 x 4 merged
units has windows of 4, 4, 2 and 2 units. The text model: Qwen2 with M-RoPE sections [2, 3, 3]
of its 8 rotated pairs (head_dim 16); widened as the family tests widen theirs."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_PIXELS = 28 * 28 * 24
_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
_VISION = {
    "qwen2_vl": dict(depth=3, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=64),
    "qwen2_5_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                       window_size=56, fullatt_block_indexes=[1]),
}
SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# Qwen2-VL's chat template (its image parts as <|vision_start|><|image_pad|><|vision_end|>,
# its video parts as <|vision_start|><|video_pad|><|vision_end|>)
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2_vl(path: Path, variant: str = "qwen2_vl", seed: int = 0, tokenizer: bool = True,
                        text: dict | None = None) -> Path:
    """Save a tiny checkpoint of ``variant`` ("qwen2_vl" or "qwen2_5_vl") under ``path``;
    ``text``: text_config fields over ours (a wider head for the GPU's kernels)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    ids = dict(vision_start_token_id=250, image_token_id=251, vision_end_token_id=252, video_token_id=253)
    if tokenizer:
        from tests.server.conftest import build_tiny_tokenizer

        build_tiny_tokenizer(path, vocab_size=240)
        tok = transformers.AutoTokenizer.from_pretrained(path)
        tok.add_special_tokens({"additional_special_tokens": [*SPECIALS, "<|im_start|>", "<|im_end|>"]})
        tok.chat_template = QWEN_CHAT_TEMPLATE
        tok.save_pretrained(path)
        got = tok.convert_tokens_to_ids(SPECIALS)
        ids = dict(zip(["vision_start_token_id", "image_token_id", "vision_end_token_id",
                        "video_token_id"], got, strict=True))
    cls = transformers.Qwen2VLConfig if variant == "qwen2_vl" else transformers.Qwen2_5_VLConfig
    config = cls(text_config={**_TEXT, **(text or {})}, vision_config=dict(_VISION[variant]), **ids)
    if variant == "qwen2_vl":
        config.vision_config.hidden_size = config.text_config.hidden_size
    else:
        config.vision_config.out_hidden_size = config.text_config.hidden_size
    torch.manual_seed(seed)
    model_cls = (transformers.Qwen2VLForConditionalGeneration if variant == "qwen2_vl"
                 else transformers.Qwen2_5_VLForConditionalGeneration)
    model = model_cls(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "ln_q" in n:
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.2 if "language_model" in n or "lm_head" in n else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": MAX_PIXELS}
                                          ).save_pretrained(path)
    return path


def hf_qwen(path: Path, variant: str = "qwen2_vl"):
    import transformers

    cls = (transformers.Qwen2VLForConditionalGeneration if variant == "qwen2_vl"
           else transformers.Qwen2_5_VLForConditionalGeneration)
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_inputs(model, x: torch.Tensor, images: list | None, videos: list | None = None) -> dict:
    """transformers' multimodal kwargs for ids ``x`` [1, n]: ``images`` and ``videos`` our
    QwenImage objects (patches, grids; a video's time step: Qwen2.5-VL's second_per_grid_ts
    x tokens_per_second), mm_token_type_ids 1 at image rows, 2 at video rows."""
    kw: dict = {}
    types = torch.zeros_like(x, dtype=torch.int32)
    if images:
        kw.update(pixel_values=torch.cat([im.patches for im in images]),
                  image_grid_thw=torch.tensor([list(im.grid) for im in images]))
        types[x == model.config.image_token_id] = 1
    if videos:
        kw.update(pixel_values_videos=torch.cat([v.patches for v in videos]),
                  video_grid_thw=torch.tensor([list(v.grid) for v in videos]))
        types[x == model.config.video_token_id] = 2
        if videos[0].time_step is not None:
            tps = model.config.vision_config.tokens_per_second
            kw["second_per_grid_ts"] = torch.tensor([v.time_step / tps for v in videos])
    if images or videos:
        kw["mm_token_type_ids"] = types
    return kw


def hf_qwen_greedy(model, ids: list[int], images: list | None, max_new_tokens: int,
                   videos: list | None = None) -> list[int]:
    """transformers' greedy generate on expanded ``ids`` with ``images`` and ``videos`` (our
    QwenImage objects: hf_inputs; None: a text-only prompt), EOS ignored: the new tokens."""
    x = torch.tensor([ids])
    kw = hf_inputs(model, x, images, videos)
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()
