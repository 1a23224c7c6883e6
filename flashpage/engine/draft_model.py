"""Speculative decoding with a draft model (vLLM's ``{"model": PATH, "num_speculative_tokens": k}``).

A smaller model with the target's vocabulary proposes the drafts; the target checks them
exactly as it checks n-gram drafts (spec_decode.verify_drafts), so greedy requests get plain
decoding's tokens whatever the draft says.

The draft keeps its own paged K/V cache: a second pool indexed by the SAME block ids and
block tables as the target's (same block size, same number of blocks). The target's
scheduler, allocator and prefix cache do all the bookkeeping; a block holds the same
tokens in both pools::

    target pool  [num_blocks, B, Hkv,  D ]   block 7 = tokens 16..31 of request "a"
    draft pool   [num_blocks, B, Hkv', D']   block 7 = the same tokens, the draft's K/V

The memory profiler sizes a block by both models' bytes (LLMEngine._num_blocks).

A step, per scheduled request (``DraftModelProposer.fill``, after the scheduler ran and
before the target runs):

1. before scheduling, ``propose`` gives each request that may draft ``room`` placeholder
   drafts, so the scheduler budgets and allocates slots for them (it may cut them);
2. one batched forward of the draft over the tokens its cache lacks: the prompt chunk the
   target runs this step, or, at a decode, the tokens since its last pass (the accepted
   drafts and the bonus token of the last check; one token when it did not draft); its
   logits at a drafting request's last token give draft 1;
3. ``k - 1`` single-token forwards (one row per drafting request) give drafts 2 .. k, their
   K/V written to the slots the scheduler allocated for the drafts; the placeholders are
   overwritten in place, and the target runs its step with them.

Each request's ``done`` count (positions whose draft K/V is right) starts at its computed
tokens when first seen (a prefix-cache hit's blocks were written into both pools when first
computed) and never passes its resolved tokens: under async scheduling a token still being
sampled is caught up at a later step. A greedy request's drafts are the draft's argmax; a
sampled request's are drawn from the draft's distribution q processed as the request samples
(temperature, top-k, top-p, min-p), and the verifier accepts draft ``d`` with probability
min(1, p(d) / q(d)) and on rejection draws from max(p - q, 0), normalized: the output is
distributed as the target's.

A structured-outputs request is drafted under its pattern: each draft forward's logits at its
row are masked by the pattern's state after its drafts so far (advanced on the host, its
drafts read back after each forward), and its drafts end where the pattern allows nothing but
eos next (a greedy one's also where the draft picks eos). The scheduler gave it slots for
``room`` drafts before they were known; when fewer are kept, ``SchedulerOutput.cut_drafts``
shortens its tokens this step (the target checks only the real drafts, and its pattern states
come from them: the runner reads the drafts after ``fill``), the surplus slots staying with it
unused, as a rejected draft's.

The drafting requests go most drafts first, so each single-token forward runs a prefix of
them (``decode_steps``): the k - 1 forwards' inputs are built and copied once, each takes
the last one's drafts on the device, and the drafts are read back once a step (and the
guided requests' after each forward). On CUDA the
single-token forwards, and a catch-up of one token a request, replay decode CUDA graphs of
the draft's own (``DraftRunner.capture_graphs``: cuda_graph.DecodeGraphs over the draft
model and its pool, the target's batch buckets, in the target's graph pool). A catch-up of
up to 1 + k tokens a request (the accepted drafts and the bonus token, 1 .. k + 1 side by
side) replays catch-up graphs (``DraftRunner.capture_catchup_graphs``: cuda_graph.PrefillGraphs
with ``tokens_per_seq = 1 + k``, the shape of the target's verify steps: per batch bucket b
one graph of b request slots and b * (1 + k) tokens, up to 1024; every request through the
prompt kernel, padding rows writing no slot, padding slots without queries), where the
draft's backend has a sync-free prompt path. Both end at the hidden states; the logits of
the drafting rows are one eager GEMM (and the structured-outputs masks applied to them
after it: guided drafting runs on the graphs too). Off with ``enforce_eager``; a capture that fails
leaves the draft eager (the catch-up graphs' alone: its catch-ups). A catch-up over a prompt
chunk longer than 1 + k tokens runs eagerly (a short one fits the catch-up graphs).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from flashpage.attention.backend import AttentionBackend, AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.engine.cuda_graph import (
    PREFILL_MAX_TOKENS,
    DecodeGraphs,
    PrefillGraphs,
    batch_buckets,
)
from flashpage.engine.model_runner import _table_width
from flashpage.engine.sampler import row_argmax
from flashpage.engine.spec_decode import (
    SEED_MIX,
    NgramProposer,
    SpeculativeConfig,
    processed_probs,
    sampling_table,
)
from flashpage.kv_cache.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from flashpage.engine.scheduler import SchedulerOutput
    from flashpage.engine.sequence import Request
    from flashpage.models.loader import ModelSource

_PLACEHOLDER_DRAFT = 0  # a valid token id: what the scheduler sees until fill() runs


def check_draft_config(draft: ModelConfig, target: ModelConfig) -> None:
    """A ValueError unless ``draft`` can draft for ``target``: the same vocabulary size
    (its token ids are the target's), dense, MHA/GQA attention."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model has vocab_size {draft.vocab_size}, the target "
                         f"{target.vocab_size}: a draft model must share the target's vocabulary")
    if draft.is_mla or draft.n_routed_experts or draft.num_experts_per_tok:
        raise ValueError(f"speculative_config model ({draft.architecture}) must be dense with "
                         "MHA/GQA attention (MLA and MoE drafts are not supported)")


