"""kernels/layer_norm.py against its pure-torch reference (torch's layer_norm in fp32, rounded
once), in the interpreter on the CPU (fp32, fp16) and on the GPU (bf16, fp32, CUDA graphs):
widths not a power of two, one row and many, with and without weight, bias and residual,
per-head weights over strided q views; bad input is a clear error."""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels.layer_norm import layer_norm, layer_norm_ref

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
# The interpreter computes bf16 wrongly: bf16 only on the GPU.
DTYPES = [torch.bfloat16, torch.float32] if GPU else [torch.float32, torch.float16]
# (atol, rtol): the kernel's fp32 sums run in another order than torch's, so fp32 differs
# by a few ulp and a 16-bit result by at most one rounding step, rarely.
TOL = {torch.float32: (1e-5, 1.3e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
# which of weight, bias, residual each case has: Cohere's (weight), Starcoder2's (both),
# OLMo 1's (neither), and a bias alone
PARAMS = [(True, False), (True, True), (False, False), (False, True)]


def randn(*shape, dtype, g, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale + shift).to(dtype)


def check(got, want, dtype, residual: bool):
    if residual:
        assert torch.equal(got[1], want[1])  # the sum, rounded once to x's dtype
        got, want = got[0], want[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    if dtype != torch.float32:  # one rounding of the same fp32 value: nearly all bits equal
        assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 100), (7, 48), (300, 48), (5, 1000), (2, 4096), (33, 3)])
