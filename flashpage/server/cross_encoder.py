"""/score and /rerank on a cross-encoder (flashpage/encoder/: *ForSequenceClassification
with one label, or a one-label decoder classifier such as Qwen2ForSequenceClassification):
each (text_1, text_2) pair joined by the tokenizer into one prompt, one forward per pair,
the score the head's logit through a sigmoid (vLLM's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from fastapi import Request
from fastapi.responses import Response

from flashpage.pooling import PoolingParams
from flashpage.server.embeddings import fit_prompt
from flashpage.server.protocol import bad_request
from flashpage.server.serving import ServerState, collect, start, unless_disconnected

if TYPE_CHECKING:
    from flashpage.encoder.engine import EncoderEngine


def is_cross_encoder(state: ServerState) -> bool:
    return "score" in getattr(state.engine.engine, "supported_tasks", ())


async def cross_scores(state: ServerState, request: Request, left: list[Any], right: list[Any],
                       pairs: list[tuple[int, int]], arrival: float, fields: tuple[str, str],
                       reply: Callable[[list[float], int], Response], priority: int,
                       model: str | None, truncate: int | None) -> Response:
    """Score each pair (left index, right index) of the raw items (texts or token ids) and
    hand ``reply`` the scores and the prompt tokens run. 400 naming the field (``fields``:
    left's, right's) of an empty item, or right's for a pair longer than the model takes."""
    engine = cast("EncoderEngine", state.engine.engine)  # is_cross_encoder said so (or a decoder classifier)
    try:
        engine.check_task("score")  # a classifier of several labels gives no score
    except ValueError as e:
        raise bad_request(str(e), "model") from None
    for items, name in zip((left, right), fields, strict=True):
        if any(not item for item in items):
            raise bad_request(f"an item of {name} is empty", name)
    field = fields[1]
    # EncoderConfig's family, else a decoder classifier's (ModelConfig.pair_family)
    mc = engine.model_config
    family = str(getattr(mc, "family", None) or getattr(mc, "pair_family", "decoder"))
    prompts = []
    for i, j in pairs:
        try:
            ids = await state.tokenizer.encode_pair(left[i], right[j], family)
        except ValueError as e:
            raise bad_request(str(e), field) from None
        prompts.append(fit_prompt(state, ids, field, truncate))
    streams = await start(state, "score", prompts, PoolingParams(task="score"), arrival,
                          prompt_param=field, model=model, priority=priority)

    async def answer() -> Response:
        scores = [float(out.embedding[0]) if out.embedding is not None else 0.0
                  for out in await collect(streams)]
        return reply(scores, sum(len(p) for p in prompts))

    return await unless_disconnected(request, answer())
