"""fused_moe_int4 (kernels/fused_moe_int4.py: the fused MoE kernels over int4 experts kept
packed, weight-only) against its pure-torch reference (the 16-bit kernel's reference over
the experts dequantized as kernels/int4_gemm.dequantize_int4_ref dequantizes them).

CPU (interpreter), fp32 and fp16: ragged token counts, top-k 1-8 of 4-16 experts, an
expert over several blocks, groups of 16 to the whole row (K tiles narrower than a group,
several groups a row), gate_up and down with different groups, AWQ-style asymmetric and
symmetric zero points, experts nobody chose (their scales NaN: never read), errors, no host
sync (meta tensors). GPU (marked gpu): bf16 at Qwen3-30B-A3B's expert shape (groups of
128) and a CUDA graph capture.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_moe import _ShapeOnlyKernel, routing  # tests/kernels

from flashpage.kernels import fused_moe as fm
from flashpage.kernels import fused_moe_int4 as fm4
from flashpage.kernels.fused_moe import num_blocks
from flashpage.kernels.fused_moe_int4 import (
    FusedMoEInt4Config,
    dequantize_experts_int4,
    fused_moe_int4,
    fused_moe_int4_ref,
    tile_k,
)
from flashpage.kernels.int4_gemm import dequantize_int4_ref, pack_int4
from flashpage.models.int4_formats import quantize_int4

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
cpu_only = pytest.mark.skipif(GPU, reason="the CPU variant (interpreter)")


def int4_experts(e: int, n: int, k: int, group: int | None, seed: int, sym: bool = False,
                 unused: tuple[int, ...] = ()):
    """Random [E, N, K] experts quantized by our group quantizer -> (int32 [E, N, K/8],
    fp16 scales [E, N, K/G], uint8 zeros [E, N, K/G]) on DEV; ``unused`` experts' scales
    NaN (a kernel reading them poisons its output)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).to(DEV)
    q, s, z = quantize_int4(w.reshape(e * n, k), group, sym)  # row by row: each expert's
    q, s, z = pack_int4(q).view(e, n, k // 8), s.view(e, n, -1), z.view(e, n, -1)
    for u in unused:
        s[u] = float("nan")
    return q, s, z


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def test_dequantize_experts_is_each_experts_reference():
    q, s, z = int4_experts(3, 16, 64, 32, seed=0)
    got = dequantize_experts_int4(q, s, z, torch.float32)
    assert got.shape == (3, 16, 64)
    for i in range(3):
        assert torch.equal(got[i], dequantize_int4_ref(q[i], s[i], z[i]))


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "k", "e", "h", "inter", "g1", "g2", "sym", "crowd", "cfg"), [
    (1, 1, 4, 64, 32, 32, 32, False, 0, None),
    (5, 2, 8, 64, 64, 16, None, False, 0, None),           # down: one group per row
    (13, 3, 8, 128, 96, None, 32, True, 0, None),         # gate_up: one group a row of 128
    (40, 8, 16, 64, 48, 64, 16, False, 40, FusedMoEInt4Config(block_m=16, block_n=32,
                                                              block_k=32)),  # K tile < G
    (33, 4, 4, 128, 64, 128, 64, False, 20, FusedMoEInt4Config(block_m=32, block_n=16)),
])
def test_fused_moe_int4_matches_reference(dtype, t, k, e, h, inter, g1, g2, sym, crowd, cfg):
    """The kernel against the reference over the dequantized experts: fp32 to fp32's sums
    order, fp16 within its rounding; experts nobody chose are never read."""
    ids, w = routing(t, k, e, seed=t, crowd=crowd)
    chosen = set(ids.flatten().tolist())
    unused = tuple(i for i in range(e) if i not in chosen)
    gu = int4_experts(e, 2 * inter, h, g1, seed=1, sym=sym, unused=unused)
    dn = int4_experts(e, h, inter, g2, seed=2, sym=sym, unused=unused)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    got = fused_moe_int4(x, *gu, *dn, ids, w, cfg)
    want = fused_moe_int4_ref(x, *gu, *dn, ids, w)
    assert got.dtype == dtype and got.shape == (t, h)
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:
        assert _rel(got, want) < 5e-3


def test_tile_k_divides_the_group():
    assert [tile_k(g, 128) for g in (16, 32, 48, 128, 768, 2048)] == [16, 32, 16, 128, 128, 128]
    assert tile_k(64, 32) == 32
    with pytest.raises(ValueError, match="group size 24 is not a multiple of 16"):
        tile_k(24, 128)


