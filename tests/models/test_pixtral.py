"""The Pixtral image side (models/pixtral*.py) against transformers: our preprocessing
against PixtralImageProcessorPil, our [IMG] expansion against PixtralProcessor's ids, the
encoder's rows against Mistral3's / LLaVA's get_image_features (two images of different
sizes in one pass, each the same as alone), and the config and weight errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flashpage.config import ConfigError, ModelConfig
from flashpage.models.loader import ModelLoadError, resolve_model
from flashpage.models.pixtral import expand_image_tokens, image_span, load_image_encoder
from flashpage.models.pixtral_image import preprocess
from tests.llava_checkpoint import smooth_image
from tests.pixtral_checkpoint import (
    batch_pixels,
    build_tiny_pixtral,
    hf_expand,
    hf_model,
    image_processor,
)

SIZES = [(30, 44), (17, 9), (64, 20), (5, 5), (33, 32), (100, 8)]  # (h, w)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("pixtral")
    return {"mistral3": build_tiny_pixtral(root / "m3"), "llava": build_tiny_pixtral(root / "lv", llava=True)}


class _Embed(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding.from_pretrained(weight)


class _Text(torch.nn.Module):
    """The text model as far as the encoder reads it: model.embed_tokens."""

    def __init__(self, weight):
        super().__init__()
        self.model = _Embed(weight)


def _encoder(path, hf):
    src = resolve_model(str(path))
    return load_image_encoder(src, torch.float32, torch.device("cpu"),
                              _Text(hf.get_input_embeddings().weight.detach()))


@pytest.mark.parametrize("kind", ["mistral3", "llava"])
def test_preprocessing_equals_pixtral_image_processor(ckpts, kind):
    vc = ModelConfig.from_hf(ckpts[kind]).vision
    proc = image_processor(ckpts[kind])
    P = vc.prompt_patch
    images = [smooth_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    images += [images[0].convert("L"), images[1].convert("RGBA")]
    for img in images:
        ref = proc(img, patch_size={"height": P, "width": P}, return_tensors="pt")
        ours = preprocess(img, vc.processing, P)
        assert list(ref["image_sizes"][0]) == list(ours.shape[1:]), img.size
        assert ours.shape[1] % P == 0 and ours.shape[2] % P == 0
        torch.testing.assert_close(ours, ref["pixel_values"][0], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="aspect ratio is too extreme"):
        preprocess(smooth_image(100, 3), vc.processing, P)  # its width would be 0 pixels
    # a uint8 tensor goes through torch's resize: the same size, within a level or so
    x = torch.frombuffer(bytearray(images[0].tobytes()), dtype=torch.uint8).view(30, 44, 3).permute(2, 0, 1)
    diff = (preprocess(x, vc.processing, P) - preprocess(images[0], vc.processing, P)).abs()
    assert diff.max() < 3 / 255 / 0.26 and diff.mean() < 0.5 / 255 / 0.26


@pytest.mark.parametrize("kind", ["mistral3", "llava"])
def test_expansion_equals_pixtral_processor(ckpts, kind):
    from transformers import AutoTokenizer

    vc = ModelConfig.from_hf(ckpts[kind]).vision
    images = [smooth_image(30, 44, seed=1), smooth_image(17, 9, seed=2)]
    text = "hello [IMG] the world [IMG] again"
    pixels = [preprocess(im, vc.processing, vc.prompt_patch) for im in images]
    ref = hf_expand(ckpts[kind], text, [tuple(p.shape[1:]) for p in pixels])
    ids = AutoTokenizer.from_pretrained(ckpts[kind])(text)["input_ids"]
    grids = [(p.shape[1] // vc.prompt_patch, p.shape[2] // vc.prompt_patch) for p in pixels]
    ours, starts = expand_image_tokens(ids, vc, grids)
    assert ours == ref
    for s, (h, w) in zip(starts, grids, strict=True):
        assert ours[s:s + h * (w + 1)] == image_span(vc, h, w)
    assert expand_image_tokens(ours, vc, grids) == (ours, starts)  # expanded already: kept
    with pytest.raises(ValueError, match=r"2 image token\(s\).*1 image\(s\)"):
        expand_image_tokens(ids, vc, grids[:1])
    with pytest.raises(ValueError, match="image 1's span there is not its"):
        expand_image_tokens(ours, vc, [grids[0], (grids[1][0], grids[1][1] + 1)])
    with pytest.raises(ValueError, match="more image spans than the 1"):
        expand_image_tokens(ours, vc, grids[:1])


@pytest.mark.parametrize("kind,layer", [("mistral3", -1), ("mistral3", 1), ("llava", [0, -1])])
def test_rows_equal_transformers_image_features(ckpts, tmp_path, kind, layer):
    """Two images of different sizes and aspects in one pass: each image's [IMG] rows are
    transformers' features, its [IMG_BREAK] / [IMG_END] rows the text embedding's; one image
    alone gives the same rows (attention never crosses images)."""
    path = tmp_path / "ck"
    if isinstance(layer, list):  # linear_1 takes both layers' width: a checkpoint of its own
        build_tiny_pixtral(path, llava=True, vision_feature_layer=layer)
    else:
        shutil.copytree(ckpts[kind], path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["vision_feature_layer"] = layer
        (path / "config.json").write_text(json.dumps(cfg))
    hf = hf_model(path)
    enc = _encoder(path, hf)
    vc = enc.config
    px = [enc.pixel_values(smooth_image(h, w, seed=i)) for i, (h, w) in enumerate(SIZES[:3])]
    pv, sizes = batch_pixels(px)
    with torch.no_grad():
        ref = hf.get_image_features(pixel_values=pv, image_sizes=sizes).pooler_output
        table = hf.get_input_embeddings().weight
    ours = enc.encode(px)
    for r, o, x in zip(ref, ours, px, strict=True):
        h, w = enc.grid(x)
        o = o.view(h, w + 1, -1)
        torch.testing.assert_close(o[:, :w].reshape(h * w, -1), r, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(o[:-1, w], table[vc.break_token_id].expand(h - 1, -1))
        torch.testing.assert_close(o[-1, w], table[vc.end_token_id])
    torch.testing.assert_close(enc.encode(px[1:2])[0], ours[1], rtol=1e-5, atol=1e-5)


def test_config_errors(ckpts, tmp_path):
    def bad(kind, edit, needle, file="config.json"):
        path = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(ckpts[kind], path)
        d = json.loads((path / file).read_text())
        edit(d)
        (path / file).write_text(json.dumps(d))
        with pytest.raises(ConfigError, match=needle):
            ModelConfig.from_hf(path)

    bad("mistral3", lambda d: d.update(vision_feature_layer=[-1, -2]), "a list is not supported")
    bad("mistral3", lambda d: d["vision_config"].update(model_type="siglip_vision_model"),
        "'siglip_vision_model' is not supported")
    bad("mistral3", lambda d: d["vision_config"].update(num_attention_heads=3),
        "head size divisible by 4")
    bad("mistral3", lambda d: d.update(vision_feature_layer=7), r"each must be an int in \[-3, 2\]")
    bad("llava", lambda d: d.update(vision_feature_select_strategy="default"), "only \"full\" is read")
    bad("mistral3", lambda d: d.update(image_processor_type="CLIPImageProcessor"),
        "'CLIPImageProcessor' is not read", "preprocessor_config.json")
    bad("mistral3", lambda d: d.update(size={"shortest_edge": 8}), "size must be",
        "preprocessor_config.json")
    path = tmp_path / "notok"  # no [IMG_BREAK] named, and [IMG] not tekken's
    shutil.copytree(ckpts["mistral3"], path)
    (path / "tokenizer.json").unlink()
    (path / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match=r"name no \[IMG_BREAK\]"):
        ModelConfig.from_hf(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["image_token_index"] = 10  # Mistral's tekken ids: 12 and 13 assumed
    (path / "config.json").write_text(json.dumps(cfg))
    vc = ModelConfig.from_hf(path).vision
    assert (vc.image_token_id, vc.break_token_id, vc.end_token_id) == (10, 12, 13)


def test_weights_under_transformers_5_names_and_missing_ones(ckpts, tmp_path):
    """The tensors under model.vision_tower / model.multi_modal_projector (transformers 5's
    module names) load the same; a missing one is named."""
    from safetensors.torch import load_file, save_file

    src = ckpts["mistral3"]
    hf = hf_model(src)
    want = _encoder(src, hf).state_dict()
    for name, drop in (("renamed", None), ("missing", "vision_tower.ln_pre.weight")):
        path = tmp_path / name
        shutil.copytree(src, path)
        (f,) = path.glob("*.safetensors")
        t = load_file(f)
        t = {("model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else k): v
             for k, v in t.items() if k != drop}
        save_file(t, f, metadata={"format": "pt"})
        if drop is None:
            got = _encoder(path, hf).state_dict()
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        else:
            with pytest.raises(ModelLoadError, match="1 vision tower / projector weight.*ln_pre"):
                _encoder(path, hf)


def test_activation_bytes_bound_a_batch(ckpts):
    """The engine's reserve for an encode call (LLMEngine._encoder_bytes): at least each
    patch's stream and MLP rows, growing with the rows, never under one image at longest_edge."""
    from flashpage.models.pixtral import PixtralImageEncoder

    vc = ModelConfig.from_hf(ckpts["mistral3"]).vision
    enc = PixtralImageEncoder(vc, 64)
    assert enc.activation_bytes(4096) >= 4096 * vc.merge ** 2 * (vc.hidden_size + vc.intermediate_size) * 4
    assert enc.activation_bytes(1) == enc.activation_bytes(0) > 0
    assert enc.activation_bytes(10**5) > enc.activation_bytes(1)
