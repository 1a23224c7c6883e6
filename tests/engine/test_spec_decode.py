"""Speculative decoding (engine/spec_decode.py): n-gram drafts, verification, and the
engine's outputs, which must be those of plain decoding for greedy requests."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from flashpage import LLM, SamplingParams
from flashpage.config import EngineConfig
from flashpage.engine.sequence import Request
from flashpage.engine.spec_decode import (
    NgramProposer,
    SpeculativeConfig,
    find_ngram_drafts,
    verify_drafts,
)
from tests.conftest import random_prompts, record_prompt_graph_keys

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def _drafts(tokens: list[int], k: int = 3, lo: int = 1, hi: int = 3) -> list[int]:
    return find_ngram_drafts(np.array(tokens, dtype=np.int64), k, lo, hi).tolist()


def test_ngram_lookup_takes_the_longest_suffix_then_its_latest_match():
    # suffix (5, 6): the 2-gram occurs at 1 (then 9) and at 4 (then 7): the latest wins
    assert _drafts([5, 6, 9, 5, 6, 7, 8, 5, 6]) == [7, 8, 5]
    # the 3-gram (1, 5, 6) occurs once, followed by 2: it wins over the later 2-gram (5, 6)
    assert _drafts([1, 5, 6, 2, 3, 5, 6, 4, 1, 5, 6]) == [2, 3, 5]
    # drafts stop where the tokens do; k caps them
    assert _drafts([4, 7, 4], k=5) == [7, 4]
    assert _drafts([1, 2, 3, 1, 2], k=1) == [3]
    # no earlier occurrence of the last token (min 1): nothing
    assert _drafts([1, 2, 3, 4]) == []
    assert _drafts([7]) == []
    # prompt_lookup_min 2: a lone repeated token is not enough
    assert _drafts([3, 9, 3], lo=2) == []


def _drafts_brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    L = len(tokens)
    for n in range(min(hi, L - 1), lo - 1, -1):
        for s in range(L - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[s:s + n] == tokens[L - n:]:
                return tokens[s + n:s + n + k]
    return []


def test_ngram_lookup_equals_a_brute_force_search():
    """The candidate-pruned search against trying every n at every position: 2,000 random
    token lists over 2-5 symbols (matches everywhere), random k and n ranges."""
    rng = np.random.default_rng(1)
    for _ in range(2000):
        toks = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 60))).tolist()
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        assert _drafts(toks, k, lo, hi) == _drafts_brute_force(toks, k, lo, hi), (toks, k, lo, hi)


@pytest.mark.parametrize("bad, words", [
    ({"method": "mlp_speculator"}, "use 'ngram' (prompt lookup), 'draft_model' (with a model), 'mtp'"),
    ({"method": "medusa"}, "method 'medusa' needs model: the Medusa heads' folder"),
    ({"method": "eagle"}, "method 'eagle' needs model: the EAGLE head's folder"),
    ({"method": "eagle3", "model": "/nonexistent"}, "method 'eagle3' needs model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min (3)"),
    ({"method": "ngram", "lookahead": 2}, "unknown keys ['lookahead']"),
    ({"num_speculative_tokens": 2}, "needs a method"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_speculative_config_is_named(bad, words):
    with pytest.raises(ValueError, match=None) as e:
        EngineConfig(speculative_config=bad)
    assert words in str(e.value)


def test_speculative_config_from_json_text():
    cfg = SpeculativeConfig.parse(json.dumps(NGRAM))
    assert cfg == SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3)


def _probs_of_first_token(logits: torch.Tensor, draft: int, params: SamplingParams, n: int) -> torch.Tensor:
    """The frequency of each token as the first one a step emits, over n rows each checking
    ``draft`` against ``logits`` (the accepted draft, or the token drawn on rejection)."""
    req = Request("r", [1, 2], params)
    got = verify_drafts(logits.expand(n, -1), [(req, [draft])] * n, logits.shape[-1])
    firsts = torch.tensor([c.accepted[0] if c.accepted else c.drawn for c in got])
    return torch.bincount(firsts, minlength=logits.shape[-1]).float() / n


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
], ids=["plain", "top_k", "top_p"])
@pytest.mark.parametrize("draft", [0, 5])
def test_sampled_rows_keep_the_model_distribution(params, draft):
    """Rejection sampling against a certain draft: the first token a step emits is
    distributed as the model's (processed) next-token distribution, whichever token the
    draft is (a likely one, 0, or an unlikely one, 5)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    x = logits / params.temperature
    from flashpage.engine.sampler import Sampler

    vocab = x.shape[1]
    x = Sampler._filter(x, torch.tensor([[params.top_k if params.top_k > 0 else vocab]]),
                        torch.tensor([[params.top_p]]), torch.tensor([[params.min_p]]))
    want = torch.softmax(x, dim=-1)[0]
    got = _probs_of_first_token(logits, draft, params, 40_000)
    # 40k draws: a standard error of at most 0.0025 per token
    assert torch.allclose(got, want, atol=0.012), (got, want)
    assert got[want == 0].sum() == 0  # nothing outside top-k / top-p


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    logits = torch.full((3, 6), -5.0)
    logits[0, 4] = logits[1, 2] = logits[2, 1] = 3.0  # argmax per row: 4, 2, 1
    req = Request("r", [1], SamplingParams(temperature=0.0))
    c, = verify_drafts(logits, [(req, [4, 2, 5])], 6)
    assert (c.accepted, c.drawn, c.num_drafts, c.logprobs) == ([4, 2], 1, 3, None)
    c, = verify_drafts(logits, [(req, [4, 2, 1])], 6)
    assert (c.accepted, c.drawn) == ([4, 2, 1], None)
    c, = verify_drafts(logits, [(req, [3, 2, 1])], 6)
    assert (c.accepted, c.drawn) == ([], 4)
    # logprobs: the raw distribution's, of each emitted token (accepted drafts, then drawn)
    lp_req = Request("l", [1], SamplingParams(temperature=0.0, logprobs=2))
    c, = verify_drafts(logits, [(lp_req, [4, 0, 5])], 6)
    assert (c.accepted, c.drawn) == ([4], 2)
    raw = torch.log_softmax(logits, dim=-1)
    assert [lp.token_id for lp in c.logprobs] == [4, 2] and [lp.rank for lp in c.logprobs] == [1, 1]
    assert c.logprobs[0].logprob == pytest.approx(raw[0, 4].item())
    top = c.logprobs[1].top  # row 1's top 2: token 2, then one of the tied rest
    assert len(top) == 2 and top[0][0] == 2 and top[1][1] == pytest.approx(raw[1, 0].item())


