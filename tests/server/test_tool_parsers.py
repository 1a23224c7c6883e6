"""Tool-call parsers (server/tools.py): each family's answer to OpenAI tool calls, text that
is not a well-formed call left as content; and streaming (server/tool_stream.py), for every
split of the answer into deltas: content up to a call, each call's header as soon as its
name is written, then its arguments in pieces that add up to the non-streamed arguments."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from flashpage.server.tool_choice import _ForcedCalls
from flashpage.server.tool_stream import ToolStream
from flashpage.server.tools import ToolParser, get_parser

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


def test_granite():
    p = get_parser("granite")
    for text in ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
                 ' <tool_call> [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]\n',
                 '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'):
        content, calls = p.extract(text)
        assert content is None and _calls(calls) == [("get_weather", WEATHER)]
    for text in ('Sure. [{"name": "f", "arguments": {}}]', '<tool_call>{"name": "f", "arguments": {}}',
                 '[{"name": "f", "arguments": {}}] and more', "[]", '[{"name": "f"}, 3]'):
        assert p.extract(text) == (text, [])


def test_jamba():
    p = get_parser("jamba")
    content, calls = p.extract('Sure. <tool_calls>[{"name": "get_weather", "arguments": '
                               '{"city": "Paris", "unit": "celsius"}}]</tool_calls>\n')
    assert content == "Sure." and _calls(calls) == [("get_weather", WEATHER)]
    for text in ('<tool_calls>[{"name": "f", "arguments": {}}]', '<tool_calls>[{"name": "f", "arguments": {}}]'
                 '</tool_calls> and more', "<tool_calls>[]</tool_calls>", "<tool_calls>{}</tool_calls>"):
        assert p.extract(text) == (text, [])


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen9'"):
        get_parser("qwen9")


def test_repeated_keys():
    p = get_parser("hermes")
    # arguments keep every member (a client reading them gets the last value, as from the model's text)
    [call] = p.extract('<tool_call>{"name": "f", "arguments": {"a": 1, "b": 2, "a": 3}}</tool_call>')[1]
    assert call.arguments == '{"a": 1, "b": 2, "a": 3}' and json.loads(call.arguments) == {"a": 3, "b": 2}
    # a call naming itself twice, or with two arguments objects, is not a call: which would count?
    for bad in ('<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": {}, "arguments": {"a": 1}}</tool_call>'):
        assert p.extract(bad) == (bad, [])


def _parser(name: str) -> ToolParser:
    if name == "named":
        return _ForcedCalls("get_weather")
    if name == "required":
        return _ForcedCalls(None)
    return get_parser(name)


LATE = "late"  # not calls, found out only after a call went out (it cannot be taken back)
ANSWERS = [  # parser, the model's text, the content a stream sends (None: the text), calls or LATE
    ("hermes", 'Checking <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}</tool_call>', "Checking ", 1),
    ("hermes", 'Let me check. <tool_call>\n{"name":"get_weather","arguments":{"city":"Par\\u00eds \\ud83d\\ude00",'
               '"days":12,"opts":{"x":[1.50,true,null,-0,1E2],"y":"\\"q\\" \\n"}}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
     "Let me check. ", 2),
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "", 1),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1, "x": [2]}}', "", 1),
    ("hermes", 'A <tool_call>{"name": "f", "arguments": {}}</tool_call> B <tool_call>{"name": "g"}</tool_call> C',
     "A B  C", 2),
    ("hermes", "a <tool> tag and <tool_call is not a call", None, 0),
    ("hermes", "<tool_call>{not json}</tool_call>", None, 0),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}} </tool_call>', None, LATE),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": "Pa', None, LATE),
    ("hermes", '<tool_call>{"name": "f", "name": "g", "arguments": {"a": 1}}</tool_call>', None, LATE),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {}}', "", 2),
    ("llama3_json", ' {"name": "f", "arguments": {"a": [1]}}\n', " ", 1),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}, "arguments": {"b": 2}}', "", 1),
    ("llama3_json", '{"name": "f", "arguments": {"b": 2}, "parameters": {"a": 1}}', "", 1),
    ("llama3_json", '{"name":"a","parameters":{"x":-1.5e3}}{"name":"b","parameters":{}};;', "", 2),
    ("llama3_json", "Plain words {with braces}", None, 0),
    ("llama3_json", "   {broken", None, 0),
    ("llama3_json", '{"name": "f", "parameters": {}} and then text', None, LATE),
    ("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {}}]', "ok ", 1),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "z"}}] ',
     "", 2),
    ("mistral", '[TOOL_CALLS]{"name": "a", "arguments": {"x": 1}}', "", 1),
    ("mistral", "[TOOL_ no", None, 0),
    ("mistral", "[TOOL_CALLS] nope", None, 0),
    ("mistral", "[TOOL_CALLS][]", None, 0),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, 5]', None, LATE),
    ("granite", '<|tool_call|>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]', "", 2),
    ("granite", 'Plain words [not calls]', None, 0),
    ("jamba", 'ok <tool_calls>[{"name": "a", "arguments": {"x": 1}}]</tool_calls>', "ok ", 1),
    ("jamba", 'ok <tool_calls>[{"name": "a", "arguments": {"x": 1}}]', None, LATE),
    ("named", '{"city": "Paris", "days": 3}', "", 1),
    ("named", ' { "city" : "Par\\u00eds" ,\n "days" : 3 } ', "", 1),
    ("named", '{"city": "Pa', None, LATE),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, '
                 '{"name": "get_time", "parameters": {"zone": "UTC"}}]', "", 2),
    ("required", '[{"name": "get_time", "parameters": {"zone": "UT', None, LATE),
]


def _stream(name: str, pieces: list[str]) -> tuple[str, list[dict], list]:
    """The pieces through a ToolStream: (content sent, tool-call delta entries, final calls)."""
    stream, content, entries = ToolStream(_parser(name)), "", []
    for piece in pieces[:-1]:
        text, deltas = stream.feed(piece)
        content += text
        entries += deltas
    rest, deltas, calls = stream.finish(pieces[-1])
    return content + (rest or ""), entries + deltas, calls


def _merged(entries: list[dict]) -> list[dict]:
    """Entries by call, checking their shape: a call's first entry names it (id, type,
    name; the id ours, or the model's own where its format gives one: Kimi K2's
    ``functions.NAME:INDEX``), the rest carry only arguments; calls begin in order."""
    calls: list[dict] = []
    for e in entries:
        i, f = e["index"], e["function"]
        if i == len(calls):
            assert set(e) == {"index", "id", "type", "function"} and e["type"] == "function", e
            assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{24}|[^:]+:\d+", e["id"]), e
            assert set(f) == {"name", "arguments"}, e
            calls.append({"id": e["id"], "name": f["name"], "arguments": f["arguments"]})
        else:
            assert i < len(calls) and set(e) == {"index", "function"} and set(f) == {"arguments"}, e
            assert f["arguments"], e  # no empty pieces
            calls[i]["arguments"] += f["arguments"]
    return calls


def _splits(text: str) -> list[list[str]]:
    """Every cut in two, many in three, and one character a delta."""
    cuts = [(i,) for i in range(len(text) + 1)] + [(i, j) for i in range(0, len(text), 7)
                                                   for j in range(i, len(text), 5)]
    out = []
    for cut in cuts:
        bounds = [0, *cut, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return out + [list(text) + [""]]


@pytest.mark.parametrize("name,text,content,want", ANSWERS)
def test_streamed_in_every_split(name, text, content, want):
    """However the answer is cut into deltas: the calls are the non-streamed answer's, each
    one's argument pieces add up to its non-streamed arguments; an answer that is not calls
    goes out as content, all of it (with, if it looked like calls at first, what of them
    had gone out by then)."""
    ref_content, ref_calls = _parser(name).extract(text)
    assert len(ref_calls) == (0 if want == LATE else want)
    for pieces in _splits(text):
        sent, entries, calls = _stream(name, pieces)
        streamed = _merged(entries)
        if ref_calls:
            assert sent == content, (pieces, sent)
            assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in ref_calls]
            assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in calls], pieces
            assert [c["id"] for c in streamed] == [c.id for c in calls]
        else:
            assert sent == text and calls == [], (pieces, sent)
            if want != LATE:
                assert entries == [], pieces  # it never looked like a call
            for c in streamed:  # what went out was the start of what the model wrote
                assert c["name"] in text or name == "named"


STREAMED = [  # the text so far -> the calls sent by then (name, arguments so far)
    ("hermes", 'Hi <tool_call>{"name": "get_we', []),
    ("hermes", 'Hi <tool_call>{"name": "get_weather"', [("get_weather", "")]),
    ("hermes", 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Par',
     [("get_weather", '{"city": "Par')]),
    ("hermes", 'Hi <tool_call>{"name": "get_weather", "arguments": {"city":"Paris","days":1',
     [("get_weather", '{"city": "Paris", "days": ')]),
    ("hermes", 'Hi <tool_call>{"name": "get_weather", "arguments": {"city":"Paris","days":12}}</tool_ca',
     [("get_weather", '{"city": "Paris", "days": 12}')]),
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"a',
     [("f", "{}"), ("g", '{"a')]),
    ("hermes", 'Hi <tool_call>{"arguments": {"city": "Par', []),
    ("hermes", 'Hi <tool_call>{"name": "f", "arguments": "{\\"a\\": ', [("f", "")]),  # held until it closes
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": [1, "y', [("f", '{"x": [1, "y')]),
    ("llama3_json", '{"name": "f", "arguments": {"x": [1, "y', [("f", "")]),  # parameters may follow
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "z',
     [("a", '{"x": 1}'), ("b", '{"y": "z')]),
    ("granite", '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "z',
     [("a", '{"x": 1}'), ("b", '{"y": "z')]),
    ("jamba", 'Hi <tool_calls>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": "z',
     [("a", '{"x": 1}'), ("b", '{"y": "z')]),
    ("named", ' {"city": "Par', [("get_weather", '{"city": "Par')]),
    ("required", '[{"name": "get_time", "parameters": {"zone": "U', [("get_time", '{"zone": "U')]),
]


@pytest.mark.parametrize("name,text,sent", STREAMED)
def test_arguments_go_out_as_they_are_written(name, text, sent):
    """Before the answer ends: each call's name once it is complete, its arguments as far as
    the rest of the text cannot change them (a number waits for the character after it)."""
    for pieces in (list(text), [text]):
        stream, entries = ToolStream(_parser(name)), []
        for piece in pieces:
            entries += stream.feed(piece)[1]
        assert [(c["name"], c["arguments"]) for c in _merged(entries)] == sent, pieces


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
_call_lists = st.lists(st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                            st.dictionaries(st.text(max_size=4), _json_values, max_size=4)), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["hermes", "llama3_json", "mistral", "granite", "jamba"]), calls=_call_lists,
       spacing=st.sampled_from([dict(), dict(separators=(",", ":")), dict(indent=1, ensure_ascii=False)]),
       prefix=st.text(alphabet="ab .\n", max_size=5), data=st.data())
def test_any_calls_any_split(name, calls, spacing, prefix, data):
    """Random calls written the way each family writes them (spacing, escapes, numbers as the
    model may write them), maybe cut off anywhere: the stream agrees with the non-streamed
    reading for random splits and for one character a delta."""
    key = "parameters" if name == "llama3_json" else "arguments"
    objs = [json.dumps({"name": n, key: a}, **spacing) for n, a in calls]
    if name == "hermes":
        text = prefix + "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    elif name == "llama3_json":
        text = "<|python_tag|>" + "; ".join(objs)
    elif name == "jamba":
        text = prefix + "<tool_calls>" + json.dumps([{"name": n, key: a} for n, a in calls], **spacing) + \
            "</tool_calls>"
    elif name == "granite":
        text = prefix.replace("a", " ").replace("b", "") + "<|tool_call|>" + \
            json.dumps([{"name": n, key: a} for n, a in calls], **spacing)
    else:
        text = prefix + "[TOOL_CALLS]" + json.dumps([{"name": n, key: a} for n, a in calls], **spacing)
    text = text[:data.draw(st.integers(0, len(text)))] if data.draw(st.booleans()) else text
    ref_content, ref_calls = get_parser(name).extract(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=3)))
    bounds = [0, *cuts, len(text)]
    for pieces in ([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], list(text) + [""]):
        sent, entries, got = _stream(name, pieces)
        streamed = _merged(entries)
        if ref_calls:
            assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in ref_calls]
            assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in got]
        else:
            assert sent == text and got == []


@settings(max_examples=300, deadline=None)
@given(answer=st.sampled_from(ANSWERS), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list('{}[]",: ;1e.\\u<>/\n') + ['"name"', "true"])),
    min_size=1, max_size=3), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    """The answers above with characters inserted, deleted or replaced: never an error;
    calls only as the non-streamed reading has them, else all the text as content."""
    name, text = answer[0], answer[1]
    for at, how, ch in edits:
        at %= len(text) + 1
        text = text[:at] + ("" if how == 1 else ch) + text[at + (how > 0):]
    _, ref_calls = _parser(name).extract(text)
    event(f"{len(ref_calls)} calls")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=3)))
    bounds = [0, *cuts, len(text)]
    for pieces in ([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], list(text) + [""]):
        sent, entries, got = _stream(name, pieces)
        streamed = _merged(entries)
        if ref_calls:
            assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in ref_calls]
        else:
            assert sent == text and got == []
