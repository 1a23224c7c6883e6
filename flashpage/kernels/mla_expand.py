"""MLA's prompt path, the latents' expansion: two copy kernels around ``kv_b_proj``.

The expanded (prompt) path attends over per-head K and V made from each request's whole
context of cached latents (layers/mla_attention.py)::

    kv_cache [num_blocks, block_size, R + rope]   entry = [c_kv (R) | k_pe (rope)]
    ctx      [Nk, R + rope]     the entries of every prompt request's context, back to back
                                (request i's at rows cu_k[i] .. cu_k[i] + seq_lens[i])
    kv       [Nk, H * (nope + v_dim)] = ctx[:, :R] @ kv_b_proj.weight.T   (torch matmul)
    k        [Nk, H, nope + rope]     = [kv[:, h, :nope] | ctx[:, R:]]   (k_pe every head's)
    v        [Nk, H, v_dim]           =  kv[:, h, nope:]
    q        [Nq, H, nope + rope]     = [q_nope | q_pe]

As torch ops that is, per layer, an index_select (and an int64 cast of the block table)
per request, a concatenation of the requests, the matmul, a concatenation for K, a copy
for V and a concatenation for q. Here it is one gather kernel (``gather_latents``: every
request's entries through the block tables into ``ctx``, an fp8 cache's widened to the
model's dtype, exactly), the same matmul, and one copy kernel (``expand_kv``: K, V and q
written from ``kv``, ``ctx``'s rope part and q's two parts). Both only move values, so
the result is bit for bit the torch path's (``mla_expand_ref``).

``MLAExpandPlan``: the checks, grids and strides once a step (the step's block tables and
lengths are every layer's); later layers launch both kernels past Triton's dispatch
(kernels/fast_launch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.fast_launch import FastLauncher
from flashpage.kernels.kv_dtype import is_fp8


@triton.jit(do_not_specialize=["stride_btb"])
def _gather_latents_kernel(
    kv_ptr, block_tables_ptr, seq_lens_ptr, cu_k_ptr, out_ptr,
    stride_kvb, stride_kvt, stride_btb, stride_o,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_T: tl.constexpr, PAGE: tl.constexpr,
):
    """Program (i, t): positions t*BLOCK_T .. of request i -> rows cu_k[i] + pos of out."""
    i = tl.program_id(0)
    n = tl.load(seq_lens_ptr + i)
    base = tl.load(cu_k_ptr + i).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = pos < n
    blk = tl.load(block_tables_ptr + i.to(tl.int64) * stride_btb + pos // PAGE, mask=t_mask, other=0)
    src = kv_ptr + blk.to(tl.int64) * stride_kvb + (pos % PAGE).to(tl.int64) * stride_kvt
    dst = out_ptr + (base + pos)[:, None] * stride_o
    offs_r = tl.arange(0, BLOCK_R)
    m = t_mask[:, None] & (offs_r < RANK)[None, :]
    c = tl.load(src[:, None] + offs_r[None, :], mask=m)
    tl.store(dst + offs_r[None, :], c.to(out_ptr.dtype.element_ty), mask=m)
    offs_p = tl.arange(0, BLOCK_P)
    m = t_mask[:, None] & (offs_p < ROPE)[None, :]
    p = tl.load(src[:, None] + RANK + offs_p[None, :], mask=m)
    tl.store(dst + RANK + offs_p[None, :], p.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _cat_heads(a_row, stride_ah, b_row, stride_bh, out_row, stride_oh, offs_h, h_mask,
               A: tl.constexpr, B: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[h] = [a[h] (A values) | b[h] (B values)] for the heads ``offs_h`` of one row
    (``stride_bh`` 0: one b for every head)."""
    offs_a = tl.arange(0, BLOCK_A)
    m = h_mask[:, None] & (offs_a < A)[None, :]
    x = tl.load(a_row + offs_h[:, None] * stride_ah + offs_a[None, :], mask=m)
    tl.store(out_row + offs_h[:, None] * stride_oh + offs_a[None, :], x, mask=m)
    offs_b = tl.arange(0, BLOCK_B)
    m = h_mask[:, None] & (offs_b < B)[None, :]
    y = tl.load(b_row + offs_h[:, None] * stride_bh + offs_b[None, :], mask=m)
    tl.store(out_row + offs_h[:, None] * stride_oh + A + offs_b[None, :], y, mask=m)


