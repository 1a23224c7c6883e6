"""Tiny random LLaVA-OneVision checkpoints (transformers' LlavaOnevisionForConditionalGeneration
saved as fp32 safetensors, a LlavaOnevisionImageProcessor's preprocessor_config.json beside
them, the tiny tokenizer with ``<image>`` and ``<video>``), shared by the model and engine
tests.

The tower: SigLIP, 16 x 16 tiles in 4 x 4 patches (16 rows per tile, no CLS row), 3 layers,
feature layer -1, select strategy "full"; the text model a tiny Qwen2. image_grid_pinpoints
every 1 .. 3 x 1 .. 3 tiles and vision_aspect_ratio "anyres_max_4", so a grid of up to 8 x 8
rows is packed as it is and a larger one (3 x 3 tiles: 12 x 12; 2 x 3: 8 x 12) pooled: both
of transformers' paths run."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.llava_checkpoint import LLAVA_CHAT_TEMPLATE

TILE, PATCH = 16, 4
PINPOINTS = [[16 * i, 16 * j] for i in range(1, 4) for j in range(1, 4)]
ASPECT = "anyres_max_4"
_VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=2, image_size=TILE, patch_size=PATCH)
_TEXT = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)


def hf_processor(**kw):
    import transformers

    cls = getattr(transformers, "LlavaOnevisionImageProcessorPil", None) or transformers.LlavaOnevisionImageProcessor
    return cls(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS, **kw)


def build_tiny_llava_onevision(path: Path, seed: int = 0, tokenizer: bool = True, text: dict | None = None,
                               **overrides) -> Path:
    """Save a tiny LLaVA-OneVision checkpoint under ``path``; ``text``: text_config fields
    over ours; ``overrides``: LlavaOnevisionConfig fields (vision_feature_layer, ...)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    image_token, video_token = 255, 254
    if tokenizer:
        from tests.server.conftest import build_tiny_tokenizer

        build_tiny_tokenizer(path, vocab_size=240)
        tok = transformers.AutoTokenizer.from_pretrained(path)
        tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
        tok.chat_template = LLAVA_CHAT_TEMPLATE
        tok.save_pretrained(path)
        image_token = int(tok.convert_tokens_to_ids("<image>"))
        video_token = int(tok.convert_tokens_to_ids("<video>"))
    config = transformers.LlavaOnevisionConfig(
        text_config={**_TEXT, **(text or {})}, vision_config=dict(_VISION), image_token_index=image_token,
        video_token_index=video_token, image_grid_pinpoints=PINPOINTS,
        **{"vision_aspect_ratio": ASPECT, **overrides})
    torch.manual_seed(seed)
    model = transformers.LlavaOnevisionForConditionalGeneration(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "language_model" in n or "multi_modal_projector" in n:
                p.uniform_(0.5, 1.5) if "norm" in n else p.normal_(0, 0.2)
            elif n.endswith("image_newline"):
                p.normal_(0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    hf_processor().save_pretrained(path)
    return path


def hf_llava_onevision(path: Path, dtype=torch.float32, device: str = "cpu"):
    import transformers

    model = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation="eager").to(device)
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_inputs(model, images: list) -> dict:
    """transformers' image inputs for one prompt's ``images`` (our AnyResImage's: tiles
    padded to one count, as the processor pads them; batch_num_images says how many)."""
    if not images:
        return {}
    dev = model.device
    most = max(im.pixels.shape[0] for im in images)
    px = torch.zeros(len(images), most, *images[0].pixels.shape[1:])
    for i, im in enumerate(images):
        px[i, :im.pixels.shape[0]] = im.pixels
    return {"pixel_values": px.to(dev, model.dtype),
            "image_sizes": torch.tensor([list(im.size) for im in images], device=dev),
            "batch_num_images": torch.tensor([len(images)], device=dev)}


def hf_llava_onevision_greedy(model, ids: list[int], images: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on expanded ``ids`` with ``images`` (AnyResImage's, the
    prompt's all; [] for a text-only prompt), EOS ignored: the new tokens."""
    dev = model.device
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids], device=dev),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **hf_inputs(model, images))
    return out[0, len(ids):].tolist()
