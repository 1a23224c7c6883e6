"""POST /v1/responses: OpenAI's Responses API (vLLM serves it too), over the chat endpoint.

A Responses request is a chat request in other words: ``instructions`` a system message,
``input`` a text or a list of items (messages with text parts, earlier ``function_call``s and
their ``function_call_output``s), ``max_output_tokens``, ``text.format`` (json_schema /
json_object) the structured outputs, ``tools`` flat function definitions. It runs through
``chat.chat`` (templates, tool parsers, reasoning parser, LoRA by model name, priorities) and
the answer is reshaped: ``output`` items of type ``reasoning`` (with a reasoning parser),
``message`` (``output_text``) and ``function_call``; ``status`` "incomplete" with
``incomplete_details.reason`` "max_output_tokens" where the output was cut. Streamed, the
chat chunks become Responses events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``), each with its ``sequence_number``.

Stored (``store``, true by default as OpenAI's) in memory, the latest ``MAX_STORED`` of
them: ``GET /v1/responses/{id}`` answers one again, ``DELETE`` forgets it, and a request's
``previous_response_id`` continues its conversation (its input and output items before the
new input; its instructions are not carried over, as OpenAI's). A server restart forgets
them all. Built-in tools (web search, file search, ...) are 400s.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, ValidationError

from flashpage.server.protocol import (
    APIError,
    Bool,
    ChatCompletionRequest,
    Float,
    Int,
    Priority,
    Str,
    _Body,
    bad_request,
    validation_error,
)
from flashpage.server.serving import ServerState


class ResponsesText(_Body):
    format: dict[str, Any] | None = None


class ResponsesReasoning(_Body):
    """OpenAI's ``reasoning``: its effort goes to the chat template as reasoning_effort."""

    effort: Literal["low", "medium", "high"] | None = None
    summary: Str | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses (the fields this server reads; others are ignored)."""

    model: Str | None = None
    input: Str | list[dict[str, Any]]
    instructions: Str | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    stream: Bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = True
    text: ResponsesText | None = None
    previous_response_id: Str | None = None
    store: Bool | None = None
    metadata: dict[str, Any] | None = None
    user: Str | None = None
    priority: Priority = 0
    reasoning: ResponsesReasoning | None = None
    # vLLM's extras
    top_k: Int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(default=None, gt=0.0)
    seed: Int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise bad_request(f"{where}: only text parts (input_text) are supported", "input")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise bad_request(f"{where}: content must be a text or a list of text parts", "input")


MAX_STORED = 1024  # responses kept for previous_response_id / GET, the latest first


class ResponseStore:
    """Stored responses (id -> the response and the conversation's items up to it), LRU."""

    def __init__(self, limit: int = MAX_STORED) -> None:
        self.limit = limit
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, rid: str, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        self._items[rid] = (response, items)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str | None = "previous_response_id"
            ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        try:
            self._items.move_to_end(rid)
            return self._items[rid]
        except KeyError:
            raise APIError(404, f"Response with id '{rid}' not found.", "invalid_request_error",
                           param) from None

    def delete(self, rid: str) -> None:
        self.get(rid, None)
        del self._items[rid]


def _input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    return [{"role": "user", "content": req.input}] if isinstance(req.input, str) else list(req.input)


def _output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the next request's input items (its text as an
    assistant message; its calls as they are; its reasoning left out)."""
    items: list[dict[str, Any]] = []
    for o in output:
        if o["type"] == "message":
            items.append({"role": "assistant", "content": "".join(p["text"] for p in o["content"])})
        elif o["type"] == "function_call":
            items.append({k: o[k] for k in ("type", "call_id", "name", "arguments")})
    return items


def _messages(req: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``instructions``, the earlier conversation's items and ``input`` as chat messages."""
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    for i, item in enumerate(history + _input_items(req)):
        kind = item.get("type", "message")
        where = f"input[{i - len(history)}]" if i >= len(history) else "previous_response_id's items"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}: role must be user, assistant, system or developer", "input")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text_of(item.get("output"), where)})
        elif kind == "reasoning":
            continue  # earlier thinking: templates leave it out
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", "input")
    if not msgs:
        raise bad_request("input is empty", "input")
    return msgs


def _chat_body(req: ResponsesRequest, stream: bool, history: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req, history), "stream": stream,
                            "priority": req.priority, "parallel_tool_calls": req.parallel_tool_calls}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                 "chat_template_kwargs"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        tools = []
        for t in req.tools:
            if t.get("type") != "function":
                raise bad_request(f"tools of type {t.get('type')!r} are not supported (functions only)",
                                  "tools")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
            tools.append({"type": "function", "function": fn})
        body["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or "name" not in choice:
            raise bad_request("tool_choice must be none, auto, required or a function by name",
                              "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        body["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.get("type") != "text":
        if fmt.get("type") == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "schema"), "schema": fmt.get("schema"),
                "strict": fmt.get("strict")}}
        else:
            raise bad_request(f"text.format type {fmt.get('type')!r} is not supported", "text")
    return body


def _usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u["total_tokens"]}


def _envelope(rid: str, req: ResponsesRequest, model: str, status: str,
              output: list[dict[str, Any]], usage: dict[str, Any] | None,
              finish: str | None, created: int) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": model, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "store": req.store is not False,
            "temperature": req.temperature, "text": {"format": {"type": "text"}}
            if req.text is None or req.text.format is None else {"format": req.text.format},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "top_p": req.top_p, "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}}


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


