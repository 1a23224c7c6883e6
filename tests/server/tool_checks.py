"""Checks the tool-call format tests share: an answer through a ToolStream cut into deltas
every way, against the parser's non-streamed reading (tests/server/test_tool_parsers.py's
contract, for any parser)."""

from __future__ import annotations

from hypothesis import strategies as st

from flashpage.server.tool_stream import ToolStream
from flashpage.server.tools import ToolParser
from tests.server.test_tool_parsers import _merged, _splits

LATE = "late"  # not calls, found out only after a call went out (it cannot be taken back)


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict], list]:
    """The pieces through a ToolStream: (content sent, tool-call delta entries, final calls)."""
    s, content, entries = ToolStream(parser), "", []
    for piece in pieces[:-1]:
        text, deltas = s.feed(piece)
        content += text
        entries += deltas
    rest, deltas, calls = s.finish(pieces[-1])
    return content + (rest or ""), entries + deltas, calls


def agrees(parser: ToolParser, text: str, pieces: list[str], ref_calls: list | None = None,
           content: str | None = None) -> int:
    """The stream of ``pieces`` agrees with the non-streamed reading of their text: the same
    calls, each one's argument pieces adding up to its arguments, the content ``content``
    (when given); or, no calls, all the text as content. The number of calls."""
    if ref_calls is None:
        ref_calls = parser.extract(text)[1]
    sent, entries, got = stream(parser, pieces)
    streamed = _merged(entries)
    if ref_calls:
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in ref_calls]
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.name, c.arguments) for c in got], pieces
        assert [c["id"] for c in streamed] == [c.id for c in got]
        assert content is None or sent == content, (pieces, sent)
    else:
        assert sent == text and got == [], (pieces, sent)
    return len(ref_calls)


def every_split(parser: ToolParser, text: str, content: str | None, want: int | str) -> None:
    """``text`` cut into deltas every way: ``want`` calls (LATE: none, found out after a call
    went out), content as ``content`` says (None: the text)."""
    _, ref_calls = parser.extract(text)
    assert len(ref_calls) == (0 if want == LATE else want)
    for pieces in _splits(text):
        agrees(parser, text, pieces, ref_calls, content)
        if not ref_calls and want != LATE:
            assert stream(parser, pieces)[1] == [], pieces  # it never looked like a call


def sent_by_now(parser: ToolParser, text: str) -> list[tuple[str, str]]:
    """What went out for ``text`` fed so far (one character a delta, and whole): the calls'
    names and their arguments so far; the same both ways."""
    out = []
    for pieces in (list(text), [text]):
        s, entries = ToolStream(parser), []
        for piece in pieces:
            entries += s.feed(piece)[1]
        out.append([(c["name"], c["arguments"]) for c in _merged(entries)])
    assert out[0] == out[1]
    return out[0]


# JSON values for fuzzed arguments
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)


# calls with JSON arguments: (name, arguments) lists, and the ways json.dumps may space them
JSON_CALLS = st.lists(st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                                st.dictionaries(st.text(max_size=4), JSON_VALUES, max_size=4)),
                      min_size=1, max_size=3)
JSON_SPACINGS = st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1, "ensure_ascii": False}])


def cut_off_then_agrees(parser: ToolParser, text: str, data) -> None:
    """Maybe cut ``text`` short (a model stopped anywhere), then ``agrees_when_cut``."""
    if data.draw(st.booleans()):
        text = text[:data.draw(st.integers(0, len(text)))]
    agrees_when_cut(parser, text, data)


def edited(text: str, edits: list[tuple[int, int, str]]) -> str:
    """``text`` with each edit (where, 0 insert / 1 delete / 2 replace, character) applied."""
    for at, how, ch in edits:
        at %= len(text) + 1
        text = text[:at] + ("" if how == 1 else ch) + text[at + (how > 0):]
    return text


def agrees_when_cut(parser: ToolParser, text: str, data) -> int:
    """``agrees`` for ``text`` cut at up to 3 places hypothesis draws (``data``: st.data()),
    then fed one character a delta; the number of calls."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=3)))
    bounds = [0, *cuts, len(text)]
    n = agrees(parser, text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    agrees(parser, text, list(text) + [""])
    return n


def tagged_calls(props: dict, chars: str, extra: list[str], closing: str) -> st.SearchStrategy:
    """Random XML-ish calls for the tag formats' property tests (glm45, qwen3_coder,
    qwen3_xml): 1-3 calls of a known or unknown function, each up to 4 (parameter, value)
    pairs over ``props`` and one undeclared, values of up to 8 pieces (a character of
    ``chars`` or an ``extra`` string) that never hold the value's ``closing`` tag."""
    values = st.lists(st.sampled_from(list(chars) + extra), max_size=8).map(
        lambda s: "".join(s).replace(closing, ""))
    return st.lists(st.tuples(st.sampled_from(["get_weather", "get_time", "other"]),
                              st.lists(st.tuples(st.sampled_from(sorted(props) + ["extra"]), values),
                                       max_size=4)),
                    min_size=1, max_size=3)

