"""Speculative decoding with the checkpoint's multi-token-prediction layer (vLLM's
``{"method": "mtp", "num_speculative_tokens": k}``; GLM-4.5's or DeepSeek-V3's MTP layer: models/mtp.py).

The MTP layer's entry at position t reads the target's final hidden state h_t and the token
t + 1 and predicts token t + 2. It keeps a paged K/V cache of its one attention layer beside
the target's, as a draft model does (engine/draft_model.py): a second pool indexed by the
target's block ids and tables, so the target's scheduler, allocator and prefix cache do the
bookkeeping, and the memory profiler sizes a block by both.

The target's model runner keeps, while an MTP draft is configured, each step's final hidden
states (``DecoderStack.hidden_out``, a static buffer the CUDA graphs write too) and where each
request's tokens sit in them (``ModelRunner.last_layout``). A step (``MTPProposer.fill``,
after the scheduler ran, before the target's step):

1. before scheduling, ``propose`` gives each request that may draft ``room`` placeholder
   drafts, so the scheduler budgets and allocates slots for them;
2. one batched forward of the MTP layer over the positions the last target step computed
   that it lacks, for every request of that step still running (scheduled now or not):
   position p of a request needs h_p (right only below its computed count: a rejected
   draft's position is not) and token p + 1. While a request drafts, the engine reads each
   step back before scheduling the next (NgramProposer.wants_tokens, as for a draft model),
   so every token is known: at a decode the positions are the accepted drafts' and the
   bonus token's predecessors, ending at position T - 2 (T: the request's tokens); the
   logits there give draft 1 (token T). With nobody drafting (prompts, backed-off requests)
   the engine schedules asynchronously: a position whose next token is still being sampled
   has its hidden state copied aside (``_held``: the target's next step overwrites the
   buffer) and its entry computed at a later step, once the token is read back;
3. ``k - 1`` single-token forwards of the drafting requests: forward j feeds the layer's own
   output hidden state of the forward before (before ``shared_head.norm``) and draft j, at
   position T - 2 + j, its K/V into the slots the scheduler gave the drafts; the
   placeholders are overwritten in place.

Greedy requests draft the argmax; sampled ones draw from the layer's distribution q and are
checked by rejection sampling with it; structured-outputs requests under their pattern
(draft_model._DraftPicker, all as for a draft model). A drafting request whose h_{T-2} is not
at hand (it was not in the last step, nor held) drafts nothing this step
(``SchedulerOutput.cut_drafts``).

On CUDA the layer's forwards replay CUDA graphs of its own, as a draft model's do
(``MTPRunner``, DraftRunner's graphs over the layer and its pool, in the target's graph
pool, captured by LLMEngine._capture_draft_graphs): decode graphs at the target's batch
buckets for the k - 1 single-token forwards (and a catch-up of one position a request), and,
where its prompt path is sync-free (GLM-4.5's; not MLA's: DeepSeek-V3's catch-ups run
eagerly), catch-up graphs of up to 1 + k positions a request. The layer reads the previous
hidden states from a static buffer of each graph kind, filled before each replay. The graphs
end at the hidden states; the logits of the drafting rows are one eager GEMM.
``enforce_eager`` or a failed capture leaves the layer eager.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from flashpage.attention.backend import AttentionBackend, AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.engine.cuda_graph import PREFILL_MAX_TOKENS
from flashpage.engine.draft_model import DraftModelProposer, DraftRunner, _DraftPicker, _Row
from flashpage.engine.spec_decode import SpeculativeConfig
from flashpage.kv_cache.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from flashpage.engine.model_runner import ModelRunner
    from flashpage.engine.scheduler import SchedulerOutput
    from flashpage.engine.sequence import Request
    from flashpage.models.mtp import HiddenStateDraft


class MTPRunner(DraftRunner):
    """The MTP layer, its K/V pool (the target's block ids), its forwards and, once captured,
    its graphs (DraftRunner's: decode graphs for its single-token forwards, catch-up graphs
    where its prompt path is sync-free). A forward reads the previous hidden states from
    ``model.prev_hidden`` (one row a token, in the forward's token order) and leaves its
    output hidden states at the rows whose logits were asked for in ``hidden``; a forward
    that replays a graph first copies them into that graph kind's static buffer, which the
    layer read while it was captured."""

    model: HiddenStateDraft

    def __init__(self, model: HiddenStateDraft, model_config: ModelConfig, backend: AttentionBackend,
                 kv_manager: KVCacheManager, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype, vocab_size: int) -> None:
        super().__init__(model, model_config, backend, kv_manager, num_blocks, block_size,
                         device, kv_dtype, vocab_size)
        self.hidden: torch.Tensor | None = None
        self.static_prev: dict[str, torch.Tensor] = {}  # graph kind -> [rows, hidden]

    @contextmanager
    def _reading(self, kind: str, rows: int) -> Iterator[None]:
        """The layer reads a new static buffer of ``rows`` rows for graph ``kind`` while
        its graphs are built (and captured)."""
        dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        buf = torch.zeros(rows, self.config.hidden_size, dtype=dtype, device=self.device)
        self.static_prev[kind] = buf
        prev, self.model.prev_hidden = self.model.prev_hidden, buf
        try:
            yield
        finally:
            self.model.prev_hidden = prev

    def capture_graphs(self, max_bs: int, max_model_len: int, pool: Any = None, *,
                       capture: bool = True) -> Any:
        with self._reading("decode", max_bs):
            return super().capture_graphs(max_bs, max_model_len, pool, capture=capture)

    def capture_catchup_graphs(self, max_bs: int, max_model_len: int, tokens_per_seq: int,
                               pool: Any = None, *, capture: bool = True) -> Any:
        with self._reading("catchup", min(max_bs * tokens_per_seq, PREFILL_MAX_TOKENS)):
            return super().capture_catchup_graphs(max_bs, max_model_len, tokens_per_seq, pool,
                                                  capture=capture)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                rows: torch.Tensor | None) -> torch.Tensor:
        kind = self._graph_kind(md, rows)
        prev = self.model.prev_hidden
        if kind is not None:  # the previous hidden states where the graph reads them
            assert prev is not None
            static = self.static_prev[kind]
            static[:prev.shape[0]].copy_(prev)
            self.model.prev_hidden = static
        try:
            self.hidden = super()._hidden(input_ids, positions, md, rows)
        finally:
            self.model.prev_hidden = prev
        return self.hidden


@dataclass
class MTPProposer(DraftModelProposer):
    """Drafts from the target's MTP layer (the module doc); the drafting rules (who drafts,
    how many, back-off, when the engine reads a step back first) are NgramProposer's, the
    placeholders and their picking a draft model's."""

    target: ModelRunner | None = None
    hidden_states: torch.Tensor | None = None  # the target's DecoderStack.hidden_out
    # (request id -> next MTP position to compute: _done, DraftModelProposer's)
    # request id -> (request, p, hidden states [n, hidden]): its positions p .. p + n - 1,
    # computed by the target, whose next tokens were not known yet (async scheduling)
    _held: dict[str, tuple[Request, int, torch.Tensor]] = field(default_factory=dict)
    _skipped: int = field(default=0)  # drafting requests cut for want of h_{T-2} (tests)

    def propose(self, running: list[Request]) -> None:
        super().propose(running)
        live = {r.request_id for r in running}
        for rid in [r for r in self._held if r not in live]:
            del self._held[rid]

    def _spans(self, out: SchedulerOutput) -> list[tuple[Request, int, list[torch.Tensor]]]:
        """Each running request's positions whose entries the layer lacks and whose hidden
        states are at hand: its held ones, then those the target's last step computed (from
        where the held ones end) -> (request, first position, hidden-state pieces)."""
        states, target = self.hidden_states, self.target
        assert states is not None and target is not None
        gone = set(out.preempted_request_ids)  # their blocks are freed
        for rid in gone:
            self._done.pop(rid, None)
            self._held.pop(rid, None)
        spans: dict[str, tuple[Request, int, list[torch.Tensor]]] = {}
        for req, t, start, n in target.last_layout:
            rid = req.request_id
            if rid in gone or req.is_finished():
                continue
            held = self._held.pop(rid, None)
            seen = held[1] + held[2].shape[0] if held is not None else self._done.get(rid, start)
            lo, hi = max(start, seen), min(start + n, req.num_computed_tokens)
            if hi <= lo:
                if held is not None:
                    self._held[rid] = held
                continue
            piece = states[t + lo - start:t + hi - start]
            if held is not None and seen == lo:
                spans[rid] = (req, held[1], [held[2], piece])
            else:  # (none held, or a step the layer did not see between)
                spans[rid] = (req, lo, [piece])
        target.last_layout = []  # consumed
        for rid, (req, pos, rows) in list(self._held.items()):  # not in the last step
            del self._held[rid]
            if not req.is_finished():
                spans[rid] = (req, pos, [rows])
        return list(spans.values())

    def fill(self, out: SchedulerOutput) -> None:
        runner = self.runner
        assert isinstance(runner, MTPRunner)
        rows: list[_Row] = []
        hidden: list[torch.Tensor] = []
        ends: dict[str, int] = {}  # request id -> its row's end (positions < end computed)
        for req, lo, pieces in self._spans(out):
            rid = req.request_id
            hi = lo + sum(p.shape[0] for p in pieces)
            # position p needs token p + 1: past the known tokens (async scheduling: being
            # sampled) its hidden states are held for a later step
            end = min(hi, req.num_prompt_tokens + req.num_resolved_outputs - 1)
            h = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            if end < hi:
                self._held[rid] = (req, max(lo, end), h[max(end - lo, 0):].clone())
            if end <= lo:
                continue
            self._done[rid] = end
            ends[rid] = end
            rows.append(_Row(req, lo, req.all_token_ids[lo + 1:end + 1], runner.table(req)))
            hidden.append(h[:end - lo])
        # the drafting requests: their last entry, at T - 2, computed now
        active: list[Request] = []
        for req, _ in out.scheduled:
            if not req.spec_token_ids:
                continue
            if ends.get(req.request_id) == req.num_tokens - 1:
                active.append(req)
                continue
            self._skipped += 1  # h_{T-2} not at hand: no drafts this step
            n = out.cut_drafts(req, 0)
            runner.kv_manager.trim(req, req.num_computed_tokens + n)
            req.spec_probs = None
        if not rows:
            return
        # decodes (one token) first, as the runner's forward orders them (stable)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].tokens) != 1)
        rows = [rows[i] for i in order]
        hidden = [hidden[i] for i in order]
        where = {r.req.request_id: i for i, r in enumerate(rows)}
        # most drafts first: each single-token forward runs a prefix of them (decode_steps)
        active.sort(key=lambda r: -len(r.spec_token_ids))
        want = [where[r.request_id] for r in active]
        counts = [len(r.spec_token_ids) for r in active]
        picker = _DraftPicker(active, counts, runner.vocab_size, runner.device)
        # (an EAGLE-3 head projects the target's three states to one here: models/eagle.py)
        runner.model.prev_hidden = runner.model.from_target(
            torch.cat(hidden) if len(hidden) > 1 else hidden[0])
        try:
            logits = runner.forward(rows, want)
            if not active:  # only catching up
                return
            drafts = torch.zeros(counts[0], len(active), dtype=torch.int64, device=runner.device)
            picker.pick(logits, 0, drafts[0])
            if counts[0] > 1:  # draft j + 1 from position T - 2 + j, fed draft j and its hidden
                steps = runner.prepare_steps([r.num_tokens - 1 for r in active], counts,
                                             [rows[i].table for i in want])
                for j, m in enumerate(steps.rows):
                    assert runner.hidden is not None
                    runner.model.prev_hidden = runner.hidden[:m]
                    picker.pick(runner.step(steps, j, drafts[j, :m]), j + 1, drafts[j + 1, :m])
        finally:
            runner.model.prev_hidden = None
        self._place_drafts(out, runner, active, counts, picker.keep, drafts)


def build_mtp_proposer(config: SpeculativeConfig, layer: nn.Module, target_config: ModelConfig,
                       target: ModelRunner, hidden_states: torch.Tensor, backend: AttentionBackend,
                       kv_manager: KVCacheManager, num_blocks: int, block_size: int,
                       device: torch.device, kv_dtype: torch.dtype, max_model_len: int) -> MTPProposer:
    """The proposer over a loaded MTP ``layer`` (models/mtp.load_mtp) or EAGLE head
    (models/eagle.load_eagle: engine/eagle.py), its pool (of the layer's shape) allocated;
    the target's runner set to keep each step's layout."""
    from flashpage.models.mtp import HiddenStateDraft

    assert isinstance(layer, HiddenStateDraft)
    runner = MTPRunner(layer, layer.config, backend, kv_manager, num_blocks, block_size,
                       device, kv_dtype, target_config.vocab_size)
    target.keep_layout = True
    return MTPProposer(config, max_model_len, runner=runner, target=target,
                       hidden_states=hidden_states)


def mtp_kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """The MTP layer's K/V bytes a token (one layer of ``config``'s shape: the target's, an
    EAGLE head's own)."""
    return config.kv_bytes_per_token(kv_dtype, per_layer=True)


__all__ = ["MTPProposer", "MTPRunner", "build_mtp_proposer", "mtp_kv_bytes_per_token"]
