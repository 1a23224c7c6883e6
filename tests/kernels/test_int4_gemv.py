"""The row-wise int4 GEMV (kernels/int4_gemv.py) against the dequantizing reference: 1, 3
and 16 rows, N ragged against the block, groups of 8 / 32 / 128 and one group per row, zero
points 0 and 16, split K on and off, 1-3 tiles in flight, bias, both ways of doing the row
products (CUDA cores and tensor cores; the inline-PTX unpacking replayed in torch), the K
loop left to Triton's pipeliner (prefetch 0) and the SiLU·mul prologue (silu_mul=True, an
MLP's gate/up output in), and the layer's choice of the fused down projection; fp32 / fp16
on the CPU under the interpreter (small shapes: a few seconds), bf16 at Llama-3-8B shapes
on the GPU, judged as test_int4_gemm.py judges its kernel (against fp32, beside cuBLAS over
the dequantized weight). The sm_90 compile test reads the pipelined form's cp.async copies
and its SASS instructions per weight without a GPU."""

from __future__ import annotations

import pytest
import torch
from test_int4_gemm import DEV, GPU, _as_close_as_the_reference, _weight

from flashpage.kernels.int4_gemm import int4_linear_ref, pack_int4
from flashpage.kernels.int4_gemv import (
    CANDIDATES,
    MAX_ROWS,
    Int4GemvConfig,
    default_config,
    int4_gemv,
    parse_config,
    supports,
)

FMA = Int4GemvConfig(16, 64, split_k=1, dot=False)
DOT = Int4GemvConfig(16, 64, split_k=1, dot=True)
CHAIN = Int4GemvConfig(16, 64, split_k=1, chain=True)
PIPE_CHAIN = Int4GemvConfig(16, 64, 2, 4, 3, prefetch=0, chain=True)

CASES = [
    # m, n, k, g, zero (None: random 0..16), bias, config
    (1, 40, 128, 32, None, True, FMA),                                  # 2 tiles, ragged N
    (1, 24, 256, 256, 16, False, Int4GemvConfig(16, 64, 2, prefetch=3)),  # G = K, split
    (3, 40, 256, 128, 0, True, Int4GemvConfig(16, 64, 1, prefetch=1)),  # rows past M masked
    (3, 24, 128, 32, None, False, Int4GemvConfig(16, 64, 2, dot=True)),  # split K, dot
    (16, 40, 128, 128, 16, True, DOT),                                  # G = K, dot, bias
    (16, 20, 64, 32, None, False, Int4GemvConfig(8, 32, 2, dot=False)),  # 16 rows on FMAs
    # the K loop left to Triton's pipeliner (prefetch 0; stages ignored by the interpreter)
    (1, 40, 256, 32, None, True, Int4GemvConfig(16, 64, 1, 4, 3, prefetch=0)),   # 4 tiles
    (3, 40, 256, 128, None, False, Int4GemvConfig(16, 64, 2, 4, 4, prefetch=0)),  # split
    (5, 24, 256, 256, 16, True, Int4GemvConfig(16, 64, 2, 4, 3, dot=True, prefetch=0)),
    (16, 40, 128, 32, None, False, Int4GemvConfig(16, 32, 1, 4, 5, dot=True, prefetch=0)),
    # the FFMA chains from 2048 + q / 128 + q (chain=True): groups of 8 (a scale per word),
    # zero points 0 and 16, split, rows past M, both K loops
    (1, 40, 128, 32, None, True, CHAIN),
    (1, 24, 256, 8, 16, False, Int4GemvConfig(16, 64, 2, chain=True, prefetch=3)),
    (3, 40, 256, 128, 0, True, Int4GemvConfig(16, 64, 2, chain=True, prefetch=1)),
    (1, 40, 256, 256, None, False, PIPE_CHAIN),
]
PIPE_FMA = Int4GemvConfig(16, 64, 2, 4, 3, prefetch=0)
PIPE_DOT = Int4GemvConfig(16, 64, 2, 4, 3, dot=True, prefetch=0)


def _case(m, n, k, g, zero, bias, dtype):
    qw, scales, zeros, _ = _weight(n, k, g, m * 100 + n + k)
    if zero is not None:
        zeros.fill_(zero)
    gen = torch.Generator(device="cpu").manual_seed(m + k)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype) if bias else None
    return x, qw, scales, zeros, b


