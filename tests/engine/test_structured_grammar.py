"""Grammar-guided generation end to end: a tiny random model over the byte-level tokenizer,
greedy and sampled, writes only sentences of the grammar (checked by recognizers written
in tests/structured/test_grammar.py, independent of the automaton), eos only where the
start rule may end, a max_tokens cut leaves a prefix that can still complete, and a bad
grammar fails alone."""

from __future__ import annotations

import pytest
import torch

from flashpage import LLM, SamplingParams, StructuredOutputsParams
from flashpage.structured.grammar import compile_grammar
from tests.structured.test_grammar import (
    ARITH,
    ARITH_LARK,
    JSON_GBNF,
    JSON_LARK,
    LIST_GBNF,
    arith_ok,
    json_ok,
    lark_json_ok,
    list_ok,
)

EOS = 2


@pytest.fixture(scope="module")
def llm(byte_model_dir):
    return LLM(str(byte_model_dir), dtype="float32", device="cpu", max_model_len=256, block_size=8)


def _params(seed: int | None, grammar: str, **kw) -> SamplingParams:
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=kw.pop("max_tokens", 120),
                          structured_outputs=StructuredOutputsParams(grammar=grammar), **kw)


def test_outputs_are_sentences_of_their_grammars(llm):
    cases = [(ARITH, arith_ok), (ARITH_LARK, arith_ok), (JSON_GBNF, json_ok), (JSON_LARK, lark_json_ok),
             (LIST_GBNF, list_ok)]
    prompts, params, checks = [], [], []
    for seed in (None, 0, 1, 2):  # greedy, then sampled with three seeds
        for grammar, ok in cases:
            prompts.append("Write one:")
            params.append(_params(seed, grammar))
            checks.append(ok)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    stopped = 0
    for out, ok, p in zip(outs, checks, params, strict=True):
        assert out.finish_reason in ("stop", "length")
        assert EOS not in out.token_ids[:-1]
        if out.finish_reason == "stop":
            stopped += 1
            assert ok(out.text), out.text
        else:  # cut by max_tokens: what it wrote can still be completed
            assert len(out.token_ids) == 120
            spec = p.structured_outputs
            assert spec is not None and spec.grammar is not None
            dfa = compile_grammar(spec.grammar)
            assert dfa.walk(dfa.start, out.text.encode()) != 0, out.text
    assert stopped >= len(outs) // 2
    assert llm.engine.kv_manager.stats().blocks_used == 0


def test_eos_only_where_the_grammar_may_end(llm):
    """A grammar whose sentences end on a closing bracket: eos (sampled or not) comes only
    right after one that closes everything."""
    grammar = 'root ::= "(" inner ")"\ninner ::= ("x" | "(" inner ")")*'
    for seed in range(4):
        out = llm.generate("p", _params(seed, grammar, max_tokens=60), use_tqdm=False)[0].outputs[0]
        text = out.text
        depth = 0
        for i, c in enumerate(text):
            depth += {"(": 1, ")": -1}.get(c, 0)
            assert depth > 0 or i == len(text) - 1, text  # closes everything only at the end
        if out.finish_reason == "stop":
            assert depth == 0 and text.startswith("(")


def test_max_tokens_cuts_a_recursive_grammar(llm):
    """No sentence is shorter than 30 characters: cut at 4 tokens, the request ends for
    length, its text a prefix that can still complete (as for a regex)."""
    grammar = 'root ::= "(" root ")" | "x"{30}'
    dfa = compile_grammar(grammar)
    for seed in (None, 5):
        out = llm.generate("p", _params(seed, grammar, max_tokens=4), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        assert dfa.walk(dfa.start, out.text.encode()) != 0 and not dfa.matches(out.text.encode())


def test_bad_grammar_fails_alone(llm):
    good = SamplingParams(temperature=1.0, seed=1, max_tokens=6)
    for grammar, message in [("root ::= value", "not defined"), ("start: a\na: a \"x\" | \"y\"", "left-recursive"),
                             ("root ::= \"a", "line 1, column 12")]:
        outs = llm.generate(["one", "two", "three"], [good, _params(2, grammar), good], use_tqdm=False)
        assert outs[1].error is not None and message in outs[1].error, outs[1].error
        assert outs[1].outputs == []
        assert [len(outs[i].outputs[0].token_ids) for i in (0, 2)] == [6, 6]
        assert llm.engine.kv_manager.stats().blocks_used == 0
        assert not llm.engine.has_unfinished_requests()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grammar_outputs_on_the_gpu(byte_model_dir_head64):
    """On CUDA (head_dim 64, which the Triton kernels take; async scheduling, graphs): the
    masks are copied to the device per configuration, the outputs are the CPU engine's."""
    grammar_checks = [(ARITH, arith_ok), (JSON_LARK, lark_json_ok), (JSON_GBNF, json_ok)]
    params = [_params(seed, g) for seed in (None, 0, 1) for g, _ in grammar_checks]
    runs = {}
    for device in ("cuda", "cpu"):
        llm = LLM(str(byte_model_dir_head64), dtype="float32", device=device, max_model_len=256, block_size=16)
        outs = [o.outputs[0] for o in llm.generate(["Write one:"] * len(params), params, use_tqdm=False)]
        runs[device] = [(o.text, o.finish_reason) for o in outs]
        for o, (_, ok) in zip(outs, grammar_checks * 3, strict=True):
            assert o.finish_reason == "length" or ok(o.text), o.text
        assert llm.engine.kv_manager.stats().blocks_used == 0
    # greedy outputs equal the CPU engine's (fp32 on both); sampled ones draw from another
    # generator on CUDA (the Gumbel kernel's Philox stream), so only their validity is compared
    # (run 164: the three greedy ones equal, the six sampled ones not)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    assert [runs["cuda"][i] for i in greedy] == [runs["cpu"][i] for i in greedy], runs
