"""Why the swapped fused fp8 MoE form dots fp16, not e4m3 (kernels/fused_moe_fp8.py,
``FusedMoEFp8Config.swap_mma``): Hopper's e4m3 warpgroup MMA (QGMMA) keeps 13 fraction
bits in its fp32 accumulator, cut toward zero, where the fp16 MMAs' sums of e4m3 products
are fp32's. Replayed in torch on the CPU: the W8A8 pipeline the kernels run (x quantized
per token per 128 columns, each 128-wide K tile's sum times both scales, the projections
rounded to bf16, silu(gate) * up, the activation quantized again, down, the routing
weights), with each K tile's sum either exact (fp32: what the unswapped 16- and 32-row
tiles' HMMAs and the swapped form's fp16 wgmmas make) or as QGMMA makes it (four 32-wide
steps, each D = C + its products, cut to 13 fraction bits). The first is
fused_moe_fp8_ref to the bit; the second sits 0.2-0.6% (in norm) away, as the e4m3
swapped form did on the H200 (runs 202, 204: 0.45-0.62%), though each tile sum moves by
~1e-4 of itself: a projection a bf16 step apart moves the activation's e4m3 code or its
group's scale, and that moves the output by e4m3 steps. GPU (marked gpu, sm_90): one
e4m3 wgmma and one fp16 wgmma on constructed operands show the 13 bits and the cut.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from test_fused_moe_fp8 import _case, _rel  # tests/kernels

from flashpage.kernels.fp8_block_ref import quantize_per_token_group_ref
from flashpage.kernels.fused_moe_fp8 import fused_moe_fp8_ref

GPU = torch.cuda.is_available()
B = 128
QGMMA_K = 32  # K of one e4m3 wgmma
QGMMA_FRACTION_BITS = 13


def _cut(v: torch.Tensor, bits: int) -> torch.Tensor:
    """fp64 ``v`` with ``bits`` fraction bits kept, cut toward zero."""
    m, e = torch.frexp(v)  # |m| in [0.5, 1)
    scale = 2.0 ** (bits + 1)
    return torch.ldexp(torch.trunc(m * scale) / scale, e)


def _tile_sums(xq: torch.Tensor, q: torch.Tensor, mma: str) -> torch.Tensor:
    """xq [P, K], q [N, K] e4m3 -> each 128-wide K tile's dot [P, N, K / 128] (fp32 values
    in fp64). Sums of 32 e4m3 products are exact in fp64 (8-bit products within 2^-18 ..
    2^18)."""
    p, k = xq.shape
    steps = torch.einsum("pcj,ncj->pnc", xq.double().view(p, k // QGMMA_K, QGMMA_K),
                         q.double().view(q.shape[0], k // QGMMA_K, QGMMA_K))
    steps = steps.view(p, q.shape[0], k // B, B // QGMMA_K)
    if mma == "exact":
        return steps.sum(-1).float().double()
    acc = torch.zeros_like(steps[..., 0])
    for j in range(B // QGMMA_K):  # the wgmmas of one K tile, chained through C
        acc = _cut(acc + steps[..., j], QGMMA_FRACTION_BITS)
    return acc.float().double()


def _linear(x: torch.Tensor, q: torch.Tensor, ws: torch.Tensor, mma: str) -> torch.Tensor:
    """One W8A8 projection as the kernels run it: acc = fma(tile sum, xs * ws, acc) per K
    tile, rounded to x's dtype."""
    xq, xs = quantize_per_token_group_ref(x, B)
    sums = _tile_sums(xq, q, mma)
    wsn = ws.repeat_interleave(B, 0)
    acc = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float32)
    for g in range(sums.shape[-1]):
        acc = (acc.double() + sums[..., g] * (xs[:, g:g + 1] * wsn[None, :, g]).double()).float()
    return acc.to(x.dtype)


def _replayed_moe(x, gu, gus, d, ds, ids, w, mma: str) -> torch.Tensor:
    """fused_moe_fp8's W8A8 pipeline with each K tile dotted as ``mma`` does."""
    inter = gu.shape[1] // 2
    ys = torch.zeros(*ids.shape, x.shape[1], dtype=x.dtype)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        proj = _linear(x[tok], gu[e], gus[e], mma)
        act = torch.nn.functional.silu(proj[:, :inter]) * proj[:, inter:]
        ys[tok, slot] = (_linear(act, d[e], ds[e], mma) * w[tok, slot, None]).to(x.dtype)
    return ys.sum(1)


