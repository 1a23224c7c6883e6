"""Tool-call parsers (server/tools.py): each family's answer to OpenAI tool calls, text that
is not a well-formed call left as content, and streaming that holds back only what may
start a call, for every split of the answer into deltas."""

from __future__ import annotations

import json

import pytest

from flashpage.server.tools import ToolStream, get_parser

WEATHER = {"city": "Paris", "unit": "celsius"}


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes():
    p = get_parser("hermes")
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    content, calls = p.extract(text)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", WEATHER), ("get_time", {})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("chatcmpl-tool-")
    # the model stopped before the closing tag: still a call
    assert _calls(p.extract('<tool_call>{"name": "f", "arguments": {"x": 1}}')[1]) == [("f", {"x": 1})]
    for bad in ("no calls here", "<tool_call>{not json}</tool_call>",
                '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": 3}</tool_call>'):
        assert p.extract(bad) == (bad, [])


def test_llama3_json():
    p = get_parser("llama3_json")
    content, calls = p.extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                               '"unit": "celsius"}}; {"name": "get_time", "parameters": {}}')
    assert content is None and _calls(calls) == [("get_weather", WEATHER), ("get_time", {})]
    assert _calls(p.extract(' {"name": "f", "arguments": {"a": [1]}}\n')[1]) == [("f", {"a": [1]})]
    for text in ("The answer is {1}.", '{"name": "f", "parameters": {}} and then text', "{broken"):
        assert p.extract(text) == (text, [])


def test_mistral():
    p = get_parser("mistral")
    content, calls = p.extract('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": '
                               '{"city": "Paris", "unit": "celsius"}}]')
    assert content == "Sure." and _calls(calls) == [("get_weather", WEATHER)]
    assert p.extract("[TOOL_CALLS] nope") == ("[TOOL_CALLS] nope", [])


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen9'"):
        get_parser("qwen9")


ANSWERS = [
    ("hermes", 'Checking <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}</tool_call>', "Checking ", [("get_weather", WEATHER)]),
    ("hermes", "a <tool> tag and <tool_call is not a call", "a <tool> tag and <tool_call is not a call", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     "", [("get_weather", WEATHER)]),
    ("llama3_json", "Plain words {with braces}", "Plain words {with braces}", []),
    ("llama3_json", "   {broken", "   {broken", []),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {}}]', "ok ", [("f", {})]),
    ("mistral", "[TOOL_ no", "[TOOL_ no", []),
]


@pytest.mark.parametrize("name,text,content,want", ANSWERS)
def test_streamed_in_every_split(name, text, content, want):
    """Every way of cutting the answer into two or three deltas: the content sent is the
    text before the call (all of it when nothing parses), never a piece of a call."""
    cuts = [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(0, len(text), 7)
                                                   for j in range(i, len(text), 5)]
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        stream = ToolStream(get_parser(name))
        sent = "".join(stream.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
        rest, calls = stream.finish()
        if want:
            assert sent == content and rest is None, (cut, sent, rest)
            assert _calls(calls) == want
        else:
            assert sent + (rest or "") == text and calls == [], (cut, sent, rest)
