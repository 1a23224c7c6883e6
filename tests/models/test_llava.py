"""LLaVA's image side (models/llava.py, clip_vision.py, clip_image.py, config.VisionConfig):
our preprocessing against transformers' CLIPImageProcessor, our tower's feature layers and
the projector's rows against transformers' LlavaForConditionalGeneration.get_image_features
(fp32, CPU), both checkpoint layouts, and the config's fields and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from flashpage.config import ConfigError, ModelConfig
from flashpage.models.clip_image import is_pil_image, preprocess
from flashpage.models.llava import expand_image_tokens, load_image_encoder
from flashpage.models.loader import ModelLoadError, resolve_model
from tests.conftest import edited_copy
from tests.llava_checkpoint import IMAGE_SIZE, build_tiny_llava, smooth_image

# one uint8 level after normalization: 1 / 255 / the smallest CLIP std
LEVEL = 1 / 255 / 0.26130258 + 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(name: str, **overrides) -> Path:
        if name not in cache:
            cache[name] = build_tiny_llava(tmp_path_factory.mktemp(name), tokenizer=False, **overrides)
        return cache[name]

    return get


def _hf_processor(**kw):
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return cls(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
               **kw)


def _hf_pixels(proc, img) -> torch.Tensor:
    return torch.as_tensor(np.asarray(proc(img, return_tensors="np")["pixel_values"][0]))


def _ours(path: Path):
    return ModelConfig.from_hf(path).vision


def test_preprocessing_equals_clip_image_processor(tiny):
    """Exactly where no resampling happens (an image of the output size, or one whose short
    side is already the output's: crop only); within one uint8 level (1/255 before the
    normalization) after a resize of a smooth image, and on most pixels exactly."""
    vc = _ours(tiny("default"))
    proc = _hf_processor()
    for h, w in [(28, 28), (28, 60), (45, 28)]:  # no resampling
        img = smooth_image(h, w, seed=h + w)
        assert torch.equal(preprocess(img, vc.processing), _hf_pixels(proc, img)) or \
            (preprocess(img, vc.processing) - _hf_pixels(proc, img)).abs().max() < 1e-6
    for h, w in [(40, 60), (100, 37), (17, 23), (300, 500), (64, 64), (31, 200)]:
        img = smooth_image(h, w, seed=h * w)
        ours, ref = preprocess(img, vc.processing), _hf_pixels(proc, img)
        assert ours.shape == ref.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
        diff = (ours - ref).abs()
        assert diff.max() <= LEVEL, (h, w, diff.max())
        assert (diff < 1e-5).float().mean() > 0.9, (h, w)


def test_preprocessing_modes_and_gray_images(tiny):
    """A grayscale and an RGBA image become RGB as transformers' do_convert_rgb has them."""
    vc = _ours(tiny("default"))
    proc = _hf_processor()
    base = smooth_image(50, 40, seed=3)
    for img in (base.convert("L"), base.convert("RGBA")):
        diff = (preprocess(img, vc.processing) - _hf_pixels(proc, img)).abs()
        assert diff.max() <= LEVEL
    assert is_pil_image(base) and not is_pil_image(torch.zeros(3)) and not is_pil_image("x")


def test_pad_to_square_equals_llava_image_processor(tiny, tmp_path):
    """LlavaImageProcessor's do_pad (mean-colored borders to a square, then CLIP's steps)."""
    cls = getattr(transformers, "LlavaImageProcessorPil", None)
    if cls is None:
        pytest.skip("transformers has no LlavaImageProcessorPil")
    proc = cls(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
               do_pad=True)
    path = edited_copy(tiny("default"), tmp_path / "padded")
    proc.save_pretrained(path)
    vc = _ours(path)
    assert vc.processing.pad_to_square
    for h, w in [(20, 35), (56, 28), (28, 28)]:
        img = smooth_image(h, w, seed=7)
        diff = (preprocess(img, vc.processing) - _hf_pixels(proc, img)).abs()
        assert diff.max() <= LEVEL, (h, w, diff.max())


@pytest.mark.parametrize("name, overrides", [
    ("default", {}),
    ("full", {"vision_feature_select_strategy": "full"}),
    ("layers", {"vision_feature_layer": [-3, -1]}),
    ("first", {"vision_feature_layer": 0}),
])
def test_image_rows_equal_transformers(tiny, name, overrides):
    """Our encoder's rows equal transformers' get_image_features for the same pixel values:
    one image and a batch of two; feature layer(s) and strategy as configured."""
    path = tiny(name, **overrides)
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    enc = load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    vc = enc.config
    pixels = torch.stack([preprocess(smooth_image(40 + i, 30, seed=i), vc.processing) for i in range(2)])
    with torch.no_grad():
        ref = hf.get_image_features(pixel_values=pixels, vision_feature_layer=hf.config.vision_feature_layer,
                                    vision_feature_select_strategy=hf.config.vision_feature_select_strategy,
                                    output_hidden_states=True)
    ref_rows = ref.pooler_output if hasattr(ref, "pooler_output") else ref
    ref_rows = torch.stack(list(ref_rows))
    ours = torch.stack(enc.encode(list(pixels)))
    assert ours.shape == ref_rows.shape == (2, vc.tokens_per_image, 64)
    torch.testing.assert_close(ours, ref_rows, rtol=1e-4, atol=1e-5)
    one = enc.encode([pixels[1]])[0]
    torch.testing.assert_close(one, ref_rows[1], rtol=1e-4, atol=1e-5)
    want = 17 if name == "full" else 16
    assert vc.tokens_per_image == want
    assert len(enc.vision_tower.encoder.layers) == max(vc.feature_layers)


