"""Iteration-level continuous batching with chunked prefill and preemption.

Each step has a token budget (``max_num_batched_tokens``) and a cap on running requests
(``max_num_seqs``). There is no prefill or decode phase:

1. Running requests, in admission order, each get ``min(remaining tokens, budget left)``
   (usually 1; a request still in chunked prefill gets its next chunk; never more than
   ``long_prefill_token_threshold``, vLLM's, when it is set). If one cannot
   get a block, the most recently admitted running request is preempted (blocks freed,
   ``num_computed_tokens = 0``, status PREEMPTED, put at the HEAD of the waiting queue;
   recomputed later from ``all_token_ids``, so its output never changes) until it can,
   or until it is itself the one preempted. Requests already scheduled in this step are
   never preempted (they come earlier in admission order).
2. If nothing was preempted, waiting requests (FIFO) fill what is left of the budget,
   chunked if they do not fit, while ``len(running) < max_num_seqs``. A waiting request
   is admitted only if its blocks (after prefix hits) can be had; otherwise admission
   stops for this step (FIFO: the head is never overtaken). No preemption here, which
   keeps same-step prefix hits safe. With ``max_loras`` (LoRA), the running requests hold
   at most that many distinct adapters: a waiting request whose adapter would be one too
   many is passed over (it keeps its place) and the ones after it may go, as vLLM's.

With ``policy="priority"`` (vLLM's ``--scheduling-policy priority``) both queues are kept
sorted by ``Request.queue_order`` (priority, lower first; then arrival): a preempted request
goes back to its place in that order, not to the head, and "the most recently admitted
running request" above becomes the lowest-priority, latest-arriving one (the last of
``running``), never one already scheduled in the step since running requests get their
tokens in that order too. One more rule: before a running request gets its tokens, the
first waiting request (the adapter rule above applies) whose priority is strictly higher
(a lower value) is admitted ahead of it; if it lacks a seat or blocks, running requests it
outranks are preempted, the lowest first, until it fits (only when it would fit with all
of theirs freed; none of them has been scheduled yet in the step, so nobody has taken a
prefix hit on blocks they were to write). Ties never preempt, so equal priorities cannot
evict each other back and forth.

A prompt with a ``bidirectional`` multimodal input (Gemma 3's images: its positions attend
to each other both ways) is never cut inside one (``chunk_tokens``): the chunk ends before
it, or, when the input began before the chunk (a prefix-cache hit inside it), the request
waits for a step whose budget holds the input's rest; add_request refuses an input longer
than a chunk may be.

``schedule()`` does NOT advance ``num_computed_tokens`` (except that an admitted
request's counter is set to its prefix-cache hit): the tokens scheduled for request r
are positions ``[r.num_computed_tokens, r.num_computed_tokens + n)``, and r needs a
sampled token exactly when that range ends at ``r.num_tokens``.
``update_from_output`` advances the counters and appends sampled tokens.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from flashpage.engine.sequence import Request, RequestRefused, RequestStatus
from flashpage.kv_cache.hybrid import HybridKVCacheManager
from flashpage.kv_cache.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]  # (request, num_new_tokens), in schedule order
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # freed since last schedule()
    new_request_ids: list[str] = field(default_factory=list)  # admitted (or resumed) this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def cut_drafts(self, req: Request, keep: int) -> int:
        """Keep only ``req``'s first ``keep`` drafts, after it was scheduled with all of them
        (a draft model's structured-outputs drafts end where the pattern does, known only once
        drafted: engine/draft_model.py). Its tokens this step and the step's total shrink by
        the rest; the slots allocated for them stay with the request, unused, as a rejected
        draft's do. Returns its tokens this step now."""
        if not 0 <= keep <= len(req.spec_token_ids):
            raise ValueError(f"request {req.request_id!r}: cannot keep {keep} of its "
                             f"{len(req.spec_token_ids)} drafts")
        i = next(i for i, (r, _) in enumerate(self.scheduled) if r is req)
        cut = len(req.spec_token_ids) - keep
        n = self.scheduled[i][1] - cut
        self.scheduled[i] = (req, n)
        self.total_num_scheduled_tokens -= cut
        del req.spec_token_ids[keep:]
        return n


SCHEDULING_POLICIES = ("fcfs", "priority")


def check_scheduling_policy(policy: object) -> str:
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be fcfs or priority, got {policy!r}")
    return str(policy)


