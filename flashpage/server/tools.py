"""Tool calls (OpenAI's ``tools``): a model's text read back as function calls.

A chat template shows the model its tools and the shape of a call; the model answers in that
shape, and a parser turns the answer into OpenAI ``tool_calls``. As in vLLM, the parser is the
server's choice (``--tool-call-parser``, with ``--enable-auto-tool-choice`` for ``tool_choice
"auto"``), one per model family:

- ``hermes`` (Qwen2.5, Hermes, many fine-tunes): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, any number, text around them as the message's content;
- ``llama3_json`` (Llama 3.1-3.3): the whole answer one or more ``{"name": ..., "parameters":
  {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``;
- ``pythonic`` (Llama 3.2 / 4: a Python list of calls, server/pythonic_calls.py; vLLM's
  ``llama4_pythonic`` the same), ``qwen3_coder`` (Qwen3-Coder's XML-like tags, values typed
  by the tool's schema, server/qwen3_coder_calls.py), ``deepseek_v3`` and ``deepseek_v31``
  (DeepSeek-V3 / R1 and V3.1's special tokens around JSON, server/deepseek_calls.py) and
  ``kimi_k2`` (Kimi K2's, the call ids the model's, server/kimi_calls.py) and ``glm45``
  (GLM-4.5's key / value tags, values typed by the tool's schema, server/glm_calls.py),
  ``qwen3_xml`` (qwen3_coder's tags, values read as vLLM's qwen3_xml reads them),
  ``granite`` and ``jamba`` (a JSON list, server/json_list_calls.py), ``phi4_mini_json`` and
  ``hunyuan_a13b`` (a marker, then a JSON list) and ``xlam`` (a JSON list alone, after
  ``</think>`` or in a code fence), in json_list_calls.py too, ``internlm``,
  ``granite-20b-fc`` and ``minimax`` (a marker before JSON call objects,
  server/marked_json_calls.py), ``seed_oss`` (qwen3_coder's tags inside Seed's,
  server/seed_oss_calls.py), ``openai`` (GPT-OSS's harmony messages addressed to functions,
  server/harmony_calls.py, reading what the ``openai_gptoss`` reasoning parser passes on),
  each in its own module, imported when chosen.

An answer whose call does not parse as JSON of that shape is content, not a call (the client
sees what the model wrote). ``tool_choice`` "required" and a named function need no parser:
structured outputs make the model write the call's JSON (server/serving.py, ``tool_guide``).

A call's ``arguments`` are its JSON object written again canonically (``json.dumps``'s
spacing; every member, repeats included: server/partial_json.py); a call object that repeats
``name`` or its arguments key is not a call (which one would count?).

Streaming (server/tool_stream.py): content goes out as it comes until the text could be the
start of a call; each parser's ``reader()`` then follows the calls as they are written, so
each call's name goes out as soon as it is complete and its arguments piece by piece.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from flashpage.server.partial_json import Members, dumps, loads
from flashpage.server.tool_stream import CallReader, JsonCalls, new_call_id


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # stream deltas number their calls
            d["index"] = index
        return d


def _call(obj: Any, args_key: str, fallback: str = "arguments") -> ToolCall | None:
    """{"name": str, args_key (else fallback): object or JSON text} (read by ``loads``) -> a
    ToolCall; anything else, or a call repeating its name or arguments, None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = args_key if args_key in obj else fallback
    if isinstance(obj, Members) and (obj.count("name") > 1 or obj.count(key) > 1):
        return None
    args = obj.get(key, {})
    if isinstance(args, str):
        try:
            args = loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], dumps(args))


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
    may be (the start of) a call, len(text) if none of it can; reader() -> what follows the
    calls of a streamed answer as it is written (server/tool_stream.py). ``tools``: the
    request's tool definitions (OpenAI's dicts), for formats whose reading depends on them."""

    name = ""
    # the format's markers are special tokens the answer's text must keep (the request's
    # skip_special_tokens is then off, as vLLM's parser for the format turns it off)
    keeps_special_tokens = False
    # the reasoning parser whose output this format reads (openai: openai_gptoss's, the
    # harmony channels; the server puts it in front when none was chosen)
    channels: str | None = None

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def hold(self, text: str) -> int:
        raise NotImplementedError

    def reader(self) -> CallReader:
        return CallReader()


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
                call = _call(loads(body.strip()), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return _content(self._CALL.sub("", text)), calls

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.OPEN)

    def reader(self) -> CallReader:
        return _HermesReader()


class _HermesReader(CallReader):
    """Text outside calls skipped; each ``<tool_call>`` body read as one call object up to
    ``</tool_call>`` (not fed while the text ends in what may be the start of that tag)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0  # where reading goes on in the text
        self.body: JsonCalls | None = None  # the call being read

    def feed(self, text: str) -> None:
        open_, close = HermesParser.OPEN, HermesParser.CLOSE
        while not self.dead:
            if self.body is None:
                i = text.find(open_, self.pos)
                if i < 0:
                    self.pos = max(self.pos, len(text) - len(open_) + 1)
                    return
                self.pos = i + len(open_)
                self.body = JsonCalls(self, self.pos, lambda v: _call(v, "arguments"))
            end = self.pos + _prefix_at_end(text[self.pos:], close)
            self.pos += self.body.read(text, end)
            if not text.startswith(close, end) or self.dead:
                return
            if not self.body.json.done:  # a call cut short: not a call
                self.dead = True
                return
            self.pos, self.body = end + len(close), None


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        calls, i, decoder = [], 0, json.JSONDecoder(object_pairs_hook=Members)
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except ValueError:
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

    def reader(self) -> CallReader:
        return _Llama3Reader()


