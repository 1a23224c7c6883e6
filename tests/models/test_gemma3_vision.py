"""Gemma 3's image side (models/gemma3_vision.py, gemma3_config.py, attention/bidirectional.py):
our preprocessing against transformers' Gemma3ImageProcessor, the SigLIP tower + projector
rows against Gemma3ForConditionalGeneration.get_image_features (fp32, CPU), the prompt
expansion against Gemma3Processor's text expansion through the tokenizer, the image mask
against transformers' masks, the scheduler's cut, and the config's fields and errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from flashpage.attention.bidirectional import image_mask
from flashpage.config import ConfigError, ModelConfig, with_mm_processor_kwargs
from flashpage.engine.multimodal import MultiModalInput
from flashpage.engine.scheduler import chunk_tokens
from flashpage.models.clip_image import preprocess
from flashpage.models.gemma3_config import GEMMA3_NEWLINES
from flashpage.models.gemma3_vision import expand_gemma3_images, load_image_encoder
from flashpage.models.loader import ModelLoadError, resolve_model
from tests.conftest import edited_copy
from tests.gemma3_checkpoint import IMAGE_SIZE, TOKENS, build_tiny_gemma3
from tests.llava_checkpoint import smooth_image

LEVEL = 1 / 255 / 0.5 + 1e-6  # one uint8 level after Gemma 3's normalization


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


def _hf_pixels(path: Path, images) -> torch.Tensor:
    proc = transformers.Gemma3ImageProcessorPil.from_pretrained(path)
    return torch.as_tensor(np.asarray(proc(images, return_tensors="np")["pixel_values"]))


def test_preprocessing_equals_gemma3_image_processor(tiny):
    """Exactly for an image of the tower's size; within one uint8 level after a resize."""
    vc = ModelConfig.from_hf(tiny).vision
    assert vc.processing.resize_hw == (IMAGE_SIZE, IMAGE_SIZE) and vc.processing.resample == "bilinear"
    img = smooth_image(IMAGE_SIZE, IMAGE_SIZE, seed=1)
    assert (preprocess(img, vc.processing) - _hf_pixels(tiny, [img])[0]).abs().max() < 1e-6
    for h, w in [(60, 80), (100, 37), (17, 23), (300, 200)]:
        img = smooth_image(h, w, seed=h * w)
        ours, ref = preprocess(img, vc.processing), _hf_pixels(tiny, [img])[0]
        assert ours.shape == ref.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
        assert (ours - ref).abs().max() <= LEVEL, (h, w)
    gray = smooth_image(40, 50, seed=3).convert("L")
    assert (preprocess(gray, vc.processing) - _hf_pixels(tiny, [gray])[0]).abs().max() <= LEVEL


def test_tower_and_projector_rows_equal_transformers(tiny):
    """Our encoder's rows equal get_image_features' (SigLIP's last hidden state pooled,
    normed, projected) for one image and a batch of two; fp32 tolerance."""
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tiny, dtype=torch.float32, attn_implementation="eager").eval()
    enc = load_image_encoder(resolve_model(str(tiny)), torch.float32, torch.device("cpu"))
    pixels = _hf_pixels(tiny, [smooth_image(40 + i, 70, seed=i) for i in range(2)])
    with torch.no_grad():
        ref = hf.get_image_features(pixel_values=pixels).pooler_output
    ours = torch.stack(enc.encode(list(pixels)))
    assert ours.shape == ref.shape == (2, TOKENS, 64)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(enc.encode([pixels[1]])[0], ref[1], rtol=1e-4, atol=1e-5)
    assert ref.abs().mean() > 0.1  # rows far from zero: the comparison means something
    enc.MAX_TOWER_IMAGES = 1  # the tower in slices of one image: the same rows
    torch.testing.assert_close(torch.stack(enc.encode(list(pixels))), ref, rtol=1e-4, atol=1e-5)


def test_activation_estimate_of_the_published_tower():
    """gemma-3-4b-it's tower in bf16: an encode batch of 8192 rows (32 images) runs in
    slices of 8 images, so the reserve stays near 2 GB, not 32 images' worth."""
    from flashpage.models.gemma3_vision import Gemma3ImageEncoder

    vc = ModelConfig.from_hf(_published_4b()).vision
    with torch.device("meta"):
        enc = Gemma3ImageEncoder(vc, 2560).to(torch.bfloat16)
    one, many = enc.activation_bytes(256), enc.activation_bytes(8192)
    assert one < many < 3 << 30
    assert many < 16 * one  # not 32 images in one tower call: a slice of 8 (and 32 rows, pixels)