def _judge(got, ref, x, qw, scales, zeros, b=None):
    """bf16 (the GPU): within 1.5x cuBLAS-over-the-dequantized-weight's own error of the fp32
    linear; fp32 / fp16 (the interpreter): within 1e-4 / 2e-2 of the reference."""
    if got.dtype == torch.bfloat16:
        _as_close_as_the_reference(got, ref, x, qw, scales, zeros, b)
    else:
        tol = 1e-4 if got.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,g,zero,bias,cfg", CASES)
def test_int4_gemv_matches_reference(m, n, k, g, zero, bias, cfg, dtype):
    if GPU and dtype == torch.float16:
        dtype = torch.bfloat16
    x, qw, scales, zeros, b = _case(m, n, k, g, zero, bias, dtype)
    got = int4_gemv(x, qw, scales, zeros, b, cfg)
    ref = int4_linear_ref(x, qw, scales, zeros, b)
    assert got.shape == (m, n) and got.dtype == dtype
    _judge(got, ref, x, qw, scales, zeros, b)


def _silu_mul_ref(h):
    from flashpage.kernels.silu_mul import silu_and_mul_ref

    return silu_and_mul_ref(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,g,cfg", [
    (1, 40, 128, 32, FMA), (3, 24, 256, 128, DOT), (1, 40, 256, 32, PIPE_FMA),
    (5, 40, 256, 256, PIPE_DOT), (1, 40, 128, 32, CHAIN), (2, 24, 256, 128, PIPE_CHAIN)])
def test_int4_gemv_silu_mul_matches_silu_then_reference(m, n, k, g, cfg, dtype):
    """silu_mul=True on the gate/up output h [M, 2K]: silu(gate) * up rounded to x's dtype
    (kernels/silu_mul's rounding), then the reference; both forms, both K loops."""
    if GPU and dtype == torch.float16:
        dtype = torch.bfloat16
    qw, scales, zeros, _ = _weight(n, k, g, m + n + k)
    gen = torch.Generator(device="cpu").manual_seed(m * 7 + k)
    h = (torch.randn(m, 2 * k, generator=gen) * 2).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype)
    got = int4_gemv(h, qw, scales, zeros, b, cfg, silu_mul=True)
    act = _silu_mul_ref(h)
    ref = int4_linear_ref(act, qw, scales, zeros, b)
    assert got.shape == (m, n) and got.dtype == dtype
    _judge(got, ref, act, qw, scales, zeros, b)
    with pytest.raises(ValueError, match=r"x \(gate \| up\)"):
        int4_gemv(h[:, :k], qw, scales, zeros, config=cfg, silu_mul=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("res", [True, False])
@pytest.mark.parametrize("k,g,cfg", [(256, 32, Int4GemvConfig(16, 64, 2, chain=True)),
                                     (128, 128, CHAIN), (256, 128, PIPE_CHAIN)])
def test_int4_gemv_norm_prologue_matches_norm_then_reference(k, g, cfg, res, dtype):
    """norm=(weight, eps): rmsnorm(x + residual) * weight in the prologue (x + residual
    rounded to x's dtype, then s * rstd, then the weight's product: HF's rounding), then
    the GEMV; x + residual written to residual_out exactly, by one program."""
    if GPU and dtype == torch.float16:
        dtype = torch.bfloat16
    n = 40
    qw, scales, zeros, _ = _weight(n, k, g, k + n)
    gen = torch.Generator(device="cpu").manual_seed(k + res)
    x = torch.randn(1, k, generator=gen).to(DEV, dtype)
    r = torch.randn(1, k, generator=gen).to(DEV, dtype) if res else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEV, dtype)
    b = torch.randn(n, generator=gen).to(DEV, dtype)
    r_out = torch.full_like(x, float("nan")) if res else None
    got = int4_gemv(x, qw, scales, zeros, b, cfg, norm=(nw, 1e-5), residual=r,
                    residual_out=r_out)
    s = x if r is None else x + r
    h = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    act = nw * h.to(dtype)
    _judge(got, int4_linear_ref(act, qw, scales, zeros, b), act, qw, scales, zeros, b)
    if res:
        assert torch.equal(r_out, s)


