"""fused_moe_mxfp4 (the fused MoE kernel reading MXFP4 weights: e2m1 nibble pairs and e8m0
scales, dequantized in its K loop) against the 16-bit kernel on the same weights
dequantized (models/mxfp4.dequantize_mxfp4) and against the pure-torch reference.

CPU (interpreter), fp32 and fp16: the in-kernel decode of every byte at every scale (0 to
255: subnormal, overflow, inf) equals dequantize_mxfp4's; the experts' outputs equal the
16-bit kernel's on the dequantized weights bit for bit (ragged routing, an expert over
several blocks, experts nobody chose (their weights inf: never read), biases, the clamped
SwiGLU with both clamps binding, realistic scales 127 +- 10 and a few extreme ones) and the
reference's within the accumulation order; errors; no host sync (meta tensors).
GPU (marked gpu): the decode in bf16, gpt-oss-20b's expert shape against dequantize + the
16-bit kernel, a CUDA graph capture.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from test_fused_moe import _ShapeOnlyKernel  # tests/kernels

from flashpage.kernels import fused_moe as fm
from flashpage.kernels.fused_moe import (
    ClampedSwiGLU,
    FusedMoEConfig,
    dequantize_kernel_mxfp4,
    fused_moe,
    fused_moe_mxfp4,
    fused_moe_mxfp4_ref,
    num_blocks,
)
from flashpage.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
cpu_only = pytest.mark.skipif(GPU, reason="the CPU variant (interpreter)")


@triton.jit
def _decode_kernel(b_ptr, s_ptr, out_ptr, n_rows, k_bytes, k_groups,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [N, K] = the kernel's own MXFP4 tile decode (fm._mxfp4_tile), tile by tile."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 32)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < n_rows
    b_ptrs = b_ptr + offs_n[None, :] * k_bytes + offs_kb[:, None]
    s_ptrs = s_ptr + offs_n[None, :] * k_groups + offs_ks[:, None]
    for k0 in range(0, 2 * k_bytes, BLOCK_K):
        w = fm._mxfp4_tile(b_ptrs, s_ptrs, mask_n[None, :] & (offs_kb[:, None] >= 0),
                           mask_n[None, :] & (offs_ks[:, None] >= 0), BLOCK_K, BLOCK_N,
                           out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs_n[None, :] * (2 * k_bytes) + k0 + offs_k[:, None], w,
                 mask=mask_n[None, :])
        b_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 32


def every_byte_at_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [512, 128] (each row 128 bytes: rows alternate bytes 0-127 and 128-255),
    scales [512, 8] (every e8m0 value 0-255 at every byte, and in every group)."""
    n = 512
    blocks = (torch.arange(128)[None, :] + 128 * (torch.arange(n)[:, None] % 2)).to(torch.uint8)
    scales = ((torch.arange(n)[:, None] // 2 + 37 * torch.arange(8)[None, :]) % 256).to(torch.uint8)
    return blocks, scales


def assert_decode_exact(dtype: torch.dtype) -> None:
    blocks, scales = every_byte_at_every_scale()
    blocks, scales = blocks.to(DEV), scales.to(DEV)
    out = torch.full((blocks.shape[0], 256), 7.0, dtype=dtype, device=DEV)  # 7: no e2m1 value
    _decode_kernel[(triton.cdiv(blocks.shape[0], 16),)](
        blocks, scales, out, blocks.shape[0], 128, 8, BLOCK_K=128, BLOCK_N=16)
    want = dequantize_mxfp4(blocks.view(-1, 8, 16), scales, dtype)
    assert want.isinf().any() and (want != 0).any()  # scale 255, 254: overflow
    if GPU:
        # fp32 subnormal products (scale 0, and 0.5 at scale 1: below 2 ** -126) may be
        # flushed to zero by the GPU's fp32 multiply: either exact or zero there
        tiny = dequantize_mxfp4(blocks.view(-1, 8, 16), scales, torch.float32).abs() < 2.0 ** -126
        flushed = tiny & (out == 0)
        assert not (~tiny & (out == 0) & (want != 0)).any()
        out = torch.where(flushed, want, out)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(dequantize_kernel_mxfp4(blocks, scales, dtype), want, rtol=0,
                               atol=0, equal_nan=True)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_every_byte_at_every_scale(dtype):
    """The kernel's tile decode, value for value, is dequantize_mxfp4's: scale 0 (fp32's
    subnormal 2 ** -127), 1-254, 255 (inf); fp16 rounding its subnormals, overflowing to inf."""
    assert_decode_exact(dtype)


def routing(t: int, k: int, e: int, seed: int, crowd: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k ids per token; the first ``crowd`` tokens all pick experts 0..k-1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:crowd] = torch.arange(k)
    return ids.to(DEV), (torch.rand(t, k, generator=g) * 2).to(DEV)


def mxfp4_experts(e: int, h: int, inter: int, seed: int, gate_up_scales: tuple[int, int],
                  down_scales: tuple[int, int]):
    """Random bytes; scales uniform in each [lo, hi] (e8m0: 2 ** (s - 127))."""
    g = torch.Generator().manual_seed(seed)

    def rand(shape, lo=0, hi=255):
        return torch.randint(lo, hi + 1, shape, dtype=torch.uint8, generator=g).to(DEV)

    return (rand((e, 2 * inter, h // 2)), rand((e, 2 * inter, h // 32), *gate_up_scales),
            rand((e, h, inter // 2)), rand((e, h, inter // 32), *down_scales))


CASES = [  # t, k, e, hidden, inter, crowd
    (1, 4, 16, 64, 32, 0),      # one token: four blocks of one row
    (37, 4, 16, 96, 64, 20),    # ragged, 20 tokens on experts 0..3 (several blocks)
    (24, 2, 16, 64, 96, 24),    # every token on experts 0 and 1: 14 experts unused
    (5, 3, 8, 160, 96, 0),      # hidden, inter not multiples of the N tiles
]
SWIGLU = ClampedSwiGLU(alpha=1.702, limit=0.6)  # the projections pass it: both clamps bind


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "k", "e", "h", "inter", "crowd"), CASES)
def test_mxfp4_kernel_is_the_16_bit_kernel_on_dequantized_weights(t, k, e, h, inter, crowd, dtype):
    """Scales 127 +- 10 (gate_up; down 117-127 so fp16's range holds the outputs), x scaled
    to keep the projections O(1); the unused experts' scales 255 (inf weights) and a few
    extreme scales (1: 2 ** -126; 140: fp16's largest without overflow) in used ones. The MXFP4 kernel's outputs
    equal, bit for bit, the 16-bit kernel's on the weights dequantized to x's dtype (the
    "tile" form: the same tl.dot calls), and the reference's (dequantize, then
    fused_moe_ref) within accumulation order."""
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, seed=t, gate_up_scales=(117, 137),
                                         down_scales=(117, 127))
    ids, w = routing(t, k, e, seed=t + 1, crowd=crowd)
    unused = sorted(set(range(e)) - set(ids.unique().tolist()))
    gu_s[unused], d_s[unused] = 255, 255
    used = ids[0].tolist()
    gu_s[used[0], 0, 0], gu_s[used[0], 1, 0], d_s[used[-1], 2, 0] = 1, 140, 1
    gu_s[used[-1], 3, -1] = 140  # fp16's largest exact scale: a gate row huge, then clamped
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(t, h, generator=g) * 2.0 ** -10).to(DEV, dtype)
    gu_bias = (torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEV, dtype)
    d_bias = (torch.randn(e, h, generator=g) * 0.5).to(DEV, dtype)
    cfg = FusedMoEConfig(block_m=16, block_n=32, block_k=64)  # several N and K tiles
    kw = dict(gate_up_bias=gu_bias, down_bias=d_bias, activation=SWIGLU)
    got = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, cfg, **kw)
    gate_up = dequantize_kernel_mxfp4(gu_b, gu_s, dtype)
    down = dequantize_kernel_mxfp4(d_b, d_s, dtype)
    assert not unused or gate_up[unused].isinf().any()  # unused: every case but the second
    assert got.shape == (t, h) and got.dtype == dtype and torch.isfinite(got).all()
    assert torch.equal(got, fused_moe(x, gate_up, down, ids, w, cfg, **kw))
    want = fused_moe_mxfp4_ref(x, gu_b, gu_s, d_b, d_s, ids, w, **kw)
    scale = want.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(1.0, scale))
    # the test could fail: the clamps bind, the biases and the scales move the output
    h0 = x.float() @ gate_up[ids[0, 0]].float().T + gu_bias[ids[0, 0]].float()
    assert (h0[:, :inter] > SWIGLU.limit).any() and (h0[:, inter:].abs() > SWIGLU.limit).any()
    assert not torch.equal(got, fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, cfg))
    d_s2 = d_s.clone()
    d_s2[used[0]] += 1
    assert not torch.equal(got, fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s2, ids, w, cfg, **kw))


