"""CLIP's ViT vision tower (transformers' CLIPVisionModel), as LLaVA reads it: pixel values
in, the hidden states of its feature layers out.

    pixel_values [n, 3, S, S] -> patch conv (stride = patch) -> [CLS | patches] + positions
    -> pre_layrnorm -> layers 0 .. k-1 (pre-norm: x + attn(ln1(x)); x + mlp(ln2(x)))

hidden state 0 is the embeddings after pre_layrnorm, hidden state i the output of layer
i - 1 (transformers' ``hidden_states`` tuple). Only the layers up to the deepest feature
layer are built (LLaVA-1.5 reads the next-to-last: its last layer and post_layernorm are
never used, and their tensors are skipped at load, as vLLM does). Attention is full
(bidirectional) over the n x (1 + patches) tokens: torch's scaled_dot_product_attention.
Parameter names are the checkpoint's (``embeddings.patch_embedding.weight``,
``encoder.layers.{i}.self_attn.q_proj.weight``, ...).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.config import VisionConfig


class LayerShape(Protocol):
    """What an encoder layer reads of its config (CLIP's VisionConfig; Gemma 3's SigLIP
    tower, models/gemma3_vision.py, whose layers are CLIP's)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def hidden_act(self) -> str: ...
    @property
    def layer_norm_eps(self) -> float: ...


def activation(name: str) -> nn.Module:
    """transformers' ACT2FN for the activations CLIP and LLaVA's projector use."""
    if name == "quick_gelu":
        return QuickGELU()
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_pytorch_tanh":
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    raise ValueError(f"activation {name!r} is not supported")


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.patch_size = vc.patch_size
        self.image_size = vc.image_size
        self.class_embedding = nn.Parameter(torch.empty(vc.hidden_size))
        self.patch_embedding = nn.Conv2d(vc.num_channels, vc.hidden_size, kernel_size=vc.patch_size,
                                         stride=vc.patch_size, bias=False)
        num_positions = (vc.image_size // vc.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, vc.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, 3, S, S] -> [n, 1 + (S / patch)^2, hidden]"""
        n = pixel_values.shape[0]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, vc: LayerShape) -> None:
        super().__init__()
        h = vc.hidden_size
        self.num_heads = vc.num_attention_heads
        self.head_dim = h // vc.num_attention_heads
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.out_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                           heads(self.v_proj(x)))
        return self.out_proj(o.transpose(1, 2).reshape(n, t, -1))


# fc1 and SigLIP's tanh GELU in one cuBLASLt call on CUDA (its GELU epilogue is the tanh
# form, applied to the fp32 sums before the 16-bit rounding); False: two passes, as transformers
FUSED_GELU = True


class CLIPMLP(nn.Module):
    def __init__(self, vc: LayerShape) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vc.hidden_size, vc.intermediate_size)
        self.act = activation(vc.hidden_act)
        self.fc2 = nn.Linear(vc.intermediate_size, vc.hidden_size)
        self.tanh_gelu = vc.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tanh_gelu and FUSED_GELU and x.is_cuda:
            # (torch's CPU kernel of the same call applies the erf GELU: CUDA only)
            h = torch._addmm_activation(self.fc1.bias, x.reshape(-1, x.shape[-1]), self.fc1.weight.t(),
                                        use_gelu=True)
            return self.fc2(h.view(*x.shape[:-1], -1))
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vc: LayerShape) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.self_attn = CLIPAttention(vc)
        self.layer_norm2 = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.mlp = CLIPMLP(vc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, vc: VisionConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(vc) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """transformers' CLIPVisionModel up to layer ``vc.layers_run`` (names kept)."""

    def __init__(self, vc: VisionConfig) -> None:
        super().__init__()
        self.config = vc
        self.embeddings = CLIPVisionEmbeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.encoder = CLIPEncoder(vc, vc.layers_run)

    def forward(self, pixel_values: torch.Tensor, feature_layers: tuple[int, ...]) -> list[torch.Tensor]:
        """The hidden states at ``feature_layers`` (0: the embeddings after pre_layrnorm, i:
        layer i - 1's output), each [n, 1 + patches, hidden]."""
        want = set(feature_layers)
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        kept = {0: x} if 0 in want else {}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if i in want:
                kept[i] = x
        return [kept[i] for i in feature_layers]
