"""The OpenAI-compatible HTTP server: FastAPI app over one AsyncEngine.

``build_app(async_engine, served_model_name, api_key=None)`` makes the app;
``run_server(args)`` (``flashpage serve``) builds the engine and runs uvicorn.
Endpoints: POST /v1/completions, POST /v1/chat/completions (both streaming as
server-sent events), GET /v1/models, GET /health, GET /metrics. See docs/server.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashpage.outputs import RequestOutput
from flashpage.sampling_params import SamplingParams
from flashpage.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from flashpage.server.metrics import ServerMetrics
from flashpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    validation_error,
)
from flashpage.server.render import (
    ChoiceState,
    chat_logprobs,
    completion_logprobs,
    sse,
)
from flashpage.server.tokenize import ServerTokenizer

logger = logging.getLogger("flashpage.server")

M = TypeVar("M", bound=BaseModel)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


class ServerState:
    def __init__(self, engine: AsyncEngine, served_model_name: str, api_key: str | None,
                 max_n: int, max_body_bytes: int, max_prompts: int) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key.encode() if api_key else None
        self.max_n = max_n
        self.max_body_bytes = max_body_bytes
        self.max_prompts = max_prompts
        self.metrics: ServerMetrics = engine.metrics or ServerMetrics()
        engine.metrics = self.metrics
        self.tokenizer = ServerTokenizer(engine.tokenizer)
        self.created = int(time.time())


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None, *,
              max_n: int = 16, max_body_bytes: int = 4 << 20, max_prompts: int = 64) -> FastAPI:
    """The FastAPI app. The engine thread starts with the app (lifespan) and stops with it.

    max_n bounds ``n``; max_body_bytes the request body (413 beyond); max_prompts the
    number of prompts in one /v1/completions request.
    """
    state = ServerState(async_engine, served_model_name, api_key, max_n, max_body_bytes,
                        max_prompts)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()
            state.tokenizer.close()

    # No docs or schema routes: every route but /health needs the key when one is set.
    app = FastAPI(title="flashpage", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.flashpage = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return _error_response(state, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(state, APIError(e.status_code, str(e.detail), kind, None, None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(state, bad_request(f"invalid request: {e.errors()[:1]}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(state, APIError(500, "internal server error", "server_error"))

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return _error_response(state, APIError(503, "the engine is not running",
                                                   "server_error"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        _check_key(state, request)
        with contextlib.suppress(EngineDeadError):
            state.metrics.set_engine_stats(await async_engine.stats())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _check_key(state, request)
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "flashpage", "max_model_len": async_engine.max_model_len,
            "vocab_size": async_engine.vocab_size}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        _check_key(state, request)
        req = await _parse(state, request, CompletionRequest)
        return await _completions(state, request, req, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        _check_key(state, request)
        req = await _parse(state, request, ChatCompletionRequest)
        return await _chat(state, request, req, arrival)

    return app


# ---------------------------------------------------------------------------- plumbing
def _error_response(state: ServerState, e: APIError) -> JSONResponse:
    state.metrics.http_errors.labels(status=str(e.status)).inc()
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _check_key(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    given = token.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
    # compare_digest: the time taken does not depend on where the first difference is.
    if not hmac.compare_digest(given, state.api_key):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                       "authentication_error", None, "invalid_api_key")


async def _read_body(state: ServerState, request: Request) -> bytes:
    limit = state.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if size > limit:
            raise APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(state: ServerState, request: Request, model: type[M]) -> M:
    body = await _read_body(state, request)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"malformed JSON body: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise bad_request("request body nested too deeply") from None
    name = getattr(req, "model", None)
    if name is not None and name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist (this server serves "
                       f"`{state.model_name}`).", "not_found_error", "model", "model_not_found")
    return req


def _sampling_params(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                     max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    if req.n > state.max_n:
        raise bad_request(f"n must be at most {state.max_n}, got {req.n}", "n")
    vocab = state.engine.vocab_size
    if logprobs is not None and logprobs > vocab:
        raise bad_request(f"logprobs must be at most the vocabulary size {vocab}", "logprobs")
    kw: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, logprobs=logprobs, stop=req.stop, seed=req.seed,
        ignore_eos=bool(req.ignore_eos),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    try:
        return SamplingParams(**kw)
    except ValueError as e:  # SamplingParams names the field first
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


def _check_length(state: ServerState, n_prompt: int, max_tokens: int | None) -> int:
    """The max_tokens to use; 400 (with both numbers) when it does not fit the context."""
    limit = state.engine.max_model_len
    if n_prompt == 0:
        raise bad_request("the prompt is empty", "prompt")
    if max_tokens is None:
        if n_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{n_prompt} tokens, which leaves no room for output.", "messages")
        return limit - n_prompt
    if n_prompt + max_tokens > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens; the prompt has "
            f"{n_prompt} tokens and max_tokens asks for {max_tokens} ({n_prompt + max_tokens} "
            "in all). Shorten the prompt or lower max_tokens.", "max_tokens")
    return max_tokens


async def _start(state: ServerState, prefix: str, prompts: list[list[int]],
                 params: list[SamplingParams], arrival: float) -> list[RequestStream]:
    """Add every prompt's request; if one is refused, abort the others and answer 400."""
    streams: list[RequestStream] = []
    base = f"{prefix}-{uuid.uuid4().hex}"
    try:
        for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            streams.append(await state.engine.add_request(rid, ids, sp, arrival))
    except ValueError as e:
        for s in streams:
            s.abort()
        raise bad_request(str(e), "prompt") from None
    except EngineDeadError as e:
        for s in streams:
            s.abort()
        raise APIError(503, str(e), "server_error") from None
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; one stream: no tasks."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work`` but cancel it (aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _ClientGone()


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in _merged(streams):
            finals[i] = out
    except EngineDeadError as e:
        raise APIError(503, str(e), "server_error") from None
    return [f for f in finals if f is not None]


