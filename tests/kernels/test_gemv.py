"""skinny_linear (decode-batch GEMM) against its PyTorch reference: fp32/fp16 on the CPU
under the interpreter, bf16 on the GPU; bias, ragged K and N, the SiLU·mul prologue."""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels.gemv import (
    CANDIDATES,
    ROW_CANDIDATES,
    GemvConfig,
    RowConfig,
    default_row_config,
    gemv_row,
    gemv_row_norm_ref,
    skinny_linear,
    skinny_linear_ref,
)
from flashpage.kernels.gemv_tune import pick_config

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def _check(m, n, k, dtype, bias, silu, cfg, atol, fn=skinny_linear, **kw):
    g = torch.Generator(device=DEV).manual_seed(m * 1000 + n + k)
    x = torch.randn(m, 2 * k if silu else k, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=DEV, dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(n, device=DEV, dtype=dtype, generator=g) if bias else None
    got = fn(x, w, b, cfg, silu_mul=silu, **kw)
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
    x = torch.zeros(17, 64)
    with pytest.raises(ValueError, match="1..16 rows"):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,bias,silu,cfg", [
    (48, 64, False, False, RowConfig(8, 32, 1)),     # two K tiles
    (37, 96, True, False, RowConfig(8, 64, 1)),      # ragged N and K (96 = 64 + 32)
    (16, 256, False, True, RowConfig(4, 64, 2)),     # SiLU·mul prologue, four K tiles
    (33, 80, True, True, RowConfig(16, 32, 1)),      # all of it, K not a multiple of 16
    (5, 24, False, False, None),                     # default tile: whole rows
    (21, 48, True, True, RowConfig(4, 64, 1)),       # whole rows wider than K, SiLU·mul
    (1, 40, True, False, None),                      # one output feature
])
def test_gemv_row_cpu(n, k, bias, silu, cfg, dtype):
    if GPU:
        pytest.skip("the CPU variant (interpreter)")
    _check(1, n, k, dtype, bias, silu, cfg, 1e-4 if dtype == torch.float32 else 2e-2, fn=gemv_row)


def test_gemv_row_rejects_bad_input():
    with pytest.raises(ValueError, match="one row, got 2"):
        gemv_row(torch.zeros(2, 64), torch.zeros(16, 64))
    with pytest.raises(ValueError, match="needs 128"):
        gemv_row(torch.zeros(1, 64), torch.zeros(16, 64), silu_mul=True)
    with pytest.raises(ValueError, match="dtype mismatch"):
        gemv_row(torch.zeros(1, 64), torch.zeros(16, 64, dtype=torch.float16))


def test_default_row_config(monkeypatch):
    monkeypatch.delenv("FLASHPAGE_GEMV_WHOLE_ROW", raising=False)
    assert default_row_config(6144, 4096) == RowConfig(4, 4096, 4)  # whole rows
    assert default_row_config(4096, 4096) == RowConfig(4, 4096, 4)
    assert default_row_config(1000, 96) == RowConfig(4, 128, 4)
    assert default_row_config(8192, 8192) == RowConfig(4, 8192, 8)
    assert default_row_config(4096, 14336) == RowConfig(16, 512, 8)  # long rows: looped
    assert default_row_config(4096, 14336, whole=True) == RowConfig(2, 16384, 8)  # a norm: whole
    monkeypatch.setenv("FLASHPAGE_GEMV_WHOLE_ROW", "16384")
    assert default_row_config(4096, 14336) == RowConfig(2, 16384, 8)
    monkeypatch.setenv("FLASHPAGE_GEMV_WHOLE_ROW", "1024")
    assert default_row_config(6144, 4096) == RowConfig(16, 512, 8)
    for bad in ("1000", "wide", "32768"):
        monkeypatch.setenv("FLASHPAGE_GEMV_WHOLE_ROW", bad)
        with pytest.raises(ValueError, match="FLASHPAGE_GEMV_WHOLE_ROW must be a power of two"):
            default_row_config(6144, 4096)


