"""The small fused kernels against their references (and against HF transformers where
the layout must match it): cache writes, rotary (+ cache write), RMSNorm, SiLU- and GELU-tanh-and-mul."""

from __future__ import annotations

import math

import pytest
import torch

from flashpage.kernels.cache_write import (
    _write_kv,
    _write_mla,
    write_kv_cache,
    write_kv_cache_ref,
    write_mla_cache,
    write_mla_cache_ref,
)
from flashpage.kernels.kv_cache_write import (
    KV_WRITE_VARIANTS,
    KVWriteConfig,
    kv_write_name,
    write_kv_rows,
)
from flashpage.kernels.rms_norm import rms_norm, rms_norm_ref
from flashpage.kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    compute_cos_sin_cache,
    rotary_and_cache_write,
    rotary_and_cache_write_ref,
)
from flashpage.kernels.silu_mul import (
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
DTYPES = [torch.bfloat16] if GPU else [torch.float32, torch.float16]


def gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape, dtype, g):
    return torch.randn(*shape, generator=g, device=DEVICE).to(dtype)


def random_slots(num_tokens, num_blocks, block_size, g, *, num_skipped):
    """Distinct random slots in the pool, with num_skipped tokens set to -1."""
    slots = torch.randperm(num_blocks * block_size, generator=g, device=DEVICE)[:num_tokens]
    skip = torch.randperm(num_tokens, generator=g, device=DEVICE)[:num_skipped]
    slots[skip] = -1
    return slots


def qkv_views(n, hq, hkv, d, dtype, g):
    """q, k, v as strided views of one fused projection output, as the model produces them."""
    qkv = randn(n, (hq + 2 * hkv) * d, dtype=dtype, g=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)


def assert_untouched(cache, before, slot_mapping):
    """Every cache entry that no valid slot names still holds its old contents."""
    flat, old = cache.flatten(0, 1), before.flatten(0, 1)
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device=cache.device)
    written[slot_mapping[slot_mapping >= 0]] = True
    assert torch.equal(flat[~written].isnan(), old[~written].isnan())
    assert torch.equal(flat[~written].nan_to_num(), old[~written].nan_to_num())


# ---------------------------------------------------------------- cache writes


@pytest.mark.parametrize("dtype", DTYPES)
# head dims 80 (Phi-2, Pythia-2.8B) and 96 (GPT-NeoX-20B): rows that are no power of two
@pytest.mark.parametrize("block_size,hkv,d", [(16, 2, 64), (256, 1, 128), (32, 4, 256), (16, 2, 80),
                                              (8, 3, 96)])
def test_write_kv_cache(dtype, block_size, hkv, d):
    g = gen(block_size + d)
    n, num_blocks = 37, 5
    _, k, v = qkv_views(n, 4, hkv, d, dtype, g)
    key_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full_like(key_cache, float("nan"))
    slots = random_slots(n, num_blocks, block_size, g, num_skipped=6)
    kc_ref, vc_ref = key_cache.clone(), value_cache.clone()
    write_kv_cache(k, v, key_cache, value_cache, slots)
    write_kv_cache_ref(k, v, kc_ref, vc_ref, slots)
    torch.testing.assert_close(key_cache, kc_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, vc_ref, atol=0, rtol=0, equal_nan=True)
    assert_untouched(key_cache, torch.full_like(key_cache, float("nan")), slots)
    assert not key_cache.flatten(0, 1)[slots[slots >= 0]].isnan().any()


# Tile settings the benchmark sweeps: (elements per tensor per program, warps).
WRITE_TILES = [(2048, 4), (4096, 8), (16384, 8)]


@pytest.mark.parametrize("tile", WRITE_TILES)
def test_write_kv_cache_tiles(tile):
    dtype = DTYPES[-1]
    g = gen(tile[0])
    n, num_blocks, block_size, hkv, d = 45, 6, 16, 8, 128
    _, k, v = qkv_views(n, 4, hkv, d, dtype, g)
    key_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full_like(key_cache, float("nan"))
    slots = random_slots(n, num_blocks, block_size, g, num_skipped=5)
    kc_ref, vc_ref = key_cache.clone(), value_cache.clone()
    _write_kv(k, v, key_cache, value_cache, slots, *tile)
    write_kv_cache_ref(k, v, kc_ref, vc_ref, slots)
    torch.testing.assert_close(key_cache, kc_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, vc_ref, atol=0, rtol=0, equal_nan=True)


