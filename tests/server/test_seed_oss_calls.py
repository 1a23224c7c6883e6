"""``seed_oss`` tool calls (server/seed_oss_calls.py): qwen3_coder's function and parameter tags
inside ``<seed:tool_call>``, each parameter's text read as vLLM's seed_oss parser reads it;
string values streamed as they come once they cannot be "null", for every split of the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpage.server.seed_oss_calls import convert_seed
from flashpage.server.tools import get_parser
from tests.server.test_qwen3_coder_calls import PROPS, TOOLS
from tests.server.tool_checks import (
    LATE,
    agrees_when_cut,
    edited,
    every_split,
    sent_by_now,
    tagged_calls,
)

P = get_parser("seed_oss", TOOLS)
SPROPS = {**PROPS, "Days": {"type": "Integer"}, "ints": {"type": "array"}, "d": {"type": "dict"}}


def _call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<seed:tool_call>\n<function={name}>\n{body}</function>\n</seed:tool_call>"


@pytest.mark.parametrize("kind,text,value", [
    ("city", "null", None), ("city", "NULL", None), ("plain", "null", None), ("unknown", "null", None),
    ("note", "None", "None"), ("days", "None", "None"), ("city", "Paris", "Paris"), ("unknown", "42", "42"),
    ("days", "3", 3), ("Days", "3", 3), ("days", "3.5", "3.5"), ("temp", "21.0", 21), ("temp", "21.5", 21.5),
    ("temp", "inf", "inf"), ("metric", "True", True), ("metric", "yes", False),
    ("opts", '{"a": [1, 2.50]}', {"a": [1, 2.5]}), ("opts", "{'a': (1, None)}", {"a": [1, None]}),
    ("opts", "\"{'a': 1}\"", "{'a': 1}"), ("opts", "not json", "not json"), ("d", '{"a": true}', {"a": True}),
    # a type that is not a string, number, boolean or object: a Python literal, else the text
    ("ints", "[1, 'a', None]", [1, "a", None]), ("ints", '["a", true]', '["a", true]'), ("ints", "(1, 2)", [1, 2]),
    ("tags", "[1, 2]", [1, 2]), ("any", "42", 42), ("any", "Paris", "Paris"),
])
def test_values_are_read_as_vllms_seed_oss(kind, text, value):
    assert convert_seed(text, SPROPS.get(kind)) == value
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": SPROPS}}}]
    [call] = get_parser("seed_oss", tools).extract(_call("f", (kind, text)))[1]
    assert json.loads(call.arguments) == {kind: value}


def test_calls_and_content():
    text = "Let me check.\n" + _call("get_weather", ("city", "Paris"), ("days", "3")) + "\n" + _call("get_time") + "\nOk."
    content, calls = P.extract(text)
    assert content == "Let me check.\n\n\nOk."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "days": 3}'),
                                                      ("get_time", "{}")]
    # qwen3_coder's own tags are not Seed's calls
    qwen = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
    assert P.extract(qwen) == (qwen, [])


@pytest.mark.parametrize("text", [
    "No calls here.", "<seed:tool_call>", "<seed:tool_call><function=f><parameter=a>1</function></seed:tool_call>",
    "<seed:tool_call>\n<function=f>\n<parameter=a>\nnull\n</parameter>\n", '<seed:tool_call>{"name": "f"}</seed:tool_call>',
    "<seed:tool_call><function=f></function></tool_call>",
])
def test_not_calls(text):
    assert P.extract(text) == (text, [])


ANSWERS = [  # the model's text, the content a stream sends (None: the text), calls or LATE
    ("Checking.\n" + _call("get_weather", ("city", "null"), ("note", "Nullable <b>\n"), ("plain", "nu"),
                           ("x", "NULL\n"), ("days", "12"), ("tags", "[1, 'a']")), "Checking.\n", 1),
    ("A " + _call("f", ("a", "")) + " B " + _call("g", ("x", "</param")) + " C", "A B  C", 2),
    ("a <seed:tool> tag and <tool_call> too", None, 0),
    ("<seed:tool_call><function=get_weather><parameter=city>nul", None, LATE),
]


@pytest.mark.parametrize("text,content,want", ANSWERS)
def test_streamed_in_every_split(text, content, want):
    every_split(P, text, content, want)


@pytest.mark.parametrize("text,sent", [
    ("Hi <seed:tool_ca", []),
    ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nNul", [("get_weather", '{"city": ')]),
    ("<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [("get_weather", '{"city": "Par')]),
    ("<seed:tool_call>\n<function=get_weather>\n<parameter=days>\n12", [("get_weather", '{"days": ')]),
    ("<seed:tool_call>\n<function=get_weather>\n<parameter=days>\n12\n</parameter>", [("get_weather", '{"days": 12')]),
])
def test_strings_go_out_once_they_cannot_be_null(text, sent):
    assert sent_by_now(P, text) == sent


@settings(max_examples=80, deadline=None)
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


@settings(max_examples=80, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[2] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2),
    st.sampled_from(list("<>/=\nNul") + ["</parameter>", "null", "</function>", "</seed:tool_call>"])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    agrees_when_cut(P, edited(answer[0], edits), data)
