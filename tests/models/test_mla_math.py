"""MLA math: the expanded (prefill) and absorbed (decode) paths agree; rope/scale match HF."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from flashpage.config import ModelConfig
from flashpage.kernels.mla_decode import mla_decode_ref
from flashpage.layers.mla import (
    mla_absorb_output,
    mla_absorb_query,
    mla_expand_kv,
    mla_rope_is_neox,
    mla_softmax_scale,
    yarn_inv_freq_and_mscale,
)

H, NOPE, ROPE, V, R = 4, 16, 8, 12, 32


def weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(H * (NOPE + V), R, generator=g, dtype=torch.float64) / math.sqrt(R)
    return w, g


def causal_attention(q, k, v, scale):
    """q [L, H, Dq], k [L, H, Dq] or [L, Dq], v [L, H, Dv] or [L, Dv]; bottom-right causal."""
    if k.dim() == 2:
        k = k[:, None].expand(-1, q.shape[1], -1)
        v = v[:, None].expand(-1, q.shape[1], -1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("length", [1, 2, 7, 33, 100])
def test_expanded_and_absorbed_paths_agree(length):
    """Prefill math (expanded K/V) == decode math (absorbed query over the latent)."""
    w, g = weights(length)
    latent = torch.randn(length, R, generator=g, dtype=torch.float64)
    k_pe = torch.randn(length, ROPE, generator=g, dtype=torch.float64)
    q_nope = torch.randn(length, H, NOPE, generator=g, dtype=torch.float64)
    q_pe = torch.randn(length, H, ROPE, generator=g, dtype=torch.float64)
    scale = (NOPE + ROPE) ** -0.5

    k, v = mla_expand_kv(latent, k_pe, w, H, NOPE, V)
    assert k.shape == (length, H, NOPE + ROPE) and v.shape == (length, H, V)
    assert torch.equal(k[:, 2, NOPE:], k_pe)
    expanded = causal_attention(torch.cat([q_nope, q_pe], -1), k, v, scale)

    q_abs = mla_absorb_query(q_nope, q_pe, w, H, NOPE, V)
    assert q_abs.shape == (length, H, R + ROPE)
    entries = torch.cat([latent, k_pe], -1)  # what the cache holds
    o_lat = causal_attention(q_abs, entries, latent, scale)
    absorbed = mla_absorb_output(o_lat, w, H, NOPE, V)
    assert absorbed.shape == (length, H, V)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-10, atol=1e-10)

    # In fp32 the two differ only by rounding.
    f = lambda t: t.float()  # noqa: E731
    exp32 = causal_attention(torch.cat([f(q_nope), f(q_pe)], -1), *mla_expand_kv(
        f(latent), f(k_pe), f(w), H, NOPE, V), scale)
    abs32 = mla_absorb_output(causal_attention(
        mla_absorb_query(f(q_nope), f(q_pe), f(w), H, NOPE, V), f(entries), f(latent), scale),
        f(w), H, NOPE, V)
    torch.testing.assert_close(abs32, exp32, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(abs32.double(), expanded, rtol=1e-5, atol=1e-5)


def test_decode_kernel_reference_over_paged_latent_matches_expanded():
    """The last query through mla_decode_ref's paged contract == expanded attention."""
    length, page = 37, 8
    w, g = weights(99)
    latent = torch.randn(length, R, generator=g)
    k_pe = torch.randn(length, ROPE, generator=g)
    q_nope = torch.randn(1, H, NOPE, generator=g)
    q_pe = torch.randn(1, H, ROPE, generator=g)
    scale = (NOPE + ROPE) ** -0.5
    w = w.float()
    k, v = mla_expand_kv(latent, k_pe, w, H, NOPE, V)
    want = causal_attention(torch.cat([q_nope, q_pe], -1), k, v, scale)[0]

    nblk = math.ceil(length / page)
    table = torch.randperm(nblk + 2)[:nblk].int()
    cache = torch.full((nblk + 2, page, R + ROPE), float("nan"))
    slots = table[torch.arange(length) // page].long() * page + torch.arange(length) % page
    cache.view(-1, R + ROPE)[slots] = torch.cat([latent, k_pe], -1)
    q_abs = mla_absorb_query(q_nope, q_pe, w, H, NOPE, V)
    o_lat = mla_decode_ref(q_abs, cache, table[None], torch.tensor([length], dtype=torch.int32),
                           kv_lora_rank=R, sm_scale=scale)
    got = mla_absorb_output(o_lat, w, H, NOPE, V)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- rope and scale vs HF
YARN = dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=256,
            beta_fast=32, beta_slow=1, mscale=0.9, mscale_all_dim=0.7)
SHAPE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
             qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
             max_position_embeddings=8192)


