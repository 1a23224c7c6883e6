"""A draft model's drafts for structured-outputs requests (engine/draft_model.py): each draft
forward's row masked by the pattern's state after the drafts before, so every draft is one
the pattern allows; drafts cut after scheduling where the pattern ends (the step's tokens
shrink with them); the target checks the real drafts. Greedy guided requests get plain
guided decoding's tokens, token for token, with drafts accepted."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flashpage import LLM, SamplingParams, StructuredOutputsParams
from flashpage.engine import draft_model, model_runner
from flashpage.engine.draft_model import DraftModelProposer
from flashpage.engine.scheduler import SchedulerOutput
from flashpage.engine.sequence import Request
from tests.conftest import build_tiny_checkpoint, random_prompts
from tests.engine.test_draft_graphs import _graphed
from tests.engine.test_draft_model import noisy_copy

EOS = 2
REGEX = r"[a-z]{2,6}@[a-z]{1,5}\.(com|org)"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "maximum": 120}},
          "required": ["name", "age"]}
CHOICES = ["positive", "negative", "neutral", "né"]
SPECS = {"json": StructuredOutputsParams(json=SCHEMA), "regex": StructuredOutputsParams(regex=REGEX),
         "choice": StructuredOutputsParams(choice=CHOICES)}
PROMPTS = ["A person as JSON:", "Write an email address:", "Sentiment?"]
K = 4  # "positive" drafted from its first token "p" (8 byte tokens): 4 drafts, then 3 of 4


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, byte_model_dir):
    """name -> a draft for byte_model_dir: "self" the target; "noisy" its weights with noise
    (drafts mostly right); "other" a 1-layer random model of the same vocabulary."""
    from tests.byte_tokenizer import VOCAB_SIZE

    other = build_tiny_checkpoint(tmp_path_factory.mktemp("guided_other"), "mqa", seed=1,
                                  num_hidden_layers=1, vocab_size=VOCAB_SIZE)
    noisy = noisy_copy(byte_model_dir, tmp_path_factory.mktemp("guided_noisy"))
    return {"self": byte_model_dir, "noisy": noisy, "other": other}


def _llm(path, draft=None, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 8, "max_model_len": 256, **kw}
    spec = None if draft is None else {"model": str(draft), "num_speculative_tokens": K,
                                       "backoff": False, **kw.pop("spec", {})}
    return LLM(str(path), speculative_config=spec, **kw)


def _greedy(spec: str | None, max_tokens: int = 48) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=SPECS[spec] if spec else None)


def _ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


class _Watch:
    """Spies on a draft-model engine: after each ``fill``, every guided request's drafts are
    ones its pattern allows (no eos), and each drafting request's tokens this step are its
    last token and its drafts (the step's total their sum); the drafts the target's pattern
    states are computed from are those ``fill`` drew; accepted drafts per request."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        self.filled: dict[str, list[int]] = {}  # request id -> its drafts this step
        self.guided_drafts = 0  # drafts of guided requests that reached the target
        self.cuts = 0  # guided requests whose drafts ended before the scheduled count
        self.checked_states = 0  # drafting requests whose pattern states the target computed
        self.accepted: dict[str, int] = {}
        self.drafted: set[str] = set()  # requests that have had drafts
        self.preempted_drafted = 0  # preemptions of requests that had had drafts
        proposer = llm.engine.proposer
        assert isinstance(proposer, DraftModelProposer)
        real_fill, real_learn = proposer.fill, proposer.learn
        real_states = model_runner.guide_states

        def fill(out: SchedulerOutput) -> None:
            before = {r.request_id: len(r.spec_token_ids) for r, _ in out.scheduled}
            real_fill(out)
            self.preempted_drafted += sum(rid in self.drafted for rid in out.preempted_request_ids)
            self.filled = {}
            for req, n in out.scheduled:
                ds = list(req.spec_token_ids)
                if before[req.request_id]:
                    assert n == 1 + len(ds) and req.num_computed_tokens + 1 == req.num_tokens
                    self.filled[req.request_id] = ds
                    self.drafted.add(req.request_id)
                if req.guide is not None and before[req.request_id]:
                    self.cuts += len(ds) < before[req.request_id]
                    assert EOS not in ds
                    assert len(req.guide.states_along(ds)) == len(ds) + 1, "a draft the pattern forbids"
                    self.guided_drafts += len(ds)
            assert out.total_num_scheduled_tokens == sum(n for _, n in out.scheduled)

        def states(spec):
            for r, ds in spec:
                assert ds == self.filled[r.request_id], "the target checked other drafts than fill's"
            self.checked_states += len(spec)
            return real_states(spec)

        def learn(checked):
            for rid, got in checked.items():
                self.accepted[rid] = self.accepted.get(rid, 0) + len(got.accepted)
            real_learn(checked)

        proposer.fill, proposer.learn = fill, learn  # type: ignore[method-assign]
        monkeypatch.setattr(model_runner, "guide_states", states)


def _check_patterns(outs, specs) -> None:
    for o, spec in zip(outs, specs, strict=True):
        text = o.outputs[0].text
        if spec == "json" and o.outputs[0].finish_reason == "stop":
            assert set(json.loads(text)) == {"name", "age"}, text
        elif spec == "regex" and o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(REGEX, text), text
        elif spec == "choice":
            assert text in CHOICES, text


@pytest.mark.parametrize("which", ["self", "noisy"])
@pytest.mark.parametrize("spec", ["json", "regex", "choice"])
def test_guided_greedy_drafts_give_plain_guided_tokens(byte_model_dir, drafts, monkeypatch, spec, which):
    """A JSON schema, a regex, a choice: drafts masked by the pattern, accepted (all of them
    with the target as its draft), cut where the pattern ends; the tokens are plain guided
    decoding's."""
    params = _greedy(spec)
    want = _ids(_llm(byte_model_dir), PROMPTS, params)
    llm = _llm(byte_model_dir, drafts[which])
    watch = _Watch(llm, monkeypatch)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    _check_patterns(outs, [spec] * len(PROMPTS))
    st = llm.engine.stats()["spec_decode"]
    assert watch.guided_drafts == st["num_draft_tokens"] > 0 and st["num_accepted_tokens"] > 0, st
    assert watch.checked_states == st["num_drafts"] > 0
    if which == "self":  # masked as the target's rows are: every draft accepted, and drafted
        # as far as room and the pattern allow (unmasked, most would stop at a forbidden pick)
        assert st["acceptance_rate"] == 1.0 and st["mean_accepted_length"] > K, st
    if spec == "choice":  # short patterns: the drafts outrun their end
        assert watch.cuts > 0
    assert llm.engine.kv_manager.stats().blocks_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_batch_of_guided_and_unguided_requests(byte_model_dir, drafts, monkeypatch, async_scheduling):
    """Guided requests of every kind beside unguided ones (one with ignore_eos), chunked
    prefill, a noisy draft, scheduling sync and async: everyone's tokens are plain
    decoding's; every guided request has drafts accepted."""
    specs = ["json", "regex", None, "choice", None]
    prompts = [*PROMPTS[:2], "the quick brown fox", PROMPTS[2], random_prompts(1, 12, 12, seed=3)[0]]
    params = [_greedy(s) for s in specs]
    params[2] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _ids(_llm(byte_model_dir), prompts, params)
    llm = _llm(byte_model_dir, drafts["noisy"], max_num_batched_tokens=24,
               async_scheduling=async_scheduling)
    watch = _Watch(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    _check_patterns([outs[i] for i in (0, 1, 3)], ["json", "regex", "choice"])
    ids = {o.request_id: s for o, s in zip(outs, specs, strict=True)}
    assert all(watch.accepted.get(rid, 0) > 0 for rid, s in ids.items() if s), watch.accepted
    assert watch.accepted.get(outs[2].request_id, 0) > 0  # the unguided ones draft as before
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_a_draft_that_is_mostly_wrong(byte_model_dir, drafts, monkeypatch):
    """Another random model as the draft: its masked drafts are often rejected; the tokens
    stay plain guided decoding's."""
    params = [_greedy(s) for s in SPECS]
    want = _ids(_llm(byte_model_dir), PROMPTS, params)
    llm = _llm(byte_model_dir, drafts["other"])
    watch = _Watch(llm, monkeypatch)
    assert _ids(llm, PROMPTS, params) == want
    st = llm.engine.stats()["spec_decode"]
    assert watch.guided_drafts == st["num_draft_tokens"] > 0 and st["acceptance_rate"] < 1.0, st


def test_preemption_of_guided_drafted_requests(byte_model_dir, drafts, monkeypatch):
    """A cache too small for every request: guided requests with drafts are preempted (both
    pools' blocks freed, recomputed from their tokens, their patterns' states kept) and
    still get plain guided decoding's tokens."""
    specs = ["json", "regex", "choice", "json", "regex", "choice"]
    prompts = PROMPTS * 2
    params = [_greedy(s) for s in specs]
    want = _ids(_llm(byte_model_dir), prompts, params)
    llm = _llm(byte_model_dir, drafts["noisy"], block_size=4, num_gpu_blocks=20,
               max_num_batched_tokens=32)
    watch = _Watch(llm, monkeypatch)
    assert _ids(llm, prompts, params) == want
    assert watch.preempted_drafted > 0, "the small cache was meant to preempt drafting requests"
    assert watch.guided_drafts > 0 and sum(watch.accepted.values()) > 0
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_guided_drafts_on_the_draft_graphs(byte_model_dir, drafts, monkeypatch):
    """The draft's decode and catch-up graphs (uncaptured on the CPU): the masks apply to the
    logits after the graphs' hidden states, so guided drafting runs on them too."""
    params = [_greedy(s) for s in SPECS]
    want = _ids(_llm(byte_model_dir), PROMPTS, params)
    llm = _llm(byte_model_dir, drafts["self"])
    log, ups = _graphed(llm)
    watch = _Watch(llm, monkeypatch)
    assert _ids(llm, PROMPTS, params) == want
    assert log and ups, "the draft's graphs were meant to run"
    st = llm.engine.stats()["spec_decode"]
    assert watch.guided_drafts == st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0, st


def test_seeded_sampled_guided_requests_with_a_draft(byte_model_dir, drafts, monkeypatch):
    """Sampled guided requests draft from the draft's q masked by the pattern (eos left out:
    a draft never ends the output; the target's row after the drafts may): a seeded request
    gets the same tokens alone or in a batch, the outputs keep their patterns, and with the
    target as its draft most drafts pass min(1, p / q)."""
    seeded = [SamplingParams(temperature=0.8, seed=7, max_tokens=48, structured_outputs=SPECS[s])
              for s in SPECS]
    llm = _llm(byte_model_dir, drafts["self"])
    watch = _Watch(llm, monkeypatch)
    alone = [_ids(llm, [p], s)[0] for p, s in zip(PROMPTS, seeded, strict=True)]
    outs = llm.generate(PROMPTS, seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    _check_patterns(outs, list(SPECS))
    st = llm.engine.stats()["spec_decode"]
    assert watch.guided_drafts == st["num_draft_tokens"] > 0 and st["acceptance_rate"] > 0.8, st
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_guided_sampled_drafts_from_a_masked_q_keep_the_model_distribution(byte_model_dir):
    """A guided sampled request's draft drawn from q masked by its pattern without eos (as
    the draft model draws it), checked against that q with the target's row masked by the
    pattern with eos: the first token a step emits is distributed as the masked p, eos
    included (drawn at a rejection, from max(p - q, 0))."""
    from flashpage.engine.spec_decode import guide_states, processed_probs, verify_drafts
    from flashpage.structured.guide import GuideState

    llm = _llm(byte_model_dir)
    guide = llm.engine.compile_guide(SamplingParams(structured_outputs=StructuredOutputsParams(
        regex="[a-z]*")))
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, generator=g) * 2
    logits[0, EOS] = 4.0  # the pattern may end here: eos takes a share of p
    p_mask = guide.mask(guide.start, True, torch.device("cpu"))
    want = processed_probs(logits.masked_fill(~p_mask, float("-inf")), [params], vocab)[0]
    q_mask = guide.mask(guide.start, False, torch.device("cpu"))
    q = torch.softmax((torch.randn(vocab, generator=g) * 2).masked_fill(~q_mask, float("-inf")), -1)
    assert want[EOS] > 0.05 and q[EOS] == 0
    n = 40_000
    reqs = []
    for i, d in enumerate(torch.multinomial(q, n, replacement=True, generator=g).tolist()):
        r = Request(str(i), [1, 2], params)
        r.guide, r.spec_probs = GuideState(guide), q[None]
        reqs.append((r, [d]))
    got = verify_drafts(logits.expand(n, -1), reqs, vocab, guide_states(reqs))
    firsts = torch.tensor([c.accepted[0] if c.accepted else c.drawn for c in got])
    freq = torch.bincount(firsts, minlength=vocab).float() / n
    assert (freq[~p_mask] == 0).all()
    assert torch.allclose(freq, want, atol=0.012), (freq[EOS], want[EOS])


def test_cut_drafts_shrinks_the_step():
    """SchedulerOutput.cut_drafts: the request's tokens this step and the step's total lose
    the cut drafts; keeping more than it has is named."""
    a, b = Request("a", [1, 2, 3], SamplingParams()), Request("b", [4, 5], SamplingParams())
    a.spec_token_ids, b.spec_token_ids = [7, 8, 9], [6]
    out = SchedulerOutput(scheduled=[(a, 4), (b, 2)], total_num_scheduled_tokens=6)
    assert out.cut_drafts(a, 1) == 2
    assert out.scheduled == [(a, 2), (b, 2)] and out.total_num_scheduled_tokens == 4
    assert a.spec_token_ids == [7]
    assert out.cut_drafts(b, 0) == 1 and out.total_num_scheduled_tokens == 3 and b.spec_token_ids == []
    with pytest.raises(ValueError, match="cannot keep 2 of its 1 drafts"):
        out.cut_drafts(a, 2)


def test_picker_masks_and_cuts_by_the_pattern(byte_model_dir):
    """_DraftPicker on hand-made logits: a guided greedy request whose unmasked argmax is a
    token its pattern forbids drafts the best allowed one; its drafts end once the pattern
    allows nothing but eos; a greedy pick of eos (where the pattern may end) ends them before
    it; an unguided request's drafts are the plain argmax."""
    llm = _llm(byte_model_dir)
    tok = llm.engine.tokenizer
    guide = llm.engine.compile_guide(SamplingParams(structured_outputs=StructuredOutputsParams(
        choice=["ab", "abc"])))
    from flashpage.structured.guide import GuideState

    def req(rid, guided):
        r = Request(rid, [1, 5], SamplingParams(temperature=0.0))
        if guided:
            r.guide = GuideState(guide)
        return r

    a_id, b_id, c_id = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    reqs = [req("g", True), req("e", True), req("u", False)]
    vocab = llm.engine.model_config.vocab_size
    picker = draft_model._DraftPicker(reqs, [4, 4, 4], vocab, torch.device("cpu"))
    out = torch.zeros(4, 3, dtype=torch.int64)

    def logits(*favour):  # each row's largest logit at its token (then the next, ...)
        x = torch.zeros(3, vocab)
        for row, toks in enumerate(favour):
            for rank, t in enumerate(toks):
                x[row, t] = 10.0 - rank
        return x

    picker.pick(logits([c_id, a_id], [a_id], [c_id]), 0, out[0])
    assert out[0].tolist() == [a_id, a_id, c_id] and picker.keep == [4, 4, 4]
    picker.pick(logits([b_id], [b_id], [c_id]), 1, out[1])
    assert out[1].tolist() == [b_id, b_id, c_id] and picker.keep == [4, 4, 4]
    # after "ab": "c" or the end; row 1's draft prefers eos
    picker.pick(logits([c_id, EOS], [EOS, c_id], [a_id]), 2, out[2])
    assert out[2].tolist() == [c_id, EOS, a_id]
    assert picker.keep == [3, 2, 4]  # "abc": nothing but eos may follow; eos: cut before it
    picker.pick(logits([c_id], [c_id], [EOS]), 3, out[3])  # the cut rows are left unmasked
    assert out[3].tolist() == [c_id, c_id, EOS] and picker.keep == [3, 2, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_guided_drafts_on_the_gpu_with_graphs(byte_model_dir_head64, monkeypatch):
    """fp32 on CUDA over the Triton kernels, the target's and the draft's graphs captured,
    the target as its own draft: guided (and one unguided) greedy requests get plain
    decoding's tokens with (nearly) every draft accepted, the draft's single-token forwards
    on its graphs; seeded sampled guided requests are reproducible and keep their patterns."""
    path = byte_model_dir_head64
    kw: dict = dict(device="cuda", attention_backend="triton", block_size=16, max_num_batched_tokens=128)
    specs = ["json", "regex", "choice", None]
    prompts = [*PROMPTS, "the quick brown fox"]
    params = [_greedy(s) for s in specs]
    params[3] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    want = _ids(_llm(path, **kw), prompts, params)
    llm = _llm(path, path, **kw)
    runner = llm.engine.proposer.runner
    assert llm.engine.runner.graphs is not None and runner.graphs is not None
    watch = _Watch(llm, monkeypatch)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    _check_patterns(outs[:3], specs[:3])
    assert runner.graph_forwards > 0
    st = llm.engine.stats()["spec_decode"]
    assert watch.guided_drafts > 0 and st["acceptance_rate"] > 0.95, st
    assert all(watch.accepted.get(o.request_id, 0) > 0 for o in outs[:3]), watch.accepted
    seeded = [SamplingParams(temperature=0.8, seed=7, max_tokens=48, structured_outputs=SPECS[s])
              for s in SPECS]
    alone = [_ids(llm, [p], s)[0] for p, s in zip(PROMPTS, seeded, strict=True)]
    outs = llm.generate(PROMPTS, seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    _check_patterns(outs, list(SPECS))
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.num_blocks
