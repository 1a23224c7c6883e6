"""``flashpage run-batch`` (vLLM's ``vllm run-batch``): a file of requests in OpenAI's Batch
API format, run offline through the server's own handlers (no HTTP, no uvicorn).

Input, JSON Lines (a path, an http(s) URL, or ``-`` for stdin), one request a line::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output (a path, an http(s) URL to PUT to, or ``-`` for stdout), one line per request, in
input order::

    {"id": "batch_req_<hex>", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "chatcmpl-...", "body": {...}},
     "error": null}

``body`` is what the server answers for the same request body. A line that fails has the
status the server would answer with, and the server's error body (``{"error": {"message",
"type", "param", "code"}}``) both as ``response.body`` (where OpenAI's Batch output keeps it)
and as ``error`` (where vLLM's run-batch writes it): ``error`` is null exactly when the line
succeeded. The file's own faults are such lines too, the other lines still running: a line
that is not a JSON object (400, ``custom_id`` null), no string ``custom_id`` (400), one
already used by an earlier line (400: OpenAI refuses such files; the first line with it
runs), a method other than POST (405), a url not served here (404), a ``body`` that is not
an object (400), ``"stream": true`` (400: batch output is not streamed).

Every line is submitted at once; the engine's continuous batching schedules them, and the
results are written as soon as every line before them is done.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel

from flashpage.server import serving
from flashpage.server.api_server import _default_name, build_state, validate_body
from flashpage.server.async_engine import AsyncEngine
from flashpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    bad_request,
)
from flashpage.server.serving import ServerState

logger = logging.getLogger("flashpage.server")

URL_TIMEOUT_S = 300  # reading the input from a URL, or uploading the output

Handler = Callable[[ServerState, Any, Any, float], Awaitable[Any]]


def _routes() -> dict[str, tuple[type[BaseModel], Handler]]:
    """url -> (its request body, its handler), the server's routes that answer a POST with
    one JSON body (the server's modules imported here, as api_server imports them lazily)."""
    from flashpage.server.chat import chat
    from flashpage.server.embeddings import classify, embeddings, pooled
    from flashpage.server.responses import ResponsesRequest, responses
    from flashpage.server.score import rerank, score

    async def pooling(state: ServerState, request: Any, req: Any, arrival: float) -> Any:
        return await pooled(state, request, req, arrival, "pooling")

    async def tokenize(state: ServerState, request: Any, req: Any, arrival: float) -> Any:
        return await serving.tokenize(state, req)

    async def detokenize(state: ServerState, request: Any, req: Any, arrival: float) -> Any:
        return await serving.detokenize(state, req)

    routes: dict[str, tuple[type[BaseModel], Handler]] = {
        "/v1/chat/completions": (ChatCompletionRequest, chat),
        "/v1/completions": (CompletionRequest, serving.completions),
        "/v1/embeddings": (EmbeddingRequest, embeddings),
        "/v1/responses": (ResponsesRequest, responses),
        "/pooling": (PoolingRequest, pooling),
        "/classify": (ClassifyRequest, classify),
        "/tokenize": (TokenizeRequest, tokenize),
        "/detokenize": (DetokenizeRequest, detokenize),
    }
    for url in ("/score", "/v1/score"):
        routes[url] = (ScoreRequest, score)
    for url in ("/rerank", "/v1/rerank", "/v2/rerank"):
        routes[url] = (RerankRequest, rerank)
    return routes


@dataclass
class BatchLine:
    """One request of the file: where it was, and its parts or what is wrong with it."""

    lineno: int  # 1-based, in the file (blank lines skipped, as vLLM does)
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] | None = None
    error: APIError | None = None  # the file's own fault: answered without running


def parse_lines(lines: list[bytes], urls: Collection[str]) -> list[BatchLine]:
    """The file's non-blank lines as requests (``urls``: those served), each fault (module
    docstring) an ``error``."""
    out: list[BatchLine] = []
    seen: dict[str, int] = {}  # custom_id -> the line that has it
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        line = BatchLine(lineno, None)
        out.append(line)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            line.error = bad_request(f"line {lineno} is not JSON: {str(e)[:200]}")
            continue
        if not isinstance(data, dict):
            line.error = bad_request(f"line {lineno} must be a JSON object")
            continue
        cid = data.get("custom_id")
        if not isinstance(cid, str):
            line.error = bad_request(f"line {lineno}: custom_id (a string) is required",
                                     "custom_id")
            continue
        line.custom_id = cid
        if cid in seen:
            line.error = bad_request(f"line {lineno}: custom_id {cid!r} is already used on line "
                                     f"{seen[cid]} (each request of a batch needs its own)",
                                     "custom_id")
            continue
        seen[cid] = lineno
        method, url, body = data.get("method"), data.get("url"), data.get("body")
        if method != "POST":
            line.error = (bad_request(f"line {lineno}: method is required (\"POST\")", "method")
                          if method is None else
                          APIError(405, f"line {lineno}: method {method!r}: batch requests are "
                                   "POST", "invalid_request_error", "method"))
        elif not isinstance(url, str) or url not in urls:
            line.error = (bad_request(f"line {lineno}: url (a string) is required", "url")
                          if not isinstance(url, str) else
                          APIError(404, f"line {lineno}: url {url!r} is not served here; batch "
                                   f"requests take {', '.join(sorted(urls))}",
                                   "not_found_error", "url"))
        elif not isinstance(body, dict):
            line.error = bad_request(f"line {lineno}: body must be a JSON object (the "
                                     f"request to {url})", "body")
        else:
            line.url, line.body = url, body
    return out


