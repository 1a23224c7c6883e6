"""Tiny random Gemma 3 checkpoints (transformers' Gemma3ForConditionalGeneration saved as
fp32 safetensors, a Gemma3ImageProcessor's preprocessor_config.json beside them, and a tiny
tokenizer with <start_of_image> / <end_of_image> / <image_soft_token> and the newline
tokens), shared by the model, engine and server tests.

The tower: 56 x 56 images in 7 x 7 patches (an 8 x 8 grid) pooled 2 x 2 to 16 rows per
image; 2 SigLIP layers. The text model: 4 layers, three sliding (window 8, shorter than an
image, so the window cuts into an image's both-ways attention as transformers' mask does)
and one global."""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_SIZE, PATCH, TOKENS = 56, 7, 16
_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             sliding_window=8, query_pre_attn_scalar=16, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, pad_token_id=0,
             layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]
# Gemma 3's chat template, cut down: turns, image parts as <start_of_image>
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# ids when built without a tokenizer
BOI, EOI, SOFT = 250, 251, 252


def build_tiny_gemma3(path: Path, seed: int = 0, tokenizer: bool = True, text: dict | None = None,
                      **overrides) -> Path:
    """Save a tiny Gemma 3 checkpoint under ``path``; ``text``: text_config fields over ours
    (head_dim 64 for the GPU's kernels); ``overrides``: Gemma3Config fields."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    boi, eoi, soft = BOI, EOI, SOFT
    if tokenizer:
        from tests.server.conftest import build_tiny_tokenizer

        build_tiny_tokenizer(path, vocab_size=236)
        tok = transformers.AutoTokenizer.from_pretrained(path)
        tok.add_tokens(NEWLINES)
        tok.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<end_of_image>",
                                                              "<image_soft_token>", "<start_of_turn>",
                                                              "<end_of_turn>"]})
        tok.chat_template = GEMMA3_CHAT_TEMPLATE
        tok.save_pretrained(path)
        boi, eoi, soft = (int(tok.convert_tokens_to_ids(t))
                          for t in ("<start_of_image>", "<end_of_image>", "<image_soft_token>"))
    config = transformers.Gemma3Config(
        text_config={**_TEXT, **(text or {})}, vision_config=dict(_VISION), mm_tokens_per_image=TOKENS,
        image_token_index=soft, boi_token_index=boi, eoi_token_index=eoi,
        **{"tie_word_embeddings": False, **overrides})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "embed_tokens" in n:
                p.normal_(0, 0.05)  # x sqrt(64): rows of the stream's scale
            elif "norm" in n and "vision_tower" not in n:
                p.uniform_(-0.5, 0.5)  # Gemma's norms: x (1 + w)
            elif "vision_tower" in n and "norm" in n:
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.2)
        # never generated: a sampled <image_soft_token> fed back would read as an image's
        # position in transformers' teacher-forced pass (the GPU test's)
        model.lm_head.weight[[boi, eoi, soft]] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    return path


def hf_gemma3(path: Path):
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_gemma3_greedy(model, ids: list[int], pixel_values: torch.Tensor | None,
                     max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on expanded ``ids`` with ``pixel_values`` [n, 3, S, S]
    (None: text only) and the token_type_ids its processor gives (1 at image rows), EOS
    ignored: the new tokens."""
    t = torch.tensor([ids])
    kw = {} if pixel_values is None else {"pixel_values": pixel_values}
    with torch.no_grad():
        out = model.generate(input_ids=t, attention_mask=torch.ones_like(t),
                             token_type_ids=(t == model.config.image_token_index).long(),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()
