"""What generate() returns, shaped as vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from flashpage.engine.sampler import Logprobs

if TYPE_CHECKING:
    from flashpage.lora.request import LoRARequest


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0  # of num_cached_tokens, loaded from the host tier

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request was refused; outputs is then empty
    new_text: list[str] = field(default_factory=list)  # per output: the text added by this step
    # SamplingParams.prompt_logprobs: entry p for prompt token p given the ones before it
    # (None for the first), as far as the prompt has been computed
    prompt_logprobs: list[Logprobs | None] | None = None
    # an embedding request's vector once finished (flashpage/pooling.py), a float32 numpy
    # array (LLM.embed's EmbeddingOutput makes the list); outputs is empty. A cross-encoder's
    # score request (flashpage/encoder/): its score, one value; a classifier's: its classes'
    embedding: np.ndarray | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with (flashpage/lora/), as vLLM's
