"""Qwen3-VL (Qwen3VLForConditionalGeneration, and Qwen3VLMoeForConditionalGeneration: the
same tower over a Qwen3-MoE text model): its vision tower, with deepstack.

The text model is Qwen3 or Qwen3-MoE (models/llama.py: q / k norms) with M-RoPE in the interleaved layout
(layers/rotary.MRotaryEmbedding, ``interleaved``); the image side is models/qwen2_vl.py's
encoder (QwenImageEncoder: preprocessing as Qwen2VLImageProcessor's, with 16-pixel patches
merged 2 x 2, so sizes are multiples of 32; the prompt's <|image_pad|> expansion; the 3-D
positions, engine/mrope.py) around this tower (transformers' Qwen3VLVisionModel, names kept):

    patches [L, 3 x 2 x 16 x 16] -> patch_embed (the Conv3d, with a bias, as one linear)
    + pos_embed (a learned side x side table, bilinearly interpolated to each image's grid,
      align_corners: ``position_embeddings``) -> blocks -> merger -> rows [L / 4, H]
                                                    |
             after block deepstack_visual_indexes[j]: deepstack_merger_list[j] -> [L / 4, H]

- each block: x + attn(norm1(x)); x + mlp(norm2(x)), LayerNorm, linear_fc1 -> GELU(tanh) ->
  linear_fc2; attention full within one image, q and k rotated by the same 2-D rotary as
  Qwen2-VL's (models/qwen2_vl.vision_cos_sin); no windows;
- the merger: each patch normed, the merge block's 4 concatenated -> linear_fc1 -> GELU ->
  linear_fc2; a deepstack merger norms the concatenated 4 instead (postshuffle);
- deepstack: the k features of an image's row (in the tower's block order) are added to the
  text model's hidden state at that row after decoder layers 0 .. k-1 (transformers'
  Qwen3VLTextModel._deepstack_process). The encoder gives (rows, features [n, k, H]); the
  engine keeps both with the image (engine/multimodal.MultiModalInput.deepstack) and gives
  each step its slice of them beside the rows (models/common.InputEmbeds.deep_values), so a
  chunk holding part of an image adds its part; rows whose K/V came from the prefix cache
  take none (their later layers' K/V already hold the features).

Videos (frames) are cut into their frame groups, each an input of one temporal step with its
"<t seconds>" timestamp text before it in the prompt (models/qwen3_vl_video.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.config import QwenVisionConfig
from flashpage.models.qwen2_vl import Rope, VisionAttention, _act, frame_segments, vision_cos_sin


class Qwen3VisionMLP(nn.Module):
    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.act = _act(vc.hidden_act)
        self.linear_fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(vc.hidden_size, eps=1e-6)
        self.attn = VisionAttention(vc)
        self.mlp = Qwen3VisionMLP(vc)

    def forward(self, x: torch.Tensor, rope: Rope, segments: list[tuple[int, int]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchEmbed(nn.Module):
    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        k = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.proj = nn.Conv3d(3, vc.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class Qwen3PatchMerger(nn.Module):
    """``postshuffle`` (the deepstack mergers): the norm over the merge block's 4 patches
    concatenated, else over each patch."""

    def __init__(self, vc: QwenVisionConfig, postshuffle: bool = False) -> None:
        super().__init__()
        self.width = vc.hidden_size * vc.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else vc.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, vc.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def _taps(n: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear interpolation (align_corners) of ``side`` table entries to ``n`` along one
    axis: each target's two source indexes [n, 2] and weights fp32 [n, 2]."""
    src = torch.arange(n, dtype=torch.float32) * (side - 1) / max(n - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grid: tuple[int, int, int], side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's (or video's) patches' taps into the side x side position table and their
    bilinear weights: int64 / fp32 [t x h x w, 4], in the patches' merge-block order."""
    t, h, w = grid
    ht, hw = _taps(h, side)
    wt, ww = _taps(w, side)
    idx = (ht[:, None, :, None] * side + wt[None, :, None, :]).reshape(h, w, 4)
    wts = (hw[:, None, :, None] * ww[None, :, None, :]).reshape(h, w, 4)

    def blocks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(h // merge, merge, w // merge, merge, 4).transpose(1, 2).reshape(-1, 4)

    return blocks(idx).repeat(t, 1), blocks(wts).repeat(t, 1)


class Qwen3VisionTower(nn.Module):
    """transformers' Qwen3VLVisionModel (names kept). ``forward`` gives each merge block's
    row and its k deepstack features side by side: [L / 4, (1 + k) x out_hidden_size]
    (QwenImageEncoder.encode cuts them apart per image)."""

    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.config = vc
        self.patch_embed = Qwen3PatchEmbed(vc)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.side = math.isqrt(vc.num_position_embeddings)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(vc) for _ in range(vc.depth))
        self.merger = Qwen3PatchMerger(vc)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(vc, postshuffle=True)
                                                   for _ in vc.deepstack_visual_indexes)
        # our rotary kernel on CUDA (None; tests force it under the interpreter)
        self.kernels: bool | None = None
        half = vc.hidden_size // vc.num_heads // 2
        # fp32 always (not a buffer: a cast of the module to bf16 would round it)
        self.inv_freq = 1.0 / (vc.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                                              device="cpu") / half))

    def position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned table interpolated to each grid: [L, hidden] in fp32 (transformers'
        fp32 weights times the table's values, summed over the 4 taps)."""
        taps = [position_taps(g, self.side, self.config.spatial_merge_size) for g in grids]
        dev = self.pos_embed.weight.device
        idx = torch.cat([i for i, _ in taps]).to(dev)
        wts = torch.cat([w for _, w in taps]).to(dev)
        return (self.pos_embed(idx) * wts[:, :, None]).sum(1)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [L, patch_dim] of the images ``grids`` in turn -> [L / merge^2, (1 + k) x out]."""
        vc = self.config
        x = self.patch_embed(patches)
        x = x + self.position_embeddings(grids).to(x.dtype)
        cos, sin = vision_cos_sin(grids, vc.spatial_merge_size, self.inv_freq, x.device)
        frames = frame_segments(grids)
        rope = Rope.of(cos, sin, self.kernels if self.kernels is not None else x.is_cuda)
        deep: list[torch.Tensor] = []  # in block order, as transformers appends them
        for i, blk in enumerate(self.blocks):
            x = blk(x, rope, frames)
            if i in vc.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[vc.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)