def test_int4_gemv_norm_names_bad_input():
    qw, scales, zeros, _ = _weight(24, 128, 32, 5)
    x = torch.randn(1, 128, device=DEV)
    nw = torch.ones(128, device=DEV)
    with pytest.raises(ValueError, match="one row"):
        int4_gemv(x.repeat(2, 1), qw, scales, zeros, config=CHAIN, norm=(nw, 1e-5))
    with pytest.raises(ValueError, match="chain config"):
        int4_gemv(x, qw, scales, zeros, config=FMA, norm=(nw, 1e-5))
    with pytest.raises(ValueError, match="norm weight"):
        int4_gemv(x, qw, scales, zeros, config=CHAIN, norm=(nw[:64], 1e-5))
    with pytest.raises(ValueError, match="residual_out"):
        int4_gemv(x, qw, scales, zeros, config=CHAIN, norm=(nw, 1e-5), residual=x)
    with pytest.raises(ValueError, match="residual needs norm"):
        int4_gemv(x, qw, scales, zeros, config=CHAIN, residual=x, residual_out=x.clone())


def test_default_config_runs_and_names_round_trip():
    """The launcher's own choice (split K off the GPU) at 1 and 5 rows, and every config's
    name (what the benchmark prints) parses back to it."""
    for m in (1, 5):
        x, qw, scales, zeros, b = _case(m, 24, 128, 64, None, True, torch.float32)
        torch.testing.assert_close(int4_gemv(x, qw, scales, zeros, b),
                                   int4_linear_ref(x, qw, scales, zeros, b), atol=1e-4, rtol=1e-4)
    for cfg in (*CANDIDATES, default_config(1, 4096, 4096), default_config(16, 4096, 4096)):
        assert parse_config(cfg.name) == cfg
    with pytest.raises(ValueError, match="not a config name"):
        parse_config("n16k64")


