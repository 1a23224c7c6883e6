"""The MLA attention layer (DeepSeek-V2/V3): projections, rope, the paged latent cache, two paths.

Per token, one latent entry goes into the layer's cache (docs/architecture.md)::

    kv_cache : [num_blocks, block_size, R + rope]     R = kv_lora_rank
               entry = [c_kv (after kv_a_layernorm) | k_pe (rope applied)]

The cache holds the model's dtype or, with ``--kv-cache-dtype fp8``, float8_e4m3fn
(scale 1): entries are rounded to e4m3 as they are written and up-cast to the model's
dtype right after they are read, before any arithmetic.

Each step the new tokens' entries are written first; then the requests of the step are
split as the metadata orders them (decodes first):

- decodes (query length 1), *absorbed*: the query takes W_UK in
  (``q_abs = [q_nope W_UK | q_pe]``, [nd, H, R + rope]), attends over the latent
  entries as MQA (v = the first R values), and the latent output takes W_UV
  (:func:`mla_decode_torch`, or the backend's ``forward_mla_decode``);
- the rest (prompt chunks, prefix hits), *expanded*: the latents of each request's
  whole context are expanded into per-head K [.., nope + rope] and V [.., v_dim] and
  attended causally (:func:`mla_expand_prefill_torch` and :func:`mla_prefill_torch`, or the
  backend's ``expand_mla_prefill`` and ``forward_mla_prefill``).

Parameter names are transformers', so ``self_attn.*`` loads by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.attention.torch_native import causal_mask, gather_paged, write_slots
from flashpage.config import ModelConfig
from flashpage.layers.fp32 import KeepFp32
from flashpage.layers.linear import ColumnParallelLinear, RowParallelLinear
from flashpage.layers.mla import (
    mla_absorb_output,
    mla_absorb_query,
    mla_expand_kv,
    mla_rope_is_neox,
    mla_softmax_scale,
    yarn_inv_freq_and_mscale,
)
from flashpage.layers.norm import RMSNorm
from flashpage.layers.rotary import apply_rotary_torch, build_cos_sin_cache

if TYPE_CHECKING:
    from flashpage.attention.backend import AttentionBackend, AttentionMetadata

# transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps,
# not config.rms_norm_eps (so did DeepSeek's own code).
LATENT_NORM_EPS = 1e-6


class MLARotaryEmbedding(KeepFp32, nn.Module):
    """DeepSeek rope over the ``qk_rope_head_dim`` dims, shared by every layer.

    ``cos_sin_cache`` [max_positions, rope] fp32 (cos half, then sin half), both halves
    multiplied by the YaRN attention factor; it stays fp32 whatever the model dtype.
    """

    cos_sin_cache: torch.Tensor

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq, mscale = yarn_inv_freq_and_mscale(config)
        self.is_neox = mla_rope_is_neox(config)
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(inv_freq, max_positions, mscale),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_pe [N, H, rope], k_pe [N, 1, rope] -> rotated copies."""
        return (apply_rotary_torch(positions, q_pe, self.cos_sin_cache, self.is_neox),
                apply_rotary_torch(positions, k_pe, self.cos_sin_cache, self.is_neox))


