"""JSON as tool calls carry it: read keeping every member, written back canonically, and
written back a character at a time while the model is still writing it.

A call's ``arguments`` are the model's JSON written again the way ``json.dumps`` writes it
(``", "`` and ``": "`` between items, no other whitespace, non-ASCII kept, strings escaped
only where JSON must, numbers as Python reads and writes them: ``1.50`` -> ``1.5``). That
text does not depend on how the model spaced or escaped its JSON, so a stream can send it
piece by piece: ``CanonicalJson`` reads raw JSON text a character at a time and appends to
its output only what the rest of the text cannot change::

    raw read so far                     canonical output so far
    {"city":"Par                        {"city": "Par
    {"city":"Paris", "days":1           {"city": "Paris", "days":       (1 may become 12)
    {"city":"Paris", "days":12}         {"city": "Paris", "days": 12}

So the output is always a prefix of ``dumps(loads(raw))`` when the raw text turns out to be
valid JSON; a number or literal waits for the character after it, a ``\\ud83d`` escape for
its low surrogate. ``loads`` keeps an object's members in order, repeats included, and
``dumps`` writes them all (where ``json.dumps(json.loads(...))`` would keep the last value
at the first key's place): the canonical text then follows the model's text member by
member, and a client reading it still gets the last value, as from the model's own text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

Path = tuple[str | int, ...]  # object keys and list indices from the top-level value down
# (path of the value, its first character, output offset, raw offset) on a value's start;
# (path, output offset after it, raw offset after it) on its end
OnStart = Callable[[Path, str, int, int], None]
OnEnd = Callable[[Path, int, int], None]

_WS = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WRITE = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
_HEX = frozenset("0123456789abcdefABCDEF")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LITERALS = frozenset({"true", "false", "null", "NaN", "Infinity", "-Infinity"})  # as Python reads


class Members(dict[str, Any]):
    """A JSON object read by ``loads``: a dict (the last value of a repeated key, as
    ``json.loads`` gives) that also keeps every member in order."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs

    def count(self, key: str) -> int:
        return sum(k == key for k, _ in self.pairs)


def loads(text: str) -> Any:
    """``json.loads`` with objects as ``Members``."""
    return json.loads(text, object_pairs_hook=Members)


def dumps(value: Any) -> str:
    """The canonical text of a value (``json.dumps(value, ensure_ascii=False)``, an object
    read by ``loads`` with every member it had)."""
    if isinstance(value, dict):
        pairs = value.pairs if isinstance(value, Members) else value.items()
        return "{" + ", ".join(f"{dumps(k)}: {dumps(v)}" for k, v in pairs) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _write_char(ch: str) -> str:
    if ch in _WRITE:
        return _WRITE[ch]
    return f"\\u{ord(ch):04x}" if ch < " " else ch


