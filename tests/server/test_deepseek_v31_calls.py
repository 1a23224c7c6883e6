"""``deepseek_v31`` tool calls (server/deepseek_calls.py): DeepSeek-V3.1's special tokens around
each call's name and its JSON arguments (no type, no fence); streamed as the JSON formats are,
for every split of the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpage.server.deepseek_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from flashpage.server.tools import get_parser
from tests.server.tool_checks import (
    JSON_CALLS,
    JSON_SPACINGS,
    LATE,
    agrees_when_cut,
    cut_off_then_agrees,
    edited,
    every_split,
    sent_by_now,
)

P = get_parser("deepseek_v31")


def _call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def _calls(*calls: str, end: bool = True) -> str:
    return CALLS_BEGIN + "".join(calls) + (CALLS_END if end else "")


def test_calls_and_content():
    text = "Let me check." + _calls(_call("get_weather", '{"city":"Paris","days":3}'), _call("get_time", "{}"))
    content, calls = P.extract(text)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "days": 3}'),
                                                      ("get_time", "{}")]
    assert [c.name for c in P.extract(_calls(_call("f", "{}"), end=False))[1]] == ["f"]
    assert P.extract(_calls(_call(" f\n", " {} ")) + " Done.")[0] == "Done."
    assert P.extract(_calls(_call("f", "{}"), "\n", _call("g", "{}")))[1][1].name == "g"


@pytest.mark.parametrize("text", [
    "No calls.", CALLS_BEGIN, _calls(), _calls(_call("f", "[1]")), _calls(_call("f", "{broken")),
    _calls(_call("", "{}")), _calls(_call("a b", "{}")), _calls(_call("f", "{}")[:-len(CALL_END)]),
    _calls(_call("function" + SEP + "f", "{}")), _calls(_call("f", '```json\n{"a": 1}\n```')),
    _calls(_call("f", '{"name": "f"} {}')), CALLS_BEGIN + "text" + _call("f", "{}"),
])
def test_not_calls(text):
    assert P.extract(text) == (text, [])


def test_deepseek_v3_calls_are_not_v31_calls():
    text = CALLS_BEGIN + CALL_BEGIN + "function" + SEP + 'f\n```json\n{}\n```' + CALL_END + CALLS_END
    assert P.extract(text) == (text, []) and get_parser("deepseek_v3").extract(text)[1]


ANSWERS = [  # the model's text, the content a stream sends (None: the text), calls or LATE
    ("Sure. " + _calls(_call("get_weather", '{"city":"Par\\u00eds","days":12,"x":[1.50,true,null]}'),
                       _call("get_time", ' {"zone": "UTC"} ')), "Sure. ", 2),
    (_calls(_call("f", "{}"), end=False), "", 1),
    (_calls(_call("f", '{"a": 1}')) + "\nThat is all.", "That is all.", 1),
    ("<｜tool▁call no", None, 0),
    (_calls(_call("f", '{"a": 1}'), _call("g", '{"a": "b"')), None, LATE),
    (_calls(_call("f", '{"a": 1}') + "x"), None, LATE),
]


@pytest.mark.parametrize("text,content,want", ANSWERS)
def test_streamed_in_every_split(text, content, want):
    every_split(P, text, content, want)


@pytest.mark.parametrize("text,sent", [
    (CALLS_BEGIN + CALL_BEGIN + "get_weather", []),
    (CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP, []),
    (CALLS_BEGIN + CALL_BEGIN + "get_weather" + SEP + '{"city": "Par', [("get_weather", '{"city": "Par')]),
    (_calls(_call("f", '{"n": 1}'), CALL_BEGIN + "g" + SEP + '{"n": 12', end=False),
     [("f", '{"n": 1}'), ("g", '{"n": ')]),
])
def test_arguments_go_out_as_they_are_written(text, sent):
    assert sent_by_now(P, text) == sent


@settings(max_examples=150, deadline=None)
@given(calls=JSON_CALLS, spacing=JSON_SPACINGS, prefix=st.text(alphabet="ab .\n", max_size=5), data=st.data())
def test_any_calls_any_split(calls, spacing, prefix, data):
    text = prefix + _calls(*(_call(n, json.dumps(a, **spacing)) for n, a in calls))
    assert [(c.name, json.loads(c.arguments)) for c in P.extract(text)[1]] == [
        (n, json.loads(json.dumps(a))) for n, a in calls]
    cut_off_then_agrees(P, text, data)


@settings(max_examples=200, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[2] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list('{}[]",: \n1') + [CALL_END, CALLS_END, SEP])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    text = edited(answer[0], edits)
    agrees_when_cut(P, text, data)
