"""kernels/lora.py (the gathered LoRA shrink and expand) against their PyTorch references:
fp32/fp16 on the CPU under the interpreter, bf16 on the GPU; ragged T, tokens without an
adapter among the others, 1-4 slots, n not a power of two, K and OUT not multiples of
the tiles, split K, the SiLU·mul prologue, and LoRALinear.apply over them."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from flashpage.kernels.lora import (
    KERNEL_MAX_TOKENS,
    MAX_PARTIAL_ROWS,
    ExpandConfig,
    ShrinkConfig,
    _k_split,
    default_expand_config,
    default_shrink_config,
    lora_expand,
    lora_expand_ref,
    lora_shrink,
    lora_shrink_ref,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
CPU_ONLY = pytest.mark.skipif(GPU, reason="the CPU variant (interpreter)")


def _inputs(t, k, out, s, n, dtype, seed, silu=False, none_share=0.3):
    """x, a, b, y and a slot map of ``t`` tokens over ``s`` slots, about ``none_share`` of
    them -1, padded with -1 past t (as the engine's slot map is)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(t, 2 * k if silu else k, device=DEV, dtype=dtype, generator=g)
    a = (torch.randn(s * n, k, device=DEV, generator=g) / k ** 0.5).to(dtype)
    b = (torch.randn(out, s * n, device=DEV, generator=g) / n ** 0.5).to(dtype)
    y = torch.randn(t, out, device=DEV, dtype=dtype, generator=g)
    slots = torch.randint(0, s, (t + 5,), device=DEV, generator=g)
    none = torch.rand(t + 5, device=DEV, generator=g) < none_share
    slots[none] = -1
    slots[0] = s - 1  # the first token has an adapter, the last (of more) none
    if t > 1:
        slots[t - 1] = -1
    slots[t:] = -1
    return x, a, b, y, slots


def _tol(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


# (T, K, OUT, S, n, shrink config, expand config)
CASES = [
    (1, 64, 40, 1, 16, ShrinkConfig(16, 32, 4, 1), ExpandConfig(16, 32, 1)),    # one token, 2 splits
    (5, 80, 70, 2, 48, ShrinkConfig(16, 32, 16, 1), ExpandConfig(16, 32, 1)),   # n = 3 x 16, ragged K/OUT
    (19, 96, 33, 3, 8, ShrinkConfig(16, 32, 2, 1), ExpandConfig(16, 16, 1)),    # two T tiles, n padded to 16
    (40, 100, 48, 4, 32, ShrinkConfig(32, 16, 4, 1), ExpandConfig(32, 32, 1)),  # 4 slots, K % 16 != 0
    (130, 48, 24, 4, 48, ShrinkConfig(64, 16, 4, 1), ExpandConfig(64, 16, 1)),  # the large-T tiles
    (40, 100, 48, 4, 32, ShrinkConfig(32, 16, 4, 1, slot_grid=False),           # slots looped in
     ExpandConfig(32, 32, 1)),                                                  # one program
    (3, 32, 16, 2, 16, None, None),                                             # default configs
]
IDS = ["t1", "t5-n48", "t19-n8", "t40-s4", "t130", "t40-s4-looped", "default"]


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,k,out,s,n,scfg,ecfg", CASES, ids=IDS)
def test_shrink_and_expand_cpu(t, k, out, s, n, scfg, ecfg, dtype):
    x, a, b, y, slots = _inputs(t, k, out, s, n, dtype, seed=t + k + s)
    part = lora_shrink(x, a, slots, n, scfg)
    assert part.dtype == torch.float32 and part.shape[1:] == (t, n)
    if scfg is not None:
        assert part.shape[0] == -(-k // _k_split(k, scfg))
    xa_ref = lora_shrink_ref(x, a, slots, n)
    torch.testing.assert_close(part.sum(0), xa_ref, **_tol(dtype))
    none = (slots[:t] == -1).nonzero().flatten()
    assert (len(none) > 0) == (t > 1)
    assert torch.equal(part.sum(0)[none], torch.zeros(len(none), n))
    # the expand, from the partials and from a 2-D xa in y's dtype; in place
    want = lora_expand_ref(part, b, slots, n, y)
    for xa in (part, xa_ref.to(dtype)):
        y2 = y.clone()
        got = lora_expand(xa, b, slots, n, y2, ecfg)
        assert got is y2
        torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))
        assert torch.equal(got[none], y[none])  # tokens without an adapter: untouched


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shrink_silu_mul_prologue_cpu(dtype):
    """x is the gate/up output [T, 2K]: silu(gate) * up on the fly, rounded as
    kernels/silu_mul, equals the shrink of the materialized activation."""
    t, k, s, n = 7, 80, 2, 16
    x, a, _, _, slots = _inputs(t, k, 8, s, n, dtype, seed=3, silu=True)
    got = lora_shrink(x, a, slots, n, ShrinkConfig(16, 32, 2, 1), silu_mul=True).sum(0)
    torch.testing.assert_close(got, lora_shrink_ref(x, a, slots, n, silu_mul=True), **_tol(dtype))
    act = (torch.nn.functional.silu(x[:, :k].float()).to(dtype).float() * x[:, k:].float()).to(dtype)
    torch.testing.assert_close(lora_shrink_ref(x, a, slots, n, silu_mul=True),
                               lora_shrink_ref(act, a, slots, n), atol=0, rtol=0)


@CPU_ONLY
def test_only_each_tokens_own_slot_is_read():
    """NaN in the slots no token uses and in the rows of tokens without an adapter: the
    kernels never read them (a dense product over every slot would spread the NaNs)."""
    t, k, out, s, n = 20, 64, 40, 4, 16
    x, a, b, y, slots = _inputs(t, k, out, s, n, torch.float32, seed=7, none_share=0.0)
    slots[:t] = torch.tensor([0, 2] * (t // 2))
    slots[3] = slots[11] = -1
    for unused in (1, 3):
        a[unused * n:(unused + 1) * n] = float("nan")
        b[:, unused * n:(unused + 1) * n] = float("nan")
    x[3] = x[11] = float("nan")
    part = lora_shrink(x, a, slots, n, ShrinkConfig(16, 32, 2, 1))
    got = lora_expand(part, b, slots, n, y.clone(), ExpandConfig(16, 16, 1))
    assert torch.isfinite(got).all()
    ok = [i for i in range(t) if i not in (3, 11)]
    want = lora_expand_ref(lora_shrink_ref(x[ok], a, slots[ok], n), b, slots[ok], n, y[ok])
    torch.testing.assert_close(got[ok], want, atol=1e-4, rtol=1e-4)


@CPU_ONLY
def test_no_adapter_at_all_writes_nothing():
    t, k, out, s, n = 9, 32, 24, 2, 16
    x, a, b, y, slots = _inputs(t, k, out, s, n, torch.float32, seed=1)
    slots.fill_(-1)
    part = lora_shrink(x, a, slots, n)
    assert torch.equal(part, torch.zeros_like(part))
    y2 = y.clone()
    lora_expand(part, b, slots, n, y2)
    assert torch.equal(y2, y)
    empty = torch.zeros(0, k)
    assert lora_shrink(empty, a, slots, n).shape[1:] == (0, n)


def test_launchers_reject_bad_input():
    x, a, b, y = torch.zeros(4, 32), torch.zeros(32, 32), torch.zeros(24, 32), torch.zeros(4, 24)
    slots = torch.full((8,), -1)
    with pytest.raises(ValueError, match="not a positive multiple of n=48"):
        lora_shrink(x, a, slots, 48)
    with pytest.raises(ValueError, match="x has 32 columns, a needs 64"):
        lora_shrink(x, a, slots, 16, silu_mul=True)
    with pytest.raises(ValueError, match="dtype mismatch"):
        lora_shrink(x, a.half(), slots, 16)
    with pytest.raises(ValueError, match="contiguous int64"):
        lora_shrink(x, a, slots.int(), 16)
    with pytest.raises(ValueError, match="2 entries for 4 tokens"):
        lora_shrink(x, a, slots[:2], 16)
    with pytest.raises(ValueError, match="last dimension"):
        lora_shrink(torch.zeros(32, 4).t(), a, slots, 16)
    with pytest.raises(ValueError, match="x dtype torch.int32 unsupported"):
        lora_shrink(x.int(), a, slots, 16)
    with pytest.raises(ValueError, match="a must be contiguous"):
        lora_shrink(x, torch.zeros(32, 64)[:, ::2], slots, 16)
    xa = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="shapes do not fit"):
        lora_expand(xa, b, slots, 16, torch.zeros(4, 25))
    with pytest.raises(ValueError, match="shapes do not fit"):
        lora_expand(torch.zeros(4, 8), b, slots, 16, y)
    with pytest.raises(ValueError, match="xa must be contiguous float32"):
        lora_expand(xa.double(), b, slots, 16, y)
    with pytest.raises(ValueError, match="dtype mismatch: b"):
        lora_expand(xa, b.half(), slots, 16, y)
    with pytest.raises(ValueError, match="y must be contiguous"):
        lora_expand(xa, b, slots, 16, torch.zeros(24, 4).t())


def test_default_configs():
    for t in (1, 16, 17, 32, 33, 64, 256, 4096):
        s, e = default_shrink_config(t), default_expand_config(t)
        assert s.block_t == e.block_t >= 16 and s.block_t * s.max_splits <= MAX_PARTIAL_ROWS
        assert (t <= 16) == (s.block_t == 16)
    one = default_shrink_config(1)
    assert _k_split(4096, one) == 256 and _k_split(14336, one) == 1024  # 16 and 14 splits
    assert _k_split(100, one) == 256  # one split
    assert _k_split(4096, default_shrink_config(256)) == 1024  # 4 splits of 64-token tiles


@pytest.fixture
def kernels_on(monkeypatch):
    """LoRALinear runs kernels/lora.py on the CPU only when asked (the interpreter is slow)."""
    monkeypatch.setenv("FLASHPAGE_LORA_KERNELS", "1")


def _lora_linear(in_f, slices, num_slots, rank, dtype, seed):
    from flashpage.lora.layers import LoRALinear, LoRAState

    g = torch.Generator().manual_seed(seed)
    out_f = sum(r for _, r in slices)
    state = LoRAState(KERNEL_MAX_TOKENS + 8, torch.device(DEV))
    lin = LoRALinear(state, in_f, out_f, slices, num_slots=num_slots, max_rank=rank,
                     device=torch.device(DEV), dtype=dtype)
    pieces = {}
    for s in range(num_slots - 1):  # the last slot stays empty
        r = rank - s  # ranks under the maximum
        pieces[s] = {j: (torch.randn(r, in_f, generator=g) / in_f ** 0.5,
                         torch.randn(rows, r, generator=g) / r ** 0.5)
                     for j, (_, rows) in enumerate(slices) if (j + s) % 3 != 2}
        lin.set_slot(s, pieces[s])
    return lin, pieces, out_f


def _check_apply(t, dtype, seed, kernels_expected, tol):
    from flashpage.lora.layers import lora_delta_ref

    slices = [(0, 48), (48, 16), (64, 16)]  # q, k, v of a qkv_proj
    lin, pieces, out_f = _lora_linear(40, slices, 4, 16, dtype, seed)
    assert lin.kernel_max_tokens == KERNEL_MAX_TOKENS
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randint(-1, 4, (t,), generator=g)
    lin.state.token_slots[:t] = slots.to(DEV)
    x = torch.randn(t, 40, generator=g).to(DEV, dtype)
    y0 = torch.randn(t, out_f, generator=g).to(DEV, dtype)
    import flashpage.kernels.lora as kl

    with mock.patch.object(kl, "lora_shrink", wraps=kl.lora_shrink) as spy:
        got = lin.apply(x, y0.clone())
    assert spy.called == kernels_expected
    pieces_cpu = {s: {j: (a, b) for j, (a, b) in p.items()} for s, p in pieces.items()}
    want = y0.float().cpu() + lora_delta_ref(x.cpu(), slots.tolist(), pieces_cpu, slices, out_f)
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_linear_apply_through_the_kernels_cpu(dtype, kernels_on):
    """qkv-like slices (n = 3 x 16 = 48), 4 slots (one empty), ranks under the maximum,
    some slices untouched: apply through the kernels equals the per-token reference."""
    _check_apply(37, dtype, 0, True, 1e-4 if dtype == torch.float32 else 3e-2)


@CPU_ONLY
def test_lora_linear_keeps_the_dense_path_above_the_threshold(kernels_on):
    _check_apply(KERNEL_MAX_TOKENS + 1, torch.float32, 1, False, 1e-4)


@CPU_ONLY
def test_down_projection_keeps_its_fused_silu_mul_with_lora(monkeypatch, kernels_on):
    """A one-row down projection with LoRA: silu_mul_forward runs the fused GEMV and the
    shrink's SiLU·mul prologue (no activation materialized) and equals SiLU·mul, then the
    linear with its delta."""
    from flashpage.layers.activation import SiluAndMul
    from flashpage.layers.linear import RowParallelLinear, set_row_gemv
    from flashpage.lora.layers import LoRALinear, LoRAState, lora_delta_ref

    torch.manual_seed(0)
    dtype = torch.float16
    k, out_f = 48, 32
    down = RowParallelLinear(k, out_f).to(dtype)
    torch.nn.init.normal_(down.weight, std=0.1)
    down.silu_input = True
    assert set_row_gemv(down, True) == 1
    monkeypatch.setenv("FLASHPAGE_GEMV", "1")
    state = LoRAState(8, torch.device("cpu"))
    down.lora = LoRALinear(state, k, out_f, [(0, out_f)], num_slots=2, max_rank=8,
                           device=torch.device("cpu"), dtype=dtype)
    piece = {0: (torch.randn(8, k) / k ** 0.5, torch.randn(out_f, 8) / 8 ** 0.5)}
    down.lora.set_slot(1, piece)
    h = torch.randn(1, 2 * k, dtype=dtype)
    act = SiluAndMul()(h)
    import flashpage.kernels.gemv as gemv

    for slot in (1, -1):
        state.token_slots[0] = slot
        with mock.patch.object(gemv, "gemv_row", wraps=gemv.gemv_row) as spy:
            got = down.silu_mul_forward(h)
        assert got is not None
        assert [c.kwargs.get("silu_mul", False) for c in spy.call_args_list] == [True]
        want = torch.nn.functional.linear(act, down.weight).float() + lora_delta_ref(
            act, [slot], {1: piece}, [(0, out_f)], out_f)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    down.lora.kernel_max_tokens = 0  # the dense path: SiLU·mul stays outside the GEMV
    assert down.silu_mul_forward(h) is None


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 7, 16, 64, 200, 256])
@pytest.mark.parametrize("k,out,n,silu", [(4096, 6144, 48, False), (14336, 4096, 16, True),
                                          (4096, 28672, 32, False)],
                         ids=["qkv", "down-silu", "gate_up"])
