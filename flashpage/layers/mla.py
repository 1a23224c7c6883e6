"""Multi-head latent attention (DeepSeek-V2/V3): the math, as functions of the weights.

Per token the cache holds one latent entry ``[c_kv (R) | k_pe (rope)]``; ``kv_b_proj``
maps c_kv to every head's K (no-rope part) and V::

    kv_b_proj.weight : [H * (nope + v_dim), R]
    viewed [H, nope + v_dim, R]:  W_UK[h] = rows [:nope]  ([nope, R])
                                  W_UV[h] = rows [nope:]  ([v_dim, R])
    k[h] = [W_UK[h] c_kv | k_pe]        v[h] = W_UV[h] c_kv

Two ways to attend, equal up to rounding:

- prefill (:func:`mla_expand_kv`): expand the latents into per-head K [.., nope+rope] and
  V [.., v_dim] and run ordinary attention (qk dim 192, v dim 128 for V2/V3);
- decode (:func:`mla_absorb_query`, :func:`mla_absorb_output`):
  ``q_nope[h] . (W_UK[h] c) = (q_nope[h] W_UK[h]) . c``, so the query absorbs W_UK and
  every head attends over the shared latent (MQA, qk dim R + rope = 576, v dim R = 512);
  the latent-space output then goes through W_UV. The softmax scale is the same.

Rope and scale (:func:`yarn_inv_freq_and_mscale`, :func:`mla_softmax_scale`,
:func:`mla_rope_is_neox`) follow transformers' DeepseekV2/V3: YaRN inv_freq over the
rope dims, cos/sin multiplied by the YaRN attention factor, and the softmax scale
multiplied by ``yarn_get_mscale(factor, mscale_all_dim) ** 2``.
"""

from __future__ import annotations

import torch

from flashpage.config import ModelConfig
from flashpage.layers.rotary import default_inv_freq, yarn_get_mscale, yarn_inv_freq


# ----------------------------------------------------------------- kv_b_proj, split
def split_kv_b_proj(kv_b_proj_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int,
                    v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (W_UK [H, nope, R], W_UV [H, v_dim, R]), views of the weight (no copy)."""
    rank = kv_b_proj_weight.shape[-1]
    if kv_b_proj_weight.shape[0] != num_heads * (qk_nope_head_dim + v_head_dim):
        raise ValueError(f"kv_b_proj weight {tuple(kv_b_proj_weight.shape)} does not match "
                         f"{num_heads} heads x ({qk_nope_head_dim} + {v_head_dim})")
    w = kv_b_proj_weight.view(num_heads, qk_nope_head_dim + v_head_dim, rank)
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def mla_expand_kv(latent: torch.Tensor, k_pe: torch.Tensor, kv_b_proj_weight: torch.Tensor,
                  num_heads: int, qk_nope_head_dim: int, v_head_dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill path. latent [N, R] (after kv_a_layernorm), k_pe [N, rope] (rope applied)
    -> k [N, H, nope + rope], v [N, H, v_dim]; k_pe is the same for every head."""
    n = latent.shape[0]
    kv = (latent @ kv_b_proj_weight.t()).view(n, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(n, num_heads, k_pe.shape[-1])], dim=-1)
    return k, v.contiguous()


def mla_absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_proj_weight: torch.Tensor,
                     num_heads: int, qk_nope_head_dim: int, v_head_dim: int) -> torch.Tensor:
    """Decode path. q_nope [N, H, nope], q_pe [N, H, rope] (rope applied)
    -> q_absorbed [N, H, R + rope] = [q_nope[h] @ W_UK[h] | q_pe[h]]."""
    w_uk, _ = split_kv_b_proj(kv_b_proj_weight, num_heads, qk_nope_head_dim, v_head_dim)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [N, H, R]
    return torch.cat([q_lat, q_pe], dim=-1)


def mla_absorb_output(o_latent: torch.Tensor, kv_b_proj_weight: torch.Tensor, num_heads: int,
                      qk_nope_head_dim: int, v_head_dim: int) -> torch.Tensor:
    """Decode path, after attention. o_latent [N, H, R] -> [N, H, v_dim] = o[h] @ W_UV[h]^T."""
    _, w_uv = split_kv_b_proj(kv_b_proj_weight, num_heads, qk_nope_head_dim, v_head_dim)
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


# ----------------------------------------------------------------- rope and scale
def yarn_inv_freq_and_mscale(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq fp32 [qk_rope_head_dim // 2], mscale): multiply cos and sin by mscale.

    No scaling: the plain rope frequencies and 1.0. ``yarn``: DeepSeek's YaRN, as
    transformers computes it (layers/rotary.yarn_inv_freq; the correction range truncated
    to whole dims unless the config says ``truncate: false``).
    """
    dim = config.qk_rope_head_dim
    inv_freq = default_inv_freq(config.rope_theta, dim)
    rs = config.rope_scaling
    if rs is None or rs.rope_type == "default":
        return inv_freq, 1.0
    if rs.rope_type == "linear":
        return inv_freq / rs.factor, 1.0
    if rs.rope_type != "yarn":
        raise ValueError(f"MLA supports rope types default, linear and yarn, not {rs.rope_type!r}")
    return yarn_inv_freq(config.rope_theta, dim, rs, config.max_position_embeddings)


def mla_softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim^-0.5, times yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rs = config.rope_scaling
    if rs is not None and rs.rope_type != "default" and rs.mscale_all_dim:
        m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
        scale *= m * m
    return scale


def mla_rope_is_neox(config: ModelConfig) -> bool:
    """Which rotation pairs the rope dims use (``is_neox`` of the rotary kernels).

    DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... : V2 always, V3 when
    ``rope_interleave`` (its default). transformers' V3 writes the rotated pairs
    de-interleaved (evens, then odds) while GPT-J style (is_neox=False) keeps them in
    place: a permutation applied alike to q_pe and k_pe, so every score q . k is equal.
    Only V3 with ``rope_interleave: false`` rotates halves (is_neox=True).
    """
    if config.model_type == "deepseek_v3":
        # ModelConfig has no rope_interleave field yet; read it from the raw config.
        return not bool(config.raw.get("rope_interleave", True))
    return False


__all__ = [
    "mla_absorb_output",
    "mla_absorb_query",
    "mla_expand_kv",
    "mla_rope_is_neox",
    "mla_softmax_scale",
    "split_kv_b_proj",
    "yarn_get_mscale",
    "yarn_inv_freq_and_mscale",
]
