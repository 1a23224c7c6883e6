"""Block-scaled fp8 linears (kernels/fp8_block_gemm.py) against their torch references
(kernels/fp8_block_ref.py): the per-token-group activation quantizer bit for bit, the
weight-only (W8A16) and W8A8 kernels with partial N and K blocks, several block shapes,
bias and split K; fp32 / fp16 under the interpreter on the CPU (whose fp8 ``tl.dot`` is
exact: the e4m3 products summed in fp32), bf16 and the e4m3 tensor cores on the GPU, and
the kernels compiled for sm_90 (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from flashpage.kernels import fp8_block_gemm
from flashpage.kernels.fp8_block_gemm import (
    W8A8_CANDIDATES,
    BlockFp8Config,
    parse_config,
    quantize_per_token_group,
    w8a8_block_linear,
    w8a8_block_matmul,
    w8a8_config,
    w8a8_split_k,
    w8a16_block_matmul,
)
from flashpage.kernels.fp8_block_ref import (
    dequantize_fp8_block,
    quantize_fp8_block,
    quantize_per_token_group_ref,
    tile_k,
    w8a8_block_linear_ref,
    w8a16_block_linear_ref,
)
from flashpage.kernels.fp8_quant import quantize_per_token_ref
from flashpage.kernels.gemv import RowConfig, gemv_row, gemv_row_norm_ref, skinny_linear_ref
from tests.kernels.test_fp8_kv import (  # noqa: F401  (autouse: torch's fp8 casts in the interpreter)
    exact_fp8_casts_in_the_interpreter,
)

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
CPU_ONLY = pytest.mark.skipif(GPU, reason="the CPU variant (interpreter)")
FP8 = torch.float8_e4m3fn


def _weights(n, k, block, seed, bias=False, dtype=torch.float32):
    """A block-quantized random weight whose tiles differ in magnitude by up to 1000x (a
    scale per row or per tensor would not do), and a bias."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(n, k, device=DEV, generator=g) / k ** 0.5
    bn, bk = block
    mag = torch.logspace(-1.5, 1.5, 7, device=DEV)
    tiles = mag[torch.randint(0, 7, (-(-n // bn), -(-k // bk)), device=DEV, generator=g)]
    w *= tiles.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q, s = quantize_fp8_block(w, block)
    b = torch.randn(n, device=DEV, generator=g).to(dtype) if bias else None
    return w, q, s, b, g


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------------- references
def test_references_mean_the_layout():
    """dequantize_fp8_block multiplies each tile by its own scale (edge tiles partial);
    quantize_fp8_block's round trip is within e4m3's rounding of every value; a group as
    wide as the row is kernels/fp8_quant's per-token quantizer."""
    n, k, block = 70, 100, (32, 48)
    w, q, s, _, g = _weights(n, k, block, 0)
    assert q.dtype == FP8 and s.shape == (3, 3) and s.dtype == torch.float32
    deq = dequantize_fp8_block(q, s, block)
    for i in range(3):
        for j in range(3):
            rows, cols = slice(32 * i, 32 * (i + 1)), slice(48 * j, 48 * (j + 1))
            assert torch.equal(deq[rows, cols], q[rows, cols].float() * s[i, j])
            # every tile uses the top of e4m3's range
            assert q[rows, cols].float().abs().max() == 448
    assert torch.all((deq - w).abs() <= 2 ** -4 * w.abs() + 2 ** -9 * s.max())
    x = torch.randn(5, 300, device=DEV, generator=g)
    a, sa = quantize_per_token_group_ref(x, 300)
    b, sb = quantize_per_token_ref(x)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb)


@pytest.mark.parametrize("m,k,group", [(1, 256, 128), (4, 300, 128), (3, 100, 48), (2, 64, 64),
                                       (0, 128, 128), (6, 4096, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else []))
def test_quantize_per_token_group_bit_for_bit(m, k, group, dtype):
    """Each (row, group) by its own amax, the last group partial, a zero group at the floor
    scale with zeros (not NaN): the kernel's e4m3 bytes and scales are the reference's."""
    g = torch.Generator(device=DEV).manual_seed(m + k)
    x = torch.randn(m, k, device=DEV, generator=g) * torch.logspace(-3, 3, k, device=DEV)
    x = x.to(dtype)
    if m > 1:
        x[1, :group] = 0
    q, s = quantize_per_token_group(x, group)
    rq, rs = quantize_per_token_group_ref(x, group)
    ng = -(-k // group)
    assert q.dtype == FP8 and q.shape == (m, k) and s.shape == (m, ng) and s.dtype == torch.float32
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert not q.float().isnan().any()
    if m > 1:
        assert s[1, 0] == 1e-12 and not q[1, :group].float().any()
    if m and ng > 1:  # scales per group: they differ along the row (x grows with k)
        assert s[0, -1] > s[0, 0]


def test_bad_input_is_named():
    q = torch.zeros(64, 96, dtype=FP8, device=DEV)
    s = torch.ones(2, 2, device=DEV)
    x = torch.zeros(2, 96, device=DEV)
    with pytest.raises(ValueError, match=r"block scales must be fp32 \[2, 2\] for a \[64, 96\] weight in 32x48"):
        w8a16_block_matmul(x, q, torch.ones(2, 3, device=DEV), (32, 48))
    with pytest.raises(ValueError, match=r"block scales must be fp32 \[2, 2\]"):
        w8a16_block_matmul(x, q, s.half(), (32, 48))
    with pytest.raises(ValueError, match=r"no kernel for K blocks of 24"):
        w8a16_block_matmul(x, q, torch.ones(2, 4, device=DEV), (32, 24))
    with pytest.raises(ValueError, match=r"x \(2, 64\) does not fit a \[64, 96\] weight"):
        w8a16_block_matmul(x[:, :64], q, torch.ones(2, 2, device=DEV), (32, 48))
    with pytest.raises(ValueError, match=r"weight must be float8_e4m3fn"):
        w8a16_block_matmul(x, q.float(), torch.ones(2, 2, device=DEV), (32, 48))
    with pytest.raises(ValueError, match=r"xs must be fp32 \[2, 2\]"):
        w8a8_block_matmul(x.to(FP8), torch.ones(2, 1, device=DEV), q,
                          torch.ones(2, 2, device=DEV), (32, 48))
    with pytest.raises(ValueError, match=r"group must be positive"):
        quantize_per_token_group(x, 0)
    assert tile_k(128) == 128 and tile_k(48) == 16 and tile_k(256) == 128 and tile_k(24) == 0
    assert parse_config(BlockFp8Config(16, 64, 0, 4, 4, 8).name) == BlockFp8Config(16, 64, 0, 4, 4, 8)


# ----------------------------------------------------------------------------- CPU (interpreter)
SHAPES = [  # m, n, k, block
    (1, 96, 256, (128, 128)),    # one partial N block
    (3, 200, 300, (128, 128)),   # partial N and K blocks
    (5, 64, 100, (32, 48)),      # the checkpoint tests' blocks: K tiles of 16
    (2, 130, 192, (64, 32)),
    (20, 150, 256, (128, 128)),  # past the decode tile: the GEMM tile
]


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,block", SHAPES)
def test_w8a16_block_cpu(m, n, k, block, bias, dtype):
    w, q, s, b, g = _weights(n, k, block, m + n + k, bias, dtype)
    x = torch.randn(m, k, device=DEV, generator=g).to(dtype)
    got = w8a16_block_matmul(x, q, s, block, b)
    ref = w8a16_block_linear_ref(x, q, s, block, b)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)
    # split K (each split's fp32 sums added after, with the bias) gives the same
    split = w8a16_block_matmul(x, q, s, block, b, config=BlockFp8Config(16, 32, split_k=3))
    torch.testing.assert_close(split.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)


@CPU_ONLY
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,block", SHAPES + [(70, 130, 256, (128, 128))])
def test_w8a8_block_cpu(m, n, k, block, bias, out_dtype):
    """The interpreter's fp8 dot is exact (e4m3 products in fp32), so the kernel equals the
    emulation to fp32's summation order; and W8A8 stays within e4m3's activation rounding
    of the weight-only product."""
    w, q, s, b, g = _weights(n, k, block, m * n + k, bias)
    x = torch.randn(m, k, device=DEV, generator=g)
    xq, xs = quantize_per_token_group(x, block[1])
    got = w8a8_block_matmul(xq, xs, q, s, block, b, out_dtype=out_dtype,
                            config=BlockFp8Config(16, 32, group_m=2))
    ref = w8a8_block_linear_ref(x, q, s, block, b, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    tol = 1e-5 if out_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)
    assert torch.equal(w8a8_block_linear(x, q, s, block, b, config=BlockFp8Config(16, 32, group_m=2)),
                       w8a8_block_matmul(xq, xs, q, s, block, b, out_dtype=torch.float32,
                                         config=BlockFp8Config(16, 32, group_m=2)))
    # activations rounded to e4m3 per group: ~2^-5 relative rms, far from nothing
    err = _rel(ref, w8a16_block_linear_ref(x, q, s, block, b))
    assert 2 ** -10 < err < 2 ** -4, err


CANDIDATE_CASES = [  # m, n, k, block
    (70, 200, 300, (128, 128)),  # partial row, column and K tiles; one weight scale a tile
    (130, 260, 256, (64, 128)),  # 64-row blocks: a 128-column tile takes a scale a column
    (40, 300, 512, (256, 128)),  # 256-row blocks: tiles share a block row, split K uneven
]


@CPU_ONLY
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("m,n,k,block", CANDIDATE_CASES)
@pytest.mark.parametrize("cfg", W8A8_CANDIDATES, ids=lambda c: c.name)
def test_w8a8_candidate_tiles_cpu(cfg, m, n, k, block, split):
    """Every tile the GPU sweep times (benchmarks/fp8_block_gemm.py --sweep), through
    pointers or TMA descriptors (K 300: pointers, its rows not 16-byte multiples), gives the
    fp32 emulation's product, unsplit (fp32 out) and with K split in 3 (the partial sums
    added after, with the bias; fp16 out): one scale per row and tile where its columns
    share a weight block row, a scale per column where they do not."""
    import dataclasses

    w, q, s, b, g = _weights(n, k, block, m + n + k, bias=True)
    x = torch.randn(m, k, device=DEV, generator=g)
    xq, xs = quantize_per_token_group(x, block[1])
    out_dtype = torch.float32 if split == 1 else torch.float16
    got = w8a8_block_matmul(xq, xs, q, s, block, b, out_dtype=out_dtype,
                            config=dataclasses.replace(cfg, split_k=split))
    ref = w8a8_block_linear_ref(x, q, s, block, b, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (m, n)
    tol = 1e-5 if out_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)
    # TMA tiles read through descriptors where rows are 16-byte multiples (K 256, 512)
    assert fp8_block_gemm._tma_ok(xq, q) == (k % 16 == 0)


def test_w8a8_default_tiles_and_split(monkeypatch):
    """The default tile is one of the swept candidates at every row count, each candidate
    named uniquely (TMA ones with a trailing t); K is split only
    on the GPU, doubling while the programs cover under 90% of the SMs and every split
    keeps 4 K tiles."""
    from flashpage.kernels import device

    for m in (1, 17, 64, 128, 256, 257, 2048, 8192):
        assert w8a8_config(m, 4096, 4096) in W8A8_CANDIDATES
        assert w8a8_config(m, 4096, 14336) in W8A8_CANDIDATES
    # run 194's picks: TMA 64 x 128, but 128 x 128 past 128 rows of a long K
    assert w8a8_config(2048, 14336, 4096).name == "m64n128s0w4st4g8t"
    assert w8a8_config(64, 4096, 14336).name == "m64n128s0w4st4g8t"
    assert w8a8_config(256, 4096, 14336).name == "m128n128s0w8st4g8t"
    # each candidate's name (the sweep's JSON, --configs) is its own and parses back to it
    assert len({c.name for c in W8A8_CANDIDATES}) == len(W8A8_CANDIDATES)
    assert all(parse_config(c.name) == c for c in W8A8_CANDIDATES)
    assert parse_config("m64n128s0w4st3g8t").tma and not parse_config("m64n128s0w4st3g8").tma
    assert w8a8_split_k(8, 64, torch.device("cpu")) == 1
    monkeypatch.setattr(device, "num_sms", lambda dev: 132)
    cuda = torch.device("cuda")
    assert w8a8_split_k(32, 32, cuda) == 4      # 64 x 4096 outputs in 64 x 128 tiles, K 4096
    assert w8a8_split_k(32, 112, cuda) == 4     # K 14336
    assert w8a8_split_k(112, 32, cuda) == 2     # 64 x 14336
    assert w8a8_split_k(128, 32, cuda) == 1     # 128 programs: 97% of the SMs
    assert w8a8_split_k(4, 8, cuda) == 2        # 8 K tiles: two splits of 4, no more
    assert w8a8_split_k(4, 7, cuda) == 1


ROW_CASES = [  # n, k, block, config (None: default_row_config), silu_mul
    (96, 256, (128, 128), None, False),                 # whole row, sub-tiles of 128
    (200, 300, (128, 128), None, True),                 # partial N and K blocks, SiLU·mul
    (64, 100, (32, 48), None, False),                   # whole row of 128: sub-tiles of 16
    (130, 512, (128, 128), RowConfig(4, 128, 4), False),  # looped, a tile = a block
    (130, 512, (64, 32), RowConfig(8, 64, 4), True),    # looped, two blocks a tile
    (70, 200, (32, 48), RowConfig(4, 64, 4), False),    # looped, tiles across block edges
]


@CPU_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,block,cfg,silu", ROW_CASES)
def test_gemv_row_block_scales_cpu(n, k, block, cfg, silu, dtype):
    """The one-row GEMV (kernels/gemv.gemv_row) over block-scaled weights: each sub-tile's
    sum under its block's scale equals the dequantized weight's linear (SiLU·mul rounded as
    the skinny reference rounds it)."""
    _, q, s, b, g = _weights(n, k, block, n + k, bias=True, dtype=dtype)
    x = torch.randn(1, 2 * k if silu else k, device=DEV, generator=g).to(dtype)
    got = gemv_row(x, q, b, config=cfg, silu_mul=silu, scale=s, block=block)
    ref = skinny_linear_ref(x, dequantize_fp8_block(q, s, block), b, silu_mul=silu)
    assert got.dtype == dtype and got.shape == (1, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)


@CPU_ONLY
@pytest.mark.parametrize("with_res", [False, True])
def test_gemv_row_block_scales_norm_prologue_cpu(with_res):
    """The RMSNorm (and residual add) in the GEMV's prologue, block scales on the sums."""
    _, q, s, b, g = _weights(150, 384, (128, 128), 7, bias=True)
    x = torch.randn(1, 384, device=DEV, generator=g)
    res = torch.randn(1, 384, device=DEV, generator=g) if with_res else None
    nw = torch.rand(384, device=DEV, generator=g) + 0.5
    res_out = torch.empty_like(x) if with_res else None
    got = gemv_row(x, q, b, norm=(nw, 1e-6), residual=res, residual_out=res_out, scale=s,
                   block=(128, 128))
    ref, summed = gemv_row_norm_ref(x, dequantize_fp8_block(q, s, (128, 128)), nw, 1e-6, res, b)
    torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    if with_res:
        assert torch.equal(res_out, summed)


def test_gemv_row_block_scales_are_checked():
    x = torch.zeros(1, 96, device=DEV)
    q = torch.zeros(64, 96, dtype=FP8, device=DEV)
    with pytest.raises(ValueError, match="block-scaled fp8 weights need their scales"):
        gemv_row(x, q, block=(32, 48))
    with pytest.raises(ValueError, match=r"block scales must be fp32 \[2, 2\]"):
        gemv_row(x, q, scale=torch.ones(64, device=DEV), block=(32, 48))


def test_fp8_block_linear_on_the_cpu_is_the_dequantized_linear():
    """layers/quant.fp8_block_linear off CUDA: the weight dequantized to x's dtype, then
    F.linear, for any leading shape: the dequantized checkpoint's own product, to the bit."""
    from flashpage.layers.quant import fp8_block_linear

    w, q, s, b, g = _weights(96, 128, (32, 48), 1, bias=True)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0))
    got = fp8_block_linear(x, q.cpu(), s.cpu(), (32, 48), b.cpu())
    want = torch.nn.functional.linear(x, dequantize_fp8_block(q.cpu(), s.cpu(), (32, 48)), b.cpu())
    assert got.shape == (2, 3, 96) and torch.equal(got, want)


# ----------------------------------------------------------------------------- GPU
GPU_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (576, 7168)]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_w8a16_block_gpu_bf16(m, n, k):
    """Weight-only at the decode sizes (split K chosen from the SM count): the bf16 output
    within bf16 rounding of the fp32 reference."""
    _, q, s, _, g = _weights(n, k, (128, 128), m + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    got = w8a16_block_matmul(x, q, s, (128, 128))
    ref = w8a16_block_linear_ref(x, q, s, (128, 128))
    assert _rel(got, ref) < 2 ** -8


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("n,k,silu", [(4096, 4096, False), (28672, 4096, False),
                                      (4096, 14336, True), (576, 7168, False)])
def test_gemv_row_block_scales_gpu_bf16(n, k, silu, pdl):
    """The one-row GEMV over block scales in bf16, whole rows (K 4096, 7168) and looped
    (14336, SiLU·mul), with and without PDL; and its norm prologue at K 4096."""
    _, q, s, _, g = _weights(n, k, (128, 128), n + k)
    x = torch.randn(1, 2 * k if silu else k, device="cuda", generator=g).bfloat16()
    got = gemv_row(x, q, silu_mul=silu, scale=s, block=(128, 128), pdl=pdl)
    ref = skinny_linear_ref(x, dequantize_fp8_block(q, s, (128, 128)), silu_mul=silu)
    assert _rel(got, ref) < 2 ** -8
    if k == 4096:
        nw = torch.rand(k, device="cuda", generator=g).bfloat16() + 0.5
        got = gemv_row(x, q, norm=(nw, 1e-6), scale=s, block=(128, 128), pdl=pdl)
        ref, _ = gemv_row_norm_ref(x, dequantize_fp8_block(q, s, (128, 128)), nw, 1e-6)
        assert _rel(got, ref) < 2 ** -8


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [17, 64, 256, 2048])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_w8a8_block_gpu_matches_its_emulation(m, n, k):
    """W8A8 on the e4m3 tensor cores equals the fp32 emulation (the same operands and
    scales) to bf16 rounding, normwise (Hopper's fp8 MMA keeps ~14 mantissa bits between
    promotions, DeepSeek-V3 report 3.3.2: the per-tile scaling promotes every 128 columns),
    and stays close to the unquantized bf16 linear; the quantizer is bit-exact on the GPU."""
    from flashpage.kernels.device import cuda_capability

    if cuda_capability(torch.device("cuda")) < (8, 9):
        pytest.skip("e4m3 tensor cores need sm_89+")
    w, q, s, _, g = _weights(n, k, (128, 128), m + n)
    b = torch.randn(n, device="cuda", generator=g).bfloat16()
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    xq, xs = quantize_per_token_group(x, 128)
    rq, rs = quantize_per_token_group_ref(x, 128)
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(xs, rs)
    got = w8a8_block_linear(x, q, s, (128, 128), b)
    ref = w8a8_block_linear_ref(x, q, s, (128, 128), b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert _rel(got, ref) < 2 ** -8
    full = torch.nn.functional.linear(x, w.bfloat16(), b)
    assert _rel(got, full) < 0.06


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [64, 300])
@pytest.mark.parametrize("cfg", W8A8_CANDIDATES, ids=lambda c: c.name)
def test_w8a8_candidate_tiles_gpu(cfg, m):
    """Every tile --sweep times, on the e4m3 tensor cores (cp.async or TMA; at 64 rows K
    split, at 300 a partial row tile): the emulation's product to bf16 rounding."""
    from flashpage.kernels.device import cuda_capability

    if cuda_capability(torch.device("cuda")) < (8, 9):
        pytest.skip("e4m3 tensor cores need sm_89+")
    _, q, s, b, g = _weights(1536, 1024, (128, 128), m, bias=True, dtype=torch.bfloat16)
    x = torch.randn(m, 1024, device="cuda", generator=g).bfloat16()
    got = w8a8_block_linear(x, q, s, (128, 128), b, config=cfg)
    assert _rel(got, w8a8_block_linear_ref(x, q, s, (128, 128), b)) < 2 ** -8


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_fp8_block_linear_paths_on_the_gpu():
    """layers/quant.fp8_block_linear: weight-only up to BLOCK_W8A16_ROWS rows, W8A8 above
    (sm_89+), weight-only for fp32 activations; each the kernel it names, to the bit, and
    capturable in a CUDA graph."""
    from flashpage.kernels.device import cuda_capability
    from flashpage.layers.quant import BLOCK_W8A16_ROWS, fp8_block_linear

    _, q, s, b, g = _weights(1024, 2048, (128, 128), 3, bias=True, dtype=torch.bfloat16)
    for m in (1, BLOCK_W8A16_ROWS, BLOCK_W8A16_ROWS + 1, 300):
        x = torch.randn(m, 2048, device="cuda", generator=g).bfloat16()
        w8a8 = m > BLOCK_W8A16_ROWS and cuda_capability(x.device) >= (8, 9)
        want = w8a8_block_linear(x, q, s, (128, 128), b) if w8a8 else \
            w8a16_block_matmul(x, q, s, (128, 128), b)
        assert torch.equal(fp8_block_linear(x, q, s, (128, 128), b), want), m
        out = torch.empty_like(want)
        graph = torch.cuda.CUDAGraph()
        fp8_block_linear(x, q, s, (128, 128), b)  # compiled before the capture
        with torch.cuda.graph(graph):
            out.copy_(fp8_block_linear(x, q, s, (128, 128), b))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), m
    x32 = torch.randn(40, 2048, device="cuda", generator=g)
    assert torch.equal(fp8_block_linear(x32, q, s, (128, 128), b.float()),
                       w8a16_block_matmul(x32, q, s, (128, 128), b.float()))