def _llm(path, spec=None, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 8, **kw}
    return LLM(str(path), speculative_config=spec, **kw)


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so n-gram lookups find matches."""
    return [(p * 5)[:48] for p in random_prompts(4, 4, 12, seed=5)]


@pytest.mark.parametrize("name", ["llama31_gqa", "qwen2_bias"])
def test_greedy_ngram_gives_plain_decoding_tokens(tiny_checkpoint, name):
    path = tiny_checkpoint(name)
    prompts = _repetitive_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    llm = _llm(path, NGRAM)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.engine.stats()["spec_decode"]
    assert stats["num_draft_tokens"] > 0, "the repeated prompts were meant to give drafts"
    assert llm.engine.kv_manager.stats().blocks_used == 0


class _Oracle(NgramProposer):
    """Drafts from a known answer (plain decoding's tokens), wrong at every ``wrong``-th
    output position when set: every path of acceptance and rejection, on purpose."""

    answers: dict[str, list[int]]
    wrong: int = 0

    def draft(self, req: Request, k: int) -> list[int]:
        ans = self.answers[req.request_id]
        i = req.num_output_tokens
        out = ans[i:i + k]
        if self.wrong:
            out = [(t + 1) % 256 if (i + j) % self.wrong == self.wrong - 1 else t
                   for j, t in enumerate(out)]
        return out


def _with_oracle(llm: LLM, answers: list[list[int]], wrong: int = 0) -> _Oracle:
    base = llm.engine.proposer
    assert base is not None
    oracle = _Oracle(base.config, base.max_model_len)
    oracle.answers = {str(i): a for i, a in enumerate(answers)}
    oracle.wrong = wrong
    llm.engine.proposer = oracle
    return oracle


def _generate_ids(llm: LLM, prompts, params) -> list[list[int]]:
    """Requests ids "0", "1", ... (the oracle's keys), finished outputs in order."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = {}
    for _ in range(1000):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert not eng.has_unfinished_requests(), "the engine stopped making progress"
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("wrong", [0, 3, 1])
def test_right_and_wrong_drafts_give_the_same_tokens(tiny_checkpoint, wrong):
    """Drafts all right (every one accepted: ~k + 1 tokens a step), every third wrong, or
    all wrong (none accepted): the tokens are plain decoding's every time."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(3, 5, 30, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    llm = _llm(path, NGRAM)
    oracle = _with_oracle(llm, want, wrong)
    got = [o.outputs[0].token_ids for o in _generate_ids(llm, prompts, params)]
    assert got == want
    st = oracle.stats
    if wrong == 0:
        assert st.num_accepted_tokens == st.num_draft_tokens > 0
        # one prompt step, then 5 tokens a step: 21 outputs in 1 + 4 steps
        assert llm.engine.scheduler.num_steps == 5
    elif wrong == 1:
        assert st.num_accepted_tokens == 0 and st.num_draft_tokens > 0
    else:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_backoff_pauses_unproductive_drafting_and_doubles_the_pause():
    """patience unproductive drafting steps in a row pause a request for base steps, the
    next pause twice that (up to cap); an accepted draft resets both."""
    from flashpage.engine.spec_decode import SpecBackoff

    bo = SpecBackoff(patience=2, base=3, cap=8)
    drafting = []
    outcomes = iter([False, False,   # steps 1-2 unproductive: pause 3 (steps 3-5)
                     False, False,   # steps 6-7: pause 6 (8-13)
                     True, False, False,  # steps 14-16: reset, then pause 3 (17-19)
                     False, False, False, False, False, False, False])  # pauses 6, then 8 (cap)
    for _ in range(40):
        bo.tick()
        on = bo.drafting("r")
        drafting.append(on)
        if on:
            bo.record("r", next(outcomes, False))
    runs = "".join("d" if d else "." for d in drafting)
    assert runs == "dd...dd......ddd...dd......dd........dd.", runs
    bo.forget("r")
    assert bo.drafting("r") and bo.drafting("never seen")
    with pytest.raises(ValueError, match="backoff must be true or false"):
        SpeculativeConfig.parse({"method": "ngram", "backoff": "yes"})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_wrong_drafts_back_off_and_let_scheduling_go_async(tiny_checkpoint, monkeypatch,
                                                           async_scheduling):
    """Drafts that are always wrong: with back-off each request checks drafts in a few short
    bursts (far fewer checking steps than without), and with async scheduling the steps in
    between are scheduled before the last one is read back (inputs from the device); the
    tokens are plain decoding's either way."""
    from flashpage.engine.scheduler import Scheduler

    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(3, 5, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    real = Scheduler.schedule
    unresolved_steps = []

    def spy(self):
        unresolved_steps.append(any(r.num_unresolved for r in self.running))
        return real(self)

    monkeypatch.setattr(Scheduler, "schedule", spy)
    drafts = {}
    for backoff in (False, True):
        unresolved_steps.clear()
        llm = _llm(path, {**NGRAM, "backoff": backoff}, async_scheduling=async_scheduling)
        oracle = _with_oracle(llm, want, wrong=1)
        got = [o.outputs[0].token_ids for o in _generate_ids(llm, prompts, params)]
        assert got == want
        assert oracle.stats.num_accepted_tokens == 0
        drafts[backoff] = oracle.stats.num_drafts
        # async scheduling only once nobody drafts: never without back-off
        assert any(unresolved_steps) == (async_scheduling and backoff), unresolved_steps
        assert llm.engine.kv_manager.stats().blocks_used == 0
    assert drafts[False] >= 3 * 58  # every decode step of every request checked drafts
    assert 0 < drafts[True] < drafts[False] / 3, drafts


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there(tiny_checkpoint):
    """eos and a stop token id that plain decoding meets mid-way are met inside a run of
    accepted drafts: the output ends on them, max_tokens is never passed."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(2, 5, 20, seed=3)
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, free, use_tqdm=False)]
    stop_tok = full[0][10]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok])
    want = [o.outputs[0] for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    assert want[0].token_ids[-1] == stop_tok and len(want[0].token_ids) <= 11
    llm = _llm(path, NGRAM)
    _with_oracle(llm, full)
    got = [o.outputs[0] for o in _generate_ids(llm, prompts, params)]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert got[0].stop_reason == stop_tok
    # max_tokens in the middle of a draft run
    short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    llm2 = _llm(path, NGRAM)
    _with_oracle(llm2, full)
    got2 = _generate_ids(llm2, prompts, short)
    assert [g.outputs[0].token_ids for g in got2] == [f[:7] for f in full]
    assert llm.engine.kv_manager.stats().blocks_used == llm2.engine.kv_manager.stats().blocks_used == 0


def test_a_stop_string_inside_accepted_drafts_ends_the_text_and_tokens_there(byte_model_dir):
    prompt = "the quick brown fox"
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base = _llm(byte_model_dir)
    full = base.generate([prompt], free, use_tqdm=False)[0].outputs[0]
    stop = full.text[8:10]
    assert stop and stop not in full.text[:9], "pick a stop string that first appears mid-way"
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = _llm(byte_model_dir, NGRAM)
    _with_oracle(llm, [full.token_ids])
    got = _generate_ids(llm, [prompt], params)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, "stop", stop)
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_unspeculable_requests_decode_beside_drafted_ones(tiny_checkpoint):
    """A penalized request gets no drafts but shares the steps with drafted ones, one asking
    for logprobs among them; each request's tokens are what it gets without speculation, and
    the logprobs those of plain decoding, token for token."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = _repetitive_prompts()[:3]
    plist = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=0.5),
             SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)]
    want = _llm(path).generate(prompts, plist, use_tqdm=False)
    llm = _llm(path, NGRAM)
    oracle = _with_oracle(llm, [w.outputs[0].token_ids for w in want])
    drafted: set[str] = set()
    propose = oracle.propose

    def watch(running):
        propose(running)
        drafted.update(r.request_id for r in running if r.spec_token_ids)

    oracle.propose = watch  # type: ignore[method-assign]
    for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
        llm.engine.add_request(str(i), p, sp)
    got = {}
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            got[o.request_id] = o
    assert drafted == {"0", "2"}
    for i, w in enumerate(want):
        assert got[str(i)].outputs[0].token_ids == w.outputs[0].token_ids
    mine, theirs = got["2"].outputs[0], want[2].outputs[0]
    assert [lp.token_id for lp in mine.logprobs] == theirs.token_ids
    for a, b in zip(mine.logprobs, theirs.logprobs, strict=True):
        assert a.rank == b.rank and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert mine.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-3)