@pytest.mark.parametrize(
    "rope",
    [
        YARN,
        dict(YARN, mscale=1.0, mscale_all_dim=1.0, factor=4.0),  # DeepSeek-V3's choice
        dict(YARN, mscale_all_dim=0.0),  # attention factor from factor alone, no scale fix
        dict(rope_type="default"),
    ],
    ids=["yarn", "yarn_equal_mscale", "yarn_no_mscale_all_dim", "default"],
)
@pytest.mark.parametrize("version", ["v2", "v3"])
def test_rope_and_scale_match_hf(version, rope):
    theta = 10000.0
    if version == "v3":
        conf = DeepseekV3Config(**SHAPE, rope_parameters=dict(rope, rope_theta=theta))
        hf_rot, hf_attn = hf_v3.DeepseekV3RotaryEmbedding(conf), hf_v3.DeepseekV3Attention(conf, 0)
    else:
        conf = DeepseekV2Config(**SHAPE, rope_parameters=dict(rope, rope_theta=theta))
        hf_rot, hf_attn = hf_v2.DeepseekV2RotaryEmbedding(conf), hf_v2.DeepseekV2Attention(conf, 0)
    cfg = ModelConfig.from_hf(conf.to_dict())
    inv_freq, mscale = yarn_inv_freq_and_mscale(cfg)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (SHAPE["qk_rope_head_dim"] // 2,)
    torch.testing.assert_close(inv_freq, hf_rot.inv_freq, rtol=0, atol=0)
    assert mscale == pytest.approx(hf_rot.attention_scaling, rel=1e-12)
    assert mla_softmax_scale(cfg) == pytest.approx(hf_attn.scaling, rel=1e-12)
    if rope.get("rope_type") == "yarn" and rope.get("mscale") != rope.get("mscale_all_dim"):
        assert mscale != 1.0  # the case really exercises the attention factor

    # cos/sin as the engine builds them: angle = position * inv_freq, times mscale.
    pos = torch.tensor([[0, 1, 5, 300, 4000, 8191]])
    ang = pos[0, :, None].float() * inv_freq
    cos, sin = ang.cos() * mscale, ang.sin() * mscale
    x = torch.zeros(1, 1, pos.shape[1], SHAPE["qk_rope_head_dim"])
    if version == "v3":
        hf_cos, hf_sin = hf_rot(x, pos)
        torch.testing.assert_close(torch.cat([cos, cos], -1), hf_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([sin, sin], -1), hf_sin[0], rtol=0, atol=0)
    else:
        freqs_cis = hf_rot(x, pos)[0]
        torch.testing.assert_close(cos, freqs_cis.real, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, freqs_cis.imag, rtol=1e-6, atol=1e-6)


def rotate(x, cos, sin, is_neox):
    """x [L, Hx, D]; cos/sin [L, D/2]: neox rotates halves, else interleaved pairs in place."""
    cos, sin = cos[:, None], sin[:, None]
    if is_neox:
        x1, x2 = x.chunk(2, -1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


@pytest.mark.parametrize("version,interleave", [("v2", None), ("v3", True), ("v3", False)])
def test_rope_layout_gives_hf_scores(version, interleave):
    """q_pe . k_pe after our rotation (mla_rope_is_neox) equals HF's, for every pair."""
    extra = {} if interleave is None else dict(rope_interleave=interleave)
    cls = DeepseekV3Config if version == "v3" else DeepseekV2Config
    conf = cls(**SHAPE, rope_parameters=dict(YARN, rope_theta=10000.0), **extra)
    cfg = ModelConfig.from_hf(conf.to_dict())
    is_neox = mla_rope_is_neox(cfg)
    assert is_neox == (interleave is False)
    inv_freq, mscale = yarn_inv_freq_and_mscale(cfg)
    g = torch.Generator().manual_seed(3)
    L, D = 9, SHAPE["qk_rope_head_dim"]
    pos = torch.arange(L) * 37
    q = torch.randn(L, 4, D, generator=g)
    k = torch.randn(L, 1, D, generator=g)
    ang = pos[:, None].float() * inv_freq
    cos, sin = ang.cos() * mscale, ang.sin() * mscale
    qo, ko = rotate(q, cos, sin, is_neox), rotate(k, cos, sin, is_neox)

    q4, k4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # HF: [B, H, L, D]
    if version == "v2":
        freqs_cis = torch.polar(torch.ones_like(ang), ang) * mscale
        hq, hk = hf_v2.apply_rotary_emb(q4, k4, freqs_cis[None])
        torch.testing.assert_close(qo, hq[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    else:
        emb_cos, emb_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
        fn = hf_v3.apply_rotary_pos_emb_interleave if interleave else hf_v3.apply_rotary_pos_emb
        hq, hk = fn(q4, k4, emb_cos, emb_sin)
    ours_scores = torch.einsum("qhd,kd->hqk", qo, ko[:, 0])
    hf_scores = torch.einsum("hqd,kd->hqk", hq[0], hk[0, 0])
    torch.testing.assert_close(ours_scores, hf_scores, rtol=1e-5, atol=1e-5)
