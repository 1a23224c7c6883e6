"""The text model of a multimodal checkpoint (config.MULTIMODAL_TEXT_ARCHITECTURES:
Llama4ForConditionalGeneration served alone, images not supported; and
LlavaForConditionalGeneration / LlavaNextForConditionalGeneration /
LlavaOnevisionForConditionalGeneration, Qwen2VLForConditionalGeneration /
Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration /
Qwen3VLMoeForConditionalGeneration, Mistral3ForConditionalGeneration,
Gemma3ForConditionalGeneration, InternVLForConditionalGeneration / InternVLChatModel,
Idefics3ForConditionalGeneration / SmolVLMForConditionalGeneration and
Glm4vForConditionalGeneration, whose images
models/llava.py / llava_next.py / llava_onevision.py, models/qwen2_vl.py, models/pixtral.py,
models/gemma3_vision.py, models/internvl.py, models/idefics3.py and models/glm4v.py run beside them; and
Qwen2AudioForConditionalGeneration, whose audio models/qwen2_audio.py runs).

The config is the text model's (config._text_config_of); its weights sit under the wrapper's
prefixes, which ``text_model_weights`` takes off on the way to the text family's own
``load_weights``:

- the language model: ``language_model.model.`` (transformers 4 and what transformers 5
  still writes; ``language_model.model.model.``: Qwen2-Audio as transformers 5.17 saves it),
  ``model.language_model.`` (transformers 5's module names),
  ``model.text_model.`` (Idefics3's and SmolVLM's) -> ``model.``;
  Qwen2-VL's published files: ``model.`` as it is;
- the head: ``language_model.lm_head.`` or ``lm_head.`` -> ``lm_head.`` (absent when tied);
  InternLM2's ``language_model.output.`` -> ``output.`` (its own name, models/internlm2.py);
- the vision tower and projector (``vision_tower`` / ``vision_model``,
  ``multi_modal_projector`` / ``connector``, LLaVA-NeXT's ``image_newline``, Qwen2-Audio's
  ``audio_tower``, with or without ``model.`` before them): skipped, counted in
  one INFO line (LLaVA's: read by its image encoder, models/llava.py, in a pass of its own);
- anything else: a ModelLoadError naming the tensor (a file of another layout, or a
  module we would silently drop).

Qwen3-VL-MoE's routed experts are fused per layer in its files (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``), in one of two layouts: the published checkpoints' (transformers
4.57's modules: gate_up_proj [E, H, 2I], down_proj [E, I, H], read as x @ W) or transformers
5's (its modules' [E, 2I, H] / [E, H, I], as nn.Linear, which is what its save_pretrained
writes); ``qwen3_vl_moe_experts`` gives ours (transformers 5's, layers/moe.py) as
transformers' conversion does (conversion_mapping "qwen3_vl_moe": transposed unless the shape
is already the module's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from flashpage.config import MULTIMODAL_TEXT_ARCHITECTURES, ModelConfig

logger = logging.getLogger(__name__)

# checkpoint prefix -> ours, tried in order
_TEXT_PREFIXES = (
    # Qwen2-Audio as transformers 5.17's save_pretrained writes it (its language_model.model
    # renaming applied to a whole causal LM's model.: one "model." too many; 5.25 does not)
    ("language_model.model.model.", "model."),
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),  # Idefics3's and SmolVLM's
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
    ("language_model.output.", "output."),  # InternLM2's head (InternVL2.5-8B; models/internlm2.py)
)

# the published Qwen2-VL / Qwen2.5-VL files keep the language model at the top level
# (``model.layers.``, ``model.embed_tokens.``; the tower under ``visual.``)
_BARE_PREFIXES = {arch: (("model.", "model."),) for arch in
                  ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")}


# a vision config's class -> the module under flashpage/models/ whose load_image_encoder
# builds its tower and projector (LLaVA-NeXT's and LLaVA-OneVision's: llava's,
# llava.encoder_class)
IMAGE_MODULES = {"VisionConfig": "llava", "QwenVisionConfig": "qwen2_vl",
                 "PixtralVisionConfig": "pixtral", "Gemma3VisionConfig": "gemma3_vision",
                 "InternVLVisionConfig": "internvl", "Idefics3VisionConfig": "idefics3",
                 "Glm4vVisionConfig": "glm4v",
                 # an audio config (ModelConfig.audio): its encoder's module, loaded the same way
                 "Qwen2AudioConfig": "qwen2_audio"}


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` on ``device``: from the host through pinned memory and asynchronous on CUDA (see
    ``stack_to``)."""
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def stack_to(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``tensors`` (one shape and dtype) stacked on ``device`` by one copy: from the host,
    through pinned memory and asynchronous on CUDA (a pageable copy first waits for the
    stream's queued work, idling the GPU while the host copies)."""
    if device.type != "cuda" or any(t.device.type != "cpu" for t in tensors):
        return torch.stack([t.to(device) for t in tensors])
    buf = torch.empty((len(tensors), *tensors[0].shape), dtype=tensors[0].dtype, pin_memory=True)
    torch.stack(tensors, out=buf)
    return buf.to(device, non_blocking=True)


def image_module(config: ModelConfig) -> str | None:
    """The module (under flashpage/models/) of ``config``'s multimodal encoder (its image
    encoder, or Qwen2-Audio's audio encoder); None: neither images nor audio."""
    enc = config.vision if config.vision is not None else config.audio
    return None if enc is None else IMAGE_MODULES[type(enc).__name__]


def text_only_note(config: ModelConfig) -> str:
    """The one sentence saying what of a multimodal checkpoint runs (log, inspect)."""
    if config.audio is not None:
        return (f"{config.multimodal_architecture}: its text model ({config.architecture}) "
                f"and its audio (audio encoder and projector: models/{image_module(config)}.py)")
    if config.vision is not None:
        return (f"{config.multimodal_architecture}: its text model ({config.architecture}) "
                f"and its images (vision tower and projector: models/{image_module(config)}.py)")
    return (f"{config.multimodal_architecture}: its text model ({config.architecture}) only; "
            "image inputs are not supported")


def vision_prefixes(config: ModelConfig) -> tuple[str, ...]:
    """The prefixes of the tensors we skip: the wrapper's vision modules, bare or under
    ``model.`` (transformers 5's names)."""
    mods = MULTIMODAL_TEXT_ARCHITECTURES[config.multimodal_architecture][2]
    return tuple(f"{m}." for m in mods) + tuple(f"model.{m}." for m in mods)


def text_model_name(name: str, config: ModelConfig) -> str | None:
    """A multimodal checkpoint's tensor ``name`` as the text model's (``text_model_weights``'
    renaming); None for a vision module's or any other (models/fp8_checkpoint.py matches
    the file's fp8 weights to our linears by it)."""
    if name.startswith(vision_prefixes(config)):
        return None
    for prefix, ours in _TEXT_PREFIXES + _BARE_PREFIXES.get(config.multimodal_architecture, ()):
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return None


def text_model_weights(weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig,
                       where: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (a multimodal checkpoint's tensors) as the text model's: the language
    model's renamed, the vision tower's and projector's skipped (one INFO line counting
    them once the stream is read), anything else a ModelLoadError."""
    from flashpage.models.loader import ModelLoadError

    skip = vision_prefixes(config)
    skipped = 0
    prefixes = _TEXT_PREFIXES + _BARE_PREFIXES.get(config.multimodal_architecture, ())
    experts = config.multimodal_architecture == "Qwen3VLMoeForConditionalGeneration"
    for name, t in weights:
        if name.startswith(skip) or f"{name}." in skip:  # LLaVA-NeXT's image_newline: a tensor
            skipped += 1
            continue
        for prefix, ours in prefixes:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                yield name, qwen3_vl_moe_experts(name, t, config) if experts else t
                break
        else:
            raise ModelLoadError(
                f"{where}: checkpoint tensor {name!r} is neither the language model's "
                f"({', '.join(p for p, _ in prefixes)}) nor a vision module's "
                f"({', '.join(skip)}) in this {config.multimodal_architecture} checkpoint")
    logger.info("%s; skipped %d vision tower / projector tensor(s) of the checkpoint",
                text_only_note(config), skipped)


def qwen3_vl_moe_experts(name: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A Qwen3-VL-MoE checkpoint's tensor ``name`` (our name) in our layout: a fused
    ``mlp.experts.gate_up_proj`` [E, H, 2I] (the published files') becomes [E, 2I, H], a
    ``down_proj`` [E, I, H] becomes [E, H, I]; one already in ours (transformers 5's files)
    and any other tensor as it is (a shape that fits neither is the loader's error)."""
    if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) or t.dim() != 3:
        return t
    e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    ours = (e, 2 * i, h) if name.endswith("gate_up_proj") else (e, h, i)
    if tuple(t.shape) != ours and tuple(t.shape) == (e, ours[2], ours[1]):
        return t.transpose(1, 2).contiguous()
    return t


def build_image_encoder(source: Any, dtype: torch.dtype, device: torch.device, seed: int,
                        make: Callable[[], torch.nn.Module], prefixes: tuple[str, ...],
                        weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                        zero_norm_biases: bool = True) -> Any:
    """An image encoder (``make()``, built on ``device`` and cast to ``dtype``) with
    ``source``'s (loader.ModelSource) tensors: its checkpoint's under ``prefixes`` (or
    ``weights`` given, e.g. dequantized ones) through the encoder's load_weights, or random
    ones for a random_config source (init_random_, LayerNorm biases zeroed: it fills norm
    weights with 1). In training mode still: the family finishes it (its own random
    values, fusions) and calls eval()."""
    from flashpage.models.loader import init_random_, iter_safetensors

    with torch.device(device):
        enc = make()
    enc.to(dtype)
    if source.kind == "random":
        init_random_(enc, seed)
        if zero_norm_biases:
            with torch.no_grad():
                for n, p in enc.named_parameters():
                    if "norm" in n and n.endswith(".bias"):
                        p.zero_()
    else:
        assert source.path is not None
        if weights is None:
            weights = iter_safetensors(source.path, "cpu", keep=lambda n: n.startswith(prefixes))
        enc.load_weights(weights, source.path)  # type: ignore[operator]
    return enc


def load_image_weights(module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], where: str,
                       prefixes: Sequence[tuple[str, str]], what: str, kind: str,
                       skip: Callable[[str], bool] | None = None) -> tuple[set[str], int]:
    """An image encoder's tensors of a checkpoint (models/llava.py, qwen2_vl.py, pixtral.py):
    each name under one of ``prefixes`` (checkpoint prefix, ours) copied into ``module``'s
    parameter of our name, unless ``skip(our name)`` (tensors the encoder never reads);
    other names are the text model's, ignored. A ModelLoadError names a tensor that is no
    parameter of ``what``, a shape that differs, and the ``kind`` weights the checkpoint
    lacks. -> (the parameter names loaded, how many were skipped)."""
    from flashpage.models.loader import ModelLoadError

    params = dict(module.named_parameters())
    loaded: set[str] = set()
    skipped = 0
    for name, t in weights:
        ours = next((o + name[len(p):] for p, o in prefixes if name.startswith(p)), None)
        if ours is None:
            continue
        if skip is not None and skip(ours):
            skipped += 1
            continue
        p = params.get(ours)
        if p is None:
            raise ModelLoadError(f"{where}: checkpoint tensor {name!r} is not a parameter of {what}")
        if tuple(t.shape) != tuple(p.shape):
            raise ModelLoadError(f"{where}: checkpoint tensor {name!r} has shape "
                                 f"{tuple(t.shape)}, the config says {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t)
        loaded.add(ours)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{where}: {len(missing)} {kind} weight(s) missing from the checkpoint: {shown}")
    return loaded, skipped


def image_encoder_shell(config: ModelConfig) -> torch.nn.Module | None:
    """``config``'s image encoder (tower and projector) built under the current device
    (``torch.device("meta")`` for its shapes alone: ``flashpage inspect``), without weights;
    None for a model that takes no images. Its ``pixel_values`` / ``num_rows`` preprocess
    on the host and count an image's prompt rows."""
    if config.vision is None:
        return None
    module = image_module(config)
    vc: Any = config.vision
    if module == "qwen2_vl":
        from flashpage.models.qwen2_vl import QwenImageEncoder

        return QwenImageEncoder(vc)
    if module == "glm4v":
        from flashpage.models.glm4v import Glm4vImageEncoder

        return Glm4vImageEncoder(vc)
    if module == "llava":
        from flashpage.models.llava import encoder_class

        return encoder_class(vc)(vc, config.hidden_size)
    if module == "gemma3_vision":
        from flashpage.models.gemma3_vision import Gemma3ImageEncoder

        return Gemma3ImageEncoder(vc, config.hidden_size)
    if module == "internvl":
        from flashpage.models.internvl import InternVLImageEncoder

        return InternVLImageEncoder(vc, config.hidden_size)
    if module == "idefics3":
        from flashpage.models.idefics3 import Idefics3ImageEncoder

        return Idefics3ImageEncoder(vc, config.hidden_size)
    if module == "pixtral":
        from flashpage.models.pixtral import PixtralImageEncoder

        return PixtralImageEncoder(vc, config.hidden_size)
    return None


def audio_encoder_shell(config: ModelConfig) -> torch.nn.Module | None:
    """``config``'s audio encoder and projector built under the current device (as
    ``image_encoder_shell``), without weights; None for a model that takes no audio."""
    if config.audio is None:
        return None
    from flashpage.models.qwen2_audio import Qwen2AudioEncoder

    return Qwen2AudioEncoder(config.audio, config.hidden_size)
