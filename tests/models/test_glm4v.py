"""GLM-4.1V's image side (models/glm4v.py, glm4v_config.py, layers/rotary's M-RoPE on
interleaved pairs): the preprocessing against transformers' Glm4vImageProcessorPil (its size
rule against smart_resize), the tower's rows against get_image_features (images of four sizes
in one pass, the kernels' path under the interpreter), M-RoPE's rotation against
Glm4vTextRotaryEmbedding and the fused kernel's table form, the prompt's 3-D positions (images
and a video's frame groups) against get_rope_index, and the config's fields and errors (fp32,
CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from flashpage.config import ConfigError, ModelConfig
from flashpage.engine.mrope import prompt_positions
from flashpage.engine.multimodal import MultiModalInput
from flashpage.kernels.rotary import apply_rotary
from flashpage.layers.rotary import MRotaryEmbedding, apply_rotary_torch
from flashpage.models.glm4v import load_image_encoder
from flashpage.models.loader import ModelLoadError, resolve_model
from tests.conftest import edited_copy
from tests.glm4v_checkpoint import MAX_PIXELS, shared_glm4v
from tests.llava_checkpoint import smooth_image

LEVEL = 1 / 255 / 0.26130258 + 1e-6  # one uint8 level after the normalization
SIZES = [(84, 130), (60, 90), (100, 40), (20, 10)]  # grids 6x10, 4x6, 8x2, 6x4 (20 x 10 scaled up)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return shared_glm4v(tmp_path_factory)  # (its path, transformers' model)


@pytest.fixture(scope="module")
def tiny(glm) -> Path:
    return glm[0]


def _encoder(path: Path):
    return load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def test_config_reads_the_text_model_and_tower(tiny):
    cfg = ModelConfig.from_hf(tiny)
    assert (cfg.architecture, cfg.multimodal_architecture, cfg.head_dim, cfg.rotary_dim) == \
        ("Glm4ForCausalLM", "Glm4vForConditionalGeneration", 32, 16)
    assert cfg.rope_interleaved and cfg.mrope_section == (2, 3, 3) and not cfg.mrope_interleaved
    assert cfg.attention_bias and not cfg.o_proj_bias and cfg.rms_norm_eps == 1e-5
    vc = cfg.vision
    assert type(vc).__name__ == "Glm4vVisionConfig" and vc.variant == "glm4v"
    assert (vc.num_position_embeddings, vc.rms_norm_eps, vc.attention_bias, vc.out_hidden_size) == (16, 1e-5, False, 64)
    assert (vc.processing.min_pixels, vc.processing.max_pixels) == (2 * 56 * 56, 2 * MAX_PIXELS)
    # the published files' form (transformers 4.5x's): rope_scaling {"type": "default"} and
    # partial_rotary_factor beside it in text_config; and a flat config (no text_config)
    raw = json.loads((tiny / "config.json").read_text())
    tc = raw["text_config"]
    rope = tc.pop("rope_parameters")
    tc.update(rope_scaling={"type": "default", "mrope_section": rope["mrope_section"]},
              partial_rotary_factor=0.5, rope_theta=10000.0, attention_bias=True)
    published = ModelConfig.from_hf(json.loads(json.dumps(raw)))
    assert published == ModelConfig.from_hf(json.loads((tiny / "config.json").read_text()))
    assert ModelConfig.from_hf({**tc, **{k: v for k, v in raw.items() if k != "text_config"}}) == published
    assert (published.rotary_dim, published.mrope_section) == (16, (2, 3, 3))
    # without a preprocessor_config.json: Glm4vImageProcessor's class defaults
    assert (published.vision.processing.min_pixels, published.vision.processing.max_pixels) == \
        (112 * 112, 28 * 28 * 15000)


def test_config_errors_name_the_field(tiny):
    raw = json.loads((tiny / "config.json").read_text())

    def bad(edit) -> str:
        d = json.loads(json.dumps(raw))
        edit(d)
        with pytest.raises(ConfigError) as e:
            ModelConfig.from_hf(d)
        return str(e.value)

    assert "mrope_section [2, 3, 2] sums to 7, not half the rotary width (16 / 2" in bad(
        lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[2, 3, 2]))
    assert "differs from the text model's hidden_size 64" in bad(lambda d: d["vision_config"].update(out_hidden_size=32))
    assert "image_size 50 is not a multiple of patch_size 14" in bad(lambda d: d["vision_config"].update(image_size=50))
    assert "quantized Glm4vForConditionalGeneration checkpoints" in bad(
        lambda d: d.update(quantization_config={"quant_method": "fp8"}))
    assert "hidden_size 64 is not a multiple of num_attention_heads 3" in bad(
        lambda d: d["text_config"].update(num_attention_heads=3))


def test_preprocessing_equals_the_image_processor(tiny):
    """Grids and patches of Glm4vImageProcessorPil as the checkpoint saved it: an image
    sized as two frames (its bounds halved), a side under 28 scaled up first; exact where no
    resampling happens, within one uint8 level after a resize; its smart_resize's sizes."""
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as hf_resize

    from flashpage.models.qwen3_vl_video import smart_resize_video

    for h in (5, 20, 28, 57, 333, 1000):
        for w in (3, 28, 70, 999):
            if max(h, w) / min(h, w) < 200:
                assert smart_resize_video(2, h, w, 2, 28, 6272, 37632) == hf_resize(2, h, w, 2, 28, 6272, 37632)
    proc = transformers.Glm4vImageProcessorPil.from_pretrained(tiny)
    enc = _encoder(tiny)
    for (h, w), exact in [((56, 84), True), *((s, False) for s in SIZES), ((333, 17), False), ((600, 800), False)]:
        img = smooth_image(h, w, seed=h + w)
        ours = enc.pixel_values(img)
        ref = proc(images=[img], return_tensors="pt")
        assert list(ours.grid) == ref["image_grid_thw"][0].tolist(), (h, w)
        assert ours.grid[1] * ours.grid[2] * 14 * 14 <= MAX_PIXELS
        diff = (ours.patches - ref["pixel_values"]).abs()
        assert diff.max() <= (1e-6 if exact else LEVEL), (h, w, diff.max())
    with pytest.raises(ValueError, match="aspect ratio"):
        enc.pixel_values(smooth_image(10, 2500))


