"""``kimi_k2`` tool calls (server/kimi_calls.py): Kimi K2's special tokens around each call's id
(``functions.NAME:INDEX``, the call's id as in vLLM) and its JSON arguments; streamed as the
JSON formats are, for every split of the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpage.server.kimi_calls import ARGS_BEGIN, CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END
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

P = get_parser("kimi_k2")


def _call(call_id: str, args: str) -> str:
    return f"{CALL_BEGIN}{call_id}{ARGS_BEGIN}{args}{CALL_END}"


def _calls(*calls: str, end: bool = True) -> str:
    return CALLS_BEGIN + "".join(calls) + (CALLS_END if end else "")


def test_calls_ids_and_content():
    text = "Let me check." + _calls(_call("functions.get_weather:0", '{"city":"Paris","days":3}'),
                                    _call("functions.get_time:1", "{}"))
    content, calls = P.extract(text)
    assert content == "Let me check."
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("functions.get_weather:0", "get_weather", '{"city": "Paris", "days": 3}'),
        ("functions.get_time:1", "get_time", "{}")]
    assert [(c.id, c.name) for c in P.extract(_calls(_call("f:3", "{}"), end=False))[1]] == [("f:3", "f")]
    assert P.extract(_calls(_call(" functions.f:0\n", " {} ")) + " Done.")[0] == "Done."
    assert P.extract(_calls(_call("f:0", "{}"), "\n", _call("g:1", "{}")))[1][1].name == "g"


@pytest.mark.parametrize("text", [
    "No calls.", CALLS_BEGIN, _calls(), _calls(_call("functions.f:0", "[1]")),
    _calls(_call("functions.f:0", "{broken")), _calls(_call("functions.f", "{}")), _calls(_call("f:x", "{}")),
    _calls(_call("", "{}")), _calls(_call(":0", "{}")), _calls(_call("functions.:0", "{}")),
    _calls(_call("functions.a b:0", "{}")), _calls(_call("functions.f:0", "{}")[:-len(CALL_END)]),
    _calls(_call("functions.f:0", '{"name": "f"} {}')), CALLS_BEGIN + "text" + _call("functions.f:0", "{}"),
])
def test_not_calls(text):
    assert P.extract(text) == (text, [])


ANSWERS = [  # the model's text, the content a stream sends (None: the text), calls or LATE
    ("Sure. " + _calls(_call("functions.get_weather:0", '{"city":"Par\\u00eds","days":12,"x":[1.50,true,null]}'),
                       _call("functions.get_time:1", ' {"zone": "UTC"} ')), "Sure. ", 2),
    (_calls(_call("functions.f:0", "{}"), end=False), "", 1),
    (_calls(_call("functions.f:0", '{"a": 1}')) + "\nThat is all.", "That is all.", 1),
    ("<|tool_calls no", None, 0),
    (_calls(_call("functions.f:0", '{"a": 1}'), _call("functions.g:1", '{"a": "b"')), None, LATE),
    (_calls(_call("functions.f:0", '{"a": 1}') + "x"), None, LATE),
]


@pytest.mark.parametrize("text,content,want", ANSWERS)
def test_streamed_in_every_split(text, content, want):
    every_split(P, text, content, want)


@pytest.mark.parametrize("text,sent", [
    (CALLS_BEGIN + CALL_BEGIN + "functions.get_weather:0", []),
    (CALLS_BEGIN + CALL_BEGIN + "functions.get_weather:0" + ARGS_BEGIN, []),
    (CALLS_BEGIN + CALL_BEGIN + "functions.get_weather:0" + ARGS_BEGIN + '{"city": "Par',
     [("get_weather", '{"city": "Par')]),
    (_calls(_call("functions.f:0", '{"n": 1}'), CALL_BEGIN + "functions.g:1" + ARGS_BEGIN + '{"n": 12', end=False),
     [("f", '{"n": 1}'), ("g", '{"n": ')]),
])
def test_arguments_go_out_as_they_are_written(text, sent):
    assert sent_by_now(P, text) == sent


@settings(max_examples=150, deadline=None)
@given(calls=JSON_CALLS, spacing=JSON_SPACINGS, prefix=st.text(alphabet="ab .\n", max_size=5), data=st.data())
def test_any_calls_any_split(calls, spacing, prefix, data):
    text = prefix + _calls(*(_call(f"functions.{n}:{i}", json.dumps(a, **spacing)) for i, (n, a) in enumerate(calls)))
    assert [(c.id, c.name, json.loads(c.arguments)) for c in P.extract(text)[1]] == [
        (f"functions.{n}:{i}", n, json.loads(json.dumps(a))) for i, (n, a) in enumerate(calls)]
    cut_off_then_agrees(P, text, data)


@settings(max_examples=200, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[2] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list('{}[]",: \n1.') + [CALL_END, CALLS_END, ARGS_BEGIN])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    text = edited(answer[0], edits)
    agrees_when_cut(P, text, data)