# ----------------------------------------------------------------- torch math of both paths
def write_mla_cache_torch(latent: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """latent [N, R + rope] into slots ``slot_mapping`` [N] of kv_cache (-1 skipped).

    kv_cache in the latent's dtype or float8_e4m3fn (each value rounded to e4m3,
    saturating at +-448 as the Triton write does)."""
    write_slots(latent, kv_cache, slot_mapping)


def gather_prefill_contexts(kv_cache: torch.Tensor, md: AttentionMetadata,
                            dtype: torch.dtype | None = None) -> torch.Tensor:
    """The latent entries of the whole context of every non-decode request, back to back:
    [sum(seq_lens[num_decodes:]), R + rope] (request b's keys at positions 0..seq_lens[b]),
    in ``dtype`` (default the cache's: an fp8 cache's entries are up-cast, exactly, as read)."""
    dtype = dtype or kv_cache.dtype
    parts = [gather_paged(kv_cache, md.block_tables[i], md.seq_lens_cpu[i]).to(dtype)
             for i in range(md.num_decodes, md.num_seqs)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def mla_expand_prefill_torch(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                             kv_b_proj_weight: torch.Tensor, md: AttentionMetadata, *, num_heads: int,
                             qk_nope_head_dim: int, v_head_dim: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expanded path's inputs for the non-decode requests (``num_decodes ..``).

    q_nope [Nq, H, nope], q_pe [Nq, H, rope]: their new tokens; kv_cache as the layer's ->
    (q [Nq, H, nope + rope], k [Nk, H, nope + rope], v [Nk, H, v_dim]) over their whole
    contexts back to back (:func:`gather_prefill_contexts`, layers/mla.mla_expand_kv). Same
    contract as the triton backend's ``expand_mla_prefill`` (kernels/mla_expand.py), which
    gives these values bit for bit in two copy kernels around the same matmul."""
    ctx = gather_prefill_contexts(kv_cache, md, q_nope.dtype)
    r = kv_cache.shape[-1] - q_pe.shape[-1]
    k, v = mla_expand_kv(ctx[:, :r], ctx[:, r:], kv_b_proj_weight, num_heads, qk_nope_head_dim,
                         v_head_dim)
    return torch.cat([q_nope, q_pe], dim=-1), k, v


def mla_decode_torch(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, *,
                     kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Absorbed path for the leading ``q.shape[0]`` (decode) requests of the step.

    q [nd, H, R + rope] (absorbed query, one per request, at position seq_lens[b] - 1);
    kv_cache [num_blocks, block_size, R + rope] in q's dtype or float8_e4m3fn (up-cast
    as read) -> latent output [nd, H, R]. Same
    contract as ``kernels/mla_decode.py: mla_decode`` over ``block_tables[:nd]``,
    ``seq_lens[:nd]``.
    """
    nd = q.shape[0]
    block_size, dim = kv_cache.shape[1], kv_cache.shape[2]
    # Every block of the table, not just up to the longest context: the width is a shape,
    # so no host-side lengths are needed (CUDA-graph metadata carries none).
    nblocks = md.block_tables.shape[1]
    max_len = nblocks * block_size
    bt = md.block_tables[:nd].reshape(-1).long()
    ent = kv_cache.index_select(0, bt).view(nd, max_len, dim).to(q.dtype)  # fp8: up-cast
    valid = torch.arange(max_len, device=q.device)[None, :] < md.seq_lens[:nd, None]
    # Slots past a request's length hold anything (other requests' data, never-written
    # memory): zero them, since a masked probability of 0 times a NaN is still NaN.
    ent = ent.masked_fill(~valid[..., None], 0)
    # fp32 scores and sums, as the kernel accumulates (bf16 scores would round before softmax).
    ent = ent.float()
    scores = torch.matmul(q.float(), ent.transpose(1, 2)) * scale  # [nd, H, L]
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.matmul(probs, ent[..., :kv_lora_rank]).to(q.dtype)  # every head reads the one latent


def mla_prefill_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
                      *, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Expanded path for the non-decode requests (``num_decodes ..`` of the step).

    q [Nq, H, nope + rope]: their new tokens back to back; k [Nk, H, nope + rope],
    v [Nk, H, v_dim]: their whole contexts back to back (lengths ``seq_lens``) ->
    [Nq, H, v_dim] (into ``out`` where given: a contiguous tensor of that shape). Query i of
    a request sits at position seq_len - q_len + i and sees keys 0 .. that position
    (bottom-right causal, as ``flash_attn_varlen``).
    """
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    qs = ks = 0
    for i in range(md.num_decodes, md.num_seqs):
        q_len, k_len = md.query_lens_cpu[i], md.seq_lens_cpu[i]
        qi = q[qs:qs + q_len].transpose(0, 1)
        ki = k[ks:ks + k_len].transpose(0, 1)
        vi = v[ks:ks + k_len].transpose(0, 1)
        if q_len == k_len:  # no cached prefix: plain causal
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:
            mask = causal_mask(q_len, k_len, None, q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[qs:qs + q_len] = o.transpose(0, 1)
        qs += q_len
        ks += k_len
    return out


# ----------------------------------------------------------------- the layer
class MLAAttention(nn.Module):
    """DeepSeek's ``self_attn``: x [N, hidden] -> [N, hidden] over the paged latent cache.

    The model runner sees ``is_mla`` and binds ``kv_cache`` (one tensor of
    :meth:`kv_cache_shape`) and ``backend``. A backend with ``write_mla_cache`` /
    ``forward_mla_decode`` / ``expand_mla_prefill`` / ``forward_mla_prefill`` (signatures of
    :func:`write_mla_cache_torch` / :func:`mla_decode_torch` / :func:`mla_expand_prefill_torch`
    / :func:`mla_prefill_torch`) runs that part; otherwise the torch functions here do.

    CUDA graphs (decode-only steps): with a backend that has ``write_mla_cache`` and
    ``forward_mla_decode`` free of host syncs, the decode path has static shapes and no
    host sync (the torch cache write checks its slots on the host, so it is not capturable).
    """

    is_mla = True

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: MLARotaryEmbedding) -> None:
        super().__init__()
        if config.kv_lora_rank is None:
            raise ValueError("MLAAttention needs kv_lora_rank")
        h = self.num_heads = config.num_attention_heads
        self.layer_idx = layer_idx
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = config.attention_bias  # transformers: on q_a_proj, kv_a_proj_with_mqa, o_proj
        hidden = config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, h * qk_dim)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, h * qk_dim)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank,
                                              h * (self.qk_nope_head_dim + self.v_head_dim))
        # absorbed into queries and outputs as a matrix (layers/mla.py): never fp8
        self.kv_b_proj.quantizable = False
        self.o_proj = RowParallelLinear(h * self.v_head_dim, hidden, bias=bias)
        self.rotary_emb = rotary_emb  # one module shared by all layers (no parameters)
        self.scale = mla_softmax_scale(config)
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int]:
        return (num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("MLA layer used before the model runner bound its latent cache")
        n = x.shape[0]
        h, nope, rope, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(n, h, nope + rope).split([nope, rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([r, rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe[:, None, :])
        latent = torch.cat([c_kv, k_pe[:, 0]], dim=-1)  # [N, R + rope]: the cache entry
        n_act = md.num_actual_tokens
        write = getattr(self.backend, "write_mla_cache", None) or write_mla_cache_torch
        write(latent[:n_act], self.kv_cache, md.slot_mapping[:n_act])
        if md.split is not None:  # a piecewise graph's boundary (engine/cuda_graph.py)
            out = md.split(self._core, (q_nope, q_pe), (n, h, self.v_head_dim))
        else:
            out = self.attend(q_nope, q_pe, md)
        return self.o_proj(out.reshape(n, h * self.v_head_dim))

    def _core(self, md: AttentionMetadata, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        return self.attend(q_nope, q_pe, md)

    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """q_nope [N, H, nope], q_pe [N, H, rope] (rope applied), this step's entries already
        in the cache -> [N, H, v_dim]: decodes absorbed, the rest expanded."""
        assert self.kv_cache is not None
        n = q_nope.shape[0]
        n_act, nd = md.num_actual_tokens, md.num_decode_tokens
        h, nope, vd, r = self.num_heads, self.qk_nope_head_dim, self.v_head_dim, self.kv_lora_rank
        w = self.kv_b_proj.weight
        if not nd and n == n_act > 0:  # a prompt-only step: the prefill's output is the whole
            return self._expanded(q_nope, q_pe, md)
        out = q_nope.new_zeros(n, h, vd) if n > n_act else q_nope.new_empty(n, h, vd)
        if nd:
            q_abs = mla_absorb_query(q_nope[:nd], q_pe[:nd], w, h, nope, vd)
            decode = getattr(self.backend, "forward_mla_decode", None) or mla_decode_torch
            o_lat = decode(q_abs, self.kv_cache, md, kv_lora_rank=r, scale=self.scale)
            out[:nd] = mla_absorb_output(o_lat, w, h, nope, vd)
        if n_act > nd:  # written in place: rows nd .. n_act of out are one contiguous block
            self._expanded(q_nope[nd:n_act], q_pe[nd:n_act], md, out[nd:n_act])
        return out

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, md: AttentionMetadata,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """The non-decode requests' queries [Nq, H, nope] / [Nq, H, rope] -> [Nq, H, v_dim]
        (into ``out`` where given): their contexts' latents expanded (the backend's
        ``expand_mla_prefill``: two copy kernels around kv_b_proj's matmul) and attended
        causally."""
        assert self.kv_cache is not None
        expand = getattr(self.backend, "expand_mla_prefill", None) or mla_expand_prefill_torch
        q, k, v = expand(q_nope, q_pe, self.kv_cache, self.kv_b_proj.weight, md,
                         num_heads=self.num_heads, qk_nope_head_dim=self.qk_nope_head_dim,
                         v_head_dim=self.v_head_dim)
        prefill = getattr(self.backend, "forward_mla_prefill", None) or mla_prefill_torch
        return prefill(q, k, v, md, scale=self.scale, out=out)


__all__ = [
    "MLAAttention",
    "MLARotaryEmbedding",
    "gather_prefill_contexts",
    "mla_decode_torch",
    "mla_expand_prefill_torch",
    "mla_prefill_torch",
    "write_mla_cache_torch",
]
