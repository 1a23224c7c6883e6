"""InternVL's image side (models/internvl.py, models/internvl_config.py): our tiles against
transformers' GotOcr2ImageProcessor (PIL) with crop_to_patches (InternVLProcessor's), our
tile counts against its get_number_of_image_patches, our prompt expansion against
InternVLProcessor's ids, our rows against InternVLModel.get_image_features (fp32, CPU) for
the tower's variants (LayerNorm / RMSNorm with q / k norms, a final LayerNorm, an earlier
feature layer, no absolute positions, another downsample ratio), the checkpoint's tensors,
and the config's fields, the published counts and its errors; OpenGVLab's remote-code
layout (InternVLChatModel) of the same weights read to the same config and rows."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from flashpage.config import ConfigError, ModelConfig
from flashpage.models.internvl import (
    InternVLImage,
    expand_internvl_images,
    load_image_encoder,
    num_image_rows,
    num_tiles,
    tile_grid,
    tile_image,
)
from flashpage.models.loader import ModelLoadError, resolve_model
from tests.conftest import edited_copy
from tests.internvl_checkpoint import (
    MAX_TILES,
    ROWS,
    build_tiny_internvl,
    hf_image_processor,
    hf_pixels,
    hf_processor,
)
from tests.llava_checkpoint import smooth_image

# one uint8 level after normalization: 1 / 255 / the smallest ImageNet std
LEVEL = 1 / 255 / 0.224 + 1e-6
# (height, width): one tile, 2 x 1 + thumbnail, tall, square ties (2 x 2), 6 x 1, 3 x 2, tiny
SIZES = [(16, 16), (20, 40), (45, 18), (33, 33), (10, 90), (40, 61), (3, 4), (300, 200), (17, 16)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(name: str, **kw) -> Path:
        if name not in cache:
            cache[name] = build_tiny_internvl(tmp_path_factory.mktemp(name), **kw)
        return cache[name]

    return get


def _hf_model(path: Path):
    return transformers.InternVLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _encoder(path: Path):
    return load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


class _Dev:
    """hf_pixels' model stand-in: the host, fp32."""

    device = torch.device("cpu")
    dtype = torch.float32


