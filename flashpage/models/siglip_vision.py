"""SigLIP's ViT vision tower (transformers' SiglipVisionModel without its pooling head), for
Gemma 3 (models/gemma3_vision.py: every layer, then post_layernorm) and LLaVA-OneVision
(models/llava_onevision.py: the hidden states of its feature layers, as CLIP's tower gives
LLaVA's: models/clip_vision.py).

    pixel_values [n, 3, S, S] -> patch conv (stride = patch, with bias) + learned positions
    -> layers (CLIP's pre-norm layers) -> [post_layernorm]            [n, (S / patch)^2, hidden]

No class token and no pre-norm: hidden state 0 is the embeddings, hidden state i layer
i - 1's output (transformers' ``hidden_states``, whose last is taken before post_layernorm).
Parameter names are the checkpoint's (``embeddings.patch_embedding.weight``,
``encoder.layers.{i}.self_attn.q_proj.weight``, ``post_layernorm.weight``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from flashpage.models.clip_vision import CLIPEncoderLayer, LayerShape


class TowerShape(LayerShape, Protocol):
    """What the tower reads of its config (Gemma3VisionConfig, LLaVA's VisionConfig)."""

    @property
    def num_channels(self) -> int: ...
    @property
    def image_size(self) -> int: ...
    @property
    def patch_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...


class SiglipEmbeddings(nn.Module):
    def __init__(self, vc: TowerShape) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, kernel_size=vc.patch_size,
                                         stride=vc.patch_size)
        self.position_embedding = nn.Embedding((vc.image_size // vc.patch_size) ** 2, vc.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, P*P, hidden] (patches row-major)"""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        # contiguous: an add keeps its input's layout, so the residual stream would otherwise stay
        # channel-major ([n, hidden, P*P] in memory) through every layer, each residual add and
        # LayerNorm a strided pass (run 240: the adds at ~0.8 TB/s, a quarter of the tower's time)
        return x.flatten(2).transpose(1, 2).contiguous() + self.position_embedding.weight


class SiglipEncoder(nn.Module):
    def __init__(self, vc: TowerShape, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(vc) for _ in range(num_layers))


class SiglipVisionTower(nn.Module):
    """transformers' SiglipVisionModel without its pooling head (names kept): its first
    ``num_layers`` layers (all by default) and post_layernorm unless ``post_norm`` is False
    (a reader of hidden states never runs the layers past its deepest, nor the norm)."""

    def __init__(self, vc: TowerShape, num_layers: int | None = None, post_norm: bool = True) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(vc)
        self.encoder = SiglipEncoder(vc, vc.num_hidden_layers if num_layers is None else num_layers)
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps) if post_norm else None

    def forward(self, pixel_values: torch.Tensor,
                feature_layers: tuple[int, ...] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """Without ``feature_layers``: the last hidden state after post_layernorm [n, P*P,
        hidden] (Gemma 3's); with them: the hidden states at those indexes (module
        docstring), each [n, P*P, hidden] (LLaVA-OneVision's)."""
        x = self.embeddings(pixel_values)
        if feature_layers is None:
            for layer in self.encoder.layers:
                x = layer(x)
            assert self.post_layernorm is not None
            return self.post_layernorm(x)
        want = set(feature_layers)
        kept = {0: x} if 0 in want else {}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if i in want:
                kept[i] = x
        return [kept[i] for i in feature_layers]
