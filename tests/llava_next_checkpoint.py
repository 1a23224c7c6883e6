"""Tiny random LLaVA-NeXT checkpoints (transformers' LlavaNextForConditionalGeneration saved
as fp32 safetensors, a LlavaNextImageProcessor's preprocessor_config.json beside them, the
tiny tokenizer with ``<image>``), shared by the model, engine and server tests.

The tower: 16 x 16 tiles in 4 x 4 patches (16 rows per tile), 3 layers, feature layer -2;
image_grid_pinpoints llava-v1.6's shapes at that tile size (1 x 2, 2 x 1, 2 x 2, 3 x 1,
1 x 3 tiles), so an image gives 16 + r x (c + 1) rows, r, c up to 8 / 12."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.llava_checkpoint import _TEXT, LLAVA_CHAT_TEMPLATE

TILE, PATCH = 16, 4
PINPOINTS = [[16, 32], [32, 16], [32, 32], [48, 16], [16, 48]]
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
               image_size=TILE, patch_size=PATCH)


def hf_processor(**kw):
    import transformers

    cls = getattr(transformers, "LlavaNextImageProcessorPil", None) or transformers.LlavaNextImageProcessor
    return cls(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE},
               image_grid_pinpoints=PINPOINTS, **kw)


def build_tiny_llava_next(path: Path, seed: int = 0, tokenizer: bool = True, text: dict | None = None,
                          **overrides) -> Path:
    """Save a tiny LLaVA-NeXT checkpoint under ``path``; ``text``: text_config fields over
    ours; ``overrides``: LlavaNextConfig fields (vision_feature_layer, ...)."""
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
    text_config = {**_TEXT, "max_position_embeddings": 1024, **(text or {})}
    config = transformers.LlavaNextConfig(text_config=text_config, vision_config=dict(_VISION),
                                          image_token_index=image_token,
                                          image_grid_pinpoints=PINPOINTS, **overrides)
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "language_model" in n or "multi_modal_projector" in n:
                p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.2)
            elif n.endswith("image_newline"):
                p.normal_(0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    hf_processor().save_pretrained(path)
    return path


def hf_llava_next(path: Path, dtype=torch.float32, device: str = "cpu"):
    import transformers

    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation="eager").to(device)
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_llava_next_greedy(model, ids: list[int], images: list | None, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on expanded ``ids`` with ``images`` (our AnyResImage's:
    their tiles padded to one count, as LlavaNextImageProcessor pads a batch; None: a
    text-only prompt), EOS ignored: the new tokens."""
    kw = {}
    dev = model.device
    if images:
        most = max(im.pixels.shape[0] for im in images)
        px = torch.zeros(len(images), most, *images[0].pixels.shape[1:])
        for i, im in enumerate(images):
            px[i, :im.pixels.shape[0]] = im.pixels
        kw = {"pixel_values": px.to(dev, model.dtype),
              "image_sizes": torch.tensor([list(im.size) for im in images], device=dev)}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids], device=dev),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()