def test_shrink_and_expand_gpu_bf16(t, k, out, n, silu):
    x, a, b, y, slots = _inputs(t, k, out, 4, n, torch.bfloat16, seed=t, silu=silu)
    part = lora_shrink(x, a, slots, n, silu_mul=silu)
    xa_ref = lora_shrink_ref(x, a, slots, n, silu_mul=silu)
    torch.testing.assert_close(part.sum(0), xa_ref, atol=2e-2, rtol=2e-2)
    want = lora_expand_ref(part, b, slots, n, y)
    got = lora_expand(part, b, slots, n, y.clone())
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
    none = slots[:t] == -1
    assert torch.equal(got[none], y[none])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_kernels_in_a_cuda_graph_read_the_slot_map_in_place():
    """Captured once, replayed with other slot maps written into the same buffer: every
    replay gives the eager reference of its map."""
    t, k, out, n = 16, 4096, 6144, 48
    x, a, b, y, slots = _inputs(t, k, out, 4, n, torch.bfloat16, seed=5)
    y_in = y.clone()
    lora_expand(lora_shrink(x, a, slots, n), b, slots, n, y_in.clone())  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = lora_expand(lora_shrink(x, a, slots, n), b, slots, n, y_in)
    g = torch.Generator(device="cuda").manual_seed(9)
    for _ in range(4):
        slots.copy_(torch.randint(-1, 4, slots.shape, device="cuda", generator=g))
        y_in.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        want = lora_expand_ref(lora_shrink_ref(x, a, slots, n), b, slots, n, y)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 16, 100])