# The row kernel's variants (the benchmark times them): tokens per program, K/V split or
# joint; strided rows out of a fused qkv (heads adjacent: the flat path) and a v whose
# heads are not adjacent (the head/dim path); a token count that is not a multiple of
# the tile.
@pytest.mark.parametrize("d", [64, 80])  # and Phi-2's 80: rows of 160 / 80 padded to 256 / 128
@pytest.mark.parametrize("cfg", KV_WRITE_VARIANTS + [KVWriteConfig(1, 1, True)], ids=kv_write_name)
def test_write_kv_rows_variants(cfg, d):
    dtype = DTYPES[-1]
    g = gen(cfg.block_t + 7 * cfg.split_kv)
    n, num_blocks, block_size, hkv = 29, 5, 16, 2
    _, k, v = qkv_views(n, 4, hkv, d, dtype, g)
    v_heads_apart = randn(n, hkv, 2 * d, dtype=dtype, g=g)[..., :d]  # head stride 2 * d
    for vv in (v, v_heads_apart):
        key_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
        value_cache = torch.full_like(key_cache, float("nan"))
        slots = random_slots(n, num_blocks, block_size, g, num_skipped=4)
        kc_ref, vc_ref = key_cache.clone(), value_cache.clone()
        write_kv_rows(k, vv, key_cache, value_cache, slots, cfg)
        write_kv_cache_ref(k, vv, kc_ref, vc_ref, slots)
        torch.testing.assert_close(key_cache, kc_ref, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(value_cache, vc_ref, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,tile", [(512 + 64, None), (512 + 64, (2048, 4)), (512 + 64, (16384, 8)),
                                        (80, None), (33, None)])
def test_write_mla_cache(dtype, width, tile):
    """DeepSeek's 512 + 64 (64-wide steps), a width of 16-wide steps and an odd one."""
    g = gen(width)
    n, num_blocks, block_size = 29, 3, 16
    latent = randn(n, width, dtype=dtype, g=g)
    kv_cache = randn(num_blocks, block_size, width, dtype=dtype, g=g)
    before = kv_cache.clone()
    slots = random_slots(n, num_blocks, block_size, g, num_skipped=4)
    ref = kv_cache.clone()
    if tile is None:
        write_mla_cache(latent, kv_cache, slots)
    else:
        _write_mla(latent, kv_cache, slots, *tile)
    write_mla_cache_ref(latent, ref, slots)
    assert torch.equal(kv_cache, ref)
    assert_untouched(kv_cache, before, slots)


def test_cache_write_rejects_bad_inputs():
    k = torch.zeros(4, 2, 64)
    cache = torch.zeros(2, 16, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        write_kv_cache(k, k, cache, cache, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match"):
        write_kv_cache(k[:, :1], k[:, :1], cache, cache, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="latent must be"):
        write_mla_cache(torch.zeros(4, 576), torch.zeros(2, 16, 512), torch.zeros(4, dtype=torch.int64))


# ---------------------------------------------------------------- rotary


def llama3_inv_freq(head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_pos):
    """Llama 3.1 rope scaling, written from Meta's description: long wavelengths divided by
    `factor`, short ones kept, a smooth blend in between."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_pos / low_freq_factor
    high_freq_wavelen = original_max_pos / high_freq_factor
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, blended)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, out)


def test_rotary_matches_hf_llama31_scaling():
    """Layout and scaling against transformers' own Llama rotary (fp32, CPU)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    d, hq, hkv, theta = 64, 4, 2, 500000.0
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    config = LlamaConfig(hidden_size=d * hq, num_attention_heads=hq, num_key_value_heads=hkv,
                         head_dim=d, max_position_embeddings=131072, rope_theta=theta,
                         rope_scaling=scaling)
    hf_rope = LlamaRotaryEmbedding(config)
    inv_freq = llama3_inv_freq(d, theta, 8.0, 1.0, 4.0, 8192)
    # The scaled frequencies really differ from plain rope, and match HF's.
    assert not torch.allclose(inv_freq, 1.0 / theta ** (torch.arange(0, d, 2).float() / d))
    torch.testing.assert_close(inv_freq, hf_rope.inv_freq, atol=0, rtol=1e-6)

    g = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.tensor([0, 1, 8191, 8192, 131071]), torch.randint(0, 131072, (11,), generator=g)])
    n = positions.numel()
    q = torch.randn(n, hq, d, generator=g)
    k = torch.randn(n, hkv, d, generator=g)
    cos, sin = hf_rope(q, positions[None])  # [1, n, d]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)

    cache = compute_cos_sin_cache(inv_freq.to(DEVICE), 131072)
    q_ours, k_ours = apply_rotary(positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), cache)
    torch.testing.assert_close(q_ours.cpu(), q_hf[0].transpose(0, 1))
    torch.testing.assert_close(k_ours.cpu(), k_hf[0].transpose(0, 1))


