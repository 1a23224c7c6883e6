"""Tool calls written as a marker, then one JSON call object (minimax: several), any number of them:

- ``internlm`` (InternLM2 / 2.5 chat, vLLM's name): ``<|action_start|><|plugin|>`` (special
  tokens, written together), then ``{"name": ..., "parameters": {...}}`` ("arguments" read
  where "parameters" is missing, as vLLM reads it), then ``<|action_end|>``, which may be
  missing at the very end::

      Let me check.<|action_start|><|plugin|>
      {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

  vLLM's parser reads one call an answer (a second makes it fail); here each call block is
  read, the text between and after them content, as hermes' blocks are.
- ``granite-20b-fc`` (IBM granite-20b-functioncalling): ``<function_call>`` before each
  ``{"name": ..., "arguments": {...}}``, whitespace allowed after the marker::

      Sure.<function_call> {"name": "get_weather", "arguments": {"city": "Paris"}}
      <function_call> {"name": "get_time", "arguments": {}}

  There is no closing marker: a call ends where its JSON object does. vLLM drops text after
  an object (up to the next marker); here it is content, with the text before the first.

- ``minimax`` (MiniMax-M1): ``<tool_calls>``, then call objects ``{"name": ..., "arguments":
  {...}}``, one a line (any whitespace between them here), then ``</tool_calls>``, which may
  be missing at the very end; any number of blocks::

      Let me check.<tool_calls>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      {"name": "get_time", "arguments": {}}
      </tool_calls>

  vLLM skips a line that is not a JSON object, drops the text after the first block and
  reads no call inside ``<think>...</think>`` (its reasoning parser's part); here the text
  after a block is content, and a block that is not all calls makes the answer content.

Any way a call that does not read so (JSON that is not a call object, a marker not
followed by one, an answer ending inside one) makes the whole answer content. Streamed as
the JSON formats are (server/tool_stream.py): the header once the name is written, then the
arguments' canonical JSON piece by piece. The non-streamed reading is this same reader run
over the whole answer, so the two agree.
"""

from __future__ import annotations

from flashpage.server.tool_stream import JsonCalls, TagReader
from flashpage.server.tools import ToolCall, ToolParser, _call, _content, _prefix_at_end


class MarkedJsonParser(ToolParser):
    """OPEN, one call object (its arguments under ARGS_KEY, else "arguments"), CLOSE if any."""

    OPEN = CLOSE = ""
    ARGS_KEY = "arguments"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.OPEN not in text:
            return text, []
        reader = self.reader()
        reader.feed(text)
        # done: after a call; the closing marker may be missing at the very end
        done = reader.state == "outside" or reader.state == "close" and reader.pos == len(text)
        if reader.dead or not done or not reader.calls:
            return text, []
        outside, at = [], 0
        for start, end in reader.spans + [(len(text), len(text))]:
            outside.append(text[at:start])
            at = end if end is not None else len(text)
        return _content(*outside), [c.final for c in reader.calls if c.final is not None]

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.OPEN)

    def reader(self) -> _MarkedReader:
        return _MarkedReader(self.OPEN, self.CLOSE, self.ARGS_KEY)


class InternLMParser(MarkedJsonParser):
    name = "internlm"
    keeps_special_tokens = True  # <|action_start|>, <|plugin|>, <|action_end|> are InternLM's special tokens
    OPEN, CLOSE = "<|action_start|><|plugin|>", "<|action_end|>"
    ARGS_KEY = "parameters"


class Granite20bFCParser(MarkedJsonParser):
    name = "granite-20b-fc"
    OPEN = "<function_call>"


class MinimaxParser(MarkedJsonParser):
    name = "minimax"
    OPEN, CLOSE = "<tool_calls>", "</tool_calls>"

    def reader(self) -> _MarkedReader:
        return _MarkedReader(self.OPEN, self.CLOSE, self.ARGS_KEY, several=True)


class _MarkedReader(TagReader):
    """outside -> (OPEN) args -> (the call object) close -> (CLOSE) outside; without CLOSE,
    args -> outside; ``several``: close -> ({) args, more calls before CLOSE."""

    def __init__(self, open_: str, close: str, args_key: str, several: bool = False) -> None:
        super().__init__()
        self.open, self.close, self.args_key, self.several = open_, close, args_key, several
        self.pos = 0
        self.state = "outside"
        self.spans: list[tuple[int, int | None]] = []  # each call's text (no end: to the end)
        self.body: JsonCalls | None = None

    def _outside(self, text: str) -> bool:
        i = text.find(self.open, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(text) - len(self.open) + 1)
            return False
        self.spans.append((i, None))
        self.pos, self.state = i + len(self.open), "args"
        return True

    def _args(self, text: str) -> bool:
        if self.body is None:
            self.body = JsonCalls(self, self.pos, lambda v: _call(v, self.args_key), self.args_key)
        self.pos += self.body.read(text, len(text), stop=True)
        if not self.body.json.done:
            return False
        self.body = None
        if self.close:
            self.state = "close"
        else:
            self._ended()
        return True

    def _close(self, text: str) -> bool:
        if self.several:
            while self.pos < len(text) and text[self.pos] in " \t\r\n":
                self.pos += 1
            if text.startswith("{", self.pos):
                self.state = "args"
                return True
        if not self._expect(text, self.close, "outside"):
            return False
        self._ended()
        return True

    def _ended(self) -> None:
        self.spans[-1] = (self.spans[-1][0], self.pos)
        self.state = "outside"

