"""``qwen3_coder`` tool calls (server/qwen3_coder_calls.py): XML-like blocks whose parameter
texts are read by the type the request's tool schema gives them, as vLLM reads them;
streamed with string values character by character, for every split of the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpage.server.qwen3_coder_calls import convert
from flashpage.server.tools import get_parser
from tests.server.tool_checks import (
    LATE,
    agrees_when_cut,
    edited,
    every_split,
    sent_by_now,
    tagged_calls,
)

PROPS = {"city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
         "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": ["array", "null"]},
         "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "any": {"type": "any"}, "plain": {}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": PROPS}}},
         {"type": "function", "function": {"name": "get_time"}}]
P = get_parser("qwen3_coder", TOOLS)


def _call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("kind,text,value", [
    ("city", "Paris", "Paris"), ("city", "null", "null"), ("city", " 3 ", " 3 "),
    ("days", "3", 3), ("days", "+3", 3), ("days", "1_000", 1000), ("days", "3.5", "3.5"), ("days", "None", None),
    ("temp", "21.5", 21.5), ("temp", "21.0", 21), ("temp", "1e3", 1000), ("temp", "warm", "warm"),
    ("temp", "nan", "nan"), ("temp", "inf", "inf"),
    ("metric", "true", True), ("metric", "True", True), ("metric", "yes", False), ("metric", "false", False),
    ("opts", '{"a": [1, 2.50]}', {"a": [1, 2.5]}), ("opts", "{'a': (1, None)}", {"a": [1, None]}),
    ("opts", "\"{'a': 1}\"", {"a": 1}), ("opts", "not json", "not json"), ("opts", "{1, 2}", "{1, 2}"),
    ("tags", "[1, 2]", [1, 2]), ("tags", "null", None),
    ("note", "null", None), ("note", "None", None), ("note", "Paris", "Paris"),
    ("any", "[1, 'a']", [1, "a"]), ("any", "  42", 42), ("any", "hello", "hello"), ("plain", "42", "42"),
    ("unknown", "42", "42"),
])
def test_values_are_read_by_their_schema_type(kind, text, value):
    assert convert(text, PROPS.get(kind)) == value
    assert json.loads(P.extract(_call("get_weather", (kind, text)))[1][0].arguments) == {kind: value}


def test_calls_and_content():
    text = ("Let me check.\n" + _call("get_weather", ("city", 'Par"is\n'), ("days", "3"), ("extra", "5")) + "\n"
            + _call("get_time") + "\nDone.")
    content, calls = P.extract(text)
    assert content == "Let me check.\n\n\nDone."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Par\\"is\\n", "days": 3, "extra": "5"}'), ("get_time", "{}")]
    # the same answer for a request without tools: every value its text
    assert json.loads(get_parser("qwen3_coder").extract(text)[1][0].arguments) == {
        "city": 'Par"is\n', "days": "3", "extra": "5"}
    # the model stopped before </tool_call>: still a call; a repeated parameter kept, as JSON keys are
    [call] = P.extract("<tool_call><function=f><parameter=a>1</parameter><parameter=a>2</parameter></function>")[1]
    assert call.arguments == '{"a": "1", "a": "2"}'


@pytest.mark.parametrize("text", [
    "No calls here.", "<tool_call>", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n",
    "<tool_call><function=f><parameter=a>1</function></tool_call>",
    "<tool_call>{\"name\": \"f\"}</tool_call>", "<tool_call><function={{ name }}></function></tool_call>",
    "<tool_call><function=f>text<parameter=a>1</parameter></function></tool_call>",
    "<tool_call><function=f></function> and words </tool_call>", "<tool_call><function=></function></tool_call>",
    "<tool_call><function=f><parameter=>1</parameter></function></tool_call>",
])
def test_not_calls(text):
    assert P.extract(text) == (text, [])


ANSWERS = [  # the model's text, the content a stream sends (None: the text), calls or LATE
    ("Checking.\n" + _call("get_weather", ("city", "Paris <b>\n\n"), ("days", "3"), ("opts", '{"a": "\\u00e9"}')),
     "Checking.\n", 1),
    (_call("get_weather", ("note", "null"), ("temp", "-1.50"), ("metric", "True"), ("tags", "['x']"))
     + _call("get_time", ("zone", "<UTC>\n")), "", 2),
    ("A " + _call("f") + " B " + _call("g", ("x", "</param")) + " C", "A B  C", 2),
    ("<tool_call><function=f><parameter=a></parameter></function>", "", 1),
    ("a <tool> and <tool_call is not a call", None, 0),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>", None, LATE),
    ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\noops</function>", None, LATE),
    ("<tool_call><function=get_weather><parameter=city>Par", None, LATE),
]


@pytest.mark.parametrize("text,content,want", ANSWERS)
def test_streamed_in_every_split(text, content, want):
    every_split(P, text, content, want)


@pytest.mark.parametrize("text,sent", [
    ("<tool_call>\n<function=get_wea", []),
    ("<tool_call>\n<function=get_weather>", [("get_weather", "")]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [("get_weather", '{"city": "Par')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar\"is\n", [("get_weather", '{"city": "Par\\"is')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis</para", [("get_weather", '{"city": "Paris')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n12", [("get_weather", '{"days": ')]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\n12\n</parameter>\n<parameter=x>\n",
     [("get_weather", '{"days": 12, "x": "')]),
    ("<tool_call>\n<function=f>\n</function>\n</tool_call>\n<tool_call>\n<function=g>",
     [("f", "{}"), ("g", "")]),
])
def test_arguments_go_out_as_they_are_written(text, sent):
    assert sent_by_now(P, text) == sent




@settings(max_examples=150, deadline=None)
@given(calls=tagged_calls(PROPS, "ab <>/=\n\"\\{}[]1.é", ["</parameter", "<parameter=", "null"], "</parameter>"),
       prefix=st.text(alphabet="ab .\n<", max_size=5), data=st.data())
def test_any_calls_any_split(calls, prefix, data):
    """Random calls (values with tags, quotes, newlines; every schema type), maybe cut off
    anywhere: the stream agrees with the non-streamed reading for random splits and for one
    character a delta."""
    text = prefix + "\n".join(_call(n, *params) for n, params in calls)
    full = P.extract(text)[1]
    assert [c.name for c in full] == [n for n, _ in calls]
    if data.draw(st.booleans()):
        text = text[:data.draw(st.integers(0, len(text)))]
    agrees_when_cut(P, text, data)


@settings(max_examples=200, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[2] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list("<>/=\n ab1") + ["</parameter>", "<parameter=a>",
                                                                                   "</function>", "<tool_call>"])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    text = edited(answer[0], edits)
    agrees_when_cut(P, text, data)
