"""The OpenAI-compatible HTTP server: FastAPI app over one AsyncEngine.

``build_app(async_engine, served_model_name, api_key=None, lora_modules=...)`` makes the app;
``run_server(args)`` (``flashpage serve``) builds the engine and runs uvicorn.
Endpoints: POST /v1/completions, POST /v1/chat/completions (both streaming as
server-sent events), GET /v1/models, GET /health, GET /metrics, GET /version, POST /tokenize
and POST /detokenize, POST /pooling, SageMaker's GET|POST /ping and POST /invocations (vLLM's),
OpenAI's Files and Batches APIs (/v1/files, /v1/batches: server/batches.py);
with FLASHPAGE_SERVER_DEV_MODE=1, POST /sleep, POST /wake_up, GET /is_sleeping and POST
/reload_weights (sleep mode).
See docs/server.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashpage import envs
from flashpage.lora.request import LoRARequest
from flashpage.server import serving
from flashpage.server.async_engine import AsyncEngine, EngineDeadError
from flashpage.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
    validation_error,
)
from flashpage.server.serving import ServerState

logger = logging.getLogger("flashpage.server")

M = TypeVar("M", bound=BaseModel)


def build_state(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
                *, max_n: int = 16, max_body_bytes: int = 4 << 20, max_prompts: int = 64,
                tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                lora_modules: list[LoRARequest] | None = None,
                reasoning_parser: str | None = None,
                structured_outputs_in_reasoning: bool = False) -> ServerState:
    """What the handlers share (build_app's arguments of the same names), the LoRA adapters
    added to the engine: the app's and ``flashpage run-batch``'s (server/run_batch.py)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    loras = {lr.lora_name: lr for lr in lora_modules or []}
    if len(loras) != len(lora_modules or []) or served_model_name in loras:
        raise ValueError("--lora-modules: each adapter needs a name of its own, not the served "
                         f"model's ({served_model_name!r})")
    for lr in loras.values():
        async_engine.engine.add_lora(lr)  # before the engine thread starts
    state = ServerState(async_engine, served_model_name, api_key, max_n, max_body_bytes,
                        max_prompts, tool_call_parser, enable_auto_tool_choice, loras,
                        reasoning_parser)
    state.structured_in_reasoning = structured_outputs_in_reasoning
    return state


def build_app(async_engine: AsyncEngine, served_model_name: str, api_key: str | None = None, *,
              max_n: int = 16, max_body_bytes: int = 4 << 20, max_prompts: int = 64,
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
              lora_modules: list[LoRARequest] | None = None,
              reasoning_parser: str | None = None,
              structured_outputs_in_reasoning: bool = False,
              cors: dict[str, Any] | None = None, log_requests: bool = False,
              files_dir: str | None = None) -> FastAPI:
    """The FastAPI app. The engine thread starts with the app (lifespan) and stops with it.

    max_n bounds ``n``; max_body_bytes the request body (413 beyond); max_prompts the
    number of prompts in one /v1/completions request; tool_call_parser how the model's tool
    calls are read (server/tools.py), needed with enable_auto_tool_choice for tool_choice
    "auto". lora_modules: LoRA adapters a request selects by naming one as its "model"
    (vLLM's --lora-modules), each read and checked now (a bad one stops the start).
    reasoning_parser: how a reasoning model's thinking is told from its answer
    (server/reasoning.py); structured outputs then start after the thinking, unless
    structured_outputs_in_reasoning (vLLM's enable_in_reasoning: the pattern covers it too).
    cors: starlette's CORSMiddleware arguments (allow_origins, allow_methods, allow_headers,
    allow_credentials; None: no CORS headers). log_requests: vLLM's --enable-log-requests,
    an INFO line per request at arrival and at finish (server/request_log.py).
    files_dir: where the Files API keeps its files (server/files.py; None: in memory).
    """
    state = build_state(async_engine, served_model_name, api_key, max_n=max_n,
                        max_body_bytes=max_body_bytes, max_prompts=max_prompts,
                        tool_call_parser=tool_call_parser,
                        enable_auto_tool_choice=enable_auto_tool_choice,
                        lora_modules=lora_modules, reasoning_parser=reasoning_parser,
                        structured_outputs_in_reasoning=structured_outputs_in_reasoning)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            await batches.close()  # running batches cancelled, their requests aborted
            async_engine.shutdown()
            state.tokenizer.close()

    # No docs or schema routes: every route but /health needs the key when one is set.
    app = FastAPI(title="flashpage", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    if cors is not None:  # preflight OPTIONS answered before any route (and its key check)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, **cors)
    app.state.flashpage = state
    async_engine.log_requests = log_requests
    if log_requests:  # tags each HTTP request with its route for the log lines
        from flashpage.server.request_log import RouteTag

        app.add_middleware(RouteTag)

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
    @app.get("/ping")  # SageMaker's health check (vLLM's), GET or POST
    @app.post("/ping")
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

    @app.get("/version")
    async def version() -> Response:
        from flashpage import __version__

        return JSONResponse({"version": __version__})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _check_key(state, request)
        base = {"object": "model", "created": state.created, "owned_by": "flashpage",
                "max_model_len": async_engine.max_model_len, "vocab_size": async_engine.vocab_size}
        data = [{"id": state.model_name, **base, "parent": None}]
        data += [{"id": name, **base, "root": lr.lora_path, "parent": state.model_name}
                 for name, lr in state.lora_modules.items()]  # LoRA adapters, as vLLM lists them
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        _check_key(state, request)
        req = await _parse(state, request, CompletionRequest)
        return await serving.completions(state, request, req, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        _check_key(state, request)
        req = await _parse(state, request, ChatCompletionRequest)
        from flashpage.server.chat import chat

        return await chat(state, request, req, arrival)

    @app.post("/v1/responses")
    async def responses_endpoint(request: Request) -> Response:
        from flashpage.server.responses import ResponsesRequest, responses

        arrival = time.monotonic()
        _check_key(state, request)
        return await responses(state, request, await _parse(state, request, ResponsesRequest), arrival)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        _check_key(state, request)
        return JSONResponse(state.responses.get(response_id, None)[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        _check_key(state, request)
        state.responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        from flashpage.server.embeddings import embeddings

        arrival = time.monotonic()
        _check_key(state, request)
        return await embeddings(state, request, await _parse(state, request, EmbeddingRequest), arrival)

    @app.post("/classify")
    async def classify_inputs(request: Request) -> Response:
        from flashpage.server.embeddings import classify

        arrival = time.monotonic()
        _check_key(state, request)
        return await classify(state, request, await _parse(state, request, ClassifyRequest), arrival)

    @app.post("/score")
    @app.post("/v1/score")
    async def score_pairs(request: Request) -> Response:
        from flashpage.server.score import score

        arrival = time.monotonic()
        _check_key(state, request)
        return await score(state, request, await _parse(state, request, ScoreRequest), arrival)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank_documents(request: Request) -> Response:
        from flashpage.server.score import rerank

        arrival = time.monotonic()
        _check_key(state, request)
        return await rerank(state, request, await _parse(state, request, RerankRequest), arrival)

    @app.post("/pooling")
    async def pooling(request: Request) -> Response:
        from flashpage.server.embeddings import pooled
        from flashpage.server.protocol import PoolingRequest

        arrival = time.monotonic()
        _check_key(state, request)
        return await pooled(state, request, await _parse(state, request, PoolingRequest), arrival,
                            "pooling")

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one inference route (vLLM's): the first request shape the body
        validates as, in vLLM's order, picks the route; otherwise a 400 naming the shapes."""
        arrival = time.monotonic()
        _check_key(state, request)
        data = await _read_json(state, request)
        for model, handler in _invocation_routes(state):
            try:
                model.model_validate(data)
            except (ValidationError, RecursionError):
                continue
            return await handler(state, request, validate_body(state, data, model), arrival)
        names = ", ".join(m.__name__ for m, _ in _invocation_routes(state))
        raise bad_request("the body matches no request this server takes at /invocations; "
                          f"expected one of: {names}")

    if envs.allow_runtime_lora_updating():  # vLLM's runtime LoRA updating (server/lora_admin.py)
        from flashpage.server.lora_admin import load_lora_adapter, unload_lora_adapter

        @app.post("/v1/load_lora_adapter")
        async def load_lora(request: Request) -> Response:
            _check_key(state, request)
            return await load_lora_adapter(state, await _parse(state, request, LoadLoRAAdapterRequest))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora(request: Request) -> Response:
            _check_key(state, request)
            return await unload_lora_adapter(state, await _parse(state, request,
                                                                 UnloadLoRAAdapterRequest))

    if envs.server_dev_mode():  # vLLM's sleep-mode routes (its VLLM_SERVER_DEV_MODE)
        _add_sleep_routes(app, state, async_engine)

    from flashpage.server.batches import add_batch_routes

    # OpenAI's Files and Batches APIs (/v1/files, /v1/batches; server/batches.py)
    batches = add_batch_routes(app, state, files_dir)

    @app.post("/reset_prefix_cache")  # vLLM's (there in its dev mode): forget cached prefixes
    async def reset_prefix_cache(request: Request) -> Response:
        _check_key(state, request)
        # on the engine thread between two steps; an encoder model has no prefix cache
        done = await async_engine.call(lambda engine: getattr(engine, "reset_prefix_cache",
                                                              lambda: True)())
        if not done:
            return _error_response(state, APIError(
                409, "the prefix cache cannot be reset while requests hold KV blocks; retry when "
                "they have finished", "invalid_request_error"))
        return JSONResponse({"reset": True})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        _check_key(state, request)
        return await serving.tokenize(state, await _parse(state, request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        _check_key(state, request)
        return await serving.detokenize(state, await _parse(state, request, DetokenizeRequest))

    return app


def _add_sleep_routes(app: FastAPI, state: ServerState, async_engine: AsyncEngine) -> None:
    """POST /sleep?level=N, POST /wake_up[?tags=weights&tags=kv_cache], GET /is_sleeping, as
    vLLM's, and POST /reload_weights (ours: the checkpoint read from disk again, after a
    level-2 sleep): each runs on the engine thread between two steps. 400: sleep mode off,
    a bad level or tag, the weights asleep; 409: requests in flight. A request while asleep gets a 503
    naming the wake_up it waits for (server/serving.py)."""
    from flashpage.engine.sleep import EngineBusyError

    async def run(fn: Any) -> Response:
        try:
            await async_engine.call(fn)
        except EngineBusyError as e:
            return _error_response(state, APIError(409, str(e), "invalid_request_error"))
        except ValueError as e:
            return _error_response(state, bad_request(str(e)))
        return Response(status_code=200)

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        _check_key(state, request)
        raw = request.query_params.get("level", "1")
        if not raw.isdigit():
            raise bad_request(f"level must be 1 or 2, got {raw!r}", "level")
        level = int(raw)
        return await run(lambda engine: _sleep_engine(engine).sleep(level))

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        _check_key(state, request)
        tags = request.query_params.getlist("tags") or None
        return await run(lambda engine: _sleep_engine(engine).wake_up(tags))

    @app.post("/reload_weights")  # ours: after /sleep?level=2, the checkpoint read again
    async def reload_weights(request: Request) -> Response:
        _check_key(state, request)
        return await run(lambda engine: _sleep_engine(engine).reload_weights())

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request) -> Response:
        _check_key(state, request)
        asleep = await async_engine.call(lambda engine: bool(getattr(engine, "is_sleeping",
                                                                     lambda: False)()))
        return JSONResponse({"is_sleeping": asleep})


def _sleep_engine(engine: Any) -> Any:
    if not hasattr(engine, "sleep_state"):
        raise ValueError("sleep mode is not supported for encoder models")
    return engine


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


async def _read_body(state: ServerState, request: Request, limit: int | None = None,
                     why: str = "") -> bytes:
    """The body, at most ``limit`` bytes (default the server's JSON body limit; ``why``
    names where another comes from in the 413)."""
    limit = state.max_body_bytes if limit is None else limit
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
        if size > limit:
            raise APIError(413, f"request body of {size} bytes exceeds the limit of {limit} "
                           f"bytes{why}")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes{why}")
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_json(state: ServerState, request: Request) -> dict[str, Any]:
    body = await _read_body(state, request)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"malformed JSON body: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


def validate_body(state: ServerState, data: dict[str, Any], model: type[M]) -> M:
    """A JSON body as ``model``'s request: a 400 naming the field that is wrong, a 404 for a
    "model" this server does not serve."""
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise bad_request("request body nested too deeply") from None
    name = getattr(req, "model", None)
    if name is not None and name != state.model_name and name not in state.lora_modules:
        served = ", ".join(f"`{n}`" for n in state.served_names())
        raise APIError(404, f"The model `{name}` does not exist (this server serves {served}).",
                       "not_found_error", "model", "model_not_found")
    return req


async def _parse(state: ServerState, request: Request, model: type[M]) -> M:
    return validate_body(state, await _read_json(state, request), model)


def _invocation_routes(state: ServerState) -> list[tuple[type[BaseModel], Any]]:
    """/invocations' request shapes and handlers, in vLLM's order (the first that validates
    wins): chat ("messages"), completions ("prompt"), embeddings ("input"; a sequence
    classifier's "input" goes to /classify, as vLLM routes only the tasks a model does),
    score ("text_1", "text_2"), rerank ("query", "documents")."""
    from flashpage.server.chat import chat
    from flashpage.server.embeddings import classify, embeddings
    from flashpage.server.score import rerank, score

    classifier = getattr(state.engine.engine.model_config, "is_classifier", False)
    pool: tuple[type[BaseModel], Any] = (ClassifyRequest, classify) if classifier else \
        (EmbeddingRequest, embeddings)
    return [(ChatCompletionRequest, chat), (CompletionRequest, serving.completions), pool,
            (ScoreRequest, score), (RerankRequest, rerank)]


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
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")  # before loading
    from flashpage.cli import parse_lora_modules

    loras = parse_lora_modules(getattr(args, "lora_modules", None) or [])
    if loras and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    llm = build_llm(args)
    name = args.served_model_name or _default_name(args.model, random_cfg)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning("serving on %s without --api-key: anyone who reaches it can use it",
                       args.host)
    app = build_app(AsyncEngine(llm.engine), name, args.api_key,
                    tool_call_parser=getattr(args, "tool_call_parser", None),
                    enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
                    lora_modules=loras, reasoning_parser=getattr(args, "reasoning_parser", None),
                    structured_outputs_in_reasoning=bool(getattr(args, "structured_outputs_in_reasoning",
                                                                 False)),
                    cors=_cors(args),
                    log_requests=bool(getattr(args, "enable_log_requests", False)),
                    files_dir=getattr(args, "files_dir", None))
    ssl = {k: getattr(args, k, None) for k in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs")}
    logger.info("serving %r on %s://%s:%d", name, "https" if ssl["ssl_certfile"] else "http",
                args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port,
                log_level=getattr(args, "uvicorn_log_level", "warning"),
                timeout_graceful_shutdown=5, root_path=getattr(args, "root_path", None) or "",
                **{k: v for k, v in ssl.items() if v})
    return 0


def _cors(args: argparse.Namespace) -> dict[str, Any]:
    """The CLI's CORS flags as CORSMiddleware's arguments (vLLM's defaults: all allowed)."""
    return {"allow_origins": getattr(args, "allowed_origins", ["*"]),
            "allow_methods": getattr(args, "allowed_methods", ["*"]),
            "allow_headers": getattr(args, "allowed_headers", ["*"]),
            "allow_credentials": bool(getattr(args, "allow_credentials", False))}


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
    """``python -m flashpage.server.api_server``: the same as ``flashpage serve``."""
    from flashpage import envs
    from flashpage.cli import add_engine_arguments, add_lora_module_arguments, add_tool_arguments

    logging.basicConfig(level=envs.log_level(), format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m flashpage.server.api_server")
    p.add_argument("model_path", nargs="?", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--files-dir", default=None)
    add_tool_arguments(p)
    add_lora_module_arguments(p)
    add_engine_arguments(p)
    return run_server(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