def test_tiles_equal_the_image_processor(tiny):
    """Each size's tiles (the grid's row by row, then the thumbnail) as GotOcr2's with
    crop_to_patches: within two uint8 levels after a resize (PIL's filter vs torch's port of
    it), on most pixels exactly; the tile counts its get_number_of_image_patches' for many
    sizes, and the grid search its get_optimal_tiled_canvas' under other bounds."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    vc = ModelConfig.from_hf(tiny("default")).vision
    proc = hf_image_processor()
    kw = {"crop_to_patches": True}
    for h, w in SIZES:
        img = smooth_image(h, w, seed=h + w)
        ours = tile_image(img, vc)
        want = proc(img, return_tensors="pt", **kw)["pixel_values"]
        px = hf_pixels(_Dev(), [ours])["pixel_values"]
        assert px.shape == want.shape, (h, w)
        assert ours.rows == want.shape[0] * ROWS == num_image_rows(vc, (h, w))
        diff = (px - want).abs()
        assert diff.max() <= 2 * LEVEL and (diff < 1e-5).float().mean() > 0.85, (h, w, diff.max())
    for h in (1, 7, 16, 31, 45, 100, 449):
        for w in (1, 9, 16, 33, 47, 120, 896):
            assert num_tiles(vc, (h, w)) == proc.get_number_of_image_patches(h, w, kw), (h, w)
            for lo, hi in ((1, 12), (2, 6), (1, 1), (3, 40)):
                assert tile_grid((h, w), 448, lo, hi) == get_optimal_tiled_canvas((h, w), (448, 448), lo, hi)
    assert {num_tiles(vc, s) for s in SIZES} >= {1, 3, 4, 5, 7}


def test_prompt_expansion_equals_the_processor(tiny):
    """InternVLProcessor's ids for a text with two <IMG_CONTEXT> (images of 5 and 3 tiles)
    are ours: <img>, each image's rows, </img>; those ids given again are kept; a count of
    placeholders that differs is refused by name."""
    path = tiny("default")
    vc = ModelConfig.from_hf(path).vision
    processor = hf_processor(path)
    images = [smooth_image(33, 33, seed=1), smooth_image(20, 40, seed=2)]
    text = "the cat <IMG_CONTEXT>\nand <IMG_CONTEXT> a dog"
    want = processor(images=images, text=[text])["input_ids"][0]
    ids = processor.tokenizer(text)["input_ids"]
    assert ids.count(vc.image_token_id) == 2
    rows = [tile_image(im, vc).rows for im in images]
    assert rows == [5 * ROWS, 3 * ROWS]
    out, starts = expand_internvl_images(ids, vc, rows)
    assert out == want
    assert [out[s - 1] for s in starts] == [vc.start_token_id] * 2
    assert [out[s + n] for s, n in zip(starts, rows, strict=True)] == [vc.end_token_id] * 2
    assert expand_internvl_images(out, vc, rows) == (out, starts)
    with pytest.raises(ValueError, match=r"2 image token\(s\) \(<IMG_CONTEXT>, id 242\) but 1 image"):
        expand_internvl_images(ids, vc, rows[:1])
    with pytest.raises(ValueError, match="put one <IMG_CONTEXT> per image: it is expanded here"):
        expand_internvl_images(out, vc, [ROWS, ROWS])


VARIANTS = {
    "default": {},
    # InternViT-6B's shape (InternVL3-78B): RMSNorms, q / k norms, no qkv bias
    "rms_qk": dict(vision=dict(norm_type="rms_norm", use_qk_norm=True, attention_bias=False)),
    # the tower's final LayerNorm read (use_mean_pooling false), an earlier layer (it is not)
    "final_norm": dict(vision=dict(use_mean_pooling=False)),
    "layer_2": dict(vision=dict(use_mean_pooling=False), vision_feature_layer=-2),
    "no_positions": dict(vision=dict(use_absolute_position_embeddings=False, hidden_act="gelu_pytorch_tanh")),
    "shuffle_4": dict(downsample_ratio=0.25, projector_hidden_act="relu"),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_image_rows_equal_transformers(tiny, name):
    """Our rows equal get_image_features' (every tile, flattened in order) for images of 1,
    3, 5 and 7 tiles in one encode call, float pixel values given beside uint8 ones too."""
    path = tiny(name, **VARIANTS[name])
    hf = _hf_model(path)
    enc = _encoder(path)
    vc = enc.config
    items = [tile_image(smooth_image(h, w, seed=i), vc) for i, (h, w) in enumerate([(16, 16), (20, 40), (33, 33),
                                                                                      (10, 90)])]
    assert [it.pixels.shape[0] for it in items] == [1, 3, 5, 7]
    ours = enc.encode(items)
    mixed = enc.encode([InternVLImage(hf_pixels(_Dev(), [items[1]])["pixel_values"], items[1].size, 0), items[2]])
    for o, it in zip(ours, items, strict=True):
        with torch.no_grad():
            want = hf.model.get_image_features(**hf_pixels(hf, [it])).pooler_output
        assert o.shape == (it.rows, 64) == (want.shape[0] * want.shape[1], 64)
        torch.testing.assert_close(o, want.reshape(-1, 64), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mixed[0], ours[1], rtol=1e-5, atol=1e-6)
    if name == "shuffle_4":
        assert vc.tokens_per_image == 4 and ours[0].shape[0] == 4
    if name == "layer_2":
        assert (vc.feature_layer, vc.final_norm, len(enc.vision_tower.encoder.layer)) == (2, False, 2)


def test_checkpoint_tensors(tiny, tmp_path):
    """The layers past the feature layer and a final LayerNorm not read are skipped, the text
    model's loader skips the image tensors, transformers 5's module names (``model.`` before
    the modules: what it saves is the layout without) load the same, and a missing tensor is
    refused by name."""
    src = tiny("layer_2", **VARIANTS["layer_2"])
    enc = _encoder(src)
    names = {n for n, _ in enc.named_parameters()}
    assert not any(n.startswith(("vision_tower.encoder.layer.2.", "vision_tower.layernorm.")) for n in names)
    assert "vision_tower.encoder.layer.1.lambda_2" in names and "multi_modal_projector.layer_norm.weight" in names
    item = tile_image(smooth_image(30, 21), enc.config)
    want = enc.encode([item])[0]

    def v5(t):
        for k in [k for k in t if not k.startswith("lm_head.")]:
            t["model." + k.replace("language_model.model.", "language_model.")] = t.pop(k)

    path = edited_copy(src, tmp_path / "v5", edit=v5)
    assert torch.equal(_encoder(path).encode([item])[0], want)
    from flashpage.models.loader import load_model

    load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    path = edited_copy(src, tmp_path / "missing",
                       edit=lambda t: t.pop("vision_tower.encoder.layer.0.lambda_1"))
    with pytest.raises(ModelLoadError, match=r"1 vision tower / projector weight\(s\) missing.*layer\.0\.lambda_1"):
        _encoder(path)


# InternVL3-2B-hf's config.json (the published -hf file's fields)
INTERNVL3_2B = {
    "architectures": ["InternVLForConditionalGeneration"], "downsample_ratio": 0.5, "image_seq_length": 256,
    "image_token_id": 151667, "model_type": "internvl", "projector_hidden_act": "gelu",
    "text_config": {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
                    "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 8960,
                    "max_position_embeddings": 32768, "max_window_layers": 70, "model_type": "qwen2",
                    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
                    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": None,
                    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151674},
    "vision_config": {"attention_bias": True, "hidden_act": "gelu", "hidden_size": 1024, "image_size": [448, 448],
                      "intermediate_size": 4096, "layer_norm_eps": 1e-06, "layer_scale_init_value": 0.1,
                      "model_type": "internvl_vision", "norm_type": "layer_norm", "num_attention_heads": 16,
                      "num_channels": 3, "num_hidden_layers": 24, "patch_size": [14, 14],
                      "use_absolute_position_embeddings": True, "use_mask_token": False, "use_mean_pooling": True,
                      "use_qk_norm": False},
    "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
}


def test_config_fields_and_the_published_counts(tiny):
    mc = ModelConfig.from_hf(tiny("default"))
    vc = mc.vision
    assert (mc.multimodal_architecture, mc.architecture) == ("InternVLForConditionalGeneration", "Qwen2ForCausalLM")
    assert (vc.image_token_id, vc.start_token_id, vc.end_token_id) == (242, 240, 241)
    assert (vc.min_tiles, vc.max_tiles, vc.tokens_per_image, vc.feature_layer) == (1, MAX_TILES, ROWS, 3)
    assert vc.processing.mean == (0.485, 0.456, 0.406) and vc.processing.resample == "bicubic"
    qwen3 = ModelConfig.from_hf(tiny("qwen3", text="qwen3"))
    assert qwen3.architecture == "Qwen3ForCausalLM" and qwen3.vision.tokens_per_image == ROWS
    big = ModelConfig.from_hf(INTERNVL3_2B)
    bv = big.vision
    assert big.architecture == "Qwen2ForCausalLM" and big.hidden_size == 1536 and big.vocab_size == 151674
    # no tokenizer files beside it: <img> / </img> are the published ids before <IMG_CONTEXT>
    assert (bv.tokens_per_image, bv.image_size, bv.start_token_id, bv.end_token_id) == (256, 448, 151665, 151666)
    assert (bv.min_tiles, bv.max_tiles, bv.final_norm, bv.qk_norm) == (1, 12, False, False)
    from flashpage.inspect import inspect_config

    proc = hf_image_processor(size={"height": 448, "width": 448}, max_patches=12)
    for h, w in [(448, 448), (480, 640), (1080, 1920), (4000, 300), (100, 3000)]:
        assert num_tiles(bv, (h, w)) == proc.get_number_of_image_patches(h, w, {"crop_to_patches": True})
    info = inspect_config(big, 80 << 30, image_size=(1024, 768))["vision"]
    # InternViT-300M (24 layers, 0.30B) and the projector (4096 -> 1536 -> 1536: 8.7M)
    assert 0.30e9 < info["params"] < 0.32e9
    assert info["image_tokens"] == num_image_rows(bv, (768, 1024)) == 256 * (12 + 1)  # 4 x 3 tiles + thumbnail


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(vision_feature_select_strategy="full"), "'full' in InternVL.*\"default\" is read"),
    (lambda d: d.update(vision_feature_layer=[-1, -2]), r"vision_feature_layer \[-1, -2\] must be an int"),
    (lambda d: d.update(downsample_ratio=0.3), "downsample_ratio 0.3 must be 1 / k"),
    (lambda d: d.update(downsample_ratio=1 / 3), "dividing the tower's 8 x 8 patch grid"),
    (lambda d: d.update(image_seq_length=64), "image_seq_length 64.*differs from the 16 rows a tile gives"),
    (lambda d: d["vision_config"].update(model_type="siglip_vision_model"), "'siglip_vision_model'.*InternViT"),
    (lambda d: d["vision_config"].update(norm_type="batch_norm"), "norm_type 'batch_norm'"),
    (lambda d: d["vision_config"].update(image_size=[16, 32]), r"image_size \[16, 32\]: only square tiles"),
    (lambda d: d["text_config"].update(model_type="gemma"), "'gemma' is not supported.*qwen2, qwen3, llama"),
])
def test_config_errors(tiny, edit, needle):
    d = json.loads((tiny("default") / "config.json").read_text())
    edit(d)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf(d)


def test_preprocessor_config_errors(tiny, tmp_path):
    src = tiny("default")
    for i, (edit, needle) in enumerate([
        (lambda pc: pc.update(size={"height": 32, "width": 32}), "the vision tower takes 16 x 16 tiles"),
        (lambda pc: pc.update(image_processor_type="Phi4MultimodalImageProcessorFast"),
         "'Phi4MultimodalImageProcessorFast' is not read in InternVL"),
        (lambda pc: pc.update(min_patches=4, max_patches=2), "min_patches 4 is above max_patches 2"),
    ]):
        path = edited_copy(src, tmp_path / str(i))
        pc = json.loads((path / "preprocessor_config.json").read_text())
        edit(pc)
        (path / "preprocessor_config.json").write_text(json.dumps(pc))
        with pytest.raises(ConfigError, match=needle):
            ModelConfig.from_hf(str(path))


# InternVL3-2B's config.json in OpenGVLab's remote-code layout (InternVLChatModel)
INTERNVL3_2B_REMOTE = {
    "architectures": ["InternVLChatModel"], "downsample_ratio": 0.5, "dynamic_image_size": True,
    "force_image_size": 448, "llm_config": {**INTERNVL3_2B["text_config"]}, "max_dynamic_patch": 12,
    "min_dynamic_patch": 1, "model_type": "internvl_chat", "ps_version": "v2", "select_layer": -1,
    "template": "internvl2_5", "use_thumbnail": True,
    "vision_config": {"architectures": ["InternVisionModel"], "attention_dropout": 0.0, "drop_path_rate": 0.0,
                      "hidden_act": "gelu", "hidden_size": 1024, "image_size": 448, "intermediate_size": 4096,
                      "layer_norm_eps": 1e-06, "model_type": "intern_vit_6b", "norm_type": "layer_norm",
                      "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14,
                      "qk_normalization": False, "qkv_bias": True, "use_flash_attn": True},
}


@pytest.mark.parametrize("name", ["default", "rms_qk"])
def test_remote_layout_reads_as_transformers(tiny, tmp_path, name):
    """OpenGVLab's remote-code layout of the same weights (InternVLChatModel: llm_config,
    InternVisionConfig's names, vision_model. / mlp1. with fused qkv; transformers' converter
    backwards) gives the same config fields and exactly the same rows; its CLIP-style
    preprocessor_config.json is not read (its chat code's transform is)."""
    from tests.internvl_checkpoint import to_remote_layout

    src = tiny(name, **VARIANTS[name])
    dst = to_remote_layout(src, tmp_path / "remote")
    hf_vc, vc = ModelConfig.from_hf(src).vision, ModelConfig.from_hf(dst).vision
    assert vc.remote and not hf_vc.remote
    # the video fields differ as the two layouts' processors do: "<video>" is text in the
    # remote one, frames joined without a newline (vLLM's), normalized as images
    assert (vc.video_token_id, vc.frame_sep, vc.video_processing) == (None, "", None)
    assert hf_vc.video_token_id is not None and hf_vc.frame_sep == "\n" and hf_vc.video_processing is not None
    assert replace(vc, remote=False, video_token_id=hf_vc.video_token_id, frame_sep="\n",
                   video_processing=hf_vc.video_processing) == hf_vc
    mc = ModelConfig.from_hf(dst)
    assert (mc.multimodal_architecture, mc.architecture) == ("InternVLChatModel", "Qwen2ForCausalLM")
    items = [tile_image(smooth_image(h, w, seed=i), vc) for i, (h, w) in enumerate([(33, 33), (10, 90)])]
    for a, b in zip(_encoder(src).encode(items), _encoder(dst).encode(items), strict=True):
        assert torch.equal(a, b)
    from flashpage.models.loader import load_model

    load_model(resolve_model(str(dst)), torch.float32, torch.device("cpu"))  # the text model's tensors
    path = edited_copy(dst, tmp_path / "missing", edit=lambda t: t.pop("mlp1.1.bias"))
    with pytest.raises(ModelLoadError, match=r"missing.*multi_modal_projector\.linear_1\.bias"):
        _encoder(path)


def test_remote_layout_over_an_internlm2_text_model():
    """InternVL2.5-8B / InternVL2-8B's llm_config: InternLM2 (internlm2_5-7b-chat's sizes,
    ``bias`` false, a "dynamic" rope read as the plain one) is its text model; InternVL3-9B's
    InternLM3 too (``qkv_bias``)."""
    llm = {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": False, "hidden_act": "silu",
           "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
           "rope_scaling": {"type": "dynamic", "factor": 2.0}, "vocab_size": 92553, "tie_word_embeddings": False}
    mc = ModelConfig.from_hf({**INTERNVL3_2B_REMOTE, "llm_config": llm})
    assert (mc.multimodal_architecture, mc.architecture, mc.model_type) == (
        "InternVLChatModel", "InternLM2ForCausalLM", "internlm2")
    assert (mc.num_key_value_heads, mc.head_dim, mc.attention_bias, mc.rope_scaling, mc.rope_theta) == (
        8, 128, False, None, 1e6)
    assert mc.vision is not None and mc.vision.remote
    three = {**llm, "architectures": ["InternLM3ForCausalLM"], "model_type": "internlm3", "qkv_bias": True,
             "head_dim": 128, "rope_scaling": {"rope_type": "dynamic", "factor": 6.0}}
    mc = ModelConfig.from_hf({**INTERNVL3_2B_REMOTE, "llm_config": three})
    assert (mc.architecture, mc.attention_bias, mc.o_proj_bias) == ("InternLM3ForCausalLM", True, False)


def test_remote_layout_config_fields_and_errors():
    mc = ModelConfig.from_hf(INTERNVL3_2B_REMOTE)
    vc = mc.vision
    assert (mc.architecture, mc.hidden_size) == ("Qwen2ForCausalLM", 1536)
    assert (vc.remote, vc.thumbnail, vc.min_tiles, vc.max_tiles, vc.tokens_per_image) == (True, True, 1, 12, 256)
    assert (vc.image_token_id, vc.start_token_id, vc.end_token_id) == (151667, 151665, 151666)
    assert vc == replace(ModelConfig.from_hf(INTERNVL3_2B).vision, remote=True, frame_sep="")
    one = ModelConfig.from_hf({**INTERNVL3_2B_REMOTE, "dynamic_image_size": False}).vision
    assert (one.min_tiles, one.max_tiles) == (1, 1) and num_tiles(one, (1080, 1920)) == 1
    bare = ModelConfig.from_hf({**INTERNVL3_2B_REMOTE, "use_thumbnail": False}).vision
    assert num_tiles(bare, (768, 1024)) == 12 and num_tiles(bare, (448, 448)) == 1
    for edit, needle in [
        ({"ps_version": "v1"}, "ps_version 'v1': only pixel shuffle \"v2\""),
        ({"force_image_size": 224}, "force_image_size 224 differs from vision_config.image_size 448"),
        ({"llm_config": {"model_type": "phi3"}}, "llm_config.model_type 'phi3' is not supported"),
        ({"llm_config": None}, "InternVLChatModel needs a llm_config object"),
        ({"min_dynamic_patch": 13}, "min_dynamic_patch 13 is above max_dynamic_patch 12"),
        ({"select_layer": -30}, "vision_feature_layer -30 must be an int"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            ModelConfig.from_hf({**INTERNVL3_2B_REMOTE, **edit})
    bad = {**INTERNVL3_2B_REMOTE, "vision_config": {**INTERNVL3_2B_REMOTE["vision_config"], "model_type": "clip"}}
    with pytest.raises(ConfigError, match="'clip' is not supported in InternVLChatModel"):
        ModelConfig.from_hf(bad)


def test_video_processor_config(tiny, tmp_path):
    """InternVLVideoProcessor's settings as transformers finds them: video_preprocessor_config.json
    (the tiny checkpoint's: ImageNet's mean and std, the tower's square), processor_config.json's
    "video_processor" over it, none at all (the frames take the image steps); the tokenizer's
    <video> id; a size other than the tower's, do_resize false, center crop and another
    processor class are ConfigErrors."""
    import shutil

    src = tiny("default")
    vc = ModelConfig.from_hf(src).vision
    assert vc.video_processing is not None and vc.video_processing.mean == (0.485, 0.456, 0.406)
    assert (vc.video_processing.resize_hw, vc.video_processing.resample) == ((16, 16), "bicubic")
    assert vc.video_token_id == 243 and vc.token_texts == ("<img>", "</img>", "<IMG_CONTEXT>", "<video>")
    assert vc.frame_sep == "\n"
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    pc = json.loads((path / "processor_config.json").read_text())
    (path / "processor_config.json").write_text(json.dumps(
        {**pc, "video_processor": {"size": {"height": 16, "width": 16}, "image_mean": [0.5] * 3}}))
    nested = ModelConfig.from_hf(path).vision.video_processing
    assert nested.mean == (0.5, 0.5, 0.5) and nested.std == (0.26862954, 0.26130258, 0.27577711)
    (path / "processor_config.json").write_text(json.dumps(pc))
    (path / "video_preprocessor_config.json").unlink()
    none = ModelConfig.from_hf(path).vision
    assert none.video_processing is None and none.frame_processing == none.processing
    for edit, needle in [({"size": {"height": 384, "width": 384}}, "the vision tower takes 16 x 16 frames"),
                         ({"size": None}, "size {'height': 384, 'width': 384}"),
                         ({"do_resize": False}, "do_resize false"),
                         ({"do_center_crop": True}, "do_center_crop is not read"),
                         ({"video_processor_type": "Qwen2VLVideoProcessor"}, "'Qwen2VLVideoProcessor' is not read")]:
        from tests.internvl_checkpoint import VIDEO_PROCESSOR

        (path / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_PROCESSOR, **edit}))
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("{", r"\{")):
            ModelConfig.from_hf(path)
