"""fused_moe (grouped MoE experts, routed weights only) against its PyTorch reference:
the on-device alignment element for element, the experts fp32/fp16 on the CPU under the
interpreter (silu, and GPT-OSS's biases with its clamped SwiGLU), bf16 and CUDA-graph
capture on the GPU; no host sync (meta tensors)."""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels import fused_moe as fm
from flashpage.kernels.fused_moe import (
    ClampedSwiGLU,
    FusedMoEConfig,
    fused_moe,
    fused_moe_ref,
    moe_align,
    moe_align_ref,
    num_blocks,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def routing(t: int, k: int, e: int, seed: int, crowd: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k ids per token; the first ``crowd`` tokens all pick experts 0..k-1
    (one expert then spans several blocks). Weights fp32 in [0, 2)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:crowd] = torch.arange(k)
    return ids.to(DEV), (torch.rand(t, k, generator=g) * 2).to(DEV)


def weights(e: int, h: int, inter: int, dtype: torch.dtype, seed: int):
    """gate_up [E, 2I, H], down [E, H, I], scaled so outputs stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    return gate_up.to(DEV, dtype), down.to(DEV, dtype)


# ----------------------------------------------------------------- alignment
@pytest.mark.parametrize(("t", "k", "e", "block_m", "crowd"), [
    (1, 6, 64, 16, 0), (3, 2, 8, 16, 0), (40, 6, 64, 16, 0), (70, 3, 8, 16, 70),
    (50, 6, 64, 32, 30), (9, 1, 5, 64, 0), (33, 4, 160, 16, 10),
    (10, 6, 64, 16, 0), (11, 6, 64, 16, 5),  # 60 pairs: tiles sized to the work; 66: not
])
def test_align_matches_reference_and_groups_every_pair_once(t, k, e, block_m, crowd):
    ids, _ = routing(t, k, e, seed=t + k, crowd=crowd)
    pairs, block_expert = moe_align(ids, e, block_m)
    want_pairs, want_blocks = moe_align_ref(ids, e, block_m)
    assert torch.equal(pairs, want_pairs) and torch.equal(block_expert, want_blocks)
    nb = num_blocks(t * k, e, block_m)
    assert pairs.shape == (nb * block_m,) and block_expert.shape == (nb,)
    # Each pair exactly once; padding marked t * k; every row in a block of its expert.
    real = pairs[pairs < t * k].long()
    assert torch.equal(real.sort().values, torch.arange(t * k, device=DEV))
    assert (pairs[pairs >= t * k] == t * k).all()
    row_expert = block_expert.long().repeat_interleave(block_m)
    valid = pairs < t * k
    assert torch.equal(row_expert[valid], ids.reshape(-1)[pairs[valid].long()])
    # Used blocks first, then only -1; unused experts own no block.
    used = (block_expert >= 0).sum()
    assert (block_expert[:used] >= 0).all() and (block_expert[used:] == -1).all()
    assert set(block_expert[:used].tolist()) == set(ids.unique().tolist())
    if crowd > block_m:
        assert (block_expert == 0).sum() > 1  # one expert over several blocks


# ----------------------------------------------------------------- experts
CASES = [  # t, k, e, hidden, inter, crowd
    (1, 6, 64, 64, 32, 0),      # T=1: six blocks of one row each
    (37, 6, 64, 48, 40, 20),    # ragged sizes, 20 tokens on experts 0..5, most experts used
    (24, 2, 16, 32, 24, 24),    # every token on experts 0 and 1: 14 experts unused
    (5, 3, 8, 80, 72, 0),       # hidden, inter not multiples of the tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "k", "e", "h", "inter", "crowd"), CASES)
def test_fused_moe_cpu(t, k, e, h, inter, crowd, dtype):
    if GPU:
        pytest.skip("the CPU variant (interpreter)")
    gate_up, down = weights(e, h, inter, dtype, seed=t)
    ids, w = routing(t, k, e, seed=t + 1, crowd=crowd)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    cfg = FusedMoEConfig(block_m=16, block_n=32, block_k=32)  # several N and K tiles
    got = fused_moe(x, gate_up, down, ids, w, cfg)
    want = fused_moe_ref(x, gate_up, down, ids, w)
    assert got.shape == (t, h) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 4e-3  # fp16: a few ulps of O(1) outputs
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if dtype == torch.float16:
        # The rounding steps are the reference's: outputs agree bit for bit but for rare
        # fp32 accumulation-order ties (one rounding step left out: 30-70% differ).
        assert (got == want).float().mean() >= 0.99


def biases(e: int, h: int, inter: int, dtype: torch.dtype, seed: int):
    """gate_up_bias [E, 2I], down_bias [E, H]: nonzero, O(1) like the projections."""
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEV, dtype),
            (torch.randn(e, h, generator=g) * 0.5).to(DEV, dtype))


# GPT-OSS's activation at a limit the O(1) projections pass (so both clamps bind)
SWIGLU = ClampedSwiGLU(alpha=1.702, limit=0.6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "k", "e", "h", "inter", "crowd"), CASES)
def test_fused_moe_biases_and_clamped_swiglu_cpu(t, k, e, h, inter, crowd, dtype):
    """GPT-OSS's experts: biases on both projections and the clamped SwiGLU, against the
    reference (transformers' ops, op for op), over the same ragged routings (an expert
    spanning several blocks, experts nobody chose, ragged tiles)."""
    if GPU:
        pytest.skip("the CPU variant (interpreter)")
    gate_up, down = weights(e, h, inter, dtype, seed=t)
    gu_bias, d_bias = biases(e, h, inter, dtype, seed=t + 7)
    ids, w = routing(t, k, e, seed=t + 1, crowd=crowd)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(dtype)
    cfg = FusedMoEConfig(block_m=16, block_n=32, block_k=32)
    kw = dict(gate_up_bias=gu_bias, down_bias=d_bias, activation=SWIGLU)
    got = fused_moe(x, gate_up, down, ids, w, cfg, **kw)
    want = fused_moe_ref(x, gate_up, down, ids, w, **kw)
    assert got.shape == (t, h) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if dtype == torch.float16:
        assert (got == want).float().mean() >= 0.99  # each rounding step the reference's
    # The test could fail: the biases, the clamp and the activation each move the output.
    h_ = x.float() @ gate_up[ids[0, 0]].float().T + gu_bias[ids[0, 0]].float()
    assert (h_[:, :inter] > SWIGLU.limit).any() and (h_[:, inter:].abs() > SWIGLU.limit).any()
    for other in (dict(kw, gate_up_bias=None, down_bias=None),
                  dict(kw, activation=ClampedSwiGLU(alpha=1.702, limit=float("inf"))),
                  dict(kw, activation=None)):
        assert not torch.allclose(fused_moe_ref(x, gate_up, down, ids, w, **other), want,
                                  rtol=tol, atol=tol)


def test_unclamped_swiglu_and_silu_with_biases():
    """limit inf (no clamp: a config's swiglu_limit null) and silu with biases, each
    against the reference; an expert nobody chose keeps even a huge bias out."""
    if GPU:
        pytest.skip("the CPU variant (interpreter)")
    t, k, e, h, inter = 9, 2, 8, 48, 40
    gate_up, down = weights(e, h, inter, torch.float32, seed=11)
    gu_bias, d_bias = biases(e, h, inter, torch.float32, seed=12)
    ids, w = routing(t, k, e, seed=13)
    unused = sorted(set(range(e)) - set(ids.unique().tolist()))
    assert unused
    gu_bias[unused] = 1e6
    d_bias[unused] = 1e6
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(14))
    cfg = FusedMoEConfig(block_m=16, block_n=16, block_k=16)
    for act in (ClampedSwiGLU(alpha=1.0, limit=float("inf")), None):
        kw = dict(gate_up_bias=gu_bias, down_bias=d_bias, activation=act)
        got = fused_moe(x, gate_up, down, ids, w, cfg, **kw)
        torch.testing.assert_close(got, fused_moe_ref(x, gate_up, down, ids, w, **kw),
                                   rtol=1e-5, atol=1e-5)
        assert got.abs().max() < 1e3


def test_clamped_swiglu_reference_is_transformers():
    """The reference's activation is transformers' GptOssExperts._apply_gate (on its
    interleaved columns; ours in halves), in fp32 and bf16 alike (bit for bit)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=2,
                                    swiglu_limit=0.6)
    hf = GptOssExperts(cfg)
    inter = 8
    for dtype in (torch.float32, torch.bfloat16):
        # H = 2I, gate_up the identity (h = x: gate x[:, :I], up x[:, I:]) and down [I | 0]
        # rows: the output's first I columns are the activation itself
        x = (torch.randn(5, 2 * inter, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
        eye = torch.eye(2 * inter, dtype=dtype)[None]
        down = torch.cat([torch.eye(inter), torch.zeros(inter, inter)]).to(dtype)[None]
        ids, w = torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1)
        got = fused_moe_ref(x, eye, down, ids, w, activation=ClampedSwiGLU(cfg.swiglu_alpha, 0.6))
        interleaved = torch.stack([x[:, :inter], x[:, inter:]], -1).flatten(-2)
        want = hf._apply_gate(interleaved)
        assert (x.abs() > 0.6).any()
        assert torch.equal(got[:, :inter], want), dtype
        assert torch.equal(got[:, inter:], torch.zeros_like(got[:, inter:]))


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_block_sizes_agree(block_m):
    t, k, e, h, inter = 45, 4, 8, 32, 16  # ~22 pairs per expert: 1, 1 and 2+ blocks each
    gate_up, down = weights(e, h, inter, torch.float32, seed=3)
    ids, w = routing(t, k, e, seed=4, crowd=30)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(5)).to(DEV)
    cfg = FusedMoEConfig(block_m=block_m, block_n=16, block_k=16)
    torch.testing.assert_close(fused_moe(x, gate_up, down, ids, w, cfg),
                               fused_moe_ref(x, gate_up, down, ids, w), rtol=1e-5, atol=1e-5)


def test_empty_batch_and_bad_shapes():
    gate_up, down = weights(4, 16, 8, torch.float32, seed=0)
    out = fused_moe(torch.zeros(0, 16, device=DEV), gate_up, down,
                    torch.zeros(0, 2, dtype=torch.long, device=DEV), torch.zeros(0, 2, device=DEV))
    assert out.shape == (0, 16)
    x = torch.zeros(3, 16, device=DEV)
    ids = torch.zeros(3, 2, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="fp32"):
        fused_moe(x, gate_up, down, ids, torch.zeros(3, 2, device=DEV, dtype=torch.float16))
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe(torch.zeros(3, 12, device=DEV), gate_up, down, ids, torch.zeros(3, 2, device=DEV))
    with pytest.raises(ValueError, match="T = 3"):
        fused_moe(x, gate_up, down, ids[:2], torch.zeros(2, 2, device=DEV))
    w = torch.zeros(3, 2, device=DEV)
    gu_bias, d_bias = biases(4, 16, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="both or neither"):
        fused_moe(x, gate_up, down, ids, w, gate_up_bias=gu_bias)
    with pytest.raises(ValueError, match=r"gate_up_bias must be \[E, 2I\]"):
        fused_moe(x, gate_up, down, ids, w, gate_up_bias=gu_bias[:, :8], down_bias=d_bias)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, gate_up, down, ids, w, gate_up_bias=gu_bias.half(), down_bias=d_bias.half())
    with pytest.raises(ValueError, match="limit > 0"):
        ClampedSwiGLU(alpha=1.0, limit=0.0)


