"""A request's state as the scheduler and the KV cache manager see it.

A request has ``num_tokens`` (prompt + output so far) and ``num_computed_tokens``
(those whose K/V are in the cache). There is no prefill or decode phase: each step
the scheduler gives a request some ``num_new_tokens`` (the token positions
``[num_computed_tokens, num_computed_tokens + num_new_tokens)``), and the request
needs a sampled token exactly when that range reaches ``num_tokens``.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flashpage.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch

    from flashpage.engine.multimodal import MultiModalInput
    from flashpage.lora.request import LoRARequest
    from flashpage.pooling import PoolingState
    from flashpage.structured.guide import GuideState


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished (see ``is_finished``).
    FINISHED_STOPPED = 3  # eos or a stop token id / stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len reached
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6  # never ran (kept for vLLM parity; we raise RequestRefused instead)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASON.get(status)


_FINISH_REASON: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


# Stands in ``all_token_ids`` for a token sampled on the GPU but not yet read back (async
# scheduling): the next step feeds the model that token straight from the GPU.
PLACEHOLDER = -1


def prompt_text_and_ids(prompt: str | list[int], tokenize: Callable[[str], list[int]]
                        ) -> tuple[str | None, list[int]]:
    """A request's prompt (text, or token ids) -> (its text or None, its ids); an empty text
    is a ValueError."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt, tokenize(prompt)
    return None, list(prompt)


class RequestRefused(ValueError):
    """A request that can never run (too long for the model or for the whole KV cache)."""


