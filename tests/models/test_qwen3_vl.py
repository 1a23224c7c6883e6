"""Qwen3-VL's image side (models/qwen3_vl.py, config's qwen3_vl fields, layers/rotary's
interleaved M-RoPE): the tower's rows and deepstack features against transformers'
get_image_features (images of three sizes in one pass), the position table's taps against
transformers' interpolation helper, interleaved M-RoPE's cos / sin against
Qwen3VLTextRotaryEmbedding and the fused kernel's table form, the prompt's 3-D positions
against get_rope_index, the preprocessing against Qwen2VLImageProcessorPil with 16-pixel
patches, and the config's fields and errors (fp32, CPU)."""

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
from flashpage.models.loader import ModelLoadError, resolve_model
from flashpage.models.qwen2_vl import load_image_encoder
from flashpage.models.qwen3_vl import position_taps
from tests.conftest import edited_copy
from tests.llava_checkpoint import smooth_image
from tests.qwen3_vl_checkpoint import MAX_PIXELS, build_tiny_qwen3_vl, hf_qwen3_vl

SIZES = [(84, 130), (60, 90), (100, 40)]  # grids 6x8 (after resize to 96 x 128), 4x6, 6x2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


def _encoder(path: Path):
    return load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


def test_config_reads_the_text_model_and_tower(tiny):
    cfg = ModelConfig.from_hf(tiny)
    assert (cfg.architecture, cfg.model_type, cfg.qk_norm, cfg.multimodal_architecture) == \
        ("Qwen3ForCausalLM", "qwen3", True, "Qwen3VLForConditionalGeneration")
    assert cfg.mrope_section == (4, 2, 2) and cfg.mrope_interleaved and cfg.head_dim == 16
    vc = cfg.vision
    assert vc is not None and vc.variant == "qwen3_vl"
    assert (vc.patch_size, vc.spatial_merge_size, vc.num_position_embeddings, vc.deepstack_visual_indexes) == \
        (16, 2, 16, (1, 0))
    assert (vc.processing.min_pixels, vc.processing.max_pixels, vc.processing.mean) == \
        (64 * 64, MAX_PIXELS, (0.5, 0.5, 0.5))


def test_preprocessing_equals_the_image_processor(tiny):
    """32-pixel multiples (16-pixel patches merged 2 x 2) and the patches' values:
    transformers' Qwen2VLImageProcessorPil as the checkpoint saved it."""
    proc = transformers.Qwen2VLImageProcessorPil.from_pretrained(tiny)
    enc = _encoder(tiny)
    for h, w in [*SIZES, (32, 32), (333, 17)]:
        img = smooth_image(h, w, seed=h)
        ours = enc.pixel_values(img)
        ref = proc(images=[img], return_tensors="pt")
        assert list(ours.grid) == ref["image_grid_thw"][0].tolist()
        assert ours.grid[1] % 2 == 0 and ours.grid[2] % 2 == 0
        assert ours.patches.shape == ref["pixel_values"].shape and ours.patches.shape[1] == 3 * 2 * 16 * 16
        # torch's antialiased resize against PIL's: within a level of 1/255 after the 0.5 std
        torch.testing.assert_close(ours.patches, ref["pixel_values"], atol=2 / 255 / 0.5 + 1e-6, rtol=0)


def test_position_taps_equal_transformers():
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    grids = [(1, 6, 8), (1, 2, 2), (2, 4, 10), (1, 48, 2)]
    ref_i, ref_w = get_vision_interpolation_indices_and_weights(
        torch.tensor(grids), num_grid_per_side=48, mode="bilinear", align_corners=True, spatial_merge_size=2)
    taps = [position_taps(g, 48, 2) for g in grids]
    assert torch.equal(torch.cat([i for i, _ in taps]), ref_i)
    assert torch.equal(torch.cat([w for _, w in taps]), ref_w)


