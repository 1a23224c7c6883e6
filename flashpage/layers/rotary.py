"""Rotary position embedding: inv_freq per scaling type, a cos/sin cache, and its application.

``cos_sin_cache`` is ``[max_positions, rot_dim]`` fp32: cos in the first half, sin in
the second (the layout the Triton rotary kernel reads); rot_dim < head_dim rotates the
first rot_dim dims of each head only (Phi-3's partial_rotary_factor). longrope's choice of
factors is made once from max_positions (``uses_long_factors``), and its attention factor
is folded into the cache; so is YaRN's (``yarn_inv_freq``, shared with MLA's rope,
layers/mla.py: GPT-OSS, DeepSeek).
"""

from __future__ import annotations

import math

import torch

from flashpage.config import ModelConfig, RopeScaling
from flashpage.layers import ops
from flashpage.layers.fp32 import KeepFp32


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    # Same expression as transformers, so fp32 values match bit for bit.
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def uses_long_factors(scaling: RopeScaling, max_positions: int) -> bool:
    """longrope: whether the long factors apply. transformers switches per forward, on the
    longest position it is given (> original_max_position_embeddings: long), so a sequence
    that grows past it keeps the keys it cached with the short factors. A cache that must
    stay valid picks once, as vLLM does: long whenever the model may see positions past
    the original length (max_model_len > original_max_position_embeddings)."""
    assert scaling.original_max_position_embeddings is not None
    return max_positions > scaling.original_max_position_embeddings


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context stretched ``scale`` times (1 for none)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(base: float, dim: int, scaling: RopeScaling,
                  original_max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """YaRN (``rope_type`` yarn) as transformers' _compute_yarn_parameters computes it ->
    (inv_freq fp32 [dim // 2], the attention factor cos and sin are multiplied by).

    Frequencies below the correction range [low, high] (found from beta_fast / beta_slow
    rotations over original_max_position_embeddings; ``original_max_positions`` where the
    scaling has none) are divided by ``factor``, those above it kept, a linear ramp between;
    ``truncate`` (transformers' default true; GPT-OSS false) rounds the range out to whole
    dims. The attention factor: ``attention_factor`` where given, else
    yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) where both are
    set (DeepSeek), else yarn_get_mscale(factor)."""
    factor = scaling.factor
    orig_max = scaling.original_max_position_embeddings or original_max_positions
    if orig_max is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    if scaling.attention_factor is not None:
        mscale = float(scaling.attention_factor)
    elif scaling.mscale and scaling.mscale_all_dim:
        mscale = yarn_get_mscale(factor, scaling.mscale) / yarn_get_mscale(factor, scaling.mscale_all_dim)
    else:
        mscale = yarn_get_mscale(factor)
    beta_fast = scaling.beta_fast or 32.0
    beta_slow = scaling.beta_slow or 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = float(max(low, 0)), float(min(high, dim - 1))
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    # Same expressions as transformers, so fp32 values match bit for bit.
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(mscale)


def scaled_inv_freq(base: float, dim: int, scaling: RopeScaling | None,
                    max_positions: int | None = None) -> torch.Tensor:
    if scaling is not None and scaling.rope_type == "longrope":
        if max_positions is None:
            raise ValueError("longrope picks its factors by max_positions: pass it")
        long = uses_long_factors(scaling, max_positions)
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor,
                               dtype=torch.float32)
        # transformers' expression, so fp32 values match bit for bit
        return 1.0 / (factors * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = default_inv_freq(base, dim)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings or 8192
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope type {scaling.rope_type!r} has no inv_freq rule here (yarn: "
                     "yarn_inv_freq, which also gives its attention factor)")


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, mscale: float = 1.0) -> torch.Tensor:
    t = torch.arange(max_positions, dtype=torch.float)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)


def apply_rotary_torch(
    positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """x [N, H, D] -> rotated copy. neox: rotate halves (HF Llama); else interleaved pairs."""
    cos_sin = cos_sin_cache.index_select(0, positions)
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, None, :half].to(x.dtype)
    sin = cos_sin[:, None, half:].to(x.dtype)
    rot = 2 * half
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if is_neox:
        x1, x2 = x_rot[..., :half], x_rot[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, x_pass], dim=-1) if x_pass.numel() else out


