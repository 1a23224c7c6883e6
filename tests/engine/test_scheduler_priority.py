"""The priority scheduling policy (vLLM's ``--scheduling-policy priority``), exactly: which
request is admitted, scheduled and preempted, in which order. The order and preemption
tests run the same requests under fcfs too, to show the two differ there; each rule has a
test that fails without it (checked by removing each in turn). Outputs are checked
against the fake model's unbatched reference (test_scheduler)."""

from __future__ import annotations

import os
import sys

import pytest

from flashpage.engine.scheduler import Scheduler
from flashpage.engine.sequence import Request, RequestStatus
from flashpage.kv_cache.kv_cache_manager import KVCacheManager
from flashpage.lora.request import LoRARequest
from flashpage.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from test_scheduler import FakeRunner, R, expected_output, run_all, sched_view, step  # noqa: E402


def make(policy: str = "priority", num_blocks: int = 64, block_size: int = 4,
         max_num_seqs: int = 8, budget: int = 64, prefix: bool = False,
         **kw) -> tuple[Scheduler, KVCacheManager, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(max_num_seqs, budget, 256, kv, policy=policy, **kw), kv, FakeRunner(kv)


def P(rid: str, prompt: int, priority: int, arrival: float, max_tokens: int = 4,
      lora: int = 0) -> Request:
    r = R(rid, prompt, max_tokens=max_tokens)
    req = Request(rid, r.prompt_token_ids, r.sampling_params, arrival_time=arrival,
                  priority=priority,
                  lora_request=LoRARequest(f"l{lora}", lora, "/unused") if lora else None)
    return req


def ids(queue) -> list[str]:
    return [r.request_id for r in queue]


def check_outputs(s: Scheduler, kv: KVCacheManager, reqs: list[Request]) -> None:
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH, r
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_policy_is_checked():
    kv = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority, got 'lifo'"):
        Scheduler(8, 64, 256, kv, policy="lifo")
    assert Scheduler(8, 64, 256, kv).policy == "fcfs"


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_waiting_order_is_priority_then_arrival(policy):
    """One seat: requests run one at a time, in (priority, arrival) order; equal in both,
    in the order they were added. fcfs: the order they were added."""
    s, kv, runner = make(policy, max_num_seqs=1)
    reqs = [P("a", 3, 2, arrival=1.0), P("b", 3, 0, arrival=2.0), P("c", 3, 1, arrival=3.0),
            P("d", 3, 0, arrival=4.0), P("e", 3, 0, arrival=0.5),  # added late, arrived first
            P("f", 3, 1, arrival=3.0)]  # c's twin (n > 1 children look like this)
    for r in reqs:
        s.add_request(r)  # fcfs: priorities are not looked at
    expected = ["e", "b", "d", "c", "f", "a"] if policy == "priority" else list("abcdef")
    assert ids(s.waiting) == expected
    admitted = []
    while s.has_unfinished_requests():
        out, _ = step(s, runner)
        admitted += out.new_request_ids
    assert admitted == expected
    check_outputs(s, kv, reqs)


def test_preemption_picks_the_lowest_priority_and_it_keeps_its_place():
    # 6 blocks of 4 tokens; three 8-token prompts (2 blocks each) fill the pool. Next step
    # each needs a 3rd block: fcfs preempts c (admitted last), priority b (priority 5).
    for policy, victim, order in (("fcfs", "c", [("a", 1), ("b", 1)]),
                                  ("priority", "b", [("c", 1), ("a", 1)])):
        s, kv, runner = make(policy, num_blocks=6)
        reqs = [P("a", 8, 1, arrival=1.0, max_tokens=10), P("b", 8, 5, arrival=2.0, max_tokens=10),
                P("c", 8, 0, arrival=3.0, max_tokens=10)]
        for r in reqs:
            s.add_request(r)
        out, _ = step(s, runner)
        expected_first = [("a", 8), ("b", 8), ("c", 8)]
        if policy == "priority":  # running requests get their tokens in priority order
            expected_first = [("c", 8), ("a", 8), ("b", 8)]
        assert sched_view(out) == expected_first and kv.num_free_blocks == 0
        out, _ = step(s, runner)
        assert out.preempted_request_ids == [victim] and sched_view(out) == order
        if policy == "priority":
            # New arrivals: the preempted one keeps its place by (priority, arrival),
            # not at the head (fcfs) nor at the tail.
            s.add_request(P("x", 2, 3, arrival=4.0))  # outranks b: before it
            s.add_request(P("y", 2, 5, arrival=5.0))  # ties with b, arrived later: after it
            assert ids(s.waiting) == ["x", "b", "y"]
            reqs += [s.get_request("x"), s.get_request("y")]
        else:
            s.add_request(P("x", 2, 0, arrival=4.0))
            assert ids(s.waiting) == ["c", "x"]
            reqs.append(s.get_request("x"))
        run_all(s, runner)
        check_outputs(s, kv, reqs)


def test_among_equal_priorities_the_latest_arrival_is_preempted():
    s, kv, runner = make(num_blocks=6)
    # Added (and admitted) in the order c, a, b; arrivals say a, b, c: c is the victim.
    reqs = [P("c", 8, 1, arrival=3.0, max_tokens=10), P("a", 8, 1, arrival=1.0, max_tokens=10),
            P("b", 8, 1, arrival=2.0, max_tokens=10)]
    for r in reqs:
        s.add_request(r)
    assert sched_view(step(s, runner)[0]) == [("a", 8), ("b", 8), ("c", 8)]
    out, _ = step(s, runner)
    assert out.preempted_request_ids == ["c"] and sched_view(out) == [("a", 1), ("b", 1)]
    run_all(s, runner)
    check_outputs(s, kv, reqs)


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_high_priority_arrival_preempts_a_low_priority_running_request(policy):
    """a and b (priority 5) hold 4 of 6 blocks; h (priority 0, 12 tokens: 3 blocks)
    arrives. Priority: before a gets its token, h is admitted ahead of it, b (the later
    arrival) preempted for the blocks. fcfs: h waits while a and b grow."""
    s, kv, runner = make(policy, num_blocks=6)
    low = [P("a", 8, 5, arrival=1.0, max_tokens=6), P("b", 8, 5, arrival=2.0, max_tokens=6)]
    for r in low:
        s.add_request(r)
    step(s, runner)
    h = P("h", 12, 0, arrival=3.0, max_tokens=3)
    s.add_request(h)
    out, _ = step(s, runner)
    if policy == "priority":
        assert out.preempted_request_ids == ["b"] and out.new_request_ids == ["h"]
        assert sched_view(out) == [("h", 12), ("a", 1)]
        assert ids(s.running) == ["h", "a"] and ids(s.waiting) == ["b"]
        assert kv.num_free_blocks == 0
    else:
        assert out.preempted_request_ids == [] and sched_view(out) == [("a", 1), ("b", 1)]
        assert ids(s.waiting) == ["h"]
    finished = []
    while s.has_unfinished_requests():
        finished += [r.request_id for r in step(s, runner)[1]]
    assert finished[0] == ("h" if policy == "priority" else "a")
    check_outputs(s, kv, [*low, h])


def test_equal_priority_never_preempts():
    s, kv, runner = make(num_blocks=6)
    for r in (P("a", 8, 5, arrival=1.0, max_tokens=6), P("b", 8, 5, arrival=2.0, max_tokens=6)):
        s.add_request(r)
    step(s, runner)
    s.add_request(P("h", 12, 5, arrival=3.0, max_tokens=3))
    out, _ = step(s, runner)
    assert out.preempted_request_ids == [] and sched_view(out) == [("a", 1), ("b", 1)]
    assert ids(s.waiting) == ["h"]


def test_no_preemption_when_it_would_not_make_room():
    """h outranks b but not a; of 7 blocks a holds 4, b 1. When b's turn comes, a has
    taken a 5th: even with b's block freed, h's 3 blocks are not there. Nobody is
    preempted, h waits."""
    s, kv, runner = make(num_blocks=7)
    a, b = P("a", 16, 0, arrival=1.0, max_tokens=4), P("b", 4, 5, arrival=2.0, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    assert sched_view(step(s, runner)[0]) == [("a", 16), ("b", 4)]
    s.add_request(P("h", 12, 1, arrival=3.0, max_tokens=2))
    out, _ = step(s, runner)
    # a's 17th token and b's 5th each take a fresh block: the pool is full, h waits
    assert kv.num_free_blocks == 0
    assert out.preempted_request_ids == [] and sched_view(out) == [("a", 1), ("b", 1)]
    assert ids(s.waiting) == ["h"] and s.num_preemptions == 0


def test_a_high_priority_arrival_takes_the_seat_of_a_low_priority_one():
    s, kv, runner = make(max_num_seqs=2)
    low = [P("a", 4, 5, arrival=1.0, max_tokens=4), P("b", 4, 7, arrival=2.0, max_tokens=4)]
    for r in low:
        s.add_request(r)
    step(s, runner)
    h = P("h", 4, 6, arrival=3.0, max_tokens=2)  # outranks b (7), not a (5)
    s.add_request(h)
    out, _ = step(s, runner)
    assert out.preempted_request_ids == ["b"]
    assert sched_view(out) == [("a", 1), ("h", 4)] and ids(s.running) == ["a", "h"]
    run_all(s, runner)
    check_outputs(s, kv, [*low, h])


def test_an_outranking_request_without_an_adapter_slot_is_passed_over():
    """max_loras 1, two seats: a and b run adapter 1. h (priority 0) wants adapter 2: no
    slot, it is passed over; g (priority 1, no adapter) takes b's seat ahead of a."""
    s, kv, runner = make(max_num_seqs=2, max_loras=1)
    low = [P("a", 4, 5, arrival=1.0, lora=1), P("b", 4, 5, arrival=2.0, lora=1)]
    for r in low:
        s.add_request(r)
    step(s, runner)
    h, g = P("h", 4, 0, arrival=3.0, lora=2), P("g", 4, 1, arrival=4.0)
    s.add_request(h)
    s.add_request(g)
    out, _ = step(s, runner)
    assert out.preempted_request_ids == ["b"] and sched_view(out) == [("g", 4), ("a", 1)]
    assert ids(s.waiting) == ["h", "b"]
    run_all(s, runner)
    check_outputs(s, kv, [*low, h, g])


def test_prefix_hits_and_chunked_prefill_under_priority():
    """A small budget chunks the prompts; the children of one prompt (equal priority and
    arrival) share its blocks; a later high-priority request with the same system prompt
    preempts the low-priority ones and hits the cached blocks. Outputs unchanged."""
    s, kv, runner = make(num_blocks=14, budget=10, prefix=True)
    system = list(range(1, 17))  # 4 full blocks
    params = SamplingParams(max_tokens=8)
    kids = [Request(f"p#{i}", system + [30, 31], params, arrival_time=1.0, priority=3)
            for i in range(3)]
    for k in kids:
        s.add_request(k)
    for _ in range(4):
        step(s, runner)
    hi = Request("hi", system + [40, 41, 42], params, arrival_time=2.0, priority=0)
    s.add_request(hi)
    out, _ = step(s, runner)
    assert out.new_request_ids == ["hi"] and out.scheduled[0] == (hi, 3)
    assert hi.num_cached_tokens == 16
    run_all(s, runner)
    for r in [*kids, hi]:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, params, 256)[0]
    assert kv.num_free_blocks == 14 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_admitted_requests_take_their_place_among_the_running_ones():
    """Arrival times come from the caller (the server stamps them when a request comes in),
    so a request may be added after one that arrived later: once admitted it sits before
    it, whether it was admitted ahead of an outranked request or after the running ones."""
    s, kv, runner = make()
    y, low = P("y", 4, 1, arrival=2.0, max_tokens=8), P("low", 4, 5, arrival=0.0, max_tokens=8)
    s.add_request(y)
    s.add_request(low)
    step(s, runner)
    w = P("w", 4, 1, arrival=1.0, max_tokens=8)  # outranks low: admitted ahead of it
    s.add_request(w)
    out, _ = step(s, runner)
    assert sched_view(out) == [("y", 1), ("w", 4), ("low", 1)]
    assert ids(s.running) == ["w", "y", "low"]
    x = P("x", 4, 5, arrival=-1.0, max_tokens=8)  # outranks nobody: admitted after them
    s.add_request(x)
    out, _ = step(s, runner)
    assert sched_view(out) == [("w", 1), ("y", 1), ("low", 1), ("x", 4)]
    assert ids(s.running) == ["w", "y", "x", "low"]
    run_all(s, runner)
    check_outputs(s, kv, [y, low, w, x])