def test_tower_rows_and_deepstack_equal_transformers(tiny):
    """Three images in one tower pass: each image's rows and its 2 deepstack features (in
    the tower's block order: blocks 0 then 1, the mergers listed as [1, 0]) equal
    get_image_features'."""
    hf = hf_qwen3_vl(tiny)
    enc = _encoder(tiny)
    imgs = [enc.pixel_values(smooth_image(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.cat([p.patches for p in imgs]),
                                          torch.tensor([list(p.grid) for p in imgs]), return_dict=True)
    ours = enc.encode(imgs)
    assert len(ours) == 3
    for j, (rows, deep) in enumerate(ours):
        assert rows.shape == (math.prod(imgs[j].grid) // 4, 64) and deep.shape == (rows.shape[0], 2, 64)
        torch.testing.assert_close(rows, ref.pooler_output[j], rtol=1e-4, atol=1e-4)
        for k in range(2):
            torch.testing.assert_close(deep[:, k], ref.deepstack_features[k][j], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours[0][1][:, 0], ours[0][1][:, 1])  # two distinct features
    # what a request keeps (resized uint8 pixels, patched in encode) gives the same rows and
    # features; so does the rotary kernel the tower takes on CUDA (here the interpreter)
    kept = [enc.admit_image(smooth_image(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]
    enc.visual.kernels = True
    for (r, d), (r0, d0) in zip(enc.encode(kept), ours, strict=True):
        torch.testing.assert_close(r, r0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(d, d0, rtol=1e-5, atol=1e-5)


def test_interleaved_mrope_equals_transformers_and_the_fused_table():
    """Qwen3-VL's interleaved sections [24, 20, 20] of 64 pairs: cos / sin rows of 3-D
    positions equal Qwen3VLTextRotaryEmbedding's; the per-token table (the fused kernel's
    input) rotates as the torch path; 1-D positions are the plain rope."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (
        Qwen3VLTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = transformers.Qwen3VLTextConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=128, rope_parameters={
                                             "rope_type": "default", "rope_theta": 5e6,
                                             "mrope_section": [24, 20, 20], "mrope_interleaved": True})
    ours = MRotaryEmbedding(128, 128, 256, 5e6, (24, 20, 20), interleaved=True)
    comp = ours.component[:64].tolist()
    assert comp[:6] == [0, 1, 2, 0, 1, 2] and comp[57:] == [0, 1, 2, 0, 0, 0, 0]
    torch.manual_seed(0)
    pos = torch.randint(0, 200, (3, 9))
    pos[:, :3] = torch.tensor([5, 6, 7])
    q, k = torch.randn(9, 2, 128), torch.randn(9, 1, 128)
    cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(q, pos[:, None, :])
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = ours(pos, q, k)
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    contiguous = MRotaryEmbedding(128, 128, 256, 5e6, (24, 20, 20))(pos, q, k)[0]
    assert not torch.allclose(contiguous[3:], q_ours[3:], atol=1e-3)  # the layouts differ
    idx, table = ours.table(pos)
    assert torch.equal(apply_rotary_torch(idx, q, table, True), q_ours)
    q_1d, _ = ours(pos[0, :3], q[:3], k[:3])
    assert torch.equal(q_1d, q_ours[:3])
    qf, kf = apply_rotary(idx, q.clone(), k.clone(), table)
    torch.testing.assert_close(qf, q_ours, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kf, k_ours, rtol=1e-5, atol=1e-5)


def test_prompt_positions_equal_get_rope_index(tiny):
    hf = hf_qwen3_vl(tiny)
    tok = hf.config.image_token_id
    ids = [1, 5, 6, 250, *[tok] * 12, 252, 7, 8, 250, *[tok] * 2, 252, 9]
    grids = [(1, 3, 4), (1, 2, 1)]
    x = torch.tensor([ids])
    ref, delta = hf.model.get_rope_index(x, (x == tok).int(), torch.tensor([[1, 6, 8], [1, 4, 2]]))
    starts = [i for i, t in enumerate(ids) if t == tok and ids[i - 1] != tok]
    inputs = [MultiModalInput(s, math.prod(g), b"", None, grid=g) for s, g in zip(starts, grids, strict=True)]
    ours, our_delta = prompt_positions(len(ids), inputs)
    assert np.array_equal(ours, ref[:, 0].numpy()) and our_delta == int(delta) < 0


def test_config_errors_name_the_field(tiny):
    raw = json.loads((tiny / "config.json").read_text())

    def bad(edit) -> str:
        d = json.loads(json.dumps(raw))
        edit(d)
        with pytest.raises(ConfigError) as e:
            ModelConfig.from_hf(d)
        return str(e.value)

    assert "num_position_embeddings must be a positive square int" in bad(
        lambda d: d["vision_config"].update(num_position_embeddings=20))
    assert "deepstack_visual_indexes must be distinct block indexes in [0, 3)" in bad(
        lambda d: d["vision_config"].update(deepstack_visual_indexes=[0, 3]))
    assert "has 3 entries" in bad(lambda d: (d["vision_config"].update(deepstack_visual_indexes=[0, 1, 2]),
                                             d["text_config"].update(num_hidden_layers=2)))
    assert "mrope_section [4, 2, 1] sums to 7" in bad(
        lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[4, 2, 1]))
    assert "differs from the text model's hidden_size 64" in bad(
        lambda d: d["vision_config"].update(out_hidden_size=32))
    # a dense text model under the MoE wrapper's name: its text_config names what is read
    moe = bad(lambda d: d.update(architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe"))
    assert "text_config.model_type 'qwen3_vl_text' is not supported" in moe and "qwen3_vl_moe_text" in moe


def test_missing_tower_tensors_are_named(tiny, tmp_path):
    path = edited_copy(tiny, tmp_path / "missing",
                       edit=lambda t: t.pop("model.visual.deepstack_merger_list.1.linear_fc2.bias"))
    with pytest.raises(ModelLoadError, match=r"1 vision tower weight\(s\) missing.*deepstack_merger_list.1"):
        _encoder(path)
