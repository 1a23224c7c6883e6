"""Gemma 3's pan-and-scan (Gemma3ImageProcessor's ``do_pan_and_scan``): a wide or tall image
is given to the model as its whole (resized to the tower's square, as without pan-and-scan)
and as a few crops along its long side, each crop resized to the square too: one more
image of T rows each, in the prompt after the whole one.

The crops, as transformers 5.24's Gemma3ImageProcessor cuts them (``crop_boxes``), on the
image's own pixels before any resize: a landscape image (w >= h) whose w / h reaches
``min_ratio_to_activate`` gets n = round-half-up(w / h) crops, at most w // min_crop_size,
then clamped to [2, max_num_crops]; each ceil(w / n) wide, the whole height (the last one
narrower where n does not divide w); none at all if a crop would be under min_crop_size
pixels on either side. A portrait image the same along its height. A square image, or one
not elongated enough, gets none and is an ordinary image (its prompt text unchanged).

The prompt, as Gemma3Processor writes an image with k > 0 crops in place of its
<start_of_image> (FULL: "\\n\\n<start_of_image>" + T x <image_soft_token> + "<end_of_image>\\n\\n",
the text of an ordinary image)::

    "Here is the original image " FULL " and here are some crops to help you see better "
    FULL (" " FULL) x (k - 1)

The engine works on ids: the text between two special tokens is tokenized whole by the
model's tokenizer (``texts``: "Here is the original image \\n\\n", "\\n\\n and here are some
crops to help you see better \\n\\n", "\\n\\n \\n\\n"), which is exactly what tokenizing the
joined prompt gives there, as special tokens split a tokenizer's input. The first piece
follows the prompt's own text, which transformers tokenizes joined with it: the two agree
where the prompt's text before <start_of_image> ends in a special token or a newline (a chat
template's image part does), as vLLM's expansion of the same text does. The "\\n\\n" after
the last crop merges with a newline after it as an ordinary image's does
(models/gemma3_vision.expand_gemma3_images).

Each of the whole image and its crops is its own MultiModalInput of T rows, attending
bidirectionally within itself only (transformers' token_type_ids blocks: the text between
two images separates them), so the scheduler's cut and the encoder cache treat a crop as
any image; their digests are their own pixels' (a crop's rows are a function of its pixels),
and the prefix cache's chain holds every input's offset and digest beside the prompt's ids,
whose pan-and-scan text already differs from an ordinary image's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product

import torch

from flashpage.models.gemma3_config import PanAndScan

# Gemma3Processor's text around an image with crops, cut at its special tokens
ORIGINAL = "Here is the original image \n\n"
CROPS = "\n\n and here are some crops to help you see better \n\n"
BETWEEN = "\n\n \n\n"


def crop_boxes(height: int, width: int, pas: PanAndScan) -> list[tuple[int, int, int, int]]:
    """The crops of an image of ``height`` x ``width`` pixels as (top, bottom, left, right),
    row-major, as Gemma3ImageProcessor.pan_and_scan cuts them (module docstring); [] for
    none (pan-and-scan off, or an image it leaves whole)."""
    if not pas.enabled:
        return []
    landscape = width >= height
    long, short = (width, height) if landscape else (height, width)
    if long / short < pas.min_ratio_to_activate:
        return []
    n = min(int(math.floor(long / pas.min_crop_size)), int(math.floor(long / short + 0.5)))
    n = min(pas.max_num_crops, max(2, n))
    n_w, n_h = (n, 1) if landscape else (1, n)
    cw, ch = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
    if min(cw, ch) < pas.min_crop_size:
        return []
    # (a crop past the edge, possible only with min_crop_size of a few pixels, is left out:
    # transformers' would be empty)
    return [(y, min(y + ch, height), x, min(x + cw, width))
            for y, x in product(range(0, ch * n_h, ch), range(0, cw * n_w, cw)) if y < height and x < width]


@dataclass(eq=False)
class PanScanImage:
    """What a request keeps of an image admitted with pan-and-scan on (``Gemma3ImageEncoder
    .admit_image``): the whole image and its crops (none where it is left whole), each
    resized to uint8 [3, S, S], the whole one first, in the prompt's order."""

    images: list[torch.Tensor]

    @property
    def num_crops(self) -> int:
        return len(self.images) - 1


def texts_ids(tokenize: Callable[[str], list[int]]) -> tuple[list[int], list[int], list[int]]:
    """The ids of the three pieces of Gemma3Processor's pan-and-scan text (module
    docstring): before the whole image, between it and the first crop, between crops."""
    return tokenize(ORIGINAL), tokenize(CROPS), tokenize(BETWEEN)
