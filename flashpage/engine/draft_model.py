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
distributed as the target's. The draft runs eagerly (no CUDA graphs). Structured-outputs
requests are not drafted by it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from flashpage.attention.backend import AttentionBackend, AttentionMetadata
from flashpage.config import ModelConfig
from flashpage.engine.model_runner import _table_width
from flashpage.engine.sampler import row_argmax
from flashpage.engine.spec_decode import SEED_MIX, NgramProposer, SpeculativeConfig, processed_probs
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


class DraftRunner:
    """The draft model, its K/V pool (the target's block ids) and its forwards."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, backend: AttentionBackend,
                 kv_manager: KVCacheManager, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype, vocab_size: int) -> None:
        self.model, self.config, self.backend = model, model_config, backend
        self.kv_manager, self.block_size, self.device = kv_manager, block_size, device
        self.vocab_size = vocab_size
        backend.bind_kv_cache(num_blocks, block_size)
        for layer in model.attention_layers():  # type: ignore[operator]
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache = (torch.zeros(shape, dtype=kv_dtype, device=device),
                              torch.zeros(shape, dtype=kv_dtype, device=device))
            layer.backend = backend

    def table(self, req: Request) -> np.ndarray:
        return np.asarray(self.kv_manager.get_block_ids(req.request_id), dtype=np.int64)

    @torch.inference_mode()
    def forward(self, rows: list[_Row], want: list[int],
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward over ``rows`` (each row's tokens appended to its context);
        the fp32 next-token logits [len(want), vocab] after the last token of each row in
        ``want`` (row indices). ``input_ids``: the tokens on the device instead of the rows'
        (rows of one token each: the last forward's drafts, not read back)."""
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
        t = torch.from_numpy(buf)
        dev = t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" \
            else t.to(self.device)
        d_ids, d_pos, d_slots, d_qsl, d_seq, d_logits, d_tables = (dev[offs[i]:offs[i + 1]] for i in range(7))
        if input_ids is not None:
            assert len(input_ids) == total and total == n, "device input ids are one token a row"
            d_ids = input_ids
        num_decodes = int((lens == 1).sum())
        md = AttentionMetadata(
            num_actual_tokens=total, num_seqs=n,
            query_start_loc=d_qsl.to(torch.int32), seq_lens=d_seq.to(torch.int32),
            block_tables=d_tables.view(n, width).to(torch.int32), slot_mapping=d_slots,
            max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()),
            num_decodes=num_decodes, num_decode_tokens=num_decodes,
            query_lens_cpu=lens.tolist(), seq_lens_cpu=seq_lens.tolist())
        md = self.backend.prepare(md)
        hidden = self.model(d_ids, d_pos, md)
        logits = self.model.compute_logits(hidden[d_logits])  # type: ignore[operator]
        return logits[:, :self.vocab_size].float()


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
        return []  # the draft's tokens are not known before scheduling: not drafted

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
        active = [rows[i].req for i in drafting]
        for req in active:
            req.spec_probs = None if req.sampling_params.greedy else torch.empty(
                len(req.spec_token_ids), runner.vocab_size, device=runner.device)
        logits = runner.forward(rows, drafting)
        if not active:  # only catching up (prompt chunks, requests not drafting)
            return
        tokens = self._pick(logits, active, 0)
        picked = [(active, tokens)]
        # drafts 2 .. k: one token each, at the slots the scheduler gave the drafts; each
        # forward's input is the last one's drafts, left on the device (read back once)
        tables = {rows[i].req.request_id: rows[i].table for i in drafting}
        for j in range(1, max((len(r.spec_token_ids) for r in active), default=0)):
            keep = [i for i, r in enumerate(active) if len(r.spec_token_ids) > j]
            if len(keep) < len(active):
                active = [active[i] for i in keep]
                tokens = tokens.index_select(0, torch.tensor(keep, device=tokens.device))
            step = [_Row(r, r.num_tokens + j - 1, [_PLACEHOLDER_DRAFT], tables[r.request_id])
                    for r in active]
            tokens = self._pick(runner.forward(step, list(range(len(step))), tokens), active, j)
            picked.append((active, tokens))
        values = torch.cat([t for _, t in picked]).tolist()
        i = 0
        for j, (reqs, _) in enumerate(picked):
            for r in reqs:
                r.spec_token_ids[j] = values[i]
                i += 1

    @staticmethod
    def _pick(logits: torch.Tensor, reqs: list[Request], j: int) -> torch.Tensor:
        """Draft ``j`` of each of ``reqs`` (on the device) from its row of ``logits``: the argmax for a
        greedy request; else drawn from the draft's distribution as the request samples
        (temperature, top-k/p, min-p), kept in ``spec_probs`` for the verifier; a seeded
        request's draw from its own stream (seed, output position), as the verifier's."""
        tokens = row_argmax(logits)
        sampled = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if sampled:
            rows = torch.tensor(sampled, device=logits.device)
            q = processed_probs(logits.index_select(0, rows),
                                [reqs[i].sampling_params for i in sampled], logits.shape[1])
            noise = torch.empty_like(q).exponential_()
            for n, i in enumerate(sampled):
                r = reqs[i]
                probs = r.spec_probs
                assert probs is not None
                probs[j] = q[n]
                seed = r.sampling_params.seed
                if seed is not None:
                    g = torch.Generator(device=q.device)
                    g.manual_seed((seed * SEED_MIX + r.num_output_tokens + j) % (1 << 63) ^ 0xD4A)
                    noise[n].exponential_(generator=g)
            tokens = tokens.index_copy(0, rows, row_argmax(q / noise))
        return tokens


def build_draft_proposer(config: SpeculativeConfig, source: ModelSource, target: ModelConfig,
                         model: nn.Module, backend: AttentionBackend, kv_manager: KVCacheManager,
                         num_blocks: int, block_size: int, device: torch.device,
                         kv_dtype: torch.dtype, max_model_len: int) -> DraftModelProposer:
    """The proposer over a loaded draft ``model`` (``source``'s), its pool allocated."""
    check_draft_config(source.config, target)
    runner = DraftRunner(model, source.config, backend, kv_manager, num_blocks, block_size,
                         device, kv_dtype, target.vocab_size)
    return DraftModelProposer(config, max_model_len, runner=runner)