@cpu_only
def test_silu_without_biases_and_quantized_weights():
    """Mixtral-style experts (silu, no biases) whose weights went through quantize_mxfp4:
    the MXFP4 kernel equals the 16-bit kernel on dequantize_mxfp4's weights, at the default
    config (K tiles of 128: 4 scale groups) and at K tiles of one group."""
    t, k, e, h, inter = 9, 2, 8, 64, 64
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    (gu_b, gu_s), (d_b, d_s) = quantize_mxfp4(gate_up), quantize_mxfp4(down)
    gu_b, d_b = gu_b.flatten(-2), d_b.flatten(-2)  # [E, N, K / 32, 16] -> the kernel's [E, N, K / 2]
    ids, w = routing(t, k, e, seed=4)
    x = torch.randn(t, h, generator=g)
    got = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w)
    deq = (dequantize_kernel_mxfp4(gu_b, gu_s, torch.float32),
           dequantize_kernel_mxfp4(d_b, d_s, torch.float32))
    default = fm.default_config(t * k, e, torch.float32)  # "tile", 32 columns a tile
    assert default.mxfp4_form == "tile" and default.block_n == 32
    assert torch.equal(got, fused_moe(x, *deq, ids, w, default))
    one_group = FusedMoEConfig(block_m=16, block_n=16, block_k=32)  # a scale a K tile
    assert torch.equal(fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, one_group),
                       fused_moe(x, *deq, ids, w, one_group))
    # and near the unquantized experts' (4-bit weights: ~10-20% off, relative)
    exact = fm.fused_moe_ref(x, gate_up, down, ids, w)
    err = ((got - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.3, err


def test_mxfp4_errors():
    e, h, inter = 4, 64, 32
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, 0, (120, 130), (120, 130))
    x = torch.zeros(3, h, device=DEV)
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEV)
    w = torch.zeros(3, 2, device=DEV)
    with pytest.raises(ValueError, match="uint8"):
        fused_moe_mxfp4(x, gu_b.float(), gu_s, d_b, d_s, ids, w)
    with pytest.raises(ValueError, match="MXFP4 shapes disagree"):
        fused_moe_mxfp4(x, gu_b, gu_s[..., :1], d_b, d_s, ids, w)
    with pytest.raises(ValueError, match="MXFP4 shapes disagree"):
        fused_moe_mxfp4(torch.zeros(3, 32, device=DEV), gu_b, gu_s, d_b, d_s, ids, w)
    with pytest.raises(ValueError, match="3-D"):
        fused_moe_mxfp4(x, gu_b.view(e, 2 * inter, 2, 16), gu_s, d_b, d_s, ids, w)
    with pytest.raises(ValueError, match="fp32, fp16 or bf16"):
        fused_moe_mxfp4(x.double(), gu_b, gu_s, d_b, d_s, ids, w)
    with pytest.raises(ValueError, match="T = 3"):
        fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids[:2], w[:2])
    with pytest.raises(ValueError, match="block_k a multiple of 32"):
        fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, FusedMoEConfig(block_k=16))
    with pytest.raises(ValueError, match="'scaled'.*bf16 activations, got torch.float32"):
        fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, FusedMoEConfig(mxfp4_form="scaled"))
    # gpt-oss-20b (32 experts, top-4), bf16 (run 196): "swap" to 16 pairs an expert (16 rows
    # a block, 3 stages to 64 tokens; 32 rows, 1 stage at 128), then "scaled" at twice the mean
    cfgs = [fm.default_config(4 * t, 32, torch.bfloat16) for t in (1, 64, 128, 512)]
    assert [(c.mxfp4_form, c.block_m, c.num_stages) for c in cfgs] == [
        ("swap", 16, 3), ("swap", 16, 3), ("swap", 32, 1), ("scaled", 64, 3)]
    assert fm.default_config(4 * 128, 32).block_m == 16  # bf16 weights: the mean
    with pytest.raises(ValueError, match="mxfp4_form must be one of tile, scaled"):
        FusedMoEConfig(mxfp4_form="lut")
    out = fused_moe_mxfp4(x[:0], gu_b, gu_s, d_b, d_s, ids[:0], w[:0])
    assert out.shape == (0, h)


