"""Plain-PyTorch paged attention: runs on any device, reads K/V through the block tables.

Decodes (query length 1) are gathered into one padded batch; longer queries (prompt
chunks, prefix hits) are handled one request at a time with an explicit causal mask
offset by the cached prefix. Masks take a sliding window and Llama 4's attention chunks
(the one backend that runs those: the others refuse them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from flashpage.attention.backend import AttentionBackend, AttentionMetadata
from flashpage.kernels.alibi import alibi_ref
from flashpage.kernels.sinks import softmax_with_sinks

if TYPE_CHECKING:
    from flashpage.config import ModelConfig


def write_slots(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """x [N, *entry] into slots ``slot_mapping`` [N] of a paged cache [num_blocks,
    block_size, *entry] (-1 skipped), cast to the cache's dtype. An fp8 (float8_e4m3fn)
    cache saturates at +-448, as the Triton writes do (torch's own cast may give NaN past
    it), and takes the bytes (index_copy_ has no float8 kernel)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        x, slot_mapping = x[keep], slot_mapping[keep]
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == torch.float8_e4m3fn:
        x = x.clamp(-448.0, 448.0).to(cache.dtype).view(torch.uint8)
        flat = flat.view(torch.uint8)
    flat.index_copy_(0, slot_mapping, x.to(flat.dtype))


