"""``deepseek_v3`` and ``deepseek_v31`` tool calls (vLLM's ``--tool-call-parser deepseek_v3``:
DeepSeek-V3 and R1 with their chat templates; ``deepseek_v31``: DeepSeek-V3.1): after the content, the calls between DeepSeek's special tokens, each
its type, name and a fenced JSON object of arguments::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(``｜`` is U+FF5C, ``▁`` U+2581.) The type must be ``function``, the name is the rest of its
line, the arguments a JSON object (whitespace around it and around the tokens allowed); the
closing ``<｜tool▁calls▁end｜>`` may be missing at the very end. Text before the calls and
after them is the content; a call that does not read so makes the whole answer content.
Streamed as the JSON formats are (server/tool_stream.py): the header once the arguments
object opens, then its canonical JSON piece by piece. The non-streamed reading is this same
reader run over the whole answer.

DeepSeek-V3.1 writes each call without the type and the fence, its name up to the separator
(whitespace around it allowed) and the JSON object right after it::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Kimi K2 (server/kimi_calls.py) is SectionReader too, with its own tokens and call header.
"""

from __future__ import annotations

from typing import Any

from flashpage.server.partial_json import dumps
from flashpage.server.tool_stream import JsonCalls, TagReader
from flashpage.server.tools import ToolCall, ToolParser, _content, _prefix_at_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TYPE, FENCE, FENCE_END = "function", "```json", "```"
_WS = " \t\r\n"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    CALLS_BEGIN = CALLS_BEGIN

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.CALLS_BEGIN not in text:
            return text, []
        reader = self.reader()
        reader.feed(text)
        if reader.dead or reader.state not in ("calls", "done") or not reader.calls:
            return text, []
        calls = [c.final for c in reader.calls if c.final is not None]
        return _content(text[:reader.begin], text[reader.end or len(text):]), calls

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.CALLS_BEGIN)

    def reader(self) -> SectionReader:
        return _DeepSeekReader()


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseek_v31"

    def reader(self) -> SectionReader:
        return _DeepSeekV31Reader()


class SectionReader(TagReader):
    """Calls between special tokens: outside -> (calls begin) calls -> (call begin) ``HEADER``
    ... -> args (the JSON object) -> ``AFTER_ARGS`` ... -> call_end -> (call end) calls;
    calls -> (calls end) done. A subclass reads the header (its states end in "args", with
    ``name`` and ``call_id`` set) and names the tokens."""

    CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END = CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END
    HEADER = AFTER_ARGS = "call_end"

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.state = "outside"
        self.begin = 0  # where the calls begin in the text
        self.end: int | None = None  # and where they end, once they did
        self.name = ""
        self.call_id: str | None = None  # the call's id, where the format gives it
        self.body: JsonCalls | None = None

    def _outside(self, text: str) -> bool:
        i = text.find(self.CALLS_BEGIN, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(text) - len(self.CALLS_BEGIN) + 1)
            return False
        self.begin, self.pos, self.state = i, i + len(self.CALLS_BEGIN), "calls"
        return True

    def _calls(self, text: str) -> bool:
        while self.pos < len(text) and text[self.pos] in _WS:
            self.pos += 1
        if text.startswith(self.CALLS_END, self.pos) and self.calls:
            self.pos, self.state = self.pos + len(self.CALLS_END), "done"
            self.end = self.pos
            return True
        if self.calls and self.CALLS_END.startswith(text[self.pos:]):
            return False
        return self._expect(text, self.CALL_BEGIN, self.HEADER)

    def _upto(self, text: str, tag: str, bad: str) -> str | None:
        """The text up to ``tag``, whitespace around it dropped, once the tag is written (None
        to wait; dead if it is empty or holds whitespace or a character of ``bad``)."""
        i = text.find(tag, self.pos)
        end = i if i >= 0 else self.pos + _prefix_at_end(text[self.pos:], tag)
        word = text[self.pos:end].strip(_WS)
        if any(c in _WS or c in bad for c in word) or (i >= 0 and not word):
            self.dead = True
            return None
        if i < 0:
            return None
        self.pos = i + len(tag)
        return word

    def _args(self, text: str) -> bool:
        if self.body is None:
            self.body = JsonCalls(self, self.pos, self._call, name=self.name, call_id=self.call_id)
        self.pos += self.body.read(text, len(text), stop=True)
        if not self.body.json.done:
            return False
        self.body, self.state = None, self.AFTER_ARGS
        return True

    def _call_end(self, text: str) -> bool:
        return self._expect(text, self.CALL_END, "calls")

    def _call(self, value: Any) -> ToolCall | None:
        if not isinstance(value, dict):
            return None
        if self.call_id is None:
            return ToolCall(self.name, dumps(value))
        return ToolCall(self.name, dumps(value), self.call_id)


class _DeepSeekReader(SectionReader):
    """DeepSeek-V3's header: type -> (``function`` sep) name -> (newline) fence -> (```json)
    args; after them: fence_end -> (```) call_end."""

    HEADER, AFTER_ARGS = "type", "fence_end"

    def _type(self, text: str) -> bool:
        return self._expect(text, TYPE + SEP, "name")

    def _name(self, text: str) -> bool:
        end = text.find("\n", self.pos)
        name = text[self.pos:end if end >= 0 else len(text)].strip(" \t\r")
        if any(c in _WS or c == "<" for c in name) or (end >= 0 and not name):
            self.dead = True
            return False
        if end < 0:
            return False
        self.name, self.pos, self.state = name, end + 1, "fence"
        return True

    def _fence(self, text: str) -> bool:
        return self._expect(text, FENCE, "args")

    def _fence_end(self, text: str) -> bool:
        return self._expect(text, FENCE_END, "call_end")


class _DeepSeekV31Reader(SectionReader):
    """DeepSeek-V3.1's header: name -> (NAME sep) args; after them: call_end."""

    HEADER = "name"

    def _name(self, text: str) -> bool:
        name = self._upto(text, SEP, "<")
        if name is None:
            return False
        self.name, self.state = name, "args"
        return True
