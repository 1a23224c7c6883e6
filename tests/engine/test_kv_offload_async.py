"""Asynchronous loads from the host tier (kv_cache/host_cache.py, engine/kv_offload.py):
only the requests reading a load's blocks wait for it, everyone else goes on.

The scheduler and the KV cache manager run for real over ``FakeRunner``'s cache of prefix
fingerprints (tests/engine/test_scheduler.py: a request reading any slot that does not hold
exactly its own prefix fails). ``HostRunner`` adds the host tier as the engine runs it: a
store copies its GPU block's slots to a host row at once (the gather runs on the compute
stream before the forward); a load fills its GPU block only when its batch *lands*, a
chosen number of steps later, and until then the block holds garbage; a batch whose readers
were freed lands at the next flush (the engine makes the compute stream wait for it). So a
request computing before its load landed, a GPU hit on a block still loading taken without
waiting, or a freed block rewritten before its late load would all read a wrong context.
"""

from __future__ import annotations

import random

import pytest

from flashpage.engine.scheduler import Scheduler
from flashpage.engine.sequence import Request, RequestStatus
from flashpage.kv_cache.host_cache import HostBlockCache, LoadBatch
from flashpage.kv_cache.kv_cache_manager import KVCacheManager
from tests.engine.test_scheduler import FakeRunner, R, expected_output

GARBAGE = -1


class FakeEvent:
    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed


class HostRunner(FakeRunner):
    """FakeRunner with the host tier's copies; loads land ``delay()`` steps after their
    flush."""

    def __init__(self, kv: KVCacheManager, host: HostBlockCache, delay) -> None:
        super().__init__(kv)
        self.host = host
        self.rows: list[list[int | None] | None] = [None] * host.num_blocks
        self.delay = delay
        self.flying: list[tuple[int, LoadBatch, list[tuple[int, int]]]] = []  # (lands at, ...)
        self.step_no = 0
        self.num_orphans = 0

    def _slots(self, block_id: int) -> range:
        B = self.kv.block_size
        return range(block_id * B, (block_id + 1) * B)

    def land(self, batch: LoadBatch, loads: list[tuple[int, int]]) -> None:
        for h, g in loads:
            row = self.rows[h]
            assert row is not None, f"host block {h} loaded before it was stored"
            for s, v in zip(self._slots(g), row, strict=True):
                self.cache[s] = v
        assert isinstance(batch.event, FakeEvent)
        batch.event.landed = True

    def land_due(self) -> None:
        keep = []
        for at, batch, loads in self.flying:
            if at <= self.step_no:
                self.land(batch, loads)
            else:
                keep.append((at, batch, loads))
        self.flying = keep

    def flush(self) -> None:
        """As KVOffloader.flush on CUDA: orphans waited for, stores, then the loads queued."""
        stores, loads = self.host.take_ops()
        batch = self.host.last_batch
        orphans = self.host.take_orphaned()
        self.num_orphans += len(orphans)
        for b in orphans:
            for i, (_, fb, fl) in enumerate(self.flying):
                if fb is b:
                    self.land(fb, fl)
                    del self.flying[i]
                    break
        for g, h in stores:
            self.rows[h] = [self.cache[s] for s in self._slots(g)]
        if loads:
            assert batch is not None and batch.event is None
            batch.event = FakeEvent()
            for _, g in loads:  # not there yet: whatever the block held is garbage now
                for s in self._slots(g):
                    self.cache[s] = GARBAGE
            self.flying.append((self.step_no + self.delay(), batch, list(loads)))

    def step(self, s: Scheduler) -> tuple[list, dict[str, int]]:
        self.land_due()
        out = s.schedule()
        self.flush()
        sampled = self.execute(out)
        s.update_from_output(out, sampled)
        self.step_no += 1
        return out.scheduled, sampled


