"""``glm45`` tool calls (vLLM's ``--tool-call-parser glm45``: GLM-4.5 / 4.6 with their chat
templates): tagged blocks, any number, text around them the message's content::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name is the rest of the ``<tool_call>`` line, or what comes before the next tag (no
whitespace inside it; vLLM needs the newline). Each argument is
a key and a value, whitespace around both dropped (``str.strip``), read as vLLM reads them:
a value whose parameter the request's tool declares ``"type": "string"`` keeps its text;
any other (other types, undeclared parameters, unknown functions) is read as JSON, else as
JSON after unescaping (``{\"a\": 1}``), else as a Python literal, else kept as text (a
value JSON cannot hold, NaN or infinity, is not read so). The call's arguments are those
values as a JSON object (server/partial_json.py's ``dumps``), every argument in order, a
repeated one too.

Only whitespace may come between the tags; a ``<tool_call>`` whose contents are anything
else, or that the answer ends inside (before ``</tool_call>``), makes the answer content.
vLLM skips anything between the arguments and keeps only the text before the first call as
content; here text between and after calls is content too, as with hermes and qwen3_coder.

Streamed as written: a call's header once its name's line ends; a string value character by
character (held back only where it may be whitespace the strip drops or the start of
``</arg_value>``), any other value once its ``</arg_value>`` is read. The non-streamed
reading is this same reader run over the whole answer, so the two agree.
"""

from __future__ import annotations

import json
from typing import Any

from flashpage.server.partial_json import dumps, loads
from flashpage.server.pythonic_calls import literal
from flashpage.server.qwen3_coder_calls import _escaped
from flashpage.server.tool_stream import StreamedCall, TagReader, new_call_id
from flashpage.server.tools import ToolCall, ToolParser, _content, _prefix_at_end

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
_WS = " \t\r\n"


def _json(value: Any) -> bool:
    """Whether JSON can hold the value (no NaN or infinity anywhere in it)."""
    def refuse(name: str) -> None:
        raise ValueError(name)
    try:
        json.loads(dumps(value), parse_constant=refuse)
    except (ValueError, TypeError):
        return False
    return True


def deserialize(text: str) -> Any:
    """A value that is not a string parameter's, as vLLM's glm45 reads it."""
    for read in (loads, lambda t: loads(json.loads('"' + t + '"')), literal):
        try:
            value = read(text)
        except (ValueError, TypeError):
            continue
        if _json(value):
            return value
    return text


class Glm45Parser(ToolParser):
    name = "glm45"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if OPEN not in text:
            return text, []
        reader = self.reader()
        reader.feed(text)
        if reader.dead or reader.state != "outside" or not reader.calls:
            return text, []
        outside, at = [], 0
        for start, end in reader.spans + [(len(text), len(text))]:
            outside.append(text[at:start])
            at = end
        calls = [ToolCall(c.name or "", c.partial) for c in reader.calls]
        return _content(*outside), calls

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, OPEN)

    def reader(self) -> _GlmReader:
        strings: dict[str, set[str]] = {}
        for tool in self.tools:
            function = tool.get("function", {})
            params = function.get("parameters") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            strings[function.get("name")] = {
                k for k, v in (props.items() if isinstance(props, dict) else [])
                if isinstance(v, dict) and v.get("type") == "string"}
        return _GlmReader(strings)


class _GlmReader(TagReader):
    """outside -> (``<tool_call>``) name -> (NAME, end of line) args; args -> (``<arg_key>``)
    key -> (KEY ``</arg_key>``) value_open -> (``<arg_value>``) value -> (``</arg_value>``)
    args; args -> (``</tool_call>``) outside."""

    def __init__(self, strings: dict[str, set[str]]) -> None:
        super().__init__()
        self.strings = strings  # each tool's string parameters, by function name
        self.pos = 0
        self.state = "outside"
        self.spans: list[tuple[int, int]] = []  # each call's text (the last one's end: so far)
        self.call: StreamedCall | None = None
        self.args = 0  # the call's arguments so far
        self.streams = False  # the value goes out as it comes (a string)
        self.value_at = 0  # where the value's text starts
        self.start: int | None = None  # where it starts once whitespace is dropped
        self.sent = 0  # how far it went out

    def _outside(self, text: str) -> bool:
        i = text.find(OPEN, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(text) - len(OPEN) + 1)
            return False
        self.spans.append((i, len(text)))
        self.pos, self.state = i + len(OPEN), "name"
        return True

    def _name(self, text: str) -> bool:
        ends = [i for i in (text.find("\n", self.pos), text.find("<", self.pos)) if i >= 0]
        end = min(ends) if ends else len(text)
        name = text[self.pos:end].strip(" \t\r")
        if any(c in _WS for c in name) or (ends and not name):
            self.dead = True
            return False
        if not ends:
            return False
        self.call, self.args, self.state = StreamedCall(new_call_id(), name), 0, "args"
        self.calls.append(self.call)
        self.pos = end
        return True

    def _args(self, text: str) -> bool:
        assert self.call is not None
        while self.pos < len(text) and text[self.pos] in _WS:
            self.pos += 1
        if text.startswith(CLOSE, self.pos):
            self.call.partial += "}" if self.args else "{}"
            self.pos, self.state = self.pos + len(CLOSE), "outside"
            self.spans[-1] = (self.spans[-1][0], self.pos)
            return True
        if CLOSE.startswith(text[self.pos:]):
            return False
        return self._expect(text, KEY, "key")

    def _key(self, text: str) -> bool:
        assert self.call is not None
        end = text.find(KEY_END, self.pos)
        if "<" in text[self.pos:end if end >= 0 else self.pos + _prefix_at_end(text[self.pos:], KEY_END)]:
            self.dead = True
            return False
        if end < 0:
            return False
        key = text[self.pos:end].strip()
        self.streams = key in self.strings.get(self.call.name or "", set())
        self.call.partial += ("{" if not self.args else ", ") + dumps(key) + ": "
        self.call.partial += '"' if self.streams else ""
        self.args += 1
        self.pos, self.state = end + len(KEY_END), "value_open"
        return True

    def _value_open(self, text: str) -> bool:
        if not self._expect(text, VALUE, "value"):
            return False
        self.value_at = self.sent = self.pos
        self.start = None
        return True

    def _value(self, text: str) -> bool:
        assert self.call is not None
        end = text.find(VALUE_END, self.pos)
        if end < 0:  # what may not be the value's yet: a start of </arg_value>, whitespace before it
            self.pos = max(self.value_at, len(text) - len(VALUE_END) + 1)
            if self.streams:
                self._send(text, self.pos + _prefix_at_end(text[self.pos:], VALUE_END))
            return False
        if self.streams:
            self._send(text, end)
            self.call.partial += '"'
        else:
            self.call.partial += dumps(deserialize(text[self.value_at:end].strip()))
        self.pos, self.state = end + len(VALUE_END), "args"
        return True

    def _send(self, text: str, cut: int) -> None:
        """A string value's text up to ``cut`` out, less whitespace at either end."""
        assert self.call is not None
        if self.start is None:
            while self.sent < cut and text[self.sent].isspace():
                self.sent += 1
            if self.sent == cut:
                return
            self.start = self.sent
        while cut > self.sent and text[cut - 1].isspace():
            cut -= 1
        if cut > self.sent:
            self.call.partial += _escaped(text[self.sent:cut])
            self.sent = cut
