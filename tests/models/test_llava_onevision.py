"""LLaVA-OneVision's image side (models/llava_onevision.py on llava_next.py and the SigLIP
tower, models/siglip_vision.py): our tiles against transformers'
LlavaOnevisionImageProcessor (PIL) for an image alone and for images of a prompt of
several, our row counts against LlavaOnevisionProcessor's and the model's (the
anyres_max pooling included), our rows against LlavaOnevisionModel.get_image_features
(fp32, CPU), the checkpoint's tensors and the config's fields and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from flashpage.config import ConfigError, ModelConfig
from flashpage.models.llava import load_image_encoder
from flashpage.models.llava_next import (
    anyres_pixels,
    num_image_rows,
    pooled_grid,
    select_best_resolution,
    unpadded_grid,
)
from flashpage.models.llava_onevision import single_tile_pixels
from flashpage.models.loader import ModelLoadError, resolve_model
from tests.conftest import edited_copy
from tests.llava_checkpoint import smooth_image
from tests.llava_onevision_checkpoint import (
    ASPECT,
    TILE,
    build_tiny_llava_onevision,
    hf_inputs,
    hf_processor,
)

# one uint8 level after normalization: 1 / 255 / the smallest CLIP std
LEVEL = 1 / 255 / 0.26130258 + 1e-6
# (height, width): pooled (3 x 3 and 2 x 3 tiles' grids) and not (1 x 2, 2 x 2, one tile, 3 x 1)
SIZES = [(45, 40), (30, 45), (20, 33), (30, 30), (16, 16), (9, 70), (70, 12), (300, 200), (3, 4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(name: str, **overrides) -> Path:
        if name not in cache:
            cache[name] = build_tiny_llava_onevision(tmp_path_factory.mktemp(name), tokenizer=False, **overrides)
        return cache[name]

    return get


def _hf_model(path: Path):
    return transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _encoder(path: Path):
    return load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def _processor(image_processor, num_image_tokens: int, aspect: str):
    """LlavaOnevisionProcessor's counting alone (its __init__ wants torchvision's video
    processor, which the CPU image need not have): the methods read these fields."""
    p = transformers.LlavaOnevisionProcessor.__new__(transformers.LlavaOnevisionProcessor)
    p.image_processor = image_processor
    p.num_image_tokens = num_image_tokens
    p.vision_feature_select_strategy = "full"
    p.vision_aspect_ratio = aspect
    p.image_token = "<image>"
    p.video_token = "<video>"
    return p


def test_tiles_equal_the_image_processor(tiny):
    """An image alone: tiles as LLaVA-NeXT's (the whole image first); images of a prompt of
    several: one tile each, padded to a square of the mean color. Within two uint8 levels
    after a resize (PIL's filter vs torch's port of it: one pixel of 3 x 3 tiles' off by
    two here), on most pixels exactly."""
    vc = ModelConfig.from_hf(tiny("default")).vision
    proc = hf_processor()
    for h, w in SIZES:
        img = smooth_image(h, w, seed=h + w)
        ours = anyres_pixels(img, vc)
        ref = proc(img, return_tensors="pt")
        want = ref["pixel_values"][0]
        assert tuple(ref["image_sizes"][0].tolist()) == ours.size == (h, w)
        assert ours.pixels.shape == want.shape, (h, w)
        diff = (ours.pixels - want).abs()
        assert diff.max() <= 2 * LEVEL and (diff < 1e-5).float().mean() > 0.85, (h, w, diff.max())
    imgs = [smooth_image(h, w, seed=i) for i, (h, w) in enumerate([(20, 33), (45, 18), (30, 30)])]
    ref = proc([imgs], return_tensors="pt")
    assert ref["pixel_values"].shape == (3, 1, 3, TILE, TILE) and ref["batch_num_images"].tolist() == [3]
    for img, want in zip(imgs, ref["pixel_values"], strict=True):
        ours = single_tile_pixels(img, vc)
        assert ours.pixels.shape == want.shape and ours.rows == 16 + 1
        diff = (ours.pixels - want).abs()
        assert diff.max() <= 2 * LEVEL and (diff < 1e-5).float().mean() > 0.85


def test_row_counts_equal_the_processor_and_the_model(tiny):
    """num_image_rows equals LlavaOnevisionProcessor's count for every size, pooled or not
    (both occur), and the length of the model's packed rows; an image among several of a
    prompt is 16 + 1 rows to both."""
    path = tiny("default")
    vc = ModelConfig.from_hf(path).vision
    processor = _processor(hf_processor(), 16, ASPECT)
    sizes = SIZES + [(h, w) for h in (7, 15, 31, 47, 48) for w in (9, 16, 33, 47, 50)]
    pooled = 0
    for h, w in sizes:
        assert num_image_rows(vc, (h, w)) == processor._get_number_of_features(h, w, TILE, TILE), (h, w)
        bh, bw = select_best_resolution((h, w), vc.grid_pinpoints)
        _, r, _, c = unpadded_grid((h, w), (bh // 4, bw // 4))
        pooled += pooled_grid(vc, r, c) != (r, c)
    assert 0 < pooled < len(sizes)
    several = {"batch_num_images": [2], "image_sizes": [[20, 33], [45, 18]]}
    assert processor.replace_image_token(several, 1).count("<image>") == 17
    hf = _hf_model(path)
    for images in ([anyres_pixels(smooth_image(h, w), vc)] for h, w in SIZES):
        with torch.no_grad():
            rows = hf.model.get_image_features(**hf_inputs(hf, images)).pooler_output
        assert [r.shape[0] for r in rows] == [it.rows for it in images]


@pytest.mark.parametrize("name, overrides", [("default", {}), ("layers", {"vision_feature_layer": [-3, -1]}),
                                             ("shallow", {"vision_feature_layer": -3})])
def test_image_rows_equal_transformers(tiny, name, overrides):
    """Our rows equal get_image_features' for an image alone (pooled, and not) and for two
    images of one prompt (one tile each, image_newline after), in one encode call."""
    path = tiny(name, **overrides)
    hf = _hf_model(path)
    enc = _encoder(path)
    vc = enc.config
    alone = [[anyres_pixels(smooth_image(h, w, seed=i), vc)] for i, (h, w) in enumerate([(45, 40), (20, 33)])]
    pair = [single_tile_pixels(smooth_image(h, w, seed=7 + i), vc) for i, (h, w) in enumerate([(30, 12), (16, 40)])]
    ours = enc.encode([*alone[0], *alone[1], *pair])
    want = []
    for images in (*alone, pair):
        with torch.no_grad():
            want += list(hf.model.get_image_features(**hf_inputs(hf, images)).pooler_output)
    assert [o.shape[0] for o in ours] == [w.shape[0] for w in want] == [it.rows for it in (*alone[0], *alone[1], *pair)]
    assert alone[0][0].rows < 16 + 12 * 13  # the 3 x 3 tiles' 12 x 12 grid pooled
    for o, w in zip(ours, want, strict=True):
        torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5)


def test_checkpoint_tensors(tiny, tmp_path):
    """The SigLIP pooling head and post_layernorm (never read) are skipped, the text
    model's loader skips the image tensors, the transformers 5 module layout loads the
    same, and a checkpoint without image_newline is refused by name."""
    src = tiny("default")
    enc = _encoder(src)
    names = {n for n, _ in enc.named_parameters()}
    assert not any(n.startswith(("vision_tower.head.", "vision_tower.post_layernorm.")) for n in names)
    assert "image_newline" in names and "vision_tower.encoder.layers.2.mlp.fc2.weight" in names
    item = anyres_pixels(smooth_image(30, 21), enc.config)
    want = enc.encode([item])[0]

    def v5(t):
        for k in [k for k in t if k.startswith(("vision_tower.", "multi_modal_projector.", "image_newline"))]:
            t["model." + k] = t.pop(k)

    path = edited_copy(src, tmp_path / "v5", edit=v5)
    assert torch.equal(_encoder(path).encode([item])[0], want)
    from flashpage.models.loader import load_model

    load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    path = edited_copy(src, tmp_path / "missing", edit=lambda t: t.pop("image_newline"))
    with pytest.raises(ModelLoadError, match=r"1 vision tower / projector weight\(s\) missing.*image_newline"):
        _encoder(path)


def test_config_fields_and_the_published_counts(tiny):
    mc = ModelConfig.from_hf(tiny("default"))
    vc = mc.vision
    assert mc.multimodal_architecture == "LlavaOnevisionForConditionalGeneration"
    assert mc.architecture == "Qwen2ForCausalLM"
    assert (vc.tower, vc.anyres_max, vc.select_strategy, vc.feature_layers) == ("siglip", 4, "full", (3,))
    assert vc.tokens_per_image == 16 and not vc.processing.pad_to_square
    assert (vc.image_token_id, vc.video_token_id) == (255, 254)
    # llava-onevision-qwen2-0.5b-ov-hf's sizes (no preprocessor config beside it:
    # LlavaOnevisionImageProcessor's defaults, 384 x 384)
    d = {"architectures": ["LlavaOnevisionForConditionalGeneration"], "image_token_index": 151646,
         "model_type": "llava_onevision", "projector_hidden_act": "gelu",
         "text_config": {"hidden_size": 896, "intermediate_size": 4864, "model_type": "qwen2",
                         "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
                         "rope_theta": 1000000.0, "tie_word_embeddings": True, "vocab_size": 152000,
                         "max_position_embeddings": 32768},
         "video_token_index": 151647, "vision_aspect_ratio": "anyres_max_9",
         "vision_config": {"hidden_size": 1152, "image_size": 384, "intermediate_size": 4304,
                           "model_type": "siglip_vision_model", "num_attention_heads": 16,
                           "num_hidden_layers": 26, "patch_size": 14, "vision_use_head": False},
         "vision_feature_layer": -1, "vision_feature_select_strategy": "full"}
    big = ModelConfig.from_hf(d)
    assert big.architecture == "Qwen2ForCausalLM" and big.hidden_size == 896 and big.vocab_size == 152000
    bv = big.vision
    assert bv.tokens_per_image == 729 and len(bv.grid_pinpoints) == 36 and bv.anyres_max == 9
    proc = _processor(transformers.LlavaOnevisionImageProcessorPil(), 729, "anyres_max_9")
    for h, w in [(384, 384), (480, 640), (1080, 1920), (2304, 2304), (4000, 300), (100, 3000)]:
        assert num_image_rows(bv, (h, w)) == proc._get_number_of_features(h, w, 384, 384), (h, w)
    assert num_image_rows(bv, (2304, 2304)) == 729 + 81 * 82  # 162 x 162 pooled by 2
    from flashpage.inspect import inspect_config

    info = inspect_config(big, 80 << 30, image_size=(1024, 768))["vision"]
    # SigLIP so400m's 26 layers (no post_layernorm, no head: never read) and the projector
    assert 0.39e9 < info["params"] < 0.41e9
    assert info["image_tokens"] == num_image_rows(bv, (768, 1024)) == proc._get_number_of_features(768, 1024, 384, 384)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(vision_feature_select_strategy="default"), "'default' in LlavaOnevision.*\"full\" is read"),
    (lambda d: d.update(vision_aspect_ratio="anyres"), "vision_aspect_ratio 'anyres' is not read"),
    (lambda d: d.update(vision_aspect_ratio="anyres_max_0"), "anyres_max_N"),
    (lambda d: d["vision_config"].update(model_type="clip_vision_model"), "'clip_vision_model'.*a SigLIP tower"),
    (lambda d: d["text_config"].update(model_type="llama"), "'llama' is not supported.*qwen2"),
    (lambda d: d.update(image_grid_pinpoints=[[16, 30]]), r"\[\[16, 30\]\] are not multiples"),
    (lambda d: d.update(video_token_index=255), "video_token_index must be a token id other than the image"),
])
def test_config_errors(tiny, edit, needle):
    d = json.loads((tiny("default") / "config.json").read_text())
    edit(d)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf(d)


def test_video_rows_equal_transformers(tiny):
    """A video's frames: each resized to the tower's square and normalized as
    LlavaOnevisionVideoProcessor's steps say (size, bicubic, CLIP's mean and std: the image
    processor's whole-image tile, which the CPU image can run without torchvision, within
    two uint8 levels); its rows equal get_video_features' (pooled 2 x 2, one newline) and
    their count LlavaOnevisionProcessor's."""
    import numpy as np

    from flashpage.models.clip_image import normalize
    from flashpage.models.llava_onevision import video_frames

    path = tiny("default")
    hf = _hf_model(path)
    enc = _encoder(path)
    vc = enc.config
    proc = hf_processor()
    frames = [smooth_image(30, 45, seed=k) for k in range(3)]
    video = video_frames(np.stack([np.asarray(f) for f in frames]), vc)
    px = normalize(video.frames, vc.processing)
    for f, ours in zip(frames, px, strict=True):
        assert (ours - proc(f, return_tensors="pt")["pixel_values"][0][0]).abs().max() <= 2 * LEVEL
    counting = _processor(proc, 16, ASPECT)
    assert counting.replace_video_token({"pixel_values_videos": [px]}, 0).count("<video>") == video.rows == 13
    with torch.no_grad():
        want = hf.model.get_video_features(pixel_values_videos=px[None]).pooler_output[0]
    ours = enc.encode([video])[0]
    assert ours.shape == want.shape == (13, 64)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-5)