@pytest.mark.parametrize("m", [17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_more_than_16_rows_on_the_tensor_cores(m, dtype):
    """17-64 rows: x's operand 32 or 64 wide, split K, bias; the default config and the
    pipelined form."""
    x, qw, scales, zeros, b = _case(m, 40, 128, 32, None, True, dtype)
    ref = int4_linear_ref(x, qw, scales, zeros, b)
    for cfg in (None, Int4GemvConfig(32, 64, 2, 4, dot=True, prefetch=0, num_stages=3)):
        _judge(int4_gemv(x, qw, scales, zeros, b, cfg), ref, x, qw, scales, zeros, b)
    assert supports(m, 128, 32) and not supports(m, 24, 8)  # past 16: tl.dot's K tiles only


def test_narrow_k_tiles_fall_back_to_cuda_cores():
    """K = 8 x odd: 8-wide tiles, too narrow for tl.dot; a dot config still runs (on FMAs)."""
    x, qw, scales, zeros, _ = _case(3, 16, 24, 8, None, False, torch.float32)
    got = int4_gemv(x, qw, scales, zeros, config=DOT)
    torch.testing.assert_close(got, int4_linear_ref(x, qw, scales, zeros), atol=1e-4, rtol=1e-4)


def test_launcher_names_bad_input():
    qw, scales, zeros, _ = _weight(16, 64, 32, 1)
    x = torch.randn(2, 64).to(DEV)
    with pytest.raises(ValueError, match="x .* does not fit"):
        int4_gemv(torch.randn(2, 32).to(DEV), qw, scales, zeros)
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows, got {MAX_ROWS + 1}"):
        int4_gemv(torch.randn(MAX_ROWS + 1, 64).to(DEV), qw, scales, zeros)
    with pytest.raises(ValueError, match="17 rows .past 16. run on the tensor cores only"):
        int4_gemv(torch.randn(17, 64).to(DEV), qw, scales, zeros, config=Int4GemvConfig(64, 32, 1, 4))
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        int4_gemv(x.to(torch.float64), qw, scales, zeros)
    with pytest.raises(ValueError, match="bias must be"):
        int4_gemv(x, qw, scales, zeros, torch.zeros(16, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match="prefetch must be 0 .* or 1, 2, 3"):
        int4_gemv(x, qw, scales, zeros, config=Int4GemvConfig(prefetch=4))
    with pytest.raises(ValueError, match="qweight must be int32"):
        int4_gemv(x, qw.float(), scales, zeros)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        int4_gemv(x, qw, scales, zeros.int())
    # K = 60, not a whole number of words: no [N, K/8] weight fits it
    with pytest.raises(ValueError, match="x .* does not fit"):
        int4_gemv(torch.randn(2, 60).to(DEV), qw, scales, zeros)
    with pytest.raises(ValueError, match="group size 4 is not a multiple of 8"):
        int4_gemv(x, qw, scales.repeat(1, 8), zeros.repeat(1, 8))


def test_layer_dispatch_runs_the_gemv_on_cuda_decode_rows(monkeypatch):
    """layers/int4.int4_linear's choice, read without a GPU: the GEMV at 1-64 rows by
    default, the swapped GEMM above up to GEMM_MAX_ROWS (where its K tiles of 16 fit),
    dequantize + cuBLAS past it; the old tl.dot kernel with FLASHPAGE_INT4_KERNEL=gemm (or
    1), dequantize + cuBLAS at every size with =dequant."""
    from flashpage.layers.int4 import GEMM_MAX_ROWS, GEMV_ROWS, cuda_path

    monkeypatch.delenv("FLASHPAGE_INT4_KERNEL", raising=False)
    assert cuda_path(1, 4096, 128) == cuda_path(GEMV_ROWS, 4096, 128) == "gemv"
    assert cuda_path(GEMV_ROWS + 1, 4096, 128) == cuda_path(GEMM_MAX_ROWS, 4096, 4096) == "swap"
    assert cuda_path(GEMM_MAX_ROWS + 1, 4096, 128) == "dequant"
    assert cuda_path(GEMV_ROWS + 1, 72, 8) == "dequant"  # K = 8 x 9: no K tile of 16
    monkeypatch.setenv("FLASHPAGE_INT4_KERNEL", "dequant")
    assert cuda_path(256, 4096, 128) == "dequant"
    for value, want in (("gemm", "gemm"), ("1", "gemm"), ("dequant", "dequant"),
                        ("0", "dequant"), ("gemv", "gemv")):
        monkeypatch.setenv("FLASHPAGE_INT4_KERNEL", value)
        assert cuda_path(4, 4096, 128) == want, value
    monkeypatch.setenv("FLASHPAGE_INT4_KERNEL", "fast")
    with pytest.raises(ValueError, match="FLASHPAGE_INT4_KERNEL"):
        cuda_path(4, 4096, 128)


def test_layer_dispatch_fuses_silu_mul_into_int4_down_projections(monkeypatch):
    """layers/int4.fuses_silu_mul (a pure function of shape, dtype, device and env): an int4
    down projection takes the gate/up output itself on CUDA at one row (fused, 8-16 rows
    were slower on the H200, run 175), wherever int4_linear would run the GEMV; not on the
    CPU, at more rows, with another kernel chosen, or for an h of the wrong width."""
    from flashpage.layers.int4 import GEMV_ROWS, fuses_silu_mul

    monkeypatch.delenv("FLASHPAGE_INT4_KERNEL", raising=False)
    bf = torch.bfloat16
    assert fuses_silu_mul((1, 28672), bf, True, 14336, 128)
    for m in (2, 8, GEMV_ROWS, GEMV_ROWS + 1):
        assert not fuses_silu_mul((m, 28672), bf, True, 14336, 128), m
    assert not fuses_silu_mul((1, 28672), bf, False, 14336, 128)  # the CPU
    assert not fuses_silu_mul((1, 14336), bf, True, 14336, 128)  # not gate | up
    assert not fuses_silu_mul((1, 28672), torch.float64, True, 14336, 128)
    for value in ("dequant", "gemm"):
        monkeypatch.setenv("FLASHPAGE_INT4_KERNEL", value)
        assert not fuses_silu_mul((1, 28672), bf, True, 14336, 128), value


def test_layer_dispatch_fuses_the_norm_into_one_row_int4_linears(monkeypatch):
    """layers/int4.fuses_norm (shape, dtype, device, env): with FLASHPAGE_INT4_FUSED_NORM=1
    the RMSNorm moves into an int4 linear's GEMV at one row on CUDA wherever int4_linear
    runs the GEMV; not by default, on the CPU, at more rows, with another kernel chosen, or
    for an x of the wrong width."""
    from flashpage.layers.int4 import fuses_norm

    monkeypatch.delenv("FLASHPAGE_INT4_KERNEL", raising=False)
    bf = torch.bfloat16
    monkeypatch.delenv("FLASHPAGE_INT4_FUSED_NORM", raising=False)
    assert not fuses_norm((1, 4096), bf, True, 4096, 128)  # off by default (run 179)
    monkeypatch.setenv("FLASHPAGE_INT4_FUSED_NORM", "1")
    assert fuses_norm((1, 4096), bf, True, 4096, 128)
    assert not fuses_norm((2, 4096), bf, True, 4096, 128)
    assert not fuses_norm((1, 4096), bf, False, 4096, 128)
    assert not fuses_norm((1, 2048), bf, True, 4096, 128)
    assert not fuses_norm((1, 4096), torch.float64, True, 4096, 128)
    monkeypatch.setenv("FLASHPAGE_INT4_KERNEL", "dequant")
    assert not fuses_norm((1, 4096), bf, True, 4096, 128)


@pytest.mark.parametrize("res", [True, False])
def test_int4_linear_takes_a_pending_norm(monkeypatch, res):
    """An int4 linear handed the RMSNorm unevaluated (PendingNorm), its CUDA choice forced
    on the CPU (the interpreter runs the kernel): one int4_gemv call with norm=, equal to
    the norm then the layer, x + residual written to residual_out; without the choice it
    computes the norm first."""
    import flashpage.kernels.int4_gemv as gemv_mod
    import flashpage.layers.linear as linear
    from flashpage.layers.linear import ColumnParallelLinear, PendingNorm
    from flashpage.layers.norm import RMSNorm

    torch.manual_seed(1)
    lin = ColumnParallelLinear(128, 48, bias=True).to(DEV)
    lin.weight.data.normal_(0, 0.2)
    lin.bias.data.normal_(0, 0.2)
    lin.quantize_int4(32)
    norm = RMSNorm(128, 1e-5).to(DEV)
    norm.weight.data.normal_(1, 0.1)
    norm.fused = True
    x, r = torch.randn(1, 128, device=DEV), torch.randn(1, 128, device=DEV)
    want_x, want_r = norm(x, r) if res else (norm(x), None)
    want = lin(want_x)
    r_out = torch.empty_like(x) if res else None
    if not GPU:
        assert not lin.fuses_norm(x, norm)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("norm") is not None)
        return real(*args, **kwargs)

    real = gemv_mod.int4_gemv
    monkeypatch.setattr(gemv_mod, "int4_gemv", spy)
    monkeypatch.setattr(linear, "int4_fuses_norm", lambda *a: True)
    assert lin.fuses_norm(x, norm)
    got = lin(PendingNorm(x, r if res else None, norm, r_out))
    assert calls == [True]
    # fp32 x: the chains carry 2048 * x beside q * x, ~2^-13 of a word's sum (the dense
    # reference is exact in fp32; bf16 outputs round at 2^-9)
    torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-3)
    if res:
        assert torch.equal(r_out, want_r)


def test_int4_mlp_down_projection_runs_the_fused_gemv(monkeypatch):
    """An int4 MLP's down projection, its CUDA choice forced on the CPU (the interpreter
    runs the kernel): silu_mul_forward is the fused GEMV and equals SiLU·mul then the
    layer; without the choice (the CPU) it declines and the MLP runs the two steps."""
    import flashpage.layers.linear as linear
    from flashpage.layers.mlp import GatedMLP

    torch.manual_seed(0)
    mlp = GatedMLP(32, 64).to(DEV)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.data.normal_(0, 0.2)
        lin.quantize_int4(32)
    x = torch.randn(3, 32).to(DEV)
    h = mlp.gate_up_proj(x)
    unfused = mlp.down_proj(_silu_mul_ref(h))
    if not GPU:
        assert mlp.down_proj.silu_mul_forward(h) is None
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("silu_mul"))
        return real(*args, **kwargs)

    import flashpage.kernels.int4_gemv as gemv_mod

    real = gemv_mod.int4_gemv
    monkeypatch.setattr(gemv_mod, "int4_gemv", spy)
    monkeypatch.setattr(linear, "fuses_silu_mul", lambda *a: True)
    got = mlp.down_proj.silu_mul_forward(h)
    assert calls == [True] and got is not None
    torch.testing.assert_close(got, unfused, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mlp(x), unfused, atol=1e-4, rtol=1e-4)


