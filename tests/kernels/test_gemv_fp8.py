"""FP8 weights in our decode GEMMs (kernels/gemv.py: W8A16, a scale per output row) and the
per-token activation quantizer of the W8A8 path (kernels/fp8_quant.py), against their torch
references: fp32/fp16 activations on the CPU under the interpreter, bf16 and
torch._scaled_mm on the GPU."""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels.fp8_quant import quantize_per_token, quantize_per_token_ref
from flashpage.kernels.gemv import (
    GemvConfig,
    RowConfig,
    gemv_row,
    gemv_row_norm_ref,
    skinny_linear,
    skinny_linear_ref,
)
from flashpage.layers.quant import (
    dequantize_fp8_rowwise,
    quantize_fp8_per_token,
    quantize_fp8_rowwise,
    w8a8_linear_ref,
)
from tests.kernels.test_fp8_kv import (  # noqa: F401  (autouse: torch's fp8 casts in the interpreter)
    exact_fp8_casts_in_the_interpreter,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
CPU_ONLY = pytest.mark.skipif(GPU, reason="the CPU variant (interpreter)")


def _weights(n, k, dtype, bias, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) / k ** 0.5
    w[0] *= 50.0  # rows of very different magnitude: one scale per row must follow them
    q, scale = quantize_fp8_rowwise(w)
    b = torch.randn(n, device=DEV, dtype=dtype, generator=g) if bias else None
    return q, scale, b, g


def _check(fn, m, n, k, dtype, bias, silu, cfg, atol):
    q, scale, b, g = _weights(n, k, dtype, bias, m * 1000 + n + k)
    x = torch.randn(m, 2 * k if silu else k, device=DEV, dtype=dtype, generator=g)
    got = fn(x, q, b, cfg, silu_mul=silu, scale=scale)
    ref = skinny_linear_ref(x, q, b, silu_mul=silu, scale=scale)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=atol)
    # The reference is the dequantized weight's linear (so the scale really is per row).
    deq = dequantize_fp8_rowwise(q, scale)
    if not silu:
        lin = (x.float() @ deq.t() + (b.float() if bias else 0)).to(dtype)
        torch.testing.assert_close(ref.float(), lin.float(), atol=atol, rtol=atol)


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,bias,silu", [
    (1, 48, 64, False, False), (3, 40, 96, True, False), (16, 16, 256, False, True),
    (2, 33, 80, True, True),
])
def test_skinny_linear_fp8_cpu(m, n, k, bias, silu, dtype):
    cfg = GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1)
    _check(skinny_linear, m, n, k, dtype, bias, silu, cfg, 1e-4 if dtype == torch.float32 else 2e-2)


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,bias,silu,cfg", [
    (48, 64, False, False, RowConfig(8, 32, 1)),     # looped, two K tiles
    (37, 96, True, False, RowConfig(8, 64, 1)),      # ragged N and K
    (16, 256, False, True, RowConfig(4, 64, 2)),     # SiLU·mul prologue
    (21, 48, True, True, RowConfig(4, 64, 1)),       # whole rows, SiLU·mul
    (5, 24, False, False, None),                     # default tile: whole rows
])
def test_gemv_row_fp8_cpu(n, k, bias, silu, cfg, dtype):
    _check(gemv_row, 1, n, k, dtype, bias, silu, cfg, 1e-4 if dtype == torch.float32 else 2e-2)


