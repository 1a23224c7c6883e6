"""Embeddings: a prompt's hidden states pooled into one vector (vLLM's pooling requests).

An embedding request runs its prompt through the model like any other (chunked prefill,
batched beside generation, its KV blocks freed when it ends) and takes the final-norm hidden
states of its prompt tokens, pooled the model's way:

- ``last``: the last token's (decoder embedding models: e5-mistral, gte-Qwen2, Qwen3-Embedding);
- ``mean``: the average over the prompt's tokens;
- ``cls``: the first token's.

The model's way comes from its sentence-transformers files (``modules.json`` naming a
Pooling module whose ``config.json`` sets ``pooling_mode_lasttoken`` / ``_mean_tokens`` /
``_cls_token``), else ``last``; ``LLM(pooling_type=...)`` / ``--pooling-type`` override it.
``PoolingParams`` (per request): ``dimensions`` keeps the first that many values (Matryoshka
embeddings), ``normalize`` (default on) scales the vector to unit length, after the cut.

In the engine an embedding request is a request for one greedy token that nobody reads: the
scheduler, preemption and async scheduling need nothing new; the model runner pools the
prompt rows of each step (engine/model_runner.py) and the output carries the vector.

A decoder sequence classifier (Qwen2ForSequenceClassification, ...; models/llama.py) runs
the same way: its classify / score requests pool the last prompt token's hidden state (HF's
last non-pad token), and the output is its ``score`` head's logits through the model's
activation (config.classifier_activation: softmax over the labels, one label's sigmoid). Its
ignored token is sampled from those logits (the model has no LM head).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

POOLING_TYPES = ("last", "mean", "cls")
POOLING_TASKS = ("embed", "score", "classify")


@dataclass
class PoolingParams:
    dimensions: int | None = None  # keep the first this many values (Matryoshka); None: all
    normalize: bool = True  # L2-normalize (after the cut)
    # "embed": the pooled vector; "score": a cross-encoder's score of the pair the prompt
    # holds (flashpage/encoder/; LLM.score and the server's /score, /rerank send it);
    # "classify": a sequence classifier's class probabilities (LLM.classify, /classify)
    task: str = "embed"

    def validate(self, hidden_size: int | None = None) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {POOLING_TASKS}, got {self.task!r}")
        d = self.dimensions
        if d is not None and self.task != "embed":
            raise ValueError(f"dimensions applies to embeddings, not to a {self.task} request")
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")
        if d is not None and hidden_size is not None and d > hidden_size:
            raise ValueError(f"dimensions must be at most the model's {hidden_size}, got {d}")


def pooling_type_of(model_dir: str | None, default: str = "last") -> str:
    """The model folder's sentence-transformers pooling (see the module docstring), else
    ``default`` (last for decoders; encoders pass mean, as sentence-transformers does)."""
    if not model_dir or not os.path.isdir(model_dir):
        return default
    try:
        with open(os.path.join(model_dir, "modules.json")) as f:
            modules = json.load(f)
        folder = next(m["path"] for m in modules if m.get("type", "").endswith("Pooling"))
        with open(os.path.join(model_dir, folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return default
    for key, kind in (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                      ("pooling_mode_cls_token", "cls")):
        if cfg.get(key):
            return kind
    return default


class PoolingState:
    """One request's pooling as its prompt's chunks run: ``add(rows, start, num_prompt)``
    with the final-norm hidden states [n, hidden] of prompt positions start .. start + n - 1;
    ``vector`` once the last prompt position has been added. A chunk at position 0 starts
    over (a preempted request computes its prompt again). ``head`` (a classifier's): pooled
    vector [1, hidden] fp32 -> logits [1, num_labels], turned into the output by
    ``activation`` ("softmax", "sigmoid" or "identity")."""

    def __init__(self, kind: str, head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 activation: str = "softmax") -> None:
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {POOLING_TYPES}, got {kind!r}")
        self.kind = kind
        self.head = head
        self.activation = activation
        self.total: torch.Tensor | None = None  # mean: the running sum (fp32)
        self.count = 0
        self.vector: torch.Tensor | None = None

    @property
    def needs_every_position(self) -> bool:
        """mean and cls read positions a prefix-cache hit would skip; last only the last."""
        return self.kind != "last"

    def add(self, rows: torch.Tensor, start: int, num_prompt: int) -> None:
        if start == 0:
            self.total, self.count, self.vector = None, 0, None
        end = start + rows.shape[0]
        # copies: the rows may be a graph's static buffer, rewritten by the next step
        if self.kind == "cls":
            if start == 0:
                self.vector = rows[0].float().clone()
            return
        if self.kind == "mean":
            part = rows.float().sum(0)
            self.total = part if self.total is None else self.total + part
            self.count += rows.shape[0]
            if end == num_prompt:
                self.vector = self.total / self.count
            return
        if end == num_prompt:
            self.vector = rows[-1].float().clone()

    def embedding(self, params: PoolingParams) -> np.ndarray:
        """The pooled vector, cut to ``dimensions`` and normalized as asked: a float32 numpy
        array (RequestOutput.embedding)."""
        if self.vector is None:
            raise RuntimeError("the prompt has not been pooled yet")
        if self.head is not None:  # a classifier: its probabilities (or score)
            with torch.inference_mode():
                logits = self.head(self.vector[None])[0].float()
                return activate(logits, self.activation).cpu().numpy()
        v = self.vector[: params.dimensions] if params.dimensions else self.vector
        if params.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.cpu().numpy()


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """A classifier's logits [..., num_labels] -> its outputs: "softmax" over the labels,
    "sigmoid" of each, or "identity" (the logits as they are)."""
    if activation == "softmax":
        return logits.softmax(-1)
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "identity":
        return logits
    raise ValueError(f"classifier activation must be softmax, sigmoid or identity, got {activation!r}")


class EmbeddingOutput:
    """One embedding (vLLM's EmbeddingOutput). ``embedding`` is the vector as a list of
    floats, as vLLM's, but made from ``data`` (the float32 numpy array the engine hands
    over) on its first read, then kept: a caller who wants an array or a tensor
    (``out.data``, ``torch.from_numpy(out.data)``) never pays for 768 Python floats, and
    one who reads ``embedding`` gets a real list (json.dumps, ==, slicing all as before)."""

    __slots__ = ("data", "_list")

    def __init__(self, embedding: np.ndarray | Sequence[float]) -> None:
        self._list: list[float] | None = None
        if isinstance(embedding, np.ndarray):
            self.data = embedding
        else:
            self._list = list(embedding)
            self.data = np.asarray(self._list, dtype=np.float32)

    @property
    def embedding(self) -> list[float]:
        if self._list is None:
            self._list = self.data.tolist()
        return self._list

    @embedding.setter
    def embedding(self, value: Sequence[float]) -> None:
        self._list = list(value)
        self.data = np.asarray(self._list, dtype=np.float32)

    @property
    def hidden_size(self) -> int:
        return len(self.data)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, EmbeddingOutput) and self.embedding == other.embedding

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt (vLLM's shape): ``outputs.embedding``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool = True
    error: str | None = None  # the prompt was refused; outputs is None


@dataclass
class ClassificationOutput:
    """A classifier's class probabilities (softmax over its labels; one label: the sigmoid)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What LLM.classify returns per prompt (vLLM's shape): ``outputs.probs``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput | None
    finished: bool = True
    error: str | None = None  # the prompt was refused; outputs is None


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair (vLLM's shape): ``outputs.score``, the cosine of the
    two texts' embeddings (a cross-encoder's: its head's score of the pair)."""

    request_id: str
    outputs: ScoringOutput | None
    finished: bool = True
    error: str | None = None  # a text of the pair was refused; outputs is None
