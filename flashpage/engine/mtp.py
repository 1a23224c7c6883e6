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
   draft's position is not) and token p + 1 (known: the engine reads every step back before
   scheduling the next while an MTP draft is configured). At a decode that is the accepted
   drafts and the bonus token's predecessors, ending at position T - 2 (T: the request's
   tokens); the logits there give draft 1 (token T);
3. ``k - 1`` single-token forwards of the drafting requests: forward j feeds the layer's own
   output hidden state of the forward before (before ``shared_head.norm``) and draft j, at
   position T - 2 + j, its K/V into the slots the scheduler gave the drafts; the
   placeholders are overwritten in place.

Greedy requests draft the argmax; sampled ones draw from the layer's distribution q and are
checked by rejection sampling with it; structured-outputs requests under their pattern
(draft_model._DraftPicker, all as for a draft model). A drafting request whose h_{T-2} is not
at hand (it was not in the last step) drafts nothing this step (``SchedulerOutput.cut_drafts``).
The layer runs eagerly (no CUDA graphs of its own yet); the target keeps its graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from flashpage.attention.backend import AttentionBackend, AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.engine.draft_model import DraftModelProposer, DraftRunner, _DraftPicker, _Row
from flashpage.engine.spec_decode import SpeculativeConfig
from flashpage.kv_cache.kv_cache_manager import KVCacheManager

if TYPE_CHECKING:
    from flashpage.engine.model_runner import ModelRunner
    from flashpage.engine.scheduler import SchedulerOutput
    from flashpage.engine.sequence import Request
    from flashpage.models.mtp import MTPLayer


class MTPRunner(DraftRunner):
    """The MTP layer, its K/V pool (the target's block ids) and its forwards (eager). A
    forward reads the previous hidden states from ``model.prev_hidden`` (one row a token,
    in the forward's token order) and leaves its output hidden states at the rows whose
    logits were asked for in ``hidden``."""

    model: MTPLayer

    def __init__(self, model: MTPLayer, model_config: ModelConfig, backend: AttentionBackend,
                 kv_manager: KVCacheManager, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype, vocab_size: int) -> None:
        super().__init__(model, model_config, backend, kv_manager, num_blocks, block_size,
                         device, kv_dtype, vocab_size)
        self.hidden: torch.Tensor | None = None

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
             rows: torch.Tensor | None) -> torch.Tensor:
        hidden = self.model(input_ids, positions, self.backend.prepare(md))
        if rows is not None:
            hidden = hidden[rows]
        self.hidden = hidden
        if not hidden.shape[0]:
            return hidden
        logits = self.model.compute_logits(hidden)
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, :self.vocab_size].contiguous()
        return logits


@dataclass
class MTPProposer(DraftModelProposer):
    """Drafts from the target's MTP layer (the module doc); the drafting rules (who drafts,
    how many, back-off) are NgramProposer's, the placeholders and their picking a draft
    model's."""

    target: ModelRunner | None = None
    hidden_states: torch.Tensor | None = None  # the target's DecoderStack.hidden_out
    # (request id -> next MTP position to compute: _done, DraftModelProposer's)
    _skipped: int = field(default=0)  # drafting requests cut for want of h_{T-2} (tests)

    def wants_tokens(self, running: list[Request]) -> bool:
        """Always while a request runs: the layer's entry at p needs token p + 1, so every
        step is read back before the next is scheduled."""
        return bool(running)

    def fill(self, out: SchedulerOutput) -> None:
        runner, target, states = self.runner, self.target, self.hidden_states
        assert isinstance(runner, MTPRunner) and target is not None and states is not None
        gone = set(out.preempted_request_ids)  # their blocks are freed
        for rid in gone:
            self._done.pop(rid, None)
        rows: list[_Row] = []
        hidden: list[torch.Tensor] = []
        ends: dict[str, int] = {}  # request id -> its row's end (positions < end computed)
        for req, t, start, n in target.last_layout:
            rid = req.request_id
            if rid in gone or req.is_finished():
                continue
            lo = max(start, self._done.get(rid, start))
            known = req.num_prompt_tokens + req.num_resolved_outputs
            hi = min(start + n, req.num_computed_tokens, known - 1)
            if hi <= lo:
                continue
            self._done[rid] = hi
            ends[rid] = hi
            rows.append(_Row(req, lo, req.all_token_ids[lo + 1:hi + 1], runner.table(req)))
            hidden.append(states[t + lo - start:t + hi - start])
        target.last_layout = []  # consumed
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
        runner.model.prev_hidden = torch.cat(hidden) if len(hidden) > 1 else hidden[0]
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
    """The proposer over a loaded MTP ``layer`` (models/mtp.load_mtp), its pool allocated;
    the target's runner set to keep each step's layout."""
    from flashpage.models.mtp import MTPLayer

    assert isinstance(layer, MTPLayer)
    runner = MTPRunner(layer, target_config, backend, kv_manager, num_blocks, block_size,
                       device, kv_dtype, target_config.vocab_size)
    target.keep_layout = True
    return MTPProposer(config, max_model_len, runner=runner, target=target,
                       hidden_states=hidden_states)


def mtp_kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """The MTP layer's K/V bytes a token (one layer of the target's shape)."""
    return config.kv_bytes_per_token(kv_dtype, per_layer=True)


__all__ = ["MTPProposer", "MTPRunner", "build_mtp_proposer", "mtp_kv_bytes_per_token"]