@triton.jit(do_not_specialize=["num_k"])
def _expand_kernel(
    kv_ptr, ctx_ptr, qn_ptr, qp_ptr, k_ptr, v_ptr, q_ptr,
    num_k, num_heads,
    stride_kvn, stride_ctx, stride_qnn, stride_qnh, stride_qpn, stride_qph,
    stride_kn, stride_vn, stride_qn,
    RANK: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr, VD: tl.constexpr,
    BLOCK_NOPE: tl.constexpr, BLOCK_ROPE: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program (r, head block): rows r < num_k write K and V row r (kv [.., H, nope + v_dim],
    rows of ``stride_kvn``; the rope part from ctx's row), the rest write q row r - num_k.
    K, V and q rows are contiguous [H, dim]."""
    r = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    if r < num_k:
        r64 = r.to(tl.int64)
        kv_row = kv_ptr + r64 * stride_kvn
        _cat_heads(kv_row, NOPE + VD, ctx_ptr + r64 * stride_ctx + RANK, 0, k_ptr + r64 * stride_kn,
                   NOPE + ROPE, offs_h, h_mask, NOPE, ROPE, BLOCK_NOPE, BLOCK_ROPE)
        offs_v = tl.arange(0, BLOCK_V)
        m = h_mask[:, None] & (offs_v < VD)[None, :]
        x = tl.load(kv_row + offs_h[:, None] * (NOPE + VD) + NOPE + offs_v[None, :], mask=m)
        tl.store(v_ptr + r64 * stride_vn + offs_h[:, None] * VD + offs_v[None, :], x, mask=m)
    else:
        i = (r - num_k).to(tl.int64)
        _cat_heads(qn_ptr + i * stride_qnn, stride_qnh, qp_ptr + i * stride_qpn, stride_qph,
                   q_ptr + i * stride_qn, NOPE + ROPE, offs_h, h_mask, NOPE, ROPE, BLOCK_NOPE,
                   BLOCK_ROPE)


_GATHER_LAUNCH = FastLauncher(_gather_latents_kernel)
_EXPAND_LAUNCH = FastLauncher(_expand_kernel)

GATHER_BLOCK_T = 16  # cache entries a gather program copies
EXPAND_BLOCK_H = 16  # heads an expand program copies


def _geometry(kv_cache: torch.Tensor, w: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor) -> tuple:
    return (kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device, w.shape, w.dtype,
            q_nope.shape, q_nope.stride(), q_nope.dtype, q_pe.shape, q_pe.stride(), q_pe.dtype)


class MLAExpandPlan:
    """The latents' expansion planned for the layers of a step.

    kv_cache     : [num_blocks, block_size, R + rope] in q's dtype or float8_e4m3fn
    block_tables : int32 [P, max_blocks], seq_lens int32 [P] (>= 1), cu_k int32 [P + 1]
                   (cu_k[i] = seq_lens[:i].sum()): the step's prompt requests
    total_k      : cu_k[P] (known on the host), max_k >= every seq_lens[i]
    kv_b_proj_weight : [H * (nope + v_dim), R] in q's dtype
    q_nope [Nq, H, nope], q_pe [Nq, H, rope]: any strides with a contiguous last dim

    ``run(kv_cache, kv_b_proj_weight, q_nope, q_pe)`` -> (q [Nq, H, nope + rope],
    k [total_k, H, nope + rope], v [total_k, H, v_dim]), contiguous, for tensors of the
    planned geometry (``fits``): each layer's own cache, weight and queries.
    """

    def __init__(self, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 cu_k: torch.Tensor, total_k: int, max_k: int, kv_b_proj_weight: torch.Tensor,
                 q_nope: torch.Tensor, q_pe: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int,
                 v_head_dim: int) -> None:
        if kv_cache.dim() != 3 or q_nope.dim() != 3 or q_pe.dim() != 3:
            raise ValueError(f"kv_cache, q_nope and q_pe must be 3-d, got {tuple(kv_cache.shape)}, "
                             f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
        h, nope, vd = num_heads, qk_nope_head_dim, v_head_dim
        nq, rope = q_pe.shape[0], q_pe.shape[-1]
        rank = kv_cache.shape[-1] - rope
        dtype = q_nope.dtype
        if q_nope.shape != (nq, h, nope) or q_pe.shape != (nq, h, rope) or q_pe.dtype != dtype:
            raise ValueError(f"q_nope must be [Nq, {h}, {nope}] and q_pe [Nq, {h}, rope] of one "
                             f"dtype, got {tuple(q_nope.shape)} {q_nope.dtype} and "
                             f"{tuple(q_pe.shape)} {q_pe.dtype}")
        if rank <= 0 or kv_b_proj_weight.shape != (h * (nope + vd), rank):
            raise ValueError(f"kv_b_proj weight must be [{h} * ({nope} + {vd}), R] with R + rope "
                             f"= kv_cache's last dim ({kv_cache.shape[-1]}), got "
                             f"{tuple(kv_b_proj_weight.shape)} and rope {rope}")
        if kv_b_proj_weight.dtype != dtype:
            raise ValueError(f"kv_b_proj weight dtype {kv_b_proj_weight.dtype} is not q's ({dtype})")
        if kv_cache.dtype != dtype and not is_fp8(kv_cache.dtype):
            raise ValueError(f"kv_cache dtype {kv_cache.dtype} must be q's ({dtype}) or float8_e4m3fn")
        page = kv_cache.shape[1]
        if page & (page - 1):
            raise ValueError(f"block_size must be a power of two, got {page}")
        p = seq_lens.shape[0]
        if (block_tables.dtype, seq_lens.dtype, cu_k.dtype) != (torch.int32,) * 3:
            raise ValueError("block_tables, seq_lens and cu_k must be int32")
        if block_tables.dim() != 2 or block_tables.shape[0] != p or cu_k.shape != (p + 1,):
            raise ValueError(f"block_tables must be [P={p}, max_blocks] and cu_k [P + 1], got "
                             f"{tuple(block_tables.shape)} and {tuple(cu_k.shape)}")
        if (kv_cache.stride(-1), q_nope.stride(-1), q_pe.stride(-1), block_tables.stride(-1)) != (1,) * 4:
            raise ValueError("kv_cache, q_nope, q_pe and block_tables need a contiguous last dim")
        self.shapes = (h, nope, rope, vd, rank, nq, total_k)
        self.geometry = _geometry(kv_cache, kv_b_proj_weight, q_nope, q_pe)
        self._tables = (block_tables, seq_lens, cu_k)
        self._gather_grid = (p, max(1, triton.cdiv(max_k, GATHER_BLOCK_T)))
        self._gather_consts = dict(RANK=rank, ROPE=rope, BLOCK_R=triton.next_power_of_2(rank),
                                   BLOCK_P=triton.next_power_of_2(rope), BLOCK_T=GATHER_BLOCK_T,
                                   PAGE=page)
        block_h = min(EXPAND_BLOCK_H, triton.next_power_of_2(h))
        self._expand_grid = (total_k + nq, triton.cdiv(h, block_h))
        self._expand_consts = dict(RANK=rank, NOPE=nope, ROPE=rope, VD=vd,
                                   BLOCK_NOPE=triton.next_power_of_2(nope),
                                   BLOCK_ROPE=triton.next_power_of_2(rope),
                                   BLOCK_V=triton.next_power_of_2(vd), BLOCK_H=block_h)
        self._options = dict(num_warps=4)
        self._bound: dict[str, object] = {}

    def fits(self, kv_cache: torch.Tensor, kv_b_proj_weight: torch.Tensor, q_nope: torch.Tensor,
             q_pe: torch.Tensor) -> bool:
        """Whether ``run`` takes these tensors (else plan again)."""
        return _geometry(kv_cache, kv_b_proj_weight, q_nope, q_pe) == self.geometry

    def _launch(self, name: str, launcher: FastLauncher, grid: tuple[int, ...], args: tuple,
                consts: dict, varying: tuple[int, ...]) -> None:
        bound = self._bound.get(name)
        if bound is None:  # the first layer's call: launched through the JIT, then bound
            self._bound[name] = launcher.bind(grid, args, consts, self._options, varying=varying)
        else:
            bound(args)  # type: ignore[operator]

    def run(self, kv_cache: torch.Tensor, kv_b_proj_weight: torch.Tensor, q_nope: torch.Tensor,
            q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.fits(kv_cache, kv_b_proj_weight, q_nope, q_pe):
            raise ValueError("MLAExpandPlan.run: the cache, weight or queries differ in shape, "
                             "strides, dtype or device from the planned call")
        h, nope, rope, vd, rank, nq, total_k = self.shapes
        dtype, dev = q_nope.dtype, q_nope.device
        ctx = torch.empty(total_k, rank + rope, dtype=dtype, device=dev)
        block_tables, seq_lens, cu_k = self._tables
        if total_k:
            self._launch("gather", _GATHER_LAUNCH, self._gather_grid,
                         (kv_cache, block_tables, seq_lens, cu_k, ctx, kv_cache.stride(0),
                          kv_cache.stride(1), block_tables.stride(0), ctx.stride(0)),
                         self._gather_consts, (0, 4))
        kv = ctx[:, :rank] @ kv_b_proj_weight.t()  # as layers/mla.mla_expand_kv computes it
        k = torch.empty(total_k, h, nope + rope, dtype=dtype, device=dev)
        v = torch.empty(total_k, h, vd, dtype=dtype, device=dev)
        q = torch.empty(nq, h, nope + rope, dtype=dtype, device=dev)
        if total_k + nq:
            self._launch("expand", _EXPAND_LAUNCH, self._expand_grid,
                         (kv, ctx, q_nope, q_pe, k, v, q, total_k, h, kv.stride(0), ctx.stride(0),
                          q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
                          k.stride(0), v.stride(0), q.stride(0)),
                         self._expand_consts, (0, 1, 2, 3, 4, 5, 6))
        return q, k, v


def mla_expand(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               kv_b_proj_weight: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, *,
               num_heads: int, qk_nope_head_dim: int, v_head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One unplanned call (tests, benchmarks): ``MLAExpandPlan``'s contract, cu_k, total_k
    and max_k from ``seq_lens`` (read on the host)."""
    lens = [int(x) for x in seq_lens.tolist()]
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(seq_lens, 0, out=cu_k[1:])
    plan = MLAExpandPlan(kv_cache, block_tables, seq_lens, cu_k, sum(lens), max(lens, default=0),
                         kv_b_proj_weight, q_nope, q_pe, num_heads=num_heads,
                         qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim)
    return plan.run(kv_cache, kv_b_proj_weight, q_nope, q_pe)


def mla_expand_ref(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   kv_b_proj_weight: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor, *,
                   num_heads: int, qk_nope_head_dim: int, v_head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch reference (the layer's torch path): gather each request's entries
    (index_select through its block table), concatenate, widen to q's dtype, expand as
    layers/mla.mla_expand_kv does, concatenate q. Same contract as :func:`mla_expand`."""
    page = kv_cache.shape[1]
    src = kv_cache.view(torch.uint8) if is_fp8(kv_cache.dtype) else kv_cache
    parts = []
    for i, n in enumerate(int(x) for x in seq_lens.tolist()):
        rows = src.index_select(0, block_tables[i, :(n + page - 1) // page].long()).flatten(0, 1)[:n]
        parts.append(rows.view(kv_cache.dtype).to(q_nope.dtype))
    ctx = parts[0] if len(parts) == 1 else torch.cat(parts)
    rank = kv_cache.shape[-1] - q_pe.shape[-1]
    n, rope = ctx.shape[0], q_pe.shape[-1]
    kv = (ctx[:, :rank] @ kv_b_proj_weight.t()).view(n, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    k = torch.cat([k_nope, ctx[:, None, rank:].expand(n, num_heads, rope)], dim=-1)
    return torch.cat([q_nope, q_pe], dim=-1), k, v.contiguous()


__all__ = ["MLAExpandPlan", "mla_expand", "mla_expand_ref"]
