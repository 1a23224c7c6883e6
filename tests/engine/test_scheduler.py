"""Scheduler tests against a fake model that reads its context through the block tables.

``FakeRunner`` plays the model runner: for every scheduled token it writes, into the slot
the block table gives, a fingerprint of the token's WHOLE prefix (what real K/V depends
on); then each request reads its whole context back through its block table (asserting
it is exactly its own prefix), and a request that reached its last token samples
``next = fingerprint(prefix) % VOCAB``. A wrong block table, a wrong prefix hit or a
block reused while still in use would change what is read, and so the output.
"""

from __future__ import annotations

import zlib

import pytest

from flashpage.engine.scheduler import Scheduler, SchedulerOutput
from flashpage.engine.sequence import Request, RequestRefused, RequestStatus
from flashpage.kv_cache.kv_cache_manager import KVCacheManager, slot_mapping_for
from flashpage.sampling_params import SamplingParams

VOCAB = 50
_MOD = (1 << 61) - 1


def fingerprints(tokens: list[int]) -> list[int]:
    out, h = [], 1
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % _MOD
        out.append(h)
    return out


def next_token(fp: int) -> int:
    return (fp >> 7) % VOCAB


class FakeRunner:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.cache: list[int | None] = [None] * (kv.num_blocks * kv.block_size)
        self.num_steps = 0

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        kv, B = self.kv, self.kv.block_size
        ranges = []
        for req, n in out.scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            assert n >= 1 and end <= req.num_tokens, (req, n)
            ids = kv.get_block_ids(req.request_id)
            assert len(ids) * B >= end, "block table does not cover the scheduled tokens"
            fps = fingerprints(self.tokens_of(req)[:end])
            for p, slot in zip(range(start, end), slot_mapping_for(ids, start, end, B), strict=True):
                self.cache[slot] = fps[p]
            ranges.append((req, end, fps))
        sampled = {}
        for req, end, fps in ranges:  # attention: all writes of the step came first
            ids = kv.get_block_ids(req.request_id)
            ctx = [self.cache[s] for s in slot_mapping_for(ids, 0, end, B)]
            assert ctx == fps, f"{req.request_id} read a wrong context through its block table"
            if end == req.num_tokens:
                sampled[req.request_id] = next_token(ctx[-1])
        self.num_steps += 1
        return sampled

    def tokens_of(self, req: Request) -> list[int]:
        """The request's tokens as the model sees them (the async runner fills placeholders)."""
        return req.all_token_ids


def expected_output(prompt: list[int], sp: SamplingParams, max_model_len: int,
                    eos: int | None = None) -> tuple[list[int], str]:
    """What an unbatched, uncached run of the fake model produces (independent reference)."""
    toks, out = list(prompt), []
    while True:
        t = next_token(fingerprints(toks)[-1])
        toks.append(t)
        out.append(t)
        if len(out) >= sp.min_tokens:
            if t in (sp.stop_token_ids or []):
                return out, "stop"
            if eos is not None and t == eos and not sp.ignore_eos:
                return out, "stop"
        if (sp.max_tokens is not None and len(out) >= sp.max_tokens) or len(toks) >= max_model_len:
            return out, "length"


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256,
         prefix=True) -> tuple[Scheduler, KVCacheManager, FakeRunner]:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(max_num_seqs, budget, max_model_len, kv), kv, FakeRunner(kv)


def R(rid: str, prompt: list[int] | int, max_tokens: int | None = 4, **kw) -> Request:
    if isinstance(prompt, int):
        prompt = [(zlib.crc32(rid.encode()) + 7 * i) % VOCAB for i in range(prompt)]
    eos = kw.pop("eos", None)
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), eos_token_id=eos)