class _Llama3Reader(CallReader):
    """Whitespace, ``<|python_tag|>`` and whitespace, then call objects apart by ``;`` and
    whitespace; "parameters" streamed (Llama's key; "arguments", which it overrides, goes out
    whole when its call closes)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.tagged = False
        self.started = False  # the first object began
        self.body: JsonCalls | None = None

    def feed(self, text: str) -> None:
        tag = Llama3JsonParser.TAG
        while not self.dead and self.pos < len(text):
            if self.body is not None:
                self.pos += self.body.read(text, len(text), stop=True)
                if not self.body.json.done:
                    return
                self.body = None
                continue
            c = text[self.pos]
            if c == "{":
                self.started = True
                self.body = JsonCalls(self, self.pos, lambda v: _call(v, "parameters"), "parameters")
            elif self.started and c in "; \t\r\n" or not self.started and c.isspace():
                self.pos += 1
            elif not self.started and not self.tagged and text.startswith(tag, self.pos):
                self.pos, self.tagged = self.pos + len(tag), True
            elif not self.started and not self.tagged and tag.startswith(text[self.pos:]):
                return  # the tag may be coming
            else:
                self.dead = True


class MistralParser(ToolParser):
    name = "mistral"
    MARK = "[TOOL_CALLS]"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        i = text.find(self.MARK)
        if i < 0:
            return text, []
        try:
            items = loads(text[i + len(self.MARK):].strip())
        except ValueError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(it, "arguments") for it in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return _content(text[:i]), [c for c in calls if c is not None]

    def hold(self, text: str) -> int:
        return _prefix_at_end(text, self.MARK)

    def reader(self) -> CallReader:
        return _MistralReader()


class _MistralReader(CallReader):
    """After ``[TOOL_CALLS]``: one JSON list of call objects, or one call object."""

    def __init__(self) -> None:
        super().__init__()
        self.body: JsonCalls | None = None

    def feed(self, text: str) -> None:
        if self.body is None:
            i = text.find(MistralParser.MARK)
            if i < 0:
                return
            self.body = JsonCalls(self, i + len(MistralParser.MARK), lambda v: _call(v, "arguments"),
                                  lists=True)
        self.body.read(text, len(text))


# name -> "module:class" under flashpage.server, imported when chosen (vLLM's names)
PARSERS: dict[str, str] = {
    "hermes": "tools:HermesParser",
    "llama3_json": "tools:Llama3JsonParser",
    "mistral": "tools:MistralParser",
    "pythonic": "pythonic_calls:PythonicParser",
    "llama4_pythonic": "pythonic_calls:PythonicParser",  # Llama 4's <|python_start|> is read
    "qwen3_coder": "qwen3_coder_calls:Qwen3CoderParser",
    "qwen3_xml": "qwen3_coder_calls:Qwen3XmlParser",  # the same tags, values read as vLLM's qwen3_xml
    "deepseek_v3": "deepseek_calls:DeepSeekV3Parser",
    "deepseek_v31": "deepseek_calls:DeepSeekV31Parser",
    "kimi_k2": "kimi_calls:KimiK2Parser",
    "glm45": "glm_calls:Glm45Parser",
    "granite": "json_list_calls:GraniteParser",
    "jamba": "json_list_calls:JambaParser",
    "internlm": "marked_json_calls:InternLMParser",
    "granite-20b-fc": "marked_json_calls:Granite20bFCParser",
    "phi4_mini_json": "json_list_calls:Phi4MiniJsonParser",
    "hunyuan_a13b": "json_list_calls:HunyuanA13BParser",
    "xlam": "json_list_calls:XlamParser",
    "seed_oss": "seed_oss_calls:SeedOssParser",
    "minimax": "marked_json_calls:MinimaxParser",
    "openai": "harmony_calls:OpenAIParser",  # GPT-OSS's harmony messages to functions
}


def get_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The parser vLLM's ``--tool-call-parser NAME`` names, for a request with ``tools``."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: one of {sorted(PARSERS)}")
    module, cls = PARSERS[name].split(":")
    parser: type[ToolParser] = getattr(importlib.import_module(f"flashpage.server.{module}"), cls)
    return parser(tools)
