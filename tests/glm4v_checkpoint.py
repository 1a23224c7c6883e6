"""Tiny random GLM-4.1V checkpoints (transformers' Glm4vForConditionalGeneration saved as fp32
safetensors, a Glm4vImageProcessor's preprocessor_config.json beside them, and a tiny
tokenizer with GLM's <|begin_of_image|> <|image|> <|end_of_image|> <|begin_of_video|>
<|video|> <|end_of_video|> as special tokens and a GLM-4.1V-style chat template), for the
model, engine and server tests.

The tower: 14-pixel patches merged 2 x 2, images resized to multiples of 28 with at most
28 x 28 x 24 pixels each (the processor's bounds count an image twice: 2 x that), so at most
24 rows; 2 blocks, a 4 x 4 learned position table (image_size 56), sampled bicubically at
every grid. The text model: GLM-4's layers, 2 heads of 32 (rotary on the first 16 dims: 8
interleaved pairs), M-RoPE sections [2, 3, 3]."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_PIXELS = 28 * 28 * 24  # per image (the processor's longest_edge is twice this)
_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
             rms_norm_eps=1e-5, partial_rotary_factor=0.5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                              "partial_rotary_factor": 0.5})
_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
               image_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, rms_norm_eps=1e-5)
SPECIALS = ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|video|>",
            "<|end_of_video|>"]
_IDS = ["image_start_token_id", "image_token_id", "image_end_token_id", "video_start_token_id",
        "video_token_id", "video_end_token_id"]
# GLM-4.1V's chat template, shortened (its image / video parts as the published one writes them)
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif c['type'] == 'video' or 'video' in c %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# GLM-4.5V's text model (Glm4vMoeForConditionalGeneration): a dense first layer, then 8 experts
# of 24 in 2 groups (the best group kept), top-2, one shared expert, routed weights x 2
_MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, moe_intermediate_size=24, n_shared_experts=1, routed_scaling_factor=2.0,
            norm_topk_prob=True, head_dim=32)


def build_tiny_glm4v(path: Path, seed: int = 0, text: dict | None = None, moe: bool = False) -> Path:
    """Save a tiny GLM-4.1V checkpoint under ``path``; ``text``: text_config fields over ours
    (a wider model for the GPU's kernels); ``moe``: GLM-4.5V's (the routers' correction biases
    random too)."""
    import transformers

    from tests.server.conftest import build_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(path, vocab_size=240)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": [*SPECIALS, "[gMASK]", "<sop>", "<|user|>",
                                                          "<|assistant|>", "<|system|>"]})
    tok.chat_template = GLM_CHAT_TEMPLATE
    tok.save_pretrained(path)
    ids = dict(zip(_IDS, tok.convert_tokens_to_ids(SPECIALS), strict=True))
    tc = {**_TEXT, **(_MOE if moe else {}), **(text or {})}
    config_cls = transformers.Glm4vMoeConfig if moe else transformers.Glm4vConfig
    config = config_cls(text_config=tc, vision_config={**_VISION, "out_hidden_size": tc["hidden_size"]},
                        eos_token_id=2, **ids)
    torch.manual_seed(seed)
    model_cls = transformers.Glm4vMoeForConditionalGeneration if moe else transformers.Glm4vForConditionalGeneration
    model = model_cls(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5) if n.endswith("weight") else p.normal_(0, 0.1)
            else:
                p.normal_(0, 0.2 if "language_model" in n or "lm_head" in n else 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    transformers.Glm4vImageProcessorPil(size={"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * MAX_PIXELS}
                                        ).save_pretrained(path)
    return path


_SHARED: dict[str, object] = {}


def shared_glm4v_path(tmp_path_factory) -> Path:
    """One tiny checkpoint for the whole test session (the model, engine, server and inspect
    tests read it, none changes it)."""
    if "path" not in _SHARED:
        _SHARED["path"] = build_tiny_glm4v(tmp_path_factory.mktemp("glm4v"))
    return _SHARED["path"]  # type: ignore[return-value]


def shared_glm4v(tmp_path_factory) -> tuple[Path, object]:
    """``shared_glm4v_path``'s checkpoint and transformers' fp32 model of it (made once)."""
    path = shared_glm4v_path(tmp_path_factory)
    if "hf" not in _SHARED:
        _SHARED["hf"] = hf_glm4v(path)
    return path, _SHARED["hf"]


def hf_glm4v(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of the checkpoint at ``path`` (GLM-4.1V or GLM-4.5V, as its config
    says)."""
    import json

    import transformers

    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=dtype, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def hf_glm4v_greedy(model, ids: list[int], images: list | None, max_new_tokens: int,
                    videos: list | None = None) -> list[int]:
    """transformers' greedy generate on expanded ``ids`` with ``images`` and ``videos`` (our
    QwenImage objects with patches and grids: pixel_values(_videos), image / video_grid_thw;
    None: a text-only prompt), EOS ignored: the new tokens. mm_token_type_ids as
    Glm4vProcessor makes them: 2 at <|image|> inside <|begin_of_video|> ... <|end_of_video|>,
    1 at the others."""
    cfg = model.config
    x = torch.tensor([ids])
    kw: dict = {}
    inside = (torch.cumsum(x == cfg.video_start_token_id, 1) > torch.cumsum(x == cfg.video_end_token_id, 1))
    types = torch.zeros_like(x, dtype=torch.int32)
    types[(x == cfg.image_token_id) & ~inside] = 1
    types[(x == cfg.image_token_id) & inside] = 2
    if images:
        kw.update(pixel_values=torch.cat([im.patches for im in images]),
                  image_grid_thw=torch.tensor([list(im.grid) for im in images]))
    if videos:
        kw.update(pixel_values_videos=torch.cat([v.patches for v in videos]),
                  video_grid_thw=torch.tensor([list(v.grid) for v in videos]))
    if images or videos:
        kw["mm_token_type_ids"] = types
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def glm4v_processor(path: Path, monkeypatch):
    """transformers' Glm4vProcessor over the checkpoint's tokenizer and Glm4vImageProcessorPil
    (its video processor needs torchvision, absent here: the processor's class check is
    skipped and a stand-in with the merge size given; its replace_video_token reads that
    alone)."""
    import types

    import transformers

    monkeypatch.setattr(transformers.Glm4vProcessor, "check_argument_for_proper_class", lambda self, n, a: type(a))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return transformers.Glm4vProcessor(image_processor=transformers.Glm4vImageProcessorPil.from_pretrained(path),
                                       tokenizer=tok, video_processor=types.SimpleNamespace(merge_size=2))