def check_priority(priority: object, policy: str) -> None:
    """A ValueError unless ``priority`` is an integer an engine under ``policy`` takes: any
    under the priority scheduling policy, 0 only under fcfs (vLLM's rule and words)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority and policy != "priority":
        raise ValueError(f"Got priority {priority} but priority scheduling is not enabled: "
                         "start the engine with scheduling_policy='priority' "
                         "(--scheduling-policy priority)")


def _order(req: Request) -> tuple[int, float, int]:
    return req.queue_order


def chunk_tokens(req: Request, start: int, num_new: int) -> int:
    """How many of ``num_new`` tokens from position ``start`` ``req`` may compute so that
    the chunk ends inside none of its ``bidirectional`` multimodal inputs: cut back to the
    first such input it would end inside, or 0 when that input began at or before
    ``start`` (its rest must come in one chunk: a later step with more budget)."""
    end = start + num_new
    for mi in req.mm_inputs or ():
        if mi.bidirectional and mi.offset < end < mi.offset + mi.length:
            if mi.offset <= start:
                return 0
            end = mi.offset
            break
    return end - start


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 kv_cache_manager: KVCacheManager | HybridKVCacheManager, watermark: float = 0.0,
                 max_loras: int = 0, policy: str = "fcfs",
                 long_prefill_token_threshold: int = 0) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        self.policy = check_scheduling_policy(policy)
        self._by_priority = policy == "priority"
        self._num_added = 0  # the tie-break of queue_order: requests equal in all else
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # at most this many tokens of one request a step (0: the budget): long prompts share
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: off)")
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.kv_cache_manager = kv_cache_manager
        # Admission keeps this many blocks free for the running requests to grow into, so
        # a full pool does not turn the next steps' growth into preemptions (recompute).
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark_blocks = int(watermark * kv_cache_manager.num_blocks)
        # LoRA: the most distinct adapters among running requests (the engine's slots); 0: no cap
        self.max_loras = max_loras
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()  # fcfs: arrival order; priority: queue_order
        self.running: list[Request] = []  # fcfs: admission order; priority: queue_order
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        self.num_steps = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def max_total_tokens(self, request: Request) -> int:
        """The most tokens the request can ever hold (prompt + outputs at finish)."""
        max_out = request.max_tokens
        cap = max(self.max_model_len, request.num_prompt_tokens + 1)
        if max_out is None:
            return cap
        return min(request.num_prompt_tokens + max_out, cap)

    # ----------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRefused if it can never run."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        n = request.num_prompt_tokens
        if n < 1:
            raise RequestRefused(f"request {rid!r}: the prompt is empty")
        if n > self.max_model_len:
            raise RequestRefused(
                f"request {rid!r}: prompt of {n} tokens is longer than max_model_len "
                f"({self.max_model_len})"
            )
        kv = self.kv_cache_manager
        # The last token at finish is sampled, never written: positions 0 .. total-2.
        most_written = max(n, self.max_total_tokens(request) - 1)
        need = kv.max_blocks_held(most_written, self.max_num_batched_tokens)
        if need > kv.num_usable_blocks:
            raise RequestRefused(
                f"request {rid!r}: up to {most_written} tokens need {need} KV blocks of "
                f"{kv.block_size} tokens at once, but the whole cache has only "
                f"{kv.num_usable_blocks} blocks"
            )
        whole = max((mi.length for mi in request.mm_inputs or () if mi.bidirectional), default=0)
        if whole > self.chunk_cap:
            raise RequestRefused(
                f"request {rid!r}: an image of {whole} positions attends within itself "
                f"both ways and must be computed in one chunk, but a chunk holds at most "
                f"{self.chunk_cap} tokens (max_num_batched_tokens / long_prefill_token_threshold)")
        request.status = RequestStatus.WAITING
        request.queue_order = (request.priority, request.arrival_time, self._num_added)
        self._num_added += 1
        self.requests[rid] = request
        if self._by_priority:
            bisect.insort(self.waiting, request, key=_order)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus) -> list[Request]:
        """Finish requests (stop strings, abort) and free their blocks at once.

        Unknown or already finished ids are ignored.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done: list[Request] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.drop_unresolved()
        req.status = status
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[str] = []
        new_ids: list[str] = []
        running = self.running
        outranking = self._by_priority  # waiting requests may still go ahead of running ones

        loads = kv.has_loads_in_flight  # some running request waits for its KV from the host
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if outranking and self.waiting and self.waiting[0].priority < req.priority:
                n = self._admit_ahead(i, budget, scheduled, preempted, new_ids)
                if n is not None and n >= 0:
                    budget -= n
                    i += 1  # the admitted request now sits before req
                    continue
                if n is None:
                    outranking = False  # the first that outranks cannot get in: none this step
                    if i == len(running):  # (defensive: it gives up before preempting req)
                        break
                    req = running[i]
            if loads and kv.is_loading(req):
                i += 1  # its prefix is still coming from the host: the others go on
                continue
            if req.length_capped(self.max_model_len):
                i += 1  # finishes when its last token is read back: nothing left to run
                continue
            num_new = min(len(req.all_token_ids) + len(req.spec_token_ids) - req.num_computed_tokens,
                          budget, self.chunk_cap)
            if req.mm_inputs:
                num_new = chunk_tokens(req, req.num_computed_tokens, num_new)
            if num_new <= 0:  # an image's rest does not fit this step's budget (or defensive:
                i += 1        # a running request always has >= 1 token to do)
                continue
            if req.spec_token_ids:  # drafts (after its one last token) as far as the budget goes
                del req.spec_token_ids[max(num_new - 1, 0):]
            while kv.allocate_slots(req, num_new) is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            break  # req preempted itself: it was the last running request

        if not preempted:
            waiting = self.waiting
            loras = self._running_loras()
            w = 0  # the next waiting request to try (those before it wait for an adapter slot)
            while w < len(waiting) and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting[w]
                if req.num_unresolved:  # preempted with a token still in flight: next step
                    break
                if self._no_adapter_slot(req, loras):
                    w += 1  # every adapter slot is held by running requests: it waits
                    continue
                admitted = self._admit(req, budget)
                if admitted is None:
                    break
                if w:
                    del waiting[w]
                else:
                    waiting.popleft()
                if req.lora_int_id:
                    loras.add(req.lora_int_id)
                if self._by_priority:
                    bisect.insort(running, req, key=_order)
                else:
                    running.append(req)
                new_ids.append(req.request_id)
                if admitted:  # 0: admitted, its prefix loading from the host (a later step)
                    scheduled.append((req, admitted))
                    budget -= admitted

        finished, self._finished_ids = self._finished_ids, []
        self.num_steps += 1
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
            finished_request_ids=finished,
            new_request_ids=new_ids,
        )

    def _running_loras(self) -> set[int]:
        """The adapters running requests hold (only counted with a max_loras cap)."""
        return {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()

    def _no_adapter_slot(self, req: Request, loras: set[int]) -> bool:
        lid = req.lora_int_id
        return bool(self.max_loras and lid and lid not in loras and len(loras) >= self.max_loras)

    def _admit(self, req: Request, budget: int) -> int | None:
        """Take a waiting request's blocks (after its prefix hits) for its first chunk and
        mark it running; returns the chunk's tokens, or None (nothing changed) when the
        blocks cannot be had. 0: admitted with its prefix hits only, which are still loading
        from the host (asynchronous loads, kv_cache/host_cache.py): it computes in a later
        step, once they have landed. The caller moves it between the queues."""
        kv = self.kv_cache_manager
        hit_blocks, num_hit = kv.get_computed_blocks(req)
        num_new = min(req.num_tokens - num_hit, budget, self.chunk_cap)
        if req.mm_inputs and num_new > 0:
            num_new = chunk_tokens(req, num_hit, num_new)
            if num_new <= 0:  # an image's rest does not fit this step's budget: a later step
                return None
        if self.running and self.watermark_blocks:
            # Blocks this admission may take from the free queue: the fresh ones and (at
            # most) the cached hits, which may be sitting in it.
            need = kv.blocks_held_after(num_hit, num_new)
            if kv.num_free_blocks - need < self.watermark_blocks:
                return None
        if kv.must_wait_for_loads(req, hit_blocks):
            # no blocks for its first chunk yet: they would be registered (findable) before
            # anything is computed in them
            num_new = 0
        if kv.allocate_slots(req, num_new, hit_blocks) is None:
            return None
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        req.status = RequestStatus.RUNNING
        return num_new

    def _admit_ahead(self, i: int, budget: int, scheduled: list[tuple[Request, int]],
                     preempted: list[str], new_ids: list[str]) -> int | None:
        """Priority policy, before ``running[i]`` gets its tokens: admit the first waiting
        request that may go (as in admission: it stops at one with a token in flight and
        passes over one without an adapter slot) if its priority is strictly higher than
        ``running[i]``'s, preempting ``running[i:]`` (all of lower priority, none scheduled
        yet) from the last while it lacks a seat or blocks. Returns its tokens; None when
        one does but cannot get in (then nobody is preempted). Admitted with 0 tokens: its prefix is loading from the host;
        -1 when no waiting request outranks ``running[i]``."""
        running, waiting, kv = self.running, self.waiting, self.kv_cache_manager
        loras = self._running_loras()
        w = 0
        while w < len(waiting) and self._no_adapter_slot(waiting[w], loras):
            w += 1
        if w == len(waiting) or waiting[w].num_unresolved:
            return None
        req = waiting[w]
        if req.priority >= running[i].priority:
            return -1
        # Would it fit with every request it outranks gone? As _admit and allocate_slots
        # will count, with their blocks freed (those no one else holds) and its prefix hits
        # among the free blocks it takes.
        hits, num_hit = kv.get_computed_blocks(req)
        first = min(req.num_tokens - num_hit, budget, self.chunk_cap)
        if req.mm_inputs and first > 0 and chunk_tokens(req, num_hit, first) <= 0:
            return None  # an image's rest does not fit the budget: preempting would not help
        total = kv.blocks_held_after(num_hit, first)
        freed = kv.blocks_freed_by([r.request_id for r in running[i:]])
        free_after = kv.num_free_blocks + len(freed)
        hits = kv.taken_hits(hits)
        hits_taken_from_free = sum(1 for b in hits if b.ref_cnt == 0 or b.block_id in freed)
        if (total - len(hits) > free_after - hits_taken_from_free
                or (i and free_after - total < self.watermark_blocks)):
            return None
        while True:
            num_new = self._admit(req, budget) if len(running) < self.max_num_seqs else None
            if num_new is not None:
                break
            if len(running) == i:
                return None
            victim = running.pop()
            self._preempt(victim)  # sorts after req (a lower priority): index w still holds req
            preempted.append(victim.request_id)
        del waiting[w]
        bisect.insort(running, req, hi=i, key=_order)  # after those already scheduled
        if num_new:
            scheduled.append((req, num_new))
        new_ids.append(req.request_id)
        return num_new

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self._by_priority:
            bisect.insort(self.waiting, req, key=_order)  # back to its place, not the head
        else:
            self.waiting.appendleft(req)

    # ------------------------------------------------------------------- update
    def advance(self, out: SchedulerOutput, sampled: list[Request]) -> None:
        """Async scheduling, right after a step is launched: its tokens count as computed
        and each request in ``sampled`` holds a placeholder for the token being sampled,
        so the next ``schedule()`` can run before that token is read back."""
        for req, n in out.scheduled:
            if req.status == RequestStatus.RUNNING:
                req.num_computed_tokens += n
        for req in sampled:
            if req.status == RequestStatus.RUNNING:
                req.append_placeholder()

    def resolve(self, sampled: list[Request], tokens: list[int],
                drafted: dict[str, list[int]] | None = None) -> list[Request]:
        """Async scheduling: the launched step's tokens, read back. Fills each request's
        oldest placeholder and finishes (and frees) the requests that stop on it; requests
        finished or aborted meanwhile are skipped. ``drafted``: a speculative step's
        accepted drafts by request id, which come before its token (Request.resolve_drafted).
        Returns the requests that finished."""
        max_model_len = self.max_model_len
        finished: list[Request] = []
        for req, token in zip(sampled, tokens, strict=True):
            if req.is_finished() or not req.num_unresolved:
                continue
            accepted = drafted.get(req.request_id) if drafted is not None else None
            if accepted is not None:
                status = req.resolve_drafted([*accepted, token], max_model_len)
                self.kv_cache_manager.trim(req)
            else:
                status = req.resolve_next(token, max_model_len)
            if status is None:
                continue
            if req.status != RequestStatus.RUNNING:  # preempted while its token was in flight
                self.waiting.remove(req)
            self._finish(req, status)  # running ones leave self.running below, in one pass
            finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return finished

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests, append sampled tokens, finish and free.

        ``sampled`` maps request id -> token for the requests whose scheduled range
        reached their ``num_tokens``. Requests finished or aborted since ``schedule()``
        are skipped. Returns the requests that finished in this step.
        """
        reqs = []
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING or req.request_id not in sampled:
                continue
            if req.num_computed_tokens + n != len(req.all_token_ids):
                raise ValueError(
                    f"request {req.request_id!r} got a sampled token mid-prefill "
                    f"({req.num_computed_tokens + n} of {len(req.all_token_ids)} tokens computed)"
                )
            reqs.append(req)
        # The synchronous step is the async one read back at once.
        self.advance(out, reqs)
        return self.resolve(reqs, [sampled[r.request_id] for r in reqs])