def _check_norm(n, k, dtype, bias, with_res, cfg, atol):
    q, scale, b, g = _weights(n, k, dtype, bias, n + k)
    x = torch.randn(1, k, device=DEV, dtype=dtype, generator=g)
    res = torch.randn(1, k, device=DEV, dtype=dtype, generator=g) if with_res else None
    nw = torch.rand(k, device=DEV, dtype=dtype, generator=g) + 0.5
    res_out = torch.full_like(x, float("nan")) if with_res else None
    got = gemv_row(x, q, b, cfg, norm=(nw, 1e-5), residual=res, residual_out=res_out, scale=scale)
    ref, s = gemv_row_norm_ref(x, q, nw, 1e-5, res, b, scale=scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=atol)
    if with_res:
        torch.testing.assert_close(res_out, s, atol=0, rtol=0)


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,bias,with_res", [(40, 64, False, False), (37, 96, True, True)])
def test_gemv_row_fp8_norm_prologue_cpu(n, k, bias, with_res, dtype):
    """The fused RMSNorm (+ residual) prologue over fp8 weights: the norm rounds in x's
    dtype, not w's."""
    _check_norm(n, k, dtype, bias, with_res, RowConfig(8, 1 << (k - 1).bit_length(), 1),
                1e-4 if dtype == torch.float32 else 2e-2)