def test_published_layout_loads_the_same(tiny, tmp_path):
    """The published files' names (vision_tower.vision_model.*) and transformers 5's under
    model. load to the same encoder; a missing or stray tensor is named."""
    pixels = _hf_pixels(tiny, [smooth_image(30, 30)])
    want = load_image_encoder(resolve_model(str(tiny)), torch.float32, torch.device("cpu")).encode(list(pixels))[0]

    def published(t):
        for k in [k for k in t if k.startswith("vision_tower.")]:
            t["vision_tower.vision_model." + k[len("vision_tower."):]] = t.pop(k)

    def v5(t):
        for k in [k for k in t if k.startswith(("vision_tower.", "multi_modal_projector."))]:
            t["model." + k] = t.pop(k)

    for name, edit in (("published", published), ("v5", v5)):
        path = edited_copy(tiny, tmp_path / name, edit=edit)
        enc = load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))
        assert torch.equal(enc.encode(list(pixels))[0], want), name
    path = edited_copy(tiny, tmp_path / "missing",
                       edit=lambda t: t.pop("multi_modal_projector.mm_input_projection_weight"))
    with pytest.raises(ModelLoadError, match=r"1 vision tower / projector weight\(s\) missing.*mm_input"):
        load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))
    path = edited_copy(tiny, tmp_path / "stray",
                       edit=lambda t: t.update({"vision_tower.encoder.extra.weight": torch.zeros(2)}))
    with pytest.raises(ModelLoadError, match="vision_tower.encoder.extra.weight"):
        load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("text", [
    "<start_of_turn>user\n<start_of_image>what is it?<end_of_turn>\n<start_of_turn>model\n",
    "one <start_of_image> two <start_of_image>\nthree",
    "a\n\n<start_of_image>\n\nb<start_of_image><start_of_image>",
    "<start_of_image>",
])
def test_expansion_equals_the_processors_text_expansion(tiny, text):
    """Our ids-level expansion (newlines merged) equals the tokenizer's ids of the text as
    Gemma3Processor expands it: "\\n\\n<start_of_image>" + T soft tokens + "<end_of_image>\\n\\n"."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    vc = ModelConfig.from_hf(tiny).vision
    assert vc.newline_ids == tuple(tok.convert_tokens_to_ids(["\n" * k for k in range(1, 5)]))
    full = "\n\n<start_of_image>" + "<image_soft_token>" * TOKENS + "<end_of_image>\n\n"
    ids = tok.encode(text)
    n = text.count("<start_of_image>")
    got, starts = expand_gemma3_images(ids, vc, n)
    assert got == tok.encode(text.replace("<start_of_image>", full))
    assert [got[s - 1] for s in starts] == [vc.boi_token_id] * n
    assert all(got[s:s + TOKENS] == [vc.image_token_id] * TOKENS for s in starts)


def test_expansion_errors(tiny):
    vc = ModelConfig.from_hf(tiny).vision
    with pytest.raises(ValueError, match=r"1 <start_of_image> token\(s\).*2 image\(s\)"):
        expand_gemma3_images([1, vc.boi_token_id, 5], vc, 2)
    with pytest.raises(ValueError, match="holds <image_soft_token>.*position 2"):
        expand_gemma3_images([1, vc.boi_token_id, vc.image_token_id], vc, 1)


def _published_4b() -> dict:
    """gemma-3-4b-it's config.json: SigLIP-So400m at 896, 256 rows pooled 4 x 4."""
    return {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
            "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
            "mm_tokens_per_image": 256, "model_type": "gemma3",
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                            "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                              "model_type": "siglip_vision_model", "num_attention_heads": 16,
                              "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}


def _hf_mask(ids: list[int], soft: int, window: int | None) -> torch.Tensor:
    """transformers' mask for one sequence, built from its own overlays (masking_utils):
    OR(causal, same image block), AND the sliding window."""
    from transformers.masking_utils import blockwise_overlay, sliding_window_overlay
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    blocks = get_block_sequence_ids_for_mask((torch.tensor([ids]) == soft).long())
    block, slide = blockwise_overlay(blocks), sliding_window_overlay(window) if window else None
    n = len(ids)
    m = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            ok = bool(k <= q) or bool(block(0, 0, q, k))
            m[q, k] = ok and (slide is None or bool(slide(0, 0, q, k)))
    return m


@pytest.mark.parametrize("window", [None, 3, 8])
def test_image_mask_equals_transformers(window):
    soft = 9
    ids = [1, 2, soft, soft, soft, soft, soft, 3, 4, soft, soft, soft, 5]
    ref = _hf_mask(ids, soft, window)
    for lo, hi in ((2, 7), (9, 12)):
        for q0 in range(lo, hi):  # the image's rows from q0 on (a chunk starting inside it)
            k_lo = 0 if window is None else max(0, q0 - window + 1)
            got = image_mask(q0, hi - q0, k_lo, hi, lo, hi, window, torch.device("cpu"))
            assert torch.equal(got, ref[q0:hi, k_lo:hi]), (lo, q0)
            assert not ref[q0:hi, :k_lo].any() and not ref[q0:hi, hi:].any()


def test_scheduler_never_cuts_an_image():
    class R:
        mm_inputs = [MultiModalInput(4, 16, b"", None, bidirectional=True),
                     MultiModalInput(30, 16, b"", None, bidirectional=True),
                     MultiModalInput(60, 5, b"", None)]  # not bidirectional: cut anywhere

    r = R()
    assert chunk_tokens(r, 0, 10) == 4  # ends before the image
    assert chunk_tokens(r, 0, 20) == 20  # holds the whole image (ends at its end)
    assert chunk_tokens(r, 0, 35) == 30
    assert chunk_tokens(r, 4, 10) == 0  # starts at an image it cannot hold: waits
    assert chunk_tokens(r, 10, 5) == 0  # starts inside one (a prefix hit): waits for its rest
    assert chunk_tokens(r, 10, 10) == 10
    assert chunk_tokens(r, 50, 12) == 12


def test_config_fields_and_inspect(tiny):
    from flashpage.inspect import format_report, inspect_config

    mc = ModelConfig.from_hf(tiny)
    vc = mc.vision
    assert mc.multimodal_architecture == "Gemma3ForConditionalGeneration"
    assert mc.architecture == "Gemma3ForCausalLM" and mc.hidden_size == 64
    assert vc.tokens_per_image == TOKENS and vc.pool == 2 and vc.patches_per_side == 8
    info = inspect_config(mc, 1 << 30)
    assert info["image_input"] is True
    assert "Gemma3ForConditionalGeneration: its text model and image input" in format_report(info)
    big = ModelConfig.from_hf(_published_4b()).vision
    assert big.patches_per_side == 64 and big.pool == 4 and big.newline_ids == GEMMA3_NEWLINES
    assert big.processing.mean == (0.5, 0.5, 0.5) and big.processing.resize_hw == (896, 896)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["vision_config"].update(model_type="clip_vision_model"), "'clip_vision_model'"),
    (lambda d: d.update(mm_tokens_per_image=15), "mm_tokens_per_image 15"),
    (lambda d: d.update(mm_tokens_per_image=9), "mm_tokens_per_image 9"),  # 3 does not divide 8
    (lambda d: d.update(boi_token_index=d["image_token_index"]), "must differ"),
    (lambda d: d["vision_config"].update(hidden_act="swish"), "hidden_act 'swish'"),
])
def test_config_errors(tiny, edit, needle):
    d = json.loads((tiny / "config.json").read_text())
    edit(d)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_hf(d)


