"""Structured outputs after the thinking (structured/reasoning_prefix.py): free text up to
</think>, then the pattern; against a plain reference on random strings, through a guide's
masks over a vocabulary, and through the server with a reasoning parser."""

from __future__ import annotations

import random
import re

import pytest
import torch

from flashpage.sampling_params import StructuredOutputsError, StructuredOutputsParams
from flashpage.structured.automaton import ByteNFA, LazyDFA
from flashpage.structured.compiler import GuideCompiler
from flashpage.structured.grammar import compile_grammar
from flashpage.structured.guide import CompiledGuide, GuideState, TokenIndex
from flashpage.structured.reasoning_prefix import ThinkingThenDFA
from flashpage.structured.regex_parser import parse_regex

WS = " \t\n\r"


def _after_thinking(rest: str, pattern: str) -> bool:
    """rest = optional whitespace, then the pattern."""
    return any(rest[:j].strip(WS) == "" and re.fullmatch(pattern, rest[j:]) for j in range(len(rest) + 1))


def _reference(text: str, pattern: str, mode: str) -> bool:
    if mode == "optional":
        if re.fullmatch(pattern, text):
            return True
        body = text.lstrip(WS)
        if not body.startswith("<think>"):
            return False
        text = body[len("<think>"):]
    end = text.find("</think>")
    return end >= 0 and _after_thinking(text[end + len("</think>"):], pattern)


@pytest.mark.parametrize("mode", ["first", "optional"])
@pytest.mark.parametrize("pattern", ["x+", "a?x", "[ax]{2}"])
def test_against_a_plain_reference(mode, pattern):
    dfa = ThinkingThenDFA(LazyDFA(ByteNFA(parse_regex(pattern))), mode)
    rng = random.Random(len(pattern) * 7 + len(mode))
    parts = ["<think>", "</think>", "<", "</", "think", ">", "a", "x", " ", "\n", "</think"]
    samples = {"x+": ["x", "xx"], "a?x": ["ax", "x"], "[ax]{2}": ["ax", "xx", "aa"]}[pattern]
    hits = 0
    for i in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 7)))
        if i % 2:  # built to match, then perhaps spoiled
            think = text.replace("</think>", "")
            text = rng.choice(["", " <think>", "<think>"]) + think + "</think>" + \
                rng.choice(["", "\n", " \n "]) + rng.choice(samples)
            if rng.random() < 0.3:
                k = rng.randrange(len(text))
                text = text[:k] + rng.choice(parts) + text[k + 1:]
        want = _reference(text, pattern, mode)
        hits += want
        assert dfa.matches(text.encode()) == want, (mode, pattern, text)
    assert 300 < hits < 2700  # both answers exercised


def test_a_recursive_grammar_after_the_thinking():
    inner = compile_grammar('root ::= "(" root ")" | "x"')
    dfa = ThinkingThenDFA(inner, "first")
    assert dfa.matches(b"hmm ( </think>\n((x))")
    assert not dfa.matches(b"hmm </think>((x)")
    assert not dfa.matches(b"((x))")


def test_masks_follow_the_thinking_then_the_pattern():
    vocab: list[bytes | None] = [None, b"<", b"/", b"think", b">", b"</think>", b"ok", b"a", b"b",
                                 b"\n", b"Z", b"</", b"k>"]
    eos = 0
    guide = CompiledGuide(ThinkingThenDFA(LazyDFA(ByteNFA(parse_regex("[ab]+"))), "first"),
                          TokenIndex(vocab, [eos]))
    state = GuideState(guide)
    cpu = torch.device("cpu")
    everything = set(range(1, len(vocab)))
    assert set(state.mask(cpu).nonzero().flatten().tolist()) == everything  # thinking: free, no eos
    for t in (6, 10, 11, 3):  # "ok", "Z", "</", "think"
        state.advance(t)
        assert set(state.mask(cpu).nonzero().flatten().tolist()) == everything
    state.advance(4)  # ">": the thinking ended
    allowed = set(state.mask(cpu).nonzero().flatten().tolist())
    assert allowed == {7, 8, 9}  # the pattern's first bytes, or whitespace
    state.advance(9)
    state.advance(7)
    assert set(state.mask(cpu).nonzero().flatten().tolist()) == {7, 8, eos}


def test_the_spec_field():
    with pytest.raises(StructuredOutputsError, match="reasoning must be"):
        StructuredOutputsParams(regex="a", reasoning="always")
    a = StructuredOutputsParams(regex="a", reasoning="first")
    assert a.cache_key() != StructuredOutputsParams(regex="a").cache_key()


def test_the_compiler_wraps_the_pattern(byte_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(byte_model_dir)
    compiler = GuideCompiler(tok, 320, [2])
    guide = compiler.compile(StructuredOutputsParams(json_object=True, reasoning="optional"))
    assert isinstance(guide.dfa, ThinkingThenDFA)
    s = guide.dfa.walk(guide.dfa.start, b'<think>I will answer.</think>\n\n{"a": 1}')
    assert guide.dfa.accepting[s]
    assert guide.dfa.accepting[guide.dfa.walk(guide.dfa.start, b'{"a": 1}')]
