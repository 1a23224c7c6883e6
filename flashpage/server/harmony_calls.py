"""``openai`` tool calls (vLLM's ``--tool-call-parser openai``: GPT-OSS's harmony format,
server/harmony.py): each call a message addressed to a function, its body the arguments'
JSON::

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The text read is what the ``openai_gptoss`` reasoning parser (server/harmony.py, which the
server puts in front of this parser) passes on: the answer's content as plain text, and every
message with a recipient whole, from ``<|start|>`` to its end token (``<|call|>``,
``<|end|>`` or ``<|return|>``; the end of the answer, or the next ``<|start|>``, does too).
A message addressed ``to=functions.NAME`` is a call of NAME; its body must be a JSON object
(whitespace around it allowed), its arguments that object written again canonically, as every
JSON format's (server/partial_json.py). A message to anything else (GPT-OSS's built-in
``python`` and ``browser.*`` tools, which flashpage does not run) is not a call: it stays in
the content as written, so the client sees what the model asked for. A call whose body is not
a JSON object, or that the answer ends inside, makes the whole answer content, as with the
other formats.

Streamed as the JSON formats are (server/tool_stream.py): a call's header once its
arguments object opens, then its canonical JSON piece by piece. The non-streamed reading is
this same reader run over the whole answer.
"""

from __future__ import annotations

from typing import Any

from flashpage.server.harmony import ENDS, MESSAGE, START, first_of, held, parse_header
from flashpage.server.partial_json import dumps
from flashpage.server.tool_stream import JsonCalls, TagReader
from flashpage.server.tools import ToolCall, ToolParser, _content, _prefix_at_end

_WS = " \t\r\n"
_NEXT = (*ENDS, START)  # what ends a message's body
FUNCTIONS = "functions."


def function_of(recipient: str | None) -> str | None:
    """The function a recipient names (``functions.NAME`` -> NAME), else None."""
    if recipient is None or not recipient.startswith(FUNCTIONS):
        return None
    name = recipient[len(FUNCTIONS):]
    return name or None


class OpenAIParser(ToolParser):
    name = "openai"
    keeps_special_tokens = True
    channels = "openai_gptoss"  # the reasoning parser whose text this one reads

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if START not in text:
            return text, []
        reader = self.reader()
        reader.feed(text)
        reader.feed_end(text)
        if reader.dead or not reader.calls:
            return text, []
        outside, at = [], 0
        for start, end in reader.spans:
            outside.append(text[at:start])
            at = end
        outside.append(text[at:])
        return _content(*outside), [c.final for c in reader.calls if c.final is not None]

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, START)

    def reader(self) -> _HarmonyReader:
        return _HarmonyReader()


class _HarmonyReader(TagReader):
    """outside -> (``<|start|>``) header -> (``<|message|>``) args (a function's) or other;
    args -> (the JSON object) after -> (an end token or ``<|start|>``) outside; other -> (an
    end token or ``<|start|>``) outside."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.state = "outside"
        self.spans: list[tuple[int, int]] = []  # each call message's text (the last: so far)
        self.begin = 0  # where the message being read starts
        self.name = ""
        self.body: JsonCalls | None = None

    def feed_end(self, text: str) -> None:
        """The answer ended: a call (or a header, which may be one) cut short is not read."""
        if self.state in ("args", "header"):
            self.dead = True
        elif self.state == "after":
            self.spans[-1] = (self.spans[-1][0], len(text))

    def _outside(self, text: str) -> bool:
        i = text.find(START, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(text) - len(START) + 1)
            return False
        self.begin, self.pos, self.state = i, i + len(START), "header"
        return True

    def _header(self, text: str) -> bool:
        i, mark = first_of(text, (MESSAGE, *_NEXT), self.pos)
        if i < 0:
            return False
        if mark != MESSAGE:  # a header with no body: not a call, read on from its end
            self.pos, self.state = i + (0 if mark == START else len(mark)), "outside"
            return True
        header = parse_header(text[self.pos:i])
        self.pos = i + len(MESSAGE)
        name = function_of(header.recipient)
        if name is None:
            self.state = "other"
            return True
        self.name, self.state = name, "args"
        self.spans.append((self.begin, len(text)))
        return True

    def _args(self, text: str) -> bool:
        if self.body is None:
            self.body = JsonCalls(self, self.pos, self._call, name=self.name)
        self.pos += self.body.read(text, len(text), stop=True)
        if not self.body.json.done:
            return False
        self.body, self.state = None, "after"
        return True

    def _after(self, text: str) -> bool:
        while self.pos < len(text) and text[self.pos] in _WS:
            self.pos += 1
        at, mark = first_of(text, _NEXT, self.pos)
        if at != self.pos:
            self.dead = held(text[self.pos:], _NEXT) != len(text) - self.pos
            return False
        self.pos += 0 if mark == START else len(mark)
        self.spans[-1] = (self.spans[-1][0], self.pos)
        self.state = "outside"
        return True

    def _other(self, text: str) -> bool:
        at, mark = first_of(text, _NEXT, self.pos)
        if at < 0:
            self.pos = max(self.pos, len(text) - held(text, _NEXT))
            return False
        self.pos, self.state = at + (0 if mark == START else len(mark)), "outside"
        return True

    def _call(self, value: Any) -> ToolCall | None:
        return ToolCall(self.name, dumps(value)) if isinstance(value, dict) else None