def test_lora_linear_apply_gpu_bf16(t, monkeypatch):
    monkeypatch.delenv("FLASHPAGE_LORA_KERNELS", raising=False)  # auto: on CUDA
    _check_apply(t, torch.bfloat16, t, True, 3e-2)


def test_the_switch_decides_where_the_kernels_run(monkeypatch):
    from flashpage.lora.layers import LoRALinear, LoRAState

    def limit():
        dev = torch.device(DEV)
        return LoRALinear(LoRAState(4, dev), 8, 8, [(0, 8)], 1, 4, dev, torch.float32
                          ).kernel_max_tokens

    monkeypatch.delenv("FLASHPAGE_LORA_KERNELS", raising=False)
    assert limit() == (KERNEL_MAX_TOKENS if GPU else 0)  # auto: CUDA only
    monkeypatch.setenv("FLASHPAGE_LORA_KERNELS", "1")
    assert limit() == KERNEL_MAX_TOKENS  # (the interpreter on the CPU: tests/conftest.py)
    monkeypatch.setenv("FLASHPAGE_LORA_KERNELS", "0")
    assert limit() == 0


def _sm90_lora_report() -> list[str]:
    """(In a subprocess with the interpreter off.) Both kernels compiled for sm_90 at every
    token tile the launchers pick (bf16, fp16 and fp32 operands, the shrink with and without
    its SiLU·mul prologue), with the default tiles: the shared memory each needs."""
    import torch as th
    from sm90 import compile_sm90

    from flashpage.kernels import lora as lk

    out = []
    for dt, tt in ((th.bfloat16, "bf16"), (th.float16, "fp16"), (th.float32, "fp32")):
        for t in (1, 32, 256):
            sc, ec = lk.default_shrink_config(t), lk.default_expand_config(t)
            for silu in (False, True):
                k = compile_sm90(lk._lora_shrink_kernel, dict(
                    SILU_MUL=silu, PRECISION=lk._precision(dt), SLOT_GRID=sc.slot_grid,
                    BLOCK_T=sc.block_t,
                    BLOCK_N=lk._block_n(48), BLOCK_K=sc.block_k),
                    {"x_ptr": f"*{tt}", "a_ptr": f"*{tt}", "slot_ptr": "*i64", "out_ptr": "*fp32"},
                    num_warps=sc.num_warps, num_stages=3)
                out.append(f"shrink {tt} t={t} silu={silu} smem={k.metadata.shared}")
            k = compile_sm90(lk._lora_expand_kernel, dict(
                PRECISION=lk._precision(dt), BLOCK_T=ec.block_t, BLOCK_N=lk._block_n(48),
                BLOCK_O=ec.block_o),
                {"xa_ptr": "*fp32", "b_ptr": f"*{tt}", "slot_ptr": "*i64", "y_ptr": f"*{tt}"},
                num_warps=ec.num_warps, num_stages=3)
            out.append(f"expand {tt} t={t} smem={k.metadata.shared}")
    return out


@CPU_ONLY
def test_lora_kernels_compile_for_sm90():
    """Both kernels build for an H200 (Triton's ptxas on the CPU) at every tile the
    launchers choose, within an SM's shared memory: a GPU-only compile error shows in CI."""
    from sm90 import run_compiled

    report = run_compiled("test_lora_kernels", "_sm90_lora_report")
    assert len(report) == 3 * 3 * 3
    assert all(int(r.rsplit("smem=", 1)[1]) <= 227 * 1024 for r in report), report