def test_preemption_with_drafts_keeps_the_tokens(tiny_checkpoint):
    """A cache too small for every request: drafts' blocks count, requests are preempted and
    recomputed, and the outputs are still plain decoding's; no block leaks."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = random_prompts(6, 10, 30, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    llm = _llm(path, NGRAM, block_size=4, num_gpu_blocks=40, max_num_batched_tokens=32)
    _with_oracle(llm, want, wrong=4)
    got = [o.outputs[0].token_ids for o in _generate_ids(llm, prompts, params)]
    assert got == want
    assert llm.engine.scheduler.num_preemptions > 0, "the small cache was meant to preempt"
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_seeded_sampling_with_drafts_is_reproducible(tiny_checkpoint):
    """Seeded requests draw from streams keyed by their seed and output position: the same
    tokens run after run, whatever shares the batch."""
    path = tiny_checkpoint("llama31_gqa")
    prompts = _repetitive_prompts()
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=11)
    llm = _llm(path, NGRAM)
    alone = llm.generate(prompts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = llm.generate(prompts, [seeded, other, other, other], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    assert llm.engine.stats()["spec_decode"]["num_drafts"] > 0
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU check runs under TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_draft_steps_through_padded_prompt_graphs(tiny_checkpoint, monkeypatch):
    """The prompt-step graphs' padded forward (run eagerly here) with 1 + k logits rows per
    request slot: steps of requests that all check drafts take it (the logits rows are
    more than the requests), the others the plain path; the tokens are plain decoding's."""
    path = tiny_checkpoint("head64_gqa")
    kw = dict(dtype="float32", device="cpu", attention_backend="triton", block_size=16,
              max_num_batched_tokens=32)
    prompts = random_prompts(2, 5, 12, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), speculative_config=NGRAM, **kw)
    llm.engine.runner.capture_prefill_graphs(32, llm.engine.max_model_len, capture=False, rows_per_seq=5)
    _with_oracle(llm, want, wrong=3)
    keys = record_prompt_graph_keys(monkeypatch)
    got = [o.outputs[0].token_ids for o in _generate_ids(llm, prompts, params)]
    assert got == want
    drafted = [(key, rows) for key, rows in keys if rows > 2]
    assert drafted, keys  # steps whose logits rows outnumber their requests took the graphs
    assert all(rows <= min(key[0] * 5, key[1]) for key, rows in keys)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wrong", [0, 3])