def step(s: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    assert out.total_num_scheduled_tokens == sum(n for _, n in out.scheduled)
    assert out.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert s.num_running <= s.max_num_seqs
    return out, s.update_from_output(out, runner.execute(out))


def run_all(s: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return
        step(s, runner)
    raise AssertionError("did not finish")


def sched_view(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


# ----------------------------------------------------------------------- tests
def test_chunked_prefill_splits_a_long_prompt():
    s, kv, runner = make(budget=8)
    a = R("a", 20, max_tokens=2)
    s.add_request(a)
    views = []
    for _ in range(5):
        out, fin = step(s, runner)
        views.append(sched_view(out))
    assert views == [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)], []]
    assert a.output_token_ids == expected_output(a.prompt_token_ids, a.sampling_params, 256)[0]
    assert a.finish_reason == "length" and not s.has_unfinished_requests()


def test_running_first_then_waiting_fills_the_budget():
    s, kv, runner = make(budget=10)
    for rid in "abc":
        s.add_request(R(rid, 2, max_tokens=10))
    out, _ = step(s, runner)
    assert sched_view(out) == [("a", 2), ("b", 2), ("c", 2)]
    s.add_request(R("d", 30, max_tokens=3))
    out, _ = step(s, runner)
    # three decodes, then d's first chunk takes the rest of the budget
    assert sched_view(out) == [("a", 1), ("b", 1), ("c", 1), ("d", 7)]
    out, _ = step(s, runner)
    assert sched_view(out) == [("a", 1), ("b", 1), ("c", 1), ("d", 7)]
    assert out.new_request_ids == []


def test_a_running_chunked_prefill_can_take_the_whole_budget_in_order():
    s, kv, runner = make(budget=6)
    s.add_request(R("a", 20, max_tokens=3))
    s.add_request(R("b", 2, max_tokens=3))
    assert sched_view(step(s, runner)[0]) == [("a", 6)]
    assert sched_view(step(s, runner)[0]) == [("a", 6)]
    assert sched_view(step(s, runner)[0]) == [("a", 6)]
    assert sched_view(step(s, runner)[0]) == [("a", 2), ("b", 2)]
    assert sched_view(step(s, runner)[0]) == [("a", 1), ("b", 1)]


def test_long_prefill_token_threshold_lets_long_prompts_advance_side_by_side():
    """vLLM's long_prefill_token_threshold: no request gets more than that many tokens a
    step, so a second long prompt starts at once instead of after the first; outputs are
    unchanged."""
    kv = KVCacheManager(64, 4)
    s = Scheduler(8, 32, 256, kv, long_prefill_token_threshold=12)
    runner = FakeRunner(kv)
    a, b = R("a", 30, max_tokens=2), R("b", 20, max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    views = [sched_view(step(s, runner)[0]) for _ in range(4)]
    assert views == [[("a", 12), ("b", 12)], [("a", 12), ("b", 8)], [("a", 6), ("b", 1)],
                     [("a", 1)]]
    run_all(s, runner)
    for r in (a, b):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]
    s0, _, _ = make(budget=32)  # without it: a takes the step's budget first
    s0.add_request(R("a", 30, max_tokens=2))
    s0.add_request(R("b", 20, max_tokens=2))
    assert sched_view(s0.schedule()) == [("a", 30), ("b", 2)]
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        Scheduler(8, 32, 256, kv, long_prefill_token_threshold=-1)


def test_max_num_seqs_respected():
    s, kv, runner = make(max_num_seqs=2, budget=100)
    for rid in "abcde":
        s.add_request(R(rid, 3, max_tokens=2))
    out, _ = step(s, runner)
    assert sched_view(out) == [("a", 3), ("b", 3)] and s.num_waiting == 3
    out, fin = step(s, runner)
    assert [r.request_id for r in fin] == ["a", "b"]
    out, _ = step(s, runner)
    assert sched_view(out) == [("c", 3), ("d", 3)] and out.finished_request_ids == ["a", "b"]
    run_all(s, runner)


def test_waiting_head_blocks_fifo_when_its_blocks_are_missing():
    s, kv, runner = make(num_blocks=6, block_size=4, budget=100)
    s.add_request(R("a", 12, max_tokens=4))  # 3 blocks
    s.add_request(R("b", 16, max_tokens=1))  # 4 blocks: does not fit beside a
    s.add_request(R("c", 2, max_tokens=1))  # would fit, but must not overtake b
    out, _ = step(s, runner)
    assert sched_view(out) == [("a", 12)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    run_all(s, runner)
    assert kv.num_free_blocks == 6


def test_preemption_takes_most_recently_admitted_and_output_is_unchanged():
    # 6 blocks of 4 tokens; a, b, c each start with 8 prompt tokens (2 blocks) and grow.
    s, kv, runner = make(num_blocks=6, block_size=4, budget=64, prefix=False)
    reqs = [R(rid, 8, max_tokens=10) for rid in "abc"]
    for r in reqs:
        s.add_request(r)
    out, _ = step(s, runner)
    assert sched_view(out) == [("a", 8), ("b", 8), ("c", 8)] and kv.num_free_blocks == 0
    # Next step every request needs a 3rd block: a's need preempts c (the most recently
    # admitted), whose 2 freed blocks then serve a and b.
    out, _ = step(s, runner)
    assert out.preempted_request_ids == ["c"]
    assert sched_view(out) == [("a", 1), ("b", 1)]
    c = reqs[2]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert kv.get_block_ids("c") == [] and list(s.waiting) == [c]
    assert c.num_output_tokens == 1  # its sampled token is kept and recomputed later
    # No admission in a step with preemption; c comes back when blocks free up.
    run_all(s, runner)
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]
    assert c.num_preemptions >= 1 and s.num_preemptions >= 1
    assert kv.num_free_blocks == 6


def test_preempting_several_puts_the_oldest_victim_at_the_head():
    s, kv, runner = make(num_blocks=8, block_size=2, budget=64, prefix=False)
    reqs = [R(rid, 4, max_tokens=8) for rid in "abcd"]  # 2 blocks each: the pool is full
    for r in reqs:
        s.add_request(r)
    s.add_request(R("e", 2, max_tokens=1))
    step(s, runner)
    assert kv.num_free_blocks == 0 and s.num_waiting == 1
    # Next step: a needs a block -> d preempted; b needs one -> c preempted... (d freed 2)
    out, _ = step(s, runner)
    assert out.preempted_request_ids == ["d", "c"]
    assert [r.request_id for r in s.waiting] == ["c", "d", "e"]
    run_all(s, runner)
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]


