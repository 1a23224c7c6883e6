"""GLM-4.1V (Glm4vForConditionalGeneration: GLM-4.1V-9B-Thinking / Base): the image side.

Qwen2-VL's design, served by its machinery (models/qwen2_vl.py QwenImageEncoder: prepare /
encode, the 3-D M-RoPE positions of engine/mrope.py, patches in merge-block order of
models/qwen2_vl_image.py); the config is models/glm4v_config.py's. The text model is GLM-4's
(models/glm.py Glm4ForCausalLM: norms after attention and after the MLP) with M-RoPE on its
interleaved pairs (layers/rotary.MRotaryEmbedding, is_neox False: sections [8, 12, 12] of the
32 rotated pairs of each head's first half). The tower (transformers' Glm4vVisionModel, names
kept):

    patches [L, 3 x 2 x 14 x 14] -> patch_embed (Conv3d with a bias, as one linear)
    -> post_conv_layernorm (RMSNorm) -> + embeddings (a learned side x side table,
       side = image_size / patch_size, sampled bicubically at each patch's centre of the
       image's grid: ``position_embeddings``) -> blocks -> post_layernorm (RMSNorm)
    -> downsample (Conv2d merge x merge, stride merge: each merge block's 4 patches, as one
       linear) -> merger -> rows [L / 4, H]

- each block: Qwen2.5-VL's (models/qwen2_vl.VisionBlock: x + attn(norm1(x)); x + mlp(norm2(x)),
  RMSNorms of ``rms_norm_eps``, q and k by Qwen2-VL's 2-D rotary, full attention within an
  image), its qkv biased only with ``attention_bias``, its proj never, its gated SiLU MLP
  (no biases) ``out_hidden_size`` wide;
- the merger: proj (no bias) -> LayerNorm -> GELU -> a gated MLP of ``intermediate_size``
  (no biases).

The preprocessing is Qwen2-VL's but for the size: Glm4vImageProcessor's smart_resize takes an
image as ``temporal_patch_size`` frames (its pixel bounds halved) and scales a side under 28
pixels up first (models/qwen3_vl_video.smart_resize_video, the same rule). The prompt: the chat
template's ``<|begin_of_image|><|image|><|end_of_image|>``, each ``<|image|>`` made its image's
rows (Glm4vProcessor).

Videos (frames; models/qwen2_vl_video.py reads vLLM's forms; sampled first where
Glm4vVideoProcessor's do_sample_frames is asked: models/glm4v_video.py) as Qwen3-VL's are run: resized
under the whole video's bound, cut into frame groups of temporal_patch_size frames, one
image-like input each (get_rope_index splits video_grid_thw so too). The prompt's
``<|begin_of_video|><|video|><|end_of_video|>`` has its ``<|video|>`` made, per frame group,
``<|begin_of_image|>`` + ``<|image|>`` x rows + ``<|end_of_image|>`` + the group's time in
whole seconds as text (its first frame's index / fps: Glm4vProcessor's timestamps[::2]) --
the frames' rows take the image token, not ``<|video|>``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.config import QwenImageProcessing, QwenVisionConfig
from flashpage.engine.multimodal import MultiModalInput, token_runs
from flashpage.models.qwen2_vl import (
    QwenImage,
    QwenImageEncoder,
    Rope,
    VisionAttention,
    VisionBlock,
    VisionGatedMLP,
    VisionRMSNorm,
    expand_pads,
    frame_segments,
    rotary_positions,
    vision_cos_sin,
)
from flashpage.models.qwen2_vl_image import resize
from flashpage.models.qwen3_vl import Qwen3PatchEmbed
from flashpage.models.qwen3_vl_video import smart_resize_video

_FRAME = -1  # a video frame's rows while a prompt's images are expanded (no token id is negative)


class Glm4vVisionEmbeddings(nn.Module):
    """transformers' Glm4vVisionEmbeddings: the learned position table, sampled per patch."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.position_embedding = nn.Embedding(vc.num_position_embeddings, vc.hidden_size)
        self.side = math.isqrt(vc.num_position_embeddings)

    def forward(self, grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
        """fp32 [L, hidden]: for each patch of ``grids`` in turn (merge-block order), the
        table (a side x side image of hidden channels) sampled bicubically (align_corners
        False, border padding) at the patch's centre, its (row, column) + 0.5 over the
        grid's height and width mapped to [-1, 1]: transformers' grid_sample, in fp32."""
        weight = self.position_embedding.weight
        table = weight.view(self.side, self.side, -1).permute(2, 0, 1)[None].float()
        coords = []
        for t, h, w in grids:
            pos = rotary_positions((t, h, w), merge).to(weight.device)
            coords.append(torch.stack([(pos[:, 1] + 0.5) / w * 2 - 1, (pos[:, 0] + 0.5) / h * 2 - 1], dim=-1))
        where = torch.cat(coords)[None, :, None, :]  # [1, L, 1, (x, y)]
        out = F.grid_sample(table, where, mode="bicubic", align_corners=False, padding_mode="border")
        return out[0, :, :, 0].t()


class Glm4vPatchMerger(VisionGatedMLP):
    """transformers' Glm4vVisionPatchMerger: proj -> LayerNorm -> GELU, then the gated MLP
    (this class's gate_proj / up_proj / down_proj, fused once loaded as the blocks' are)."""

    def __init__(self, vc: Any) -> None:
        super().__init__(vc.out_hidden_size, vc.intermediate_size, vc.hidden_act, bias=False)
        self.proj = nn.Linear(vc.out_hidden_size, vc.out_hidden_size, bias=False)
        self.post_projection_norm = nn.LayerNorm(vc.out_hidden_size)
        self.act1 = nn.GELU()

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        return super().forward(self.act1(self.post_projection_norm(self.proj(x))), fused)


class Glm4vVisionTower(nn.Module):
    """transformers' Glm4vVisionModel (module docstring; names kept)."""

    def __init__(self, vc: Any) -> None:
        super().__init__()
        self.config = vc
        h, eps = vc.hidden_size, vc.rms_norm_eps
        self.patch_embed = Qwen3PatchEmbed(vc)
        self.post_conv_layernorm = VisionRMSNorm(h, eps)
        self.embeddings = Glm4vVisionEmbeddings(vc)
        self.blocks = nn.ModuleList(
            VisionBlock(vc, (VisionRMSNorm(h, eps), VisionRMSNorm(h, eps),
                             VisionAttention(vc, qkv_bias=vc.attention_bias, proj_bias=False),
                             VisionGatedMLP(h, vc.out_hidden_size, vc.hidden_act, bias=False)))
            for _ in range(vc.depth))
        self.post_layernorm = VisionRMSNorm(h, eps)
        m = vc.spatial_merge_size
        self.downsample = nn.Conv2d(h, vc.out_hidden_size, kernel_size=m, stride=m)
        self.merger = Glm4vPatchMerger(vc)
        # our kernels (the 2-D rotary, the RMSNorm with the residual add, SiLU-mul): None =
        # on CUDA (tests force them under the interpreter)
        self.kernels: bool | None = None
        half = h // vc.num_heads // 2
        # fp32 always (not a buffer: a cast of the module to bf16 would round it)
        self.inv_freq = 1.0 / (vc.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                                              device="cpu") / half))

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [L, patch_dim] of the images ``grids`` in turn -> rows [L / merge^2, out]."""
        vc = self.config
        m = vc.spatial_merge_size
        x = self.post_conv_layernorm(self.patch_embed(patches))
        # transformers adds the table's samples cast to its weight's dtype
        x = x + self.embeddings(grids, m).to(self.embeddings.position_embedding.weight.dtype)
        cos, sin = vision_cos_sin(grids, m, self.inv_freq, x.device)
        rope = Rope.of(cos, sin, self.kernels if self.kernels is not None else x.is_cuda)
        frames = frame_segments(grids)
        for blk in self.blocks:
            x = blk(x, rope, frames)
        x = self.post_layernorm(x)
        # the Conv2d over each merge block's m x m patches (consecutive rows, row-major): one
        # linear over their values laid out (channel, row, column) as its kernel is
        c = x.shape[-1]
        w = self.downsample.weight
        x = F.linear(x.view(-1, m * m, c).transpose(1, 2).reshape(-1, c * m * m), w.view(w.shape[0], -1),
                     self.downsample.bias)
        return self.merger(x)


class Glm4vImageEncoder(QwenImageEncoder):
    """GLM-4.1V's images and videos -> the rows of their ``<|image|>`` positions (module
    docstring): QwenImageEncoder with GLM's tower, size rule, placeholders and video prompt."""

    token_name = "<|image|>"
    video_token_name = "<|video|>"

    @property
    def image_bound_frames(self) -> int:  # type: ignore[override]
        """An image is sized as temporal_patch_size frames (Glm4vImageProcessor)."""
        return self.config.temporal_patch_size

    @property
    def video_placeholder_ids(self) -> list[int]:
        """A chat turn's video part in a template that prints text:
        <|begin_of_video|><|video|><|end_of_video|>."""
        vc: Any = self.config
        return [vc.video_start_token_id, vc.video_token_id, vc.video_end_token_id]

    def _resize(self, image: Any, proc: QwenImageProcessing) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Glm4vImageProcessor's size: the image as temporal_patch_size frames under the
        pixel bounds, a side under patch x merge scaled up first."""
        vc = self.config
        tp, unit = vc.temporal_patch_size, vc.patch_size * vc.spatial_merge_size
        return resize(image, proc, vc.patch_size, vc.spatial_merge_size, lambda h, w: smart_resize_video(
            tp, h, w, tp, unit, proc.min_pixels, proc.max_pixels, what="image"))

    def _admit_qwen3_video(self, video: Any, i: int, vc: QwenVisionConfig) -> QwenImage:
        """QwenImageEncoder's, its frames sampled first where Glm4vVideoProcessor is asked to
        (do_sample_frames: its file's, the engine's or the request's mm_processor_kwargs, in
        ``vc``; models/glm4v_video.py)."""
        from flashpage.models.glm4v_config import Glm4vVisionConfig
        from flashpage.models.glm4v_video import sample_video

        if isinstance(vc, Glm4vVisionConfig):
            video = sample_video(video, vc.frame_sampling, i)
        return super()._admit_qwen3_video(video, i, vc)

    def _video_times(self, indices: list[int], fps: float) -> list[float]:
        """Each frame group's time: its first frame's (Glm4vProcessor's timestamps[::2]); the
        prompt writes it in whole seconds."""
        return [j / fps for j in indices[::self.config.temporal_patch_size]]

    def _expand(self, ids: list[int], images: list[QwenImage], vids: list[QwenImage]
                ) -> tuple[list[int], list[MultiModalInput]]:
        """The prompt with each <|video|> made its frame groups (``_video_prompt``), then
        each <|image|> (outside a video) made its image's rows; the inputs: the images and
        every video's frame groups (grid (1, h, w), its frames) at their rows."""
        vc: Any = self.config
        img = vc.image_token_id
        groups: list[QwenImage] = []
        if vids:
            ids = self._video_prompt(ids, vids)
            tp = vc.temporal_patch_size
            groups = [QwenImage(None, (1, v.grid[1], v.grid[2]), v.pixels[g * tp:(g + 1) * tp], video=True)
                      for v in vids if v.pixels is not None for g in range(v.grid[0])]
        elif vc.video_token_id in ids:
            raise ValueError(f"the prompt has {ids.count(vc.video_token_id)} video token(s) (<|video|>, id "
                             f"{vc.video_token_id}) but 0 video(s) were given")
        ids, starts = expand_pads(ids, {img: [self.num_rows(p) for p in images]}, {img: ("image", "<|image|>")},
                                  ("<|begin_of_image|>", "<|end_of_image|>"))
        frames = [s for s, _ in token_runs(ids, _FRAME)]
        out = [self.input_at(s, p) for s, p in zip(starts[img] + frames, images + groups, strict=True)]
        return [img if t == _FRAME else t for t in ids], sorted(out, key=lambda mi: mi.offset)

    def _video_prompt(self, ids: list[int], vids: list[QwenImage]) -> list[int]:
        """``ids`` with video i's <|video|> made its frame groups (module docstring), their
        rows marked _FRAME; a prompt whose videos are written out already (each
        <|begin_of_video|> ... <|end_of_video|> holding its groups' runs of <|image|>, of
        their rows) has those runs marked. A ValueError names a count that does not match."""
        vc: Any = self.config
        img, vid = vc.image_token_id, vc.video_token_id
        m2 = vc.spatial_merge_size ** 2
        rows = [v.grid[1] * v.grid[2] // m2 for v in vids for _ in range(v.grid[0])]
        n = ids.count(vid)
        if n == 0:  # written out already?
            inside, depth = [], 0
            for t in ids:
                depth += (t == vc.video_start_token_id) - (t == vc.video_end_token_id)
                inside.append(depth > 0)
            marked = [_FRAME if t == img and inside[j] else t for j, t in enumerate(ids)]
            if rows and [n for _, n in token_runs(marked, _FRAME)] == rows:
                return marked
        if n != len(vids):
            raise ValueError(f"the prompt has {n} video token(s) (<|video|>, id {vid}) but {len(vids)} "
                             "video(s) were given: put one <|begin_of_video|><|video|><|end_of_video|> "
                             "in the prompt per video")
        if self.tokenize is None:
            raise ValueError("GLM-4.1V video input needs the model's tokenizer (each frame group's "
                             "time is text in the prompt)")
        out: list[int] = []
        it = iter(vids)
        for t in ids:
            if t != vid:
                out.append(t)
                continue
            v = next(it)
            per = v.grid[1] * v.grid[2] // m2
            for s in v.timestamps or ():
                out += [vc.vision_start_token_id, *[_FRAME] * per, vc.vision_end_token_id,
                        *self.tokenize(str(int(s)))]
        return out

    def fuse(self) -> None:
        """QwenImageEncoder's (the blocks' gated MLPs), and the merger's."""
        super().fuse()
        merger = self.visual.merger
        assert isinstance(merger, Glm4vPatchMerger)
        merger.fuse()

    def _patch_bytes(self, inter: int) -> int:
        """QwenImageEncoder's with the blocks' MLP out_hidden_size wide, and per patch a
        quarter of the merger's row (its proj, norm, gated MLP) and the position table's
        fp32 samples."""
        vc = self.config
        b = self.visual.patch_embed.proj.weight.element_size()
        merger = (4 * vc.out_hidden_size + 3 * vc.intermediate_size) * b // vc.spatial_merge_size ** 2
        return super()._patch_bytes(vc.out_hidden_size) + merger + 2 * vc.hidden_size * 4


def load_image_encoder(source: Any, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Glm4vImageEncoder:
    """``source``'s GLM-4.1V image encoder in ``dtype`` on ``device``: its checkpoint's
    ``model.visual.`` / ``visual.`` tensors, or random ones (a random_config source)."""
    from flashpage.models.multimodal import build_image_encoder
    from flashpage.models.qwen2_vl import IMAGE_PREFIXES

    vc = source.config.vision
    enc = build_image_encoder(source, dtype, device, seed, lambda: Glm4vImageEncoder(vc), IMAGE_PREFIXES)
    enc.fuse()
    return enc.eval()