def test_preprocessor_config_errors_and_pan_and_scan_settings(tiny, tmp_path):
    """preprocessor_config.json's pan-and-scan keys read (null: Gemma3Processor's defaults),
    bad ones refused by name; mm_processor_kwargs' over them, an unknown key named."""
    from flashpage.models.gemma3_config import PanAndScan

    assert ModelConfig.from_hf(tiny).vision.pan_and_scan == PanAndScan(False, 256, 4, 1.2)
    cases = [({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 2}, PanAndScan(True, 256, 2, 1.2)),
             ({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": None}, PanAndScan(True, 256, 4, 1.2)),
             ({"pan_and_scan_min_ratio_to_activate": 2}, PanAndScan(False, 256, 4, 2.0)),
             ({"do_pan_and_scan": "yes"}, "do_pan_and_scan must be true or false"),
             ({"pan_and_scan_min_crop_size": 0}, "pan_and_scan_min_crop_size must be a positive int"),
             ({"pan_and_scan_max_num_crops": 2.5}, "pan_and_scan_max_num_crops must be a positive int"),
             ({"pan_and_scan_min_ratio_to_activate": -1}, "pan_and_scan_min_ratio_to_activate must be"),
             ({"size": {"height": 28, "width": 28}}, "takes 56 x 56"),
             ({"image_processor_type": "SiglipImageProcessor"}, "Siglip")]
    for i, (change, want) in enumerate(cases):
        path = edited_copy(tiny, tmp_path / f"p{i}")
        pc = json.loads((path / "preprocessor_config.json").read_text())
        pc.update(change)
        (path / "preprocessor_config.json").write_text(json.dumps(pc))
        if isinstance(want, str):
            with pytest.raises(ConfigError, match=want) as e:
                ModelConfig.from_hf(path)
            assert "preprocessor_config.json" in str(e.value)
        else:
            assert ModelConfig.from_hf(path).vision.pan_and_scan == want
    mc = ModelConfig.from_hf(tiny)
    assert with_mm_processor_kwargs(mc, {"do_pan_and_scan": False}) is mc
    on = with_mm_processor_kwargs(mc, {"do_pan_and_scan": True, "pan_and_scan_min_ratio_to_activate": 1.5})
    assert on.vision.pan_and_scan == PanAndScan(True, 256, 4, 1.5)
    with pytest.raises(ConfigError, match="mm_processor_kwargs pan_and_scan_min_ratio_to_activate"):
        with_mm_processor_kwargs(mc, {"pan_and_scan_min_ratio_to_activate": True})
    with pytest.raises(ConfigError, match=r"\['max_pixels'\].*reads do_pan_and_scan, pan_and_scan_min_crop_size"):
        with_mm_processor_kwargs(mc, {"max_pixels": 10})