@dataclass
class _Row:
    """One request's tokens in a draft forward: ``tokens`` at positions ``start ..``."""

    req: Request
    start: int
    tokens: list[int]
    table: np.ndarray


def decode_steps(starts: list[int], counts: list[int], tables: list[np.ndarray], block_size: int
                 ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
    """The host inputs of a step's single-token forwards, over its drafting rows ordered most
    drafts first (``counts`` non-increasing, each >= 1): forward j (1 .. k - 1, k = counts[0])
    runs rows 0 .. m_j - 1, those with more than j drafts, row i's draft j at position
    ``starts[i] + j - 1`` (``starts``: each row's token count, draft 1's position) into the
    slot its table gives it there (the scheduler's, for the drafts)::

        counts [4, 4, 2]   m = [3, 2, 2]   forward 2 runs rows 0, 1 (row 2 is done)

    Returns (m_j for each forward, positions [k - 1, n], slots [k - 1, n], tables [n, width]
    padded with block 0); entries past a forward's rows are 0."""
    n, k = len(counts), counts[0]
    width = _table_width(max(len(t) for t in tables))
    table = np.zeros((n, width), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    rows = [sum(c > j for c in counts) for j in range(1, k)]
    positions = np.zeros((k - 1, n), dtype=np.int64)
    slots = np.zeros((k - 1, n), dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64)
    for j, m in enumerate(rows):
        pos = first[:m] + j
        positions[j, :m] = pos
        slots[j, :m] = table[np.arange(m), pos // block_size] * block_size + pos % block_size
    return rows, positions, slots, table


@dataclass
class _Steps:
    """``decode_steps``' inputs on the device, copied once for the k - 1 forwards."""

    rows: list[int]
    positions: torch.Tensor  # [k - 1, n] int64
    slots: torch.Tensor  # [k - 1, n] int64
    seq_lens: torch.Tensor  # [k - 1, n] int32
    query_start_loc: torch.Tensor  # [n + 1] int32: 0, 1, .., n
    tables: torch.Tensor  # [n, width] int32
    seq_lens_cpu: np.ndarray  # [k - 1, n]


class DraftRunner:
    """The draft model, its K/V pool (the target's block ids), its forwards and, once
    ``capture_graphs`` ran, its decode graphs (cuda_graph.DecodeGraphs over its own pool),
    once ``capture_catchup_graphs`` ran, its catch-up graphs (cuda_graph.PrefillGraphs of up
    to 1 + k tokens a request)."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, backend: AttentionBackend,
                 kv_manager: KVCacheManager, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype, vocab_size: int) -> None:
        self.model, self.config, self.backend = model, model_config, backend
        self.kv_manager, self.block_size, self.device = kv_manager, block_size, device
        self.vocab_size = vocab_size
        self.graphs: DecodeGraphs | None = None
        self.graph_forwards = 0  # forwards that went through the decode graphs
        self.catchup: PrefillGraphs | None = None
        self.catchup_forwards = 0  # catch-ups that went through the catch-up graphs
        backend.bind_kv_cache(num_blocks, block_size)
        for layer in model.attention_layers():  # type: ignore[operator]
            if getattr(layer, "is_mla", False):  # an MTP layer's MLA (engine/mtp.py): a latent
                layer.kv_cache = torch.zeros(layer.kv_cache_shape(num_blocks, block_size),
                                             dtype=kv_dtype, device=device)
            else:
                shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
                layer.kv_cache = (torch.zeros(shape, dtype=kv_dtype, device=device),
                                  torch.zeros(shape, dtype=kv_dtype, device=device))
            layer.backend = backend

    def capture_graphs(self, max_bs: int, max_model_len: int, pool: Any = None, *,
                       capture: bool = True) -> Any:
        """Decode graphs of batches up to ``max_bs`` in ``pool`` (the target's: they never run
        at once); returns the pool. They end at the hidden states: the logits of the rows
        wanted are computed eagerly (no [bucket, vocab] output kept per bucket). Set only once
        captured: a failed capture leaves the draft eager. ``capture=False``: the same padded
        static-buffer forwards, run eagerly (tests on the CPU)."""
        max_blocks = _table_width(-(-max_model_len // self.block_size))
        graphs = DecodeGraphs(self.model, max_bs, max_blocks, self.device, logits=False)
        if capture:
            pool = graphs.capture(pool)
        self.graphs = graphs
        return pool

    def capture_catchup_graphs(self, max_bs: int, max_model_len: int, tokens_per_seq: int,
                               pool: Any = None, *, capture: bool = True) -> Any:
        """Graphs of catch-ups of up to ``tokens_per_seq`` (1 + k) tokens a request (the
        accepted drafts and the bonus token): cuda_graph.PrefillGraphs over the draft model,
        one per batch bucket up to ``max_bs`` of bucket x ``tokens_per_seq`` tokens (up to
        1024), in ``pool`` (the target's); returns the pool. They end at the hidden states of
        the drafting requests' last tokens, as the decode graphs do. Set only once captured;
        ``capture=False``: the same padded forwards, run eagerly (tests on the CPU)."""
        max_blocks = _table_width(-(-max_model_len // self.block_size))
        max_tokens = min(PREFILL_MAX_TOKENS, getattr(self.model, "max_graph_tokens", None) or 1 << 30)
        graphs = PrefillGraphs(self.model, self.backend.prepare, max_tokens, max_blocks,
                               self.block_size, self.device, tuple(batch_buckets(max_bs)),
                               tokens_per_seq=tokens_per_seq, logits=False)
        if capture:
            pool = graphs.capture(pool)
        self.catchup = graphs
        return pool

    def table(self, req: Request) -> np.ndarray:
        return np.asarray(self.kv_manager.get_block_ids(req.request_id), dtype=np.int64)

    def _to_device(self, buf: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(buf)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" \
            else t.to(self.device)

    def _graph_kind(self, md: AttentionMetadata, rows: torch.Tensor | None) -> str | None:
        """Which graphs a forward of ``md`` replays: "decode" (one token a row, a bucket
        holds the batch), "catchup" (up to 1 + k tokens a request, logits rows asked for,
        a graph holds it) or None (eager)."""
        graphs, catchup = self.graphs, self.catchup
        if graphs is not None and md.num_decodes == md.num_seqs and graphs.bucket(md.num_seqs) is not None:
            return "decode"
        if (rows is not None and catchup is not None and catchup.tokens_per_seq is not None
                and md.max_query_len <= catchup.tokens_per_seq
                and catchup.key(md.num_seqs, md.num_actual_tokens) is not None):
            return "catchup"
        return None

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                rows: torch.Tensor | None) -> torch.Tensor:
        """The forward's hidden states at rows ``rows`` (None: all), replayed where a graph
        fits (``_graph_kind``)."""
        kind = self._graph_kind(md, rows)
        if kind == "decode":
            assert self.graphs is not None
            hidden = self.graphs.run(input_ids, positions, md, md.num_seqs)
            self.graph_forwards += 1
        elif kind == "catchup":
            assert self.catchup is not None and rows is not None
            self.catchup_forwards += 1
            return self.catchup.run(input_ids, positions, md, rows)  # rows ``rows`` already
        else:
            hidden = self.model(input_ids, positions, self.backend.prepare(md))
        return hidden if rows is None else hidden[rows]

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
             rows: torch.Tensor | None) -> torch.Tensor:
        """The forward (``_hidden``: replayed where a graph fits, the decode graphs for one
        token a row, the catch-up graphs for up to 1 + k) -> the logits of hidden rows
        ``rows`` (None: all) [rows, vocab], in the model's dtype (none wanted: no logits)."""
        hidden = self._hidden(input_ids, positions, md, rows)
        if not hidden.shape[0]:  # only catching up
            return hidden
        logits = self.model.compute_logits(hidden)  # type: ignore[operator]
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, :self.vocab_size].contiguous()
        return logits

    @torch.inference_mode()
    def forward(self, rows: list[_Row], want: list[int]) -> torch.Tensor:
        """One draft forward over ``rows`` (each row's tokens appended to its context);
        the next-token logits [len(want), vocab] after the last token of each row in
        ``want`` (row indices)."""
        bs, n = self.block_size, len(rows)
        # decodes (one token) first, as every backend expects
        order = sorted(range(n), key=lambda i: len(rows[i].tokens) != 1)
        lens = np.array([len(rows[i].tokens) for i in order], dtype=np.int64)
        total = int(lens.sum())
        width = _table_width(max(len(r.table) for r in rows))
        # one staging array, one copy to the device:
        # [input_ids | positions | slot_mapping | query_start_loc | seq_lens | logits rows | tables]
        sizes = [total, total, total, n + 1, n, len(want), n * width]
        offs = np.cumsum([0, *sizes])
        buf = np.zeros(int(offs[-1]), dtype=np.int64)
        ids, pos, slots, qsl, seq_lens, logits_idx, flat = (buf[offs[i]:offs[i + 1]] for i in range(7))
        tables = flat.reshape(n, width)
        np.cumsum(lens, out=qsl[1:])
        for j, i in enumerate(order):
            r = rows[i]
            a, b = int(qsl[j]), int(qsl[j + 1])
            ids[a:b] = r.tokens
            pos[a:b] = np.arange(r.start, r.start + len(r.tokens))
            seq_lens[j] = r.start + len(r.tokens)
            tables[j, :len(r.table)] = r.table
        slots[:] = tables[np.repeat(np.arange(n), lens), pos // bs] * bs + pos % bs
        where = {i: j for j, i in enumerate(order)}
        logits_idx[:] = [qsl[where[i] + 1] - 1 for i in want]
        dev = self._to_device(buf)
        d_ids, d_pos, d_slots, d_qsl, d_seq, d_logits, d_tables = (dev[offs[i]:offs[i + 1]] for i in range(7))
        num_decodes = int((lens == 1).sum())
        md = AttentionMetadata(
            num_actual_tokens=total, num_seqs=n,
            query_start_loc=d_qsl.to(torch.int32), seq_lens=d_seq.to(torch.int32),
            block_tables=d_tables.view(n, width).to(torch.int32), slot_mapping=d_slots,
            max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()),
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            query_lens_cpu=lens.tolist(), seq_lens_cpu=seq_lens.tolist())
        return self._run(d_ids, d_pos, md, d_logits)

    def prepare_steps(self, starts: list[int], counts: list[int], tables: list[np.ndarray]) -> _Steps:
        """``decode_steps``' inputs on the device, in one copy."""
        rows, positions, slots, table = decode_steps(starts, counts, tables, self.block_size)
        n = len(counts)
        seq_lens = positions + 1
        # [positions | slots | seq_lens | query_start_loc | tables]: the last three int32
        buf = np.concatenate([positions.ravel(), slots.ravel(), seq_lens.ravel(),
                              np.arange(n + 1, dtype=np.int64), table.ravel()])
        dev = self._to_device(buf)
        jn = positions.size
        i32 = dev[2 * jn:].to(torch.int32)
        return _Steps(rows, dev[:jn].view(positions.shape), dev[jn:2 * jn].view(positions.shape),
                      i32[:jn].view(positions.shape), i32[jn:jn + n + 1],
                      i32[jn + n + 1:].view(table.shape), seq_lens)

    @torch.inference_mode()
    def step(self, steps: _Steps, j: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Single-token forward ``j + 1`` of ``steps`` over its first ``steps.rows[j]`` rows,
        whose input tokens (the last forward's drafts) stay on the device -> logits [m, vocab]."""
        m = steps.rows[j]
        lens = steps.seq_lens_cpu[j, :m]
        md = AttentionMetadata(
            num_actual_tokens=m, num_seqs=m, query_start_loc=steps.query_start_loc[:m + 1],
            seq_lens=steps.seq_lens[j, :m], block_tables=steps.tables[:m],
            slot_mapping=steps.slots[j, :m], max_query_len=1, max_seq_len=int(lens.max()),
            num_decodes=m, num_decode_tokens=m, query_lens_cpu=[1] * m, seq_lens_cpu=lens.tolist())
        return self._run(input_ids, steps.positions[j, :m], md, None)


class _DraftPicker:
    """Draws the drafts of a step's drafting requests (most drafts first) from each forward's
    logits: the argmax for a greedy request; else drawn from the draft's distribution as the
    request samples (temperature, top-k/p, min-p), kept in its ``spec_probs`` (a view of one
    [sampled, k, vocab] tensor) for the verifier; a seeded request's draw from its own stream
    (seed, output position), as the verifier's. Without structured-outputs requests everything
    a forward needs is on the device before the first: no copy between forwards.

    A structured-outputs request's row of each forward is masked by its pattern's state after
    its drafts so far (advanced on the host: its drafts are read back after each forward, a
    few ints), so every draft is one the pattern allows. Its drafts end (``keep``) where the
    pattern allows nothing but eos next, and, greedy, where the draft's pick is eos (it may
    pick eos where the pattern may end; the target's own row after the last draft then
    decides). A sampled request's draft never picks eos (its q, masked without it, is what
    the verifier checks against): cutting where a drawn draft is eos would skew its output,
    cutting on the state after the drafts before does not."""

    def __init__(self, reqs: list[Request], counts: list[int], vocab: int, device: torch.device) -> None:
        self.reqs, self.vocab = reqs, vocab
        self.sampled = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        self.params = [reqs[i].sampling_params for i in self.sampled]
        if self.sampled:
            self.rows = torch.tensor(self.sampled, device=device)
            self.table = sampling_table(self.params, vocab, device)
            self.q = torch.empty(len(self.sampled), counts[0], vocab, device=device)
            for s, i in enumerate(self.sampled):
                reqs[i].spec_probs = self.q[s, :counts[i]]
        self.keep = list(counts)  # the drafts each request keeps (a guided one's may end early)
        # guided request (index) -> its pattern's state after its drafts so far
        self.states: dict[int, int] = {}
        for i, r in enumerate(reqs):
            if r.guide is not None:
                self.states[i] = r.guide.state
                if not r.guide.guide.can_continue(r.guide.state):  # (it would have finished)
                    self.keep[i] = 0

    def pick(self, logits: torch.Tensor, j: int, out: torch.Tensor) -> None:
        """Draft ``j + 1`` of the first ``len(logits)`` requests into ``out`` [len(logits)]
        (on the device) from their rows of ``logits``."""
        m = logits.shape[0]
        guided = [i for i in self.states if i < m and self.keep[i] > j]
        if guided:
            logits = self._mask(logits, guided)
        out.copy_(row_argmax(logits))
        n = bisect.bisect_left(self.sampled, m)  # the sampled requests among the first m
        if n:
            rows = self.rows[:n]
            q = processed_probs(logits.index_select(0, rows).float(), self.params[:n], self.vocab,
                                self.table[:n])
            self.q[:n, j] = q
            noise = torch.empty_like(q).exponential_()
            for s in range(n):
                r = self.reqs[self.sampled[s]]
                seed = r.sampling_params.seed
                if seed is not None:
                    g = torch.Generator(device=q.device)
                    g.manual_seed((seed * SEED_MIX + r.num_output_tokens + j) % (1 << 63) ^ 0xD4A)
                    noise[s].exponential_(generator=g)
            out.index_copy_(0, rows, row_argmax(q / noise))
        if guided:
            self._advance(guided, j, out)

    def _mask(self, logits: torch.Tensor, guided: list[int]) -> torch.Tensor:
        """A copy of ``logits`` with each guided row's tokens its pattern does not allow next
        at -inf (eos allowed only to a greedy request, where the pattern may end)."""
        masks = []
        for i in guided:
            r = self.reqs[i]
            gs = r.guide
            assert gs is not None
            masks.append(gs.guide.mask(self.states[i], gs.allow_eos and r.sampling_params.greedy,
                                       logits.device))
        index = torch.tensor(guided, dtype=torch.long).to(logits.device)
        return logits.index_copy(0, index, logits.index_select(0, index).masked_fill_(
            ~torch.stack(masks)[:, :logits.shape[1]], float("-inf")))

    def _advance(self, guided: list[int], j: int, out: torch.Tensor) -> None:
        """The guided requests' states past their draft ``j + 1`` (read back): a request's
        drafts end before an eos (the pattern's next_state 0) and after a draft past which
        the pattern allows nothing but eos."""
        got = out[torch.tensor(guided, dtype=torch.long).to(out.device)].tolist()
        for i, t in zip(guided, got, strict=True):
            gs = self.reqs[i].guide
            assert gs is not None
            state = gs.guide.next_state(self.states[i], t)
            if not state:
                self.keep[i] = j
                continue
            self.states[i] = state
            if not gs.guide.can_continue(state):
                self.keep[i] = min(self.keep[i], j + 1)


@dataclass
class DraftModelProposer(NgramProposer):
    """Drafts from a draft model (the module doc); the drafting rules (who drafts, how many,
    back-off) are NgramProposer's."""

    runner: DraftRunner | None = None
    # request id -> positions whose K/V in the draft's pool is right (0 .. done - 1)
    _done: dict[str, int] = field(default_factory=dict)

    def draft(self, req: Request, k: int) -> list[int]:
        return [_PLACEHOLDER_DRAFT] * k  # computed in fill(), once the slots exist

    def fit_guide(self, req: Request, drafts: list[int]) -> list[int]:
        return drafts  # drawn in fill() under the pattern's masks, cut there where it ends

    def _place_drafts(self, out, runner, active, counts, keep, drafts) -> None:
        """Each drafting request's drafts (a column of ``drafts``) into its scheduled
        placeholders; where a guided request's pattern ended early (``keep`` < its count),
        the step's unused drafts are cut and their KV slots given back."""
        for req, c, k, got in zip(active, counts, keep, drafts.T.tolist(), strict=True):
            req.spec_token_ids[:] = got[:c]  # the placeholders, in place
            if k < c:  # a guided request's pattern ended: fewer tokens than scheduled
                n = out.cut_drafts(req, k)
                runner.kv_manager.trim(req, req.num_computed_tokens + n)
                if not k and self.backoff is not None:
                    self.backoff.record(req.request_id, False)

    def propose(self, running: list[Request]) -> None:
        for req in running:
            req.spec_probs = None
        super().propose(running)
        live = {r.request_id for r in running}
        for rid in [r for r in self._done if r not in live]:
            del self._done[rid]

    def fill(self, out: SchedulerOutput) -> None:
        runner = self.runner
        assert runner is not None
        for rid in out.preempted_request_ids:  # its blocks are gone
            self._done.pop(rid, None)
        rows: list[_Row] = []
        drafting: list[int] = []  # indices into rows
        for req, n in out.scheduled:
            start = min(self._done.get(req.request_id, req.num_computed_tokens), req.num_computed_tokens)
            known = req.num_prompt_tokens + req.num_resolved_outputs  # past it: being sampled
            end = min(req.num_computed_tokens + n, known)
            if end <= start:
                continue
            self._done[req.request_id] = end
            if req.spec_token_ids:
                assert end == req.num_tokens, "a drafting request's tokens are all known"
                drafting.append(len(rows))
            rows.append(_Row(req, start, req.all_token_ids[start:end], runner.table(req)))
        if not rows:
            return
        # most drafts first: each single-token forward runs a prefix of them (decode_steps)
        drafting.sort(key=lambda i: -len(rows[i].req.spec_token_ids))
        active = [rows[i].req for i in drafting]
        counts = [len(r.spec_token_ids) for r in active]
        picker = _DraftPicker(active, counts, runner.vocab_size, runner.device)
        logits = runner.forward(rows, drafting)
        if not active:  # only catching up (prompt chunks, requests not drafting)
            return
        # drafts[j, i]: draft j + 1 of active[i]; each forward's input is the last one's
        # drafts, left on the device (read back once, below)
        drafts = torch.zeros(counts[0], len(active), dtype=torch.int64, device=runner.device)
        picker.pick(logits, 0, drafts[0])
        if counts[0] > 1:  # drafts 2 .. k: at the slots the scheduler gave the drafts
            steps = runner.prepare_steps([r.num_tokens for r in active], counts,
                                         [rows[i].table for i in drafting])
            for j, m in enumerate(steps.rows):
                picker.pick(runner.step(steps, j, drafts[j, :m]), j + 1, drafts[j + 1, :m])
        self._place_drafts(out, runner, active, counts, picker.keep, drafts)


def build_draft_proposer(config: SpeculativeConfig, source: ModelSource, target: ModelConfig,
                         model: nn.Module, backend: AttentionBackend, kv_manager: KVCacheManager,
                         num_blocks: int, block_size: int, device: torch.device,
                         kv_dtype: torch.dtype, max_model_len: int) -> DraftModelProposer:
    """The proposer over a loaded draft ``model`` (``source``'s), its pool allocated."""
    check_draft_config(source.config, target)
    runner = DraftRunner(model, source.config, backend, kv_manager, num_blocks, block_size,
                         device, kv_dtype, target.vocab_size)
    return DraftModelProposer(config, max_model_len, runner=runner)