# ----------------------------------------------------------------------------- sm_90 PTX
def _compile_block_kernels() -> dict[str, str]:
    """The block kernels compiled for sm_90 (no GPU needed): name -> PTX."""
    from sm90 import compile_sm90

    from flashpage.kernels import fp8_block_gemm as m

    out = {}
    k = compile_sm90(m._w8a8_block_kernel, dict(
        BN=128, BK=128, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1,
        HAS_BIAS=True, EVEN_K=True, TMA=False, a_desc=None, w_desc=None), {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                       "ws_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16"},
        num_warps=8, num_stages=3, aligned=("a_ptr", "w_ptr", "stride_am", "stride_wn"))
    out["w8a8"] = k.asm["ptx"]
    k = compile_sm90(m._w8a16_block_kernel, dict(
        BN=128, BK=128, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, HAS_BIAS=False,
        EVEN_K=True, PRECISION="tf32"), {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                                         "b_ptr": "*bf16", "out_ptr": "*fp32"},
        num_warps=4, num_stages=4)
    out["w8a16"] = k.asm["ptx"]
    k = compile_sm90(m._quant_groups_kernel, dict(G=128, BLOCK_G=128, GROUPS=32, FP8_MAX=448.0,
                                                  MIN_SCALE=1e-12),
                     {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                     num_warps=4, num_stages=1)
    out["quant"] = k.asm["ptx"]
    return out


def test_block_kernels_compile_for_sm90():
    """On the CPU: the W8A8 kernel's dots are Hopper's e4m3 warpgroup MMAs (wgmma ...
    e4m3.e4m3), the weight-only kernel widens e4m3 with the hardware conversion and runs
    bf16 MMAs, and the quantizer stores through cvt.rn.satfinite (torch's rounding)."""
    from sm90 import run_compiled

    ptx = run_compiled("test_fp8_block_gemm", "_compile_block_kernels")
    assert "wgmma" in ptx["w8a8"] and "e4m3.e4m3" in ptx["w8a8"]
    assert "e4m3x2" in ptx["w8a16"] and ("mma" in ptx["w8a16"])
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx["quant"]


def _compile_w8a8_tiles() -> dict[str, dict]:
    """Each W8A8 candidate tile (unsplit, bf16 out) and the small default split in 4 (fp32
    out) built for sm_90a, as a GPU launch specializes them: cfg name -> registers, spills,
    shared memory and the opcode counts of the main loop (the one holding the MMAs)."""
    import collections
    import dataclasses

    from sm90 import compile_sm90, ptxas_sm90a, ptxas_usage, sass_instructions, sass_loops

    from flashpage.kernels import fp8_block_gemm as m

    out = {}
    for cfg in m.W8A8_CANDIDATES + (dataclasses.replace(m.W8A8_SMALL, split_k=4),):
        split = cfg.split_k or 1
        descs = {} if cfg.tma else dict(a_desc=None, w_desc=None)  # None: the pointer path
        k = compile_sm90(m._w8a8_block_kernel, dict(
            BN=128, BK=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=128,
            GROUP_M=cfg.group_m, SPLIT_K=split, HAS_BIAS=False, EVEN_K=True, TMA=cfg.tma,
            **descs),
            {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
             "b_ptr": "*bf16", "out_ptr": "*bf16" if split == 1 else "*fp32",
             "a_desc": f"tensordesc<fp8e4nv[{cfg.block_m}, 128]>",
             "w_desc": f"tensordesc<fp8e4nv[{cfg.block_n}, 128]>"},
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            aligned=("a_ptr", "w_ptr", "stride_am", "stride_wn", "stride_om"))
        log, sass = ptxas_sm90a(k.asm["ptx"])
        ins, labels = sass_instructions(sass)
        bodies = [[t.split(" ")[0] for t in ins[lo:hi + 1]] for lo, hi in sass_loops(ins, labels)]
        # the main loop: the shortest backward branch around MMAs (a TMA kernel's mbarrier
        # retry stubs, placed after the exit, branch back over the epilogue too)
        body = min((b for b in bodies if any(o.startswith("QGMMA") for o in b)), key=len,
                   default=[])
        out[cfg.name] = {**ptxas_usage(log), "shared": k.metadata.shared,
                         "main": dict(collections.Counter(body))}
    return out


def test_w8a8_tiles_compile_to_pipelined_wgmma_for_sm90():
    """On the CPU, every candidate tile (the defaults among them) and the split form: a
    main loop of Hopper e4m3 warpgroup MMAs (QGMMA ... E4M3.E4M3, 4 a 128-deep K tile per
    warpgroup) fed by cp.async (LDGSTS: the whole tile in 16-byte copies) or TMA (two
    UTMALDG, one box an operand) into a ring of num_stages tiles of shared memory, no
    plain load of the operands in it, no spills; and the two block scales folded into
    one factor per row where a tile's columns share a weight block row: one FFMA per
    accumulator element per K tile, no FMUL over it (two, FMUL + FFMA, where they do not)."""
    from sm90 import run_compiled

    from flashpage.kernels.fp8_block_gemm import W8A8_LARGE, W8A8_SMALL

    got = run_compiled("test_fp8_block_gemm", "_compile_w8a8_tiles")
    assert {W8A8_SMALL.name, W8A8_LARGE.name} <= set(got)
    for name, r in got.items():
        cfg = parse_config(name)
        main = r["main"]
        assert r["spill_bytes"] == 0 and main, (name, r)
        mmas = {o: n for o, n in main.items() if o.startswith("QGMMA")}
        assert mmas and all(o.endswith(".F32.E4M3.E4M3") for o in mmas), (name, main)
        assert sum(mmas.values()) == 128 // 32, (name, main)  # each warpgroup's K steps
        copies = sum(n for o, n in main.items() if o.startswith("LDGSTS"))
        tma = sum(n for o, n in main.items() if o.startswith("UTMALDG"))
        stage = (cfg.block_m + cfg.block_n) * 128  # e4m3 bytes of one K tile of A and W
        if cfg.tma:
            assert tma == 2 and copies == 0, (name, main)
        else:  # 16-byte copies
            assert tma == 0 and copies * 16 * 32 * cfg.num_warps == stage, (name, main)
        assert r["shared"] >= cfg.num_stages * stage, (name, r["shared"])
        assert main.get("LDG.E", 0) + main.get("LDG.E.CONSTANT", 0) <= 4, (name, main)  # scales
        per_thread = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)
        if cfg.block_n <= 128:  # 128 x 128 blocks: one weight scale a tile
            assert main["FFMA"] == per_thread and main.get("FMUL", 0) <= 4, (name, main)
        else:
            assert main["FFMA"] == per_thread and main["FMUL"] == per_thread, (name, main)


