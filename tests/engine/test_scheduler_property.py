"""Property test: random arrivals, lengths, shared prefixes, aborts and caches small enough
to force preemption. The invariants are checked after every step; at the end every block
is free with ref 0 and every request that was not aborted produced exactly the output of
an unbatched, uncached run of the fake model (see test_scheduler.FakeRunner).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from flashpage.engine.scheduler import Scheduler, SchedulerOutput
from flashpage.engine.sequence import PLACEHOLDER, Request, RequestRefused, RequestStatus
from flashpage.kv_cache.hybrid import HybridKVCacheManager
from flashpage.kv_cache.kv_cache_manager import KVCacheManager
from flashpage.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from test_scheduler import (  # noqa: E402
    VOCAB,
    FakeRunner,
    expected_output,
    fingerprints,
    next_token,
)

from flashpage.kv_cache.kv_cache_manager import slot_mapping_for  # noqa: E402

EXAMPLES = int(os.environ.get("FLASHPAGE_PROPERTY_EXAMPLES", "1000"))


class AsyncFakeRunner(FakeRunner):
    """The fake model under async scheduling: a decode's input may still be a PLACEHOLDER
    on the host; the "device" fills it with what it sampled for that request last step."""

    def __init__(self, kv: KVCacheManager) -> None:
        super().__init__(kv)
        self.last: dict[str, int] = {}

    def tokens_of(self, req: Request) -> list[int]:
        ids = list(req.all_token_ids)
        for p in range(len(ids) - req.num_unresolved, len(ids)):
            assert p == len(ids) - 1, "only the newest token may be unknown to the host"
            ids[p] = self.last[req.request_id]
        return ids

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        sampled = super().execute(out)
        self.last.update(sampled)
        return sampled


class WindowFakeRunner(AsyncFakeRunner):
    """The fake model attending within a sliding window: a step reads back only the keys
    its queries can see (positions after ``start - window``), through table entries that
    must not be the null block; the others may have been given back."""

    def __init__(self, kv: KVCacheManager, window: int, async_mode: bool) -> None:
        super().__init__(kv)
        self.window, self.async_mode = window, async_mode

    def tokens_of(self, req: Request) -> list[int]:
        return super().tokens_of(req) if self.async_mode else req.all_token_ids

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        kv, B, W = self.kv, self.kv.block_size, self.window
        sampled = {}
        fps_of = {}
        for req, n in out.scheduled:  # every write of the step first
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids = kv.get_block_ids(req.request_id)
            assert len(ids) * B >= end, "block table does not cover the scheduled tokens"
            fps = fingerprints(self.tokens_of(req)[:end])
            for p, slot in zip(range(start, end), slot_mapping_for(ids, start, end, B), strict=True):
                assert slot // B != 0, "a token written into the null block"
                self.cache[slot] = fps[p]
            fps_of[req.request_id] = (req, start, end, fps)
        for rid, (req, start, end, fps) in fps_of.items():
            ids = kv.get_block_ids(rid)
            lo = max(0, start - W + 1)  # the first key the step's first query sees
            assert all(ids[p // B] != 0 for p in range(lo, end)), (rid, lo, end, ids)
            ctx = [self.cache[s] for s in slot_mapping_for(ids, lo, end, B)]
            assert ctx == fps[lo:end], f"{rid} read a wrong window through its block table"
            if end == req.num_tokens:
                sampled[rid] = next_token(fps[-1])
        self.last.update(sampled)
        self.num_steps += 1
        return sampled


class HybridFakeRunner(AsyncFakeRunner):
    """The fake model with a full-attention group and windowed groups over one pool
    (kv_cache/hybrid.py): every group writes each token's fingerprint, tagged with the
    group, into the one memory all groups' blocks index (a block two groups held at once
    would be overwritten and read back wrong); the full group reads the whole context,
    the windowed ones what their window shows, through non-null entries."""

    def __init__(self, kv: HybridKVCacheManager, window: int, async_mode: bool) -> None:
        # a chunked group (kv.chunks) reads from its first query's chunk start instead
        self.kv_h, self.window, self.async_mode = kv, window, async_mode
        super().__init__(kv.groups[0])
        self.cache: list = [None] * (kv.num_blocks * kv.block_size)

    def tokens_of(self, req: Request) -> list[int]:
        return super().tokens_of(req) if self.async_mode else req.all_token_ids

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        kv, B, W = self.kv_h, self.kv_h.block_size, self.window
        sampled = {}
        fps_of = {}
        for req, n in out.scheduled:  # every group's writes of the step first
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            fps = fingerprints(self.tokens_of(req)[:end])
            for g in range(kv.num_groups):
                ids = kv.get_block_ids(req.request_id, g)
                assert len(ids) * B >= end, "block table does not cover the scheduled tokens"
                for p, slot in zip(range(start, end), slot_mapping_for(ids, start, end, B), strict=True):
                    assert slot // B != 0, "a token written into the null block"
                    self.cache[slot] = (g, fps[p])
            fps_of[req.request_id] = (req, start, end, fps)
        for rid, (req, start, end, fps) in fps_of.items():
            for g, win in enumerate(kv.windows):
                ids = kv.get_block_ids(rid, g)
                chunk = kv.chunks[g]
                lo = start // chunk * chunk if chunk else 0 if win is None else max(0, start - W + 1)
                assert all(ids[p // B] != 0 for p in range(lo, end)), (rid, g, lo, end, ids)
                ctx = [self.cache[s] for s in slot_mapping_for(ids, lo, end, B)]
                assert ctx == [(g, f) for f in fps[lo:end]], f"{rid} read a wrong context in group {g}"
            if end == req.num_tokens:
                sampled[rid] = next_token(fps[-1])
        self.last.update(sampled)
        self.num_steps += 1
        return sampled


@dataclass
class Spec:
    arrival: int  # step at which it is added
    prompt: list[int]
    max_tokens: int | None
    min_tokens: int
    eos: int | None
    stop_ids: list[int]
    abort_at: int | None  # step after its arrival at which it is aborted
    abort_mid_step: bool  # abort between the runner and update_from_output
    priority: int  # looked at only by the priority policy


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 20, 21], [30] * 9]


@st.composite
def request_spec(draw) -> Spec:
    prefix = draw(st.sampled_from([[], *PREFIXES, *PREFIXES]))
    cut = draw(st.one_of(st.just(len(prefix)), st.integers(0, len(prefix))))
    suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if cut else 1, max_size=20))
    max_tokens = draw(st.one_of(st.none(), st.integers(1, 16)))
    return Spec(
        arrival=draw(st.integers(0, 6)),
        prompt=prefix[:cut] + suffix,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(max_tokens or 3, 3))),
        eos=draw(st.one_of(st.none(), st.integers(0, VOCAB - 1))),
        stop_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        abort_at=draw(st.one_of(st.none(), st.none(), st.integers(0, 20))),
        abort_mid_step=draw(st.booleans()),
        priority=draw(st.integers(0, 3)),
    )


def check_invariants(s: Scheduler, kv: KVCacheManager | HybridKVCacheManager,
                     scheduled_tokens: int) -> None:
    B = kv.block_size
    assert scheduled_tokens <= s.max_num_batched_tokens
    assert len(s.running) <= s.max_num_seqs
    in_queue = set(kv.pool.free_queue.block_ids())
    assert len(in_queue) == kv.num_free_blocks
    holders = [0] * kv.num_blocks
    groups = kv.groups if isinstance(kv, HybridKVCacheManager) else [kv]
    for g in groups:
        for rid, ids in g._block_ids.items():
            assert [b.block_id for b in g.get_blocks(rid)] == ids
            released = g.num_released(rid)
            if not g.releases:
                assert released == 0
            if kv.null_block is not None:  # block 0 is the null block only behind a window
                assert ids[:released] == [0] * released and 0 not in ids[released:]
            for i in ids[released:]:
                holders[i] += 1
        # every group's table as long as the first's
        assert {rid: len(ids) for rid, ids in g._block_ids.items()} == \
            {rid: len(ids) for rid, ids in groups[0]._block_ids.items()}
    for b in kv.pool.blocks:
        if b is kv.null_block:  # held for good, never queued, in any number of tables
            assert b.ref_cnt == 1 and b.block_id not in in_queue and b.block_hash is None
            continue
        # no block both free and in use; ref count == number of tables holding it
        assert (b.block_id in in_queue) == (b.ref_cnt == 0), b
        assert b.ref_cnt == holders[b.block_id], b
    for h, b in kv.pool.cached.items():
        assert b.block_hash == h and b.token_ids is not None and len(b.token_ids) == B
        assert PLACEHOLDER not in b.token_ids  # a block is hashed only once its tokens are known
    assert set(groups[0]._block_ids) == {r.request_id for r in s.running}
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        assert len(kv.get_block_ids(r.request_id)) * B >= r.num_computed_tokens
        assert r.num_computed_tokens <= r.num_tokens
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and kv.get_block_ids(r.request_id) == []
    assert set(s.requests) == {r.request_id for r in s.running} | {r.request_id for r in s.waiting}
    if s.policy == "priority":  # both queues in (priority, arrival) order
        for queue in (list(s.waiting), s.running):
            keys = [r.queue_order for r in queue]
            assert keys == sorted(keys), queue


def refused_expected(spec: Spec, B: int, num_blocks: int, max_model_len: int,
                     window: int | None = None, budget: int = 0,
                     windows: tuple[object, ...] | None = None) -> bool:
    """``windows``: a hybrid cache's groups (None: full; else ``window``, a window or a chunk)."""
    n = len(spec.prompt)
    if n > max_model_len:
        return True
    # The request ends with at most this many tokens; the last one is never written.
    final = n + (spec.max_tokens if spec.max_tokens is not None else 10**9)
    final = min(final, max(max_model_len, n + 1))
    full = -(-(final - 1) // B) if final - 1 > n else -(-n // B)
    need = full
    if window is not None:  # behind a window: the keys a step sees and its own tokens
        need = min(full, -(-(window - 1 + budget) // B) + 1)
        num_blocks -= 1  # the null block
    if windows is not None:
        need = sum(full if w is None else need for w in windows)
    return need > num_blocks


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    extra_blocks=st.integers(-3, 8),  # cache = about one max_model_len: forces preemption
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 24),
    max_model_len=st.integers(4, 40),
    prefix=st.booleans(),
    specs=st.lists(request_spec(), min_size=1, max_size=10),
    async_mode=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    window=st.one_of(st.none(), st.integers(1, 12)),
    hybrid=st.sampled_from([None, (None, 0), (None, 0, 0), (0, None), (None, "chunk")]),
)
def test_scheduler_invariants_and_outputs(block_size, extra_blocks, max_num_seqs, budget,
                                          max_model_len, prefix, specs, async_mode, policy,
                                          window, hybrid):
    """With ``async_mode`` the loop is the engine's async one: advance() right after the
    step is "launched", the previous step's tokens resolve()d only then. The priority
    policy preempts for arrivals too: the same invariants and outputs hold. With a
    ``window`` the cache gives back blocks behind it (the null block in their entries) and
    the fake model reads only what the window shows; with ``hybrid`` too (a model mixing
    windowed and full layers: groups of tables over one pool, kv_cache/hybrid.py), the
    groups' windows (0: ``window``) and the cache about as large again per group."""
    windows = chunks = None  # a hybrid cache's groups' windows and chunks ("chunk": window's size)
    if window is not None and hybrid is not None:
        windows = tuple(window if w == 0 else None for w in hybrid)
        chunks = tuple(window if w == "chunk" else None for w in hybrid)
    num_blocks = max(1 + (window is not None), -(-max_model_len // block_size) + extra_blocks)
    if windows is not None:
        num_blocks += (len(windows) - 1) * max(1, -(-(window + budget) // block_size))
    kv: KVCacheManager | HybridKVCacheManager
    if windows is not None:
        kv = HybridKVCacheManager(num_blocks, block_size, prefix, windows, chunks)
    else:
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, sliding_window=window)
    s = Scheduler(max_num_seqs, budget, max_model_len, kv, policy=policy)
    if windows is not None:
        assert isinstance(kv, HybridKVCacheManager) and window is not None
        runner: FakeRunner = HybridFakeRunner(kv, window, async_mode)
    elif window is not None:
        assert isinstance(kv, KVCacheManager)
        runner = WindowFakeRunner(kv, window, async_mode)
    else:
        runner = AsyncFakeRunner(kv) if async_mode else FakeRunner(kv)
    inflight: tuple[list[Request], list[int]] | None = None
    reqs: dict[str, tuple[Request, Spec]] = {}
    aborted: set[str] = set()
    pending = sorted(enumerate(specs), key=lambda t: t[1].arrival)
    step = 0
    while pending or s.has_unfinished_requests() or inflight:
        assert step < 5000, "no progress"
        while pending and pending[0][1].arrival <= step:
            i, spec = pending.pop(0)
            rid = f"r{i}"
            r = Request(rid, spec.prompt, SamplingParams(
                max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
                stop_token_ids=spec.stop_ids), eos_token_id=spec.eos,
                priority=spec.priority if policy == "priority" else 0)
            expect_refusal = refused_expected(spec, block_size, num_blocks, max_model_len,
                                              window, budget, hybrid if windows else None)
            try:
                s.add_request(r)
            except RequestRefused:
                assert expect_refusal, spec
                event("some request refused")
                continue
            assert not expect_refusal, spec
            reqs[rid] = (r, spec)
        mid_step_aborts = []
        for rid, (_r, spec) in reqs.items():
            if spec.abort_at is not None and step == spec.arrival + spec.abort_at:
                if spec.abort_mid_step:
                    mid_step_aborts.append(rid)
                elif s.abort_requests([rid]):
                    aborted.add(rid)
        out = s.schedule()
        sampled = runner.execute(out)
        for rid in mid_step_aborts:
            if s.abort_requests(rid):
                aborted.add(rid)
        if async_mode:
            sampled_reqs = [r for r, _ in out.scheduled if r.request_id in sampled]
            s.advance(out, sampled_reqs)
            if inflight is not None:
                s.resolve(*inflight)
            inflight = (sampled_reqs, [sampled[r.request_id] for r in sampled_reqs]) \
                if sampled_reqs else None
        else:
            s.update_from_output(out, sampled)
        check_invariants(s, kv, out.total_num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(n for _, n in out.scheduled)
        step += 1

    event(f"preemptions: {'0' if not s.num_preemptions else '1-4' if s.num_preemptions < 5 else '5+'}")
    event(f"prefix hits: {kv.prefix_hits > 0}")
    event(f"aborted: {len(aborted) > 0}")
    event(f"async: {async_mode}")
    event(f"policy: {policy}")
    event(f"window: {window is not None}, hybrid: {windows is not None}")
    assert kv.num_free_blocks == kv.num_usable_blocks == num_blocks - (window is not None)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks if b is not kv.null_block)
    for rid, (r, spec) in reqs.items():
        assert r.is_finished()
        if rid in aborted:
            assert r.finish_reason == "abort"
            continue
        out_ids, reason = expected_output(spec.prompt, r.sampling_params, max_model_len, spec.eos)
        assert r.output_token_ids == out_ids, (rid, spec)
        assert r.finish_reason == reason
