"""POST /v1/embeddings (OpenAI's): each input's pooled hidden states (flashpage/pooling.py),
as floats or base64 (little-endian float32, what OpenAI's client asks for by default); and
POST /classify (vLLM's): a sequence classifier's class probabilities; POST /pooling (vLLM's): either,
as plain vectors."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from flashpage.pooling import PoolingParams
from flashpage.server.protocol import ClassifyRequest, EmbeddingRequest, bad_request
from flashpage.server.serving import (
    ServerState,
    check_priority,
    collect,
    prompt_items,
    start,
    unless_disconnected,
)


async def encode_inputs(state: ServerState, items: list[Any], field: str,
                        truncate: int | None = None) -> list[list[int]]:
    """Texts or token-id lists -> prompts an embedding request takes (``truncate``: keep the
    last that many tokens; an encoder: the first ones and its closing [SEP]); 400 naming
    ``field`` for an empty or too long one."""
    prompts: list[list[int]] = []
    for item in items:
        if not item:  # "" or []
            raise bad_request(f"an item of {field} is empty", field)
        ids = await state.tokenizer.encode(item) if isinstance(item, str) else list(item)
        prompts.append(fit_prompt(state, ids, field, truncate))
    return prompts


def fit_prompt(state: ServerState, ids: list[int], field: str, truncate: int | None) -> list[int]:
    """``ids`` truncated as asked; 400 naming ``field`` if still longer than a pooling request
    takes (max_model_len: the engine's ``max_pooled_len``)."""
    engine = state.engine.engine
    if truncate is not None and len(ids) > truncate:
        cut = getattr(engine, "truncate_prompt", None)  # an encoder keeps its [CLS] ... [SEP]
        ids = cut(ids, truncate) if cut is not None else ids[-truncate:]
    limit = state.engine.max_model_len
    takes = engine.max_pooled_len
    if len(ids) > takes:
        raise bad_request(f"This model's maximum context length is {limit} tokens; an item of "
                          f"{field} has {len(ids)} (embeddings take up to {takes}).", field)
    return ids


async def embeddings(state: ServerState, request: Request, req: EmbeddingRequest,
                     arrival: float) -> Response:
    return await pooled(state, request, req, arrival, "embedding")


async def pooled(state: ServerState, request: Request, req: EmbeddingRequest, arrival: float,
                 kind: Literal["embedding", "pooling"]) -> Response:
    """/v1/embeddings (kind "embedding": each item ``{"object": "embedding", "embedding":
    vector}``) and vLLM's /pooling ("pooling": ``{"object": "pooling", "data": vector}``, a
    sequence classifier's class probabilities as its vector), floats or base64."""
    check_priority(state, req.priority)
    items = prompt_items(state, req.input, "input")
    hidden = state.engine.hidden_size
    if req.dimensions is not None and req.dimensions > hidden:
        raise bad_request(f"dimensions must be at most the model's {hidden}, got {req.dimensions}",
                          "dimensions")
    classifier = kind == "pooling" and getattr(state.engine.engine.model_config, "is_classifier",
                                               False)
    if classifier and req.dimensions is not None:
        raise bad_request("dimensions applies to embeddings, not a classifier's probabilities",
                          "dimensions")
    prompts = await encode_inputs(state, items, "input", req.truncate_prompt_tokens)
    params = PoolingParams(task="classify") if classifier else PoolingParams(dimensions=req.dimensions)
    prefix = "embd" if kind == "embedding" else "pool"
    streams = await start(state, prefix, prompts, params, arrival, prompt_param="input",
                          model=req.model, priority=req.priority)
    key = "embedding" if kind == "embedding" else "data"

    async def answer() -> Response:
        outs = await collect(streams)
        data = []
        for i, out in enumerate(outs):
            # float32 straight from the array: numpy's tolist, or its bytes for base64
            vec = np.asarray(out.embedding if out.embedding is not None else [], dtype="<f4")
            value: Any = vec.tolist() if req.encoding_format == "float" else \
                base64.b64encode(vec.tobytes()).decode()
            data.append({"object": kind, "index": i, key: value})
        n = sum(len(p) for p in prompts)
        body: dict[str, Any] = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list",
                                "data": data, "model": state.response_model(req.model),
                                "usage": {"prompt_tokens": n, "total_tokens": n}}
        if kind == "pooling":  # vLLM's PoolingResponse carries created and completion_tokens
            body["created"] = int(time.time())
            body["usage"]["completion_tokens"] = 0
        return JSONResponse(body)

    return await unless_disconnected(request, answer())


async def classify(state: ServerState, request: Request, req: ClassifyRequest,
                   arrival: float) -> Response:
    """POST /classify (vLLM's): a sequence classifier's class probabilities per input, with
    the likeliest label's name (config.json's id2label)."""
    check_priority(state, req.priority)
    try:
        state.engine.engine.check_task("classify")
    except ValueError as e:
        raise bad_request(str(e), "model") from None
    items = prompt_items(state, req.input, "input")
    prompts = await encode_inputs(state, items, "input", req.truncate_prompt_tokens)
    streams = await start(state, "classify", prompts, PoolingParams(task="classify"), arrival,
                          prompt_param="input", model=req.model, priority=req.priority)
    labels: tuple[str, ...] = getattr(state.engine.engine.model_config, "labels", ())

    async def answer() -> Response:
        outs = await collect(streams)
        data = []
        for i, out in enumerate(outs):
            probs = out.embedding.tolist() if out.embedding is not None else []
            best = max(range(len(probs)), key=probs.__getitem__) if probs else 0
            data.append({"index": i, "label": labels[best] if best < len(labels) else str(best),
                         "probs": probs, "num_classes": len(probs)})
        n = sum(len(p) for p in prompts)
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                             "created": int(time.time()), "model": state.response_model(req.model),
                             "data": data, "usage": {"prompt_tokens": n, "total_tokens": n,
                                                     "completion_tokens": 0}})

    return await unless_disconnected(request, answer())
