"""Tiny random checkpoints with a Pixtral tower (transformers' Mistral3ForConditionalGeneration
or LlavaForConditionalGeneration over a "pixtral" vision_config, saved as fp32 safetensors),
a PixtralImageProcessorPil's preprocessor_config.json and a tiny tokenizer with [IMG],
[IMG_BREAK] and [IMG_END] as special tokens, shared by the model and engine tests.

The tower: 4 x 4 patches, 2 layers, images fitted into 32 x 32 (Mistral3: merged 2 x 2, so
at most 4 x 4 prompt positions) or 24 x 24 (LLaVA: 6 x 6)."""

from __future__ import annotations

from pathlib import Path

import torch

PATCH = 4
_TEXT = dict(model_type="mistral", vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False, sliding_window=None)
_VISION = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=2, image_size=32, patch_size=PATCH, hidden_act="silu")
# Mistral Small 3.1's way of showing parts: a loop over a message's content blocks
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{{ block['text'] }}"
    "{% elif block['type'] in ['image', 'image_url'] %}{{ '[IMG]' }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] if message['content'] is string else "
    "message['content'][0]['text'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_tiny_pixtral(path: Path, llava: bool = False, seed: int = 0, text: dict | None = None,
                       **overrides) -> Path:
    """Save a tiny Mistral3 (``llava``: LLaVA-Pixtral) checkpoint under ``path``;
    ``text``: text_config fields over ours; ``overrides``: the wrapper's config fields."""
    import transformers

    from tests.server.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(path, vocab_size=240)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    img = int(tok.convert_tokens_to_ids("[IMG]"))
    tc = {**_TEXT, **(text or {})}
    if llava:
        config = transformers.LlavaConfig(text_config=tc, vision_config=dict(_VISION), **{
            "image_token_index": img, "vision_feature_layer": -1, "tie_word_embeddings": False,
            "vision_feature_select_strategy": "full", **overrides})
        model = transformers.LlavaForConditionalGeneration(config)
    else:
        config = transformers.Mistral3Config(text_config=tc, vision_config=dict(_VISION),
                                             image_token_index=img, spatial_merge_size=2,
                                             tie_word_embeddings=False, **overrides)
        model = transformers.Mistral3ForConditionalGeneration(config)
    torch.manual_seed(seed)
    model = model.float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    transformers.PixtralImageProcessorPil(
        size={"longest_edge": 24 if llava else 32}, patch_size={"height": PATCH, "width": PATCH},
    ).save_pretrained(path)
    return path


def image_processor(path: Path):
    """transformers' PixtralImageProcessorPil of the checkpoint."""
    import transformers

    return transformers.PixtralImageProcessorPil.from_pretrained(path)


def hf_expand(path: Path, text: str, image_sizes: list[tuple[int, int]]) -> list[int]:
    """``text``'s ids with each [IMG] replaced as PixtralProcessor.replace_image_token
    replaces it for images of these preprocessed sizes (its rule written out: the processor
    module wants torchvision, not installed here), then tokenized by the checkpoint's
    tokenizer."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    patch = PATCH * getattr(cfg, "spatial_merge_size", 1)
    parts = text.split("[IMG]")
    assert len(parts) == len(image_sizes) + 1
    out = parts[0]
    for (height, width), part in zip(image_sizes, parts[1:], strict=True):
        rows = [["[IMG]"] * (width // patch) + ["[IMG_BREAK]"]] * (height // patch)
        flat = [t for row in rows for t in row]
        flat[-1] = "[IMG_END]"
        out += "".join(flat) + part
    return transformers.AutoTokenizer.from_pretrained(path)(out)["input_ids"]


def hf_model(path: Path):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    cls = (transformers.Mistral3ForConditionalGeneration if cfg.model_type == "mistral3"
           else transformers.LlavaForConditionalGeneration)
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def batch_pixels(pixels: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's pixel values [3, H, W] padded with zeros to one [n, 3, Hmax, Wmax] (as
    the processor batches them) and image_sizes [n, 2]."""
    hm, wm = max(p.shape[1] for p in pixels), max(p.shape[2] for p in pixels)
    out = torch.zeros(len(pixels), 3, hm, wm)
    for i, p in enumerate(pixels):
        out[i, :, :p.shape[1], :p.shape[2]] = p.cpu()
    return out, torch.tensor([list(p.shape[1:]) for p in pixels])


def hf_greedy(model, ids: list[int], pixels: list[torch.Tensor] | None, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on expanded ``ids`` with each image's pixel values
    (None: a text-only prompt), EOS ignored: the new tokens."""
    kw = {}
    if pixels:
        pv, sizes = batch_pixels(pixels)
        kw = {"pixel_values": pv.to(model.device, model.dtype), "image_sizes": sizes.to(model.device)}
    dev = model.device
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids], device=dev),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()
