"""Tiny random InternVL checkpoints (transformers' InternVLForConditionalGeneration saved as
fp32 safetensors, a GotOcr2ImageProcessor's preprocessor_config.json and a
processor_config.json beside them, the tiny tokenizer with ``<img>``, ``</img>``,
``<IMG_CONTEXT>`` and InternVL's chat template), shared by the model, engine and server
tests.

The tower: InternViT, 16 x 16 tiles in 2 x 2 patches (an 8 x 8 grid, a CLS row before it),
3 layers, pixel-shuffled by 2 to 16 rows a tile; tiling 1 .. 6 tiles, so an image is 1, 3
(2 tiles and the thumbnail) .. 7 tiles, 16 .. 112 rows. The text model a tiny Qwen2 (or
Qwen3 / Llama / Qwen3-MoE / GPT-OSS: ``text``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

TILE, PATCH, MAX_TILES = 16, 2, 6
ROWS = 16  # per tile: (16 / 2 / 2)^2
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# InternVLVideoProcessor's file as the -hf repos ship it (frames resized to the tower's square,
# bicubic, ImageNet's mean and std; frames taken as given)
VIDEO_PROCESSOR = {"video_processor_type": "InternVLVideoProcessor", "processor_class": "InternVLProcessor",
                   "size": {"height": TILE, "width": TILE}, "resample": 3, "do_resize": True, "do_rescale": True,
                   "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": IMAGENET_MEAN,
                   "image_std": IMAGENET_STD, "do_convert_rgb": True, "do_sample_frames": False}
# InternVL's chat template (transformers' converted checkpoints): an image part is
# <IMG_CONTEXT> on its own line, a video part <video>
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
_VISION = dict(model_type="internvl_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=2, image_size=[TILE, TILE], patch_size=[PATCH, PATCH], attention_bias=True)
_TEXT = dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False, rope_theta=10000.0)
_TEXT_KINDS = {"qwen2": {}, "qwen3": dict(model_type="qwen3", head_dim=16),
               "llama": dict(model_type="llama"),
               "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2, norm_topk_prob=True),
               # sliding and full layers alternating, as GPT-OSS's
               "gpt_oss": dict(model_type="gpt_oss", head_dim=16, intermediate_size=32, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"],
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})}


def hf_image_processor(**kw):
    import transformers

    cls = getattr(transformers, "GotOcr2ImageProcessorPil", None) or transformers.GotOcr2ImageProcessor
    return cls(**{"size": {"height": TILE, "width": TILE}, "max_patches": MAX_TILES, "image_mean": IMAGENET_MEAN,
                  "image_std": IMAGENET_STD, **kw})


def hf_processor(path: Path, image_processor=None):
    """transformers' InternVLProcessor on the folder's tokenizer (built field by field: its
    __init__ wants torchvision's video processor, which the CPU image need not have)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    p = transformers.InternVLProcessor.__new__(transformers.InternVLProcessor)
    p.image_processor = image_processor or hf_image_processor()
    p.tokenizer = tok
    p.image_seq_length = ROWS
    p.start_image_token, p.end_image_token = tok.start_image_token, tok.end_image_token
    p.start_image_token_id, p.end_image_token_id = tok.start_image_token_id, tok.end_image_token_id
    p.image_token, p.image_token_id = tok.context_image_token, tok.context_image_token_id
    p.video_token = tok.video_token
    p.multimodal_pattern = re.compile(f"(?P<image>{re.escape(p.image_token)})|(?P<video>{re.escape(p.video_token)})")
    return p


def build_tiny_internvl(path: Path, seed: int = 0, tokenizer: bool = True, text: str = "qwen2",
                        vision: dict | None = None, text_fields: dict | None = None,
                        video_processor: dict | None = None, **overrides) -> Path:
    """Save a tiny InternVL checkpoint under ``path``; ``text``: the text model's kind
    (qwen2, qwen3, llama, qwen3_moe, gpt_oss), ``text_fields`` text_config fields over ours; ``vision``:
    vision_config fields over ours; ``video_processor``: video_preprocessor_config.json fields
    over VIDEO_PROCESSOR's; ``overrides``: InternVLConfig fields (vision_feature_layer, ...)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    image_token = 242
    if tokenizer:
        from tests.server.conftest import build_tiny_tokenizer

        build_tiny_tokenizer(path, vocab_size=240)
        tok = transformers.AutoTokenizer.from_pretrained(path)
        tok.add_special_tokens({"additional_special_tokens": ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"]})
        tok.save_pretrained(path)
        tok = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens={
            "start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
            "video_token": "<video>"})
        tok.chat_template = INTERNVL_CHAT_TEMPLATE
        tok.save_pretrained(path)
        image_token = int(tok.convert_tokens_to_ids("<IMG_CONTEXT>"))
    vc = {**_VISION, **(vision or {})}
    rows = round((TILE // vc["patch_size"][0] * overrides.get("downsample_ratio", 0.5)) ** 2)
    config = transformers.InternVLConfig(
        text_config={**_TEXT, **_TEXT_KINDS[text], **(text_fields or {})}, vision_config=vc, image_token_id=image_token,
        image_seq_length=rows, **overrides)
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or ".lambda_" in n:
                p.uniform_(0.5, 1.5) if n.endswith((".weight", ".lambda_1", ".lambda_2")) else p.normal_(0, 0.1)
            elif "language_model" in n or "multi_modal_projector" in n or "embeddings" in n:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    hf_image_processor().save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_PROCESSOR, **(video_processor or {})}))
    (path / "processor_config.json").write_text(
        json.dumps({"image_seq_length": rows, "processor_class": "InternVLProcessor"}) + "\n")
    return path


def hf_internvl(path: Path, dtype=torch.float32, device: str = "cpu"):
    import transformers

    model = transformers.InternVLForConditionalGeneration.from_pretrained(
        path, dtype=dtype, attn_implementation="eager").to(device)
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_pixels(model, items: list) -> dict:
    """transformers' pixel_values for one prompt's images (our InternVLImage's: their tiles
    in order, uint8 ones normalized as GotOcr2ImageProcessor does)."""
    from flashpage.config import ImageProcessing
    from flashpage.models.clip_image import normalize

    if not items:
        return {}
    proc = ImageProcessing(None, (TILE, TILE), None, 1 / 255, tuple(IMAGENET_MEAN), tuple(IMAGENET_STD))
    px = torch.cat([normalize(it.pixels, proc) if it.pixels.dtype == torch.uint8 else it.pixels for it in items])
    return {"pixel_values": px.to(model.device, model.dtype)}


def hf_internvl_greedy(model, ids: list[int], items: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on expanded ``ids`` with ``items`` (InternVLImage's, the
    prompt's all; [] for a text-only prompt), EOS ignored: the new tokens."""
    dev = model.device
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids], device=dev),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0, **hf_pixels(model, items))
    return out[0, len(ids):].tolist()