class CanonicalJson:
    """One JSON value (whitespace around it allowed) read a character at a time.

    ``feed(text)`` reads more; ``text()`` is the canonical output so far. ``done``: the value
    is complete; ``failed``: the text is not JSON (or not only one value), nothing more is
    read. ``end()`` says the input ended (a top-level number ends there). ``on_start`` and
    ``on_end`` report each value's path and offsets, so a reader can find a member (a tool
    call's name, its arguments) in the output and in the raw text."""

    def __init__(self, on_start: OnStart | None = None, on_end: OnEnd | None = None) -> None:
        self.on_start, self.on_end = on_start, on_end
        self._out: list[str] = []
        self.size = 0  # characters written
        self.pos = 0  # characters read
        self.done = self.failed = False
        # open containers: [kind "{" or "[", state, key (object) or index (list)]
        self._stack: list[list[Any]] = []
        self._top = "value"  # before the top-level value; "after" once it started
        self._token: str | None = None  # a number or literal being read
        self._string: list[str] | None = None  # the decoded characters of a string being read
        self._key = False  # that string is an object's key
        self._escape: str | None = None  # after a backslash: what followed it so far
        self._high: str | None = None  # a \\u high surrogate waiting for its low half
        self.last_string = ""  # the last string value read

    def text(self) -> str:
        if len(self._out) > 1:
            self._out = ["".join(self._out)]
        return self._out[0] if self._out else ""

    def feed(self, text: str, stop: bool = False) -> int:
        """Read ``text`` (``stop``: only up to the end of the value); the characters read."""
        for i, c in enumerate(text):
            if self.failed or (stop and self.done):
                return i
            self._char(c)
            self.pos += 1
        return len(text)

    def end(self) -> None:
        if self._token is not None and not self.failed:
            self._end_token()

    # ------------------------------------------------------------------ reading
    def _write(self, s: str) -> None:
        self._out.append(s)
        self.size += len(s)

    def _fail(self) -> None:
        self.failed = True

    def _path(self) -> Path:
        return tuple(f[2] for f in self._stack)

    def _char(self, c: str) -> None:
        if self._string is not None:
            self._string_char(c)
            return
        if self._token is not None:
            if c.isalnum() or c in "+-.":
                self._token += c
                return
            self._end_token()
            if self.failed:
                return
        if c in _WS:
            return
        if not self._stack:
            if self._top == "value":
                self._top = "after"
                self._start(c)
            else:
                self._fail()  # something after the value
            return
        frame = self._stack[-1]
        kind, state = frame[0], frame[1]
        if state == "next":
            if c == ",":
                self._write(", ")
                if kind == "{":
                    frame[1] = "key"
                else:
                    frame[1], frame[2] = "value", frame[2] + 1
            elif c == ("}" if kind == "{" else "]"):
                self._close()
            else:
                self._fail()
        elif state in ("key0", "key"):
            if c == '"':
                self._write('"')
                self._string, self._key = [], True
            elif c == "}" and state == "key0":
                self._close()
            else:
                self._fail()
        elif state == "colon":
            if c == ":":
                self._write(": ")
                frame[1] = "value"
            else:
                self._fail()
        elif c == "]" and state == "value0":
            self._close()
        else:  # "value" or "value0": a member's value or a list's item
            frame[1] = "next"
            self._start(c)

    def _start(self, c: str) -> None:
        path, at, raw = self._path(), self.size, self.pos
        if c == "{":
            self._write("{")
            self._stack.append(["{", "key0", ""])
        elif c == "[":
            self._write("[")
            self._stack.append(["[", "value0", 0])
        elif c == '"':
            self._write('"')
            self._string, self._key = [], False
        elif c in "-0123456789tfnNI":
            self._token = c
        else:
            self._fail()
            return
        if self.on_start is not None:
            self.on_start(path, c, at, raw)

    def _ended(self, raw_end: int) -> None:
        if self.on_end is not None:
            self.on_end(self._path(), self.size, raw_end)
        if not self._stack:
            self.done = True

    def _close(self) -> None:
        self._write("}" if self._stack.pop()[0] == "{" else "]")
        self._ended(self.pos + 1)

    def _end_token(self) -> None:
        token, self._token = self._token or "", None
        if token not in _LITERALS and not _NUMBER.fullmatch(token):
            self._fail()
            return
        try:  # written as Python reads and writes it: 1.50 -> 1.5, 1E2 -> 100.0
            self._write(json.dumps(json.loads(token)))
        except ValueError:  # an integer past Python's digit limit
            self._fail()
            return
        self._ended(self.pos)

    def _string_char(self, c: str) -> None:
        if self._escape is not None:
            e = self._escape = self._escape + c
            if e[0] == "u":
                if c not in _HEX and len(e) > 1:
                    self._fail()
                elif len(e) == 5:
                    self._escape = None
                    self._decoded(chr(int(e[1:], 16)), escaped=True)
            elif e in _ESCAPES:
                self._escape = None
                self._decoded(_ESCAPES[e])
            else:
                self._fail()
            return
        if c == "\\":
            self._escape = ""
        elif c == '"':
            self._flush_high()
            self._write('"')
            text, self._string = "".join(self._string or []), None
            if self._key:
                self._stack[-1][1:] = ["colon", text]
            else:
                self.last_string = text
                self._ended(self.pos + 1)
        elif c < " ":  # a raw control character: Python's json refuses it (strict)
            self._fail()
        else:
            self._decoded(c)

    def _decoded(self, ch: str, escaped: bool = False) -> None:
        if self._high is not None:
            if escaped and "\udc00" <= ch <= "\udfff":  # a pair: one character
                high, self._high = self._high, None
                ch = chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(ch) - 0xDC00))
            else:
                self._flush_high()
        if escaped and "\ud800" <= ch <= "\udbff":
            self._high = ch  # its low half may follow
            return
        assert self._string is not None
        self._string.append(ch)
        self._write(_write_char(ch))

    def _flush_high(self) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            assert self._string is not None
            self._string.append(high)
            self._write(high)
