"""CUDA graphs for decode-only steps, short prompt-only steps, and the rest in pieces.

A decode step launches a few hundred small kernels; on the GPU their launch cost, not
their work, bounds the step. We capture the whole forward + logits once per batch-size
bucket (1, 2, 4, 8, 16, 24, 32, ... up to ``max_num_seqs``), all graphs sharing one
memory pool, and replay the smallest bucket that holds the step's batch. A draft model
(speculative decoding, engine/draft_model.py) gets decode graphs of its own, over its own
K/V pool, in the same memory pool: its single-token forwards are decode steps too; and
``PrefillGraphs`` of its own for its catch-ups of up to 1 + k tokens a request.

A short prompt is host-bound the same way: an 8B 128-token prompt ran 5.4 ms of kernels
in 23-62 ms (333 launches, BENCHMARKS.md session 14). ``PrefillGraphs`` captures
prompt-only steps (no decodes) of up to ``PREFILL_SEQS`` requests and up to
``PREFILL_MAX_TOKENS`` tokens, one graph per (request slots, token bucket).
``PiecewiseGraphs`` takes every other step of up to ``PREFILL_MAX_TOKENS`` tokens (decodes
beside prompt chunks, more prompts): the forward in pieces between its attention layers,
each layer's attention run eagerly in between over the step's own metadata.

Inputs live in static buffers the graphs were captured with. Decode padding rows write
nowhere (slot -1) and attend to one token of block 0, so they cost almost nothing and
touch no request's cache. Prompt padding rows (past the step's tokens) belong to no
request: slot -1, and the attention kernels, which work per request from the query
offsets, never read or write them; padding request slots have no queries.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flashpage.attention.backend import AttentionMetadata, with_groups


def batch_buckets(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    out = [s for s in sizes if s < max_bs]
    return out + [max_bs]


def _capture(run: Callable[[], torch.Tensor], pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run ``run`` twice (kernels compile, the allocator settles), then capture it into a
    graph in ``pool`` (None: a new one); returns the graph and its output tensor."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = run()
    return g, out


class _StaticInputs:
    """The per-token inputs every graph kind replays from: input ids, positions and slot
    mapping of up to ``rows`` tokens (padding rows: slot -1, no cache write); with KV cache
    groups (``groups`` > 1, kv_cache/hybrid.py) each other group's slot mapping and, where
    the graph holds block tables (``table_rows`` x ``table_width``), its tables too."""

    def __init__(self, rows: int, device: torch.device, groups: int = 1,
                 table_rows: int = 0, table_width: int = 0) -> None:
        i64 = torch.int64
        self.input_ids = torch.zeros(rows, dtype=i64, device=device)
        self.positions = torch.zeros(rows, dtype=i64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=i64, device=device)
        self.group_slots = [torch.full((rows,), -1, dtype=i64, device=device)
                            for _ in range(groups - 1)]
        self.group_tables = [torch.zeros(table_rows, table_width, dtype=torch.int32, device=device)
                             for _ in range(groups - 1)]

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              padded: int, md: AttentionMetadata | None = None) -> None:
        """The step's ``n`` tokens into rows 0 .. n - 1; rows n .. padded - 1 write no slot
        (each group's: ``md.groups``' slot mappings)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        pairs = [(self.slot_mapping, slot_mapping)]
        if md is not None and md.groups is not None:
            pairs += [(s, g.slot_mapping) for s, g in zip(self.group_slots, md.groups[1:], strict=True)]
        for static, step in pairs:
            static[:n].copy_(step[:n], non_blocking=True)
            if padded > n:
                static[n:padded].fill_(-1)

    def _load_group_tables(self, md: AttentionMetadata, seqs: int) -> None:
        """Each other group's tables of the step's ``k`` requests into rows 0 .. k - 1, rows
        k .. seqs - 1 zeroed."""
        if md.groups is None:
            return
        k = md.num_seqs
        for static, g in zip(self.group_tables, md.groups[1:], strict=True):
            static[:k, : g.block_tables.shape[1]].copy_(g.block_tables, non_blocking=True)
            if seqs > k:
                static[k:seqs].zero_()

    def _with_groups(self, md: AttentionMetadata, seqs: int, tokens: int,
                     prepare: Callable[[AttentionMetadata], AttentionMetadata] = lambda m: m
                     ) -> AttentionMetadata:
        """``md`` over the static buffers with the other groups' static metadata."""
        return with_groups(md, [(t[:seqs], s[:tokens]) for t, s in
                                zip(self.group_tables, self.group_slots, strict=True)], prepare)


