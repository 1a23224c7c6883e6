"""GPT-OSS's harmony format (server/harmony.py, server/harmony_calls.py): the analysis channel
as reasoning, the final channel and preambles as content, messages to functions as tool calls;
streamed in every split the same as whole."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpage.server.harmony import HarmonySplitter, parse_header
from flashpage.server.reasoning import get_reasoning_parser, make_splitter
from flashpage.server.tools import get_parser
from tests.server.test_tool_parsers import _merged, _splits
from tests.server.tool_checks import (
    JSON_CALLS,
    JSON_SPACINGS,
    LATE,
    agrees,
    agrees_when_cut,
    every_split,
    stream,
)

P = get_parser("openai")


def analysis(text: str, first: bool = True) -> str:
    return ("" if first else "<|start|>assistant") + f"<|channel|>analysis<|message|>{text}<|end|>"


def final(text: str) -> str:
    return f"<|start|>assistant<|channel|>final<|message|>{text}<|return|>"


def call(name: str, args: str, before: bool = False, start: bool = True, end: str = "<|call|>") -> str:
    head = "<|start|>assistant" if start else ""
    if before:  # the recipient in the role's part
        return f"{head} to=functions.{name}<|channel|>commentary json<|message|>{args}{end}"
    return f"{head}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}{end}"


def passed(name: str, args: str, before: bool = False, end: str = "<|call|>") -> str:
    """What the splitter passes on for a call message: it whole, from <|start|>assistant."""
    return call(name, args, before, end=end)


WEATHER = '{"city": "Paris", "days": 3}'

# (the model's harmony output after <|start|>assistant, reasoning, content)
SPLITS = [
    (analysis("The user wants a greeting.") + final("Hello!"), "The user wants a greeting.", "Hello!"),
    (analysis("Need weather.") + call("get_weather", WEATHER), "Need weather.", passed("get_weather", WEATHER)),
    (analysis("Two.") + call("get_weather", WEATHER) + call("get_time", '{"zone":"UTC"}'), "Two.",
     passed("get_weather", WEATHER) + passed("get_time", '{"zone":"UTC"}')),
    (call("get_weather", WEATHER, before=True, start=False), None, passed("get_weather", WEATHER, before=True)),
    # a preamble on the commentary channel, then a call: the preamble is content
    (analysis("x") + "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
     + call("get_weather", WEATHER), "x", "Let me check." + passed("get_weather", WEATHER)),
    # cut off: in the analysis, in a header, in the final answer
    ("<|channel|>analysis<|message|>Thinking ab", "Thinking ab", ""),
    (analysis("a") + "<|start|>assistant<|channel|>fin", "a", ""),
    (analysis("a") + "<|start|>assistant", "a", ""),
    (analysis("a") + "<|start|>assistant to=functions.get_weather", "a", ""),
    (analysis("a") + "<|start|>assistant<|channel|>final<|message|>Hel", "a", "Hel"),
    # two analysis messages; the final one with no end token (a stop token the text left out)
    (analysis("a") + analysis("b", first=False) + "<|start|>assistant<|channel|>final<|message|>c", "ab", "c"),
    # a channel harmony does not define: content; a built-in tool's call: passed on whole
    ("<|channel|>scratch<|message|>odd<|end|>" + final("ok"), None, "oddok"),
    ("<|channel|>analysis to=python code<|message|>print(1)<|call|>", None,
     "<|start|>assistant<|channel|>analysis to=python code<|message|>print(1)<|call|>"),
    # not harmony at all: content as written
    ("Just text.", None, "Just text."),
    ("", None, ""),
]


@pytest.mark.parametrize("text,reasoning,content", SPLITS)
def test_channels_split(text, reasoning, content):
    assert HarmonySplitter().split(text) == (reasoning, content)
    for pieces in _splits(text):
        s, r_all, c_all = HarmonySplitter(), "", ""
        for i, piece in enumerate(pieces):
            r, c = s.finish(piece) if i == len(pieces) - 1 else s.feed(piece)
            r_all, c_all = r_all + r, c_all + c
        assert (r_all, c_all) == (reasoning or "", content), pieces


@pytest.mark.parametrize("tail,text,want", [
    ("<|end|><|start|>assistant<|channel|>final<|message|>", "more text<|return|>", (None, "more text")),
    ("<|start|>assistant<|channel|>analysis<|message|>", "hmm<|end|>" + final("yes"), ("hmm", "yes")),
    # continue_final_message: the prompt ends inside a message's body, its header further back
    ("<|start|>assistant<|channel|>analysis<|message|>I think", " so.<|end|>" + final("yes"), (" so.", "yes")),
    ("<|channel|>final<|message|>The answer is", " 42.<|return|>", (None, " 42.")),
    # (a call the prompt began: its rest passed on as written, no call for the parser to read)
    ("<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{\"a\":", " 1}<|call|>",
     (None, " 1}<|call|>")),
    # a body the prompt closed: the output is a new message
    ("<|start|>user<|message|>hi<|end|><|start|>assistant", "<|channel|>final<|message|>ok", (None, "ok")),
])
def test_a_prompt_that_opened_the_body(tail, text, want):
    assert HarmonySplitter(tail).split(text) == want


def test_streamed_pieces_add_up_on_random_texts():
    rng = random.Random(7)
    parts = ["<|channel|>", "analysis", "final", "commentary", " to=functions.f", " to=python", "<|message|>",
             "<|end|>", "<|call|>", "<|return|>", "<|start|>", "assistant", "<|", "<|e", "|>", "a", " ", "{}"]
    for _ in range(500):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 10)))
        whole = HarmonySplitter().split(text)
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        s, r_all, c_all = HarmonySplitter(), "", ""
        for i, piece in enumerate(pieces):
            r, c = s.finish(piece) if i == len(pieces) - 1 else s.feed(piece)
            r_all, c_all = r_all + r, c_all + c
        assert (r_all, c_all) == (whole[0] or "", whole[1]), (text, pieces)


@pytest.mark.parametrize("text,want", [
    ("assistant<|channel|>final", ("assistant", "final", None, None)),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json", ("", "commentary", "functions.get_weather", "json")),
    ("assistant to=functions.x<|channel|>commentary json", ("assistant", "commentary", "functions.x", "json")),
    ("functions.get_weather to=assistant<|channel|>commentary", ("functions.get_weather", "commentary", "assistant", None)),
    ("", ("", None, None, None)),
])
def test_headers(text, want):
    h = parse_header(text)
    assert (h.role, h.channel, h.recipient, h.content_type) == want


def test_the_format_is_registered():
    fmt = get_reasoning_parser("openai_gptoss")
    assert fmt.harmony and fmt.keeps_special_tokens and isinstance(make_splitter(fmt), HarmonySplitter)
    assert P.name == "openai" and P.keeps_special_tokens and P.channels == "openai_gptoss"


# ---------------------------------------------------------------------------- tool calls
def calls_of(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = P.extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_calls_and_content():
    text = "Let me check." + passed("get_weather", WEATHER) + passed("get_time", '{"zone": "UTC"}', before=True)
    assert calls_of(text) == ("Let me check.", [("get_weather", {"city": "Paris", "days": 3}),
                                                ("get_time", {"zone": "UTC"})])
    assert P.extract(text)[1][0].arguments == '{"city": "Paris", "days": 3}'  # canonical JSON
    # a message to a built-in tool is not a call: it stays in the content, the calls still count
    py = "<|start|>assistant<|channel|>analysis to=python code<|message|>print(1)<|call|>"
    assert calls_of(py + passed("f", "{}")) == (py, [("f", {})])
    # a body with no end token (the stop token left out of the text), whitespace around it
    assert calls_of(passed("f", ' {"a": [1, 2]}\n', end="")) == (None, [("f", {"a": [1, 2]})])
    # a header that got no body is not a call; the one after it is
    assert calls_of("<|start|>assistant to=functions.g<|end|>" + passed("f", "{}")) == (
        "<|start|>assistant to=functions.g<|end|>", [("f", {})])


@pytest.mark.parametrize("text", [
    "No calls here.",
    passed("f", '{"a": 1'),  # cut off in the arguments
    "<|start|>assistant<|channel|>commentary to=functions.f",  # cut off in the header
    passed("f", '["not", "an object"]'),
    passed("f", "{} trailing"),
    passed("f", "not json") + passed("g", "{}"),  # one broken call: the answer is content
    "<|start|>assistant<|channel|>commentary to=functions. json<|message|>{}<|call|>",  # no name
    "<|start|>assistant<|channel|>analysis to=python code<|message|>print(1)<|call|>",
    "<|start|>assistant to=functions.f<|end|>{}<|call|>",  # a header with no body
])
def test_not_calls(text):
    assert P.extract(text) == (text, [])


BROWSER = "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{}<|call|>"
TOOL_ANSWERS = [  # the splitter's output, the content a stream sends, calls or LATE
    ("Let me check." + passed("get_weather", WEATHER) + passed("get_time", '{"zone": "UTC"}'), "Let me check.", 2),
    (passed("get_weather", WEATHER, before=True, end=""), "", 1),
    (BROWSER + passed("f", "{}"), BROWSER, 1),  # a built-in tool's message stays content
    (passed("get_weather", '{"city": "Par'), "", LATE),
    ("Plain <|answer|> text", None, 0),
]


@pytest.mark.parametrize("text,content,want", TOOL_ANSWERS)
def test_calls_streamed_in_every_split(text, content, want):
    every_split(P, text, content, want)


@settings(max_examples=60, deadline=None)
@given(calls=JSON_CALLS, spacing=JSON_SPACINGS, before=st.lists(st.booleans(), min_size=3, max_size=3),
       data=st.data())
def test_any_calls_any_split(calls, spacing, before, data):
    """Random calls (any JSON arguments, spaced any way), maybe cut off anywhere: the stream
    agrees with the non-streamed reading."""
    text = "".join(passed(n, json.dumps(a, **spacing), before=b) for (n, a), b in zip(calls, before, strict=False))
    assert [(c.name, json.loads(c.arguments)) for c in P.extract(text)[1]] == calls
    if data.draw(st.booleans()):
        text = text[:data.draw(st.integers(0, len(text)))]
    agrees_when_cut(P, text, data)


# ---------------------------------------------------------------------------- both, as the server runs them
def through_both(pieces: list[str]) -> tuple[str, str, list[dict], list]:
    """The model's deltas through the splitter, then its content through a ToolStream, as
    server/chat.py runs them: (reasoning, content, tool-call deltas, calls)."""
    s = HarmonySplitter()
    reasoning, content = [], []
    for i, piece in enumerate(pieces):
        r, c = s.finish(piece) if i == len(pieces) - 1 else s.feed(piece)
        reasoning.append(r)
        content.append(c)
    sent, entries, calls = stream(P, content)
    return "".join(reasoning), sent, entries, calls


@pytest.mark.parametrize("text,reasoning,content,calls", [
    (analysis("Need weather.") + call("get_weather", WEATHER), "Need weather.", "",
     [("get_weather", {"city": "Paris", "days": 3})]),
    (analysis("Both.") + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>"
     + call("get_weather", WEATHER, before=True) + call("get_time", '{"zone": "CET"}'), "Both.", "Checking both.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]),
    (analysis("Just answer.") + final("It is sunny."), "Just answer.", "It is sunny.", []),
    (call("f", '{"a": "<|end|>"}', start=False), "", "", [("f", {"a": "<|end|>"})]),
])
def test_raw_output_through_both(text, reasoning, content, calls):
    """GPT-OSS's own output, every split: the reasoning, the content and the calls are the
    non-streamed answer's. (A body that spells <|end|> out ends there for the splitter, which
    reads text, not token ids; as it passes the marker and what follows it on, the call's
    JSON string holding it still reads whole.)"""
    r_whole, c_whole = HarmonySplitter().split(text)
    content_whole, calls_whole = P.extract(c_whole)
    assert (r_whole or "", content_whole or "") == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in calls_whole] == calls
    for pieces in _splits(text):
        r, sent, _, got = through_both(pieces)
        assert (r, [(c.name, json.loads(c.arguments)) for c in got]) == (reasoning, calls), pieces
        s2 = HarmonySplitter()
        split_content = "".join(s2.feed(p)[1] for p in pieces[:-1]) + s2.finish(pieces[-1])[1]
        assert agrees(P, split_content, [split_content], calls_whole or None) == len(calls)
        assert sent == (content if calls else split_content), pieces


BODY = st.lists(st.sampled_from(list("ab {}\":,<|>\n") + ["<|", "|>", "<|e", "<|ca", "<|st", "nd|>"]),
                max_size=6).map("".join)
MESSAGES = st.one_of(
    BODY.map(analysis), BODY.map(lambda t: analysis(t, first=False)), BODY.map(final),
    BODY.map(lambda t: f"<|start|>assistant<|channel|>commentary<|message|>{t}<|end|>"),
    st.tuples(st.sampled_from(["get_weather", "f"]), st.dictionaries(st.sampled_from(["a", "b<|"]), st.integers(0, 9),
                                                                   max_size=2),
              st.booleans(), st.sampled_from(["<|call|>", "<|end|>", ""])).map(
        lambda c: call(c[0], json.dumps(c[1]), before=c[2], end=c[3])),
    BODY.map(lambda t: f"<|start|>assistant<|channel|>analysis to=python code<|message|>{t}<|call|>"),
    BODY,  # stray text
)


@settings(max_examples=150, deadline=None)
@given(messages=st.lists(MESSAGES, min_size=1, max_size=4), data=st.data())
def test_any_harmony_any_split_through_both(messages, data):
    """Random harmony answers (bodies holding pieces of markers), maybe cut off anywhere,
    through the splitter and the tool stream as the server runs them, cut into deltas at
    random and one character a delta: the reasoning and calls are the non-streamed ones; the
    content too where there are calls (but for whitespace), else all the splitter's content."""
    text = "".join(messages)
    if text.startswith("<|start|>assistant"):
        text = text[len("<|start|>assistant"):]  # the prompt wrote it
    if data.draw(st.booleans()):
        text = text[:data.draw(st.integers(0, len(text)))]
    reasoning, split_content = HarmonySplitter().split(text)
    content, calls = P.extract(split_content)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=3)))
    bounds = [0, *cuts, len(text)]
    for pieces in ([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)], list(text) + [""]):
        r, sent, entries, got = through_both(pieces)
        assert r == (reasoning or "")
        assert [(c.name, c.arguments) for c in got] == [(c.name, c.arguments) for c in calls], pieces
        if calls:  # (the content after the first call is stripped, as for every format: server/tools.py)
            assert "".join(sent.split()) == "".join((content or "").split()), pieces
        else:
            assert sent == split_content, pieces
        if calls:  # the argument pieces add up to the arguments
            assert [(c["name"], c["arguments"]) for c in _merged(entries)] == [(c.name, c.arguments) for c in got]