def tiered(num_blocks=12, host_blocks=32, block_size=4, budget=16, max_num_seqs=4, delay=lambda: 2):
    kv = KVCacheManager(num_blocks, block_size)
    host = HostBlockCache(host_blocks)
    kv.attach_host(host)
    s = Scheduler(max_num_seqs, budget, 256, kv)
    return s, kv, host, HostRunner(kv, host, delay)


def finish(s: Scheduler, runner: HostRunner, max_steps: int = 2_000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return
        runner.step(s)
    raise AssertionError("did not finish")


def assert_no_leaks(kv: KVCacheManager, host: HostBlockCache) -> None:
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not host.has_pending and all(e.pins == 0 for e in host.blocks)
    assert not kv.has_loads_in_flight
    assert not host.block_batch and host.oldest_in_flight() is None  # passed batches forgotten


def evict_prefix(s: Scheduler, runner: HostRunner, n: int = 6) -> None:
    """Fillers, one after another, whose blocks push every cached block out of the GPU
    pool (to the host)."""
    for i in range(n):
        s.add_request(R(f"filler{i}", 15, max_tokens=1))
        finish(s, runner)


PREFIX = [(5 * i + 3) % 50 for i in range(16)]


def test_a_request_waits_for_its_load_while_the_others_decode():
    s, kv, host, runner = tiered(delay=lambda: 3)
    a = R("a", PREFIX + [1], max_tokens=1)
    s.add_request(a)
    finish(s, runner)
    evict_prefix(s, runner)
    assert host.num_cached_blocks >= 4  # the prefix's 4 blocks went to the host
    c = R("c", 6, max_tokens=12)  # a decoding neighbour
    s.add_request(c)
    runner.step(s)
    b = R("b", PREFIX + [2, 3], max_tokens=3)
    s.add_request(b)
    sched, _ = runner.step(s)
    # b is admitted (a seat and its blocks: the 4 host hits, nothing for its tail yet) but
    # computes nothing while the load flies; c decodes beside it
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 16
    assert [r.request_id for r, _ in sched] == ["c"] and kv.is_loading(b)
    assert b.num_host_cached_tokens == 16 and len(kv.get_block_ids("b")) == 4
    waited = 0
    while True:
        sched, _ = runner.step(s)
        if len(sched) > 1:
            break
        assert [r.request_id for r, _ in sched] == ["c"] and kv.is_loading(b)
        waited += 1
    assert waited == 2  # the load landed 3 steps after its flush, before the step's schedule
    assert [(r.request_id, n) for r, n in sched] == [("c", 1), ("b", 2)]
    finish(s, runner)
    want, _ = expected_output(b.prompt_token_ids, b.sampling_params, 256)
    assert b.output_token_ids == want
    assert c.output_token_ids == expected_output(c.prompt_token_ids, c.sampling_params, 256)[0]
    assert_no_leaks(kv, host)


def test_a_gpu_hit_on_a_block_still_loading_waits_for_it_too():
    s, kv, host, runner = tiered(delay=lambda: 4)
    s.add_request(R("a", PREFIX + [1], max_tokens=1))
    finish(s, runner)
    evict_prefix(s, runner)
    b = R("b", PREFIX + [2], max_tokens=2)
    s.add_request(b)
    runner.step(s)
    assert kv.is_loading(b)
    d = R("d", PREFIX + [9, 9, 9], max_tokens=2)  # all of b's loading blocks, on the GPU
    s.add_request(d)
    sched, _ = runner.step(s)
    assert not sched and kv.is_loading(d) and d.num_computed_tokens == 16
    assert d.num_host_cached_tokens == 0 and d.num_cached_tokens == 16
    finish(s, runner)
    for r in (b, d):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]
    assert_no_leaks(kv, host)


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_blocks_freed_under_a_flying_load_are_not_rewritten_before_it_lands(how):
    """b is freed while its load flies (aborted, or preempted by a neighbour's growth): the
    batch is handed to the engine as an orphan and lands before anything else writes the
    blocks; the neighbours' tokens stay right (a late landing would overwrite them)."""
    s, kv, host, runner = tiered(num_blocks=12, delay=lambda: 50)
    s.add_request(R("a", PREFIX + [1], max_tokens=1))
    finish(s, runner)
    evict_prefix(s, runner)
    big = R("big", 12, max_tokens=20)  # 3 blocks now, grows to 8
    others = [R(f"o{i}", 3, max_tokens=6) for i in range(2)]
    for r in (big, *others):
        s.add_request(r)
    runner.step(s)
    b = R("b", PREFIX + [2], max_tokens=2)  # admitted last: the first preempted
    s.add_request(b)
    runner.step(s)
    assert kv.is_loading(b) and s.running[-1] is b
    if how == "abort":  # between steps: handed over at the next flush
        s.abort_requests("b")
        assert runner.num_orphans == 0
        runner.step(s)
    else:  # inside a schedule: handed over at that step's flush
        while b.num_preemptions == 0:  # big and the others grow into b's blocks
            runner.step(s)
        assert b.status == RequestStatus.PREEMPTED
    assert runner.num_orphans == 1
    finish(s, runner, max_steps=400)
    if how == "preempt":
        assert b.output_token_ids == expected_output(b.prompt_token_ids, b.sampling_params, 256)[0]
    for r in (big, *others):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]
    assert_no_leaks(kv, host)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_with_random_load_times_keeps_every_output(seed):
    """Requests sharing a few prefixes arrive over time into a pool a few prompts fill, so
    prefixes go to the host and come back; loads land 0-4 steps after their flush, some
    requests are aborted: every finished request's tokens are the unbatched reference's."""
    rng = random.Random(seed)
    s, kv, host, runner = tiered(num_blocks=16, host_blocks=24, budget=12, max_num_seqs=4,
                                 delay=lambda: rng.randint(0, 4))
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((8, 12, 16)))] for _ in range(8)]
    pending = [R(f"r{i}", rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))],
                 max_tokens=rng.randint(1, 8)) for i in range(40)]
    reqs: list[Request] = []
    aborted = set()
    for _ in range(3_000):
        if pending and rng.random() < 0.5:
            r = pending.pop(0)
            s.add_request(r)
            reqs.append(r)
        live = [r for r in reqs if not r.is_finished()]
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            s.abort_requests(victim.request_id)
            aborted.add(victim.request_id)
        if not pending and not s.has_unfinished_requests():
            break
        runner.step(s)
    else:
        raise AssertionError("did not finish")
    assert host.num_loads > 0 and host.num_stores > 0
    for r in reqs:
        if r.request_id not in aborted:
            want, _ = expected_output(r.prompt_token_ids, r.sampling_params, 256)
            assert r.output_token_ids == want, r.request_id
    assert_no_leaks(kv, host)