def write_kv_cache_torch(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [N, Hkv, D] into slots ``slot_mapping`` [N] of the paged cache (-1 skipped)."""
    write_slots(k, key_cache, slot_mapping)
    write_slots(v, value_cache, slot_mapping)


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` entries of one request's cache: [length, *cache.shape[2:]]."""
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    # index_select: advanced indexing takes a slow path on large caches (ms instead of us).
    # An fp8 cache is gathered as its bytes (the same values; the byte kernel is the
    # common, vectorised one) and viewed back.
    src = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    out = src.index_select(0, block_table[:nblocks].long()).flatten(0, 1)[:length]
    return out.view(cache.dtype) if out.dtype != cache.dtype else out


def causal_mask(q_len: int, k_len: int, window: int | None, device: torch.device,
                chunk: int | None = None) -> torch.Tensor:
    """True where query i (at position k_len - q_len + i) may see key j: j <= i, within
    ``window`` (j > i - window), within i's ``chunk`` (j // chunk == i // chunk)."""
    qpos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    kpos = torch.arange(k_len, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    if chunk is not None:
        mask &= kpos >= qpos // chunk * chunk
    return mask


def softcap_scores(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit softcapping: softcap * tanh(scores / softcap), in place."""
    if softcap is None:
        return scores
    return scores.div_(softcap).tanh_().mul_(softcap)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float | None,
                     alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, Lq, D], k/v [Hkv, Lk, D], mask [Lq, Lk] (True: attend) -> [Hq, Lq, D], in fp32
    with the scores softcapped, then ALiBi-biased (query i at key position Lk - Lq + i),
    before the mask and softmax (SDPA has no softcap), with head h's sink in its softmax
    denominator (kernels/sinks.py; SDPA has no sinks either)."""
    hkv, d = k.shape[0], k.shape[-1]
    lq, lk = q.shape[1], k.shape[1]
    qg = q.reshape(hkv, -1, lq, d).float()  # [Hkv, G, Lq, D]: GQA without repeats
    scores = torch.matmul(qg, k.float().transpose(1, 2)[:, None]) * scale  # [Hkv, G, Lq, Lk]
    scores = softcap_scores(scores, softcap)
    if alibi_slopes is not None:
        qpos = torch.arange(lk - lq, lk, device=q.device)[:, None]
        kpos = torch.arange(lk, device=q.device)[None, :]
        scores = alibi_ref(scores.view(-1, lq, lk), alibi_slopes, qpos, kpos).view(scores.shape)
    scores = scores.masked_fill_(~mask, float("-inf"))
    sink = None if sinks is None else sinks.view(hkv, -1, 1, 1)
    o = torch.matmul(softmax_with_sinks(scores, sink), v.float()[:, None])  # [Hkv, G, Lq, D]
    return o.reshape(q.shape).to(q.dtype)


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    @classmethod
    def unsupported_reasons(cls, model_config: ModelConfig, device: torch.device,
                            dtype: torch.dtype, *,
                            kv_cache_dtype: torch.dtype | None = None) -> list[str]:
        return []

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, *, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                alibi_slopes: torch.Tensor | None = None, write_kv: bool = True,
                sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        n = metadata.num_actual_tokens
        if write_kv:
            write_kv_cache_torch(k[:n], v[:n], key_cache, value_cache, metadata.slot_mapping[:n])
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], key_cache, value_cache, metadata, scale, sliding_window,
                                    softcap, alibi_slopes, sinks, chunk_size)
        start = metadata.num_decode_tokens
        for i in range(nd, metadata.num_seqs):
            q_len = metadata.query_lens_cpu[i]
            k_len = metadata.seq_lens_cpu[i]
            bt = metadata.block_tables[i]
            kk = gather_paged(key_cache, bt, k_len).to(q.dtype)  # (an fp8 cache: up-cast)
            vv = gather_paged(value_cache, bt, k_len).to(q.dtype)
            qi = q[start:start + q_len].transpose(0, 1)
            if softcap is not None or alibi_slopes is not None or sinks is not None:
                o = masked_attention(qi, kk.transpose(0, 1), vv.transpose(0, 1),
                                     causal_mask(q_len, k_len, sliding_window, q.device, chunk_size),
                                     scale, softcap, alibi_slopes, sinks)
            elif q_len == k_len and sliding_window is None and chunk_size is None:  # plain causal
                o = F.scaled_dot_product_attention(
                    qi, kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True, scale=scale,
                    enable_gqa=True)
            else:
                mask = causal_mask(q_len, k_len, sliding_window, q.device, chunk_size)
                o = F.scaled_dot_product_attention(
                    qi, kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask, scale=scale,
                    enable_gqa=True)
            out[start:start + q_len] = o.transpose(0, 1)
            start += q_len
        return out

    @staticmethod
    def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float, window: int | None,
                softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                sinks: torch.Tensor | None = None, chunk: int | None = None) -> torch.Tensor:
        nd = q.shape[0]
        lens = md.seq_lens[:nd].long()
        max_len = max(md.seq_lens_cpu[:nd])
        block_size = key_cache.shape[1]
        nblocks = (max_len + block_size - 1) // block_size
        bt = md.block_tables[:nd, :nblocks].reshape(-1).long()
        shape = (nd, nblocks * block_size, *key_cache.shape[2:])
        kk = key_cache.index_select(0, bt).view(shape)[:, :max_len]  # [nd, L, Hkv, D]
        vv = value_cache.index_select(0, bt).view(shape)[:, :max_len]
        pos = torch.arange(max_len, device=q.device)[None, :]
        mask = pos < lens[:, None]
        if window is not None:
            mask &= pos > (lens[:, None] - 1 - window)
        if chunk is not None:  # the query (at lens - 1) sees its own chunk's keys alone
            mask &= pos >= (lens[:, None] - 1) // chunk * chunk
        # Plain matmuls: SDPA with a mask takes a slow path on the CPU for one query.
        hkv, d = kk.shape[2], kk.shape[3]
        # fp32 throughout, as SDPA and the kernels accumulate: a bf16 QK^T rounds the
        # scores before the softmax and makes this reference the least accurate backend.
        qg = q.view(nd, hkv, -1, d).float()  # [nd, Hkv, G, D]: GQA without repeating K/V
        scores = torch.matmul(qg, kk.float().permute(0, 2, 3, 1)) * scale  # [nd, Hkv, G, L]
        scores = softcap_scores(scores, softcap)
        if alibi_slopes is not None:  # slope x (key position - the query's, lens - 1)
            dist = (pos - (lens[:, None] - 1)).float()  # [nd, L]
            scores += alibi_slopes.float().view(1, hkv, -1, 1) * dist[:, None, None, :]
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, hkv, -1, 1))
        o = torch.matmul(probs, vv.float().transpose(1, 2))  # [nd, Hkv, G, D]
        return o.reshape(nd, -1, d).to(q.dtype)