def test_errors_name_what_is_wrong():
    ids, w = routing(3, 2, 4, seed=0)
    gu = int4_experts(4, 64, 64, 32, seed=1)
    dn = int4_experts(4, 64, 32, 32, seed=2)
    x = torch.randn(3, 64, device=DEV)
    with pytest.raises(ValueError, match="gate_up and down must be int32"):
        fused_moe_int4(x, gu[0].float(), *gu[1:], *dn, ids, w)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe_int4(x[:, :32], *gu, *dn, ids, w)
    with pytest.raises(ValueError, match=r"down_zeros must be uint8"):
        fused_moe_int4(x, *gu, *dn[:2], dn[2].int(), ids, w)
    with pytest.raises(ValueError, match=r"gate_up_scales must be \[4, 64, K/G\]"):
        fused_moe_int4(x, gu[0], gu[1][:, :32], gu[2], *dn, ids, w)
    g8 = int4_experts(4, 64, 64, 8, seed=1)
    with pytest.raises(ValueError, match="hidden size 64 with groups of 8"):
        fused_moe_int4(x, *g8, *dn, ids, w)
    with pytest.raises(ValueError, match="topk_weights must be fp32"):
        fused_moe_int4(x, *gu, *dn, ids, w.half())


@pytest.mark.parametrize("form", ["dot", "swap"])
def test_no_host_sync_on_meta_tensors(monkeypatch, form):
    """The launcher on meta tensors (no data: a host read raises), the kernels shape-only
    stand-ins, both forms ("swap" the default at 7 tokens of 128 experts, groups of 128):
    every shape and grid comes from the input shapes."""
    from flashpage.kernels import fused_moe_int4_swap as fm4s

    grids: list = []
    monkeypatch.setattr(fm, "_align_kernel", _ShapeOnlyKernel(grids))
    module, names = ((fm4, ("_int4_gate_up_kernel", "_int4_down_kernel")) if form == "dot" else
                     (fm4s, ("_int4_swap_gate_up_kernel", "_int4_swap_down_kernel")))
    for name in names:
        monkeypatch.setattr(module, name, _ShapeOnlyKernel(grids))
    meta = torch.device("meta")
    t, k, e, h, inter, g = 7, 8, 128, 2048, 768, 128
    x = torch.empty(t, h, device=meta, dtype=torch.bfloat16)
    gu = (torch.empty(e, 2 * inter, h // 8, device=meta, dtype=torch.int32),
          torch.empty(e, 2 * inter, h // g, device=meta, dtype=torch.float16),
          torch.empty(e, 2 * inter, h // g, device=meta, dtype=torch.uint8))
    dn = (torch.empty(e, h, inter // 8, device=meta, dtype=torch.int32),
          torch.empty(e, h, inter // g, device=meta, dtype=torch.float16),
          torch.empty(e, h, inter // g, device=meta, dtype=torch.uint8))
    ids = torch.empty(t, k, device=meta, dtype=torch.long)
    w = torch.empty(t, k, device=meta)
    if form == "dot":
        out = fused_moe_int4(x, *gu, *dn, ids, w, FusedMoEInt4Config(block_m=16, block_n=64))
    else:
        assert fm4.default_config(t * k, e, x.dtype, (g, g)).form == "swap"
        out = fused_moe_int4(x, *gu, *dn, ids, w)
    assert out.shape == (t, h) and out.device == meta
    nb = num_blocks(t * k, e, 16)
    assert grids == [(1,), (inter // 64, nb), (h // 64, nb)]


# ----------------------------------------------------------------- GPU
def _qwen3_30b_case(t: int, seed: int):
    """Qwen3-30B-A3B's experts (hidden 2048, moe_intermediate 768, 128 experts, top-8),
    groups of 128 (the AWQ / GPTQ-Int4 checkpoints'), on the GPU."""
    gu = int4_experts(128, 2 * 768, 2048, 128, seed=seed)
    dn = int4_experts(128, 2048, 768, 128, seed=seed + 1)
    ids, w = routing(t, 8, 128, seed=seed + 2, crowd=t // 2)
    x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(seed + 3)).to(DEV)
    return x, gu, dn, ids, w


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 8, 77, 300])
def test_fused_moe_int4_bf16_on_the_gpu(t):
    """bf16 at Qwen3-30B-A3B's shape: within bf16 rounding (1% in norm) of the reference
    over the dequantized bf16 experts, the default config and a wider one."""
    x, gu, dn, ids, w = _qwen3_30b_case(t, seed=t)
    x = x.bfloat16()
    want = fused_moe_int4_ref(x, *gu, *dn, ids, w)
    for cfg in (None, FusedMoEInt4Config(block_m=64, block_n=64)):
        got = fused_moe_int4(x, *gu, *dn, ids, w, cfg)
        assert torch.isfinite(got).all()
        assert _rel(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_fused_moe_int4_captures_in_a_cuda_graph():
    """Captured once, replayed with other routing and inputs in the same buffers: the
    replay follows them."""
    t = 16
    x, gu, dn, ids, w = _qwen3_30b_case(t, seed=5)
    x = x.bfloat16()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe_int4(x, *gu, *dn, ids, w)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_int4(x, *gu, *dn, ids, w)
    new_ids, new_w = routing(t, 8, 128, seed=7, crowd=t)
    ids.copy_(new_ids)
    w.copy_(new_w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, fused_moe_int4_ref(x, *gu, *dn, ids, w)) < 1e-2


# ----------------------------------------------------------------------------- sm_90 build
def _compile_int4_moe_kernels() -> dict[str, dict]:
    """The "dot" form's default tiles (default_config without a dtype) at 16, 32 and 64 rows a block (one token of
    Qwen3-30B-A3B, 512 tokens, 1024), groups of 128, and benchmarks/fused_moe.py --int4's
    tiles (K tiles of 128, 8 warps), built for sm_90a with bf16 activations (no GPU needed): name -> registers,
    spills, MMA opcodes."""
    import collections

    import triton.language as tl
    from sm90 import compile_sm90, ptxas_sm90a, ptxas_usage, sass_instructions

    ptr = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
           "act_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
           "a_ptr": "*bf16", "topk_w_ptr": "*fp32", "ys_ptr": "*bf16"}
    cfgs = {f"default {p // 128} an expert": fm4.default_config(p, 128)
            for p in (8, 8 * 512, 8 * 1024)}
    for bm in (16, 32, 64):
        cfgs[f"k128 at {bm} rows"] = FusedMoEInt4Config(block_m=bm, block_k=128, num_warps=8)
    out = {}
    for tag, cfg in cfgs.items():
        common = dict(G=128, DT=tl.bfloat16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      BLOCK_K=tile_k(128, cfg.block_k), PRECISION="tf32")
        launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        kernels = {
            "gate_up": compile_sm90(fm4._int4_gate_up_kernel, common, ptr,
                                    aligned=("x_ptr", "w_ptr", "stride_xt", "stride_wn"),
                                    **launch),
            "down": compile_sm90(fm4._int4_down_kernel, common, ptr,
                                 aligned=("a_ptr", "w_ptr", "stride_ar", "stride_wn"), **launch),
        }
        for name, k in kernels.items():
            log, sass = ptxas_sm90a(k.asm["ptx"])
            ins, _ = sass_instructions(sass)
            ops = collections.Counter(t.split(" ")[0] for t in ins)
            out[f"{tag} ({cfg.name}) {name}"] = {
                **ptxas_usage(log), "mma": {o: n for o, n in ops.items() if "MMA" in o}}
    return out


def test_int4_moe_kernels_compile_for_sm90():
    """On the CPU, the kernels default_config picks (and the benchmark's tiles) build for
    sm_90 with bf16 activations: the unpacked nibbles on bf16 tensor-core MMAs, none
    spilling."""
    from sm90 import run_compiled

    got = run_compiled("test_fused_moe_int4", "_compile_int4_moe_kernels")
    assert len(got) == 12
    for name, r in got.items():
        assert r["mma"] and all("MMA" in o and "BF16" in o for o in r["mma"]), (name, r)
        assert r["spill_bytes"] == 0, (name, r)


def test_default_config_by_mean_pairs():
    """Run 199's rule for the "dot" form (no dtype given; tests/kernels/
    test_fused_moe_int4_swap.py: when "swap" is taken): 16 rows on 4 warps up to 16 pairs
    an expert, 64 rows on 8 past it."""
    small, edge, big = (fm4.default_config(p, 128) for p in (8, 16 * 128, 16 * 128 + 1))
    assert (small.block_m, small.num_warps) == (16, 4) == (edge.block_m, edge.num_warps)
    assert (big.block_m, big.num_warps, big.block_k) == (64, 8, 64)