async def responses(state: ServerState, request: Request, req: ResponsesRequest,
                    arrival: float) -> Response:
    from flashpage.server.chat import chat

    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        history = state.responses.get(req.previous_response_id)[1]
    try:
        chat_req = ChatCompletionRequest.model_validate(_chat_body(req, bool(req.stream), history))
    except ValidationError as e:
        raise validation_error(e) from None
    rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
    model = state.response_model(req.model)
    answer = await chat(state, request, chat_req, arrival)
    if answer.status_code != 200:
        return answer
    if req.stream:
        assert isinstance(answer, StreamingResponse)
        return StreamingResponse(_events(answer, rid, req, model, created, state, history),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    body = json.loads(bytes(answer.body))
    choice = body["choices"][0]
    msg, finish = choice["message"], choice["finish_reason"]
    output: list[dict[str, Any]] = []
    if msg.get("reasoning"):
        output.append(_reasoning_item(msg["reasoning"]))
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(_message_item(msg.get("content") or "",
                                    "incomplete" if finish == "length" else "completed"))
    output += [_call_item(c) for c in msg.get("tool_calls") or []]
    status = "incomplete" if finish == "length" else "completed"
    done = _envelope(rid, req, model, status, output, _usage(body.get("usage")), finish, created)
    _keep(state, req, done, history)
    return JSONResponse(done)


def _keep(state: ServerState, req: ResponsesRequest, done: dict[str, Any],
          history: list[dict[str, Any]]) -> None:
    if req.store is not False:
        state.responses.put(done["id"], done, history + _input_items(req) + _output_as_input(done["output"]))


async def _events(chat_stream: StreamingResponse, rid: str, req: ResponsesRequest, model: str,
                  created: int, state: ServerState, history: list[dict[str, Any]]) -> AsyncIterator[str]:
    """The chat stream's chunks as Responses events."""
    seq = 0
    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None  # the item deltas go to now
    calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
    finish: str | None = None
    usage = None

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        payload = {"type": kind, "sequence_number": seq - 1, **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def close(item: dict[str, Any]) -> list[str]:
        idx = output.index(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(event("response.output_text.done", item_id=item["id"], output_index=idx,
                             content_index=0, text=part["text"]))
            out.append(event("response.content_part.done", item_id=item["id"], output_index=idx,
                             content_index=0, part=part))
        elif item["type"] == "reasoning":
            out.append(event("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                             content_index=0, text=item["content"][0]["text"]))
        else:
            out.append(event("response.function_call_arguments.done", item_id=item["id"],
                             output_index=idx, arguments=item["arguments"]))
        item["status"] = "completed"
        out.append(event("response.output_item.done", output_index=idx, item=item))
        return out

    def begin(item: dict[str, Any]) -> list[str]:
        output.append(item)
        idx = len(output) - 1
        out = [event("response.output_item.added", output_index=idx, item=item)]
        if item["type"] == "message":
            out.append(event("response.content_part.added", item_id=item["id"], output_index=idx,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    first = _envelope(rid, req, model, "in_progress", [], None, None, created)
    yield event("response.created", response=first)
    yield event("response.in_progress", response=first)
    async for raw in chat_stream.body_iterator:
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        for line in text.splitlines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                yield event("error", code=chunk["error"].get("code"), message=chunk["error"]["message"],
                            param=chunk["error"].get("param"))
                return
            usage = chunk.get("usage") or usage
            for ch in chunk.get("choices", []):
                d = ch.get("delta", {})
                finish = ch.get("finish_reason") or finish
                for key, kind, delta_event in (("reasoning", "reasoning", "response.reasoning_text.delta"),
                                               ("content", "message", "response.output_text.delta")):
                    if not d.get(key):
                        continue
                    if open_item is None or open_item["type"] != kind:
                        for e in close(open_item) if open_item is not None else []:
                            yield e
                        open_item = ({**_reasoning_item(""), "status": "in_progress"} if kind == "reasoning"
                                     else _message_item("", "in_progress"))
                        for e in begin(open_item):
                            yield e
                    open_item["content"][0]["text"] += d[key]
                    yield event(delta_event, item_id=open_item["id"], output_index=output.index(open_item),
                                content_index=0, delta=d[key])
                for tc in d.get("tool_calls") or []:
                    item = calls.get(tc["index"])
                    fn = tc.get("function", {})
                    if item is None:
                        for e in close(open_item) if open_item is not None else []:
                            yield e
                        item = calls[tc["index"]] = _call_item(
                            {"id": tc.get("id"), "function": {"name": fn.get("name"), "arguments": ""}},
                            "in_progress")
                        open_item = item
                        for e in begin(item):
                            yield e
                    piece = fn.get("arguments") or ""
                    if piece:
                        item["arguments"] += piece
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=output.index(item), delta=piece)
    if open_item is not None:
        for e in close(open_item):
            yield e
    status = "incomplete" if finish == "length" else "completed"
    done = _envelope(rid, req, model, status, output, _usage(usage), finish, created)
    _keep(state, req, done, history)
    yield event("response.completed" if status == "completed" else "response.incomplete", response=done)

