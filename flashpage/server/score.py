"""POST /score and /rerank (vLLM's). Embedding models: relevance as the cosine of two
embeddings (each text's pooled hidden states, flashpage/pooling.py, L2-normalized), every
distinct text embedded once per request. Cross-encoders (one forward over each pair, its
score from the model's head): server/cross_encoder.py."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from flashpage.pooling import PoolingParams
from flashpage.server.cross_encoder import cross_scores, is_cross_encoder
from flashpage.server.embeddings import encode_inputs
from flashpage.server.protocol import RerankRequest, ScoreRequest, bad_request
from flashpage.server.serving import (
    ServerState,
    check_priority,
    collect,
    prompt_items,
    start,
    unless_disconnected,
)


async def _similarities(state: ServerState, request: Request, left: list[list[int]],
                        right: list[list[int]], pairs: list[tuple[int, int]], arrival: float,
                        field: str, reply: Any, priority: int, model: str | None) -> Response:
    """Embed the distinct prompts of ``left`` + ``right`` (at ``priority``, under the LoRA
    adapter ``model`` names if it names one) and hand ``reply`` the cosine of each pair
    (left index, right index) and the prompt tokens embedded."""
    unique: dict[tuple[int, ...], int] = {}
    for ids in left + right:
        unique.setdefault(tuple(ids), len(unique))
    prompts = [list(k) for k in unique]
    streams = await start(state, "score", prompts, PoolingParams(), arrival, prompt_param=field,
                          model=model, priority=priority)

    async def answer() -> Response:
        vecs = [np.asarray(out.embedding if out.embedding is not None else [], dtype=np.float64)
                for out in await collect(streams)]
        li = [unique[tuple(ids)] for ids in left]
        ri = [unique[tuple(ids)] for ids in right]
        scores = [float(np.dot(vecs[li[i]], vecs[ri[j]])) for i, j in pairs]
        return reply(scores, sum(len(p) for p in prompts))

    return await unless_disconnected(request, answer())


async def score(state: ServerState, request: Request, req: ScoreRequest, arrival: float) -> Response:
    check_priority(state, req.priority)
    t1 = prompt_items(state, req.text_1, "text_1")
    t2 = prompt_items(state, req.text_2, "text_2")
    if len(t1) == 1:
        pairs = [(0, j) for j in range(len(t2))]
    elif len(t1) == len(t2):
        pairs = [(i, i) for i in range(len(t1))]
    else:
        raise bad_request(f"text_1 has {len(t1)} items and text_2 {len(t2)}: give text_1 one item, "
                          "or both the same number", "text_1")

    def reply(scores: list[float], tokens: int) -> Response:
        return JSONResponse({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": state.response_model(req.model),
            "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    if is_cross_encoder(state):
        return await cross_scores(state, request, t1, t2, pairs, arrival, ("text_1", "text_2"),
                                  reply, req.priority, req.model, req.truncate_prompt_tokens)
    left = await encode_inputs(state, t1, "text_1", req.truncate_prompt_tokens)
    right = await encode_inputs(state, t2, "text_2", req.truncate_prompt_tokens)
    return await _similarities(state, request, left, right, pairs, arrival, "text_1", reply,
                               req.priority, req.model)


async def rerank(state: ServerState, request: Request, req: RerankRequest, arrival: float) -> Response:
    check_priority(state, req.priority)
    if not req.documents:
        raise bad_request("documents is empty", "documents")
    docs = prompt_items(state, req.documents, "documents")
    top_n = req.top_n or len(docs)

    def reply(scores: list[float], tokens: int) -> Response:
        order = sorted(range(len(docs)), key=lambda j: -scores[j])[:top_n]
        results = []
        for j in order:
            r: dict[str, Any] = {"index": j, "relevance_score": scores[j]}
            if req.return_documents:
                r["document"] = {"text": docs[j]}
            results.append(r)
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": state.response_model(req.model),
                             "usage": {"total_tokens": tokens}, "results": results})

    if is_cross_encoder(state):
        return await cross_scores(state, request, [req.query], docs, [(0, j) for j in range(len(docs))],
                                  arrival, ("query", "documents"), reply, req.priority,
                                  req.model, req.truncate_prompt_tokens)
    left = await encode_inputs(state, [req.query], "query", req.truncate_prompt_tokens)
    right = await encode_inputs(state, docs, "documents", req.truncate_prompt_tokens)
    return await _similarities(state, request, left, right, [(0, j) for j in range(len(docs))],
                               arrival, "documents", reply, req.priority, req.model)