def test_unpack_ptx_constants_give_q_minus_z():
    """The inline PTX's arithmetic (which the interpreter cannot run), replayed in torch on
    its own constants: lop3 (w >> 4i) & 0x000F000F | MAGIC makes the 16-bit pair
    (OFFSET + q[i], OFFSET + q[i + 4]), and x * 1 - (OFFSET + z) is q - z, exactly."""
    from flashpage.kernels.int4_gemv import _UNPACK_TYPES, _unpack_ptx

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 8), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 17, (64, 1), generator=gen, dtype=torch.int32)
    words = pack_int4(q)[:, 0].to(torch.int64) & 0xFFFFFFFF
    for dtype, (magic, offset, one, ty) in _UNPACK_TYPES.items():
        ptx = _unpack_ptx(dtype)
        assert magic in ptx and one in ptx and f"fma.rn.{ty}" in ptx and "0xEA" in ptx
        assert torch.tensor([int(one, 16) & 0xFFFF], dtype=torch.int16).view(dtype).item() == 1.0
        nz = (-(z.float() + offset)).to(dtype)
        got = torch.empty(64, 8, dtype=torch.float32)
        for i in range(4):
            pair = ((words >> (4 * i)) & 0x000F000F) | int(magic, 16)  # lop3 0xEA: a & b | c
            halves = torch.stack([pair & 0xFFFF, pair >> 16], 1).to(torch.int16)  # wraps
            vals = halves.view(dtype)  # [64, 2]: (OFFSET + q[i], OFFSET + q[i + 4])
            res = (vals.float() * 1.0 + nz.float()).to(dtype)  # fma, exact
            got[:, i], got[:, i + 4] = res[:, 0].float(), res[:, 1].float()
        assert torch.equal(got, (q - z).float()), dtype


