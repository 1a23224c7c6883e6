"""MLA's latents' expansion (kernels/mla_expand.py) against its torch reference, bit for bit:
the gather through the block tables and the K / V / q copies only move values, and the
matmul between them is the reference's own call.

CPU (Triton interpreter): fp32 and fp16, ragged lengths over scattered pages (a length-1
request, one ending on a page edge), head and head-dim counts that are no power of two,
queries as strided views; an fp8 latent cache widened as read; the plan's later calls
bound past Triton's dispatch; bad input named. GPU: bf16 at DeepSeek-V2-Lite's shape.
"""

from __future__ import annotations

import pytest
import torch

import flashpage.kernels.mla_expand as mx
from flashpage.kernels.mla_expand import MLAExpandPlan, mla_expand, mla_expand_ref

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_case(lens, heads, nope, rope, vd, rank, page, dtype, device, *, cache_dtype=None, seed=0):
    """A latent cache with every request's pages scattered over it, kv_b_proj's weight, and
    q_nope / q_pe as views of one wider [Nq, H, nope + 3 + rope] tensor."""
    g = torch.Generator().manual_seed(seed)
    per = [(n + page - 1) // page for n in lens]
    num_blocks = sum(per) + 3
    cache = torch.randn(num_blocks, page, rank + rope, generator=g).to(cache_dtype or dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width, used, rows = max(per), 0, []
    for k in per:
        rows.append(perm[used:used + k] + [0] * (width - k))
        used += k
    tables = torch.tensor(rows, dtype=torch.int32)
    w = (torch.randn(heads * (nope + vd), rank, generator=g) / rank**0.5).to(dtype)
    q = torch.randn(5, heads, nope + 3 + rope, generator=g).to(dtype).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(device) for t in (cache, tables, seq_lens, w)] + [q[..., :nope], q[..., nope + 3:]]


def check(lens, heads, nope, rope, vd, rank, page, dtype, device="cpu", **kw):
    cache, tables, seq_lens, w, q_nope, q_pe = make_case(lens, heads, nope, rope, vd, rank, page,
                                                        dtype, device, **kw)
    dims = dict(num_heads=heads, qk_nope_head_dim=nope, v_head_dim=vd)
    got = mla_expand(cache, tables, seq_lens, w, q_nope, q_pe, **dims)
    want = mla_expand_ref(cache, tables, seq_lens, w, q_nope, q_pe, **dims)
    total = sum(lens)
    shapes = [(5, heads, nope + rope), (total, heads, nope + rope), (total, heads, vd)]
    for name, g, r, shape in zip("qkv", got, want, shapes, strict=True):
        assert g.shape == shape and g.is_contiguous(), name
        assert torch.equal(g, r), name
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "lens,heads,nope,rope,vd,rank,page",
    [
        ([37], 4, 16, 8, 16, 32, 16),  # one request
        ([1, 16, 29], 3, 16, 8, 12, 20, 8),  # ragged: one entry, a page edge, odd dims
        ([50, 7], 20, 24, 16, 32, 48, 4),  # more heads than a program takes (two head blocks)
    ],
)
def test_mla_expand_matches_reference(lens, heads, nope, rope, vd, rank, page, dtype):
    q, k, v = check(lens, heads, nope, rope, vd, rank, page, dtype)
    assert k[:, 0, nope:].abs().sum() > 0 and torch.equal(k[:, 0, nope:], k[:, -1, nope:])


def test_mla_expand_fp8_cache_widened_as_read():
    """An fp8 latent cache: the entries widened to q's dtype (exactly) before the matmul."""
    check([9, 20], 2, 16, 8, 16, 32, 8, torch.float32, cache_dtype=torch.float8_e4m3fn)


def test_plan_binds_its_launches_once(monkeypatch):
    """The first run (the step's first layer) binds both kernels (FastLauncher.bind); later
    runs, over other caches and queries of the same geometry, launch the bound form."""
    binds: list[str] = []
    launches: list[str] = []
    for name in ("_GATHER_LAUNCH", "_EXPAND_LAUNCH"):
        launcher = getattr(mx, name)
        real_bind = launcher.bind

        def bind(grid, args, consts, options, varying, _real=real_bind, _name=name):
            binds.append(_name)
            launch = _real(grid, args, consts, options, varying=varying)
            return lambda a, _launch=launch, _n=_name: (launches.append(_n), _launch(a))

        monkeypatch.setattr(launcher, "bind", bind)
    cache, tables, seq_lens, w, q_nope, q_pe = make_case([13, 4], 2, 16, 8, 16, 32, 8,
                                                         torch.float32, "cpu")
    cu_k = torch.tensor([0, 13, 17], dtype=torch.int32)
    dims = dict(num_heads=2, qk_nope_head_dim=16, v_head_dim=16)
    plan = MLAExpandPlan(cache, tables, seq_lens, cu_k, 17, 13, w, q_nope, q_pe, **dims)
    for layer in range(3):  # each layer's own cache, weight and queries, the step's tables
        lc, _, _, lw, lqn, lqp = make_case([13, 4], 2, 16, 8, 16, 32, 8, torch.float32, "cpu",
                                           seed=layer)
        got = plan.run(lc, lw, lqn, lqp)
        want = mla_expand_ref(lc, tables, seq_lens, lw, lqn, lqp, **dims)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # the constexprs in signature order after every positional argument: else FastLauncher
    # keeps no compiled kernel and every GPU launch goes through the JIT (fast_launch.py)
    assert mx._GATHER_LAUNCH.params[9:] == list(plan._gather_consts)
    assert mx._EXPAND_LAUNCH.params[18:] == list(plan._expand_consts)
    assert binds == ["_GATHER_LAUNCH", "_EXPAND_LAUNCH"]
    assert launches == ["_GATHER_LAUNCH", "_EXPAND_LAUNCH"] * 2
    assert not plan.fits(cache[:2], w, q_nope, q_pe)
    with pytest.raises(ValueError, match="differ"):
        plan.run(cache[:2], w, q_nope, q_pe)


def test_bad_input_is_named():
    cache, tables, seq_lens, w, q_nope, q_pe = make_case([5], 2, 16, 8, 16, 32, 8, torch.float32, "cpu")
    dims = dict(num_heads=2, qk_nope_head_dim=16, v_head_dim=16)
    with pytest.raises(ValueError, match="kv_b_proj weight must be"):
        mla_expand(cache, tables, seq_lens, w[:-1], q_nope, q_pe, **dims)
    with pytest.raises(ValueError, match="int32"):
        mla_expand(cache, tables.long(), seq_lens, w, q_nope, q_pe, **dims)
    with pytest.raises(ValueError, match="q_nope must be"):
        mla_expand(cache, tables, seq_lens, w, q_nope[:, :1], q_pe, **dims)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        mla_expand(cache.half(), tables, seq_lens, w, q_nope, q_pe, **dims)
    with pytest.raises(ValueError, match="power of two"):
        mla_expand(cache[:, :6], tables, seq_lens, w, q_nope, q_pe, **dims)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_mla_expand_v2_lite_shape_bf16(cache_dtype):
    """DeepSeek-V2-Lite: 16 heads, nope 128, rope 64, v 128, rank 512, block 16; a mixed
    step's prompt part (a 128-token prompt, a prefix hit, a short one)."""
    check([128, 300, 16], 16, 128, 64, 128, 512, 16, torch.bfloat16, "cuda", cache_dtype=cache_dtype)