def _stream_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def _non_streamed(request: Request, build: Awaitable[Response]) -> Response:
    try:
        return await _until_disconnect(request, build)
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it


# ---------------------------------------------------------------------------- /v1/completions
async def _completions(state: ServerState, request: Request, req: CompletionRequest,
                       arrival: float) -> Response:
    if req.echo:
        raise bad_request("echo is not supported", "echo")
    raw = req.prompt
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        items: list[Any] = [raw]
    else:
        items = list(raw)
    if not items:
        raise bad_request("the prompt is empty", "prompt")
    if len(items) > state.max_prompts:
        raise bad_request(f"at most {state.max_prompts} prompts per request, got {len(items)}",
                          "prompt")
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    params = _sampling_params(state, req, max_tokens, req.logprobs)
    prompts: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("the prompt is empty", "prompt")
            ids = await state.tokenizer.encode(item)
        else:
            ids = list(item)
        _check_length(state, len(ids), max_tokens)
        prompts.append(ids)
    streams = await _start(state, "cmpl", prompts, [params] * len(prompts), arrival)
    rid = streams[0].request_id.rsplit("-", 1)[0] if len(streams) > 1 else streams[0].request_id
    created = int(time.time())
    n = params.n
    n_prompt = sum(len(p) for p in prompts)
    want_lp = req.logprobs is not None
    tok = state.tokenizer

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        states = [ChoiceState() for _ in range(len(prompts) * n)]

        async def events() -> AsyncIterator[str]:
            try:
                async for p, out in _merged(streams):
                    for o in out.outputs:
                        idx = p * n + o.index
                        st = states[idx]
                        delta, new_tokens, finish = st.advance(out.new_text[o.index], o)
                        if delta is None:
                            continue
                        lp = completion_logprobs(tok, o.logprobs[len(o.token_ids) - new_tokens:]
                                                 if want_lp and o.logprobs else [],
                                                 st, want_lp)
                        chunk = {"id": rid, "object": "text_completion", "created": created,
                                 "model": state.model_name,
                                 "choices": [{"index": idx, "text": delta, "logprobs": lp,
                                              "finish_reason": finish}]}
                        if include_usage:
                            chunk["usage"] = None
                        yield sse(chunk)
                if include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created,
                               "model": state.model_name, "choices": [],
                               "usage": _usage(n_prompt, sum(s.tokens for s in states))})
            except EngineDeadError as e:
                yield sse(APIError(503, str(e), "server_error").body())
            finally:
                for s in streams:
                    s.abort()
            yield "data: [DONE]\n\n"

        return _stream_response(events())

    async def build() -> Response:
        finals = await _collect(streams)
        choices, completion_tokens = [], 0
        for p, out in enumerate(finals):
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                lp = completion_logprobs(tok, o.logprobs or [], ChoiceState(), want_lp)
                choices.append({"index": p * n + o.index, "text": o.text, "logprobs": lp,
                                "finish_reason": o.finish_reason})
        choices.sort(key=lambda c: c["index"])
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": state.model_name, "choices": choices,
                             "usage": _usage(n_prompt, completion_tokens)})

    return await _non_streamed(request, build())


