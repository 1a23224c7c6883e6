"""The text model of a multimodal checkpoint (config.MULTIMODAL_TEXT_ARCHITECTURES:
Gemma3ForConditionalGeneration, Llama4ForConditionalGeneration served alone, images not
supported; LlavaForConditionalGeneration, whose images models/llava.py runs beside it, and
Mistral3ForConditionalGeneration, whose images models/pixtral.py runs).

The config is the text model's (config._text_config_of); its weights sit under the wrapper's
prefixes, which ``text_model_weights`` takes off on the way to the text family's own
``load_weights``:

- the language model: ``language_model.model.`` (transformers 4 and what transformers 5
  still writes), ``model.language_model.`` (transformers 5's module names) -> ``model.``;
- the head: ``language_model.lm_head.`` or ``lm_head.`` -> ``lm_head.`` (absent when tied);
- the vision tower and projector (``vision_tower`` / ``vision_model``,
  ``multi_modal_projector``, with or without ``model.`` before them): skipped, counted in
  one INFO line (LLaVA's: read by its image encoder, models/llava.py, in a pass of its own);
- anything else: a ModelLoadError naming the tensor (a file of another layout, or a
  module we would silently drop).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch

from flashpage.config import MULTIMODAL_TEXT_ARCHITECTURES, ModelConfig

logger = logging.getLogger(__name__)

# checkpoint prefix -> ours, tried in order
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


def text_only_note(config: ModelConfig) -> str:
    """The one sentence saying what of a multimodal checkpoint runs (log, inspect)."""
    if config.vision is not None:
        where = "models/llava.py" if type(config.vision).__name__ == "VisionConfig" else "models/pixtral.py"
        return (f"{config.multimodal_architecture}: its text model ({config.architecture}) "
                f"and its images (vision tower and projector: {where})")
    return (f"{config.multimodal_architecture}: its text model ({config.architecture}) only; "
            "image inputs are not supported")


def vision_prefixes(config: ModelConfig) -> tuple[str, ...]:
    """The prefixes of the tensors we skip: the wrapper's vision modules, bare or under
    ``model.`` (transformers 5's names)."""
    mods = MULTIMODAL_TEXT_ARCHITECTURES[config.multimodal_architecture][2]
    return tuple(f"{m}." for m in mods) + tuple(f"model.{m}." for m in mods)


def text_model_weights(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                       where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (a multimodal checkpoint's tensors) as the text model's: the language
    model's renamed, the vision tower's and projector's skipped (one INFO line counting
    them once the stream is read), anything else a ModelLoadError."""
    from flashpage.models.loader import ModelLoadError

    skip = vision_prefixes(config)
    skipped = 0
    for name, t in weights:
        if name.startswith(skip):
            skipped += 1
            continue
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                yield ours + name[len(prefix):], t
                break
        else:
            raise ModelLoadError(
                f"{where}: checkpoint tensor {name!r} is neither the language model's "
                f"({', '.join(p for p, _ in _TEXT_PREFIXES)}) nor a vision module's "
                f"({', '.join(skip)}) in this {config.multimodal_architecture} checkpoint")
    logger.info("%s; skipped %d vision tower / projector tensor(s) of the checkpoint",
                text_only_note(config), skipped)
