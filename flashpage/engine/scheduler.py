"""Iteration-level continuous batching with chunked prefill and preemption.

Each step has a token budget (``max_num_batched_tokens``) and a cap on running requests
(``max_num_seqs``). There is no prefill or decode phase:

1. Running requests, in admission order, each get ``min(remaining tokens, budget left)``
   (usually 1; a request still in chunked prefill gets its next chunk). If one cannot
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

``schedule()`` does NOT advance ``num_computed_tokens`` (except that an admitted
request's counter is set to its prefix-cache hit): the tokens scheduled for request r
are positions ``[r.num_computed_tokens, r.num_computed_tokens + n)``, and r needs a
sampled token exactly when that range ends at ``r.num_tokens``.
``update_from_output`` advances the counters and appends sampled tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from flashpage.engine.sequence import Request, RequestRefused, RequestStatus
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


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 kv_cache_manager: KVCacheManager, watermark: float = 0.0,
                 max_loras: int = 0) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        # Admission keeps this many blocks free for the running requests to grow into, so
        # a full pool does not turn the next steps' growth into preemptions (recompute).
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark_blocks = int(watermark * kv_cache_manager.num_blocks)
        # LoRA: the most distinct adapters among running requests (the engine's slots); 0: no cap
        self.max_loras = max_loras
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
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
        need = kv.blocks_needed(most_written)
        if need > kv.num_blocks:
            raise RequestRefused(
                f"request {rid!r}: up to {most_written} tokens need {need} KV blocks of "
                f"{kv.block_size} tokens, but the whole cache has only {kv.num_blocks} blocks"
            )
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
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
        running = self.running

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.length_capped(self.max_model_len):
                i += 1  # finishes when its last token is read back: nothing left to run
                continue
            num_new = min(len(req.all_token_ids) + len(req.spec_token_ids) - req.num_computed_tokens,
                          budget)
            if num_new <= 0:  # defensive: a running request always has >= 1 token to do
                i += 1
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

        new_ids: list[str] = []
        if not preempted:
            waiting = self.waiting
            loras = {r.lora_int_id for r in running if r.lora_int_id} if self.max_loras else set()
            w = 0  # the next waiting request to try (those before it wait for an adapter slot)
            while w < len(waiting) and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting[w]
                if req.num_unresolved:  # preempted with a token still in flight: next step
                    break
                lid = req.lora_int_id
                if self.max_loras and lid and lid not in loras and len(loras) >= self.max_loras:
                    w += 1  # every adapter slot is held by running requests: it waits
                    continue
                hit_blocks, num_hit = kv.get_computed_blocks(req)
                num_new = min(req.num_tokens - num_hit, budget)
                if running and self.watermark_blocks:
                    # Blocks this admission may take from the free queue: the fresh ones and
                    # (at most) the cached hits, which may be sitting in it.
                    need = kv.blocks_needed(num_hit + num_new)
                    if kv.num_free_blocks - need < self.watermark_blocks:
                        break
                if kv.allocate_slots(req, num_new, hit_blocks) is None:
                    break
                if w:
                    del waiting[w]
                else:
                    waiting.popleft()
                if lid:
                    loras.add(lid)
                req.num_computed_tokens = num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                req.status = RequestStatus.RUNNING
                running.append(req)
                scheduled.append((req, num_new))
                new_ids.append(req.request_id)
                budget -= num_new

        finished, self._finished_ids = self._finished_ids, []
        self.num_steps += 1
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            preempted_request_ids=preempted,
            finished_request_ids=finished,
            new_request_ids=new_ids,
        )

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
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