def test_transformers_4_layout_loads_the_same(tiny, tmp_path):
    """The published llava-hf files' names (vision_tower.vision_model.*, language_model.*)
    and transformers 5's module names (model.vision_tower.*, model.multi_modal_projector.*)
    load to the same encoder."""
    src = tiny("default")
    pixels = preprocess(smooth_image(30, 30), _ours(src).processing)
    want = load_image_encoder(resolve_model(str(src)), torch.float32, torch.device("cpu")).encode([pixels])[0]

    def v4(t):
        for k in [k for k in t if k.startswith("vision_tower.")]:
            t["vision_tower.vision_model." + k[len("vision_tower."):]] = t.pop(k)

    def v5(t):
        for k in [k for k in t if k.startswith(("vision_tower.", "multi_modal_projector."))]:
            t["model." + k] = t.pop(k)

    for name, edit in (("v4", v4), ("v5", v5)):
        path = edited_copy(src, tmp_path / name, edit=edit)
        enc = load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))
        assert torch.equal(enc.encode([pixels])[0], want), name


def test_missing_and_stray_image_tensors_are_named(tiny, tmp_path):
    src = tiny("default")
    path = edited_copy(src, tmp_path / "missing", edit=lambda t: t.pop("multi_modal_projector.linear_2.bias"))
    with pytest.raises(ModelLoadError, match=r"1 vision tower / projector weight\(s\) missing.*linear_2.bias"):
        load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))

    def stray(t):
        t["vision_tower.encoder.extra.weight"] = torch.zeros(2)

    path = edited_copy(src, tmp_path / "stray", edit=stray)
    with pytest.raises(ModelLoadError, match="vision_tower.encoder.extra.weight"):
        load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def test_config_fields(tiny):
    mc = ModelConfig.from_hf(tiny("default"))
    vc = mc.vision
    assert mc.multimodal_architecture == "LlavaForConditionalGeneration"
    assert mc.architecture == "LlamaForCausalLM" and mc.hidden_size == 64
    assert vc.feature_layers == (2,) and vc.select_strategy == "default" and vc.image_token_id == 255
    assert vc.processing.crop_hw == (IMAGE_SIZE, IMAGE_SIZE) and vc.processing.shortest_edge == IMAGE_SIZE
    # llava-1.5-7b-hf's config.json: LlamaConfig's and LlavaConfig's defaults fill it in
    d = {"architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000,
         "model_type": "llava", "projector_hidden_act": "gelu",
         "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                         "model_type": "llama", "rms_norm_eps": 1e-05, "vocab_size": 32064},
         "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                           "model_type": "clip_vision_model", "num_attention_heads": 16,
                           "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768},
         "vision_feature_layer": -2, "vision_feature_select_strategy": "default"}
    big = ModelConfig.from_hf(d)
    assert big.hidden_size == 4096 and big.num_hidden_layers == 32 and big.vocab_size == 32064
    assert big.vision.tokens_per_image == 576 and big.vision.feature_layers == (23,)
    assert big.vision.processing.mean == (0.48145466, 0.4578275, 0.40821073)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["vision_config"].update(model_type="siglip_vision_model"), "siglip_vision_model"),
    (lambda d: d.update(vision_feature_layer=7), "vision_feature_layer 7"),
    (lambda d: d.update(vision_feature_select_strategy="cls"), "'cls'"),
    (lambda d: d.update(projector_hidden_act="swish"), "projector_hidden_act 'swish'"),
    (lambda d: d["vision_config"].update(image_size=30), "not a multiple of patch_size"),
    (lambda d: d["text_config"].update(model_type="gpt2"), "'gpt2' is not supported"),
])
def test_config_errors(tiny, edit, needle):
    d = json.loads((tiny("default") / "config.json").read_text())
    edit(d)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf(d)


def test_preprocessor_config_errors(tiny, tmp_path):
    src = tiny("default")
    for i, (change, needle) in enumerate([({"crop_size": {"height": 20, "width": 20}}, "20, 20"),
                                          ({"resample": 1}, "resample 1"),
                                          ({"image_processor_type": "SiglipImageProcessor"}, "Siglip")]):
        path = edited_copy(src, tmp_path / f"p{i}")
        pc = json.loads((path / "preprocessor_config.json").read_text())
        pc.update(change)
        (path / "preprocessor_config.json").write_text(json.dumps(pc))
        with pytest.raises(ConfigError, match=needle):
            ModelConfig.from_hf(path)


def test_expand_image_tokens():
    assert expand_image_tokens([1, 9, 5, 9], 9, 2, 3) == ([1, 9, 9, 9, 5, 9, 9, 9], [1, 5])
    assert expand_image_tokens([1, 9, 9, 9, 5], 9, 1, 3) == ([1, 9, 9, 9, 5], [1])  # expanded already
    assert expand_image_tokens([9, 9], 9, 2, 3) == ([9] * 6, [0, 3])  # two adjacent placeholders
    with pytest.raises(ValueError, match=r"1 image token\(s\).*2 image\(s\)"):
        expand_image_tokens([1, 9, 5], 9, 2, 3)
    with pytest.raises(ValueError, match=r"0 image token\(s\).*1 image\(s\)"):
        expand_image_tokens([1, 5], 9, 1, 3)
