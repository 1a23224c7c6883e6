"""``deepseek_v3`` tool calls (vLLM's ``--tool-call-parser deepseek_v3``: DeepSeek-V3 and R1 with
their chat templates): after the content, the calls between DeepSeek's special tokens, each
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
"""

from __future__ import annotations

from typing import Any

from flashpage.server.partial_json import dumps
from flashpage.server.tool_stream import CallReader, JsonCalls, TagReader
from flashpage.server.tools import ToolCall, ToolParser, _content, _prefix_at_end

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
TYPE, FENCE, FENCE_END = "function", "```json", "```"
_WS = " \t\r\n"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if CALLS_BEGIN not in text:
            return text, []
        reader = _DeepSeekReader()
        reader.feed(text)
        if reader.dead or reader.state not in ("calls", "done") or not reader.calls:
            return text, []
        calls = [c.final for c in reader.calls if c.final is not None]
        return _content(text[:reader.begin], text[reader.end or len(text):]), calls

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, CALLS_BEGIN)

    def reader(self) -> CallReader:
        return _DeepSeekReader()


class _DeepSeekReader(TagReader):
    """outside -> (calls begin) calls -> (call begin) type -> (sep) name -> (newline) fence ->
    (```json) args -> (the object) fence_end -> (```) call_end -> (call end) calls;
    calls -> (calls end) done."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.state = "outside"
        self.begin = 0  # where the calls begin in the text
        self.end: int | None = None  # and where they end, once they did
        self.name = ""
        self.body: JsonCalls | None = None

    def _outside(self, text: str) -> bool:
        i = text.find(CALLS_BEGIN, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(text) - len(CALLS_BEGIN) + 1)
            return False
        self.begin, self.pos, self.state = i, i + len(CALLS_BEGIN), "calls"
        return True

    def _calls(self, text: str) -> bool:
        while self.pos < len(text) and text[self.pos] in _WS:
            self.pos += 1
        if text.startswith(CALLS_END, self.pos) and self.calls:
            self.pos, self.state = self.pos + len(CALLS_END), "done"
            self.end = self.pos
            return True
        if self.calls and CALLS_END.startswith(text[self.pos:]):
            return False
        return self._expect(text, CALL_BEGIN, "type")

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
        if not self._expect(text, FENCE, "args"):
            return False
        self.body = JsonCalls(self, self.pos, self._call, name=self.name)
        return True

    def _args(self, text: str) -> bool:
        assert self.body is not None
        self.pos += self.body.read(text, len(text), stop=True)
        if not self.body.json.done:
            return False
        self.state = "fence_end"
        return True

    def _fence_end(self, text: str) -> bool:
        return self._expect(text, FENCE_END, "call_end")

    def _call_end(self, text: str) -> bool:
        return self._expect(text, CALL_END, "calls")

    def _call(self, value: Any) -> ToolCall | None:
        return ToolCall(self.name, dumps(value)) if isinstance(value, dict) else None
