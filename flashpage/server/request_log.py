"""``--enable-log-requests`` (vLLM's): one INFO line per engine request at arrival and one at
its finish, on the ``flashpage.server.requests`` logger.

The route comes from a context variable that ``RouteTag`` (a pure ASGI middleware, so
streaming and disconnect detection are untouched) sets per HTTP request; ``AsyncEngine``
calls ``log_arrival`` from the route's task and ``log_finish`` from the engine thread.
Prompts are counted, never logged beyond their first ``MAX_PROMPT_CHARS`` characters.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from flashpage.outputs import RequestOutput
from flashpage.pooling import PoolingParams
from flashpage.sampling_params import SamplingParams

logger = logging.getLogger("flashpage.server.requests")
MAX_PROMPT_CHARS = 100
ROUTE: contextvars.ContextVar[str] = contextvars.ContextVar("flashpage_route", default="-")


class RouteTag:
    """ASGI middleware: the HTTP path into ``ROUTE`` for the request's duration."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = ROUTE.set(scope.get("path", "-"))
        try:
            await self.app(scope, receive, send)
        finally:
            ROUTE.reset(token)


def _params(params: SamplingParams | PoolingParams) -> str:
    if isinstance(params, PoolingParams):
        return f"pooling(task={params.task}, dimensions={params.dimensions})"
    return (f"n={params.n}, temperature={params.temperature}, top_p={params.top_p}, "
            f"top_k={params.top_k}, max_tokens={params.max_tokens}, seed={params.seed}, "
            f"stop={params.stop!r}"[:300])


def log_arrival(request_id: str, prompt: str | list[int],
                params: SamplingParams | PoolingParams) -> None:
    if isinstance(prompt, str):
        shown, count = f", prompt={prompt[:MAX_PROMPT_CHARS]!r}", "?"
    else:
        shown, count = "", str(len(prompt))
    logger.info("request %s arrived: route=%s, prompt_tokens=%s%s, params: %s",
                request_id, ROUTE.get(), count, shown, _params(params))


def log_finish(out: RequestOutput) -> None:
    reasons = ",".join(str(o.finish_reason) for o in out.outputs) or \
        ("error" if out.error else "pooled")
    tokens = sum(len(o.token_ids) for o in out.outputs)
    logger.info("request %s finished: finish_reason=%s, output_tokens=%d",
                out.request_id, reasons, tokens)
