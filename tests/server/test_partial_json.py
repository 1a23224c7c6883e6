"""CanonicalJson (server/partial_json.py): JSON read a character at a time, its canonical
text written only as far as the rest cannot change it; whole, the same text as
``dumps(loads(raw))``; refused exactly where Python's json refuses."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpage.server.partial_json import CanonicalJson, dumps, loads


def _read(raw: str, pieces: list[str] | None = None) -> tuple[CanonicalJson, list[str]]:
    """raw through a CanonicalJson in ``pieces`` (one character each by default): the
    output after each piece."""
    j, outs = CanonicalJson(), []
    for piece in pieces if pieces is not None else list(raw):
        j.feed(piece)
        outs.append(j.text())
    j.end()
    return j, outs


def _check(raw: str) -> None:
    try:
        want: str | None = dumps(loads(raw))
    except ValueError:
        want = None
    j, outs = _read(raw)
    if want is None:
        assert j.failed or not j.done, (raw, j.text())
        return
    assert j.done and not j.failed, (raw, j.text())
    assert j.text() == want, raw
    for out in outs:  # never a character the rest of the text could change
        assert want.startswith(out), (raw, out, want)


CASES = [
    '{"city": "Paris", "days": 3}',
    '{"city":"Paris","days":3}',
    ' \n{ "a" : [ 1 , 2.50 , -0 , 1E2 , 1e400 , true , false , null , NaN , -Infinity ] }\t',
    '{"s": "quote \\" back \\\\ slash \\/ \\b\\f\\n\\r\\t \\u00e9 \\u0001 é 😀 \\ud83d\\ude00"}',
    '{"lone": "\\ud83d", "then": "\\ud83d\\u0041", "two": "\\ud83d\\ud83d\\ude00", "low": "\\ude00"}',
    '{"a": 1, "b": 2, "a": 3}',
    '{"nested": {"x": [{"y": {}}, [], [[]]], "z": ""}}',
    '[]', '{}', '"top"', '12', 'true', '-1.5e-3',
    # not JSON
    '{"a": 01}', '{"a": 1.}', '{"a": -}', '{"a": tru}', '{"a": truex}', '{"a" 1}', '{"a": 1,}',
    '[1 2]', '{"a": "\\x"}', '{"a": "\\u12G4"}', '{"a": "raw\nnewline"}', "{'a': 1}",
    '{"a": 1} x', '{"a": 1}}', '[1,]', '{,}', '{"a": [1}', '{"a": 1e}', '{"a": +1}', '{"a": .5}',
    '{"a": 1', '{"a": "Par', '',
]


@pytest.mark.parametrize("raw", CASES)
def test_each_prefix_is_final(raw):
    _check(raw)


def test_a_number_waits_for_the_character_after_it():
    j, outs = _read('{"days": 12, "x": tru', ['{"days": 1', "2", ",", ' "x": tru'])
    assert outs == ['{"days": ', '{"days": ', '{"days": 12, ', '{"days": 12, "x": ']
    assert not j.done and j.failed  # the input ended inside a literal


def test_a_high_surrogate_waits_for_its_low_half():
    _, outs = _read('"a\\ud83d\\ude00"', ['"a\\ud83d', '\\ude0', '0"'])
    assert outs == ['"a', '"a', '"a😀"']


def test_paths_and_offsets():
    starts, ends = [], []
    raw = '{"name": "f", "arguments": {"a": [1, {"b": "x"}]}}'
    j = CanonicalJson(lambda p, c, at, r: starts.append((p, c, at, r)),
                      lambda p, at, r: ends.append((p, at, r)))
    j.feed(raw)
    out = j.text()
    assert [s[0] for s in starts] == [(), ("name",), ("arguments",), ("arguments", "a"),
                                      ("arguments", "a", 0), ("arguments", "a", 1),
                                      ("arguments", "a", 1, "b")]
    spans = {p: (at, r) for p, _, at, r in starts}
    for p, at, r in ends:  # each value's span, in the output and in the raw text
        assert out[spans[p][0]:at] == dumps(loads(raw[spans[p][1]:r]))
    assert j.last_string == "x"


def test_escapes_are_written_as_json_dumps_writes_them():
    for code in list(range(0x800)) + [0x2028, 0xFEFF, 0xD800, 0xDFFF, 0x1F600]:
        ch = chr(code)
        raw = json.dumps(ch)  # \uXXXX escapes
        j, _ = _read(raw)
        assert j.text() == json.dumps(ch, ensure_ascii=False), code


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(value=_values, indent=st.sampled_from([None, 0, 2]), ascii_=st.booleans(),
       seps=st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]), data=st.data())
def test_any_json_any_spacing(value, indent, ascii_, seps, data):
    raw = json.dumps(value, indent=indent, ensure_ascii=ascii_, separators=seps)
    _check(raw)
    cut = data.draw(st.integers(0, len(raw)))  # also a random cut of the raw text
    j, outs = _read(raw, [raw[:cut], raw[cut:]])
    assert j.text() == dumps(value) and dumps(value).startswith(outs[0])