class DecodeGraphs(_StaticInputs):
    """Graphs of decode-only steps of ``model``, one per batch bucket up to ``max_bs``,
    reading the K/V pool its attention layers hold: the target's (ModelRunner) or a draft
    model's (engine/draft_model.DraftRunner), each with its own DecodeGraphs.

    ``logits=False``: the graphs end at the final hidden states [bs, hidden] and the caller
    computes the logits of the rows it wants (a draft: per bucket a [bs, vocab] output would
    stay reserved beside the target's). Buckets not captured (``capture`` not called: the
    CPU tests) run the same padded static-buffer forward eagerly."""

    def __init__(self, model: nn.Module, max_bs: int, max_blocks: int, device: torch.device,
                 logits: bool = True, groups: int = 1) -> None:
        super().__init__(max_bs, device, groups, max_bs, max_blocks)
        self.model = model
        self.device = device
        self.max_bs = max_bs
        self.max_blocks = max_blocks
        self.with_logits = logits
        self.buckets = batch_buckets(max_bs)
        i32 = torch.int32
        self.seq_lens = torch.ones(max_bs, dtype=i32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=i32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=i32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output (hidden states: logits=False)
        self.pool: Any = None  # the shared graph memory pool handle (torch's _POOL_HANDLE)

    def metadata(self, bs: int, max_seq_len: int, seq_lens_cpu: list[int] | None = None) -> AttentionMetadata:
        return self._with_groups(AttentionMetadata(
            num_actual_tokens=bs, num_seqs=bs,
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs],
            max_query_len=1, max_seq_len=max_seq_len, num_decodes=bs, num_decode_tokens=bs,
            query_lens_cpu=[1] * bs if seq_lens_cpu is not None else [],
            seq_lens_cpu=seq_lens_cpu if seq_lens_cpu is not None else []), bs, bs)

    def forward(self, bs: int, md: AttentionMetadata) -> torch.Tensor:
        """The padded step of bucket ``bs`` over the static buffers -> logits [bs, V] (hidden
        states [bs, H] with logits=False)."""
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], md)
        return self.model.compute_logits(hidden) if self.with_logits else hidden  # type: ignore[operator]

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every bucket, largest first, into ``pool`` (None: a new one); returns the pool."""
        self.pool = pool
        max_seq = self.max_blocks * 1  # only used for grid shapes that the tables fix anyway
        for bs in reversed(self.buckets):
            md = self.metadata(bs, max_seq)

            def run(bs: int = bs, md: AttentionMetadata = md) -> torch.Tensor:
                return self.forward(bs, md)

            self.graphs[bs], self.logits[bs] = _capture(run, self.pool)
            if self.pool is None:
                self.pool = self.graphs[bs].pool()
        torch.cuda.synchronize(self.device)
        return self.pool

    def bucket(self, n: int) -> int | None:
        if n > self.max_bs:
            return None
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
            logits_rows: int) -> torch.Tensor:
        """Replay for a decode-only batch of ``md.num_seqs`` requests; returns logits [n, V]
        (hidden states [n, H] with logits=False)."""
        n = md.num_seqs
        bs = self.bucket(n)
        assert bs is not None
        self._load(input_ids, positions, md.slot_mapping, bs, md)
        self._load_group_tables(md, bs)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        width = md.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        if bs > n:
            self.seq_lens[n:bs].fill_(1)
            self.block_tables[n:bs].zero_()
        if bs not in self.graphs:  # not captured: the same padded step, eagerly (host lengths too)
            lens = [*md.seq_lens_cpu[:n], *[1] * (bs - n)]
            return self.forward(bs, self.metadata(bs, max(lens), lens))[:logits_rows]
        self.graphs[bs].replay()
        return self.logits[bs][:logits_rows]


PREFILL_MAX_TOKENS = 1024
PREFILL_SEQS = (1, 4)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts prompt-only steps are padded to: finer where the padded rows cost
    compute (the GEMMs of a few hundred rows and up), up to ``max_tokens`` (<= 1024)."""
    cap = min(max_tokens, PREFILL_MAX_TOKENS)
    # 4 and 8: a short prompt, or a request checking its drafts (speculative decoding), runs
    # GEMMs of 4 / 8 rows instead of 16 (near one row's cost where the skinny GEMM is tuned)
    sizes = [4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    return [s for s in sizes if s < cap] + [cap]


class PrefillGraphs(_StaticInputs):
    """Graphs of prompt-only steps: up to ``max(seq_slots)`` requests (the step padded to the
    smallest slot count that holds it, 1 or 4) and up to ``max_tokens`` tokens (padded to
    ``prefill_buckets``). One graph per (slots, tokens), captured with the backend's
    ``prepare`` inside it, so that what it derives on the device (the triton backend's
    query offsets) follows the static buffers; its host values are the bucket's: the
    longest query count = the token bucket, the longest context = the tables' capacity.

    ``capture=False`` keeps the padded static-buffer forward but runs it eagerly: the same
    inputs without CUDA (the CPU tests check the padding with it).

    ``rows_per_seq``: logits rows a graph computes per request slot (capped by its token
    bucket): 1, or 1 + drafts with speculative decoding, whose steps of requests that all
    check drafts then fit these graphs too.

    ``tokens_per_seq`` (a draft model's catch-ups, engine/draft_model.py: up to 1 + k tokens
    a request): steps of at most that many tokens a request, one graph per slot count of
    ``slots * tokens_per_seq`` tokens (slot counts past ``max_tokens`` dropped), whose host
    longest query is ``tokens_per_seq`` (the prompt kernel's grid: a few query blocks a
    request, not the bucket's). ``logits=False``: a graph ends at the hidden states of its
    logits rows [rows, hidden] (the caller computes the logits: no [rows, vocab] kept per
    graph)."""

    def __init__(self, model: nn.Module, prepare: Callable[[AttentionMetadata], AttentionMetadata],
                 max_tokens: int, max_blocks: int, block_size: int, device: torch.device,
                 seq_slots: tuple[int, ...] = PREFILL_SEQS, rows_per_seq: int = 1, *,
                 tokens_per_seq: int | None = None, logits: bool = True, groups: int = 1) -> None:
        self.model = model
        self.prepare = prepare
        self.device = device
        self.tokens_per_seq = tokens_per_seq
        self.with_logits = logits
        if tokens_per_seq is None:
            self.token_buckets = prefill_buckets(max_tokens)
            self.seq_slots = sorted(seq_slots)
            self.keys = [(s, t) for s in self.seq_slots for t in self.token_buckets]
        else:
            self.seq_slots = [s for s in sorted(seq_slots) if s * tokens_per_seq <= max_tokens]
            self.token_buckets = [s * tokens_per_seq for s in self.seq_slots]
            self.keys = list(zip(self.seq_slots, self.token_buckets, strict=True))
        self.capacity = max_blocks * block_size
        tokens, seqs = max(self.token_buckets, default=0), max(self.seq_slots, default=0)
        i32, i64 = torch.int32, torch.int64
        super().__init__(tokens, device, groups, seqs, max_blocks)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=i32, device=device)
        self.seq_lens = torch.ones(seqs, dtype=i32, device=device)
        self.block_tables = torch.zeros(seqs, max_blocks, dtype=i32, device=device)
        self.rows_per_seq = rows_per_seq
        self.logits_indices = torch.zeros(seqs * rows_per_seq, dtype=i64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}
        self.pool: Any = None

    def key(self, num_seqs: int, num_tokens: int) -> tuple[int, int] | None:
        """The (slots, tokens) graph a step of this size replays (the smallest that holds
        it); None: too big."""
        return next(((s, t) for s, t in self.keys if s >= num_seqs and t >= num_tokens), None)

    def rows(self, key: tuple[int, int]) -> int:
        """How many logits rows graph ``key`` = (slots, tokens) computes."""
        return min(key[0] * self.rows_per_seq, key[1])

    def forward(self, seqs: int, tokens: int, lens: tuple[list[int], list[int]] | None = None
                ) -> torch.Tensor:
        """The padded step over the static buffers -> logits [rows((seqs, tokens)), V] (the
        rows ``logits_indices`` point at; their hidden states with logits=False). Host
        lengths: the bucket's (a graph's), or ``lens`` = (query lengths, contexts) of every
        slot (the step's own, run eagerly: the torch_native backend reads them per request)."""
        max_q = min(tokens, self.tokens_per_seq or tokens)
        qlens, ctx = lens if lens is not None else ([max_q] * seqs, [self.capacity] * seqs)
        md = self._with_groups(self.prepare(AttentionMetadata(
            num_actual_tokens=tokens, num_seqs=seqs,
            query_start_loc=self.query_start_loc[: seqs + 1], seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs], slot_mapping=self.slot_mapping[:tokens],
            max_query_len=max_q, max_seq_len=self.capacity, num_decodes=0, num_decode_tokens=0,
            query_lens_cpu=qlens, seq_lens_cpu=ctx)), seqs, tokens, self.prepare)
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], md)
        hidden = hidden[self.logits_indices[:self.rows((seqs, tokens))]]
        return self.model.compute_logits(hidden) if self.with_logits else hidden  # type: ignore[operator]

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every (slots, tokens) graph, largest first, into ``pool`` (the decode
        graphs' pool: graphs never run at once); returns the pool."""
        for key in reversed(self.keys):

            def run(s: int = key[0], t: int = key[1]) -> torch.Tensor:
                return self.forward(s, t)

            self.graphs[key], self.logits[key] = _capture(run, pool)
            if pool is None:
                pool = self.graphs[key].pool()
        torch.cuda.synchronize(self.device)
        self.pool = pool
        return pool

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
            logits_indices: torch.Tensor) -> torch.Tensor:
        """A step that ``key`` fits -> the logits of its ``logits_indices`` rows
        [len(logits_indices), V] (hidden states with logits=False). Every request takes the
        prompt path in the graph, a one-token one too (the target sends prompt-only steps,
        a draft model its catch-ups, decodes first or not)."""
        n, k = md.num_actual_tokens, md.num_seqs
        key = self.key(k, n)
        assert key is not None
        seqs, tokens = key
        self._load(input_ids, positions, md.slot_mapping, tokens, md)
        self._load_group_tables(md, seqs)
        self.query_start_loc[: k + 1].copy_(md.query_start_loc, non_blocking=True)
        if seqs > k:
            self.query_start_loc[k + 1: seqs + 1].fill_(n)  # padding slots: no queries
        self.seq_lens[:k].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:k, : md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)
        rows, cap = logits_indices.shape[0], self.rows(key)
        assert rows <= cap
        self.logits_indices[:rows].copy_(logits_indices, non_blocking=True)
        if cap > rows:
            self.logits_indices[rows:cap].zero_()  # in range of any bucket (a stale one may not be)
        if key in self.graphs:
            self.graphs[key].replay()
            return self.logits[key][:rows]
        lens = None
        if md.query_lens_cpu and md.seq_lens_cpu:  # not captured: the step's own host lengths
            pad = seqs - k
            lens = ([*md.query_lens_cpu, *[0] * pad], [*md.seq_lens_cpu, *[0] * pad])
        return self.forward(seqs, tokens, lens)[:rows]