def test_tower_rows_equal_transformers(glm):
    """Four images in one tower pass (attention and the position table's sampling per image)
    and one alone: get_image_features' rows; kept uint8 pixels and the kernels the tower takes
    on CUDA (rotary, RMSNorm with the residual, SiLU-mul; here the interpreter) the same."""
    tiny, hf = glm
    enc = _encoder(tiny)
    imgs = [enc.pixel_values(smooth_image(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]
    assert [im.grid for im in imgs] == [(1, 6, 10), (1, 4, 6), (1, 8, 2), (1, 6, 4)]
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.cat([p.patches for p in imgs]),
                                          torch.tensor([list(p.grid) for p in imgs]), return_dict=True).pooler_output
    ours = enc.encode(imgs)
    for j, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.shape == (math.prod(imgs[j].grid) // 4, 64)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(enc.encode(imgs[1:2])[0], ref[1], rtol=1e-4, atol=1e-5)
    # the position table matters: zeroed, the rows are no longer transformers'
    saved = enc.visual.embeddings.position_embedding.weight.detach().clone()
    with torch.no_grad():
        enc.visual.embeddings.position_embedding.weight.zero_()
        assert not torch.allclose(enc.encode(imgs[:1])[0], ref[0], atol=1e-3)
        enc.visual.embeddings.position_embedding.weight.copy_(saved)
    kept = [enc.admit_image(smooth_image(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]
    assert all(torch.equal(a, b) for a, b in zip(enc.encode(kept), ours, strict=True))
    enc.visual.kernels = True  # (two images: the interpreter is slow)
    for a, b in zip(enc.encode(kept[1:3]), ours[1:3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the engine's reserve for an encode call: at least each patch's stream and MLP rows,
    # never under one image at its max_pixels (counted as two frames)
    vc = enc.config
    assert enc.activation_bytes(1) == enc.activation_bytes(0) > 0
    assert enc.call_rows == MAX_PIXELS // 28 ** 2
    assert enc.activation_bytes(4096) >= 4096 * 4 * (3 * vc.hidden_size + vc.out_hidden_size) * 4


def test_mrope_on_interleaved_pairs_equals_transformers_and_the_fused_table():
    """GLM-4.1V's M-RoPE: sections [8, 12, 12] of the 32 pairs of a 128-wide head's first
    half, the pairs neighbours (x[2i], x[2i + 1]): transformers' rotation of 3-D positions;
    the per-token table (the fused kernel's input, interleaved) rotates as the torch path."""
    from transformers.models.glm4v.modeling_glm4v import (
        Glm4vTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = transformers.Glm4vTextConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5})
    ours = MRotaryEmbedding(128, 64, 256, 10000.0, (8, 12, 12), is_neox=False)
    torch.manual_seed(0)
    pos = torch.randint(0, 200, (3, 9))
    pos[:, :3] = torch.tensor([5, 6, 7])
    q, k = torch.randn(9, 2, 128), torch.randn(9, 1, 128)
    cos, sin = Glm4vTextRotaryEmbedding(cfg)(q, pos[:, None, :])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = ours(pos, q, k)
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    halves = MRotaryEmbedding(128, 64, 256, 10000.0, (8, 12, 12))(pos, q, k)[0]
    assert not torch.allclose(halves, q_ours, atol=1e-3)  # the pair layouts differ
    assert torch.equal(q_ours[..., 64:], q[..., 64:])  # the second half is not rotated
    idx, table = ours.table(pos)
    assert torch.equal(apply_rotary_torch(idx, q, table, False), q_ours)
    qf, kf = apply_rotary(idx, q.clone(), k.clone(), table, is_neox=False)
    torch.testing.assert_close(qf, q_ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kf, k_ours, rtol=1e-5, atol=1e-5)


def test_prompt_positions_equal_get_rope_index(glm):
    """Text, an image of 3 x 5 merged units, text, a video of two frame groups of 2 x 1
    (their time text between them), text: transformers' 3-D positions and delta."""
    hf = glm[1]
    c = hf.config
    img, bi, ei, bv, ev = c.image_token_id, c.image_start_token_id, c.image_end_token_id, \
        c.video_start_token_id, c.video_end_token_id
    ids = [1, 5, bi, *[img] * 15, ei, 7, bv, bi, img, img, ei, 30, bi, img, img, ei, 31, ev, 9]
    x = torch.tensor([ids])
    inside = torch.cumsum(x == bv, 1) > torch.cumsum(x == ev, 1)
    types = ((x == img) & ~inside).int() + 2 * ((x == img) & inside).int()
    ref, delta = hf.model.get_rope_index(x, types, torch.tensor([[1, 6, 10]]), torch.tensor([[2, 4, 2]]))
    starts = [i for i, t in enumerate(ids) if t == img and ids[i - 1] != img]
    grids = [(1, 3, 5), (1, 2, 1), (1, 2, 1)]
    inputs = [MultiModalInput(s, math.prod(g), b"", None, grid=g) for s, g in zip(starts, grids, strict=True)]
    ours, our_delta = prompt_positions(len(ids), inputs)
    assert np.array_equal(ours, ref[:, 0].numpy()) and our_delta == int(delta) < 0


def test_missing_tower_tensors_are_named(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "missing", edit=lambda t: t.pop("model.visual.downsample.bias"))
    with pytest.raises(ModelLoadError, match=r"1 vision tower weight\(s\) missing.*downsample.bias"):
        _encoder(path)


def test_frame_picks_equal_glm4v_video_processors_and_the_settings_are_read(tiny, tmp_path):
    """models/glm4v_video.sample_indices picks the frames Glm4vVideoProcessor.sample_frames
    (transformers' own code, on its VideoMetadata) picks, for 1 to 401 frames at common
    rates, durations given or not (0 too: its count's), sampling rates and max_durations
    putting the video under and over it (3,024 cases). The settings: the video processor's
    file (do_sample_frames, fps, max_duration) and mm_processor_kwargs (do_sample_frames,
    fps as the sampling rate, a video's own fps left alone) over it; off without either;
    bad values and keys transformers' processor call ignores (max_duration) named."""
    import itertools
    import shutil
    import types

    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_utils import VideoMetadata

    from flashpage.config import with_mm_processor_kwargs
    from flashpage.models.glm4v_config import Glm4vFrameSampling
    from flashpage.models.glm4v_video import sample_indices

    n = 0
    for total, fps, rate, top in itertools.product((1, 2, 3, 7, 30, 31, 61, 200, 401), (1, 2.5, 10, 23.976, 29.97, 30, 60),
                                                   (0.5, 1, 2, 3), (1, 5, 300)):
        own = types.SimpleNamespace(fps=rate, max_duration=top)
        for duration in (None, 0, total / fps, 3.3):
            md = VideoMetadata(total_num_frames=total, fps=fps, duration=duration)
            want = Glm4vVideoProcessor.sample_frames(own, md).tolist()
            got = sample_indices(total, float(fps), duration, Glm4vFrameSampling(True, float(rate), float(top)))
            assert got == want, (total, fps, duration, rate, top)
            n += 1
    assert n == 3024
    folder = tmp_path / "sampled"
    folder.mkdir()
    shutil.copy(tiny / "config.json", folder)
    assert ModelConfig.from_hf(folder).vision.frame_sampling == Glm4vFrameSampling(False, 2.0, 300.0)
    vp = folder / "video_preprocessor_config.json"
    vp.write_text(json.dumps({"video_processor_type": "Glm4vVideoProcessor", "do_sample_frames": True, "fps": 1,
                              "max_duration": 20}))
    mc = ModelConfig.from_hf(folder)
    assert mc.vision.frame_sampling == Glm4vFrameSampling(True, 1.0, 20.0)
    asked = with_mm_processor_kwargs(mc, {"do_sample_frames": False, "fps": 3})
    assert asked.vision.frame_sampling == Glm4vFrameSampling(False, 3.0, 20.0) and asked.vision.video_fps is None
    for kwargs, needle in (({"fps": 0}, "mm_processor_kwargs: fps must be a positive number, got 0"),
                           ({"do_sample_frames": 1}, "do_sample_frames must be true or false, got 1"),
                           ({"max_duration": 5, "num_frames": 4},
                            "mm_processor_kwargs ['max_duration', 'num_frames']: Glm4vForConditionalGeneration's "
                            "processors read min_pixels, max_pixels, size and fps (the rate its video processor "
                            "samples at) and do_sample_frames (its max_duration is its video processor's file's")):
        with pytest.raises(ConfigError) as e:
            with_mm_processor_kwargs(mc, kwargs)
        assert needle in str(e.value), str(e.value)
    vp.write_text(json.dumps({"do_sample_frames": True, "fps": 0.5, "max_duration": 1.5}))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(folder)
    assert f"{vp}: do_sample_frames with fps 0.5 and max_duration 1.5 would pick no frame" in str(e.value)
    vp.write_text(json.dumps({"do_sample_frames": "yes"}))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(folder)
    assert f"{vp}: do_sample_frames must be true or false, got 'yes'" in str(e.value)
