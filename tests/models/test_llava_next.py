"""LLaVA-NeXT's image side (models/llava_next.py, config.VisionConfig.grid_pinpoints): our
any-res tiling against transformers' LlavaNextImageProcessor (PIL), our row counts against
LlavaNextProcessor's and the model's, our rows against transformers'
LlavaNextModel.get_image_features (fp32, CPU), both checkpoint layouts, the config's fields
and errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers.image_processing_utils import get_patch_output_size, select_best_resolution

from flashpage.config import ConfigError, ModelConfig
from flashpage.models.llava import expand_image_tokens, load_image_encoder
from flashpage.models.llava_next import anyres_pixels, fit_size, num_image_rows
from flashpage.models.llava_next import select_best_resolution as ours_best
from flashpage.models.loader import ModelLoadError, resolve_model
from tests.conftest import edited_copy
from tests.llava_checkpoint import smooth_image
from tests.llava_next_checkpoint import PINPOINTS, TILE, build_tiny_llava_next, hf_processor

# one uint8 level after normalization: 1 / 255 / the smallest CLIP std
LEVEL = 1 / 255 / 0.26130258 + 1e-6
# (height, width) of several aspect ratios: square, wide, tall, extreme, one tile's, tiny, large
SIZES = [(16, 16), (20, 33), (33, 20), (100, 37), (17, 60), (64, 64), (5, 90), (300, 200), (3, 4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(name: str, **overrides) -> Path:
        if name not in cache:
            cache[name] = build_tiny_llava_next(tmp_path_factory.mktemp(name), tokenizer=name == "tok",
                                                **overrides)
        return cache[name]

    return get


def _hf_model(path: Path):
    return transformers.LlavaNextForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _encoder(path: Path):
    return load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def test_best_resolution_and_fit_equal_transformers():
    """select_best_resolution and get_patch_output_size on many sizes, llava-v1.6's own
    pinpoints (ties among them included: a square image fits 672 x 672 and the others)."""
    rng = random.Random(0)
    big = [(336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008)]
    sizes = [(rng.randint(1, 1500), rng.randint(1, 1500)) for _ in range(300)] + \
        [(336, 336), (672, 672), (100, 100), (1, 1000), (1000, 1)]
    for pins in (big, [tuple(p) for p in PINPOINTS]):
        for size in sizes:
            best = ours_best(size, tuple(pins))
            assert best == tuple(select_best_resolution(size, [list(p) for p in pins])), size
            img = np.broadcast_to(np.zeros((), np.uint8), (3, *size))  # its shape alone is read
            assert fit_size(size, best) == tuple(get_patch_output_size(img, best, "channels_first")), size


def test_tiling_equals_llava_next_image_processor(tiny):
    """Our tiles (the whole image first) against LlavaNextImageProcessor's pixel values:
    the same tile count and image size; within one uint8 level after a resize (PIL's filter
    vs torch's port of it), on most pixels exactly."""
    vc = ModelConfig.from_hf(tiny("default")).vision
    proc = hf_processor()
    for h, w in SIZES:
        img = smooth_image(h, w, seed=h + w)
        ours = anyres_pixels(img, vc)
        ref = proc(img, return_tensors="pt")
        assert tuple(ref["image_sizes"][0].tolist()) == ours.size == (h, w)
        want = ref["pixel_values"][0]
        assert ours.pixels.shape == want.shape, (h, w)
        diff = (ours.pixels - want).abs()
        assert diff.max() <= LEVEL, (h, w, diff.max())
        assert (diff < 1e-5).float().mean() > 0.85, (h, w)
    gray = smooth_image(40, 25, seed=1).convert("L")  # made RGB as do_convert_rgb makes it
    diff = anyres_pixels(gray, vc).pixels - proc(gray, return_tensors="pt")["pixel_values"][0]
    assert diff.abs().max() <= LEVEL


def test_row_counts_equal_the_processor_and_the_model(tiny):
    """num_image_rows equals LlavaNextProcessor's placeholder count and the length of the
    model's packed rows for every size (unpadding's rounding included)."""
    path = tiny("tok")
    vc = ModelConfig.from_hf(path).vision
    processor = transformers.LlavaNextProcessor(
        image_processor=hf_processor(), tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        patch_size=vc.patch_size, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    sizes = SIZES + [(h, w) for h in (7, 15, 31, 47) for w in (9, 16, 33, 50)]
    for h, w in sizes:
        want = processor._get_num_multimodal_tokens(image_sizes=[[h, w]])["num_image_tokens"][0]
        assert num_image_rows(vc, (h, w)) == want, (h, w)
    hf = _hf_model(path)
    items = [anyres_pixels(smooth_image(h, w), vc) for h, w in SIZES]
    most = max(it.pixels.shape[0] for it in items)
    px = torch.zeros(len(items), most, 3, TILE, TILE)
    for i, it in enumerate(items):
        px[i, :it.pixels.shape[0]] = it.pixels
    with torch.no_grad():
        rows = hf.model.get_image_features(pixel_values=px, image_sizes=torch.tensor(SIZES)).pooler_output
    assert [r.shape[0] for r in rows] == [num_image_rows(vc, s) for s in SIZES] == [it.rows for it in items]


@pytest.mark.parametrize("name, overrides", [("default", {}), ("layers", {"vision_feature_layer": [-3, -1]})])
def test_image_rows_equal_transformers(tiny, name, overrides):
    """Our rows equal get_image_features' for a batch of two images of other sizes and
    aspect ratios (tiles padded to one count, as the processor pads a batch), and alone."""
    path = tiny(name, **overrides)
    hf = _hf_model(path)
    enc = _encoder(path)
    vc = enc.config
    items = [anyres_pixels(smooth_image(h, w, seed=i), vc) for i, (h, w) in enumerate([(20, 33), (100, 37)])]
    most = max(it.pixels.shape[0] for it in items)
    px = torch.zeros(2, most, 3, TILE, TILE)
    for i, it in enumerate(items):
        px[i, :it.pixels.shape[0]] = it.pixels
    with torch.no_grad():
        ref = hf.model.get_image_features(pixel_values=px, image_sizes=torch.tensor([list(it.size) for it in items]))
    ours = enc.encode(items)
    for o, r, it in zip(ours, ref.pooler_output, items, strict=True):
        assert o.shape == r.shape == (it.rows, 64)
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(enc.encode(items[1:])[0], ref.pooler_output[1], rtol=1e-4, atol=1e-5)


def test_both_layouts_load_and_image_newline_is_required(tiny, tmp_path):
    """transformers 4's names (vision_tower.vision_model.*, image_newline) and transformers
    5's module names (model.vision_tower.*, model.image_newline) give the same rows; a
    checkpoint without image_newline is refused by name."""
    src = tiny("default")
    item = anyres_pixels(smooth_image(30, 21), ModelConfig.from_hf(src).vision)
    want = _encoder(src).encode([item])[0]

    def v4(t):
        for k in [k for k in t if k.startswith("vision_tower.")]:
            t["vision_tower.vision_model." + k[len("vision_tower."):]] = t.pop(k)

    def v5(t):
        for k in [k for k in t if k.startswith(("vision_tower.", "multi_modal_projector.", "image_newline"))]:
            t["model." + k] = t.pop(k)

    for name, edit in (("v4", v4), ("v5", v5)):
        path = edited_copy(src, tmp_path / name, edit=edit)
        assert torch.equal(_encoder(path).encode([item])[0], want), name
        # the text model's loader skips image_newline in either layout
        from flashpage.models.loader import load_model

        load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    path = edited_copy(src, tmp_path / "missing", edit=lambda t: t.pop("image_newline"))
    with pytest.raises(ModelLoadError, match=r"1 vision tower / projector weight\(s\) missing.*image_newline"):
        _encoder(path)


def test_config_fields(tiny):
    mc = ModelConfig.from_hf(tiny("default"))
    vc = mc.vision
    assert mc.multimodal_architecture == "LlavaNextForConditionalGeneration"
    assert mc.architecture == "LlamaForCausalLM"
    assert vc.grid_pinpoints == tuple(tuple(p) for p in PINPOINTS) and vc.tokens_per_image == 16
    assert not vc.processing.pad_to_square  # LlavaNextImageProcessor's do_pad pads a batch's tiles
    from flashpage.inspect import format_report, inspect_config

    assert "LlavaNextForConditionalGeneration: its text model and image input" in \
        format_report(inspect_config(mc, 1 << 30))
    # llava-v1.6-mistral-7b-hf's config.json (no preprocessor beside it: CLIP's defaults)
    d = {"architectures": ["LlavaNextForConditionalGeneration"], "image_token_index": 32000,
         "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
         "model_type": "llava_next", "projector_hidden_act": "gelu",
         "text_config": {"architectures": ["MistralForCausalLM"], "intermediate_size": 14336,
                         "max_position_embeddings": 32768, "model_type": "mistral",
                         "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
                         "sliding_window": None, "vocab_size": 32064},
         "use_image_newline_parameter": True,
         "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                           "model_type": "clip_vision_model", "num_attention_heads": 16,
                           "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768},
         "vision_feature_layer": -2, "vision_feature_select_strategy": "default"}
    big = ModelConfig.from_hf(d)
    assert big.architecture == "MistralForCausalLM" and big.vocab_size == 32064
    assert big.vision.grid_pinpoints[2] == (672, 672)
    # a 672 x 672 image: the 2 x 2 grid, 576 + 48 x 49 rows (transformers' processor says so too)
    assert num_image_rows(big.vision, (672, 672)) == 576 + 48 * 49
    assert num_image_rows(big.vision, (500, 800)) > 576


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(vision_feature_select_strategy="full"), "'full' in LlavaNextForConditionalGeneration"),
    (lambda d: d.update(image_grid_pinpoints=[[16, 30]]), r"\[\[16, 30\]\] are not multiples"),
    (lambda d: d.update(image_grid_pinpoints=[]), "non-empty list"),
    (lambda d: d.update(image_grid_pinpoints=[[16]]), "non-empty list"),
    (lambda d: d["vision_config"].update(model_type="siglip_vision_model"), "siglip_vision_model"),
    (lambda d: d.update(architectures=["LlavaOnevisionForConditionalGeneration"]),
     "'llama' is not supported in LlavaOnevisionForConditionalGeneration"),
    (lambda d: d.update(architectures=["LlavaNextVideoForConditionalGeneration"]), "LLaVA-NeXT-Video"),
    (lambda d: d["text_config"].update(model_type="qwen2"), "'qwen2' is not supported"),
])
def test_config_errors(tiny, edit, needle):
    d = json.loads((tiny("default") / "config.json").read_text())
    edit(d)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf(d)


def test_preprocessor_pinpoints_must_agree(tiny, tmp_path):
    path = edited_copy(tiny("default"), tmp_path / "other_pins")
    pc = json.loads((path / "preprocessor_config.json").read_text())
    pc["image_grid_pinpoints"] = [[32, 32]]
    (path / "preprocessor_config.json").write_text(json.dumps(pc))
    with pytest.raises(ConfigError, match="differ from config.json's"):
        ModelConfig.from_hf(path)


def test_expand_image_tokens_per_image_counts():
    assert expand_image_tokens([1, 9, 5, 9], 9, 2, [2, 3]) == ([1, 9, 9, 5, 9, 9, 9], [1, 4])
    assert expand_image_tokens([1, 9, 9, 5, 9, 9, 9], 9, 2, [2, 3]) == ([1, 9, 9, 5, 9, 9, 9], [1, 4])
    with pytest.raises(ValueError, match=r"1 image token\(s\).*2 image\(s\)"):
        expand_image_tokens([1, 9, 5], 9, 2, [2, 3])
