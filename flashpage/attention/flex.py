"""PyTorch's FlexAttention over our paged KV cache, so a peer's kernel can be compared
with ours inside the same engine (``--attention-backend flex``).

Keys and values are the whole cache pool viewed as one long sequence ``[1, Hkv, S, D]``
(S = num_blocks * block_size). Each step builds BlockMasks straight from the block tables,
so nothing dense over S is ever evaluated:

- decodes (no sliding window): one query per batch entry, ``[nd, Hq, 1, D]`` against the
  pool broadcast over the batch (FlexAttention's paged form: the mask has the queries'
  batch, the keys batch 1). Entry b visits its own blocks, in its table's order: all but
  the last as full blocks (no ``mask_mod``), the last through ``mask_mod`` (keys past the
  context dropped). Built on the device, no host loop.
- the rest (prompt chunks; decodes too under a window): the step's flat batch, padded to
  128-token tiles; query tile t may only visit the physical blocks of the requests whose
  tokens it holds, and ``mask_mod`` keeps, inside those blocks, the keys the token's own
  request owns at logical positions up to its own (and inside the sliding window). A
  block shared through the prefix cache sits at the same logical index in every table
  that holds it, so one physical -> logical map serves the whole step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flashpage.attention.backend import AttentionBackend, AttentionMetadata, chunked_layers_reason
from flashpage.attention.torch_native import write_kv_cache_torch

if TYPE_CHECKING:
    from flashpage.config import ModelConfig

Q_TILE = 128


def windows(config: ModelConfig) -> set[int | None]:
    """The sliding windows the model's layers attend within (None: the whole context)."""
    return {config.attention_window(i) for i in range(config.num_hidden_layers)}


