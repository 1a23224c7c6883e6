"""MoE routing in one kernel: router logits -> (weights, expert ids) per token.

DeepSeek's gate after its logits GEMM is a handful of small torch ops per layer (softmax
or sigmoid, group scores, a group mask, top-k, a gather, a normalization, a scale): at a
one-token decode step each is a kernel launch and a round trip for a few hundred bytes.
Here one program per token does all of it in registers, as ``layers/moe.MoEGate`` does it
in torch (same arithmetic in fp32):

- ``greedy`` (V2, Mixtral, Qwen MoE): top-k of softmax(logits);
- ``group_limited_greedy`` (V2): groups ranked by their best softmax score, the scores of
  all but the ``topk_group`` best set to 0, then top-k;
- ``noaux_tc`` (V3): s = sigmoid(logits); groups ranked by the sum of their two best
  s + bias; outside the ``topk_group`` best, -inf; top-k of s + bias; weights = s of the
  chosen.

With ``norm_topk_prob`` the k weights are then divided by their sum (V3; Mixtral and Qwen's
``greedy``; layers/moe.MoEGate sets it only where transformers normalizes).

Then weights times ``scale`` (routed_scaling_factor). The experts come out best first;
among equal scores the lowest expert id wins (torch leaves the order of ties open).
Logits are [groups x experts per group] in the program, so groups of any size work
(V2's 160 experts in 8 groups of 20).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpage.kernels.pdl import pdl_launch_kwargs, pdl_prologue, resolve_pdl

METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    stride_l, per_group, num_groups, scale,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, PER_PAD: tl.constexpr,
    METHOD: tl.constexpr, NORM_TOPK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)[:, None]
    j = tl.arange(0, PER_PAD)[None, :]
    expert = g * per_group + j  # [GROUP_PAD, PER_PAD]
    valid = (g < num_groups) & (j < per_group)
    bias = tl.zeros([GROUP_PAD, PER_PAD], dtype=tl.float32)
    if METHOD == 2:
        bias = tl.load(bias_ptr + expert, mask=valid, other=0.0)  # a buffer: before the wait
    pdl_prologue(PDL)
    logit = tl.load(logits_ptr + row * stride_l + expert, mask=valid, other=float("-inf"))
    if METHOD == 2:
        scores = 1.0 / (1.0 + tl.exp(-logit))
        choice = tl.where(valid, scores + bias, float("-inf"))
    else:
        m = tl.max(tl.max(logit, axis=1), axis=0)
        p = tl.where(valid, tl.exp(logit - m), 0.0)
        scores = p / tl.sum(tl.sum(p, axis=1), axis=0)
        choice = tl.where(valid, scores, float("-inf"))
    if METHOD != 0:
        # Rank the groups: V3 by the sum of each group's two best, V2 by its best.
        best = tl.max(choice, axis=1)
        if METHOD == 2:
            first = tl.min(tl.where(choice == best[:, None], j, PER_PAD), axis=1)
            best = best + tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
        gid = tl.arange(0, GROUP_PAD)
        rank = tl.where(gid < num_groups, best, float("-inf"))
        keep = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(rank, axis=0)
            pick = tl.min(tl.where(rank == top, gid, GROUP_PAD), axis=0)
            keep = keep | (gid == pick)
            rank = tl.where(gid == pick, float("-inf"), rank)
        fill = float("-inf") if METHOD == 2 else 0.0
        choice = tl.where(keep[:, None] & valid, choice, tl.where(valid, fill, float("-inf")))
    flat = g * PER_PAD + j
    ks = tl.arange(0, K_PAD)
    out_w = tl.zeros([K_PAD], dtype=tl.float32)
    out_id = tl.zeros([K_PAD], dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, axis=1), axis=0)
        f = tl.min(tl.min(tl.where(choice == top, flat, GROUP_PAD * PER_PAD), axis=1), axis=0)
        hit = flat == f
        # V3 weighs by the sigmoid score (no bias); V2 by the (masked) softmax score.
        if METHOD == 2:
            w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        else:
            w = tl.sum(tl.sum(tl.where(hit, choice, 0.0), axis=1), axis=0)
        e = tl.sum(tl.sum(tl.where(hit, expert, 0), axis=1), axis=0)
        out_w = tl.where(ks == k, w, out_w)
        out_id = tl.where(ks == k, e.to(tl.int64), out_id)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM_TOPK:
        out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
    tl.store(weights_ptr + row * TOP_K + ks, out_w * scale, mask=ks < TOP_K)
    tl.store(ids_ptr + row * TOP_K + ks, out_id, mask=ks < TOP_K)


def moe_route(logits: torch.Tensor, top_k: int, method: str = "greedy", *, n_group: int = 1,
              topk_group: int = 1, norm_topk_prob: bool = False, scale: float = 1.0,
              bias: torch.Tensor | None = None, pdl: bool | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [N, E] -> (weights fp32 [N, top_k], ids int64 [N, top_k]), as
    ``MoEGate`` routes (see the module docstring); ``bias`` fp32 [E] for noaux_tc.
    ``norm_topk_prob``: the k weights divided by their sum, any method."""
    if method not in METHODS:
        raise ValueError(f"unknown routing method {method!r} (known: {', '.join(METHODS)})")
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous fp32 [N, E], got {logits.dtype} {tuple(logits.shape)}")
    n, e = logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"top_k ({top_k}) must be in 1..{e}")
    groups = n_group if method != "greedy" else 1
    topk_group = topk_group if method != "greedy" else 1
    if e % groups or not 0 < topk_group <= groups:
        raise ValueError(f"{e} experts do not split into {groups} groups keeping {topk_group}")
    if method == "noaux_tc":
        if bias is None or bias.shape != (e,) or bias.dtype != torch.float32:
            raise ValueError(f"noaux_tc needs an fp32 correction bias [{e}]")
    elif bias is not None:
        raise ValueError("a correction bias is for noaux_tc only")
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    if n == 0:
        return weights, ids
    per = e // groups
    use_pdl = resolve_pdl(pdl, logits.device)
    _route_kernel[(n,)](
        logits, bias if bias is not None else logits, weights, ids,
        logits.stride(0), per, groups, scale,
        TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)),
        TOPK_GROUP=topk_group,
        GROUP_PAD=max(2, triton.next_power_of_2(groups)), PER_PAD=max(2, triton.next_power_of_2(per)),
        METHOD=METHODS[method], NORM_TOPK=norm_topk_prob, PDL=use_pdl,
        num_warps=1 if e <= 256 else 4, **pdl_launch_kwargs(use_pdl),
    )
    return weights, ids