@pytest.mark.parametrize("has_weight,has_bias", PARAMS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm(dtype, rows, width, has_weight, has_bias, with_residual):
    g = torch.Generator(device=DEVICE).manual_seed(rows * 10007 + width)
    x = randn(rows, width, dtype=dtype, g=g, scale=3.0, shift=1.5)  # a mean far from 0
    w = randn(width, dtype=dtype, g=g) if has_weight else None
    b = randn(width, dtype=dtype, g=g) if has_bias else None
    r = randn(rows, width, dtype=dtype, g=g) if with_residual else None
    before = x.clone(), None if r is None else r.clone()
    got = layer_norm(x, w, b, 1e-5, r)
    check(got, layer_norm_ref(x, w, b, 1e-5, r), dtype, with_residual)
    assert torch.equal(x, before[0]) and (r is None or torch.equal(r, before[1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_and_strided_rows(dtype):
    """x [2, 3, W] and rows of a wider buffer (a row stride > W): out is x's shape, contiguous."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    w, b = randn(80, dtype=dtype, g=g), randn(80, dtype=dtype, g=g)
    x = randn(2, 3, 80, dtype=dtype, g=g, scale=2.0)
    r = randn(2, 3, 80, dtype=dtype, g=g)
    check(layer_norm(x, w, b, 1e-6, r), layer_norm_ref(x, w, b, 1e-6, r), dtype, True)
    wide = randn(9, 200, dtype=dtype, g=g, scale=2.0)[:, 50:130]
    res = randn(9, 300, dtype=dtype, g=g)[:, 7:87]
    got = layer_norm(wide, w, None, 1e-6, res)
    assert got[0].is_contiguous() and got[1].is_contiguous()
    check(got, layer_norm_ref(wide, w, None, 1e-6, res), dtype, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 19])
def test_per_head_weights_over_q_of_a_qkv_output(dtype, n):
    """Command-R+'s q/k norms: weight [heads, head_dim], a row per head, over q and k that are
    strided views of one qkv projection output (as models/llama.py reshapes them); a
    [heads, head_dim] bias beside a weight, and a [W] bias beside a per-head weight."""
    hq, hk, d = 6, 2, 40
    g = torch.Generator(device=DEVICE).manual_seed(n)
    qkv = randn(n, (hq + 2 * hk) * d, dtype=dtype, g=g, scale=2.0, shift=0.5)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.reshape(n, hq, d), k.reshape(n, hk, d)
    assert n == 1 or q.stride(0) == (hq + 2 * hk) * d  # rows of the qkv buffer
    for x, h in ((q, hq), (k, hk)):
        w = randn(h, d, dtype=dtype, g=g, shift=1.0)
        assert not torch.equal(w[0], w[1])
        check(layer_norm(x, w, None, 1e-3), layer_norm_ref(x, w, None, 1e-3), dtype, False)
        b = randn(h, d, dtype=dtype, g=g)
        check(layer_norm(x, w, b, 1e-3), layer_norm_ref(x, w, b, 1e-3), dtype, False)
        b1 = randn(d, dtype=dtype, g=g)
        check(layer_norm(x, w, b1, 1e-3), layer_norm_ref(x, w, b1, 1e-3), dtype, False)
        r = randn(n, h, d, dtype=dtype, g=g)
        check(layer_norm(x, w, b, 1e-3, r), layer_norm_ref(x, w, b, 1e-3, r), dtype, True)
    # each head really takes its own row: head 0's weight on every head gives another result
    w = randn(hq, d, dtype=dtype, g=g, shift=1.0)
    assert not torch.equal(layer_norm(q, w, None, 1e-3), layer_norm(q, w[0], None, 1e-3))


def test_no_rows():
    x = torch.empty(0, 64, device=DEVICE)
    out, res = layer_norm(x, torch.ones(64, device=DEVICE), None, 1e-5, torch.empty_like(x))
    assert out.shape == res.shape == (0, 64)


@pytest.mark.parametrize("args,message", [
    (lambda x: (x, torch.ones(63), None), r"weight must be \[64\] or \[4, 64\] for x of shape \(4, 64\), got \(63,\)"),
    (lambda x: (x, None, torch.ones(2, 64)), r"bias must be \[64\] or \[4, 64\]"),
    (lambda x: (x[0], torch.ones(4, 64), None), r"weight must be \[64\] for x of shape \(64,\)"),
    (lambda x: (x.int(), None, None), "x must be floating point, got torch.int32"),
    (lambda x: (torch.ones(1, 65537), None, None), "normalized size 65537 is larger than the supported 65536"),
])
def test_bad_input_is_a_clear_error(args, message):
    with pytest.raises(ValueError, match=message):
        layer_norm(*args(torch.randn(4, 64)), 1e-5)
    with pytest.raises(ValueError, match=r"residual must match x \(torch.float32 \(4, 64\)\), got "
                                         r"torch.float16 \(4, 64\)"):
        layer_norm(torch.randn(4, 64), None, None, 1e-5, torch.randn(4, 64).half())


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_bf16_graphs_and_torch_cuda(pdl):
    """bf16 at model widths (Command-R's 8192, Starcoder2-15B's 6144, 128-wide heads): the
    reference's bits nearly everywhere; fp32 against torch's own CUDA layer_norm (the
    Starcoder2 nn.LayerNorm transformers runs); a CUDA graph replays the eager result, the
    second eager call (FastLauncher's compiled kernel) too, PDL on or off."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, width in ((1, 8192), (37, 6144), (4096, 4096), (3000, 128)):
        for dtype in (torch.bfloat16, torch.float32):
            x = randn(rows, width, dtype=dtype, g=g, scale=3.0, shift=1.0)
            r = randn(rows, width, dtype=dtype, g=g)
            w, b = randn(width, dtype=dtype, g=g), randn(width, dtype=dtype, g=g)
            eager = layer_norm(x, w, b, 1e-5, r, pdl=pdl)
            check(eager, layer_norm_ref(x, w, b, 1e-5, r), dtype, True)
            if dtype == torch.float32:
                want = torch.nn.functional.layer_norm(x + r, (width,), w, b, 1e-5)
                torch.testing.assert_close(eager[0], want, atol=1e-5, rtol=1.3e-6)
            again = layer_norm(x, w, b, 1e-5, r, pdl=pdl)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = layer_norm(x, w, b, 1e-5, r, pdl=pdl)
            for t in captured:
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for e, a, c in zip(eager, again, captured, strict=True):
                assert torch.equal(e, a) and torch.equal(e, c)