# ---------------------------------------------------------------------------- /v1/chat
async def _chat(state: ServerState, request: Request, req: ChatCompletionRequest,
                arrival: float) -> Response:
    conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
    ids = await state.tokenizer.apply_chat_template(conversation)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    max_tokens = _check_length(state, len(ids), max_tokens)
    top = req.top_logprobs
    if top is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    want_lp = bool(req.logprobs)
    params = _sampling_params(state, req, max_tokens, (top or 0) if want_lp else None)
    streams = await _start(state, "chatcmpl", [ids], [params], arrival)
    rid = streams[0].request_id
    created = int(time.time())
    tok = state.tokenizer

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        states = [ChoiceState() for _ in range(params.n)]

        async def events() -> AsyncIterator[str]:
            try:
                async for _, out in _merged(streams):
                    for o in out.outputs:
                        st = states[o.index]
                        delta_text, new_tokens, finish = st.advance(out.new_text[o.index], o)
                        if delta_text is None:
                            continue
                        delta: dict[str, Any] = {"content": delta_text}
                        if not st.role_sent:
                            st.role_sent = True
                            delta = {"role": "assistant", "content": delta_text}
                        lp = chat_logprobs(tok, o.logprobs[len(o.token_ids) - new_tokens:]
                                           if want_lp and o.logprobs else [], want_lp)
                        chunk = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": state.model_name,
                                 "choices": [{"index": o.index, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish}]}
                        if include_usage:
                            chunk["usage"] = None
                        yield sse(chunk)
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": state.model_name, "choices": [],
                               "usage": _usage(len(ids), sum(s.tokens for s in states))})
            except EngineDeadError as e:
                yield sse(APIError(503, str(e), "server_error").body())
            finally:
                for s in streams:
                    s.abort()
            yield "data: [DONE]\n\n"

        return _stream_response(events())

    async def build() -> Response:
        finals = await _collect(streams)
        out = finals[0]
        choices, completion_tokens = [], 0
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            choices.append({"index": o.index,
                            "message": {"role": "assistant", "content": o.text},
                            "logprobs": chat_logprobs(tok, o.logprobs or [], want_lp),
                            "finish_reason": o.finish_reason})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                             "model": state.model_name, "choices": choices,
                             "usage": _usage(len(ids), completion_tokens)})

    return await _non_streamed(request, build())


# ---------------------------------------------------------------------------- run
def run_server(args: argparse.Namespace) -> int:
    """``flashpage serve``: build the engine from the CLI arguments and serve until ^C."""
    import uvicorn

    from flashpage.cli import build_llm

    model_path = getattr(args, "model_path", None)
    if model_path is not None:
        if args.model is not None and args.model != model_path:
            raise ValueError(f"two models given: {model_path!r} and --model {args.model!r}")
        args.model = model_path
    random_cfg = getattr(args, "random_weights_config", None)
    if random_cfg is not None:
        from flashpage.llm import LLM

        llm = LLM(args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
                  block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len,
                  enable_prefix_caching=not args.no_prefix_caching,
                  attention_backend=args.attention_backend, num_gpu_blocks=args.num_gpu_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  enforce_eager=args.enforce_eager, seed=args.seed,
                  random_weights_config=random_cfg)
    else:
        llm = build_llm(args)
    name = args.served_model_name or _default_name(args.model, random_cfg)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without --api-key: anyone who reaches it can use it",
                       args.host)
    app = build_app(AsyncEngine(llm.engine), name, args.api_key)
    logger.info("serving %r on http://%s:%d", name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5)
    return 0


def _default_name(model: str | None, random_cfg: str | None) -> str:
    import os

    if model is None and random_cfg is None:
        return "SmolLM2-135M-Instruct"
    path = (model or random_cfg or "").rstrip("/")
    base = os.path.basename(path)
    if base == "config.json":
        base = os.path.basename(os.path.dirname(path))
    return base.removesuffix(".gguf") or "model"


def main(argv: list[str] | None = None) -> int:
    """``python -m flashpage.server.api_server``: ``flashpage serve`` plus
    --random-weights-config (random weights of a given config.json, for benchmarks)."""
    from flashpage import envs
    from flashpage.cli import add_engine_arguments

    logging.basicConfig(level=envs.log_level(), format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m flashpage.server.api_server")
    p.add_argument("model_path", nargs="?", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--random-weights-config", default=None,
                   help="config.json (or its folder) whose shape to serve with random weights")
    add_engine_arguments(p)
    return run_server(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