def test_priority_admission_ahead_of_running_requests_while_loading():
    """Priority policy: a more urgent request whose prefix is on the host goes ahead of the
    running ones (a seat, preempting the least urgent) and waits for its load there; the
    request it was admitted ahead of still gets its token in that step."""
    kv = KVCacheManager(16, 4)
    host = HostBlockCache(32)
    kv.attach_host(host)
    s = Scheduler(2, 16, 256, kv, policy="priority")
    runner = HostRunner(kv, host, lambda: 2)
    s.add_request(R("a", PREFIX + [1], max_tokens=1))
    finish(s, runner)
    evict_prefix(s, runner)
    lo = [R(f"lo{i}", 5, max_tokens=10) for i in range(2)]
    for r in lo:
        r.priority = 5
        s.add_request(r)
    runner.step(s)
    urgent = R("urgent", PREFIX + [4], max_tokens=3)
    s.add_request(urgent)
    sched, _ = runner.step(s)
    assert urgent.status == RequestStatus.RUNNING and kv.is_loading(urgent)
    assert [r.request_id for r in s.running] == ["urgent", "lo0"]  # lo1 preempted for the seat
    assert [r.request_id for r, _ in sched] == ["lo0"]
    finish(s, runner)
    for r in (urgent, *lo):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]
    assert_no_leaks(kv, host)