class FlexBackend(AttentionBackend):
    name = "flex"

    def __init__(self, model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(model_config, device, dtype)
        from torch.nn.attention.flex_attention import flex_attention

        # Compiled on the GPU (eager flex is a dense reference); eager on the CPU (tests).
        self._flex: Any = torch.compile(flex_attention, dynamic=True) if device.type == "cuda" \
            else flex_attention
        # The compiled kernel's tiles must divide the mask's (128 queries x one KV block);
        # its default key tile (64 or 128) would not divide a 16-token block.
        self._kernel_options: dict[str, Any] | None = None

    @classmethod
    def unsupported_reasons(cls, model_config: ModelConfig, device: torch.device,
                            dtype: torch.dtype, *,
                            kv_cache_dtype: torch.dtype | None = None) -> list[str]:
        reasons = []
        try:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
        except ImportError as e:
            reasons.append(f"this torch has no FlexAttention ({e})")
        if model_config.is_mla:
            reasons.append("MLA is not supported by the flex backend")
        if kv_cache_dtype is not None and kv_cache_dtype != dtype:
            reasons.append(f"a {str(kv_cache_dtype).replace('torch.', '')} KV cache is not supported "
                           "by the flex backend (FlexAttention reads K/V in the query dtype)")
        if len(windows(model_config)) > 1:
            reasons.append("per-layer sliding windows (layer_types: windowed and global layers) "
                           "are not supported by the flex backend (one mask a step)")
        if model_config.attn_logit_softcapping is not None:
            reasons.append("attention logit softcapping (attn_logit_softcapping) is not "
                           "supported by the flex backend")
        if model_config.alibi:
            reasons.append("ALiBi position biases (alibi: Bloom, MPT, Falcon-RW) are not "
                           "supported by the flex backend (its masks carry no per-head biases)")
        if model_config.attention_sinks:
            reasons.append("attention sinks (GPT-OSS's per-head sink logits) are not supported "
                           "by the flex backend (its softmax has no extra denominator term)")
        return reasons + chunked_layers_reason(model_config, cls.name)

    def bind_kv_cache(self, num_blocks: int, block_size: int) -> None:
        super().bind_kv_cache(num_blocks, block_size)
        if self.device.type == "cuda":
            if block_size < 16:
                raise ValueError(f"the flex backend on CUDA needs block_size >= 16 (its key "
                                 f"tiles are one block), got {block_size}")
            self._kernel_options = {"BLOCK_M": 64, "BLOCK_N": min(block_size, 64)}

    def prepare(self, md: AttentionMetadata) -> AttentionMetadata:
        from torch.nn.attention.flex_attention import BlockMask

        bs, nblocks = self.block_size, self.num_blocks
        # Decodes as a batch of one-query entries (below), unless a window needs positions.
        window = next(iter(windows(self.model_config)))  # one for all layers (unsupported_reasons)
        nd = md.num_decodes if window is None else 0
        md.extra["flex_nd"] = nd
        if nd:
            md.extra["flex_decode_mask"] = self._decode_mask(md, nd)
        n = md.num_actual_tokens
        first = md.num_decode_tokens if nd else 0  # the flat part's first token
        if md.num_seqs == nd:
            return md
        padded = -(-(n - first) // Q_TILE) * Q_TILE
        tables = md.block_tables.cpu().numpy()
        q_req = np.full(padded, -1, dtype=np.int64)
        q_pos = np.zeros(padded, dtype=np.int64)
        logical = np.full(nblocks, -1, dtype=np.int64)
        t = 0
        used: dict[int, np.ndarray] = {}  # request -> its blocks
        for i, (ql, length) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu, strict=True)):
            if i < nd:
                continue
            q_req[t:t + ql] = i
            q_pos[t:t + ql] = np.arange(length - ql, length)
            t += ql
            blocks = tables[i, : -(-length // bs)]
            logical[blocks] = np.arange(len(blocks))
            used[i] = blocks
        n_tiles = padded // Q_TILE
        kv_num = np.zeros((1, 1, n_tiles), dtype=np.int32)
        kv_idx = np.zeros((1, 1, n_tiles, nblocks), dtype=np.int32)
        for tile in range(n_tiles):
            reqs = np.unique(q_req[tile * Q_TILE:(tile + 1) * Q_TILE])
            blocks = np.unique(np.concatenate([used[r] for r in reqs if r >= 0]))
            kv_num[0, 0, tile] = len(blocks)
            kv_idx[0, 0, tile, : len(blocks)] = blocks
        dev = md.block_tables.device
        d_req, d_pos, d_logical = (torch.from_numpy(a).to(dev) for a in (q_req, q_pos, logical))
        d_tables = md.block_tables.long()

        def mask_mod(b, h, qi, ki):  # noqa: ANN001 (FlexAttention's signature)
            r = d_req[qi]
            pb = ki // bs
            j = d_logical[pb]
            owns = (r >= 0) & (j >= 0) & (d_tables[r.clamp(min=0), j.clamp(min=0)] == pb)
            pos = j * bs + ki % bs
            keep = owns & (pos <= d_pos[qi])
            if window is not None:
                keep = keep & (pos > d_pos[qi] - window)
            return keep

        md.extra["flex_mask"] = BlockMask.from_kv_blocks(
            torch.from_numpy(kv_num).to(dev), torch.from_numpy(kv_idx).to(dev),
            BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask_mod, seq_lengths=(padded, nblocks * bs))
        md.extra["flex_padded"] = padded
        return md

    def _decode_mask(self, md: AttentionMetadata, nd: int) -> Any:
        """The BlockMask of nd one-query entries: entry b's table, all blocks but the last
        full, the last one partial (keys at or past its context dropped by mask_mod)."""
        from torch.nn.attention.flex_attention import BlockMask

        bs = self.block_size
        seq = md.seq_lens[:nd].long()
        nblk = (seq + bs - 1) // bs
        tables = md.block_tables[:nd].int()
        last = tables.gather(1, (nblk - 1)[:, None])  # [nd, 1]
        # mask_mod must hold on its own (eager FlexAttention evaluates it over the whole
        # pool; the block lists only spare the compiled kernel): key ki belongs to entry b
        # at logical block j = logical[ki // bs] and lies before b's context end. A block
        # sits at one logical index in every table holding it, so one map serves all;
        # entries past a table's blocks go to a spare last slot (no host sync).
        width = tables.shape[1]
        cols = torch.arange(width, device=seq.device)
        slots = torch.where(cols[None, :] < nblk[:, None], tables.long(), self.num_blocks)
        logical = torch.full((self.num_blocks + 1,), -1, dtype=torch.long, device=seq.device)
        logical.scatter_(0, slots.flatten(), cols.expand(nd, width).flatten())
        tables_l = tables.long()

        def mask_mod(b, h, qi, ki):  # noqa: ANN001 (FlexAttention's signature)
            pb = ki // bs
            j = logical[pb]
            owns = (j >= 0) & (tables_l[b, j.clamp(min=0, max=width - 1)] == pb)
            return owns & (j * bs + ki % bs < seq[b])

        # FlexAttention sizes its block bitmaps by the index tensors' last dim: one column
        # per block of the pool (block ids index it).
        dev, ncols = seq.device, self.num_blocks
        part_idx = torch.zeros(nd, 1, 1, ncols, dtype=torch.int32, device=dev)
        part_idx[:, 0, 0, 0] = last[:, 0]
        full_idx = torch.zeros(nd, 1, 1, ncols, dtype=torch.int32, device=dev)
        full_idx[:, 0, 0, :width] = tables
        ones = torch.ones(nd, 1, 1, dtype=torch.int32, device=dev)
        return BlockMask.from_kv_blocks(
            ones, part_idx, (nblk - 1).int().view(nd, 1, 1), full_idx,
            BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask_mod, seq_lengths=(1, ncols * bs))

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, *, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                alibi_slopes: torch.Tensor | None = None, write_kv: bool = True,
                sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
        if sinks is not None:  # unsupported_reasons refuses such models
            raise ValueError("the flex backend has no attention sinks")
        if chunk_size is not None:
            raise ValueError(f"the {self.name} backend has no chunked local attention "
                             "(unsupported_reasons declines such models)")
        if softcap is not None:
            raise ValueError("the flex backend has no attention softcap (unsupported_reasons "
                             "declines such models)")
        if alibi_slopes is not None:
            raise ValueError("the flex backend has no ALiBi biases (unsupported_reasons "
                             "declines such models)")
        key_cache, value_cache = kv_cache
        md = metadata
        n = md.num_actual_tokens
        if write_kv:
            write_kv_cache_torch(k[:n], v[:n], key_cache, value_cache, md.slot_mapping[:n])
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        hkv, d = key_cache.shape[2], key_cache.shape[3]
        k4 = key_cache.view(1, num_slots, hkv, d).transpose(1, 2)
        v4 = value_cache.view(1, num_slots, hkv, d).transpose(1, 2)
        out = torch.empty_like(q)
        nd = md.extra["flex_nd"]
        if nd:  # one query per entry, the pool broadcast over the entries
            o = self._flex(q[:nd, :, None, :], k4, v4, block_mask=md.extra["flex_decode_mask"], scale=scale,
                           enable_gqa=True, kernel_options=self._kernel_options)
            out[:nd] = o[:, :, 0]
        first = md.num_decode_tokens if nd else 0
        if md.num_seqs > nd:
            qq = q.new_zeros(1, q.shape[1], md.extra["flex_padded"], d)
            qq[0, :, :n - first] = q[first:n].transpose(0, 1)
            o = self._flex(qq, k4, v4, block_mask=md.extra["flex_mask"], scale=scale, enable_gqa=True,
                           kernel_options=self._kernel_options)
            out[first:n] = o[0, :, :n - first].transpose(0, 1)
        return out