def test_cut_keeps_13_fraction_bits_toward_zero():
    v = torch.tensor([256 + 3 * 2.0 ** -7, -(256 + 3 * 2.0 ** -7), 256 + 2.0 ** -5, 1 + 2.0 ** -9],
                     dtype=torch.float64)
    assert _cut(v, 13).tolist() == [256.0, -256.0, 256 + 2.0 ** -5, 1 + 2.0 ** -9]


@pytest.mark.skipif(GPU, reason="CPU replay (the experts are made on the CPU)")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_e4m3_accumulator_moves_the_output_half_a_percent(seed):
    """bf16, top-8 of 16 experts, H 1024, I 256, 8 tokens: exact tile sums replay
    fused_moe_fp8_ref to the bit; QGMMA's sums (each off by at most four cuts of 2^-13 of
    its products' magnitudes, half of them by less than one) put the output 0.1-2% away
    (0.25, 0.38, 0.51% for these seeds)."""
    x, gu, gus, d, ds, ids, w = _case(8, 8, 16, 1024, 256, seed=seed)
    x = x.bfloat16()
    want = fused_moe_fp8_ref(x, gu, gus, d, ds, ids, w, w8a8=True)
    assert torch.equal(_replayed_moe(x, gu, gus, d, ds, ids, w, "exact"), want)
    xq, _ = quantize_per_token_group_ref(x, B)
    q = gu[ids[0, 0].item()]
    exact, cut = _tile_sums(xq, q, "exact"), _tile_sums(xq, q, "qgmma")
    magnitude = torch.einsum("pgk,ngk->png", xq.double().abs().view(8, -1, B),
                             q.double().abs().view(q.shape[0], -1, B))
    err = (cut - exact).abs()
    assert (err <= magnitude * 4 * 2.0 ** -QGMMA_FRACTION_BITS).all() and err.max() > 0
    assert (err / magnitude).median() < 2.0 ** -QGMMA_FRACTION_BITS
    assert 1e-3 < _rel(_replayed_moe(x, gu, gus, d, ds, ids, w, "qgmma"), want) < 2e-2


# ----------------------------------------------------------------------------- GPU
@triton.jit
def _one_wgmma_kernel(a_ptr, b_ptr, out_ptr, F16: tl.constexpr):
    """out [64, 16] = a [64, 32] @ b [16, 32]^T, e4m3, one warpgroup MMA (fp32 out)."""
    m = tl.arange(0, 64)
    n = tl.arange(0, 16)
    k = tl.arange(0, 32)
    a = tl.load(a_ptr + m[:, None] * 32 + k[None, :])
    b = tl.load(b_ptr + n[:, None] * 32 + k[None, :])
    if F16:
        a = a.to(tl.float16)
        b = b.to(tl.float16)
    tl.store(out_ptr + m[:, None] * 16 + n[None, :], tl.dot(a, tl.trans(b)))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_e4m3_wgmma_keeps_13_fraction_bits():
    """sm_90: rows of two e4m3 products against ones. e4m3 wgmma: 256 + 3 * 2^-7 (15
    fraction bits) comes back 256 (cut, not rounded to 256 + 2^-5), -256 - 3 * 2^-7 comes
    back -256 (toward zero), 256 + 2^-5 and 1 + 2^-9 (13 bits or fewer) whole. fp16 wgmma
    on the same values (widened): each exact, as fp32 holds them."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper's e4m3 wgmma")
    pairs = [(256.0, 3 * 2.0 ** -7), (-256.0, -3 * 2.0 ** -7), (256.0, 2.0 ** -5), (1.0, 2.0 ** -9)]
    a = torch.zeros(64, 32, device="cuda")
    for i, (hi, lo) in enumerate(pairs):
        a[i, 0], a[i, 1] = hi, lo
    a = a.to(torch.float8_e4m3fn)
    b = torch.ones(16, 32, device="cuda").to(torch.float8_e4m3fn)
    exact = [hi + lo for hi, lo in pairs]
    got = {}
    for f16 in (False, True):
        out = torch.empty(64, 16, device="cuda")
        k = _one_wgmma_kernel[(1,)](a, b, out, F16=f16, num_warps=4)
        mma = "m64n16k16.f32.f16.f16" if f16 else "m64n16k32.f32.e4m3.e4m3"
        assert f"wgmma.mma_async.sync.aligned.{mma}" in k.asm["ptx"]
        got[f16] = out[:4, 0].tolist()
        assert (out[:4] == out[:4, :1]).all() and (out[4:] == 0).all()
    assert got[True] == exact
    assert got[False] == [256.0, -256.0, 256 + 2.0 ** -5, 1 + 2.0 ** -9], got[False]
