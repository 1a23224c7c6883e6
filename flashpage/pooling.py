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
prompt rows of each step (engine/model_runner.py), the requests whose prompts end in a step
get their outputs as one batch read back with its tokens (``PooledBatch``), and the output
carries the vector. The ignored token is never computed: a pooling prompt may fill
max_model_len (vLLM's rule).

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
                 activation: str = "softmax", params: PoolingParams | None = None) -> None:
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooling type must be one of {POOLING_TYPES}, got {kind!r}")
        self.kind = kind
        self.head = head
        self.activation = activation
        self.params = params or PoolingParams()
        self.total: torch.Tensor | None = None  # mean: the running sum (fp32)
        self.count = 0
        self.vector: torch.Tensor | None = None
        # the finished output, read back with its step (PooledBatch.deliver)
        self.output: np.ndarray | None = None

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
        array (RequestOutput.embedding). Waits for the device: the engine reads its outputs
        through PooledBatch instead; this is the one-request reference."""
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


class PooledBatch:
    """The outputs of the pooling requests whose prompts end in one step, made on the device
    as one batch per kind of output (a classifier's head and activation; an embedding's
    ``dimensions`` and ``normalize``) and brought to the host in ONE copy: on CUDA a
    non-blocking copy into pinned memory with an event behind it, so that launching the
    step never waits for the device; ``deliver()`` (when the engine reads the step's sampled
    tokens back) waits for that event and hands each request its float32 numpy row.

    ::

        device  [k, width] fp32   rows in group order, each zero-padded to the widest
        host    pinned [k, width] -> state.output = row[:its width] (a copy)
    """

    def __init__(self, states: list[PoolingState]) -> None:
        groups: dict[tuple[Any, ...], list[PoolingState]] = {}
        for st in states:
            if st.vector is None:
                raise RuntimeError("the prompt has not been pooled yet")
            key = (st.head, st.activation) if st.head is not None else \
                (None, st.params.dimensions, st.params.normalize)
            groups.setdefault(key, []).append(st)
        parts: list[torch.Tensor] = []
        self.states: list[PoolingState] = []
        with torch.inference_mode():
            for key, group in groups.items():
                vecs = torch.stack([st.vector for st in group])  # type: ignore[misc]
                if key[0] is not None:  # a classifier: its head's logits through the activation
                    out = activate(key[0](vecs).float(), key[1])
                else:
                    dims, normalize = key[1], key[2]
                    out = vecs[:, :dims] if dims else vecs
                    if normalize:
                        out = torch.nn.functional.normalize(out, dim=1)
                parts.append(out)
                self.states += group
            self.widths = [p.shape[1] for p in parts for _ in range(p.shape[0])]
            width = max(self.widths)
            rows = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
            self._event: torch.cuda.Event | None = None
            if rows.is_cuda:
                self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                self._host.copy_(rows, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()
            else:
                self._host = rows

    def deliver(self) -> None:
        """Wait for the copy (this step's only) and set each request's ``output``."""
        if self._event is not None:
            self._event.synchronize()
        host = self._host.numpy()
        for i, (st, w) in enumerate(zip(self.states, self.widths, strict=True)):
            st.output = host[i, :w].copy()


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