def test_nibbles_ptx_gives_2048_and_128_plus_q():
    """The chains' inline PTX (which the interpreter cannot run), replayed in torch from
    its own text: each shift then lop3 (a & mask | magic) gives nibbles 3, 1, 5, 0 as the
    fp32 2048 + q and 4, 2, 6, 7 as 128 + q, exactly."""
    import re

    from flashpage.kernels.int4_gemm import _NIBBLES_PTX

    ptx = _NIBBLES_PTX.value
    regs = dict(re.findall(r"mov\.b32 (\w+), (0x[0-9A-F]+);", ptx))
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (256, 8), generator=gen, dtype=torch.int32)
    w = pack_int4(q)[:, 0].to(torch.int64) & 0xFFFFFFFF
    t = w
    got = {}
    for line in ptx.splitlines():
        if line.startswith(("shl.b32", "shr.u32")):
            n = int(line.rstrip(";").split(",")[-1])
            t = (w << n) & 0xFFFFFFFF if line.startswith("shl") else w >> n
        elif line.startswith("lop3.b32"):
            out, src, mask, magic, op = (a.strip() for a in line[9:].rstrip(";").split(","))
            assert op == "0xEA"  # a & b | c
            v = ((w if src == "$8" else t) & int(regs[mask], 16)) | int(regs[magic], 16)
            got[int(out[1:])] = v.to(torch.int32).view(torch.float32)
    assert sorted(got) == list(range(8))
    for i, j in enumerate((3, 1, 5, 0)):
        assert torch.equal(got[i], q[:, j].float() + 2048), j
    for i, j in enumerate((4, 2, 6, 7)):
        assert torch.equal(got[4 + i], q[:, j].float() + 128), j


