"""models/idefics3.py's tower and connector against transformers' get_image_features: the
rows of several tiles in one call equal Idefics3Model's (fp32, 1e-4), and SmolVLMModel's for
a patch grid whose bucketed positions are not the identity (19 x 19: the float32 bucketing
repeats a position; scale_factor 1); the tiles' count and grid equal
the image processor's get_number_of_image_patches for many sizes."""

from __future__ import annotations

import pytest
import torch

from flashpage.config import ModelConfig
from flashpage.models.idefics3 import bucketed_positions, load_image_encoder, num_tiles, tile_image
from flashpage.models.loader import resolve_model
from tests.idefics3_checkpoint import build_tiny_idefics3, hf_idefics3, hf_image_processor
from tests.llava_checkpoint import smooth_image


def _encoder(path):
    return load_image_encoder(resolve_model(str(path)), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("smolvlm,vision,scale", [(False, {}, 2), (True, {"image_size": 38}, 1)])
def test_rows_equal_get_image_features(tmp_path, smolvlm, vision, scale):
    path = build_tiny_idefics3(tmp_path / "m", smolvlm=smolvlm, vision=vision, scale_factor=scale)
    hf = hf_idefics3(path)
    enc = _encoder(path)
    vc = enc.config
    p = vc.patches_per_side
    if p == 19:  # the case the bucketing matters for
        assert not torch.equal(bucketed_positions(p), torch.arange(p * p))
    tiles = torch.cat([tile_image(smooth_image(20 + 7 * i, 40 - 5 * i, seed=i), vc).pixels for i in range(2)])
    from flashpage.models.clip_image import normalize

    px = normalize(tiles, vc.processing)
    with torch.no_grad():
        want = hf.model.get_image_features(px[None], torch.ones(1, *px.shape[:1], *px.shape[2:],
                                                                dtype=torch.long)).pooler_output
    got = enc.encode(list(tiles))
    assert len(got) == len(tiles)
    torch.testing.assert_close(torch.cat(got), torch.cat(list(want)).reshape(-1, got[0].shape[-1]),
                               atol=1e-4, rtol=1e-4)


def test_tile_counts_equal_the_processors(tmp_path):
    path = build_tiny_idefics3(tmp_path / "m")
    vc = ModelConfig.from_hf(str(path)).vision
    proc = hf_image_processor()
    for h in (1, 5, 16, 17, 31, 47, 48, 49, 90, 300):
        for w in (1, 7, 16, 24, 33, 48, 64, 200):
            n, rows, cols = proc.get_number_of_image_patches(h, w, {})
            assert num_tiles(vc, (h, w)) == max(n, 1), (h, w)
            if n:
                assert tile_image(torch.zeros(3, h, w, dtype=torch.uint8), vc).grid == (rows, cols)
