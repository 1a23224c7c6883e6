"""Tool calls written as a JSON list of ``{"name": ..., "arguments": {...}}`` objects:

- ``granite`` (IBM Granite 3.x, vLLM's name): the whole answer, after Granite 3.0's
  ``<|tool_call|>`` token or 3.1's ``<tool_call>`` text, or bare; whitespace around it. An
  answer that does not open that way (after the marker, its first character ``[``) is
  content; there is no closing marker, and nothing may follow the list.
- ``jamba`` (AI21 Jamba): ``<tool_calls>[...]</tool_calls>`` after the content, nothing but
  whitespace after it.
- ``phi4_mini_json`` (Phi-4-mini): ``functools[...]`` (the ``[`` right after the word, as vLLM
  finds it: "import functools" is not a marker), each call's arguments under "arguments",
  else "parameters" (vLLM's reading). vLLM's content is None; here the text before and after
  the list is the content.
- ``hunyuan_a13b`` (Hunyuan-A13B): ``<tool_calls>[...]</tool_calls>``; the text before and after
  the block is the content (vLLM also drops what follows a ``</think>``, which its reasoning
  parser has taken out before).

- ``xlam`` (Salesforce xLAM): a JSON list of ``{"name": ..., "arguments": {...}}``, the whole
  answer, or the whole answer after the first ``</think>`` (the text up to it the content), or
  in a code fence (```` ```json ```` or ```` ``` ````, the text around the fence the content);
  the first of these places that holds a list is read (below).

For phi4_mini_json and hunyuan_a13b the first marker decides: a list that does not follow it, is not all calls, or
(hunyuan_a13b) is not closed makes the answer content; a second block is content.

Either way a list that is not all calls makes the whole answer content."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flashpage.server.partial_json import loads
from flashpage.server.tool_stream import CallReader, JsonCalls, TagReader
from flashpage.server.tools import ToolCall, ToolParser, _call, _content, _prefix_at_end

MARKERS = ("<|tool_call|>", "<tool_call>")  # 3.0's token, 3.1's text


def _body_at(text: str) -> int | None:
    """Where the list starts (after whitespace and a marker), None where the text is not
    (or cannot yet be seen to be) calls."""
    i = len(text) - len(text.lstrip())
    for m in MARKERS:
        if text.startswith(m, i):
            i += len(m)
            break
    i += len(text[i:]) - len(text[i:].lstrip())
    return i if text.startswith("[", i) else None


class GraniteParser(ToolParser):
    name = "granite"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = _body_at(text)
        if at is None:
            return text, []
        try:
            items = loads(text[at:].strip())
        except ValueError:
            return text, []
        calls = [_call(it, "arguments") for it in items] if isinstance(items, list) else []
        if not calls or any(c is None for c in calls):
            return text, []
        return None, [c for c in calls if c is not None]

    def hold(self, text: str) -> int:
        s = text.lstrip()
        if not s or s.startswith("[") or any(s.startswith(m) or m.startswith(s) for m in MARKERS):
            return 0  # may be (the start of) the calls: the whole answer is held
        return len(text)

    def reader(self) -> CallReader:
        return _GraniteReader()


class _GraniteReader(CallReader):
    """The list of call objects at the answer's start, read as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.body: JsonCalls | None = None

    def feed(self, text: str) -> None:
        if self.body is None:
            at = _body_at(text)
            if at is None:
                if GraniteParser().hold(text) == len(text):
                    self.dead = True  # not calls: nothing to stream
                return
            self.body = JsonCalls(self, at, lambda v: _call(v, "arguments"), lists=True)
        self.body.read(text, len(text))


class JambaParser(ToolParser):
    name = "jamba"
    keeps_special_tokens = True  # <tool_calls> and </tool_calls> are Jamba's special tokens
    OPEN, CLOSE = "<tool_calls>", "</tool_calls>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find(self.OPEN)
        end = text.find(self.CLOSE, i + len(self.OPEN)) if i >= 0 else -1
        if end < 0 or text[end + len(self.CLOSE):].strip():
            return text, []
        try:
            items = loads(text[i + len(self.OPEN):end].strip())
        except ValueError:
            return text, []
        calls = [_call(it, "arguments") for it in items] if isinstance(items, list) else []
        if not calls or any(c is None for c in calls):
            return text, []
        return _content(text[:i]), [c for c in calls if c is not None]

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.OPEN)

    def reader(self) -> CallReader:
        return _JambaReader()


class _JambaReader(CallReader):
    """After ``<tool_calls>``: one JSON list of call objects, up to ``</tool_calls>`` (not fed
    while the text ends in what may be the start of that tag)."""

    def __init__(self) -> None:
        super().__init__()
        self.body: JsonCalls | None = None

    def feed(self, text: str) -> None:
        if self.body is None:
            i = text.find(JambaParser.OPEN)
            if i < 0:
                return
            self.body = JsonCalls(self, i + len(JambaParser.OPEN), lambda v: _call(v, "arguments"),
                                  lists=True)
        base = self.body.base
        self.body.read(text, base + _prefix_at_end(text[base:], JambaParser.CLOSE))