def test_mxfp4_no_host_sync_on_meta_tensors(monkeypatch):
    """The MXFP4 launcher on meta tensors (no data: a host sync would raise), kernels as
    shape-only stand-ins: gpt-oss-20b's shapes give the 16-bit launcher's grids."""
    grids: list = []
    for name in ("_align_kernel", "_gate_up_kernel", "_down_kernel"):
        monkeypatch.setattr(fm, name, _ShapeOnlyKernel(grids))
    meta = torch.device("meta")
    t, k, e, h, inter = 7, 4, 32, 2880, 2880
    u8 = dict(device=meta, dtype=torch.uint8)
    out = fused_moe_mxfp4(
        torch.empty(t, h, device=meta, dtype=torch.bfloat16),
        torch.empty(e, 2 * inter, h // 2, **u8), torch.empty(e, 2 * inter, h // 32, **u8),
        torch.empty(e, h, inter // 2, **u8), torch.empty(e, h, inter // 32, **u8),
        torch.empty(t, k, device=meta, dtype=torch.long), torch.empty(t, k, device=meta),
        FusedMoEConfig(block_m=16, block_n=64),
        gate_up_bias=torch.empty(e, 2 * inter, device=meta, dtype=torch.bfloat16),
        down_bias=torch.empty(e, h, device=meta, dtype=torch.bfloat16), activation=ClampedSwiGLU())
    nb = num_blocks(t * k, e, 16)
    assert out.shape == (t, h) and grids == [(1,), (inter // 64, nb), (h // 64, nb)]


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_every_byte_at_every_scale_gpu(dtype):
    """Compiled for the GPU: exact but where an fp32 subnormal product may be flushed."""
    assert_decode_exact(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", fm.MXFP4_FORMS)
@pytest.mark.parametrize(("t", "crowd"), [(1, 0), (8, 0), (64, 40), (128, 0)])
def test_mxfp4_gpu_bf16_gpt_oss_20b(t, crowd, form):
    """gpt-oss-20b's expert shape (E 32, top-4, hidden 2880, I 2880), its clamped SwiGLU at
    7.0 and biases, scales around its weights' (2 ** -7 +- 2 ** 4), default configs in each
    form: the MXFP4 kernel against dequantize + the bf16 kernel on the same tiles (bf16
    outputs: equal but where the forms' fp32 sums, in other orders, round apart)."""
    k, e, h, inter = 4, 32, 2880, 2880
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, seed=t, gate_up_scales=(116, 124),
                                         down_scales=(116, 124))
    g = torch.Generator().manual_seed(t)
    gu_bias = (torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEV, torch.bfloat16)
    d_bias = (torch.randn(e, h, generator=g) * 0.5).to(DEV, torch.bfloat16)
    ids, w = routing(t, k, e, seed=t + 2, crowd=crowd)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    swiglu = ClampedSwiGLU(1.702, 7.0)
    cfg = dataclasses.replace(fm.default_config(t * k, e), mxfp4_form=form)
    got = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w, cfg, gate_up_bias=gu_bias,
                          down_bias=d_bias, activation=swiglu)
    gate_up = dequantize_kernel_mxfp4(gu_b, gu_s, torch.bfloat16)
    down = dequantize_kernel_mxfp4(d_b, d_s, torch.bfloat16)
    want = fused_moe(x, gate_up, down, ids, w, cfg, gate_up_bias=gu_bias, down_bias=d_bias,
                     activation=swiglu)
    h0 = x.float() @ gate_up[ids[0, 0]].float().T
    assert (h0.abs() > 7.0).any()  # the clamps bind somewhere
    assert torch.isfinite(got).all()
    same = (got == want).float().mean().item()
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * max(1.0, scale))
    assert same >= 0.95, same


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_mxfp4_captures_in_a_cuda_graph():
    t, k, e, h, inter = 16, 4, 32, 512, 256
    gu_b, gu_s, d_b, d_s = mxfp4_experts(e, h, inter, 5, (118, 124), (118, 124))
    ids, w = routing(t, k, e, seed=6)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_mxfp4(x, gu_b, gu_s, d_b, d_s, ids, w)
    new_ids, new_w = routing(t, k, e, seed=7, crowd=t)
    ids.copy_(new_ids)
    w.copy_(new_w)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = fused_moe_mxfp4_ref(x, gu_b, gu_s, d_b, d_s, ids, w)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2 * max(1.0, scale))
