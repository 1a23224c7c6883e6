"""A chat request's ``tools`` and ``tool_choice``: what the chat template is shown, how the
output is constrained, and how the answer is read back into ``tool_calls``.

- no tools, or ``"none"``: a plain chat (the template is not shown the tools);
- ``"auto"`` (the default with tools): the template shows the tools, the model decides, the
  server's parser (``--tool-call-parser``, server/tools.py) reads its calls; only with
  ``--enable-auto-tool-choice``, as in vLLM;
- ``"required"``: structured outputs make the model write a JSON list of one or more
  ``{"name": ..., "parameters": {...}}`` (each name one of the tools, its parameters valid
  against that tool's schema; one call only if ``parallel_tool_calls`` is false);
- a named function: structured outputs make it write that function's arguments object.

The forced modes need no parser, and take no other structured-outputs request (400).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashpage.sampling_params import StructuredOutputsParams
from flashpage.server.partial_json import Members, dumps, loads
from flashpage.server.protocol import ChatCompletionRequest, ChatMessage, ToolDef, bad_request
from flashpage.server.structured import structured_field
from flashpage.server.tool_stream import CallReader, JsonCalls
from flashpage.server.tools import ToolCall, ToolParser, get_parser


@dataclass
class ToolRequest:
    mode: str  # "" (no tools), "none", "auto", "required" or "named"
    template_tools: list[dict[str, Any]] | None = None  # shown to the chat template
    structured: StructuredOutputsParams | None = None  # required / named: the output's shape
    parser: ToolParser | None = None  # how the answer is read (every mode but "" and "none")


def _arguments_schema(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


def tool_request(req: ChatCompletionRequest, parser_name: str | None,
                 auto_tool_choice: bool) -> ToolRequest:
    """The request's tools read; a 400 naming the field for a choice it cannot have."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolRequest("")
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise bad_request(f"tools must have distinct names, got {names}", "tools")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolRequest("none")
    defs = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        if not auto_tool_choice or parser_name is None:
            raise bad_request('tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                              "and --tool-call-parser (or ask for \"required\" or a named function)",
                              "tool_choice")
        return ToolRequest("auto", defs, parser=get_parser(parser_name, defs))
    other = structured_field(req)
    if other is not None:
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'of a function'} shapes "
                          f"the output itself: not with {other}", other)
    if choice == "required":
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": t.function.name},
                                              "parameters": _arguments_schema(t)},
             "required": ["name", "parameters"]} for t in tools]}}
        if req.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ToolRequest("required", defs, StructuredOutputsParams(json=calls), _ForcedCalls(None))
    assert not isinstance(choice, str)
    name = choice.function.name
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools {names}", "tool_choice")
    tool = tools[names.index(name)]
    return ToolRequest("named", defs, StructuredOutputsParams(json=_arguments_schema(tool)), _ForcedCalls(name))


class _ForcedCalls(ToolParser):
    """The forced modes' answers: a named function's arguments object (``name`` set) or
    "required"'s list of {"name", "parameters"}; the whole answer is the call(s), so a stream
    sends no content, only the calls as they are written. An answer cut short (max_tokens)
    does not parse: it stays content."""

    def __init__(self, name: str | None) -> None:
        super().__init__()
        self.function = name

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            value = loads(text)
        except ValueError:
            return text, []
        if self.function is not None:
            call = self._named(value)
            return (None, [call]) if call is not None else (text, [])
        if not isinstance(value, list) or not value:
            return text, []
        calls = [_required_call(item) for item in value]
        if any(c is None for c in calls):
            return text, []
        return None, [c for c in calls if c is not None]

    def hold(self, text: str) -> int:
        return 0

    def reader(self) -> CallReader:
        if self.function is not None:
            return _WholeAnswer(self._named, name=self.function)
        return _WholeAnswer(_required_call, args_key="parameters", lists=True, objects=False)

    def _named(self, value: Any) -> ToolCall | None:
        return ToolCall(self.function or "", dumps(value)) if isinstance(value, dict) else None


class _WholeAnswer(CallReader):
    """The whole answer one JSON value: the calls (JsonCalls' arguments say how)."""

    def __init__(self, call_of: Callable[[Any], ToolCall | None], **kw: Any) -> None:
        super().__init__()
        self.body = JsonCalls(self, 0, call_of, **kw)

    def feed(self, text: str) -> None:
        self.body.read(text, len(text))


def _required_call(item: Any) -> ToolCall | None:
    if not (isinstance(item, dict) and isinstance(item.get("name"), str)
            and isinstance(item.get("parameters"), dict)):
        return None
    if isinstance(item, Members) and (item.count("name") > 1 or item.count("parameters") > 1):
        return None
    return ToolCall(item["name"], dumps(item["parameters"]))


def assistant_message(content: str | None, calls: list[ToolCall]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended in calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as chat templates take them: text parts joined; an assistant's earlier
    tool calls with their arguments as objects (templates write them with ``tojson``), a
    tool message's ``tool_call_id`` and ``name``; an assistant's reasoning (or
    reasoning_content) as ``reasoning_content`` (Qwen3's and GLM's templates read it) and
    ``thinking`` (GPT-OSS's, which writes a tool-calling turn's analysis back from it), as
    transformers 5 names it for templates itself."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        thinking = m.reasoning if m.reasoning is not None else m.reasoning_content
        if thinking is not None and m.role == "assistant":
            d["reasoning_content"] = d["thinking"] = thinking
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _object(c.function.arguments)}}
                               for c in m.tool_calls]
        out.append(d)
    return out


def _object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