def test_a_request_alone_that_runs_out_preempts_itself_then_resumes():
    s, kv, runner = make(num_blocks=3, block_size=2, budget=64, prefix=False)
    a = R("a", 2, max_tokens=3)  # up to 4 written tokens: 2 blocks
    b = R("b", 2, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    step(s, runner)  # a: block 0, b: block 1
    out, _ = step(s, runner)  # a needs a block (2), b needs one too -> none left: b preempts itself
    assert sched_view(out) == [("a", 1)] and out.preempted_request_ids == ["b"]
    run_all(s, runner)
    for r in (a, b):
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]


def test_refusal_is_clear_and_leaves_others_alone():
    s, kv, runner = make(num_blocks=8, block_size=4, max_model_len=40)
    s.add_request(R("ok", 5, max_tokens=3))
    step(s, runner)
    with pytest.raises(RequestRefused, match=r"41 tokens .* max_model_len \(40\)"):
        s.add_request(R("long", 41))
    # 40-token prompt + up to 20 outputs, capped by max_model_len: 39 written -> 10 blocks > 8.
    with pytest.raises(RequestRefused, match=r"need 10 KV blocks .* only 8 blocks"):
        s.add_request(R("big", 30, max_tokens=20))
    with pytest.raises(RequestRefused, match="empty"):
        s.add_request(R("empty", []))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(R("ok", 3))
    assert s.get_request("long") is None and s.num_waiting == 0
    s.add_request(R("fits", 30, max_tokens=2))  # 31 written tokens: 8 blocks, the whole pool
    run_all(s, runner)
    assert s.get_request("ok") is None and kv.num_free_blocks == 8


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "running", "between"])
def test_abort_at_any_time_frees_blocks(when):
    s, kv, runner = make(budget=8, num_blocks=16)
    a = R("a", 20, max_tokens=5)
    b = R("b", 5, max_tokens=5)
    s.add_request(b)
    s.add_request(a)
    if when == "waiting":
        step(s, runner)  # b admitted, a's first chunk too: make a waiting one instead
        c = R("c", 5)
        s.add_request(c)
        assert s.abort_requests("c") == [c] and c.finish_reason == "abort"
        assert s.schedule().finished_request_ids == ["c"]
        return
    step(s, runner)
    assert kv.get_block_ids("a")
    if when == "mid_prefill":
        assert a.num_computed_tokens < a.num_prompt_tokens
    if when == "running":
        for _ in range(3):
            step(s, runner)
        assert a.num_output_tokens >= 1
    if when == "between":
        out = s.schedule()
        sampled = runner.execute(out)
        assert s.abort_requests(["a", "nope"]) == [a]
        fin = s.update_from_output(out, sampled)  # a is skipped
        assert a not in fin
    else:
        assert s.abort_requests(["a"]) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED and kv.get_block_ids("a") == []
    assert s.abort_requests("a") == []  # twice: no-op
    assert s.schedule().finished_request_ids[-1] == "a"
    s2_free = kv.num_free_blocks
    assert s2_free == 16 - len(kv.get_block_ids("b"))