# One attention layer's core as a piece boundary records it: run(md, *inputs) -> out, the
# static inputs it reads at replay, and the static output view the next piece reads.
_Call = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], torch.Tensor]


class PiecewiseGraphs(_StaticInputs):
    """Graphs of the steps the whole-step graphs do not take (decodes beside prompt chunks,
    more than 4 prompts) of up to ``max_tokens`` tokens: per token bucket the forward is
    captured in pieces between its attention layers, and each layer's attention runs eagerly
    between the pieces' replays, over the step's own metadata (any mix of decodes and
    prompts: the kernels and their grids are chosen per step, as without graphs).

    The pieces hold everything else (norms, projections, rotary with the cache write through
    the static slot mapping, MLPs), ~7 of a layer's ~9 launches. An attention layer hands its
    core to ``AttentionMetadata.split`` as ``split(run, inputs, out_shape)``: ``run(md,
    *inputs)`` computes the output (``Attention``: the backend over q, k, v; ``MLAAttention``:
    ``attend`` over the query halves). Capture: ``split`` copies the inputs into static
    buffers (inside the piece: cheaper than keeping every layer's projections out of the
    pool's reuse), ends the piece, records the call, begins the next piece and hands back a
    view of one static output buffer; replay: piece, ``run`` into that buffer, piece, ...
    Padding rows (past the step's tokens) write no slot and are not attended (the step's
    metadata covers its own tokens only). Static buffers are sized by the largest bucket's
    warm-up, before any capture.

    ``capture=False``: the same padded steps, each core run eagerly (CPU tests)."""

    def __init__(self, model: nn.Module, max_tokens: int, device: torch.device, groups: int = 1) -> None:
        self.model = model
        self.device = device
        self.token_buckets = prefill_buckets(max_tokens)
        super().__init__(self.token_buckets[-1], device, groups)
        self.inputs: list[torch.Tensor] = []  # flat static buffers, one per input position
        self.out = torch.empty(0, device=device)  # flat static output
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[_Call]] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    def bucket(self, num_tokens: int) -> int | None:
        return next((t for t in self.token_buckets if t >= num_tokens), None)

    @staticmethod
    def _view(buf: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return buf[: math.prod(shape)].view(shape)

    def _size(self, inputs: tuple[torch.Tensor, ...], out_shape: tuple[int, ...]) -> None:
        """Grow the static buffers to hold these inputs and output (warm-ups only: no capture
        is running)."""
        for i, t in enumerate(inputs):
            if i == len(self.inputs):
                self.inputs.append(torch.empty(0, dtype=t.dtype, device=self.device))
            if self.inputs[i].numel() < t.numel():
                self.inputs[i] = torch.zeros(t.numel(), dtype=t.dtype, device=self.device)
        if self.out.numel() < math.prod(out_shape):
            # zeros: the warm-ups feed this output on to the next layers (a MoE router included)
            self.out = torch.zeros(math.prod(out_shape), dtype=inputs[0].dtype, device=self.device)

    def _forward(self, tokens: int, split: Callable[..., torch.Tensor]) -> torch.Tensor:
        md = AttentionMetadata(
            num_actual_tokens=tokens, num_seqs=0, query_start_loc=self.slot_mapping[:0],
            seq_lens=self.slot_mapping[:0], block_tables=self.slot_mapping[:0].view(0, 0),
            slot_mapping=self.slot_mapping[:tokens], max_query_len=0, max_seq_len=0,
            num_decodes=0, num_decode_tokens=0, split=split)
        # the pieces write each group's K/V through its static slot mapping; attention
        # (between them) reads the step's own metadata, its groups included
        md = self._with_groups(md, 0, tokens)
        return self.model(self.input_ids[:tokens], self.positions[:tokens], md)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every bucket's pieces, largest first, into ``pool``; returns the pool."""

        def warm(run: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                 out_shape: tuple[int, ...]) -> torch.Tensor:  # no attention run
            self._size(inputs, out_shape)
            return self._view(self.out, out_shape)

        stream = torch.cuda.Stream(self.device)
        for tokens in reversed(self.token_buckets):
            for _ in range(2):  # kernels compile, the allocator settles, the buffers are sized
                self._forward(tokens, warm)
            torch.cuda.synchronize(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                pool = self._capture_pieces(tokens, pool)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        return pool

    def _capture_pieces(self, tokens: int, pool: Any) -> Any:
        """One bucket's pieces (on a side stream); returns the pool (the first piece's if None)."""
        pieces = [torch.cuda.CUDAGraph()]
        calls: list[_Call] = []
        pieces[0].capture_begin(pool=pool)

        def split(run: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                  out_shape: tuple[int, ...]) -> torch.Tensor:
            nonlocal pool
            static = tuple(self._view(self.inputs[i], tuple(t.shape)) for i, t in enumerate(inputs))
            for s, t in zip(static, inputs, strict=True):
                s.copy_(t)
            pieces[-1].capture_end()
            if pool is None:
                pool = pieces[-1].pool()
            out = self._view(self.out, out_shape)
            calls.append((run, static, out))
            pieces.append(torch.cuda.CUDAGraph())
            pieces[-1].capture_begin(pool=pool)
            return out

        try:
            hidden = self._forward(tokens, split)
        except BaseException:  # end the open capture, or the stream stays in capture mode
            with contextlib.suppress(Exception):
                pieces[-1].capture_end()
            raise
        pieces[-1].capture_end()
        self.pieces[tokens], self.calls[tokens], self.hidden[tokens] = pieces, calls, hidden
        return pool if pool is not None else pieces[0].pool()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """A step of ``md.num_actual_tokens`` <= the largest bucket tokens -> its hidden
        states [num_actual_tokens, hidden]."""
        n = md.num_actual_tokens
        tokens = self.bucket(n)
        assert tokens is not None
        self._load(input_ids, positions, md.slot_mapping, tokens, md)
        if tokens not in self.pieces:  # not captured: the padded step, each core eagerly
            return self._forward(tokens, lambda run, inputs, out_shape: run(md, *inputs))[:n]
        pieces, calls = self.pieces[tokens], self.calls[tokens]
        for i, piece in enumerate(pieces):
            piece.replay()
            if i < len(calls):
                run, inputs, out = calls[i]
                out[:n].copy_(run(md, *inputs)[:n])
        return self.hidden[tokens][:n]