def _compile_int4_gemv() -> dict[str, dict]:
    """(In a subprocess with the interpreter off.) The GEMV's forms compiled for sm_90 as a
    bf16 launch of the 8B shapes specializes them (groups of 128, split K): name ->
    {"mma", "regs", "spill_bytes", "per_weight" (SASS instructions of the K loop per
    weight a thread holds), "async_copies" (the TTGIR's cp.async copies into shared memory,
    the pipeliner's), "ldgsts" (their SASS in the K loop), "shared" (bytes)}."""
    import torch
    from sm90 import compile_sm90, ptxas_sm90a, ptxas_usage, sass_instructions, sass_loops

    from flashpage.kernels import int4_gemv as m

    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "out_ptr", "N", "K", "stride_qw",
               "stride_xm", "stride_om", "stride_os")
    default = m.default_config(16, 4096, 4096)
    prefetch_asm = m.Int4GemvConfig(64, 128, 0, 4, dot=True, asm=True, prefetch=2)
    pipe_fma = m.Int4GemvConfig(64, 128, 0, 4, 3, prefetch=0)
    pipe_asm = m.Int4GemvConfig(64, 128, 0, 4, 4, dot=True, asm=True, prefetch=0)
    chain = m.default_config(1, 4096, 4096)
    assert pipe_fma in m.CANDIDATES and pipe_asm in m.CANDIDATES and chain in m.CANDIDATES
    # name -> (BLOCK_M, config, inline PTX, SiLU·mul)
    forms = {"fma_1row": (1, m.Int4GemvConfig(64, 128, 0, 4), False, False),
             "prefetch_asm": (16, prefetch_asm, True, False),
             "default_asm": (16, default, default.asm, False),
             "asm_64rows": (64, default, default.asm, False),
             "pipe_fma_1row": (1, pipe_fma, False, False),
             "pipe_asm": (16, pipe_asm, True, False),
             "pipe_asm_silu": (16, pipe_asm, True, True),
             "pipe_fma_1row_silu": (1, pipe_fma, False, True),
             "chain_1row": (1, chain, True, False),
             "chain_1row_silu": (1, chain, True, True),
             "chain_1row_norm_pdl": (1, chain, True, False, True)}
    out = {}
    for name, (bm, cfg, asm, silu, *rest) in forms.items():
        norm = bool(rest and rest[0])
        k = compile_sm90(m._int4_gemv_kernel, dict(
            G=128, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=2,
            HAS_BIAS=False, DOT=cfg.dot, PRECISION="tf32", PREFETCH=cfg.prefetch, ASM=asm,
            PTX=m._unpack_ptx(torch.bfloat16) if asm and cfg.dot else "",
            OFFSET=128.0 if asm and cfg.dot else 0.0,
            NUM_STAGES=cfg.num_stages, SILU_MUL=silu, CHAIN=cfg.chain, NORM=norm,
            HAS_RES=norm, PDL=norm),
            {"qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "out_ptr": "*fp32",
             "eps": "fp32"},
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, aligned=aligned)
        ptx = k.asm["ptx"]
        log, sass = ptxas_sm90a(ptx)
        ins, labels = sass_instructions(sass)
        loops = sass_loops(ins, labels)
        lo, hi = max(loops, key=lambda p: p[1] - p[0]) if loops else (0, -1)
        weights = cfg.block_n * cfg.block_k / (32 * cfg.num_warps)
        out[name] = {"mma": "mma" in ptx, "per_weight": (hi - lo + 1) / weights,
                     "async_copies": k.asm["ttgir"].count("ttg.async_copy_global_to_local"),
                     "ldgsts": sum(t.startswith("LDGSTS") for t in ins[lo:hi + 1]),
                     "shared": k.metadata.shared, **ptxas_usage(log)}
    return out


