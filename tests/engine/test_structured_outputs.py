"""Structured outputs end to end: a tiny random model sampling at temperature 1 writes
outputs that match the regex / parse as JSON valid against the schema / are one of the
choices, for several seeds, beside an unguided request whose tokens do not change; the
request ends once complete; async scheduling reads guided steps back before sampling; a
bad spec fails alone."""

from __future__ import annotations

import json
import re

import pytest

from flashpage import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from flashpage.structured.automaton import ByteNFA, LazyDFA
from flashpage.structured.compiler import spec_to_regex
from flashpage.structured.regex_parser import parse_regex

jsonschema = pytest.importorskip("jsonschema")

EOS = 2
REGEX = r"[a-z]{2,6}@[a-z]{1,5}\.(com|org)"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "kind": {"enum": ["x", "y", None]},
    },
    "required": ["name", "age"],
}
CHOICES = ["positive", "negative", "neutral", "né"]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(byte_model_dir, request):
    return LLM(str(byte_model_dir), dtype="float32", device="cpu", max_model_len=256,
               block_size=8, async_scheduling=request.param)


def _params(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 200), **kw)


def _alive(spec: StructuredOutputsParams, text: str) -> bool:
    """Whether ``text`` can still be completed into a match."""
    dfa = LazyDFA(ByteNFA(parse_regex(spec_to_regex(spec))))
    return dfa.walk(dfa.start, text.encode()) != 0