def test_finish_requests_for_stop_strings():
    s, kv, runner = make()
    a = R("a", 6, max_tokens=10)
    s.add_request(a)
    step(s, runner)
    assert s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED) == [a]
    assert a.finish_reason == "stop" and kv.num_free_blocks == kv.num_blocks
    with pytest.raises(ValueError, match="not a finished status"):
        s.finish_requests(["a"], RequestStatus.RUNNING)


def test_stop_conditions():
    prompt = [1, 2, 3]
    ref = expected_output(prompt, SamplingParams(max_tokens=30, ignore_eos=True), 256)[0]
    eos = ref[3]
    k = ref.index(eos)  # first occurrence
    cases = [
        (dict(max_tokens=30, eos=eos), k + 1, "stop", None),
        (dict(max_tokens=30, eos=eos, ignore_eos=True), 30, "length", None),
        (dict(max_tokens=30, stop_token_ids=[eos]), k + 1, "stop", eos),
        (dict(max_tokens=2), 2, "length", None),
    ]
    if k + 1 < 30:
        later = [i for i, t in enumerate(ref) if t == eos and i >= k + 1]
        if later:  # min_tokens skips the first eos
            cases.append((dict(max_tokens=30, eos=eos, min_tokens=k + 2), later[0] + 1, "stop", None))
    for kw, n_out, reason, stop_reason in cases:
        s, kv, runner = make()
        r = R("r", list(prompt), **kw)
        s.add_request(r)
        run_all(s, runner)
        assert r.output_token_ids == ref[:n_out], kw
        assert r.finish_reason == reason and r.stop_reason == stop_reason, kw
    # max_model_len: 3 prompt tokens, model length 7 -> 4 outputs.
    s, kv, runner = make(max_model_len=7)
    r = R("r", list(prompt), max_tokens=None)
    s.add_request(r)
    run_all(s, runner)
    assert r.output_token_ids == ref[:4] and r.finish_reason == "length" and r.num_tokens == 7


def test_sampled_token_mid_prefill_is_an_error():
    s, kv, runner = make(budget=4)
    s.add_request(R("a", 10))
    out = s.schedule()
    with pytest.raises(ValueError, match="mid-prefill"):
        s.update_from_output(out, {"a": 1})


def test_children_with_the_same_prompt_share_prompt_blocks():
    s, kv, runner = make(num_blocks=32, block_size=4, budget=100)
    prompt = list(range(17))  # 4 full blocks + 1 token
    kids = [R(f"p-{i}", list(prompt), max_tokens=3) for i in range(4)]
    for k in kids:
        s.add_request(k)
    out, _ = step(s, runner)
    # The first child computes everything; the others hit its 4 full blocks in the same step.
    assert sched_view(out) == [("p-0", 17), ("p-1", 1), ("p-2", 1), ("p-3", 1)]
    assert [k.num_cached_tokens for k in kids] == [0, 16, 16, 16]
    shared = kv.get_block_ids("p-0")[:4]
    for k in kids[1:]:
        assert kv.get_block_ids(k.request_id)[:4] == shared
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [4, 4, 4, 4]
    run_all(s, runner)
    exp = expected_output(prompt, kids[0].sampling_params, 256)[0]
    assert all(k.output_token_ids == exp for k in kids)
    assert kv.stats().prefix_hits == 48 and kv.num_free_blocks == 32


