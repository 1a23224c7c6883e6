"""Pure-torch references of kernels/fp8_block_gemm.py (the layout is described there),
importable without Triton: the CPU path of a block-scaled linear (layers/quant.py) and the
fp8 checkpoint loader use them as well as the tests.

``dequantize_fp8_block`` is what the layout means (``quantize_fp8_block`` makes one as
the checkpoints are made); ``quantize_per_token_group_ref`` the
activation quantizer's bits; ``w8a8_block_linear_ref`` the W8A8 product emulated in fp32
(the same e4m3 operands and scales, one fp32 sum per K group times both its scales);
``w8a16_block_linear_ref`` the weight-only one; ``dequantize_experts_fp8`` all of a
layer's block-fp8 routed experts at once (kernels/fused_moe_fp8.py's layout).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
MIN_SCALE = 1e-12
MAX_TILE_K = 128
# block-fp8 routed experts (kernels/fused_moe_fp8.py): 128 x 128 blocks only
EXPERT_BLOCK = 128


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q e4m3 [N, K] times its tile's scale, scale [ceil(N/bn), ceil(K/bk)], in fp32
    (edge tiles partial), then ``dtype``."""
    n, k = q.shape
    bn, bk = block
    check_block_scales(q, scale, block)
    s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.float() * s).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], fp32 [ceil(N/bn), ceil(K/bk)]) as DeepSeek-V3's checkpoints
    are made: each tile's scale its amax / 448 (edge tiles partial), each value divided by
    its tile's scale and rounded to nearest even (benchmarks' and tests' weights)."""
    (n, k), (bn, bk) = w.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    s = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_per_token_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 [M, ceil(K/group)]): each row's groups of ``group``
    columns (the last one partial) by their own amax, as kernels/fp8_quant quantizes whole
    rows: scale = max(amax / 448, 1e-12), q = e4m3(clamp(x / scale, +-448)), IEEE
    division."""
    m, k = x.shape
    groups = -(-k // group)
    x32 = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    x32[:, :k] = x.float()
    g = x32.view(m, groups, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * group)[:, :k].contiguous(), scale.squeeze(-1)


def w8a8_block_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int], bias: torch.Tensor | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What ``w8a8_block_matmul`` computes, in fp32 on any device: x [M, K] quantized per
    token per BK-group, each group's e4m3 products summed, times both its scales, summed
    over the groups (+ bias); in ``out_dtype`` (default x's)."""
    check_block_scales(q, scale, block)
    bn, bk = block
    n, k = q.shape
    xq, xs = quantize_per_token_group_ref(x, bk)
    ws = scale.float().repeat_interleave(bn, 0)[:n]  # [N, K groups]
    y = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    for g in range(xs.shape[1]):
        cols = slice(g * bk, min(k, (g + 1) * bk))
        y += (xq[:, cols].float() @ q[:, cols].float().t()) * xs[:, g:g + 1] * ws[None, :, g]
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype or x.dtype)


def w8a16_block_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                           block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only: x [M, K] @ the dequantized weight (fp32 products and sums, + bias), in
    x's dtype."""
    y = x.float() @ dequantize_fp8_block(q, scale, block).t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def tile_k(bk: int) -> int:
    """The K tile for blocks BK columns wide: the largest power of two dividing BK, up to
    MAX_TILE_K (0 where it is under 16, ``tl.dot``'s smallest: no kernel takes it)."""
    t = 1
    while t < MAX_TILE_K and bk % (2 * t) == 0:
        t *= 2
    return t if t >= 16 else 0


def check_block_scales(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """ValueError unless q is e4m3 [N, K] and scale fp32 [ceil(N/bn), ceil(K/bk)]."""
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [N, K], got {q.dtype} {tuple(q.shape)}")
    bn, bk = block
    if bn <= 0 or bk <= 0:
        raise ValueError(f"block must be two positive integers, got {block}")
    n, k = q.shape
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"block scales must be fp32 {list(want)} for a [{n}, {k}] weight in "
                         f"{bn}x{bk} blocks, got {scale.dtype} {tuple(scale.shape)}")


def dequantize_experts_fp8(q: torch.Tensor, scale: torch.Tensor,
                           dtype: torch.dtype) -> torch.Tensor:
    """Block-fp8 experts q e4m3 [E, N, K] with scale fp32 [E, N / 128, K / 128] -> [E, N, K]
    in ``dtype``: each value times its block's scale in fp32, rounded once (what
    ``dequantize_fp8_block`` gives expert by expert, and what the dequantize-at-load path
    holds): the torch paths of kept fp8 experts (layers/moe.FusedExperts.hold_fp8)."""
    e, n, k = q.shape
    b = EXPERT_BLOCK
    if n % b or k % b or tuple(scale.shape) != (e, n // b, k // b):
        raise ValueError(f"experts {tuple(q.shape)} need scales [E, N / {b}, K / {b}] = "
                         f"{[e, n // b, k // b]}, got {tuple(scale.shape)}")
    w = q.float().view(e, n // b, b, k // b, b) * scale.float()[:, :, None, :, None]
    return w.view(e, n, k).to(dtype)