@pytest.mark.parametrize("seed", range(4))
def test_outputs_follow_their_pattern_beside_an_unguided_request(llm, seed):
    prompts = ["Write an email address:", "A person as JSON:", "Sentiment?", "Once upon a time",
               "Any JSON object:"]
    obj = StructuredOutputsParams(json_object=True)
    params = [_params(seed, structured_outputs=StructuredOutputsParams(regex=REGEX)),
              _params(seed + 10, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              _params(seed + 20, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
              _params(seed + 30, max_tokens=24),
              _params(seed + 40, max_tokens=40, structured_outputs=obj)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    regex, js, choice, free, anyobj = outs
    assert regex.finish_reason == "stop" and re.fullmatch(REGEX, regex.text), regex.text
    assert js.finish_reason == "stop", js.text
    jsonschema.validate(json.loads(js.text), SCHEMA)
    assert choice.finish_reason == "stop" and choice.text in CHOICES
    if anyobj.finish_reason == "stop":
        assert isinstance(json.loads(anyobj.text), dict)
    else:  # a free-form object may outlast max_tokens; what it wrote can still complete
        assert anyobj.finish_reason == "length" and _alive(obj, anyobj.text)
    alone = llm.generate([prompts[3]], params[3], use_tqdm=False)[0].outputs[0]
    assert free.token_ids == alone.token_ids and len(free.token_ids) == 24
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_request_ends_when_nothing_but_eos_can_follow(llm):
    """A choice ends on its last character without sampling eos, even with ignore_eos
    and min_tokens; eos is sampled only where the pattern may end."""
    for kw in (dict(), dict(ignore_eos=True), dict(min_tokens=20)):
        out = llm.generate("Say yes:", _params(3, structured_outputs=StructuredOutputsParams(choice=["yes"]),
                                               **kw), use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason) == ("yes", "stop") and EOS not in out.token_ids
    for seed in range(6):
        out = llm.generate("Digits:", _params(seed, structured_outputs=StructuredOutputsParams(regex=r"\d{1,40}")),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and re.fullmatch(r"\d{1,40}", out.text), out.text
        assert EOS not in out.token_ids[:-1]


def test_n_samples_and_guided_decoding_name(llm):
    params = _params(5, n=3, guided_decoding=GuidedDecodingParams(regex=r"(ab|ba){1,3}!"))
    assert params.structured_outputs is not None and params.guided_decoding is None
    out = llm.generate("x", params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.finish_reason == "stop" and re.fullmatch(r"(ab|ba){1,3}!", o.text), o.text


def test_guides_compiled_once_per_spec(llm):
    spec = dict(json={"type": "object", "properties": {"v": {"type": "integer", "maximum": 9}},
                      "required": ["v"]})
    engine = llm.engine
    for i in range(2):
        engine.add_request(f"same-{i}", "x", _params(i, structured_outputs=StructuredOutputsParams(**spec)))
    guides = {engine.scheduler.get_request(f"same-{i}").guide.guide for i in range(2)}
    assert len(guides) == 1
    while engine.has_unfinished_requests():
        engine.step()


def test_bad_spec_fails_alone(llm):
    good = _params(1, max_tokens=6)
    bad = [dict(regex="(ab"), dict(regex="a(?=b)"), dict(json={"type": "object", "not": {}}),
           dict(json={"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}}}}),
           dict(grammar="root ::= value")]
    want = ["missing \\)", "lookaround", "'not' is not supported", "recursive", "'value' is used .* not defined"]
    for spec, message in zip(bad, want, strict=True):
        outs = llm.generate(["one", "two", "three"],
                            [good, _params(2, structured_outputs=StructuredOutputsParams(**spec)), good],
                            use_tqdm=False)
        assert outs[1].error is not None and re.search(message, outs[1].error), outs[1].error
        assert outs[1].outputs == []
        assert [len(outs[i].outputs[0].token_ids) for i in (0, 2)] == [6, 6]
        assert llm.engine.kv_manager.stats().blocks_used == 0
        assert not llm.engine.has_unfinished_requests()


def test_needs_a_tokenizer(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama2_mha")), dtype="float32", device="cpu", max_model_len=64)
    out = llm.generate([[5, 6]], _params(0, structured_outputs=StructuredOutputsParams(regex="a")),
                       use_tqdm=False)[0]
    assert out.error and "need a tokenizer" in out.error


def test_async_scheduling_reads_guided_steps_back_first(byte_model_dir, monkeypatch):
    """A guided request's mask needs its previous token on the host: with async scheduling
    the engine reads each step back before sampling the next (as for penalties), and the
    outputs equal the synchronous engine's. (The read-back is all they share with penalties:
    no penalty pass runs for them.)"""
    runs = {}
    for mode in (False, True):
        llm = LLM(str(byte_model_dir), dtype="float32", device="cpu", max_model_len=256,
                  block_size=8, async_scheduling=mode)
        sampler = llm.engine.runner.sampler
        launch = sampler.launch
        seen: list[int] = []

        def checked(logits, requests, launch=launch, seen=seen):
            for r in requests:
                if r.guide is not None:
                    seen.append(r.num_unresolved)
            return launch(logits, requests)

        monkeypatch.setattr(sampler, "launch", checked)
        monkeypatch.setattr(sampler, "_apply_penalties", lambda *a: pytest.fail("no penalties asked"))
        params = [_params(s, structured_outputs=StructuredOutputsParams(json=SCHEMA)) for s in range(3)]
        params.append(_params(7, max_tokens=30))
        outs = llm.generate(["a", "b", "c", "d"], params, use_tqdm=False)
        runs[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        assert seen and not any(seen)  # every guided row sampled with all its tokens known
    assert runs[True] == runs[False]


def test_sampler_masks_a_copy_of_the_logits():
    """The logits may be a CUDA graph's output buffer: masking must not write into them."""
    import torch

    from flashpage.engine.sampler import Sampler
    from flashpage.engine.sequence import Request
    from flashpage.structured.guide import CompiledGuide, GuideState, TokenIndex

    vocab: list[bytes | None] = [None, None, None, b"a", b"b", b"ab", b"c"]
    guide = CompiledGuide(LazyDFA(ByteNFA(parse_regex("ab?c"))), TokenIndex(vocab, [EOS]))
    params = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="ab?c"))
    guided = Request("g", [1], params, EOS)
    guided.guide = GuideState(guide)
    free = Request("f", [1], SamplingParams(temperature=0.0), EOS)
    logits = torch.tensor([[0.0, 0, 9, 1, 2, 3, 8]] * 2)
    before = logits.clone()
    out = Sampler(len(vocab), use_kernel=False)(logits, [guided, free])
    assert out.token_ids == [5, 2]  # "ab" (best of a / ab), the unguided row's argmax (eos)
    assert torch.equal(logits, before)
