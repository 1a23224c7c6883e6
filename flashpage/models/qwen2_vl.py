"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration,
Qwen2_5_VLForConditionalGeneration): the image side.

The text model is Qwen2 (models/llama.py, served as any multimodal checkpoint's text model:
models/multimodal.py) with M-RoPE (layers/rotary.MRotaryEmbedding, engine/mrope.py): an
image's rows take 3-D (t, h, w) positions. Beside it the engine keeps a ``QwenImageEncoder``:

    patches [L, 3 x T x 14 x 14] (models/qwen2_vl_image.py; L: all the batch's images')
    -> patch_embed (the Conv3d as one linear) -> blocks -> merger -> rows [L / 4, H]

- each block: x + attn(norm1(x)); x + mlp(norm2(x)). Qwen2-VL: LayerNorm, fc1 -> act ->
  fc2 (quick_gelu); Qwen2.5-VL: RMSNorm, down(act(gate) * up) with biases (silu);
- attention: bidirectional within one image (never across the batch's images), q and k
  rotated by the 2-D rotary of each patch's (row, column): the first half of the rotated
  pairs by the row, the second by the column; Qwen2.5-VL attends within windows of
  window_size pixels (window_size / 28 merged units square) but in
  ``fullatt_block_indexes``: its tokens are put in window order first (whole merge blocks
  moved, each window's contiguous) and the merger's rows put back after;
- the merger: each merge block's 4 patches (consecutive rows) normed, concatenated ->
  Linear -> GELU -> Linear to the text model's width. Rows in (row, column) order of the
  image's merged grid, which its 3-D positions follow.

Attention runs torch's scaled_dot_product_attention once per distinct segment length (the
images of one size, the windows of one size): exact (no masks, no padding), a few calls per
block.

Videos (``multi_modal_data["video"]``: models/qwen2_vl_video.py reads vLLM's forms) are
grids with t > 1: each run of temporal_patch_size frames one step of t, their patches laid out
frame group by frame group, full attention within each frame group (as transformers'
cu_seqlens), so ``encode`` may cut a long video between frame groups into several tower
calls; their rows go to <|video_pad|> positions, whose 3-D positions engine/mrope.py gives
(Qwen2.5-VL's temporal component scaled by the video's frame rate).

Weights: ``visual.`` (the published files) or ``model.visual.`` (transformers 5), HF's
names (``visual.blocks.{i}.attn.qkv.weight``, ``visual.merger.mlp.0.weight`` ...).
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.config import QwenImageProcessing, QwenVisionConfig
from flashpage.engine.multimodal import MultiModalInput, token_runs, video_items
from flashpage.engine.prompt_embeds import digest
from flashpage.models.clip_image import is_pil_image
from flashpage.models.multimodal import to_device
from flashpage.models.qwen2_vl_image import normalize, resize, resize_video
from flashpage.models.qwen2_vl_video import DEFAULT_FPS, read_video

if TYPE_CHECKING:
    from flashpage.models.glm4v import Glm4vVisionTower
    from flashpage.models.loader import ModelSource
    from flashpage.models.qwen3_vl import Qwen3VisionTower

logger = logging.getLogger(__name__)

_PREFIXES = (("model.visual.", "visual."), ("visual.", "visual."))
IMAGE_PREFIXES = tuple(p for p, _ in _PREFIXES)


@dataclass(eq=False)
class QwenImage:
    """One preprocessed image (or video: ``video``): its patch grid (t, h, w) and either its patches fp32
    [t x h x w, patch_dim] (``pixel_values``'s) or, as the engine keeps a request's, its
    pixels uint8 [3, h x patch, w x patch] at the size smart_resize chose, normalized and cut
    into patches on the device by ``encode`` (models/qwen2_vl_image.py)."""

    patches: torch.Tensor | None
    grid: tuple[int, int, int]
    pixels: torch.Tensor | None = None
    # a video's (its <|video_pad|> rows; pixels uint8 [T, 3, h x patch, w x patch]): its
    # temporal M-RoPE step (Qwen2.5-VL's; None: the grid index, engine/mrope.py)
    video: bool = False
    time_step: float | None = None
    # a Qwen3-VL video's frame groups' times in seconds (models/qwen3_vl_video.py: the prompt
    # writes them as text before each group)
    timestamps: tuple[float, ...] | None = None


def _act(name: str) -> nn.Module:
    if name == "quick_gelu":
        from flashpage.models.clip_vision import QuickGELU

        return QuickGELU()
    if name == "silu":
        return nn.SiLU()
    return nn.GELU(approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


class VisionRMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm (fp32 math, the weight applied in the input's dtype)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(vc: QwenVisionConfig, dim: int) -> nn.Module:
    return VisionRMSNorm(dim) if vc.variant == "qwen2_5_vl" else nn.LayerNorm(dim, eps=1e-6)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      segments: list[tuple[int, int]]) -> torch.Tensor:
    """q, k, v [L, H, D] -> [L, H, D]: full attention within each segment (start, length)
    (the segments cover [0, L)), one SDPA call per distinct length."""
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = defaultdict(list)
    for s, n in segments:
        by_len[n].append(s)
    for n, starts in by_len.items():
        if len(starts) == 1:
            s = starts[0]
            o = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1), k[s:s + n].transpose(0, 1),
                                               v[s:s + n].transpose(0, 1))
            out[s:s + n] = o.transpose(0, 1)
            continue
        # the starts through pinned memory: a pageable copy would wait for the queued work,
        # in every layer of the tower
        idx = (to_device(torch.tensor(starts), q.device)[:, None]
               + torch.arange(n, device=q.device)[None, :]).reshape(-1)
        m = len(starts)
        qs, ks, vs = (x[idx].view(m, n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)  # [m, H, n, D]
        out[idx] = o.transpose(1, 2).reshape(m * n, *q.shape[1:])
    return out


@dataclass
class Rope:
    """The tower's 2-D rotary for one call's patches (in the blocks' token order): fp32 cos
    and sin [L, head_dim] (rotate_half's layout); on CUDA also the rotary kernel's per-token
    table [L, head_dim] (cos then sin of the head_dim / 2 angles) and its row index 0..L-1."""

    cos: torch.Tensor
    sin: torch.Tensor
    table: torch.Tensor | None = None
    index: torch.Tensor | None = None

    @staticmethod
    def of(cos: torch.Tensor, sin: torch.Tensor, kernels: bool) -> Rope:
        """The tables, with the rotary kernel's where it runs (``kernels``: on CUDA)."""
        rope = Rope(cos, sin)
        if kernels:
            half = cos.shape[1] // 2
            rope.table = torch.cat([cos[:, :half], sin[:, :half]], dim=1).contiguous()
            rope.index = torch.arange(cos.shape[0], device=cos.device)
        return rope


def frame_segments(grids: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The patches of ``grids`` in turn cut where attention stops: (start, length) of each
    image, or each grid step t of a video (transformers' cu_seqlens: h x w repeated t times)."""
    out = []
    at = 0
    for t, h, w in grids:
        for _ in range(t):
            out.append((at, h * w))
            at += h * w
    return out


class VisionAttention(nn.Module):
    """``qkv_bias`` / ``proj_bias``: whether the projections have biases (Qwen's both;
    GLM-4.1V's per its config / never)."""

    def __init__(self, vc: QwenVisionConfig, qkv_bias: bool = True, proj_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = vc.num_heads
        self.qkv = nn.Linear(vc.hidden_size, 3 * vc.hidden_size, bias=qkv_bias)
        self.proj = nn.Linear(vc.hidden_size, vc.hidden_size, bias=proj_bias)

    def forward(self, x: torch.Tensor, rope: Rope, segments: list[tuple[int, int]]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)
        if rope.table is not None and rope.index is not None:  # CUDA: our rotary kernel, in place,
            from flashpage.kernels.rotary import apply_rotary  # fp32 math (kernels/rotary.py)

            apply_rotary(rope.index, q, k, rope.table)
        else:
            c, s = rope.cos[:, None], rope.sin[:, None]  # fp32 [L, 1, D]
            q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
            k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        return self.proj(segment_attention(q, k, v, segments).reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL's: fc1 -> act -> fc2."""

    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.act = _act(vc.hidden_act)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), each with a bias (GLM-4.1V's without:
    ``bias``), ``dim`` -> ``inter`` -> ``dim``."""

    def __init__(self, dim: int, inter: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=bias)
        self.up_proj = nn.Linear(dim, inter, bias=bias)
        self.down_proj = nn.Linear(inter, dim, bias=bias)
        self.act = _act(act)

        # set by fuse(): gate and up as one GEMM of a width padded to a multiple of 64
        self.gate_up_proj: nn.Linear | None = None

    @torch.no_grad()
    def fuse(self, multiple: int = 64) -> None:
        """After loading: gate_proj and up_proj as one linear, each half padded with zero rows
        to a multiple of ``multiple`` (down_proj with zero columns). Qwen2.5-VL's 3,420 is no
        multiple of 8: cuBLAS ran its sm80 kernels on those rows' GEMMs (run 230: 44% of the
        tower's time); the padded rows give silu(0) * 0 = 0, and zero columns add nothing."""
        i = self.gate_proj.out_features
        pad = -i % multiple
        w = torch.cat([F.pad(self.gate_proj.weight, (0, 0, 0, pad)), F.pad(self.up_proj.weight, (0, 0, 0, pad))])
        bias = self.gate_proj.bias is not None
        gate_up = nn.Linear(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
        gate_up.weight.copy_(w)
        if bias:
            gate_up.bias.copy_(torch.cat([F.pad(self.gate_proj.bias, (0, pad)), F.pad(self.up_proj.bias, (0, pad))]))
        self.gate_up_proj = gate_up
        down = nn.Linear(i + pad, self.down_proj.out_features, bias=bias, device=w.device, dtype=w.dtype)
        down.weight.copy_(F.pad(self.down_proj.weight, (0, pad)))
        if bias:
            down.bias.copy_(self.down_proj.bias)
        self.down_proj = down
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        y = self.gate_up_proj(x)
        if fused and isinstance(self.act, nn.SiLU):
            from flashpage.kernels.silu_mul import silu_and_mul

            return self.down_proj(silu_and_mul(y))
        gate, up = y.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    """``parts``: (norm1, norm2, attn, mlp) built by another family (GLM-4.1V's,
    models/glm4v.py), else the variant's."""

    def __init__(self, vc: QwenVisionConfig,
                 parts: tuple[nn.Module, nn.Module, VisionAttention, nn.Module] | None = None) -> None:
        super().__init__()
        if parts is None:
            mlp: nn.Module = VisionGatedMLP(vc.hidden_size, vc.intermediate_size, vc.hidden_act) \
                if vc.variant == "qwen2_5_vl" else VisionMLP(vc)
            parts = (_norm(vc, vc.hidden_size), _norm(vc, vc.hidden_size), VisionAttention(vc), mlp)
        self.norm1, self.norm2, self.attn, self.mlp = parts

    def forward(self, x: torch.Tensor, rope: Rope, segments: list[tuple[int, int]]) -> torch.Tensor:
        if rope.table is None or not isinstance(self.norm1, VisionRMSNorm):
            x = x + self.attn(self.norm1(x), rope, segments)
            return x + self.mlp(self.norm2(x))
        # our kernels (kernels/rms_norm.py: the residual add fused into the second norm; the
        # MLP's SiLU-mul, kernels/silu_mul.py), one rounding where transformers rounds twice
        from flashpage.kernels.rms_norm import rms_norm

        n1, n2 = self.norm1, self.norm2
        assert isinstance(n2, VisionRMSNorm)
        a = self.attn(rms_norm(x, n1.weight, n1.eps), rope, segments)
        h, x = rms_norm(a, n2.weight, n2.eps, residual=x)  # type: ignore[misc]
        return x + self.mlp(h, fused=True)


class PatchEmbed(nn.Module):
    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        k = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        # the checkpoint's Conv3d (its weight's name and shape); run as one linear: the
        # kernel covers each patch exactly (stride = kernel)
        self.proj = nn.Conv3d(3, vc.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.view(w.shape[0], -1))


class PatchMerger(nn.Module):
    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.width = vc.hidden_size * vc.spatial_merge_size ** 2
        self.ln_q = _norm(vc, vc.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(),
                                 nn.Linear(self.width, vc.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def rotary_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """Each patch's (row, column) in the patches' merge-block order: int64 [t x h x w, 2]."""
    t, h, w = grid
    hp = torch.arange(h)[:, None].expand(h, w)
    wp = torch.arange(w)[None, :].expand(h, w)

    def blocks(p: torch.Tensor) -> torch.Tensor:
        return p.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).reshape(-1)

    return torch.stack([blocks(hp), blocks(wp)], dim=-1).repeat(t, 1)


def vision_cos_sin(grids: list[tuple[int, int, int]], merge: int, inv_freq: torch.Tensor,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's 2-D rotary for patches of ``grids`` in turn (merge-block order): fp32
    [L, head_dim] cos and sin, row angles on the first quarter of the pairs' columns, column
    angles on the second, both halves alike (rotate_half's layout)."""
    pos = torch.cat([rotary_positions(g, merge) for g in grids]).to(device)
    freqs = pos[..., None].float() * inv_freq.to(device)  # [L, 2, head / 4]
    f = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos(), emb.sin()


def window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows over one image's merged grid (t, h / merge, w / merge) of
    ``window`` merged units square, tiled from the top left (the last row / column of
    windows cut short): (its merge blocks' indexes in window order, row-major within a
    window and over windows, frame by frame; each window's merge-block count)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    index = torch.arange(t * h * w).view(t, h, w)
    order: list[torch.Tensor] = []
    sizes: list[int] = []
    for f in range(t):
        for r in range(0, h, window):
            for c in range(0, w, window):
                blk = index[f, r:r + window, c:c + window].reshape(-1)
                order.append(blk)
                sizes.append(blk.numel())
    return torch.cat(order), sizes


class VisionTower(nn.Module):
    """transformers' Qwen2VisionTransformerPretrainedModel /
    Qwen2_5_VisionTransformerPretrainedModel (names kept)."""

    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.config = vc
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc.depth))
        self.merger = PatchMerger(vc)
        # our kernels (the 2-D rotary; Qwen2.5-VL's RMSNorm with the residual add and
        # SiLU-mul): None = on CUDA (tests force them under the interpreter)
        self.kernels: bool | None = None
        half = vc.hidden_size // vc.num_heads // 2
        # fp32 always (not a buffer: a cast of the module to bf16 would round it)
        self.inv_freq = 1.0 / (vc.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                                              device="cpu") / half))

    def _cos_sin(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return vision_cos_sin(grids, self.config.spatial_merge_size, self.inv_freq,
                              self.patch_embed.proj.weight.device)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [L, patch_dim] of the images ``grids`` in turn -> rows [L / merge^2, out]."""
        vc = self.config
        unit = vc.spatial_merge_size ** 2
        x = self.patch_embed(patches)
        cos, sin = self._cos_sin(grids)
        sizes = [t * h * w for t, h, w in grids]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        # full attention within one frame group: an image, or one grid step t of a video
        images = frame_segments(grids)
        windowed = vc.variant == "qwen2_5_vl" and len(vc.fullatt_block_indexes) < vc.depth
        back: torch.Tensor | None = None
        windows: list[tuple[int, int]] = images
        if windowed:
            per_window = vc.window_size // vc.spatial_merge_size // vc.patch_size
            order, windows = [], []
            at = 0
            for s, g in zip(starts, grids, strict=True):
                idx, counts = window_order(g, vc.spatial_merge_size, per_window)
                order.append(idx + s // unit)
                for c in counts:
                    windows.append((at, c * unit))
                    at += c * unit
            blocks = torch.cat(order).to(x.device)

            def permute(y: torch.Tensor) -> torch.Tensor:
                return y.view(-1, unit, y.shape[-1])[blocks].reshape(y.shape)

            x, cos, sin = permute(x), permute(cos), permute(sin)
            back = torch.argsort(blocks)
        rope = Rope.of(cos, sin, self.kernels if self.kernels is not None else x.is_cuda)
        for i, blk in enumerate(self.blocks):
            full = not windowed or i in vc.fullatt_block_indexes
            x = blk(x, rope, images if full else windows)
        rows = self.merger(x)
        return rows[back] if back is not None else rows


class QwenImageEncoder(nn.Module):
    """Images -> the rows of their ``<|image_pad|>`` positions (module docstring)."""

    def __init__(self, vc: QwenVisionConfig) -> None:
        super().__init__()
        self.config = vc
        self.visual: VisionTower | Qwen3VisionTower | Glm4vVisionTower
        if vc.variant == "qwen3_vl":
            from flashpage.models.qwen3_vl import Qwen3VisionTower

            self.visual = Qwen3VisionTower(vc)
        elif vc.variant == "glm4v":
            from flashpage.models.glm4v import Glm4vVisionTower

            self.visual = Glm4vVisionTower(vc)
        else:
            self.visual = VisionTower(vc)
        # the most rows one tower call takes (activation_bytes: what the engine reserved)
        self.call_rows: int | None = None
        # text -> the model tokenizer's ids, without special tokens (the engine sets it): a
        # Qwen3-VL video's frame timestamps are text in its prompt
        self.tokenize: Callable[[str], list[int]] | None = None

    @property
    def placeholder_ids(self) -> list[int]:
        """What a chat turn's image part becomes in a template that prints text:
        <|vision_start|><|image_pad|><|vision_end|> (the template's own part otherwise)."""
        vc = self.config
        return [vc.vision_start_token_id, vc.image_token_id, vc.vision_end_token_id]

    @property
    def video_placeholder_ids(self) -> list[int]:
        """A chat turn's video part in a template that prints text:
        <|vision_start|><|video_pad|><|vision_end|>."""
        vc = self.config
        return [vc.vision_start_token_id, vc.video_token_id, vc.vision_end_token_id]

    def num_rows(self, image: QwenImage) -> int:
        """The rows (and so the prompt positions) of a preprocessed image."""
        t, h, w = image.grid
        return t * h * w // self.config.spatial_merge_size ** 2

    def prepare(self, ids: list[int], data: Any, vision: QwenVisionConfig | None = None
                ) -> tuple[list[int], list[MultiModalInput]]:
        """The engine's multimodal hook at admission (engine/multimodal.py): a request's
        ``multi_modal_data`` ({"image": a PIL image, a uint8 [3, H, W] tensor, or a list of
        them; "video": vLLM's forms, models/qwen2_vl_video.py}) checked and preprocessed, and
        its prompt's ids with each <|image_pad|> / <|video_pad|> made its item's rows' count,
        images and videos in the prompt's order; a ValueError names what is wrong.
        ``vision``: the request's own processing settings (its mm_processor_kwargs,
        config.request_mm_processing: pixel bounds and fps; None: the engine's); the
        tower's weights and the rest of the preprocessing are the engine's either way."""
        images, vids = self._admit(data, vision)
        return self._expand(ids, images, vids)

    def _admit(self, data: Any, vision: QwenVisionConfig | None) -> tuple[list[QwenImage], list[QwenImage]]:
        """``prepare``'s items: multi_modal_data checked, its images and videos admitted."""
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{\"image\": image}}, "
                             f"got {type(data).__name__}")
        unknown = sorted(set(data) - {"image", "video"})
        if unknown:
            raise ValueError(f"multi_modal_data {unknown}: this model takes \"image\" and \"video\"")
        if "image" not in data and "video" not in data:
            raise ValueError("multi_modal_data has no \"image\" nor \"video\"")
        pix: list[QwenImage] = []
        if "image" in data:
            given = data["image"]
            images = list(given) if isinstance(given, (list, tuple)) else [given]
            if not images:
                raise ValueError("multi_modal_data[\"image\"] is an empty list")
            pix = [self.admit_image(img, i, vision) for i, img in enumerate(images)]
        vids = [self.admit_video(v, i, vision) for i, v in enumerate(video_items(data["video"]))] \
            if "video" in data else []
        return pix, vids

    def _expand(self, ids: list[int], images: list[QwenImage], vids: list[QwenImage]
                ) -> tuple[list[int], list[MultiModalInput]]:
        """``prepare``'s prompt: each <|image_pad|> / <|video_pad|> made its item's rows
        (Qwen3-VL's videos: their frame groups with their timestamps), and the inputs."""
        vc = self.config
        if vids and vc.variant == "qwen3_vl":  # one input per frame group, its timestamp text before it
            ids, vids = self._qwen3_videos(ids, vids)
        counts = {vc.image_token_id: [self.num_rows(p) for p in images],
                  vc.video_token_id: [self.num_rows(v) for v in vids]}
        ids, starts = expand_pads(ids, counts, {vc.image_token_id: ("image", "<|image_pad|>"),
                                                vc.video_token_id: ("video", "<|video_pad|>")})
        offsets = starts[vc.image_token_id] + starts[vc.video_token_id]
        out = [self.input_at(s, p) for s, p in zip(offsets, images + vids, strict=True)]
        return ids, sorted(out, key=lambda mi: mi.offset)

    def input_at(self, offset: int, item: QwenImage) -> MultiModalInput:
        """An admitted image (video, frame group) as the input whose rows start at ``offset``:
        its merged grid, digest and temporal step."""
        m = self.config.spatial_merge_size
        return MultiModalInput(offset, self.num_rows(item), _digest(item), item,
                               grid=(item.grid[0], item.grid[1] // m, item.grid[2] // m), time_step=item.time_step)

    def _qwen3_videos(self, ids: list[int], vids: list[QwenImage]) -> tuple[list[int], list[QwenImage]]:
        """Qwen3-VL: the prompt with each video's frame groups and timestamps written out
        (models/qwen3_vl_video.video_prompt), and each video cut into its frame groups, one
        image-like input of one temporal step each (grid (1, h, w), its frames)."""
        from flashpage.models.qwen3_vl_video import video_prompt

        vc = self.config
        if self.tokenize is None:
            raise ValueError("Qwen3-VL video input needs the model's tokenizer (each frame group's "
                             "timestamp is text in the prompt)")
        m2, tp = vc.spatial_merge_size ** 2, vc.temporal_patch_size
        ids = video_prompt(ids, [(list(v.timestamps or ()), v.grid[1] * v.grid[2] // m2) for v in vids],
                           vc.video_token_id, vc.vision_start_token_id, vc.vision_end_token_id, self.tokenize)
        groups = [QwenImage(None, (1, v.grid[1], v.grid[2]), v.pixels[g * tp:(g + 1) * tp], video=True)
                  for v in vids if v.pixels is not None for g in range(v.grid[0])]
        return ids, groups

    def admit_video(self, video: Any, i: int = 0, vision: QwenVisionConfig | None = None) -> QwenImage:
        """What a request keeps of a video (vLLM's forms, models/qwen2_vl_video.py): its
        frames resized under the video processor's bounds and padded to whole temporal
        patches (uint8 [T', 3, h, w]), its grid (T' / temporal_patch_size, h / patch, w /
        patch) and, for Qwen2.5-VL, its temporal position step; the rest on the device.
        ``vision``: the request's bounds and fps (``prepare``), else the engine's."""
        vc = vision or self.config
        if isinstance(video, QwenImage):  # admitted already (its resized frames): checked
            t, h, w = video.grid
            ps, tp, x = vc.patch_size, vc.temporal_patch_size, video.pixels
            if (not video.video or h % vc.spatial_merge_size or w % vc.spatial_merge_size
                    or not isinstance(x, torch.Tensor) or x.dtype != torch.uint8
                    or tuple(x.shape) != (t * tp, 3, h * ps, w * ps)
                    or (self.timestamped and len(video.timestamps or ()) != t)):
                raise ValueError(f"video {i}: a QwenImage video must hold uint8 frames [t x {tp}, 3, "
                                 f"h x {ps}, w x {ps}] of its grid (Qwen3-VL, GLM-4.1V: and t timestamps)")
            return video
        if self.timestamped:
            return self._admit_qwen3_video(video, i, vc)
        frames, fps = read_video(video, i)
        try:
            pixels, grid = resize_video(frames, vc.video_processing or vc.processing, vc.patch_size,
                                        vc.spatial_merge_size, vc.temporal_patch_size)
        except ValueError as e:  # an aspect ratio over 200
            raise ValueError(f"video {i} could not be read: {e}") from e
        step = None
        if vc.variant == "qwen2_5_vl":  # transformers' second_per_grid_ts x tokens_per_second
            rate = fps if fps is not None else vc.video_fps if vc.video_fps is not None else DEFAULT_FPS
            step = vc.tokens_per_second * (vc.temporal_patch_size / rate)
        return QwenImage(None, grid, pixels, video=True, time_step=step)

    @property
    def timestamped(self) -> bool:
        """Whether a video is cut into frame groups with their times written in the prompt
        (Qwen3-VL's; GLM-4.1V's): its frames resized under the whole video's bound."""
        return self.config.variant in ("qwen3_vl", "glm4v")

    def _video_times(self, indices: list[int], fps: float) -> list[float]:
        """A video's frame groups' times in seconds, its frames ``indices`` of a video at
        ``fps`` (Qwen3-VL's: each group's mean; models/qwen3_vl_video.py)."""
        from flashpage.models import qwen3_vl_video as q3

        return q3.timestamps(indices, fps, self.config.temporal_patch_size)

    def _admit_qwen3_video(self, video: Any, i: int, vc: QwenVisionConfig) -> QwenImage:
        """A Qwen3-VL (or GLM-4.1V) video (models/qwen3_vl_video.py): its frames as given,
        resized under the whole video's pixel bounds, and its frame groups' timestamps."""
        from flashpage.models import qwen3_vl_video as q3

        meta = None
        if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], dict):
            video, meta = video
        frames, _ = read_video(video, i)
        fps, indices = q3.video_metadata(meta, frames.shape[0], i)
        rate = fps if fps is not None else vc.video_fps if vc.video_fps is not None else q3.DEFAULT_FPS
        try:
            pixels, grid = q3.resize_video(frames, vc.video_processing or vc.processing, vc.patch_size,
                                           vc.spatial_merge_size, vc.temporal_patch_size)
        except ValueError as e:  # too few frames, an aspect ratio over 200
            raise ValueError(f"video {i} could not be read: {e}") from e
        times = self._video_times(indices if indices is not None else list(range(frames.shape[0])), rate)
        return QwenImage(None, grid, pixels, video=True, timestamps=tuple(times))

    def video_values(self, video: Any, i: int = 0) -> QwenImage:
        """A video preprocessed whole on the host: its patches fp32 [t x h x w, patch_dim]
        (what transformers' pixel_values_videos holds), grid and time step."""
        v = self.admit_video(video, i)
        assert v.pixels is not None
        return QwenImage(self._patches(v.pixels, True), v.grid, video=True, time_step=v.time_step,
                         timestamps=v.timestamps)

    def pixel_values(self, image: Any, i: int = 0, resized_only: bool = False,
                     vision: QwenVisionConfig | None = None) -> QwenImage:
        """One image preprocessed on the host (models/qwen2_vl_image.py): a PIL image, a
        uint8 [3, H, W] tensor, or a QwenImage already made (checked). ``resized_only``
        (what ``prepare`` keeps): its uint8 pixels at the resized size, the rest of the
        preprocessing left to ``encode`` on the device. ``vision``: the request's pixel
        bounds (``prepare``), else the engine's."""
        vc = self.config
        if isinstance(image, QwenImage) and image.patches is None:  # resized pixels (admit_image's)
            t, h, w = image.grid
            m, ps = vc.spatial_merge_size, vc.patch_size
            x = image.pixels
            if (t != 1 or h % m or w % m or not isinstance(x, torch.Tensor) or x.dtype != torch.uint8
                    or tuple(x.shape) != (3, h * ps, w * ps)):
                raise ValueError(f"image {i}: a QwenImage without patches must hold uint8 pixels "
                                 f"[3, h x {ps}, w x {ps}] of its grid, h and w multiples of {m}")
            return image if resized_only else QwenImage(self._patches(x), image.grid)
        if isinstance(image, QwenImage):
            t, h, w = image.grid
            m = vc.spatial_merge_size
            p = image.patches
            if (t != 1 or h % m or w % m or not isinstance(p, torch.Tensor)
                    or tuple(p.shape) != (t * h * w, vc.patch_dim) or not p.is_floating_point()):
                raise ValueError(f"image {i}: a QwenImage must hold float patches [h x w, "
                                 f"{vc.patch_dim}] of one frame, h and w multiples of {m}")
            return QwenImage(p, image.grid)
        if is_pil_image(image) or (isinstance(image, torch.Tensor) and image.dtype == torch.uint8
                                   and image.dim() == 3 and image.shape[0] == 3):
            try:
                pixels, grid = self._resize(image, (vision or vc).processing)
            except (OSError, ValueError) as e:  # a truncated file, an aspect ratio over 200
                raise ValueError(f"image {i} could not be read: {e}") from e
            if resized_only:
                return QwenImage(None, grid, pixels.contiguous())
            return QwenImage(self._patches(pixels), grid)
        if isinstance(image, torch.Tensor):
            raise ValueError(f"image {i}: a tensor image must be uint8 RGB [3, H, W] (it is "
                             f"preprocessed here), got {str(image.dtype).replace('torch.', '')} "
                             f"{list(image.shape)}")
        raise ValueError(f"image {i} is a {type(image).__name__}: give a PIL.Image.Image or a "
                         "uint8 [3, H, W] tensor")

    def _resize(self, image: Any, proc: QwenImageProcessing) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """An image -> (its uint8 pixels at the processor's size, its grid): smart_resize's
        (models/qwen2_vl_image.py; GLM-4.1V's encoder bounds it as two frames)."""
        return resize(image, proc, self.config.patch_size, self.config.spatial_merge_size)

    def fuse(self) -> None:
        """After loading (load_weights reads the checkpoint's own names): the gated MLPs'
        GEMMs fused and aligned (VisionGatedMLP.fuse)."""
        for blk in self.visual.blocks:
            if isinstance(blk.mlp, VisionGatedMLP):
                blk.mlp.fuse()

    def activation_bytes(self, rows: int) -> int:
        """The most an encode call of ``rows`` rows (or one image, or one video frame
        group, at max_pixels, if more) adds while it runs: per patch its stream, the fp32
        norm, the attention's and the MLP's intermediates (a generous sum: they are freed in
        turn), the rotary tables and the patches in fp32. ``encode`` keeps its tower calls
        within the rows asked here (the engine's reservation: a long video is encoded a few
        frame groups a call)."""
        vc = self.config
        unit = vc.patch_size * vc.spatial_merge_size
        video = vc.video_processing or vc.processing
        video_rows = video.max_pixels // unit ** 2
        if self.timestamped:  # its bound is the whole video's: a frame group holds 1 / 2 of it at most
            video_rows //= vc.temporal_patch_size
        rows = max(rows, vc.processing.max_pixels // self.image_bound_frames // unit ** 2, video_rows)
        self.call_rows = rows
        return rows * vc.spatial_merge_size ** 2 * self._patch_bytes(vc.intermediate_size)

    # how many frames an image counts as under the image processor's pixel bounds (GLM-4.1V's:
    # temporal_patch_size)
    image_bound_frames = 1

    def _patch_bytes(self, inter: int) -> int:
        """``activation_bytes``' bytes per patch, the blocks' MLP ``inter`` wide."""
        vc = self.config
        b = self.visual.patch_embed.proj.weight.element_size()
        h, i = vc.hidden_size, inter + (-inter % 64)
        per = (8 * h + 4 * i) * b + 2 * h * 4 + 3 * (h // vc.num_heads) * 4 + 2 * vc.patch_dim * 4
        # Qwen3-VL: the deepstack mergers' outputs, kept to the end of the call (per row)
        deep = len(vc.deepstack_visual_indexes) * 2 * vc.out_hidden_size * b // vc.spatial_merge_size ** 2
        return per + deep

    def admit_image(self, image: Any, i: int = 0, vision: QwenVisionConfig | None = None) -> QwenImage:
        """What a request keeps of an image (the server prepares it on a worker thread):
        its resized uint8 pixels, the rest done on the device (``pixel_values``);
        ``vision``: the request's pixel bounds, else the engine's."""
        return self.pixel_values(image, i, resized_only=True, vision=vision)

    @torch.inference_mode()
    def encode(self, data: list[QwenImage]) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
        """The engine's multimodal hook: the images' and videos' rows [num_rows, H] on the
        device (Qwen3-VL: with their deepstack features [num_rows, k, H], models/qwen3_vl.py), in tower passes of at most ``call_rows`` rows (None: one pass; a video cut
        between frame groups, which attend only within themselves, so the cut changes
        nothing; an image or a frame group is never cut), attention kept within each image
        and each video frame group."""
        w = self.visual.patch_embed.proj.weight
        m2 = self.config.spatial_merge_size ** 2
        # pieces: (input, its patches [n, patch_dim], grid), a video's a few frame groups each
        pieces: list[tuple[int, torch.Tensor, tuple[int, int, int]]] = []
        limit = self.call_rows
        for k, d in enumerate(data):
            # pinned copies: a pageable one waits for the stream's queued work first
            p = to_device(d.patches, w.device) if d.patches is not None \
                else self._patches(to_device(d.pixels, w.device), d.video)  # type: ignore[arg-type]
            t, gh, gw = d.grid
            per = max(1, (limit or t * gh * gw // m2) // max(1, gh * gw // m2))  # frame groups a piece
            for f in range(0, t, per):
                n = min(per, t - f)
                pieces.append((k, p[f * gh * gw:(f + n) * gh * gw], (n, gh, gw)))
        calls: list[list[int]] = []
        rows_in = 0
        for j, (_, p, _) in enumerate(pieces):
            r = p.shape[0] // m2
            if not calls or (limit is not None and rows_in + r > limit):
                calls.append([])
                rows_in = 0
            calls[-1].append(j)
            rows_in += r
        out: list[list[torch.Tensor]] = [[] for _ in data]
        for call in calls:
            rows = self.visual(torch.cat([pieces[j][1] for j in call]).to(w.dtype), [pieces[j][2] for j in call])
            for j, r in zip(call, rows.split([pieces[j][1].shape[0] // m2 for j in call]), strict=True):
                out[pieces[j][0]].append(r)
        rows = [r[0] if len(r) == 1 else torch.cat(r) for r in out]
        k = len(self.config.deepstack_visual_indexes)
        if not k:
            return rows
        h = self.config.out_hidden_size  # Qwen3-VL's tower: each row then its k features
        return [(r[:, :h], r[:, h:].unflatten(1, (k, h))) for r in rows]

    def _patches(self, pixels: torch.Tensor, video: bool = False) -> torch.Tensor:
        """Resized uint8 pixels (a video's frames [T, 3, h, w]) -> fp32 patches, on their
        device (models/qwen2_vl_image.py)."""
        vc = self.config
        proc = (vc.video_processing or vc.processing) if video else vc.processing
        return normalize(pixels, proc, vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], where: str) -> set[str]:
        """Load a checkpoint's ``visual.`` tensors (others are the text model's); returns
        the parameter names loaded."""
        from flashpage.models.multimodal import load_image_weights

        return load_image_weights(self, weights, where, _PREFIXES, f"the {self.config.variant} vision tower",
                                  "vision tower")[0]


def _digest(image: QwenImage) -> bytes:
    """The resized pixels' digest (or, for patches given, the patches') and the grid (two
    images of one patch count and the same bytes, a flat color, differ by grid: their rows
    and positions differ)."""
    data = image.pixels if image.pixels is not None else image.patches
    assert data is not None
    kind = b"pixels" if image.pixels is not None else b"patches"
    if image.video:  # a video's positions depend on its time step too
        kind += b"video" + repr(image.time_step).encode()
    return hashlib.blake2b(kind + digest(data) + repr(image.grid).encode(), digest_size=32).digest()


def expand_pads(ids: list[int], counts: dict[int, list[int]], names: dict[int, tuple[str, str]],
                wrap: tuple[str, str] = ("<|vision_start|>", "<|vision_end|>")
                ) -> tuple[list[int], dict[int, list[int]]]:
    """A prompt's ids with each placeholder token's i-th occurrence made ``counts[token][i]``
    of it (as Qwen2VLProcessor: <|image_pad|> per image, <|video_pad|> per video), and each
    item's first position, per token. A token's ids already expanded (one run of exactly
    counts[token][i] per item) are kept. A ValueError names a count that does not match
    (``names[token]``: the item's name and the token's; ``wrap``: the markers around a
    placeholder the error shows)."""
    keep: dict[int, bool] = {}
    for token, want in counts.items():
        runs = token_runs(ids, token)
        if runs and len(runs) == len(want) and any(c > 1 for c in want) \
                and all(n == c for (_, n), c in zip(runs, want, strict=True)):
            keep[token] = True
            continue
        keep[token] = False
        total = sum(n for _, n in runs)
        if total != len(want):
            item, name = names[token]
            raise ValueError(f"the prompt has {total} {item} token(s) ({name}, id {token}) but "
                             f"{len(want)} {item}(s) were given: put one "
                             f"{wrap[0]}{name}{wrap[1]} in the prompt per {item}")
    out: list[int] = []
    starts: dict[int, list[int]] = {t: [] for t in counts}
    at = dict.fromkeys(counts, 0)
    prev = None
    for t in ids:
        if t in counts:
            if keep[t]:
                if prev != t:
                    starts[t].append(len(out))
                out.append(t)
            else:
                starts[t].append(len(out))
                out.extend([t] * counts[t][at[t]])
                at[t] += 1
        else:
            out.append(t)
        prev = t
    return out, starts


def load_image_encoder(source: ModelSource, dtype: torch.dtype, device: torch.device,
                       seed: int = 0) -> QwenImageEncoder:
    """``source``'s image encoder in ``dtype`` on ``device``: its checkpoint's tensors, or
    random ones (a random_config source)."""
    from flashpage.models.multimodal import build_image_encoder

    vc = source.config.vision
    assert isinstance(vc, QwenVisionConfig)
    weights = None
    qc = source.config.quantization_config
    if source.kind != "random" and qc is not None:
        # an fp8 checkpoint's (Qwen3-VL's): e4m3 tower weights dequantized
        from flashpage.models.fp8_checkpoint import fp8_tower_weights

        assert source.path is not None
        weights = fp8_tower_weights(source.path, qc, lambda n: n.startswith(IMAGE_PREFIXES))
    enc = build_image_encoder(source, dtype, device, seed, lambda: QwenImageEncoder(vc), IMAGE_PREFIXES, weights)
    enc.fuse()
    return enc.eval()
