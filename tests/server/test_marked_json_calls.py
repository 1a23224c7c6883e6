"""``internlm``, ``granite-20b-fc`` and ``minimax`` tool calls (server/marked_json_calls.py): a
marker before each JSON call object (InternLM's ``<|action_end|>`` after it; MiniMax's
``<tool_calls>`` before one a line, ``</tool_calls>`` after them); streamed as the JSON formats
are, for every split of the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

INTERN, GRANITE, MINIMAX = get_parser("internlm"), get_parser("granite-20b-fc"), get_parser("minimax")
START, END, FC = "<|action_start|><|plugin|>", "<|action_end|>", "<function_call>"
OPEN, CLOSE = "<tool_calls>", "</tool_calls>"


def _intern(name: str, args: str, key: str = "parameters", end: str = END) -> str:
    return f'{START}\n{{"name": "{name}", "{key}": {args}}}{end}'


def _fc(name: str, args: str) -> str:
    return f'{FC} {{"name": "{name}", "arguments": {args}}}'


def _mm(*calls: tuple[str, str], end: str = "\n" + CLOSE) -> str:
    return OPEN + "".join(f'\n{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + end


def _read(parser, text):
    content, calls = parser.extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_internlm_calls_and_content():
    assert INTERN.keeps_special_tokens and not GRANITE.keeps_special_tokens
    text = "Let me check." + _intern("get_weather", '{"city": "Paris", "days": 3}')
    assert _read(INTERN, text) == ("Let me check.", [("get_weather", {"city": "Paris", "days": 3})])
    # "arguments" where "parameters" is missing; "parameters" wins where both are (vLLM's reading)
    assert _read(INTERN, _intern("f", '{"a": 1}', key="arguments"))[1] == [("f", {"a": 1})]
    both = f'{START}{{"name": "f", "arguments": {{"a": 1}}, "parameters": {{"b": 2}}}}{END}'
    assert _read(INTERN, both)[1] == [("f", {"b": 2})]
    # the model stopped before <|action_end|>: still a call; several calls, text after them content
    assert _read(INTERN, _intern("f", "{}", end="") + "\n") == (None, [("f", {})])
    assert _read(INTERN, _intern("f", "{}") + "\n" + _intern("g", '{"x": [1]}') + "\nDone.") == (
        "Done.", [("f", {}), ("g", {"x": [1]})])


def test_granite_20b_fc_calls_and_content():
    text = "Sure.\n" + _fc("get_weather", '{"city": "Paris"}') + "\n" + _fc("get_time", "{}")
    assert _read(GRANITE, text) == ("Sure.", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    assert _read(GRANITE, f'{FC}{{"name":"f","arguments":{{"a":1.50}}}}')[1] == [("f", {"a": 1.5})]
    assert _read(GRANITE, _fc("f", "{}") + " That is all.") == ("That is all.", [("f", {})])
    # a tool the request does not have is still a call, as for the other formats
    assert _read(get_parser("granite-20b-fc", [{"type": "function", "function": {"name": "g"}}]),
                 _fc("f", "{}"))[1] == [("f", {})]


def test_minimax_calls_and_content():
    text = "Let me check." + _mm(("get_weather", '{"city": "Paris"}'), ("get_time", "{}")) + "\nDone."
    assert _read(MINIMAX, text) == ("Let me check.\nDone.", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    # </tool_calls> may be missing at the very end; a second block is read too
    assert _read(MINIMAX, _mm(("f", "{}"), end="\n")) == (None, [("f", {})])
    assert _read(MINIMAX, _mm(("f", "{}")) + " and " + _mm(("g", '{"a": 1}')))[1] == [("f", {}), ("g", {"a": 1})]


@pytest.mark.parametrize("parser,text", [
    (MINIMAX, "No calls."), (MINIMAX, OPEN), (MINIMAX, OPEN + CLOSE), (MINIMAX, _mm(("f", "{broken"))),
    (MINIMAX, _mm(("f", "{}"), end=" x " + CLOSE)), (MINIMAX, f'{OPEN}[{{"name": "f", "arguments": {{}}}}]{CLOSE}'),
    (MINIMAX, _mm(("f", "3"))), (MINIMAX, _mm(("f", "{}"), end="\n{")),
    (INTERN, "No calls."), (INTERN, START), (INTERN, _intern("f", "{broken")), (INTERN, _intern("f", "[1]")),
    (INTERN, f"{START}[1]{END}"), (INTERN, f'{START}{{"parameters": {{}}}}{END}'),
    (INTERN, _intern("f", "{}", end=" and more" + END)), (INTERN, _intern("f", "{}", end="<|action_e")),
    (INTERN, "<|action_start|><|interpreter|>\nprint(1)<|action_end|>"),
    (INTERN, f'{START}{{"name": "f", "name": "g", "parameters": {{}}}}{END}'),
    (GRANITE, "No calls."), (GRANITE, FC), (GRANITE, _fc("f", "{broken")), (GRANITE, f"{FC} [1]"),
    (GRANITE, f"{FC} text"), (GRANITE, _fc("f", "3")), (GRANITE, _fc("f", "{}") + FC),
])
def test_not_calls(parser, text):
    assert parser.extract(text) == (text, [])


ANSWERS = [  # parser, the model's text, the content a stream sends (None: the text), calls or LATE
    (INTERN, "Sure. " + _intern("get_weather", '{"city":"Par\\u00eds","days":12,"x":[1.50,true,null]}'), "Sure. ", 1),
    (INTERN, _intern("f", '{"a": 1}') + "\n" + _intern("g", '{"b": "c"}', key="arguments"), "", 2),
    (INTERN, _intern("f", "{}", end=""), "", 1),
    (INTERN, "a <|action_start|> alone and <|action_start|><|interpreter|> code", None, 0),
    (INTERN, _intern("f", '{"a": 1}') + _intern("g", '{"a": "b"'), None, LATE),
    (INTERN, _intern("f", '{"a": 1}', end="x" + END), None, LATE),
    (GRANITE, "Sure.\n" + _fc("get_weather", '{"city": "Paris", "days": 3}') + "\n" + _fc("get_time", "{}"),
     "Sure.\n", 2),
    (GRANITE, _fc("f", '{"a": [1, {"b": null}]}') + " Done.", "Done.", 1),
    (GRANITE, "a <function_ call> and <function> tags", None, 0),
    (GRANITE, _fc("f", '{"a": 1}') + "\n" + _fc("g", '{"a": "b"'), None, LATE),
    (MINIMAX, "Sure. " + _mm(("get_weather", '{"city":"Par\\u00eds","days":12}'), ("g", '{"x": [1.50, null]}')) + " ok",
     "Sure. ok", 2),
    (MINIMAX, "a <tool_call> and <tool_calls tag", None, 0),
    (MINIMAX, _mm(("f", '{"a": 1}'), ("g", '{"a": "b"'), end=""), None, LATE),
]


@pytest.mark.parametrize("parser,text,content,want", ANSWERS)
def test_streamed_in_every_split(parser, text, content, want):
    every_split(parser, text, content, want)


@pytest.mark.parametrize("parser,text,sent", [
    (INTERN, "Hi <|action_start|><|plu", []),
    (INTERN, f'Hi {START}\n{{"name": "get_we', []),
    (INTERN, f'Hi {START}\n{{"name": "get_weather", "parameters": {{"city": "Par',
     [("get_weather", '{"city": "Par')]),
    (INTERN, f'{START}{{"name": "f", "arguments": {{"a": 1', [("f", "")]),  # "parameters" may follow
    (INTERN, _intern("f", '{"n": 1}') + f'{START}{{"name": "g", "parameters": {{"n": 12', [("f", '{"n": 1}'), ("g", '{"n": ')]),
    (GRANITE, 'Hi <function_ca', []),
    (GRANITE, _fc("a", '{"x": 1}') + f'\n{FC} {{"name": "b", "arguments": {{"y": "z',
     [("a", '{"x": 1}'), ("b", '{"y": "z')]),
    (MINIMAX, 'Hi <tool_cal', []),
    (MINIMAX, _mm(("a", '{"x": 1}'), end="") + '\n{"name": "b", "arguments": {"y": "z', [("a", '{"x": 1}'), ("b", '{"y": "z')]),
])
def test_arguments_go_out_as_they_are_written(parser, text, sent):
    assert sent_by_now(parser, text) == sent


@settings(max_examples=150, deadline=None)
@given(which=st.integers(0, 2), calls=JSON_CALLS, spacing=JSON_SPACINGS, prefix=st.text(alphabet="ab .\n", max_size=5),
       data=st.data())
def test_any_calls_any_split(which, calls, spacing, prefix, data):
    if which == 2:
        parser = MINIMAX
        text = prefix + OPEN + "".join("\n" + json.dumps({"name": n, "arguments": a}, **spacing) for n, a in calls)
        text += "\n" + CLOSE
    elif which == 1:
        parser = GRANITE
        text = prefix + "\n".join(f"{FC} " + json.dumps({"name": n, "arguments": a}, **spacing) for n, a in calls)
    else:
        parser = INTERN
        text = prefix + "\n".join(START + json.dumps({"name": n, "parameters": a}, **spacing) + END for n, a in calls)
    assert _read(parser, text)[1] == [(n, json.loads(json.dumps(a))) for n, a in calls]
    cut_off_then_agrees(parser, text, data)


@settings(max_examples=200, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[3] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list('{}[]",: \n1.') + [START, END, FC, OPEN, CLOSE])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    agrees_when_cut(answer[0], edited(answer[1], edits), data)