class MarkedListParser(ToolParser):
    """OPEN, a JSON list of call objects (arguments under ARGS_KEY, else FALLBACK), then CLOSE
    (if any); the text around that block the content. An OPEN ending in ``[`` holds the
    list's first character."""

    OPEN = CLOSE = ""
    ARGS_KEY = FALLBACK = "arguments"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.OPEN not in text:
            return text, []
        reader = self.reader()
        reader.feed(text)
        if reader.dead or reader.state != "done" or not reader.calls:
            return text, []
        return _content(text[:reader.start], text[reader.pos:]), [c.final for c in reader.calls
                                                                  if c.final is not None]

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.OPEN)

    def reader(self) -> _MarkedListReader:
        return _MarkedListReader(self.OPEN, self.CLOSE, lambda v: _call(v, self.ARGS_KEY, self.FALLBACK),
                                 self.ARGS_KEY)


class Phi4MiniJsonParser(MarkedListParser):
    name = "phi4_mini_json"
    OPEN = "functools["
    FALLBACK = "parameters"


class HunyuanA13BParser(MarkedListParser):
    name = "hunyuan_a13b"
    OPEN, CLOSE = "<tool_calls>", "</tool_calls>"


class _MarkedListReader(TagReader):
    """outside -> (OPEN) list -> (the list of call objects) close -> (CLOSE) done; without
    CLOSE, list -> done. ``start``: where OPEN is; ``pos`` at "done": where the block ends."""

    def __init__(self, open_: str, close: str, call_of: Callable[[Any], ToolCall | None],
                 args_key: str) -> None:
        super().__init__()
        self.open, self.close, self.call_of, self.args_key = open_, close, call_of, args_key
        self.start = 0
        self.body: JsonCalls | None = None

    def _outside(self, text: str) -> bool:
        i = text.find(self.open, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(text) - len(self.open) + 1)
            return False
        self.start, self.pos, self.state = i, i + len(self.open) - self.open.endswith("["), "list"
        self.body = JsonCalls(self, self.pos, self.call_of, self.args_key, lists=True, objects=False)
        return True

    def _list(self, text: str) -> bool:
        assert self.body is not None
        self.pos += self.body.read(text, len(text), stop=True)
        if not self.body.json.done:
            return False
        self.state = "close" if self.close else "done"
        return True

    def _close(self, text: str) -> bool:
        return self._expect(text, self.close, "done")


THINK_END, FENCE = "</think>", "```"


def _fence_opens_list(after: str) -> bool | None:
    """Whether the text after a fence's backticks opens a list (optional ``json``, whitespace,
    ``[``); None: it may yet."""
    if after.startswith("json"):
        after = after[4:]
    elif "json".startswith(after):
        return None
    after = after.lstrip()
    return after.startswith("[") if after else None


def _xlam_places(text: str) -> list[tuple[int, int | None, bool]]:
    """Where an xLAM list may be, in the order they start: (where its block starts, where its
    ``[`` is, or None while that is undecided, whether it is fenced). A place decided is
    decided for good: more text only adds places after it."""
    places = []
    lead = len(text) - len(text.lstrip())
    if lead == len(text) or text[lead] == "[":
        places.append((0, lead if lead < len(text) else None, False))
    think = text.find(THINK_END)
    if think >= 0:
        at = think + len(THINK_END)
        body = text[at:].lstrip()
        if not body or body[0] == "[":
            places.append((at, len(text) - len(body) if body else None, False))
    i = text.find(FENCE)
    while i >= 0:
        opens = _fence_opens_list(text[i + len(FENCE):])
        if opens is not False:
            j = text.index("[", i) if opens else None
            places.append((i, j, True))
        i = text.find(FENCE, i + len(FENCE))
    return sorted(places)


class XlamParser(ToolParser):
    name = "xlam"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        reader = self.reader()
        reader.feed(text)
        place, body = reader.place, reader.body
        if reader.dead or place is None or body is None or not body.json.done or not reader.calls:
            return text, []
        tail = text[reader.end:].lstrip()
        if place[2] and tail.startswith(FENCE):
            tail = tail[len(FENCE):]
        elif place[2] or tail:  # a fence not closed; text after a bare list
            return text, []
        return _content(text[:place[0]], tail), [c.final for c in reader.calls if c.final is not None]

    def hold(self, text: str) -> int:
        places = _xlam_places(text)
        ends = [len(text) - k for m in (FENCE, THINK_END) for k in range(1, len(m)) if text.endswith(m[:k])]
        return min([p[0] for p in places] + ends + [len(text)])

    def reader(self) -> _XlamReader:
        return _XlamReader()


class _XlamReader(CallReader):
    """The first place (``_xlam_places``) whose list opens, its list read as it comes;
    ``end``: where the list ended."""

    def __init__(self) -> None:
        super().__init__()
        self.place: tuple[int, int | None, bool] | None = None
        self.body: JsonCalls | None = None
        self.end = 0

    def feed(self, text: str) -> None:
        if self.body is None:
            places = _xlam_places(text)
            if not places or places[0][1] is None:
                return  # no list yet, or the first place's undecided
            self.place = places[0]
            self.end = places[0][1]
            self.body = JsonCalls(self, self.end, lambda v: _call(v, "arguments"), lists=True, objects=False)
        self.end += self.body.read(text, len(text), stop=True)