def test_drafts_on_the_gpu_with_graphs(tiny_checkpoint, wrong):
    """fp32 on the GPU, every graph kind captured: steps that check drafts take the
    piecewise graphs (their logits rows are not one per request), decode-only steps the
    decode graphs; the tokens are plain decoding's (drafts right, or every third wrong)."""
    path = tiny_checkpoint("head64_gqa")
    prompts = random_prompts(5, 5, 40, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", device="cuda", attention_backend="triton", block_size=16,
              max_num_batched_tokens=128)
    plain = LLM(str(path), **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), speculative_config=NGRAM, **kw)
    assert llm.engine.runner.piecewise is not None and llm.engine.runner.graphs is not None
    oracle = _with_oracle(llm, want, wrong)
    got = [o.outputs[0].token_ids for o in _generate_ids(llm, prompts, params)]
    assert got == want
    assert oracle.stats.num_accepted_tokens > 0
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_drafts_over_an_mla_cache(tiny_mla_checkpoint, name):
    """DeepSeek (MLA latents, MoE): a draft-checking step is a short chunk over the latent
    cache like any other; tokens are plain decoding's, drafts partly wrong."""
    path = tiny_mla_checkpoint(name)
    prompts = random_prompts(3, 5, 30, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(path).generate(prompts, params, use_tqdm=False)]
    llm = _llm(path, NGRAM)
    oracle = _with_oracle(llm, want, wrong=3)
    got = [o.outputs[0].token_ids for o in _generate_ids(llm, prompts, params)]
    assert got == want
    assert 0 < oracle.stats.num_accepted_tokens < oracle.stats.num_draft_tokens
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("wrong", [0, 3])
def test_structured_outputs_with_drafts(byte_model_dir, wrong, device="cpu"):
    """A JSON-schema request's drafts stop where its pattern would (a draft it forbids is
    never run), each draft row is masked by the pattern's state after the drafts before it,
    the sampled row after the last by the state after all: greedy tokens are plain guided
    decoding's, drafts right or every third wrong; sampled ones still match the schema."""
    from flashpage import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    guided = StructuredOutputsParams(json=schema)
    prompts = ["the quick brown fox", '{"name": "Ada", "age": 36}']
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=guided)
    kw: dict = dict(max_model_len=256, device=device)
    if device == "cuda":  # fp32 over our kernels, every graph kind captured
        kw.update(attention_backend="triton", block_size=16, max_num_batched_tokens=128)
    want = _llm(byte_model_dir, **kw).generate(prompts, params, use_tqdm=False)
    llm = _llm(byte_model_dir, NGRAM, **kw)
    oracle = _with_oracle(llm, [w.outputs[0].token_ids for w in want], wrong)
    got = _generate_ids(llm, prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    for g in got:
        out = json.loads(g.outputs[0].text)
        assert set(out) == {"name", "age"} and isinstance(out["age"], int)
    assert oracle.stats.num_accepted_tokens > 0
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=guided)
    llm2 = _llm(byte_model_dir, NGRAM, **kw)
    for o in llm2.generate(prompts * 2, sampled, use_tqdm=False):
        assert set(json.loads(o.outputs[0].text)) == {"name", "age"}
    assert llm.engine.kv_manager.stats().blocks_used == llm2.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_structured_outputs_with_drafts_on_the_gpu(byte_model_dir_head64):
    """The same on CUDA (head_dim 64, which the Triton kernels take): masks per draft row
    from the device's mask cache, the sampled row's through the lookahead state, the steps
    on the graphs."""
    test_structured_outputs_with_drafts(byte_model_dir_head64, 3, device="cuda")
