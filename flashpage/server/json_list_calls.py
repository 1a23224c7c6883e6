"""Tool calls written as a JSON list of ``{"name": ..., "arguments": {...}}`` objects:

- ``granite`` (IBM Granite 3.x, vLLM's name): the whole answer, after Granite 3.0's
  ``<|tool_call|>`` token or 3.1's ``<tool_call>`` text, or bare; whitespace around it. An
  answer that does not open that way (after the marker, its first character ``[``) is
  content; there is no closing marker, and nothing may follow the list.
- ``jamba`` (AI21 Jamba): ``<tool_calls>[...]</tool_calls>`` after the content, nothing but
  whitespace after it.

Either way a list that is not all calls makes the whole answer content."""

from __future__ import annotations

from flashpage.server.partial_json import loads
from flashpage.server.tool_stream import CallReader, JsonCalls
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
