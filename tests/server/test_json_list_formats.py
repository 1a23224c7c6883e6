"""``phi4_mini_json``, ``hunyuan_a13b`` and ``xlam`` tool calls (server/json_list_calls.py): a JSON
list of call objects after a marker (Hunyuan's closed by ``</tool_calls>``), or (xLAM) the whole
answer, after ``</think>`` or in a code fence; streamed as the JSON formats are, for every split
of the answer."""

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

PHI, HUNYUAN, XLAM = get_parser("phi4_mini_json"), get_parser("hunyuan_a13b"), get_parser("xlam")
FT, OPEN, CLOSE = "functools", "<tool_calls>", "</tool_calls>"  # Phi's marker: functools[


def _read(parser, text):
    content, calls = parser.extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_phi4_mini_json_calls_and_content():
    text = f'{FT}[{{"name": "get_weather", "arguments": {{"city": "Paris", "days": 3}}}}, {{"name": "get_time", ' \
           '"parameters": {"zone": "UTC"}}]'
    assert _read(PHI, text) == (None, [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "UTC"})])
    # "arguments" wins where both are (vLLM's reading); text around the list is content
    both = f'Sure. {FT}[{{"name": "f", "parameters": {{"b": 2}}, "arguments": {{"a": 1}}}}]\nDone.'
    assert _read(PHI, both) == ("Sure. \nDone.", [("f", {"a": 1})])


def test_hunyuan_a13b_calls_and_content():
    text = f'Let me see.\n{OPEN}[{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}, ' \
           f'{{"name": "get_time", "arguments": "{{}}"}}]{CLOSE}\nok'
    assert _read(HUNYUAN, text) == ("Let me see.\n\nok", [("get_weather", {"city": "Paris"}), ("get_time", {})])


def test_xlam_calls_and_content():
    calls = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": "{}"}]'
    want = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert _read(XLAM, f" {calls}\n") == (None, want)
    assert _read(XLAM, f"<think>Use [tools].</think>\n{calls}") == ("<think>Use [tools].</think>", want)
    assert _read(XLAM, f"Sure:\n```json\n{calls}\n```\nDone.") == ("Sure:\n\nDone.", want)
    # a fence that does not hold a list is passed over; the next one is read
    assert _read(XLAM, f"Code:\n```python\nx = [1]\n```\nCalls:```{calls}```") == (
        "Code:\n```python\nx = [1]\n```\nCalls:", want)


@pytest.mark.parametrize("parser,text", [
    (XLAM, "No calls [here]."), (XLAM, "[1, 2]"), (XLAM, "[]"), (XLAM, '[{"name": "f", "arguments": {}}] and more'),
    (XLAM, '```json\n[{"name": "f", "arguments": {}}]'), (XLAM, '```json\n[{"name": "f", "arguments": {}}] x ```'),
    (XLAM, '<think>a</think> b [{"name": "f", "arguments": {}}]'), (XLAM, '{"name": "f", "arguments": {}}'),
    (PHI, "No calls."), (PHI, "import functools\nfunctools.partial(f)"), (PHI, FT + "[]"), (PHI, FT + "[1]"),
    (PHI, FT + ' [{"name": "f", "arguments": {}}]'),
    (PHI, FT + '{"name": "f", "arguments": {}}'), (PHI, FT + '[{"name": "f", "arguments": {}}'),
    (PHI, FT + '[{"name": "f", "arguments": 3}]'), (PHI, FT + '[{"name": "f", "name": "g", "arguments": {}}]'),
    (HUNYUAN, OPEN + '[{"name": "f", "arguments": {}}]'), (HUNYUAN, OPEN + '[{"name": "f", "arguments": {}}] x' + CLOSE),
    (HUNYUAN, OPEN + '{"name": "f", "arguments": {}}' + CLOSE), (HUNYUAN, f"{OPEN}[]{CLOSE}"),
])
def test_not_calls(parser, text):
    assert parser.extract(text) == (text, [])