def test_interleaved_rotary_is_complex_multiplication():
    """GPT-J/DeepSeek layout: (x[2i], x[2i+1]) as one complex number times e^(i p f_i)."""
    g = torch.Generator().manual_seed(1)
    n, h, d = 9, 3, 64
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    positions = torch.randint(0, 4096, (n,), generator=g)
    q = torch.randn(n, h, d, generator=g)
    k = torch.randn(n, 1, d, generator=g)
    freqs_cis = torch.polar(torch.ones(n, d // 2), positions[:, None].float() * inv_freq)
    want_q = torch.view_as_real(torch.view_as_complex(q.view(n, h, d // 2, 2)) * freqs_cis[:, None]).flatten(-2)
    q_out, _ = apply_rotary(positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE),
                            compute_cos_sin_cache(inv_freq.to(DEVICE), 4096), is_neox=False)
    torch.testing.assert_close(q_out.cpu(), want_q, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("d,rot_dim", [(64, 64), (128, 64), (96, 96), (80, 32), (96, 24)])
def test_apply_rotary(dtype, is_neox, d, rot_dim):
    g = gen(d + rot_dim)
    n, hq, hkv = 11, 8, 2
    q, k, _ = qkv_views(n, hq, hkv, d, dtype, g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, device=DEVICE).float() / rot_dim)
    cache = compute_cos_sin_cache(inv_freq, 2048, mscale=1.1)
    positions = torch.randint(0, 2048, (n,), generator=g, device=DEVICE)
    q_in, q_ref, k_ref = q.clone(), q.clone(), k.clone()
    apply_rotary(positions, q, k, cache, is_neox=is_neox)
    apply_rotary_ref(positions, q_ref, k_ref, cache, is_neox=is_neox)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k, k_ref)
    assert torch.equal(q[..., rot_dim:], q_in[..., rot_dim:])  # dims past rot_dim untouched
    assert not torch.equal(q[..., :rot_dim], q_in[..., :rot_dim])


@pytest.mark.parametrize("dtype", DTYPES)
# Phi-2's 32 of 80 dims and NeoX-20B's 24 of 96 rotated (the rest written as they are), a
# whole interleaved 80
@pytest.mark.parametrize("is_neox,d,rot_dim,block_size", [(True, 64, 64, 16), (False, 128, 64, 32),
                                                          (True, 128, 128, 256), (True, 80, 32, 16),
                                                          (True, 96, 24, 8), (False, 80, 80, 16)])
def test_rotary_and_cache_write(dtype, is_neox, d, rot_dim, block_size):
    g = gen(7 + d)
    n, hq, hkv, num_blocks = 21, 4, 2, 3
    q, k, v = qkv_views(n, hq, hkv, d, dtype, g)
    positions = torch.randint(0, 1024, (n,), generator=g, device=DEVICE, dtype=torch.int32)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2, device=DEVICE).float() / rot_dim)
    cache = compute_cos_sin_cache(inv_freq, 1024)
    key_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full_like(key_cache, float("nan"))
    slots = random_slots(n, num_blocks, block_size, g, num_skipped=5)
    refs = [t.clone() for t in (q, k, v, key_cache, value_cache)]
    rotary_and_cache_write(positions, q, k, v, cache, key_cache, value_cache, slots, is_neox=is_neox)
    rotary_and_cache_write_ref(positions, *refs[:3], cache, *refs[3:], slots, is_neox=is_neox)
    torch.testing.assert_close(q, refs[0])
    torch.testing.assert_close(k, refs[1])  # skipped tokens' k is rotated too
    torch.testing.assert_close(key_cache, refs[3], equal_nan=True)
    torch.testing.assert_close(value_cache, refs[4], atol=0, rtol=0, equal_nan=True)
    assert_untouched(key_cache, torch.full_like(key_cache, float("nan")), slots)
    assert_untouched(value_cache, torch.full_like(value_cache, float("nan")), slots)


# ---------------------------------------------------------------- RMSNorm, SiLU·mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1000, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    g = gen(hidden)
    x = randn(2, 5, hidden, dtype=dtype, g=g) * 3
    weight = randn(hidden, dtype=dtype, g=g)
    residual = randn(2, 5, hidden, dtype=dtype, g=g) if with_residual else None
    x_before = x.clone()
    got = rms_norm(x, weight, 1e-6, residual)
    want = rms_norm_ref(x, weight, 1e-6, residual)
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the sum, rounded once
        got, want = got[0], want[0]
    # The kernel's fp32 sum of squares runs in another order than torch's; allow one
    # rounding step of the dtype on the normalised value.
    tol = {torch.float32: (1e-5, 1.3e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
    torch.testing.assert_close(got, want, atol=tol[dtype][0], rtol=tol[dtype][1])
    if dtype != torch.float32:  # HF's rounding steps are reproduced: nearly all bits equal
        assert (got == want).float().mean() > 0.99
    assert torch.equal(x, x_before)


def test_rms_norm_matches_hf():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(256, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256))
    x = torch.randn(7, 256)
    torch.testing.assert_close(rms_norm(x.to(DEVICE), norm.weight.detach().to(DEVICE), 1e-5).cpu(),
                               norm(x).detach())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp32_weight_is_gemmas_rounding(dtype, with_residual):
    """An fp32 weight beside 16-bit x (Gemma's 1 + w, layers/norm.GemmaRMSNorm): the
    product taken in fp32, rounded once, as transformers' GemmaRMSNorm computes it."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    if dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("the interpreter computes bf16 wrongly")
    g = gen(512)
    x = randn(3, 512, dtype=dtype, g=g) * 3
    residual = randn(3, 512, dtype=dtype, g=g) if with_residual else None
    hf = HFGemmaRMSNorm(512, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(512, generator=torch.Generator().manual_seed(3)) * 0.3)
    w = (hf.weight.detach().float() + 1.0).to(DEVICE)  # what models/gemma.py loads
    got = rms_norm(x, w, 1e-6, residual)
    s = x if residual is None else x + residual
    want = hf.to(DEVICE)(s)
    ref = rms_norm_ref(x, w, 1e-6, residual)
    if with_residual:
        assert torch.equal(got[1], s) and torch.equal(ref[1], s)
        got, ref = got[0], ref[0]
    assert torch.equal(ref.cpu(), want.detach().cpu())  # the reference is HF's Gemma norm
    # the kernel's sum of squares runs in another order: one rounding step at most
    torch.testing.assert_close(got, want.detach(), atol=1e-3 if dtype == torch.float16 else 8e-3,
                               rtol=1e-3 if dtype == torch.float16 else 8e-3)
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1500])
def test_silu_and_mul(dtype, inter):
    g = gen(inter)
    x = randn(3, 4, 2 * inter, dtype=dtype, g=g) * 4
    got = silu_and_mul(x)
    assert got.shape == (3, 4, inter)
    tol = {torch.float32: (1e-5, 1.3e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
    want = silu_and_mul_ref(x)
    torch.testing.assert_close(got, want, atol=tol[dtype][0], rtol=tol[dtype][1])
    if dtype != torch.float32:  # HF's rounding steps are reproduced: nearly all bits equal
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1500])
def test_gelu_tanh_and_mul(dtype, inter):
    """Gemma's gelu_pytorch_tanh(gate) * up, against torch's own GELU (tanh approximation):
    the kernel writes 0.5 x (1 + tanh(u)) as x * sigmoid(2u)."""
    g = gen(inter + 1)
    x = randn(3, 4, 2 * inter, dtype=dtype, g=g) * 4
    x[0, 0, :8] = torch.tensor([-30.0, -10.0, -3.0, -0.5, 0.0, 0.5, 3.0, 30.0], dtype=dtype)
    got = gelu_tanh_and_mul(x)
    assert got.shape == (3, 4, inter)
    tol = {torch.float32: (1e-5, 1.3e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
    want = gelu_tanh_and_mul_ref(x)
    torch.testing.assert_close(got, want, atol=tol[dtype][0], rtol=tol[dtype][1])
    assert not torch.equal(got, silu_and_mul_ref(x))
    if dtype != torch.float32:  # HF's rounding steps are reproduced: nearly all bits equal
        assert (got == want).float().mean() > 0.99


def test_fused_ops_reject_bad_inputs():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="must be even"):
        gelu_tanh_and_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="rot_dim"):
        apply_rotary(torch.zeros(2, dtype=torch.long), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8),
                     torch.zeros(4, 10))


# ---------------------------------------------------------------- GPU: a pool past 2^31 elements


@pytest.mark.gpu
@gpu_only
def test_cache_writes_pool_past_2_pow_31_elements():
    bs, hkv, d, n = 16, 8, 128, 40
    num_blocks = (1 << 31) // (bs * hkv * d) + 4
    key_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    g = gen(5)
    slots = (num_blocks - 4) * bs + torch.randperm(4 * bs, generator=g, device="cuda")[:n]
    slots[3] = -1
    assert int(slots.max()) * hkv * d > (1 << 31)
    q, k, v = qkv_views(n, 32, hkv, d, torch.bfloat16, g)
    write_kv_cache(k, v, key_cache, value_cache, slots)
    keep = slots >= 0
    flat_k, flat_v = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])

    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    cache = compute_cos_sin_cache(inv_freq, 4096)
    positions = torch.randint(0, 4096, (n,), generator=g, device="cuda")
    k_ref = k.clone()
    apply_rotary_ref(positions, q.clone(), k_ref, cache)
    rotary_and_cache_write(positions, q, k, v, cache, key_cache, value_cache, slots)
    assert torch.equal(flat_k[slots[keep]], k[keep])
    torch.testing.assert_close(k, k_ref)
    del key_cache, value_cache

    width = 576
    mla_blocks = (1 << 31) // (bs * width) + 4
    kv_cache = torch.zeros(mla_blocks, bs, width, dtype=torch.bfloat16, device="cuda")
    latent = randn(n, width, dtype=torch.bfloat16, g=g)
    slots = (mla_blocks - 4) * bs + torch.randperm(4 * bs, generator=g, device="cuda")[:n]
    write_mla_cache(latent, kv_cache, slots)
    assert torch.equal(kv_cache.flatten(0, 1)[slots], latent)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("cfg", KV_WRITE_VARIANTS, ids=kv_write_name)
def test_write_kv_rows_gpu_bf16(cfg):
    """Every row-kernel variant the benchmark times, in bf16 at its shape (Llama-3-8B K/V
    views of a qkv output, block_size 16), against the reference: an exact copy."""
    g = gen(cfg.block_t)
    n, num_blocks, bs, hkv, d = 1000, 200, 16, 8, 128  # 1000: a partial last tile
    _, k, v = qkv_views(n, 32, hkv, d, torch.bfloat16, g)
    key_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    value_cache = torch.full_like(key_cache, float("nan"))
    slots = random_slots(n, num_blocks, bs, g, num_skipped=37)
    kc_ref, vc_ref = key_cache.clone(), value_cache.clone()
    write_kv_rows(k, v, key_cache, value_cache, slots, cfg)
    write_kv_cache_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(key_cache.nan_to_num(), kc_ref.nan_to_num())
    assert torch.equal(value_cache.nan_to_num(), vc_ref.nan_to_num())
    assert torch.equal(key_cache.isnan(), kc_ref.isnan())