class RotaryEmbedding(KeepFp32, ops.FusedOpsModule):
    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, rot_dim: int, max_positions: int, base: float,
                 scaling: RopeScaling | None = None, is_neox: bool = True,
                 original_max_positions: int | None = None) -> None:
        """``original_max_positions``: YaRN's original context where the scaling names none
        (the config's max_position_embeddings)."""
        super().__init__()
        self.head_dim = head_dim
        self.is_neox = is_neox
        self.max_positions = max_positions
        if scaling is not None and scaling.rope_type == "yarn":
            self.inv_freq, self.mscale = yarn_inv_freq(base, rot_dim, scaling, original_max_positions)
        else:
            self.inv_freq = scaled_inv_freq(base, rot_dim, scaling, max_positions)
            # longrope's attention factor scales cos and sin (so q.k by its square)
            self.mscale = (scaling.attention_factor or 1.0) if scaling is not None else 1.0
        self.register_buffer("cos_sin_cache",
                             build_cos_sin_cache(self.inv_freq, max_positions, self.mscale),
                             persistent=False)

    def set_frequency_factors(self, factors: torch.Tensor) -> None:
        """Divide each frequency by a factor, as llama.cpp stores Llama 3.1's scaling in GGUF
        files (``rope_freqs``: one factor per rotated pair)."""
        if factors.shape != self.inv_freq.shape:
            raise ValueError(f"rope_freqs has shape {tuple(factors.shape)}, expected "
                             f"{tuple(self.inv_freq.shape)} (one factor per rotated pair)")
        cache = build_cos_sin_cache(self.inv_freq / factors.float().cpu(), self.max_positions,
                                    self.mscale)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [N], the cos / sin table they index): the kernels' inputs. Here the
        positions and the whole cache; M-RoPE's 3-D positions make a table of their own."""
        return positions, self.cos_sin_cache

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D], k [N, Hkv, D] -> rotated (q, k)."""
        positions, cache = self.table(positions)
        if self.fused:
            from flashpage.kernels.rotary import apply_rotary

            q, k = q.contiguous(), k.contiguous()
            return apply_rotary(positions, q, k, cache, self.is_neox)
        return (apply_rotary_torch(positions, q, cache, self.is_neox),
                apply_rotary_torch(positions, k, cache, self.is_neox))


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL, engine/mrope.py): rotated pair i turns by the angle of one of the
    position's three components (t, h, w): the first ``section[0]`` pairs by t, the next
    ``section[1]`` by h, the rest by w. Positions [N] (every text token, a decode step) are
    the 1-D rope, the parent's fast path; positions [3, N] (a step holding an image's rows)
    take per-token cos / sin rows gathered from the same cache, column by column
    (``cos_sin_rows``), which the fused kernel reads as a table of N rows at positions
    0 .. N - 1 (``table``).

    ``interleaved`` (Qwen3-VL): pair i turns by component i % 3 while that component has
    pairs of its section left (pairs 1, 4, ... < 3 x section[1] by h; 2, 5, ... < 3 x
    section[2] by w), by t otherwise: [24, 20, 20] gives t h w t h w ... then t t t t.

    ``is_neox`` False (GLM-4.1V): the rotated pairs are neighbours (x[2i], x[2i + 1]) rather
    than halves, pair i still turned by its section's component (transformers'
    Glm4vTextRotaryEmbedding: the sections cut the frequencies, then repeat_interleave)."""

    def __init__(self, head_dim: int, rot_dim: int, max_positions: int, base: float,
                 section: tuple[int, ...], scaling: RopeScaling | None = None,
                 interleaved: bool = False, is_neox: bool = True) -> None:
        super().__init__(head_dim, rot_dim, max_positions, base, scaling, is_neox=is_neox)
        if len(section) != 3 or 2 * sum(section) != rot_dim:
            raise ValueError(f"mrope_section {list(section)} must be 3 counts summing to "
                             f"{rot_dim // 2} (the rotated pairs)")
        if interleaved:
            comp = torch.zeros(rot_dim // 2, dtype=torch.int64)
            for c in (1, 2):
                comp[c:3 * section[c]:3] = c
        else:
            comp = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self.component: torch.Tensor
        self.register_buffer("component", torch.cat([comp, comp]), persistent=False)

    def cos_sin_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [3, N] -> fp32 [N, rot_dim]: column j of token n from the cache's row at
        component ``component[j]`` of its position."""
        rows = self.cos_sin_cache[positions]  # [3, N, rot_dim]
        idx = self.component.to(rows.device)[None, None, :].expand(1, rows.shape[1], -1)
        return rows.gather(0, idx)[0]

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return positions, self.cos_sin_cache
        n = positions.shape[1]
        return torch.arange(n, device=positions.device), self.cos_sin_rows(positions).contiguous()


def get_rope(config: ModelConfig, max_positions: int, layer: int | None = None) -> RotaryEmbedding:
    """Layer ``layer``'s rotary embedding over the first ``config.rotary_dim`` dims of each
    head (all of them but for a partial_rotary_factor: the fused kernels take the partial
    width too), on halves (neox, HF Llama's) or, for ``config.rope_interleaved`` (Cohere),
    on neighbouring pairs: Gemma 3's sliding layers use their own base (rope_local_theta)
    without scaling, every other layer rope_theta and rope_scaling."""
    neox = not config.rope_interleaved
    if config.mrope_section:
        return MRotaryEmbedding(config.head_dim, config.rotary_dim, max_positions, config.rope_theta,
                                config.mrope_section, config.rope_scaling, config.mrope_interleaved,
                                is_neox=neox)
    if (layer is not None and config.rope_local_theta is not None
            and config.layer_types[layer] == "sliding_attention"):
        return RotaryEmbedding(config.head_dim, config.rotary_dim, max_positions,
                               config.rope_local_theta, None, is_neox=neox)
    return RotaryEmbedding(config.head_dim, config.rotary_dim, max_positions, config.rope_theta,
                           config.rope_scaling, is_neox=neox,
                           original_max_positions=config.max_position_embeddings)
