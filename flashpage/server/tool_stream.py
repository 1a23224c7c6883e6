"""Tool calls streamed as vLLM streams them: each call's name as soon as it is written, then
its arguments piece by piece.

For each call of a streamed choice, the client gets first
``{"index": i, "id": ..., "type": "function", "function": {"name": ..., "arguments": ""}}``
(the arguments there are whatever is already known, often ""), then
``{"index": i, "function": {"arguments": piece}}`` deltas. The pieces are the call's final
``arguments`` text (what the non-streamed answer has: the JSON re-serialized as ``json.dumps``
writes it, server/partial_json.py) cut where the model's tokens happened to end: a piece is
sent only once the rest of the answer cannot change it (a number waits for the character
after it), so the pieces always add up to the non-streamed arguments, however the text was
split into deltas. Arguments that cannot be streamed that way (written as a JSON string,
llama3's ``arguments`` where a later ``parameters`` would win) go out whole once the call's
JSON closes; arguments written before the name go out with it.

A parser's ``reader()`` follows the text as it grows and keeps ``calls`` (StreamedCall):
where each one's name and arguments are in a ``CanonicalJson``, and its final form
(``final``, the parser's own reading) once its JSON closed; a format that is not JSON
(pythonic, qwen3_coder) writes the arguments known so far itself (``partial``). What the reader cannot follow
(text that is not a call after all) makes it stop (``dead``); nothing is sent for calls
after that until the end. At the end the parser reads the whole answer, as for a
non-streamed one, and that reading decides: the rest of each call goes out, or, if the answer
is not calls after all (the model wrote a broken call, or was cut off in one), the text goes
out as content, exactly as before this module existed. Deltas already sent for a call then
stay sent: a stream cannot take them back (the finish reason then says "stop" or "length",
not "tool_calls").
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from flashpage.server.partial_json import CanonicalJson, Path, loads

if TYPE_CHECKING:
    from flashpage.server.tools import ToolCall, ToolParser

logger = logging.getLogger("flashpage.server")


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass
class StreamedCall:
    """One call as far as the stream has read it, and what of it went out."""

    id: str
    name: str | None = None
    json: CanonicalJson | None = None  # where its arguments are being written
    args_at: int | None = None  # their offset in json's output; None: not streamed piecewise
    args_end: int | None = None  # where they ended, once they did
    final: ToolCall | None = None  # the parser's reading, once the call's JSON closed
    partial: str = ""  # the arguments so far, where a reader writes them itself (json None)
    header_sent: bool = False
    sent: str = ""  # arguments sent

    def arguments(self) -> str:
        """The start of the final arguments known so far."""
        if self.final is not None:
            return self.final.arguments
        if self.json is None:
            return self.partial
        if self.args_at is None:
            return ""
        end = self.args_end if self.args_end is not None else self.json.size
        return self.json.text()[self.args_at:end]


class CallReader:
    """Follows a choice's text as it grows (``feed(text)``, the whole text each time) and
    keeps the calls it has seen begin. This one sees none: every call goes out at the end."""

    def __init__(self) -> None:
        self.calls: list[StreamedCall] = []
        self.dead = False  # what follows is not what the reader expected: it stops

    def feed(self, text: str) -> None:
        pass


_WS = " \t\r\n"


class TagReader(CallReader):
    """A CallReader over tagged text, as a state machine: ``state`` names the method
    ``_<state>(text)`` that reads on from ``pos`` (False: wait for more text); the state
    "done" ends it."""

    state = "outside"
    pos = 0

    def feed(self, text: str) -> None:
        while not self.dead and self.state != "done" and self.pos < len(text):
            if not getattr(self, "_" + self.state)(text):
                return

    def _expect(self, text: str, tag: str, state: str) -> bool:
        """Whitespace, then ``tag`` (-> ``state``); wait while the text may be its start."""
        while self.pos < len(text) and text[self.pos] in _WS:
            self.pos += 1
        if text.startswith(tag, self.pos):
            self.pos, self.state = self.pos + len(tag), state
            return True
        self.dead = not tag.startswith(text[self.pos:])
        return False


class JsonCalls:
    """The calls in one JSON value, read as it comes: the value one call object, or (with
    ``lists``) a list of them; each call's arguments the value of ``args_key`` in it,
    streamed when it is an object; ``name`` given: the value is that function's arguments
    (``call_id``: the call's id, where the format gives one).
    ``call_of(value)`` reads a closed call object as the parser does (None: not a call).
    A second "name" or ``args_key`` in a call stops its streaming (``call_of`` refuses it)."""

    def __init__(self, reader: CallReader, base: int, call_of: Callable[[Any], ToolCall | None],
                 args_key: str = "arguments", lists: bool = False, objects: bool = True,
                 name: str | None = None, call_id: str | None = None) -> None:
        self.reader, self.base, self.call_of = reader, base, call_of
        self.call_id = call_id
        self.args_key, self.lists, self.objects, self.name = args_key, lists, objects, name
        self.json = CanonicalJson(self._start, self._end)
        self.depth: int | None = None  # of the call objects: 0 (the value) or 1 (a list's items)
        self.call: StreamedCall | None = None  # the call object being read
        self.raw_at = 0  # its start in the raw text, from base
        self.seen: set[str | int] = set()  # its keys so far
        self.stopped = False  # it repeated a key: nothing more of it is streamed
        self.name_is_string = False
        self.text = ""

    def read(self, text: str, end: int, stop: bool = False) -> int:
        """Read ``text[base + json.pos : end]`` (``stop``: not past the value's end); the
        number of characters read."""
        self.text = text
        n = self.json.feed(text[self.base + self.json.pos:end], stop)
        if self.json.failed:
            self.reader.dead = True
        return n

    def _start(self, path: Path, c: str, at: int, raw: int) -> None:
        if self.reader.dead:
            return
        if self.depth is None:
            if c == "[" and self.lists:
                self.depth = 1
                return
            if not self.objects:
                self.reader.dead = True
                return
            self.depth = 0
        if len(path) == self.depth:  # a call begins
            if c != "{":
                self.reader.dead = True
                return
            self.call = StreamedCall(self.call_id or new_call_id(), self.name, self.json)
            self.reader.calls.append(self.call)
            self.raw_at, self.seen, self.stopped = raw, set(), False
            if self.name is not None:
                self.call.args_at = at
        elif len(path) == self.depth + 1 and self.call is not None and self.name is None:
            key = path[-1]
            if key not in ("name", self.args_key):
                return
            if key in self.seen:  # which one counts? call_of refuses the call: stop here
                self.stopped, self.call.args_at = True, None
            elif key == "name":
                self.name_is_string = c == '"'
            elif c == "{" and not self.stopped:
                self.call.args_at = at
            self.seen.add(key)

    def _end(self, path: Path, at: int, raw: int) -> None:
        call, depth = self.call, self.depth
        if self.reader.dead or call is None or depth is None:
            return
        if len(path) == depth + 1 and self.name is None:
            key = path[-1]
            if key == "name" and self.name_is_string and call.name is None and not self.stopped:
                call.name = self.json.last_string
            elif key == self.args_key and call.args_at is not None and call.args_end is None:
                call.args_end = at
        elif len(path) == depth:  # the call's JSON closed: the parser reads it
            raw_text = self.text[self.base + self.raw_at:self.base + raw]
            try:
                final = self.call_of(loads(raw_text))
            except ValueError:
                final = None
            if final is None:
                self.reader.dead = True
            else:
                call.final = final
                call.name = call.name or final.name
            self.call = None


class ToolStream:
    """One streamed choice's text through a parser: ``feed(delta)`` -> (content to send now,
    tool-call deltas to send now); ``finish(delta)`` -> (content still to send or None, the
    last tool-call deltas, the answer's calls). Content goes out until the text could be the
    start of a call (``parser.hold``); text outside calls after that waits for the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.reader = parser.reader()
        self.text = ""
        self.sent = 0  # characters of text already sent as content

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        content = self._content(delta)
        if not self.reader.dead:
            self.reader.feed(self.text)
        if self.reader.dead:  # likely not calls after all: nothing more until the end decides
            return content, []
        return content, _deltas(self.reader.calls)

    def finish(self, delta: str = "") -> tuple[str | None, list[dict[str, Any]], list[ToolCall]]:
        before = self._content(delta)
        rest = self.text[self.sent:]
        content, calls = self.parser.extract(rest)
        if not calls:
            return before + rest or None, [], []
        content = before + (content or "") or None
        streamed = self.reader.calls
        for i, final in enumerate(calls):
            if i == len(streamed):
                streamed.append(StreamedCall(final.id, final.name))
            s = streamed[i]
            if s.header_sent and (s.name != final.name or not final.arguments.startswith(s.sent)):
                logger.error("streamed tool call %d (%s %r) differs from the answer's (%s %r)",
                             i, s.name, s.sent, final.name, final.arguments)
            s.final, s.name = final, s.name or final.name
        ids = [replace(final, id=s.id) for final, s in zip(calls, streamed, strict=False)]
        return content, _deltas(streamed[:len(calls)]), ids


    def _content(self, delta: str) -> str:
        """The text, ``delta`` added, up to where a call may start, not sent before."""
        self.text += delta
        cut = self.parser.hold(self.text)
        if cut <= self.sent:
            return ""
        content, self.sent = self.text[self.sent:cut], cut
        return content


def _deltas(calls: list[StreamedCall]) -> list[dict[str, Any]]:
    """What goes out now: each call's header once its name is known (in order: a call waits
    for the one before it), then the arguments it has beyond those sent; one entry a call."""
    out: list[dict[str, Any]] = []
    for i, c in enumerate(calls):
        entry: dict[str, Any] | None = None
        if not c.header_sent:
            if c.name is None:
                break
            c.header_sent = True
            entry = {"index": i, "id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": ""}}
        args = c.arguments()
        if len(args) > len(c.sent) and args.startswith(c.sent):
            piece, c.sent = args[len(c.sent):], args
            if entry is None:
                entry = {"index": i, "function": {"arguments": piece}}
            else:
                entry["function"]["arguments"] = piece
        if entry is not None:
            out.append(entry)
    return out