def _check_norm(n, k, dtype, bias, with_res, cfg, atol, pdl=None):
    g = torch.Generator(device=DEV).manual_seed(n + k)
    x = torch.randn(1, k, device=DEV, dtype=dtype, generator=g)
    res = torch.randn(1, k, device=DEV, dtype=dtype, generator=g) if with_res else None
    nw = torch.rand(k, device=DEV, dtype=dtype, generator=g) + 0.5
    w = torch.randn(n, k, device=DEV, dtype=dtype, generator=g) / k ** 0.5
    b = torch.randn(n, device=DEV, dtype=dtype, generator=g) if bias else None
    res_out = torch.full_like(x, float("nan")) if with_res else None
    got = gemv_row(x, w, b, cfg, norm=(nw, 1e-5), residual=res, residual_out=res_out, pdl=pdl)
    ref, s = gemv_row_norm_ref(x, w, nw, 1e-5, res, b)
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=atol)
    if with_res:
        torch.testing.assert_close(res_out, s, atol=0, rtol=0)  # one rounding, as torch's add


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,bias,with_res", [
    (40, 64, False, False), (37, 96, True, True), (9, 48, False, True),
])
def test_gemv_row_norm_prologue_cpu(n, k, bias, with_res, dtype):
    """rmsnorm(x + residual) * weight computed in the prologue, by every program; the first
    program writes x + residual."""
    if GPU:
        pytest.skip("the CPU variant (interpreter)")
    _check_norm(n, k, dtype, bias, with_res, RowConfig(8, triton_pow2(k), 1),
                1e-4 if dtype == torch.float32 else 2e-2)


def triton_pow2(k):
    return 1 << (k - 1).bit_length()


