"""skinny_linear (decode-batch GEMM) against its PyTorch reference: fp32/fp16 on the CPU
under the interpreter, bf16 on the GPU; bias, ragged K and N, the SiLU·mul prologue."""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels.gemv import (
    CANDIDATES,
    GemvConfig,
    pick_config,
    skinny_linear,
    skinny_linear_ref,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _check(m, n, k, dtype, bias, silu, cfg, atol):
    g = torch.Generator(device=DEV).manual_seed(m * 1000 + n + k)
    x = torch.randn(m, 2 * k if silu else k, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(n, device=DEV, dtype=dtype, generator=g) if bias else None
    got = skinny_linear(x, w, b, cfg, silu_mul=silu)
    ref = skinny_linear_ref(x, w, b, silu_mul=silu)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,bias,silu", [
    (1, 48, 64, False, False), (3, 40, 96, True, False), (8, 16, 256, False, True),
    (2, 33, 80, True, True),
])
def test_skinny_linear_cpu(m, n, k, bias, silu, dtype):
    if GPU:
        pytest.skip("the CPU variant (interpreter)")
    cfg = GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1)
    _check(m, n, k, dtype, bias, silu, cfg, 1e-4 if dtype == torch.float32 else 2e-2)


def test_rejects_bad_shapes():
    x = torch.zeros(9, 64)
    with pytest.raises(ValueError, match="1..8 rows"):
        skinny_linear(x, torch.zeros(16, 64))
    with pytest.raises(ValueError, match="needs 128"):
        skinny_linear(torch.zeros(1, 64), torch.zeros(16, 64), silu_mul=True)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cfg", CANDIDATES, ids=lambda c: c.name)
@pytest.mark.parametrize("m,n,k,bias,silu", [
    (1, 6144, 4096, False, False), (4, 4096, 14336, False, True), (8, 1000, 896, True, False),
])
def test_skinny_linear_gpu_bf16(m, n, k, bias, silu, cfg):
    _check(m, n, k, torch.bfloat16, bias, silu, cfg, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_pick_config_times_every_candidate():
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    best, times = pick_config(w, 1, iters=3)
    assert set(times) == {"cublas", *(c.name for c in CANDIDATES)}
    assert best is None or times[best.name] < times["cublas"]


def test_llama_mlp_routes_tuned_rows_through_the_skinny_kernel():
    """A layer tuned for M rows runs ours (SiLU·mul fused into the down projection) and
    gives the plain path's result; other row counts stay on the plain path."""
    from unittest import mock

    from flashpage.layers.ops import set_fused_ops
    from flashpage.models.llama import LlamaMLP

    torch.manual_seed(0)
    dtype = torch.bfloat16 if GPU else torch.float32  # fp32 dots on a GPU would be tf32
    mlp = LlamaMLP(64, 96).to(DEV, dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    set_fused_ops(mlp, True)
    x = torch.randn(2, 64, device=DEV, dtype=dtype)
    plain = mlp(x)
    cfg = GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1)
    mlp.gate_up_proj.skinny = {2: cfg}
    mlp.down_proj.skinny = {2: cfg}
    import flashpage.kernels.gemv as gemv

    with mock.patch.object(gemv, "skinny_linear", wraps=gemv.skinny_linear) as spy:
        fused = mlp(x)
        assert [c.kwargs.get("silu_mul", False) for c in spy.call_args_list] == [False, True]
        mlp(torch.randn(3, 64, device=DEV, dtype=dtype))  # 3 rows: not tuned
        assert spy.call_count == 2
    tol = 2e-2 if GPU else 1e-4
    torch.testing.assert_close(fused, plain, atol=tol, rtol=tol)
