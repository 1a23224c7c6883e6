"""``qwen3_xml`` tool calls (server/qwen3_coder_calls.py): qwen3_coder's tags, each parameter's
text read as vLLM's qwen3_xml parser reads it (where that differs from qwen3_coder); string
values streamed as they come once they cannot be "null", for every split of the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpage.server.qwen3_coder_calls import convert, convert_xml
from flashpage.server.tools import get_parser
from tests.server.test_qwen3_coder_calls import PROPS, TOOLS, _call
from tests.server.tool_checks import (
    LATE,
    agrees_when_cut,
    edited,
    every_split,
    sent_by_now,
    tagged_calls,
)

P = get_parser("qwen3_xml", TOOLS)
XPROPS = {**PROPS, "Days": {"type": "Integer"}, "seq": {"type": "sequence"}, "ints": {"type": "list[int]"}}


@pytest.mark.parametrize("kind,text,value", [
    # where vLLM's qwen3_xml reads a value otherwise than its qwen3_coder
    ("city", "null", None), ("city", "NULL", None), ("plain", "null", None), ("unknown", "null", None),
    ("days", "None", "None"), ("note", "None", "None"), ("tags", "[1, 2]", "[1, 2]"),
    ("note", "Paris", "Paris"), ("any", "[1, 'a']", "[1, 'a']"), ("any", "42", "42"), ("Days", "3", "3"),
    ("opts", "\"{'a': 1}\"", "{'a': 1}"), ("opts", '{"a": "it\'s", "b": true}', '{"a": "it\'s", "b": true}'),
    ("seq", "[1, 'a', None]", [1, "a", None]), ("ints", '["a", true]', '["a", true]'), ("ints", "(1, 2)", [1, 2]),
    # and where the two agree
    ("city", "Paris", "Paris"), ("days", "3", 3), ("days", "1_000", 1000), ("days", "3.5", "3.5"),
    ("temp", "21.0", 21), ("temp", "21.5", 21.5), ("temp", "inf", "inf"), ("metric", "True", True),
    ("metric", "yes", False), ("opts", '{"a": [1, 2.50]}', {"a": [1, 2.5]}), ("opts", "{'a': (1, None)}", {"a": [1, None]}),
    ("opts", "not json", "not json"), ("unknown", "42", "42"),
])
def test_values_are_read_as_vllms_qwen3_xml(kind, text, value):
    assert convert_xml(text, XPROPS.get(kind)) == value
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": XPROPS}}}]
    [call] = get_parser("qwen3_xml", tools).extract(_call("f", (kind, text)))[1]
    assert json.loads(call.arguments) == {kind: value}


def test_calls_content_and_what_qwen3_coder_reads_otherwise():
    text = "Let me check.\n" + _call("get_weather", ("city", "null"), ("days", "3"), ("note", "None")) + "\nDone."
    content, calls = P.extract(text)
    assert content == "Let me check.\n\nDone."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": null, "days": 3, "note": "None"}')]
    coder = get_parser("qwen3_coder", TOOLS).extract(text)
    assert coder[0] == content and coder[1][0].arguments == '{"city": "null", "days": 3, "note": null}'
    assert convert("null", PROPS["city"]) == "null"


@pytest.mark.parametrize("text", [
    "No calls here.", "<tool_call>", "<tool_call><function=f><parameter=a>1</function></tool_call>",
    "<tool_call>\n<function=f>\n<parameter=a>\nnull\n</parameter>\n", "<tool_call>{\"name\": \"f\"}</tool_call>",
])
def test_not_calls(text):
    assert P.extract(text) == (text, [])


ANSWERS = [  # the model's text, the content a stream sends (None: the text), calls or LATE
    ("Checking.\n" + _call("get_weather", ("city", "null"), ("note", "Nullable <b>\n"), ("plain", "nu"),
                           ("x", "NULL\n"), ("days", "null")), "Checking.\n", 1),
    ("A " + _call("f", ("a", "")) + " B " + _call("g", ("x", "</param")) + " C", "A B  C", 2),
    ("<tool_call><function=get_weather><parameter=city>nul", None, LATE),
]


@pytest.mark.parametrize("text,content,want", ANSWERS)
def test_streamed_in_every_split(text, content, want):
    every_split(P, text, content, want)


@pytest.mark.parametrize("text,sent", [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n", [("get_weather", '{"city": ')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNul", [("get_weather", '{"city": ')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nnull\n", [("get_weather", '{"city": ')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nnulls", [("get_weather", '{"city": "nulls')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [("get_weather", '{"city": "Par')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nnull\n</parameter>", [("get_weather", '{"city": null')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=note>\nPar", [("get_weather", '{"note": "Par')]),
])
def test_strings_go_out_once_they_cannot_be_null(text, sent):
    assert sent_by_now(P, text) == sent




@settings(max_examples=150, deadline=None)
@given(calls=tagged_calls(PROPS, "ab <>/=\n\"'\\{}[]1.é", ["</parameter", "null", "Nu", "true"], "</parameter>"),
       prefix=st.text(alphabet="ab .\n<", max_size=5), data=st.data())
def test_any_calls_any_split(calls, prefix, data):
    """Random calls (values with tags, quotes, "null"s; every schema type), maybe cut off
    anywhere: the stream agrees with the non-streamed reading."""
    text = prefix + "\n".join(_call(n, *params) for n, params in calls)
    assert [c.name for c in P.extract(text)[1]] == [n for n, _ in calls]
    if data.draw(st.booleans()):
        text = text[:data.draw(st.integers(0, len(text)))]
    agrees_when_cut(P, text, data)


@settings(max_examples=150, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[2] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list("<>/=\nNul") + ["</parameter>", "null", "</function>"])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    agrees_when_cut(P, edited(answer[0], edits), data)