class Request:
    """One generation request (one sample: ``n > 1`` is several requests).

    ``all_token_ids`` is ``prompt_token_ids + output_token_ids`` and is kept in sync by
    ``append_output_token``; a preempted request is recomputed from it, so its output
    never changes. ``block_hashes`` caches the chained hashes of its full blocks (filled
    lazily by the KV cache manager; hashes depend only on token ids, so they survive
    preemption).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | Sequence[int] | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        embeds_digest: bytes | None = None,
        mm_inputs: list[MultiModalInput] | None = None,
    ) -> None:
        self.request_id = request_id
        # multimodal rows (engine/multimodal.py): an image's positions, their rows encoded
        # at the first step that schedules one and kept; embeds_digest is then their
        # chain_digest (the prefix cache shares the blocks from the first input's on only
        # among the same inputs)
        self.mm_inputs = mm_inputs
        # M-RoPE (Qwen2-VL, engine/mrope.py): the prompt's 3-D positions [3, prompt length]
        # int64 and the shift of every position past it (<= 0); None / 0 for a request
        # without images (its positions are its token indexes)
        self.mrope_positions: np.ndarray | None = None
        self.mrope_delta = 0
        # a prompt given as input embeddings (engine/prompt_embeds.py): [prompt tokens, width]
        # on the host, its prompt_token_ids placeholders; embeds_digest roots its prefix-cache
        # chain (kv_cache/prefix_cache.chain)
        self.prompt_embeds = prompt_embeds
        self.embeds_digest = embeds_digest
        # where the rows embeds_digest names begin: the prefix cache splices the digest into
        # the chain at that block (kv_cache/prefix_cache.py), the text before shared as text
        self.embeds_start = min(mi.offset for mi in mm_inputs) if mm_inputs else 0
        # vLLM's cache_salt: the prefix cache shares blocks only among requests with the same
        # salt (kv_cache/prefix_cache.cache_root)
        self.cache_salt = cache_salt
        # The priority scheduling policy serves lower values first, ties by arrival
        # (vLLM's); ``queue_order`` is its sort key, the scheduler's add counter last
        self.priority = priority
        # LoRA: the adapter it runs with (flashpage/lora/); its id (0: none) keys the
        # scheduler's adapter count, the slot map and the prefix cache's hash root
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        if eos_token_id is None:
            self._eos_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self._eos_ids = frozenset((eos_token_id,))
        else:
            self._eos_ids = frozenset(eos_token_id)
        # Cached for check_stop, which runs for every request every step.
        self._stop_ids = frozenset(sampling_params.stop_token_ids or ())
        self._min_tokens = max(1, sampling_params.min_tokens)
        self._max_tokens = (sampling_params.max_tokens if sampling_params.max_tokens is not None
                            else 1 << 62)
        self._ignore_eos = sampling_params.ignore_eos
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.queue_order: tuple[int, float, int] = (priority, self.arrival_time, 0)

        self.output_token_ids: list[int] = []
        self.num_resolved_outputs = 0  # leading outputs known on the host (async scheduling)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 before
        self.num_host_cached_tokens = 0  # of which loaded from the host tier (kv offloading)
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        # prompt_logprobs: entry p is prompt token p's logprobs given the ones before it
        # (sampler.Logprobs; None for token 0), filled as the prompt's chunks run
        self.prompt_logprobs: list[Any] | None = [None] if sampling_params.prompt_logprobs is not None else None
        # structured outputs: where the output stands in its pattern, advanced with each
        # resolved token (set by the engine, which compiles the pattern)
        self.guide: GuideState | None = None
        # embeddings: the prompt's hidden states pooled as its chunks run (set by the engine)
        self.pooling: PoolingState | None = None
        # speculative decoding: tokens guessed to follow all_token_ids, run (and checked)
        # beside its last token in the next step (engine/spec_decode.py); the scheduler
        # trims them to its budget
        self.spec_token_ids: list[int] = []
        # SamplingParams.bad_words as token ids (set by the engine, which tokenizes them)
        self.bad_word_ids: list[list[int]] = []
        # a draft model's sampled drafts: the distribution each was drawn from [drafts,
        # vocab] (on the device; None: certain drafts), for rejection sampling
        self.spec_probs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def held_back_tokens(self) -> frozenset[int]:
        """Tokens its next output may not be: while it has fewer than ``min_tokens`` outputs,
        its stop token ids and (unless ``ignore_eos``) eos, as vLLM's min_tokens masks them."""
        if self.num_output_tokens >= self.sampling_params.min_tokens:
            return frozenset()
        return self._stop_ids if self._ignore_eos else self._stop_ids | self._eos_ids

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def num_unresolved(self) -> int:
        """Outputs sampled on the GPU whose values the host has not read yet (0, 1 or 2)."""
        return len(self.output_token_ids) - self.num_resolved_outputs

    def length_capped(self, max_model_len: int) -> bool:
        """max_tokens (or max_model_len) is already reached counting unresolved outputs:
        the request finishes when they resolve, so it must not be scheduled again."""
        return bool(self.num_unresolved) and (
            len(self.output_token_ids) >= self._max_tokens
            or len(self.all_token_ids) >= max_model_len)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_resolved_outputs = len(self.output_token_ids)
        if self.guide is not None:
            self.guide.advance(token_id)

    def append_placeholder(self) -> None:
        """A token sampled on the GPU in the step just launched; ``resolve_next`` fills it."""
        self.output_token_ids.append(PLACEHOLDER)
        self.all_token_ids.append(PLACEHOLDER)

    def resolve_next(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Fill the oldest unresolved output and return the finish status it causes."""
        i = self.num_resolved_outputs
        self.output_token_ids[i] = token_id
        self.all_token_ids[self.num_prompt_tokens + i] = token_id
        self.num_resolved_outputs = i + 1
        if self.guide is not None:
            self.guide.advance(token_id)
        return self._stop_status(i + 1, max_model_len)

    def resolve_drafted(self, tokens: list[int], max_model_len: int) -> RequestStatus | None:
        """A speculative step's tokens (accepted drafts, then the model's own): fill the
        placeholder with the first and append the rest, stopping at the first that finishes
        the request (those after it are dropped). Unless finished, every token but the new
        last one is now computed: K/V written past it (rejected drafts) is overwritten later."""
        status = self.resolve_next(tokens[0], max_model_len)
        for t in tokens[1:]:
            if status is not None:
                break
            self.append_output_token(t)
            status = self.check_stop(max_model_len)
        self.num_computed_tokens = len(self.all_token_ids) - 1
        self.spec_token_ids = []
        return status

    def truncate_outputs(self, n: int) -> None:
        """Keep only the first ``n`` outputs (a stop string found in the middle of a
        speculative step's tokens ends the sample there)."""
        k = len(self.output_token_ids) - n
        if k > 0:
            del self.output_token_ids[-k:]
            del self.all_token_ids[-k:]
            self.num_resolved_outputs = min(self.num_resolved_outputs, n)

    def drop_unresolved(self) -> None:
        """Forget outputs sampled after the one that finished the request."""
        k = self.num_unresolved
        if k:
            del self.output_token_ids[-k:]
            del self.all_token_ids[-k:]

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self.status)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finish status the last appended token causes, or None to go on.

        Order: stop token ids and eos (both only once ``min_tokens`` outputs exist, as in
        vLLM; eos not with ``ignore_eos``), a guide that allows nothing but eos next (the
        structured output is complete, whatever min_tokens says), then length
        (``max_tokens`` outputs, or ``max_model_len`` tokens in all). Sets ``stop_reason``
        to the stop token id.
        """
        return self._stop_status(len(self.output_token_ids), max_model_len)

    def _stop_status(self, n_out: int, max_model_len: int) -> RequestStatus | None:
        """check_stop as if the request held only its first ``n_out`` outputs."""
        if n_out >= self._min_tokens:
            last = self.output_token_ids[n_out - 1]
            if last in self._stop_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if last in self._eos_ids and not self._ignore_eos:
                return RequestStatus.FINISHED_STOPPED
        if self.guide is not None and n_out == self.num_resolved_outputs and self.guide.is_finished():
            return RequestStatus.FINISHED_STOPPED
        if n_out >= self._max_tokens or self.num_prompt_tokens + n_out >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
