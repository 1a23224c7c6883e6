"""MLA's absorbed decode projections for a few tokens (DeepSeek-V2/V3), one kernel each.

Decode attends over the latent cache with W_UK folded into the query and W_UV applied to
the latent output (layers/mla.py). Both are per-head products with the rows of
kv_b_proj's weight, viewed [H, nope + v_dim, R]::

    query:  q_abs[n, h] = [ q_nope[n, h] @ W_UK[h]  |  q_pe[n, h] ]     W_UK[h]: [nope, R]
    output: o[n, h]     =   o_lat[n, h] @ W_UV[h]^T                      W_UV[h]: [v_dim, R]

As ``torch.bmm`` over heads with one to a few rows each, cuBLAS read these 2 x 2 MB per
layer of DeepSeek-V2-Lite at a few percent of the copy rate (467 us of a 4.4 ms one-token
step on an H200). Here each program owns a slice of one head's weight, requests it before
the PDL wait (weights are never written), and multiplies the (padded) rows of all the
step's tokens with it: the query kernel also writes q_pe beside the product, so the
concatenated q_abs needs no copy of its own.

For up to ``MAX_TOKENS`` tokens (more: cuBLAS's batched GEMM is efficient again).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl

MAX_TOKENS = 16  # rows of one tl.dot tile
BLOCK_R = 64  # latent dims per program (query)
BLOCK_V = 16  # value dims per program (output)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _absorb_query_kernel(
    q_nope_ptr, q_pe_ptr, w_ptr, out_ptr, n_tokens,
    stride_qn, stride_qh, stride_pn, stride_ph, stride_w, stride_on, stride_oh,
    NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
    RANK: tl.constexpr, HEAD_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):
    h = tl.program_id(0)
    rb = tl.program_id(1)
    offs_k = tl.arange(0, NOPE_PAD)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    k_mask = offs_k < NOPE
    r_mask = offs_r < RANK
    rows = h.to(tl.int64) * HEAD_ROWS + offs_k
    w = tl.load(w_ptr + rows[:, None] * stride_w + offs_r[None, :], mask=k_mask[:, None] & r_mask[None, :],
                other=0.0)
    pdl_prologue(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_tokens
    q = tl.load(q_nope_ptr + offs_m[:, None] * stride_qn + h * stride_qh + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    acc = _dot(q, w, IEEE)
    out_row = out_ptr + offs_m[:, None] * stride_on + h * stride_oh
    tl.store(out_row + offs_r[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & r_mask[None, :])
    if rb == 0:  # q_pe beside the product: [q_nope W_UK | q_pe]
        offs_p = tl.arange(0, ROPE_PAD)
        p_mask = m_mask[:, None] & (offs_p < ROPE)[None, :]
        pe = tl.load(q_pe_ptr + offs_m[:, None] * stride_pn + h * stride_ph + offs_p[None, :], mask=p_mask,
                     other=0.0)
        tl.store(out_row + RANK + offs_p[None, :], pe, mask=p_mask)


@triton.jit
def _absorb_output_kernel(
    o_ptr, w_ptr, out_ptr, n_tokens, stride_on, stride_oh, stride_w, stride_yn, stride_yh,
    NOPE: tl.constexpr, V_DIM: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
    HEAD_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    h = tl.program_id(0)
    vb = tl.program_id(1)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, RANK_PAD)
    v_mask = offs_v < V_DIM
    r_mask = offs_r < RANK
    rows = h.to(tl.int64) * HEAD_ROWS + NOPE + offs_v
    w = tl.load(w_ptr + rows[:, None] * stride_w + offs_r[None, :], mask=v_mask[:, None] & r_mask[None, :],
                other=0.0)
    pdl_prologue(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_tokens
    o = tl.load(o_ptr + offs_m[:, None] * stride_on + h * stride_oh + offs_r[None, :],
                mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    acc = _dot(o, tl.trans(w), IEEE)
    tl.store(out_ptr + offs_m[:, None] * stride_yn + h * stride_yh + offs_v[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & v_mask[None, :])


def _check(x: torch.Tensor, w: torch.Tensor, num_heads: int, nope: int, v_dim: int, name: str) -> None:
    if x.dim() != 3 or x.shape[1] != num_heads or x.shape[0] > MAX_TOKENS:
        raise ValueError(f"{name} must be [N <= {MAX_TOKENS}, {num_heads}, dim], got {tuple(x.shape)}")
    if w.dim() != 2 or w.shape[0] != num_heads * (nope + v_dim) or w.stride(1) != 1:
        raise ValueError(f"kv_b_proj weight must be [{num_heads} x ({nope} + {v_dim}), R] with a "
                         f"contiguous last dim, got {tuple(w.shape)}")
    if x.stride(-1) != 1 or x.dtype != w.dtype:
        raise ValueError(f"{name} must be {w.dtype} with a contiguous last dim, got {x.dtype}")


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_proj_weight: torch.Tensor,
                 num_heads: int, qk_nope_head_dim: int, v_head_dim: int, *,
                 pdl: bool | None = None) -> torch.Tensor:
    """q_nope [N, H, nope], q_pe [N, H, rope] -> q_abs [N, H, R + rope] (layers/mla.py's
    mla_absorb_query), N <= MAX_TOKENS."""
    w = kv_b_proj_weight
    _check(q_nope, w, num_heads, qk_nope_head_dim, v_head_dim, "q_nope")
    _check(q_pe, w, num_heads, qk_nope_head_dim, v_head_dim, "q_pe")
    n, _, rope = q_pe.shape
    rank = w.shape[1]
    out = torch.empty(n, num_heads, rank + rope, dtype=q_nope.dtype, device=q_nope.device)
    if n == 0:
        return out
    use_pdl = resolve_pdl(pdl, q_nope.device)
    _absorb_query_kernel[(num_heads, triton.cdiv(rank, BLOCK_R))](
        q_nope, q_pe, w, out, n, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        w.stride(0), out.stride(0), out.stride(1),
        NOPE=qk_nope_head_dim, NOPE_PAD=max(16, triton.next_power_of_2(qk_nope_head_dim)), ROPE=rope,
        ROPE_PAD=triton.next_power_of_2(rope), RANK=rank, HEAD_ROWS=qk_nope_head_dim + v_head_dim,
        BLOCK_M=MAX_TOKENS, BLOCK_R=BLOCK_R, IEEE=q_nope.dtype == torch.float32, PDL=use_pdl,
        num_warps=4, **pdl_launch_kwargs(use_pdl),
    )
    return out


def absorb_output(o_latent: torch.Tensor, kv_b_proj_weight: torch.Tensor, num_heads: int,
                  qk_nope_head_dim: int, v_head_dim: int, *, pdl: bool | None = None) -> torch.Tensor:
    """o_latent [N, H, R] -> [N, H, v_dim] (layers/mla.py's mla_absorb_output), N <= MAX_TOKENS."""
    w = kv_b_proj_weight
    _check(o_latent, w, num_heads, qk_nope_head_dim, v_head_dim, "o_latent")
    n, _, rank = o_latent.shape
    if rank != w.shape[1]:
        raise ValueError(f"o_latent has {rank} dims, the weight {w.shape[1]}")
    out = torch.empty(n, num_heads, v_head_dim, dtype=o_latent.dtype, device=o_latent.device)
    if n == 0:
        return out
    use_pdl = resolve_pdl(pdl, o_latent.device)
    _absorb_output_kernel[(num_heads, triton.cdiv(v_head_dim, BLOCK_V))](
        o_latent, w, out, n, o_latent.stride(0), o_latent.stride(1), w.stride(0), out.stride(0),
        out.stride(1), NOPE=qk_nope_head_dim, V_DIM=v_head_dim, RANK=rank,
        RANK_PAD=max(16, triton.next_power_of_2(rank)), HEAD_ROWS=qk_nope_head_dim + v_head_dim,
        BLOCK_M=MAX_TOKENS, BLOCK_V=BLOCK_V, IEEE=o_latent.dtype == torch.float32, PDL=use_pdl,
        num_warps=4, **pdl_launch_kwargs(use_pdl),
    )
    return out


__all__ = ["MAX_TOKENS", "absorb_output", "absorb_query"]
