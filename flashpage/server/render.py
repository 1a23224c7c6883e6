"""Response pieces in OpenAI's shapes: server-sent events, per-choice stream state,
logprobs for /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from flashpage.engine.sampler import Logprobs
from flashpage.outputs import CompletionOutput

_FLOOR = -9999.0  # JSON has no -inf: what OpenAI-compatible servers send instead


def sse(obj: Any) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _lp(x: float) -> float:
    return x if math.isfinite(x) else _FLOOR


@dataclass
class ChoiceState:
    """What one streamed choice has sent so far."""

    tokens: int = 0  # generated tokens already reported
    finished: bool = False
    role_sent: bool = False  # chat: the first delta carries the role
    text_offset: int = 0  # completions logprobs: characters of token text so far
    echo_sent: bool = False  # completions echo: the prompt went out first

    def advance(self, new_text: str, o: CompletionOutput) -> tuple[str | None, int, str | None]:
        """(text delta, number of new tokens, finish reason) for this step's output of the
        choice, or (None, 0, None) when there is nothing to send (also after finishing)."""
        if self.finished:
            return None, 0, None
        new_tokens = len(o.token_ids) - self.tokens
        self.tokens = len(o.token_ids)
        finish = o.finish_reason
        if finish is not None:
            self.finished = True
        if not new_text and new_tokens <= 0 and finish is None:
            return None, 0, None
        return new_text, max(new_tokens, 0), finish


def completion_logprobs(tok: Any, lps: list[Logprobs], st: ChoiceState,
                        want: bool) -> dict[str, Any] | None:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for ``lps``; the
    sampled token is always among its position's top_logprobs (so up to k + 1 entries)."""
    if not want:
        return None
    return _completion_entries(tok, [(lp.token_id, lp) for lp in lps], st)


def echo_logprobs(tok: Any, prompt_ids: list[int], plps: list[Logprobs | None] | None,
                  st: ChoiceState) -> dict[str, Any]:
    """completion_logprobs' shape for an echoed prompt: every prompt token, its logprob and
    top alternatives from the request's prompt_logprobs (null for the first token, which
    has nothing before it)."""
    plps = plps or []
    return _completion_entries(
        tok, [(t, plps[i] if i < len(plps) else None) for i, t in enumerate(prompt_ids)], st)


def _completion_entries(tok: Any, items: list[tuple[int, Logprobs | None]],
                        st: ChoiceState) -> dict[str, Any]:
    """The completions logprobs lists for (token id, its logprobs or None) items; text
    offsets run on from ``st``."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, lp in items:
        s = tok.token_str(token_id)
        tokens.append(s)
        offsets.append(st.text_offset)
        st.text_offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(lp.logprob))
        top = {tok.token_str(t): _lp(v) for t, v in lp.top}
        top.setdefault(s, _lp(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs(tok: Any, prompt_ids: list[int],
                    plps: list[Logprobs | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else {token id:
    {logprob, rank, decoded_token}} for the token and its top alternatives."""
    if plps is None:
        return None
    out: list[dict[str, Any] | None] = []
    for t, lp in zip(prompt_ids, plps, strict=False):
        if lp is None:
            out.append(None)
            continue
        entry = {str(a): {"logprob": _lp(v), "rank": rank, "decoded_token": tok.token_str(a)}
                 for rank, (a, v) in enumerate(lp.top, 1)}
        entry[str(t)] = {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": tok.token_str(t)}
        out.append(entry)
    return out


def chat_logprobs(tok: Any, lps: list[Logprobs], want: bool) -> dict[str, Any] | None:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    if not want:
        return None

    def entry(token_id: int, value: float) -> dict[str, Any]:
        s = tok.token_str(token_id)
        return {"token": s, "logprob": _lp(value), "bytes": list(s.encode("utf-8"))}

    content = []
    for lp in lps:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(e)
    return {"content": content, "refusal": None}
