"""A request's outputs as its tokens come back: each sample's text (stop strings applied),
logprobs and finish, and the RequestOutput the engine hands out.

``ParentRequest`` is what the user asked for (one prompt, ``n`` samples, or one embedding);
each ``ChildRequest`` is one sample, one scheduler Request. The engine owns the maps from
ids to them and the scheduler; this module owns what a token does to a sample's text and
what an output holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flashpage.engine.sequence import Request, RequestStatus
from flashpage.engine.tokenizer import IncrementalDetokenizer
from flashpage.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flashpage.pooling import PoolingParams
from flashpage.sampling_params import SamplingParams


@dataclass
class ChildRequest:
    """Engine-side state of one sample (one scheduler Request)."""

    request: Request
    parent_id: str
    index: int
    detok: IncrementalDetokenizer | None
    text: str = ""
    sent: int = 0  # characters of text already reported
    new_text: str = ""  # what the last output added
    stop_reason: int | str | None = None
    logprobs: list[Any] = field(default_factory=list)
    cumulative_logprob: float = 0.0

    def add_token(self, token: int, finished: bool) -> bool:
        """Take the sample's next token (``finished``: the scheduler ended it with this one):
        its text, and a stop string found in it. True when a stop string ends a sample the
        scheduler has not finished (the caller finishes it there)."""
        req = self.request
        if (finished and req.status == RequestStatus.FINISHED_STOPPED
                and token in (req.sampling_params.stop_token_ids or ())):
            self.stop_reason = token
        if self.detok is None:
            return False
        self.detok.add(token)
        text = self.detok.text
        stops = req.sampling_params.stop_strings
        stop_now = False
        if stops:
            start = max(0, len(self.text) - max(len(s) for s in stops) + 1)
            hit = find_stop(text, stops, start)
            if hit is not None:
                pos, s = hit
                keep = pos + len(s) if req.sampling_params.include_stop_str_in_output else pos
                text = text[:keep]
                self.stop_reason = s
                if finished:  # also hit max_tokens this step: the stop string wins
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    stop_now = True
        self.text = text
        return stop_now

    def add_tokens(self, tokens: list[int], start: int, finished: bool,
                   logprobs: list[Any] | None) -> bool:
        """A speculative step's tokens (and their logprobs), one by one, as far as the request
        took them (``start``: its outputs before them); a stop string among them ends the
        sample there, the tokens after it dropped. True as ``add_token``: the caller finishes
        the sample."""
        req = self.request
        taken = req.num_output_tokens - start
        for j, tok in enumerate(tokens[:taken]):
            if logprobs is not None:
                self.logprobs.append(logprobs[j])
                self.cumulative_logprob += logprobs[j].logprob
            stop_now = self.add_token(tok, finished)
            if stop_now or isinstance(self.stop_reason, str):
                req.truncate_outputs(start + j + 1)
                return stop_now
        return False

    def output(self) -> CompletionOutput:
        """The sample so far; a text tail that may still begin a stop string held back."""
        r = self.request
        reason = RequestStatus.finish_reason(r.status) if r.is_finished() else None
        stops = r.sampling_params.stop_strings
        visible = self.text if reason or not stops else \
            self.text[: max(self.sent, len(self.text) - max(len(s) for s in stops) + 1)]
        self.new_text = visible[self.sent:]
        self.sent = len(visible)
        return CompletionOutput(
            index=self.index, text=visible,
            token_ids=r.output_token_ids[: r.num_resolved_outputs],  # no placeholders
            finish_reason=reason, stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if r.sampling_params.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs else None)


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildRequest]
    metrics: RequestMetrics
    pooling: PoolingParams | None = None  # an embedding request

    def is_done(self) -> bool:
        return all(c.request.is_finished() for c in self.children)

    def output(self, now: float) -> RequestOutput:
        """Every sample so far (an embedding: its vector once done); ``finished`` when all
        are, which also stamps the metrics' finish time."""
        outs = [c.output() for c in self.children]
        done = all(o.finish_reason is not None for o in outs)
        if done:
            self.metrics.finished_time = now
        if self.pooling is not None:  # an embedding: the vector once done, no completion
            st = self.children[0].request.pooling
            embedding = None
            if done and st is not None:  # read back with its step (pooling.PooledBatch)
                embedding = st.output if st.output is not None else st.embedding(self.pooling)
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [],
                                 finished=done, metrics=self.metrics, embedding=embedding)
        plp = self.children[0].request.prompt_logprobs
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs,
                             finished=done, metrics=self.metrics,
                             new_text=[c.new_text for c in self.children],
                             prompt_logprobs=list(plp) if plp is not None else None,
                             lora_request=self.children[0].request.lora_request)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample ``index``'s own params (n = 1; a seed made its own: seed + index)."""
    child = dataclasses.replace(params, n=1)
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` from ``start``: (its position, the string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, s)
    return best
