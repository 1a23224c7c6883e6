"""Tiny random LLaVA checkpoints (transformers' LlavaForConditionalGeneration saved as fp32
safetensors, a CLIPImageProcessor's preprocessor_config.json beside them, and a tiny
tokenizer with ``<image>`` as a special token), shared by the model, engine and server tests.

The tower: 28 x 28 images in 7 x 7 patches, 16 rows per image under "default" (17 under
"full"); 3 layers, feature layer -2 (its last layer unused). The language model and the
projector are widened as the family tests widen theirs (logits far from ties)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

IMAGE_SIZE, PATCH = 28, 7
_TEXT = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
               image_size=IMAGE_SIZE, patch_size=PATCH)
# llava-hf's chat template: images first, then the text, of each turn
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def image_token_of(folder: Path) -> int:
    from transformers import AutoTokenizer

    return int(AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<image>"))


def build_tiny_llava(path: Path, seed: int = 0, tokenizer: bool = True, text: dict | None = None,
                     **overrides) -> Path:
    """Save a tiny LLaVA checkpoint under ``path``; ``text``: text_config fields over ours
    (head_dim 64 for the GPU's kernels); ``overrides``: LlavaConfig fields
    (vision_feature_layer, vision_feature_select_strategy, ...)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    image_token = 255
    if tokenizer:
        from tests.server.conftest import build_tiny_tokenizer

        build_tiny_tokenizer(path, vocab_size=240)
        tok = transformers.AutoTokenizer.from_pretrained(path)
        tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
        tok.chat_template = LLAVA_CHAT_TEMPLATE
        tok.save_pretrained(path)
        image_token = int(tok.convert_tokens_to_ids("<image>"))
    config = transformers.LlavaConfig(text_config={**_TEXT, **(text or {})}, vision_config=dict(_VISION),
                                      image_token_index=image_token, **overrides)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "language_model" not in n and "multi_modal_projector" not in n:
                continue
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    ).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["image_token_index"] == image_token
    return path


def smooth_image(h: int, w: int, seed: int = 0):
    """A PIL RGB image of smooth color fields (a photo's statistics more than noise's)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BILINEAR)


def hf_llava(path: Path):
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_llava_greedy(model, ids: list[int], pixel_values: torch.Tensor | None,
                    max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on expanded ``ids`` with ``pixel_values`` [n, 3, S, S]
    (None: a text-only prompt), EOS ignored: the new tokens."""
    kw = {} if pixel_values is None else {"pixel_values": pixel_values}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()