ANSWERS = [  # parser, the model's text, the content a stream sends (None: the text), calls or LATE
    (PHI, f'Sure. {FT}[{{"name": "get_weather", "arguments": {{"city": "Par\\u00eds", "x": [1.50, true]}}}}, '
          '{"name": "g", "parameters": {"a": null}}] Done.', "Sure. Done.", 2),
    (PHI, "import functools as ft", None, 0),
    (PHI, 'from functools import cache\nfunctools[{"name": "a", "arguments": {"x": 1}}]', "from functools import cache\n", 1),
    (PHI, FT + '[{"name": "f", "arguments": {"a": 1}}, 3]', None, LATE),
    (HUNYUAN, f'ok {OPEN}\n[{{"name": "a", "arguments": {{"x": 1}}}}, {{"name": "b", "arguments": {{}}}}]\n{CLOSE}',
     "ok ", 2),
    (HUNYUAN, "a <tool_call> and <tool_calls tag", None, 0),
    (HUNYUAN, OPEN + '[{"name": "f", "arguments": {"a": 1}}]', None, LATE),
    (XLAM, ' [{"name": "a", "arguments": {"x": [1.50, null]}}, {"name": "b", "arguments": {"y": "\\u00e9"}}]\n', "", 2),
    (XLAM, '<think>Maybe [x].</think> [{"name": "a", "arguments": {}}]', "<think>Maybe [x].</think>", 1),
    (XLAM, 'Sure ```py\nx```, ```json [{"name": "a", "arguments": {"k": "v"}}]``` ok', "Sure ```py\nx```, ok", 1),
    (XLAM, "Plain words, a `tick` and ```code```", None, 0),
    (XLAM, '[{"name": "a", "arguments": {}}] then text', None, LATE),
]


@pytest.mark.parametrize("parser,text,content,want", ANSWERS)
def test_streamed_in_every_split(parser, text, content, want):
    every_split(parser, text, content, want)


@pytest.mark.parametrize("parser,text,sent", [
    (PHI, "Hi functoo", []),
    (PHI, f'Hi {FT}[{{"name": "get_weather", "arguments": {{"city": "Par', [("get_weather", '{"city": "Par')]),
    (PHI, f'{FT}[{{"name": "f", "parameters": {{"a": 1', [("f", "")]),  # "arguments" may follow and win
    (HUNYUAN, f'{OPEN}[{{"name": "a", "arguments": {{"x": 1}}}}, {{"name": "b", "arguments": {{"y": "z',
     [("a", '{"x": 1}'), ("b", '{"y": "z')]),
    (XLAM, '<think>ok</think>\n[{"name": "a", "arguments": {"x": "y', [("a", '{"x": "y')]),
    (XLAM, 'See ```js', []),
    (XLAM, 'See ```json\n[{"name": "a", "arguments": {"n": 12', [("a", '{"n": ')]),
])
def test_arguments_go_out_as_they_are_written(parser, text, sent):
    assert sent_by_now(parser, text) == sent


@settings(max_examples=80, deadline=None)
@given(which=st.integers(0, 3), calls=JSON_CALLS, spacing=JSON_SPACINGS, prefix=st.text(alphabet="ab .\n", max_size=5),
       data=st.data())
def test_any_calls_any_split(which, calls, spacing, prefix, data):
    body = json.dumps([{"name": n, "arguments": a} for n, a in calls], **spacing)
    parser, text = [(PHI, f"{prefix}{FT}{body}"), (HUNYUAN, f"{prefix}{OPEN}{body}{CLOSE}"),
                    (XLAM, f"{prefix}```json\n{body}\n```"), (XLAM, f"<think>{prefix}</think>{body}")][which]
    assert _read(parser, text)[1] == [(n, json.loads(json.dumps(a))) for n, a in calls]
    cut_off_then_agrees(parser, text, data)


@settings(max_examples=100, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[3] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list('{}[]",: \n1.`') + [FT, OPEN, CLOSE, "</think>", "```"])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    agrees_when_cut(answer[0], edited(answer[1], edits), data)
