"""Tool calls (OpenAI's ``tools``): a model's text read back as function calls.

A chat template shows the model its tools and the shape of a call; the model answers in that
shape, and a parser turns the answer into OpenAI ``tool_calls``. As in vLLM, the parser is the
server's choice (``--tool-call-parser``, with ``--enable-auto-tool-choice`` for ``tool_choice
"auto"``), one per model family:

- ``hermes`` (Qwen2.5, Hermes, many fine-tunes): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, any number, text around them as the message's content;
- ``llama3_json`` (Llama 3.1-3.3): the whole answer one or more ``{"name": ..., "parameters":
  {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``.

An answer whose call does not parse as JSON of that shape is content, not a call (the client
sees what the model wrote). ``tool_choice`` "required" and a named function need no parser:
structured outputs make the model write the call's JSON (server/serving.py, ``tool_guide``).

Streaming: ``ToolStream`` sends content as it comes until the text could be the start of a
call, holds the rest, and at the end sends the calls in one delta (``tool_calls`` with their
ids, names and whole arguments) or, if none parsed, the held text as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # stream deltas number their calls
            d["index"] = index
        return d


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """{"name": str, args_key: object or JSON text} -> a ToolCall; anything else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _prefix_at_end(text: str, marker: str) -> int:
    """Where a (possibly partial) ``marker`` starts in ``text``: its index, or where the
    longest suffix of text that begins the marker starts, else len(text)."""
    i = text.find(marker)
    if i >= 0:
        return i
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ToolParser:
    """extract(text) -> (content or None, calls); hold(text) -> the index from which the text
    may be (the start of) a call, len(text) if none of it can."""

    name = ""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def hold(self, text: str) -> int:
        raise NotImplementedError


def _content(*parts: str) -> str | None:
    text = "".join(parts).strip()
    return text or None


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.OPEN not in text:
            return text, []
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = _call(json.loads(body.strip()), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return _content(self._CALL.sub("", text)), calls

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.OPEN)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        calls, i, decoder = [], 0, json.JSONDecoder()
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in "; \t\r\n":
                i += 1
        return None, calls

    def hold(self, text: str) -> int:
        body = text.lstrip()
        start = len(text) - len(body)
        if not body:
            return 0  # only whitespace yet: a call may follow
        if body.startswith("{") or body.startswith(self.TAG) or self.TAG.startswith(body):
            return start
        return len(text)


class MistralParser(ToolParser):
    name = "mistral"
    MARK = "[TOOL_CALLS]"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find(self.MARK)
        if i < 0:
            return text, []
        try:
            items = json.loads(text[i + len(self.MARK):].strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(it, "arguments") for it in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return _content(text[:i]), [c for c in calls if c is not None]

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.MARK)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: one of {sorted(PARSERS)}")
    return PARSERS[name]()


class ToolStream:
    """One streamed choice's text through a parser: ``feed(delta)`` -> the content to send
    now (all but what may be the start of a call); ``finish()`` -> (the content still to send,
    or None; the calls). Held text that turns out not to be a call goes out as content."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text already sent as content

    def feed(self, delta: str) -> str:
        self.text += delta
        cut = self.parser.hold(self.text)
        if cut <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:cut], cut
        return out

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        rest = self.text[self.sent:]
        content, calls = self.parser.extract(rest)
        if not calls:
            return rest or None, []
        return content, calls
