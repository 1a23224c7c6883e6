"""``glm45`` tool calls (server/glm_calls.py): GLM-4.5's tagged key / value pairs, a value read
as text where the tool declares a string, else as JSON or a Python literal, as vLLM reads it;
streamed with string values character by character, for every split of the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpage.server.glm_calls import deserialize
from flashpage.server.tools import get_parser
from tests.server.tool_checks import (
    LATE,
    agrees_when_cut,
    edited,
    every_split,
    sent_by_now,
    tagged_calls,
)

PROPS = {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"},
         "note": {"type": ["string", "null"]}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": PROPS}}},
         {"type": "function", "function": {"name": "get_time"}}]
P = get_parser("glm45", TOOLS)


def _call(name: str, *args: tuple[str, str]) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args)
    return f"<tool_call>{name}\n{body}</tool_call>"


@pytest.mark.parametrize("key,text,value", [
    ("city", "Paris", "Paris"), ("city", " 3 ", "3"), ("city", "null", "null"), ("city", "\na b\n", "a b"),
    ("days", "3", 3), ("days", "3.50", 3.5), ("days", "three", "three"), ("days", "null", None),
    ("days", "NaN", "NaN"), ("days", "1e999", "1e999"),
    ("opts", '{"a": [1, true]}', {"a": [1, True]}), ("opts", '{\\"a\\": 1}', {"a": 1}),
    ("opts", "{'a': (1, None)}", {"a": [1, None]}), ("opts", "{1, 2}", "{1, 2}"), ("opts", "not json", "not json"),
    ("note", "42", 42), ("extra", '"quoted"', "quoted"), ("extra", "True", True),
])
def test_values_are_read_as_vllm_reads_them(key, text, value):
    assert json.loads(P.extract(_call("get_weather", (key, text)))[1][0].arguments) == {key: value}
    if PROPS.get(key, {}).get("type") != "string":
        assert deserialize(text.strip()) == value


def test_calls_and_content():
    text = ("Let me check.\n" + _call("get_weather", ("city", 'Par"is\n'), ("days", "3"), ("extra", "5")) + "\n"
            + _call("get_time") + "\nDone.")
    content, calls = P.extract(text)
    assert content == "Let me check.\n\n\nDone."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Par\\"is", "days": 3, "extra": 5}'), ("get_time", "{}")]
    # the same answer for a request without tools: every value read as JSON where it is
    assert json.loads(get_parser("glm45").extract(text)[1][0].arguments) == {"city": 'Par"is', "days": 3, "extra": 5}
    [call] = P.extract("<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key>"
                       "<arg_value>2</arg_value></tool_call>")[1]
    assert call.arguments == '{"a": 1, "a": 2}'  # a repeated argument kept, as JSON keys are
    assert P.extract("<tool_call>get_time</tool_call>")[1][0].arguments == "{}"


@pytest.mark.parametrize("text", [
    "No calls.", "<tool_call>", "<tool_call>f\n", _call("f", ("a", "1"))[:-len("</tool_call>")],
    "<tool_call>\n</tool_call>", "<tool_call>a b\n</tool_call>", "<tool_call>f\ntext</tool_call>",
    "<tool_call>f\n<arg_key>a</arg_key>x<arg_value>1</arg_value></tool_call>",
    "<tool_call>f\n<arg_key>a</arg_key></tool_call>", "<tool_call>f\n<arg_key>a<b</arg_key><arg_value>1</arg_value></tool_call>",
    "<tool_call>f\n<arg_value>1</arg_value></tool_call>", "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</tool_call>",
])
def test_not_calls(text):
    assert P.extract(text) == (text, [])


ANSWERS = [  # the model's text, the content a stream sends (None: the text), calls or LATE
    ("Sure. " + _call("get_weather", ("city", " Par\\is é "), ("days", "12"), ("opts", "{'x': [1.50, None]}"))
     + _call("get_time", ("zone", "UTC")), "Sure. ", 2),
    (_call("get_weather", ("city", "")) + "\nThat is all.", "That is all.", 1),
    ("<tool_cal no", None, 0),
    (_call("get_weather", ("city", "a")) + "<tool_call>g\n<arg_key>a", None, LATE),
    (_call("get_weather", ("city", "a")) + "<tool_call>g\nx", None, LATE),
]


@pytest.mark.parametrize("text,content,want", ANSWERS)
def test_streamed_in_every_split(text, content, want):
    every_split(P, text, content, want)


@pytest.mark.parametrize("text,sent", [
    ("<tool_call>get_wea", []),
    ("<tool_call>get_weather\n", [("get_weather", "")]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value> Par", [("get_weather", '{"city": "Par')]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Par is \n", [("get_weather", '{"city": "Par is')]),
    ("<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_va", [("get_weather", '{"city": "Paris')]),
    ("<tool_call>get_weather\n<arg_key>days</arg_key><arg_value>12", [("get_weather", '{"days": ')]),
    ("<tool_call>get_weather\n<arg_key>days</arg_key><arg_value>12</arg_value><arg_key>x</arg_key>",
     [("get_weather", '{"days": 12, "x": ')]),
    ("<tool_call>f\n</tool_call><tool_call>g\n", [("f", "{}"), ("g", "")]),
])
def test_arguments_go_out_as_they_are_written(text, sent):
    assert sent_by_now(P, text) == sent




@settings(max_examples=150, deadline=None)
@given(calls=tagged_calls(PROPS, "ab <>/\n \t\"\\{}[]1.é'", ["</arg_value", "<arg_key>", "null", "\u3000"], "</arg_value>"),
       prefix=st.text(alphabet="ab .\n<", max_size=5), data=st.data())
def test_any_calls_any_split(calls, prefix, data):
    """Random calls (values with tags, quotes, whitespace; string and other parameters), maybe
    cut off anywhere: the stream agrees with the non-streamed reading for random splits and
    for one character a delta."""
    text = prefix + "\n".join(_call(n, *args) for n, args in calls)
    full = P.extract(text)[1]
    assert [c.name for c in full] == [n for n, _ in calls]
    if data.draw(st.booleans()):
        text = text[:data.draw(st.integers(0, len(text)))]
    agrees_when_cut(P, text, data)


@settings(max_examples=200, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[2] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list("<>/\n ab1") + ["</arg_value>", "<arg_key>a</arg_key>",
                                                                                  "<arg_value>", "</tool_call>"])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    text = edited(answer[0], edits)
    agrees_when_cut(P, text, data)