class _NoClient:
    """The handlers' ``request``: a batch line has no client that could go away
    (serving.unless_disconnected waits on ``receive`` for a disconnect)."""

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # never set
        return {"type": "http.disconnect"}


def _output(custom_id: str | None, status: int, body: dict[str, Any],
            failed: bool) -> dict[str, Any]:
    rid = body.get("id") if not failed else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status,
                         "request_id": rid if isinstance(rid, str) else f"req-{uuid.uuid4().hex}",
                         "body": body},
            "error": body if failed else None}


async def answer(state: ServerState, routes: dict[str, tuple[type[BaseModel], Handler]],
                 line: BatchLine, aliases: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The output line for one request: its body run through the server's handler for its
    url (``aliases``: other names of the served model a body's "model" may use)."""
    if line.error is not None:
        return _output(line.custom_id, line.error.status, line.error.body(), True)
    assert line.body is not None  # parse_lines gives a body to every line without an error
    body = line.body
    if isinstance(body.get("model"), str) and body["model"] in aliases:  # (a list: its 400 below)
        body = {**body, "model": state.model_name}
    model, handler = routes[line.url]
    try:
        req = validate_body(state, body, model)
        if getattr(req, "stream", False):
            raise bad_request("stream: batch output is not streamed (leave stream out, or "
                              "false)", "stream")
        if state.engine.log_requests:
            from flashpage.server.request_log import ROUTE

            ROUTE.set(line.url)  # this line's task only: each task runs in its own context
        resp = await handler(state, _NoClient(), req, time.monotonic())
        status, data = resp.status_code, json.loads(bytes(resp.body))
    except APIError as e:
        status, data = e.status, e.body()
    except Exception:  # a bug: this line's 500, as the server answers it; the others run
        logger.exception("batch line %d (%s) failed", line.lineno, line.url)
        status, data = 500, APIError(500, "internal server error", "server_error").body()
    return _output(line.custom_id, status, data, status != 200)


def start_lines(state: ServerState, lines: list[BatchLine],
                aliases: frozenset[str] = frozenset(),
                limit: int | None = None) -> list[asyncio.Task[dict[str, Any]]]:
    """A task per line giving its output line (``answer``), all started now; with ``limit``
    at most that many run at once, the others waiting for a slot before anything of theirs
    reaches the engine (so cancelling a waiting one runs nothing). Cancelling a running one
    aborts its engine requests (their KV blocks freed)."""
    routes = _routes()
    gate = asyncio.Semaphore(limit) if limit else None

    async def one(line: BatchLine) -> dict[str, Any]:
        if gate is None:
            return await answer(state, routes, line, aliases)
        async with gate:
            return await answer(state, routes, line, aliases)

    return [asyncio.ensure_future(one(line)) for line in lines]


async def run_lines(state: ServerState, lines: list[BatchLine], write: Callable[[str], Any],
                    aliases: frozenset[str] = frozenset(), progress: bool = True) -> Counter[int]:
    """Run every line at once and ``write`` each output line (JSON, newline-terminated) in
    input order as soon as those before it are written; the failed lines, by status."""
    from tqdm import tqdm

    tasks = start_lines(state, lines, aliases)
    failed: Counter[int] = Counter()
    with tqdm(total=len(tasks), desc="Running batch", unit="req", file=sys.stderr,
              disable=not progress) as bar:
        for t in tasks:
            t.add_done_callback(lambda _: bar.update())
        try:
            for t in tasks:
                out = await t
                if out["error"] is not None:
                    failed[out["response"]["status_code"]] += 1
                write(json.dumps(out, ensure_ascii=False) + "\n")
        finally:
            for t in tasks:  # (a write failed: the rest is abandoned, its requests aborted)
                t.cancel()
    return failed


# ---------------------------------------------------------------------------- files
def _is_url(name: str) -> bool:
    return name.startswith(("http://", "https://"))


def read_input(source: str) -> list[bytes]:
    """The input's lines: a path, an http(s) URL (GET), or ``-`` (stdin); OSError naming it."""
    try:
        if source == "-":
            data = sys.stdin.buffer.read()
        elif _is_url(source):
            with urllib.request.urlopen(source, timeout=URL_TIMEOUT_S) as r:
                data = r.read()
        else:
            data = Path(source).read_bytes()
    except (OSError, ValueError) as e:  # URLError and HTTPError are OSErrors
        raise OSError(f"cannot read the input file {source}: {e}") from None
    return data.splitlines()


def check_output(dest: str) -> None:
    """Before the model loads: an OSError naming ``dest`` if it cannot be written."""
    if dest == "-" or _is_url(dest):
        return
    path = Path(dest)
    folder = path.parent
    if path.is_dir():
        raise OSError(f"the output file {dest} is a folder")
    if not folder.is_dir():
        raise OSError(f"the output file's folder {folder} does not exist")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise OSError(f"the output file {dest} cannot be written (permission denied)")


@contextmanager
def open_output(dest: str, tmp_dir: str | None = None) -> Iterator[IO[str]]:
    """A text file the output lines go to: ``dest`` itself, stdout for ``-``, or for an
    http(s) URL a temporary file (in ``tmp_dir``, else the system's) PUT there when the run
    ends (kept, named, if that fails)."""
    if dest == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    if not _is_url(dest):
        with open(dest, "w", encoding="utf-8") as f:
            yield f
        return
    fd, tmp = tempfile.mkstemp(prefix="flashpage-batch-", suffix=".jsonl", dir=tmp_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
    except BaseException:  # the run failed: nothing to upload
        os.unlink(tmp)
        raise
    try:
        with open(tmp, "rb") as data:
            req = urllib.request.Request(dest, data=data, method="PUT", headers={
                "Content-Type": "application/jsonl", "Content-Length": str(os.path.getsize(tmp))})
            with urllib.request.urlopen(req, timeout=URL_TIMEOUT_S):
                pass
    except (OSError, ValueError) as e:
        raise OSError(f"cannot upload the output to {dest}: {e} (the results are in {tmp})") \
            from None
    os.unlink(tmp)


# ---------------------------------------------------------------------------- command
def run(args: argparse.Namespace) -> int:
    """``flashpage run-batch``: read and check the input, load the model, run every line,
    write the output. 0 once the file is processed, even if some lines failed (vLLM's rule);
    an input that cannot be read or a model that cannot load is an error before anything
    is written."""
    from flashpage.cli import build_llm, parse_lora_modules

    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    loras = parse_lora_modules(getattr(args, "lora_modules", None) or [])
    if loras and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    check_output(args.output_file)
    lines = parse_lines(read_input(args.input_file), _routes())
    name = args.served_model_name or _default_name(args.model, args.random_weights_config)
    # vLLM serves a model under its --model string: a file written for it runs here too
    aliases = frozenset([args.model] if args.model and not args.served_model_name else []) - {name}
    llm = build_llm(args)
    with open_output(args.output_file, getattr(args, "output_tmp_dir", None)) as out:
        failed = asyncio.run(run_batch(
            llm.engine, lines, out.write, name, aliases=aliases,
            log_requests=bool(getattr(args, "enable_log_requests", False)),
            tool_call_parser=getattr(args, "tool_call_parser", None),
            enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
            lora_modules=loras, reasoning_parser=getattr(args, "reasoning_parser", None),
            structured_outputs_in_reasoning=bool(getattr(args, "structured_outputs_in_reasoning",
                                                         False))))
    statuses = ", ".join(f"{n} x {status}" for status, n in sorted(failed.items()))
    print(f"run-batch: {len(lines)} requests, {failed.total()} failed{f' ({statuses})' if failed else ''}; "
          f"results in {args.output_file}", file=sys.stderr)
    return 0


async def run_batch(engine: Any, lines: list[BatchLine], write: Callable[[str], Any],
                    served_model_name: str, *, aliases: frozenset[str] = frozenset(),
                    progress: bool = True, log_requests: bool = False,
                    **state_kw: Any) -> Counter[int]:
    """``lines`` (parse_lines') run on an LLMEngine through an AsyncEngine started for them
    and stopped after, the handlers' state made as the server makes it (``state_kw``:
    build_state's tool / reasoning / LoRA arguments); the failed lines, by status."""
    async_engine = AsyncEngine(engine)
    state = build_state(async_engine, served_model_name, **state_kw)
    async_engine.log_requests = log_requests
    async_engine.start()
    try:
        return await run_lines(state, lines, write, aliases, progress)
    finally:
        async_engine.shutdown()
        state.tokenizer.close()