def to_remote_layout(src: Path, dst: Path, internlm2: bool = False, **top) -> Path:
    """``src`` (a tiny checkpoint of ours) in OpenGVLab's remote-code layout at ``dst``
    (InternVLChatModel: llm_config, vision_config under InternVisionConfig's names,
    ``vision_model.`` / ``mlp1.`` tensors with each layer's q / k / v fused in one qkv,
    ``language_model.lm_head``; transformers' convert_internvl_weights_to_hf backwards),
    with a CLIP-style preprocessor_config.json as those repos ship (their chat code does not
    read it); ``internlm2``: a Llama text model written as InternLM2 (InternVL2.5-8B's: its
    llm_config and ``language_model.`` tensors in InternLM2's names and grouped wqkv,
    tests/internlm2_checkpoint.py); ``top``: config fields over ours (ps_version,
    max_dynamic_patch, ...)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, dst / f.name)
    hf = json.loads((src / "config.json").read_text())
    renames = [(r"^vision_tower\.", "vision_model."), (r"\.layer\.", ".layers."), (r"cls_token$", "class_embedding"),
               (r"position_embeddings$", "position_embedding"), (r"patch_embeddings\.projection\.", "patch_embedding."),
               (r"\.lambda_(\d)$", r".ls\1"), (r"\.attention\.projection_layer\.", ".attn.proj."),
               (r"\.attention\.", ".attn."), (r"\.layernorm_before\.", ".norm1."), (r"\.layernorm_after\.", ".norm2."),
               (r"^multi_modal_projector\.layer_norm\.", "mlp1.0."), (r"^multi_modal_projector\.linear_1\.", "mlp1.1."),
               (r"^multi_modal_projector\.linear_2\.", "mlp1.3."), (r"^lm_head\.", "language_model.lm_head.")]
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".attention.k_proj." in name or ".attention.v_proj." in name:
            continue
        new = name
        for pat, rep in renames:
            new = re.sub(pat, rep, new)
        if ".attention.q_proj." in name:
            parts = [tensors[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[new.replace(".q_proj.", ".qkv.")] = torch.cat(parts).contiguous()
        else:
            out[new] = t.contiguous()
    llm = {**hf["text_config"], "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    if internlm2:
        from tests.internlm2_checkpoint import internlm2_config, internlm2_tensors

        assert llm["model_type"] == "llama", "only a Llama text model is written as InternLM2"
        out = internlm2_tensors(out, llm.get("num_key_value_heads") or llm["num_attention_heads"], "language_model.")
        llm = internlm2_config(llm)
    save_file(out, str(dst / "model.safetensors"))
    v = hf["vision_config"]
    vision = {"model_type": "intern_vit_6b", "architectures": ["InternVisionModel"], "hidden_size": v["hidden_size"],
              "intermediate_size": v["intermediate_size"], "num_hidden_layers": v["num_hidden_layers"],
              "num_attention_heads": v["num_attention_heads"], "image_size": v["image_size"][0],
              "patch_size": v["patch_size"][0], "hidden_act": v["hidden_act"], "layer_norm_eps": v["layer_norm_eps"],
              "norm_type": v["norm_type"], "qkv_bias": v["attention_bias"], "qk_normalization": v["use_qk_norm"],
              "num_channels": 3, "drop_path_rate": 0.0, "use_flash_attn": True}
    config = {"architectures": ["InternVLChatModel"], "model_type": "internvl_chat",
              # the language model ties as transformers' did (by the top-level flag)
              "llm_config": llm,
              "vision_config": vision,
              "downsample_ratio": hf["downsample_ratio"], "select_layer": hf["vision_feature_layer"],
              "ps_version": "v2", "dynamic_image_size": True, "use_thumbnail": True, "min_dynamic_patch": 1,
              "max_dynamic_patch": MAX_TILES, "force_image_size": TILE, "template": "internvl2_5",
              "torch_dtype": "float32", **top}
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": TILE, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
        "resample": 3, "size": TILE}))
    return dst