def test_int4_gemv_compiles_for_sm90():
    """On the CPU: both forms build for an H200, the default on tensor cores, nothing
    spilled (a spill in the K loop would cost more than the weight's bytes), and the K
    loop stays near its instruction count per weight (sm_90 issues ~128 a cycle per SM:
    at 4 a weight, ~8.4e12 weights/s, 4.2 TB/s of int4 bytes; 2.4 TB/s at 7)."""
    from sm90 import run_compiled

    got = run_compiled("test_int4_gemv", "_compile_int4_gemv")
    assert got["default_asm"]["mma"], got
    assert not got["fma_1row"]["mma"], got
    assert all(v["spill_bytes"] == 0 for v in got.values()), got
    assert got["prefetch_asm"]["per_weight"] <= 5, got  # 4.4 when written (3.8 with stride_qw)
    assert got["fma_1row"]["per_weight"] <= 9, got  # 7.3 when written (7.4 with stride_qw)
    # the K loop left to the pipeliner: its word tiles (and x's, for the tensor cores) are
    # cp.async copies into shared memory, issued inside the K loop (LDGSTS), stages ahead
    assert got["fma_1row"]["async_copies"] == got["prefetch_asm"]["async_copies"] == 0, got
    for name in ("default_asm", "asm_64rows", "pipe_fma_1row", "pipe_asm", "pipe_asm_silu",
                 "pipe_fma_1row_silu"):
        assert got[name]["async_copies"] > 0 and got[name]["ldgsts"] > 0, (name, got)
        assert got[name]["shared"] > 0, (name, got)
    assert got["pipe_asm"]["mma"] and got["pipe_asm"]["per_weight"] <= 5, got  # 4.2 written
    assert got["default_asm"]["per_weight"] <= 5 and got["asm_64rows"]["mma"], got
    assert got["pipe_fma_1row"]["per_weight"] <= 9, got  # 7.3 when written
    # SiLU·mul's exp and division per K tile, one row on the CUDA cores (what the engine
    # fuses): 7.7 when written
    assert got["pipe_fma_1row_silu"]["per_weight"] <= 9, got
    # the one-row default: the FFMA chains, ~2 instructions a weight fewer (5.5 / 6.0 with
    # SiLU·mul when written)
    assert not got["chain_1row"]["mma"] and got["chain_1row"]["async_copies"] == 0, got
    assert got["chain_1row"]["per_weight"] <= 6.2, got
    assert got["chain_1row_silu"]["per_weight"] <= 6.6, got
    # the RMSNorm prologue costs the K loop little (x's tile normed instead of loaded)
    assert got["chain_1row_norm_pdl"]["per_weight"] <= 6.6, got


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 8, 16, 32, 64])
def test_int4_gemv_bf16_8b_shapes_on_the_gpu(n, k, m):
    qw, scales, zeros, _ = _weight(n, k, 128, 7)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    got = int4_gemv(x, qw, scales, zeros)
    _as_close_as_the_reference(got, int4_linear_ref(x, qw, scales, zeros), x, qw, scales, zeros)
    # and the layer's path at these rows is this kernel
    from flashpage.layers.int4 import GEMV_ROWS, int4_linear

    if m <= GEMV_ROWS:
        assert torch.equal(int4_linear(x, qw, scales, zeros), got)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("cfg", CANDIDATES, ids=lambda c: c.name)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_int4_gemv_candidates_bf16_on_the_gpu(cfg, m):
    """Every tile the benchmark sweeps is correct on the GPU (o_proj's shape, bias)."""
    n, k = 4096, 4096
    qw, scales, zeros, _ = _weight(n, k, 128, 3)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    got = int4_gemv(x, qw, scales, zeros, b, cfg)
    _as_close_as_the_reference(got, int4_linear_ref(x, qw, scales, zeros, b), x, qw, scales,
                               zeros, b)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("cfg", [None, *(c for c in CANDIDATES if c.pipelined)],
                         ids=lambda c: "default" if c is None else c.name)
@pytest.mark.parametrize("m", [1, 8, 16])
def test_int4_gemv_silu_mul_bf16_8b_down_on_the_gpu(cfg, m):
    """The 8B down projection (4096 x 14336) from the gate/up output h [M, 28672]: the
    fused GEMV against SiLU·mul (kernels/silu_mul) then the reference, at the default tile
    and every pipelined one; and the layer fuses it at one row only."""
    from flashpage.kernels.silu_mul import silu_and_mul
    from flashpage.layers.int4 import fuses_silu_mul

    n, k = 4096, 14336
    qw, scales, zeros, _ = _weight(n, k, 128, 11)
    h = torch.randn(m, 2 * k, device=DEV, dtype=torch.bfloat16) * 2
    got = int4_gemv(h, qw, scales, zeros, config=cfg, silu_mul=True)
    act = silu_and_mul(h)
    _as_close_as_the_reference(got, int4_linear_ref(act, qw, scales, zeros), act, qw, scales,
                               zeros)
    if cfg is None:
        assert torch.equal(got, int4_gemv(act, qw, scales, zeros))  # the same sums
        assert fuses_silu_mul(tuple(h.shape), h.dtype, h.is_cuda, k, 128) == (m == 1)