# ----------------------------------------------------------------- no host sync
class _ShapeOnlyKernel:
    """A Triton kernel stand-in: ``kernel[grid](*args)`` records the grid, runs nothing."""

    def __init__(self, grids: list) -> None:
        self.grids = grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args, **kwargs: None


def test_no_host_sync_on_meta_tensors(monkeypatch):
    """Meta tensors hold no data: .item(), .tolist(), bool() and data-dependent shapes
    raise. The launcher (alignment buffers, grids, the final sum) runs on them with the
    kernels as shape-only stand-ins, and the torch alignment runs on them whole: every
    shape comes from the input shapes. The grids too: same shapes, same launches."""
    grids: list = []
    for name in ("_align_kernel", "_gate_up_kernel", "_down_kernel"):
        monkeypatch.setattr(fm, name, _ShapeOnlyKernel(grids))
    meta = torch.device("meta")
    t, k, e, h, inter = 7, 6, 64, 2048, 1408
    x = torch.empty(t, h, device=meta, dtype=torch.bfloat16)
    gate_up = torch.empty(e, 2 * inter, h, device=meta, dtype=torch.bfloat16)
    down = torch.empty(e, h, inter, device=meta, dtype=torch.bfloat16)
    ids = torch.empty(t, k, device=meta, dtype=torch.long)
    w = torch.empty(t, k, device=meta)
    out = fused_moe(x, gate_up, down, ids, w, FusedMoEConfig(block_m=16, block_n=64))
    assert out.shape == (t, h) and out.device == meta
    nb = num_blocks(t * k, e, 16)
    assert grids == [(1,), (inter // 64, nb), (h // 64, nb)]
    pairs, block_expert = moe_align_ref(ids, e, 16)
    assert pairs.shape == (nb * 16,) and block_expert.shape == (nb,)
    # GPT-OSS's variant (biases, clamped SwiGLU): the same launches
    grids.clear()
    out = fused_moe(x, gate_up, down, ids, w, FusedMoEConfig(block_m=16, block_n=64),
                    gate_up_bias=torch.empty(e, 2 * inter, device=meta, dtype=torch.bfloat16),
                    down_bias=torch.empty(e, h, device=meta, dtype=torch.bfloat16),
                    activation=ClampedSwiGLU())
    assert out.shape == (t, h) and grids == [(1,), (inter // 64, nb), (h // 64, nb)]
    # The check bites: the reference experts read the used ids back to the host.
    with pytest.raises((NotImplementedError, RuntimeError)):
        fused_moe_ref(x, gate_up, down, ids, w)


# ----------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("t", "crowd"), [(1, 0), (4, 0), (64, 0), (256, 200), (512, 0)])
def test_fused_moe_gpu_bf16(t, crowd):
    """V2-Lite shapes, default configs (block_m by token count)."""
    k, e, h, inter = 6, 64, 2048, 1408
    gate_up, down = weights(e, h, inter, torch.bfloat16, seed=t)
    ids, w = routing(t, k, e, seed=t + 1, crowd=crowd)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    got = fused_moe(x, gate_up, down, ids, w)
    want = fused_moe_ref(x, gate_up, down, ids, w)
    # bf16: outputs O(1), each projection rounded to bf16 (8 bits) along the way.
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("t", "crowd"), [(1, 0), (8, 0), (64, 40), (128, 0)])
def test_fused_moe_gpu_bf16_gpt_oss(t, crowd):
    """gpt-oss-20b's expert shapes (E=32, top-4, hidden 2880, I 2880: neither a multiple of
    the 64/128 tiles), biases and the clamped SwiGLU at its limit 7.0, default configs."""
    k, e, h, inter = 4, 32, 2880, 2880
    gate_up, down = weights(e, h, inter, torch.bfloat16, seed=t)
    gate_up, down = gate_up * 4, down * 4  # projections of a few units: the clamp at 7 binds
    gu_bias, d_bias = biases(e, h, inter, torch.bfloat16, seed=t + 1)
    ids, w = routing(t, k, e, seed=t + 2, crowd=crowd)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    kw = dict(gate_up_bias=gu_bias, down_bias=d_bias, activation=ClampedSwiGLU(1.702, 7.0))
    got = fused_moe(x, gate_up, down, ids, w, **kw)
    want = fused_moe_ref(x, gate_up, down, ids, w, **kw)
    h0 = x.float() @ gate_up[ids[0, 0]].float().T
    assert (h0.abs() > 7.0).any()  # the clamps bind somewhere
    # outputs of tens (act up to (7 + 1) * 7): bf16's 8 bits, relative to the largest
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * max(1.0, scale))
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_fused_moe_gpu_fp32_is_ieee(monkeypatch):
    t, k, e, h, inter = 33, 6, 64, 256, 128
    gate_up, down = weights(e, h, inter, torch.float32, seed=1)
    ids, w = routing(t, k, e, seed=2, crowd=20)
    x = torch.randn(t, h, device=DEV)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the reference too
    torch.testing.assert_close(fused_moe(x, gate_up, down, ids, w),
                               fused_moe_ref(x, gate_up, down, ids, w), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_fused_moe_captures_in_a_cuda_graph():
    """Captured once, replayed with other routing in the same buffers: the replay follows
    the new routing (nothing about the data was baked in at capture)."""
    t, k, e, h, inter = 16, 6, 64, 512, 256
    gate_up, down = weights(e, h, inter, torch.bfloat16, seed=5)
    ids, w = routing(t, k, e, seed=6)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe(x, gate_up, down, ids, w)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, gate_up, down, ids, w)
    new_ids, new_w = routing(t, k, e, seed=7, crowd=t)
    ids.copy_(new_ids)
    w.copy_(new_w)
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = fused_moe_ref(x, gate_up, down, ids, w)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