def test_prefix_cache_survives_finish_and_is_reused():
    s, kv, runner = make(num_blocks=32, block_size=4, budget=100)
    system = list(range(12))
    a = R("a", system + [40, 41], max_tokens=2)
    s.add_request(a)
    run_all(s, runner)
    b = R("b", system + [42], max_tokens=2)
    s.add_request(b)
    out, _ = step(s, runner)
    assert sched_view(out) == [("b", 1)] and b.num_cached_tokens == 12
    run_all(s, runner)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, b.sampling_params, 256)[0]


def test_preempted_request_recomputes_with_prefix_hits_and_same_output():
    s, kv, runner = make(num_blocks=10, block_size=2, budget=64, prefix=True)
    reqs = [R(rid, 6, max_tokens=8) for rid in "abc"]
    for r in reqs:
        s.add_request(r)
    run_all(s, runner)
    assert s.num_preemptions >= 1
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.sampling_params, 256)[0]
    assert kv.num_free_blocks == 10
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_counters():
    s, kv, runner = make()
    s.add_request(R("a", 3))
    s.add_request(R("b", 3))
    assert (s.num_waiting, s.num_running) == (2, 0)
    step(s, runner)
    assert (s.num_waiting, s.num_running) == (0, 2)
    assert s.has_unfinished_requests()
    run_all(s, runner)
    assert not s.has_unfinished_requests() and s.num_running == 0


def test_watermark_keeps_blocks_free_for_running_requests():
    """Admission stops while it would leave fewer than the watermark's blocks free; a
    request alone is admitted regardless (no deadlock for one that needs the pool)."""
    kv = KVCacheManager(20, 4, enable_prefix_caching=False)
    s = Scheduler(8, 1000, 200, kv, watermark=0.25)  # keep 5 of 20 blocks free
    assert s.watermark_blocks == 5
    params = SamplingParams(max_tokens=4)
    for i in range(3):
        s.add_request(Request(f"r{i}", list(range(1, 25)), params))  # 24 tokens = 6 blocks
    out = s.schedule()
    # r0 (6 blocks, alone) and r1 (6 more: 8 left >= 5) run; r2 would leave 2 < 5.
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert kv.num_free_blocks == 8 and s.num_waiting == 1
    alone = Scheduler(8, 1000, 200, KVCacheManager(20, 4), watermark=0.25)
    alone.add_request(Request("big", list(range(1, 73)), params))  # 18 of 20 blocks
    assert [r.request_id for r, _ in alone.schedule().scheduled] == ["big"]
    with pytest.raises(ValueError, match="watermark"):
        Scheduler(8, 1000, 200, kv, watermark=1.5)


def test_max_loras_caps_the_adapters_running_together():
    """Two adapter slots: a waiting request whose adapter would be a third is passed over
    (it keeps its place) and those behind it with a running adapter, or none, go; it is
    admitted once a running adapter's requests are all done."""
    from flashpage.lora.request import LoRARequest

    kv = KVCacheManager(64, 4)
    s, runner = Scheduler(8, 64, 256, kv, max_loras=2), FakeRunner(kv)

    def LR(rid: str, lid: int, max_tokens: int) -> Request:
        r = R(rid, 6, max_tokens=max_tokens)
        r.lora_request = LoRARequest(f"l{lid}", lid, "/unused") if lid else None
        r.lora_int_id = lid
        return r

    for rid, lid, mt in (("a", 1, 2), ("b", 2, 6), ("c", 3, 2), ("d", 1, 2), ("e", 0, 2),
                         ("f", 3, 2)):
        s.add_request(LR(rid, lid, mt))
    out, _ = step(s, runner)
    assert sched_view(out) == [("a", 6), ("b", 6), ("d", 6), ("e", 6)]
    assert [r.request_id for r in s.waiting] == ["c", "f"]
    step(s, runner)  # a, d and e finish: adapter 1 leaves
    out, _ = step(s, runner)
    assert sched_view(out) == [("b", 1), ("c", 6), ("f", 6)]
    run_all(s, runner)
    assert kv.num_free_blocks == 64