def test_fp8_weights_need_their_scale():
    x = torch.zeros(1, 64)
    q = torch.zeros(16, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8 weights need their scale"):
        gemv_row(x, q)
    with pytest.raises(ValueError, match="fp8 weights need their scale"):
        skinny_linear(x, q)
    with pytest.raises(ValueError, match=r"contiguous fp32 \[16\]"):
        gemv_row(x, q, scale=torch.ones(8))
    with pytest.raises(ValueError, match=r"contiguous fp32 \[16\]"):
        skinny_linear(x, q, scale=torch.ones(16, dtype=torch.float16))
    with pytest.raises(ValueError, match="scale is for float8_e4m3fn weights"):
        gemv_row(x, torch.zeros(16, 64), scale=torch.ones(16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else []))
@pytest.mark.parametrize("m,k,block", [(1, 64, 2048), (5, 100, 2048), (3, 300, 64), (0, 64, 2048)])
def test_quantize_per_token_matches_torch_bit_for_bit(m, k, block, dtype):
    """One program per row, its amax over several tiles when K > block: the e4m3 bytes and
    the scales equal the torch reference's (and layers/quant's torch path) exactly; a zero
    row gets the floor scale and zeros, not NaN."""
    g = torch.Generator(device=DEV).manual_seed(m + k)
    x = (torch.randn(m, k, device=DEV, generator=g) * torch.logspace(-3, 3, max(m, 1), device=DEV)[:m, None]
         ).to(dtype)
    if m > 2:
        x[1] = 0
    q, s = quantize_per_token(x, block_k=block)
    rq, rs = quantize_per_token_ref(x)
    tq, ts = quantize_fp8_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (m, 1) and s.dtype == torch.float32
    assert torch.equal(s, rs) and torch.equal(s, ts)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), tq.view(torch.uint8))
    assert not q.float().isnan().any()
    if m:  # every row uses the top of e4m3's range: its largest value maps to +-448
        assert torch.all(q.float().abs().amax(dim=1)[x.abs().amax(dim=1) > 0] == 448)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_quantize_per_token_bit_for_bit_on_the_gpu():
    """The check above in the GPU runs' selection (-m gpu), bf16 included: the compiled
    kernel's fp32 -> e4m3 conversion rounds as torch's does."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m, k, block in [(5, 100, 2048), (3, 300, 64), (64, 14336, 2048)]:
            test_quantize_per_token_matches_torch_bit_for_bit(m, k, block, dtype)


def test_quantize_per_token_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        quantize_per_token(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="unsupported"):
        quantize_per_token(torch.zeros(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        quantize_per_token(torch.zeros(16, 4).t())


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k,bias,silu", [
    (1, 6144, 4096, False, False), (4, 4096, 14336, False, True), (16, 1000, 896, True, False),
])
def test_skinny_linear_fp8_gpu_bf16(m, n, k, bias, silu):
    _check(skinny_linear, m, n, k, torch.bfloat16, bias, silu, GemvConfig(), 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("n,k,bias,silu", [
    (6144, 4096, False, False), (4096, 14336, False, True), (1000, 896, True, False),
])
def test_gemv_row_fp8_gpu_bf16(n, k, bias, silu, pdl):
    q, scale, b, g = _weights(n, k, torch.bfloat16, bias, n + k)
    x = torch.randn(1, 2 * k if silu else k, device=DEV, dtype=torch.bfloat16, generator=g)
    got = gemv_row(x, q, b, silu_mul=silu, scale=scale, pdl=pdl)
    ref = skinny_linear_ref(x, q, b, silu_mul=silu, scale=scale)
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gemv_row_fp8_norm_prologue_gpu_bf16(n, k):
    _check_norm(n, k, torch.bfloat16, False, True, None, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,n,k,bias", [(17, 4096, 4096, False), (512, 6144, 4096, True),
                                        (64, 4096, 14336, False), (3, 1024, 256, True)])
def test_scaled_mm_matches_its_emulation(m, n, k, bias):
    """W8A8 through torch._scaled_mm (row-wise scales, the weight column-major as q.t())
    equals the fp32 emulation (the same fp8 operands and scales) to bf16 rounding, and
    stays close to the unquantized bf16 linear. Normwise: Hopper's e4m3 tensor cores keep
    ~14 mantissa bits between promotions to fp32 (DeepSeek-V3 report, 3.3.2), so a few of
    millions of sums land an ulp or two of bf16 off where fp32 would not (run 141: 70 of
    3.1M past an elementwise 2e-2); the whole stays within bf16's unit roundoff (2^-8)."""
    from flashpage.kernels.device import cuda_capability
    from flashpage.layers.quant import fp8_linear, scaled_mm_linear, scaled_mm_supported

    if cuda_capability(torch.device("cuda")) < (8, 9):
        pytest.skip("e4m3 tensor cores need sm_89+")
    g = torch.Generator(device="cuda").manual_seed(m + n)
    w = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    q, scale = quantize_fp8_rowwise(w)
    assert scaled_mm_supported(x, q)
    got = scaled_mm_linear(x, q, scale, b)
    ref = w8a8_linear_ref(x, q, scale, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = (got.float() - ref.float()).norm() / ref.float().norm()
    assert err < 2 ** -8, err
    torch.testing.assert_close(fp8_linear(x, q, scale, b), got, atol=0, rtol=0)
    full = torch.nn.functional.linear(x, w.bfloat16(), b).float()
    assert ((got.float() - full).norm() / full.norm()).item() < 0.06


def _compile_fp8_kernels() -> dict[str, str]:
    """The fp8 variants compiled for sm_90 (no GPU needed): name -> PTX."""
    from sm90 import compile_sm90

    from flashpage.kernels import fp8_quant, gemv

    out = {}
    for act in ("bf16", "fp16"):
        k = compile_sm90(gemv._gemv_kernel, dict(
            HAS_BIAS=True, HAS_SCALE=True, SILU_MUL=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256,
            EVEN_K=True), {"x_ptr": f"*{act}", "w_ptr": "*fp8e4nv", "b_ptr": f"*{act}",
                           "s_ptr": "*fp32", "y_ptr": f"*{act}"}, num_warps=4, num_stages=4)
        out[f"skinny_{act}"] = k.asm["ptx"]
    k = compile_sm90(fp8_quant._quant_rows_kernel, dict(FP8_MAX=448.0, MIN_SCALE=1e-12, BLOCK_K=2048),
                     {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}, num_warps=8, num_stages=1)
    out["quant_rows"] = k.asm["ptx"]
    return out


def test_fp8_kernels_compile_for_sm90():
    """On the CPU: the skinny GEMM widens e4m3 weights with the hardware conversion and
    runs its dots on tensor cores in the activations' dtype; the per-token quantizer stores
    through cvt.rn.satfinite (round to nearest even, clamped at 448, as torch's cast)."""
    from sm90 import run_compiled

    ptx = run_compiled("test_gemv_fp8", "_compile_fp8_kernels")
    assert "e4m3x2" in ptx["skinny_fp16"] and "mma" in ptx["skinny_fp16"]
    assert "e4m3x2" in ptx["skinny_bf16"] and "mma" in ptx["skinny_bf16"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx["quant_rows"]
