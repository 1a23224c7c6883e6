"""models/pil_resample.py against Pillow's own Image.resize: pil_resize (Pillow where
installed) bit for bit on up- and downscales, a strided tensor and each filter; the torch
port (pillow=False) bit for bit on each pass alone and on enlargements (horizontal pass
first, as Pillow runs them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flashpage.models.pil_resample import pil_resize

CODES = {"lanczos": Image.LANCZOS, "bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR}


def _pillow(x: torch.Tensor, size: tuple[int, int], name: str) -> torch.Tensor:
    img = Image.fromarray(x.permute(1, 2, 0).contiguous().numpy())
    out = img.resize((size[1], size[0]), resample=CODES[name])
    return torch.from_numpy(np.array(out)).permute(2, 0, 1)


@pytest.mark.parametrize("name", sorted(CODES))
def test_pil_resize_is_pillows(name):
    g = torch.Generator().manual_seed(0)
    for (h, w), size in (((33, 47), (96, 64)), ((100, 80), (16, 16)), ((17, 60), (48, 5)), ((45, 12), (16, 16))):
        x = torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)
        assert torch.equal(pil_resize(x, size, name), _pillow(x, size, name))
    strided = torch.randint(0, 256, (20, 30, 3), generator=g, dtype=torch.uint8).permute(2, 0, 1)
    assert torch.equal(pil_resize(strided, (7, 41), name), _pillow(strided, (7, 41), name))
    assert torch.equal(pil_resize(strided, (20, 30), name), strided)


@pytest.mark.parametrize("name", sorted(CODES))
def test_port_equals_pillow_per_pass_and_on_enlargements(name):
    g = torch.Generator().manual_seed(1)
    for (h, w), size in (((33, 47), (33, 90)), ((33, 47), (9, 47)), ((40, 17), (40, 5)), ((13, 21), (64, 30)),
                         ((9, 9), (48, 48)), ((24, 48), (32, 48))):
        x = torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)
        assert torch.equal(pil_resize(x, size, name, pillow=False), _pillow(x, size, name)), (h, w, size)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="uint8"):
        pil_resize(torch.zeros(3, 4, 4), (2, 2))
    with pytest.raises(ValueError, match="positive"):
        pil_resize(torch.zeros(3, 4, 4, dtype=torch.uint8), (0, 2))
