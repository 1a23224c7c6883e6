"""MLA's absorbed decode projections (kernels/mla_absorb.py) against layers/mla.py's torch
forms: CPU under the interpreter in fp32 and fp16, the GPU in bf16 at DeepSeek's shapes."""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels.mla_absorb import MAX_TOKENS, absorb_output, absorb_query
from flashpage.layers.mla import mla_absorb_output, mla_absorb_query

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def _case(n, heads, nope, rope, v_dim, rank, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(heads * (nope + v_dim), rank, generator=g) / rank**0.5).to(dtype).to(DEVICE)
    q_nope = torch.randn(n, heads, nope, generator=g).to(dtype).to(DEVICE)
    q_pe = torch.randn(n, heads, rope, generator=g).to(dtype).to(DEVICE)
    o_lat = torch.randn(n, heads, rank, generator=g).to(dtype).to(DEVICE)
    return w, q_nope, q_pe, o_lat


def _check(n, heads, nope, rope, v_dim, rank, dtype):
    w, q_nope, q_pe, o_lat = _case(n, heads, nope, rope, v_dim, rank, dtype, seed=n + heads)
    rtol, atol = TOL[dtype]
    ref_q = mla_absorb_query(q_nope.float(), q_pe.float(), w.float(), heads, nope, v_dim)
    got_q = absorb_query(q_nope, q_pe, w, heads, nope, v_dim)
    assert got_q.shape == (n, heads, rank + rope) and got_q.dtype == dtype
    torch.testing.assert_close(got_q.float(), ref_q, rtol=rtol, atol=atol)
    assert torch.equal(got_q[..., rank:], q_pe)  # copied, not computed
    ref_o = mla_absorb_output(o_lat.float(), w.float(), heads, nope, v_dim)
    got_o = absorb_output(o_lat, w, heads, nope, v_dim)
    assert got_o.shape == (n, heads, v_dim) and got_o.dtype == dtype
    torch.testing.assert_close(got_o.float(), ref_o, rtol=rtol, atol=atol * 4)


# (tokens, heads, nope, rope, v_dim, rank): one token and MAX_TOKENS; dims that are not
# powers of two or under 16 (tiny checkpoints), v_dim unlike nope, a rank past one tile
CPU_CASES = [(1, 4, 16, 8, 16, 64), (3, 2, 24, 16, 8, 96), (MAX_TOKENS, 3, 8, 4, 32, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_absorb_matches_torch(case, dtype):
    if GPU and dtype == torch.float16:
        pytest.skip("the CPU cases (interpreter); the GPU runs bf16 below")
    _check(*case, dtype)


def test_rejects_too_many_tokens():
    w, q_nope, q_pe, o_lat = _case(MAX_TOKENS + 1, 2, 16, 8, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="N <= 16"):
        absorb_query(q_nope, q_pe, w, 2, 16, 16)
    with pytest.raises(ValueError, match="N <= 16"):
        absorb_output(o_lat, w, 2, 16, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])  # DeepSeek-V2-Lite, V3
@pytest.mark.parametrize("n", [1, 5, MAX_TOKENS])
def test_absorb_gpu_bf16(heads, n):
    _check(n, heads, 128, 64, 128, 512, torch.bfloat16)
