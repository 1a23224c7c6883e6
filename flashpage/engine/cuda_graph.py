"""CUDA graphs for decode-only steps.

A decode step launches a few hundred small kernels; on the GPU their launch cost, not
their work, bounds the step. We capture the whole forward + logits once per batch-size
bucket (1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs``), all graphs sharing one
memory pool, and replay the smallest bucket that holds the step's batch.

Inputs live in static buffers the graphs were captured with; padding rows write
nowhere (slot -1) and attend to one token of block 0, so they cost almost nothing and
touch no request's cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata


def batch_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    out = [s for s in sizes if s < max_bs]
    return out + [max_bs]


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_bs: int, max_blocks: int, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.max_bs = max_bs
        self.max_blocks = max_blocks
        self.buckets = batch_buckets(max_bs)
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=device)
        self.positions = torch.zeros(max_bs, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=i32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=i32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the shared graph memory pool handle (torch's _POOL_HANDLE)

    def metadata(self, bs: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=bs, num_seqs=bs,
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs],
            max_query_len=1, max_seq_len=max_seq_len, num_decodes=bs, num_decode_tokens=bs)

    @torch.inference_mode()
    def capture(self) -> None:
        max_seq = self.max_blocks * 1  # only used for grid shapes that the tables fix anyway
        for bs in reversed(self.buckets):
            md = self.metadata(bs, max_seq)
            for _ in range(2):  # warm up: compile kernels, settle the allocator
                hidden = self.model(self.input_ids[:bs], self.positions[:bs], md)
                self.model.compute_logits(hidden)  # type: ignore[operator]
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                hidden = self.model(self.input_ids[:bs], self.positions[:bs], md)
                self.logits[bs] = self.model.compute_logits(hidden)  # type: ignore[operator]
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize(self.device)

    def bucket(self, n: int) -> int | None:
        if n > self.max_bs:
            return None
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
            logits_rows: int) -> torch.Tensor:
        """Replay for a decode-only batch of ``md.num_seqs`` requests; returns logits [n, V]."""
        n = md.num_seqs
        bs = self.bucket(n)
        assert bs is not None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        width = md.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs].zero_()
        self.graphs[bs].replay()
        return self.logits[bs][:logits_rows]