def test_gemv_row_norm_rejects_what_it_cannot_do():
    x, w, nw = torch.zeros(1, 64), torch.zeros(16, 64), torch.ones(64)
    with pytest.raises(ValueError, match="whole rows"):
        gemv_row(x, w, config=RowConfig(4, 32, 1), norm=(nw, 1e-5))
    with pytest.raises(ValueError, match="cannot be combined"):
        gemv_row(torch.zeros(1, 128), w, norm=(nw, 1e-5), silu_mul=True)
    with pytest.raises(ValueError, match="residual_out"):
        gemv_row(x, w, norm=(nw, 1e-5), residual=torch.zeros(1, 64))
    with pytest.raises(ValueError, match="residual needs norm"):
        gemv_row(x, w, residual=torch.zeros(1, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("cfg", ROW_CANDIDATES, ids=lambda c: c.name)
@pytest.mark.parametrize("n,k,bias,silu", [
    (6144, 4096, False, False), (4096, 14336, False, True), (1000, 896, True, False),
    (128256, 4096, False, False),
])
def test_gemv_row_gpu_bf16(n, k, bias, silu, cfg, pdl):
    _check(1, n, k, torch.bfloat16, bias, silu, cfg, 2e-2, fn=gemv_row, pdl=pdl)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("n,k,bias,with_res", [
    (6144, 4096, False, True), (28672, 4096, False, False), (1000, 896, True, True),
    (1536, 8192, False, True), (512, 14336, False, True),
])
def test_gemv_row_norm_prologue_gpu_bf16(n, k, bias, with_res, pdl):
    _check_norm(n, k, torch.bfloat16, bias, with_res, None, 2e-2, pdl=pdl)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gemv_row_pdl_chain_in_a_graph_reads_what_the_kernel_before_wrote():
    """gemv_row asks for its weights before the previous kernel has finished: in a CUDA
    graph of PDL kernels (an RMSNorm writing x, then the GEMV reading it, over and over,
    each GEMV's output the next norm's input) every result must still be the reference's."""
    from flashpage.kernels.rms_norm import rms_norm

    torch.manual_seed(0)
    d = 4096
    ws = [torch.randn(d, d, device="cuda", dtype=torch.bfloat16) / d ** 0.5 for _ in range(4)]
    nw = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    x0 = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)

    def chain(x, pdl):
        outs = []
        for w in ws * 3:
            h = rms_norm(x, nw, 1e-5, pdl=pdl)
            x = gemv_row(h, w, pdl=pdl)
            outs.append(x)
        return outs

    ref = chain(x0.clone(), False)
    xin = x0.clone()
    chain(xin, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain(xin, True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_llama_mlp_routes_one_row_through_gemv_row(monkeypatch):
    """With FLASHPAGE_GEMV on, a one-row input takes gemv_row (SiLU·mul fused into the down
    projection) and gives the plain path's result; two rows, or the switch off, do not."""
    from unittest import mock

    import flashpage.kernels.gemv as gemv
    from flashpage.layers.linear import set_row_gemv
    from flashpage.layers.ops import set_fused_ops
    from flashpage.models.llama import LlamaMLP

    torch.manual_seed(0)
    dtype = torch.bfloat16 if GPU else torch.float16
    mlp = LlamaMLP(64, 96).to(DEV, dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    set_fused_ops(mlp, True)
    assert set_row_gemv(mlp, True) == 2
    x = torch.randn(1, 64, device=DEV, dtype=dtype)
    monkeypatch.setenv("FLASHPAGE_GEMV", "0")
    plain = mlp(x)
    with mock.patch.object(gemv, "gemv_row", wraps=gemv.gemv_row) as spy:
        mlp(x)
        assert spy.call_count == 0
        monkeypatch.setenv("FLASHPAGE_GEMV", "1")
        fused = mlp(x)
        assert [c.kwargs.get("silu_mul", False) for c in spy.call_args_list] == [False, True]
        mlp(torch.randn(2, 64, device=DEV, dtype=dtype))
        assert spy.call_count == 2
    torch.testing.assert_close(fused, plain, atol=2e-2, rtol=2e-2)


class _FlattenQ(torch.nn.Module):
    def forward(self, q, k, v, md, positions, rotary):
        return q.reshape(q.shape[0], -1)


def test_llama_layers_hand_their_norms_to_the_gemv(monkeypatch):
    """Two Llama decoder layers at one row with FLASHPAGE_GEMV on: each RMSNorm goes into
    the prologue of the linear after it (no norm kernel runs), and hidden state and
    residual stream equal the unfused path's (attention stubbed: q flattened)."""
    from unittest import mock

    import flashpage.kernels.gemv as gemv
    import flashpage.kernels.rms_norm as rms
    from flashpage.config import ModelConfig
    from flashpage.layers.linear import set_row_gemv
    from flashpage.layers.ops import set_fused_ops
    from flashpage.models.llama import LlamaDecoderLayer

    torch.manual_seed(0)
    dtype = torch.bfloat16 if GPU else torch.float16
    cfg = ModelConfig(architecture="LlamaForCausalLM", model_type="llama", hidden_size=64,
                      intermediate_size=96, max_position_embeddings=64,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_hidden_layers=2, vocab_size=128, rms_norm_eps=1e-5)
    layers = [LlamaDecoderLayer(cfg, i, 64).to(DEV, dtype) for i in range(2)]
    for layer in layers:
        for p in layer.parameters():
            torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1)
        layer.self_attn.attn = _FlattenQ()
        set_fused_ops(layer, True)
        set_row_gemv(layer, True)

    def run():
        x, res = torch.randn(1, 64, device=DEV, dtype=dtype, generator=torch.Generator(
            device=DEV).manual_seed(1)), None
        for layer in layers:
            x, res = layer(torch.zeros(1, dtype=torch.long, device=DEV), x, res, None)
        return x, res

    monkeypatch.setenv("FLASHPAGE_GEMV", "0")
    plain = run()
    monkeypatch.setenv("FLASHPAGE_GEMV", "1")
    with mock.patch.object(gemv, "gemv_row", wraps=gemv.gemv_row) as spy, \
            mock.patch.object(rms, "rms_norm", wraps=rms.rms_norm) as norms:
        fused = run()
        assert norms.call_count == 0
        assert [c.kwargs.get("norm") is not None for c in spy.call_args_list] == \
            [True, False, True, False] * 2  # qkv, o_proj, gate_up, down per layer
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_a_linear_that_cannot_fuse_computes_the_pending_norm_first(monkeypatch):
    """PendingNorm given to a linear that does not run gemv_row (the switch off, or fp32
    weights): the norm runs first, x + residual lands in residual_out, and the result is
    norm-then-linear's."""
    from flashpage.layers.linear import ColumnParallelLinear, PendingNorm, set_row_gemv
    from flashpage.layers.norm import RMSNorm

    torch.manual_seed(0)
    lin = ColumnParallelLinear(32, 48).to(DEV)
    torch.nn.init.normal_(lin.weight, std=0.1)
    norm = RMSNorm(32, 1e-5).to(DEV)
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.1)
    assert set_row_gemv(lin, True) == 0  # fp32 weights: never ours
    monkeypatch.setenv("FLASHPAGE_GEMV", "1")
    x, res = torch.randn(1, 32, device=DEV), torch.randn(1, 32, device=DEV)
    res_out = torch.full_like(x, float("nan"))
    got = lin(PendingNorm(x, res, norm, res_out))
    h, s = norm(x, res)
    torch.testing.assert_close(got, lin(h))
    torch.testing.assert_close(res_out, s)
    torch.testing.assert_close(lin(PendingNorm(x, None, norm, None)), lin(norm(x)))