# ----------------------------------------------------------------------------- in the engine
@CPU_ONLY
@pytest.mark.parametrize("path", ["w8a16", "w8a8"])
def test_engine_over_the_block_kernels_cpu(tiny_checkpoint, tmp_path, monkeypatch, path):
    """The engine on a block-scaled checkpoint (32 x 48 blocks: partial tiles, merged
    qkv / gate_up) with its linears routed through the CUDA paths' kernels under the
    interpreter (fp32) gives the greedy tokens and log-probabilities (to fp32's summation
    order) of the same engine over the path's reference: for weight-only, the dequantized
    checkpoint itself; for W8A8, its fp32 emulation (activations rounded to e4m3 per group
    move this tiny model's small logit margins: its tokens part from the dequantized
    checkpoint's within a few steps, the kernel's and the emulation's do not)."""
    from flashpage import LLM, SamplingParams
    from flashpage.kernels import fp8_block_gemm
    from flashpage.kernels.fp8_block_ref import w8a8_block_linear_ref
    from flashpage.layers import quant
    from tests.conftest import random_prompts
    from tests.models.test_fp8_checkpoints import build_fp8_checkpoint

    fp8, ref = tmp_path / "fp8", tmp_path / "ref"
    build_fp8_checkpoint(tiny_checkpoint("llama31_gqa"), fp8, ref, "fp8_block")
    prompts = random_prompts(3, 3, 12, seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)

    def generate(folder):
        outs = LLM(str(folder), device="cpu", dtype="float32").generate(prompts, params,
                                                                        use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [lp.top[0][1] for o in outs for lp in o.outputs[0].logprobs])

    kernel = "w8a16_block_matmul" if path == "w8a16" else "w8a8_block_linear"
    monkeypatch.setattr(quant, "block_fp8_path", lambda x, block: path)
    if path == "w8a16":
        want = generate(ref)
    else:  # the same engine over the emulation, for the kernel's call
        with monkeypatch.context() as mp:
            mp.setattr(fp8_block_gemm, kernel, lambda x, q, s, block, bias=None:
                       w8a8_block_linear_ref(x, q, s, block, bias))
            want = generate(fp8)
    calls = []
    real = getattr(fp8_block_gemm, kernel)
    monkeypatch.setattr(fp8_block_gemm, kernel, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = generate(fp8)
    assert len(calls) >= 8 * 6  # 8 block linears, every step
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=0)
