"""Qwen2-VL / Qwen2.5-VL's image side (models/qwen2_vl.py, qwen2_vl_image.py, engine/mrope.py,
layers/rotary.MRotaryEmbedding, config.QwenVisionConfig): our preprocessing against
transformers' Qwen2VLImageProcessorPil, the tower's rows against get_image_features (images of
three sizes in one pass; Qwen2.5-VL's windows of several sizes), the prompt's 3-D positions
against get_rope_index, M-RoPE's cos / sin against transformers' rotary and the fused kernel's
table form against the torch path, both weight layouts, and the config's fields and errors
(fp32, CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from flashpage.config import ConfigError, ModelConfig
from flashpage.engine.mrope import prompt_positions, step_positions
from flashpage.engine.multimodal import MultiModalInput
from flashpage.kernels.rotary import apply_rotary
from flashpage.layers.rotary import MRotaryEmbedding, apply_rotary_torch
from flashpage.models.loader import ModelLoadError, resolve_model
from flashpage.models.qwen2_vl import load_image_encoder, window_order
from flashpage.models.qwen2_vl_image import preprocess, smart_resize
from tests.conftest import edited_copy
from tests.llava_checkpoint import smooth_image
from tests.qwen2_vl_checkpoint import MAX_PIXELS, build_tiny_qwen2_vl

LEVEL = 1 / 255 / 0.26130258 + 1e-6  # one uint8 level after the normalization
SIZES = [(84, 112), (60, 90), (100, 40)]  # grids 6x8, 4x6, 8x2 (merged: 3x4, 2x3, 4x1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in cache:
            cache[variant] = build_tiny_qwen2_vl(tmp_path_factory.mktemp(variant), variant, tokenizer=False)
        return cache[variant]

    return get


def _encoder(path: Path):
    return load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def test_smart_resize_equals_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize

    for h in (1, 17, 28, 55, 56, 57, 100, 333, 1000, 4000):
        for w in (3, 28, 70, 280, 999, 2048):
            if max(h, w) / min(h, w) > 200:
                with pytest.raises(ValueError, match="aspect ratio"):
                    smart_resize(h, w, 28, 56 * 56, 28 * 28 * 1280)
                continue
            for lo, hi in ((56 * 56, 28 * 28 * 1280), (28 * 28 * 4, MAX_PIXELS)):
                assert smart_resize(h, w, 28, lo, hi) == hf_resize(h, w, 28, lo, hi), (h, w, lo, hi)


def test_preprocessing_equals_qwen2vl_image_processor(tiny):
    """Patches and grids: exactly where no resampling happens (sides already multiples of
    28 within the pixel bounds), within one uint8 level after a resize."""
    vc = ModelConfig.from_hf(tiny("qwen2_vl")).vision
    proc = transformers.Qwen2VLImageProcessorPil.from_pretrained(tiny("qwen2_vl"))
    for (h, w), exact in [((56, 84), True), ((112, 56), True), ((60, 90), False), ((100, 40), False),
                          ((300, 500), False), ((20, 31), False)]:
        img = smooth_image(h, w, seed=h + w)
        patches, grid = preprocess(img, vc.processing, 14, 2, 2)
        ref = proc(img, return_tensors="pt")
        assert list(grid) == ref["image_grid_thw"][0].tolist(), (h, w)
        diff = (patches - ref["pixel_values"]).abs()
        assert diff.max() <= (1e-6 if exact else LEVEL), (h, w, diff.max())
        assert grid[1] * grid[2] * 14 * 14 <= MAX_PIXELS


@pytest.mark.parametrize("variant", ["qwen2_vl", "qwen2_5_vl"])
def test_image_rows_equal_transformers(tiny, variant):
    """Three images of different sizes in one encode call (attention kept within each, and
    within each window for Qwen2.5-VL's windowed blocks) and each alone: transformers' rows."""
    path = tiny(variant)
    enc = _encoder(path)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    images = [enc.pixel_values(smooth_image(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]
    assert [im.grid for im in images] == [(1, 6, 8), (1, 4, 6), (1, 8, 2)]
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.cat([im.patches for im in images]),
                                          torch.tensor([list(im.grid) for im in images])).pooler_output
    ours = enc.encode(images)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(enc.encode(images[1:2])[0], ref[1], rtol=1e-4, atol=1e-5)
    # what a request keeps (admit_image: resized uint8 pixels, normalized and cut into
    # patches in encode) gives the very rows of the host's patches, at an eighth of the bytes
    kept = [enc.admit_image(smooth_image(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]
    assert all(k.patches is None and k.pixels.dtype == torch.uint8 and k.grid == im.grid
               for k, im in zip(kept, images, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(enc.encode(kept), ours, strict=True))
    assert all(torch.equal(enc.pixel_values(k).patches, im.patches) for k, im in zip(kept, images, strict=True))
    # the engine's reserve for an encode call (LLMEngine._encoder_bytes): at least each
    # patch's stream and MLP rows, growing with the rows, never under one image at max_pixels
    vc = enc.config
    big = 8192 * 4 * (3 * vc.hidden_size + vc.intermediate_size) * 4  # fp32 here
    assert enc.activation_bytes(8192) >= big and enc.activation_bytes(1) == enc.activation_bytes(0) > 0
    # the kernels the tower takes on CUDA (the rotary over a per-token table; Qwen2.5-VL's
    # RMSNorm with the residual and SiLU-mul), here under the interpreter: the same rows
    enc.visual.kernels = True
    for a, b in zip(enc.encode(kept), ours, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if variant == "qwen2_5_vl":  # the windows the test exercises: 2 x 2 merged units, cut short
        vc = enc.config
        assert vc.fullatt_block_indexes == (1,) and vc.depth == 3
        _, sizes = window_order((1, 6, 8), 2, vc.window_size // 28)
        assert sizes == [4, 4, 2, 2]


def test_window_order_tiles_from_the_top_left():
    order, sizes = window_order((1, 6, 10), 2, 2)  # merged 3 x 5
    assert sizes == [4, 4, 2, 2, 2, 1]
    assert order[:4].tolist() == [0, 1, 5, 6] and order[-1].item() == 14
    assert sorted(order.tolist()) == list(range(15))


def _inputs(ids: list[int], token: int, grids: list[tuple[int, int, int]]) -> list[MultiModalInput]:
    starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
    return [MultiModalInput(s, math.prod(g), b"", None, grid=g) for s, g in zip(starts, grids, strict=True)]


def test_prompt_positions_equal_get_rope_index(tiny):
    """Text, an image of 3 x 4 merged units, text, an image of 2 x 1, text: transformers'
    3-D positions and delta; every chunking of the prompt gives the same positions."""
    hf = transformers.AutoModelForImageTextToText.from_pretrained(tiny("qwen2_vl"), dtype=torch.float32)
    tok = hf.config.image_token_id
    ids = [1, 5, 6, 250, *[tok] * 12, 252, 7, 8, 250, *[tok] * 2, 252, 9]
    grids = [(1, 3, 4), (1, 2, 1)]
    x = torch.tensor([ids])
    ref, delta = hf.model.get_rope_index(x, (x == tok).int(), torch.tensor([[1, 6, 8], [1, 4, 2]]))
    ours, our_delta = prompt_positions(len(ids), _inputs(ids, tok, grids))
    assert np.array_equal(ours, ref[:, 0].numpy()) and our_delta == int(delta) < 0
    for cut in (1, 4, 5, 7):
        got = []
        for s in range(0, len(ids) + 3, cut):  # past the prompt: index + delta, 1-D
            one, three = step_positions(ours, our_delta, s, min(s + cut, len(ids) + 3))
            got.append(three if three is not None else np.repeat(one[None], 3, axis=0))
            if three is not None:
                assert np.array_equal(one, three[0])
        full = np.concatenate(got, axis=1)
        assert np.array_equal(full[:, :len(ids)], ours)
        assert full[:, len(ids):].tolist() == [[len(ids) + our_delta + i for i in range(3)]] * 3


def test_mrope_rotary_equals_transformers_and_the_fused_table():
    """cos / sin rows of 3-D positions equal Qwen2VLRotaryEmbedding's; rotating by the
    per-token table at 0 .. N - 1 (the fused kernel's input) equals the 3-D torch path;
    1-D positions are the plain rope."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = transformers.Qwen2VLTextConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [8, 12, 12]})
    ours = MRotaryEmbedding(64, 64, 256, 10000.0, (8, 12, 12))
    torch.manual_seed(0)
    pos = torch.randint(0, 200, (3, 9))
    pos[:, :3] = torch.tensor([5, 6, 7])  # three text tokens
    q, k = torch.randn(9, 2, 64), torch.randn(9, 1, 64)
    cos, sin = Qwen2VLRotaryEmbedding(cfg)(q, pos[:, None, :])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = ours(pos, q, k)
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    idx, table = ours.table(pos)
    assert idx.tolist() == list(range(9)) and table.shape == (9, 64)
    assert torch.equal(apply_rotary_torch(idx, q, table, True), q_ours)
    q_1d, _ = ours(pos[0, :3], q[:3], k[:3])
    assert torch.equal(q_1d, q_ours[:3])
    qf, kf = apply_rotary(idx, q.clone(), k.clone(), table)
    torch.testing.assert_close(qf, q_ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kf, k_ours, rtol=1e-5, atol=1e-5)


def _flat(d: dict) -> dict:
    """A transformers 5 config.json as the published files have it: the text model's fields
    at the top level, rope_scaling {"type": "mrope"}, the tower's old names."""
    text = d.pop("text_config")
    rope = text.pop("rope_parameters")
    out = {**d, **text, "model_type": d["model_type"], "rope_theta": rope["rope_theta"],
           "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    vc = out["vision_config"]
    vc["in_chans"] = vc.pop("in_channels")
    return out


def test_published_layout_reads_the_same(tiny, tmp_path):
    """A flat config.json and the module names model.language_model.* / model.visual.*
    (transformers 5's modules) give the same config and rows as transformers' own save."""
    src = tiny("qwen2_5_vl")
    want = ModelConfig.from_hf(src)

    def v5(t):
        for key in list(t):
            if key.startswith("visual."):
                t["model." + key] = t.pop(key)
            elif key.startswith("model."):
                t["model.language_model." + key[len("model."):]] = t.pop(key)

    def flat(d):
        f = _flat(json.loads(json.dumps(d)))
        d.clear()
        d.update(f)

    path = edited_copy(src, tmp_path / "v5", edit=v5, config_edit=flat)
    assert "text_config" not in json.loads((path / "config.json").read_text())
    got = ModelConfig.from_hf(path)
    assert got.mrope_section == want.mrope_section == (2, 3, 3)
    assert got.vision == want.vision and got.hidden_size == want.hidden_size
    assert (got.architecture, got.model_type, got.attention_bias, got.o_proj_bias) == \
        ("Qwen2ForCausalLM", "qwen2", True, False)
    img = _encoder(src).pixel_values(smooth_image(60, 90))
    assert torch.equal(_encoder(path).encode([img])[0], _encoder(src).encode([img])[0])
    from flashpage.models.loader import load_model

    model = load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"), max_positions=64)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_config_errors_name_the_field(tiny, tmp_path):
    src = tiny("qwen2_vl")
    raw = json.loads((src / "config.json").read_text())

    def bad(edit) -> str:
        d = json.loads(json.dumps(raw))
        edit(d)
        with pytest.raises(ConfigError) as e:
            ModelConfig.from_hf(d)
        return str(e.value)

    assert "mrope_section [2, 3, 2] sums to 7" in bad(
        lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[2, 3, 2]))
    assert "rope type 'yarn' is not supported with M-RoPE" in bad(
        lambda d: d["text_config"]["rope_parameters"].update(rope_type="yarn"))
    assert "differs from the text model's hidden_size 64" in bad(lambda d: d["vision_config"].update(hidden_size=32))
    assert "in_channels 1" in bad(lambda d: d["vision_config"].update(in_channels=1))
    path = edited_copy(src, tmp_path / "proc")
    (path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "min_pixels": 100}))
    with pytest.raises(ConfigError, match="patch_size 16 differs from the vision tower's 14"):
        ModelConfig.from_hf(path)


def test_missing_and_stray_tower_tensors_are_named(tiny, tmp_path):
    src = tiny("qwen2_vl")
    path = edited_copy(src, tmp_path / "missing", edit=lambda t: t.pop("visual.merger.mlp.2.bias"))
    with pytest.raises(ModelLoadError, match=r"1 vision tower weight\(s\) missing.*merger.mlp.2.bias"):
        _encoder(path)
    path = edited_copy(src, tmp_path / "stray", edit=lambda t: t.update({"visual.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match="visual.extra.weight"):
        _encoder(path)
