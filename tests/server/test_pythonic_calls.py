"""``pythonic`` tool calls (server/pythonic_calls.py): a Python list of calls read with ``ast``,
literals written as JSON; streamed one argument at a time, for every split of the answer."""

from __future__ import annotations

import json

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from flashpage.server.tools import get_parser
from tests.server.tool_checks import LATE, agrees_when_cut, edited, every_split, sent_by_now

P = get_parser("pythonic")


def _calls(text: str) -> list[tuple[str, dict]] | None:
    content, calls = P.extract(text)
    if not calls:
        assert content == text
        return None
    assert content is None
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_calls_and_their_literals():
    text = ('[get_weather(city="Paris", unit=\'celsius\'), get_time(zone=None, opts={"dst": True, '
            '"n": [1, -2.50, 1e3, (3, 4)], \'q\': "\\"a\\" \\u00e9\\n"}, big=10**0 if 0 else 1_000)]')
    assert _calls(text) is None  # an expression that is not a literal: not a call
    text = text.replace("10**0 if 0 else 1_000", "1_000")
    assert _calls(text) == [("get_weather", {"city": "Paris", "unit": "celsius"}),
                            ("get_time", {"zone": None, "opts": {"dst": True, "n": [1, -2.5, 1000.0, [3, 4]],
                                                                 "q": '"a" é\n'}, "big": 1000})]
    [call] = P.extract('[f(a="""x\ny""", b=r"\\d", c=+1, d=-0.0, e="a" "b", g=[], h={})]')[1]
    # written as json.dumps writes it, keys in the model's order
    assert call.arguments == '{"a": "x\\ny", "b": "\\\\d", "c": 1, "d": -0.0, "e": "ab", "g": [], "h": {}}'
    assert _calls(" <|python_start|>[f()]<|python_end|>\n") == [("f", {})]
    assert _calls("[f(x=1,), g(), ]") == [("f", {"x": 1}), ("g", {})]
    assert _calls("[\n  f(\n    x=1,  # the first\n  )\n]") == [("f", {"x": 1})]


@pytest.mark.parametrize("text", [
    "It is sunny.", "The list [1, 2] is short.", "Let me call it: [f(x=1)]", "[f(x=1)] done",
    "[]", "[f(1)]", "[f(x=1, x=2)]", "[f(**x)]", "[a.b(x=1)]", "[f(x=1)(y=2)]", "[f(x=y)]",
    "[f(x={1, 2})]", "[f(x=b'1')]", "[f(x=1j)]", "[f(x=f'{y}')]", "[f(x={1: 2})]", "[f(x=1)",
    "[f(x='a\nb')]", "[f(x=1),,]", "[f(,)]", "[1, f()]", "[f()] [g()]", "[f(x=...)]",
    "[f(x=" + "[" * 300 + "]" * 300 + ")]", "[f(x=1)]\x00",
])
def test_not_calls(text):
    assert _calls(text) is None


def test_unknown_names_are_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown tool call parser 'pythonik': one of \[.*'pythonic'"):
        get_parser("pythonik")


ANSWERS = [  # the model's text, the content a stream sends (None: the text), calls or LATE
    ('[get_weather(city="Paris", unit="celsius"), get_time()]', "", 2),
    ("  [get_weather(city='Par\\'is', days=3, opts={'a': [1, 2.50, None, True]}, z=-1)]\n", "  ", 1),
    ('<|python_start|>[f(s="""x""\\"y\n""", t=(1,), u={"k": "#)]"}, # c)\n v=1,)]<|python_end|>', "", 1),
    ('[f(x="a", y=\'\'), g(z="")]', "", 2),
    ("[f(a='''it's \"x\"\n''' '', b=\"line\\\ncont\", c=r'\\'', d='''''')]", "", 1),
    ("[ f ( x = 1 ) , g ( ) , ]", "", 2),
    ("Hello [f(x=1)]", None, 0),
    ("[not a call]", None, 0),
    ("[f(x=1), 2]", None, LATE),
    ("[f(x=1, x=2)]", None, LATE),
    ("[f(x=1)] and more", None, LATE),
    ('[f(x="unterminated)]', None, LATE),
    ("[f(x=1), g(y=[1, 2)]", None, LATE),
]


@pytest.mark.parametrize("text,content,want", ANSWERS)
def test_streamed_in_every_split(text, content, want):
    every_split(P, text, content, want)


@pytest.mark.parametrize("text,sent", [
    ("[get_wea", []),
    ("[get_weather", []),  # the name may go on
    ("[get_weather(", [("get_weather", "")]),
    ('[get_weather(city="Par', [("get_weather", "")]),
    ('[get_weather(city="Paris"', [("get_weather", "")]),  # "Paris" "x" is one string
    ('[get_weather(city="Paris", days=1', [("get_weather", '{"city": "Paris"')]),
    ('[get_weather(city="Paris", days=12)', [("get_weather", '{"city": "Paris", "days": 12}')]),
    ('[f(a=[1, 2], b={"c": (3,', [("f", '{"a": [1, 2]')]),
    ("[f(), g(x='''a,b)", [("f", "{}"), ("g", "")]),
])
def test_arguments_go_out_one_at_a_time(text, sent):
    assert sent_by_now(P, text) == sent


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
_names = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True).filter(
    lambda n: n not in {"if", "in", "is", "or", "as", "and", "not", "for", "def", "del", "try", "with",
                        "else", "elif", "from", "pass", "while", "class", "break", "raise", "yield",
                        "async", "await", "global", "import", "lambda", "return", "assert", "finally",
                        "continue", "nonlocal", "except"})


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(_names, st.dictionaries(_names, _values, max_size=4)), min_size=1, max_size=3),
       spacing=st.sampled_from([", ", ",", ",\n  "]), data=st.data())
def test_any_calls_any_split(calls, spacing, data):
    """Random calls written with Python's repr (quotes and escapes as Python picks them),
    maybe cut off anywhere: the non-streamed reading gives the calls back, and the stream
    agrees with it for random splits and one character a delta."""
    text = "[" + spacing.join(f"{n}({spacing.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"
    full = [(c.name, json.loads(c.arguments)) for c in P.extract(text)[1]]
    assert full == [(n, json.loads(json.dumps(a))) for n, a in calls]
    if data.draw(st.booleans()):
        text = text[:data.draw(st.integers(0, len(text)))]
    agrees_when_cut(P, text, data)


@settings(max_examples=300, deadline=None)
@given(answer=st.sampled_from([a for a in ANSWERS if a[2] != 0]), edits=st.lists(st.tuples(
    st.integers(0, 10**4), st.integers(0, 2), st.sampled_from(list("()[]{}'\",=#\\:\n x1.-") + ['"""', "None"])),
    min_size=1, max_size=2), data=st.data())
def test_edited_answers_any_split(answer, edits, data):
    """The answers above with characters inserted, deleted or replaced: never an error;
    calls only as the non-streamed reading has them, else all the text as content."""
    text = edited(answer[0], edits)
    event(f"{agrees_when_cut(P, text, data)} calls")


def test_llama4_pythonic_is_pythonic():
    """vLLM's ``llama4_pythonic``: the same reading, Llama 4's wrapper tokens included."""
    llama4 = get_parser("llama4_pythonic")
    for text in ['<|python_start|>[get_weather(city="Paris")]<|python_end|>', "[f(a=1), g()]", "no calls"]:
        assert [(c.name, c.arguments) for c in llama4.extract(text)[1]] == [
            (c.name, c.arguments) for c in P.extract(text)[1]]
    every_split(llama4, '<|python_start|>[get_weather(city="Paris", days=3)]<|python_end|>', "", 1)
