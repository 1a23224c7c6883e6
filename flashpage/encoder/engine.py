"""EncoderEngine: encoder-only embedding models and cross-encoders (BERT, XLM-RoBERTa,
ModernBERT, NomicBERT), apart from the KV cache.

An encoder reads a whole prompt in one forward and keeps nothing: no KV cache, no decode,
no chunks. So its engine is a queue and a batcher, not the decoder's scheduler:

    add_request   validate (a ValueError naming the problem; nothing else touched), queue
    step()        take the head of the queue and the waiting requests nearest its length
                  while the padded batch (requests x longest prompt) fits
                  max_num_batched_tokens (one always runs, however long; batch.py), one
                  forward, and finish every request of it:
                  embed -> each prompt's rows pooled on the device (batch.pool: mean, cls,
                           last), cut and normalized there, the whole batch copied back once
                  score -> the classification head (on the first token; ModernBERT's
                           on its classifier_pooling), then sigmoid
                  With async scheduling (CUDA's default) a step launches its batch and
                  returns the PREVIOUS one's outputs: the host reads one batch back and
                  builds the next while the device runs, so the device never waits on it.

A finished request's ``RequestOutput.embedding`` is a float32 numpy row (a score: one
value; classes: their probabilities), not a list: LLM.embed's EmbeddingOutput makes the
list on first read, the server encodes base64 straight from the bytes.

It offers what LLM (generate refused, embed, score) and the server's AsyncEngine call on
an LLMEngine: add_request, step, abort_request, has_unfinished_requests, check_priority,
compile_guide, stats, tokenizer, model_config (vocab_size, hidden_size), max_model_len.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flashpage.config import EngineConfig
from flashpage.encoder.batch import cut_and_normalize, pack, pick, pool, to_device, window
from flashpage.encoder.config import EncoderConfig
from flashpage.encoder.model import load_encoder
from flashpage.engine.scheduler import check_priority
from flashpage.engine.sequence import prompt_text_and_ids
from flashpage.kv_cache.kv_cache_manager import KVCacheStats
from flashpage.outputs import RequestMetrics, RequestOutput
from flashpage.pooling import PoolingParams, PoolingState, activate, pooling_type_of

logger = logging.getLogger("flashpage")
_INT = {int}


@dataclass(order=True)
class _Pending:
    key: tuple[int, float, int]  # queue order: (priority or 0, arrival, add counter)
    request_id: str = field(compare=False)
    prompt: str | None = field(compare=False)
    ids: list[int] = field(compare=False)
    array: np.ndarray = field(compare=False)  # the ids as int64: what batches are built from
    params: PoolingParams = field(compare=False)
    arrival: float = field(compare=False)
    aborted: bool = field(default=False, compare=False)  # while its batch runs


@dataclass
class _Launched:
    """A batch whose forward is queued on the device; ``out`` [B, D] fp32 on the host is
    filled once ``ready`` (None on the CPU: already) has passed."""

    requests: list[_Pending]
    started: float
    out: torch.Tensor
    ready: torch.cuda.Event | None


class EncoderEngine:
    """Runs an encoder-only model (flashpage/encoder/config.py's architectures)."""

    def __init__(self, config: EngineConfig, *, random_config: str | None = None,
                 tokenizer: str | None = None) -> None:
        from flashpage.engine.llm_engine import resolve_device, resolve_dtype

        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        folder = None if random_config is not None else config.model
        assert folder is not None or random_config is not None  # LLM only dispatches these here
        self.model_config = EncoderConfig.from_hf(random_config or folder or "")
        mc = self.model_config
        self.supported_tasks: tuple[str, ...] = ("embed",) if mc.head == "embed" else ("score",)
        if config.max_model_len is not None and config.max_model_len > mc.max_prompt_len:
            raise ValueError(f"max_model_len {config.max_model_len} is more than this encoder's "
                             f"positions allow ({mc.max_prompt_len})")
        # the longest prompt taken (no output tokens: a prompt may fill it)
        self.max_model_len = config.max_model_len or mc.max_prompt_len
        self.max_pooled_len = self.max_model_len
        self.pooling_type = config.pooling_type or pooling_type_of(folder, default="mean")
        PoolingState(self.pooling_type)  # an unknown --pooling-type fails here
        self.model = load_encoder(mc, folder, self.dtype, self.device, config.seed)
        self.tokenizer = _load_tokenizer(tokenizer or folder, config.trust_remote_code)
        self.sep_token_id: int | None = getattr(self.tokenizer, "sep_token_id", None)
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._pin = self.device.type == "cuda"
        self._waiting: list[_Pending] = []
        self._inflight: _Launched | None = None
        self._ids: set[str] = set()
        self._counter = 0  # request ids (LLM._run reads and bumps it too)
        self._adds = 0
        self.num_forwards = 0
        self.num_batched_tokens = 0  # padded tokens run, over all forwards

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt token ids instead of text")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def encode_pair(self, text_1: str | list[int], text_2: str | list[int]) -> list[int]:
        """A cross-encoder's input for one pair (``join_pair`` with this model's tokenizer)."""
        return join_pair(self.tokenizer, self.model_config.family, text_1, text_2)

    def truncate_prompt(self, ids: list[int], keep: int) -> list[int]:
        """``truncate_prompt_tokens`` for an encoder: the first ``keep - 1`` tokens and the
        closing special token ([SEP] / </s>), as the tokenizer's right-side truncation."""
        if len(ids) <= keep:
            return ids
        return ids[: keep - 1] + ids[-1:] if keep > 1 else ids[:1]

    def check_priority(self, priority: object) -> None:
        """As LLMEngine's: any integer under the priority policy, 0 only under fcfs."""
        check_priority(priority, self.config.scheduling_policy)

    def _no_generation(self) -> ValueError:
        return ValueError(f"this model ({self.model_config.architecture}) is an encoder-only "
                          f"{'embedding model' if self.model_config.head == 'embed' else 'cross-encoder'}"
                          f" and does not support generation; it serves {self.supported_tasks[0]} "
                          f"({'/v1/embeddings' if self.model_config.head == 'embed' else '/score, /rerank'})")

    def compile_guide(self, params: Any) -> None:
        raise self._no_generation()

    def check_task(self, task: str) -> None:
        """A ValueError unless this model does ``task`` ("generate", "embed", "score")."""
        if task == "generate":
            raise self._no_generation()
        if task == "embed" and self.model_config.head != "embed":
            raise ValueError(f"this model ({self.model_config.architecture}) is a cross-encoder: "
                             "it scores pairs of texts (LLM.score, /score, /rerank), it does not embed")
        if task == "score" and self.model_config.head == "embed":
            raise ValueError(f"this model ({self.model_config.architecture}) is an encoder-only "
                             "embedding model: it has no head to score a pair with (LLM.score and "
                             "/score take the cosine of its embeddings instead)")
        if task == "score" and self.model_config.num_labels != 1:
            raise ValueError(f"this classifier has {self.model_config.num_labels} labels; only a "
                             "one-label cross-encoder gives a score (LLM.classify, /classify give "
                             "its class probabilities)")
        if task == "classify" and self.model_config.head != "classify":
            raise ValueError(f"this model ({self.model_config.architecture}) is an embedding "
                             "model: it has no classification head")

    def add_lora(self, lora_request: Any) -> None:
        raise ValueError("LoRA adapters are not supported on encoder models")

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: PoolingParams | Any = None, arrival_time: float | None = None,
                    lora_request: Any = None, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        """Queue a pooling request; raises ValueError (naming the problem) if it cannot run.
        (``cache_salt`` is accepted as the decoder engine's: an encoder caches nothing.)
        ``params.task``: "embed" (embedding models) or "score" (a cross-encoder; the prompt
        is a pair joined by ``encode_pair``)."""
        self.check_priority(priority)
        if not isinstance(params, PoolingParams):
            raise self._no_generation()
        if lora_request is not None:
            self.add_lora(lora_request)
        params.validate(self.model_config.hidden_size)
        self.check_task(params.task)
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if request_id in self._ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = prompt_text_and_ids(prompt, self.tokenize)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        arr = None
        if set(map(type, ids)) == _INT:  # plain ints (bools are not ids)
            arr = np.fromiter(ids, np.int64, len(ids))
            # a numpy reduce costs microseconds before its first element: Python's min / max
            # are quicker up to a few hundred ids (a negative id is a huge unsigned one)
            if (not 0 <= min(ids) <= max(ids) < vocab if len(ids) < 256
                    else int(arr.view(np.uint64).max()) >= vocab):
                arr = None
        if arr is None:
            for i, t in enumerate(ids):  # name the first bad one
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"prompt token id {t!r} at position {i} is outside the "
                                     f"vocabulary [0, {vocab})")
            ids = [int(t) for t in ids]  # subclasses of int
            arr = np.asarray(ids, dtype=np.int64)
        if len(ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but this encoder takes at most "
                             f"{self.max_model_len} ({self.model_config.position_limit}); "
                             "shorten it or set truncate_prompt_tokens")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        prio = priority if self.config.scheduling_policy == "priority" else 0
        self._adds += 1
        pending = _Pending((prio, arrival, self._adds), request_id, text, ids, arr, params, arrival)
        if not self._waiting or self._waiting[-1].key <= pending.key:
            self._waiting.append(pending)  # the usual case: it goes last
        else:
            bisect.insort(self._waiting, pending)
        self._ids.add(request_id)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self._waiting = [r for r in self._waiting if r.request_id not in ids]
        if self._inflight is not None:  # running: its output is dropped when read back
            for r in self._inflight.requests:
                r.aborted = r.aborted or r.request_id in ids
        self._ids -= ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting) or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self._waiting) + self._num_running()

    def _num_running(self) -> int:
        """Requests of the batch in flight, less the aborted ones."""
        return sum(not r.aborted for r in self._inflight.requests) if self._inflight else 0

    # ------------------------------------------------------------------ step
    def _take_batch(self) -> list[_Pending]:
        """The next batch (batch.pick) from the head of the queue, of the head's priority."""
        waiting = self._waiting
        if not waiting:
            return []
        prio = waiting[0].key[0]
        budget, seats = self.config.max_num_batched_tokens, self.config.max_num_seqs
        head = window((len(r.ids) for r in itertools.takewhile(lambda r: r.key[0] == prio, waiting)),
                      budget, seats)
        n = len(head)
        chosen = pick(head, budget, seats)
        batch = [waiting[i] for i in chosen]
        if len(chosen) == chosen[-1] + 1:  # a prefix of the queue (equal lengths, say)
            del waiting[: len(chosen)]
        else:
            taken = set(chosen)
            waiting[:n] = [r for i, r in enumerate(waiting[:n]) if i not in taken]
        return batch

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Launch the next batch; every request of a batch finishes when it is read back:
        this one at once, or with async scheduling at the next call (module docstring)."""
        batch = self._take_batch()
        launched = self._launch(batch) if batch else None
        previous, self._inflight = self._inflight, launched
        outs = self._finish(previous) if previous is not None else []
        if self._inflight is not None and not self.async_scheduling:
            outs += self._finish(self._inflight)
            self._inflight = None
        return outs

    def _launch(self, batch: list[_Pending]) -> _Launched:
        """Queue the batch's forward, pooling and copy back on the device; no sync."""
        mc = self.model_config
        started = time.monotonic()
        with torch.inference_mode():
            pairs = [r.params.task == "score" and mc.type_vocab_size > 1 for r in batch]
            host = pack([r.array for r in batch], mc.pad_token_id, self.sep_token_id, pairs,
                        self._pin)
            x = to_device(host, self.device, mc.pad_token_id, mc.family == "roberta")
            hidden = self.model(x.ids, x.types, x.positions, x.valid)
            self.num_forwards += 1
            self.num_batched_tokens += x.ids.numel()
            out = self._head(batch, hidden, x.valid)
            ready = None
            if out.device.type == "cuda":  # into pinned memory; the event says when it landed
                out = out.to("cpu", non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
        return _Launched(batch, started, out, ready)

    def _head(self, batch: list[_Pending], hidden: torch.Tensor,
              valid: torch.Tensor | None) -> torch.Tensor:
        """[B, T, hidden] -> [B, D] fp32 on the device: embeddings pooled, cut and normalized
        (each row's first ``dimensions`` count), or the head's probabilities."""
        if batch[0].params.task != "embed":  # one head: the batch is all scores or classes
            logits = self.model.classify(hidden, valid).float()
            return activate(logits, self.model_config.score_activation)
        pooled = pool(hidden, valid, self.pooling_type)
        return cut_and_normalize(pooled, [r.params.dimensions for r in batch],
                                 [r.params.normalize for r in batch])

    def _finish(self, launched: _Launched) -> list[RequestOutput]:
        """Wait for a launched batch's copy, and give each request its row (a copy: the
        host buffer is pinned memory, returned to torch's cache)."""
        if launched.ready is not None:
            launched.ready.synchronize()
        rows = launched.out.numpy()
        now = time.monotonic()
        outs = []
        for r, row in zip(launched.requests, rows, strict=True):
            if r.aborted:
                continue
            self._ids.discard(r.request_id)
            d = r.params.dimensions
            metrics = RequestMetrics(r.arrival, first_scheduled_time=launched.started,
                                     first_token_time=now, last_token_time=now, finished_time=now)
            outs.append(RequestOutput(r.request_id, r.prompt, r.ids, [], finished=True,
                                      metrics=metrics, embedding=(row[:d] if d else row).copy()))
        return outs

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """LLMEngine.stats()'s shape (the server's /metrics reads it); no KV cache: zeros."""
        kv = KVCacheStats(num_blocks=0, block_size=0, blocks_used=0, blocks_free=0,
                          blocks_cached_free=0, tokens_stored=0, slots_allocated=0,
                          utilization=1.0, usage=0.0, prefix_queries=0, prefix_hits=0,
                          prefix_hit_rate=0.0, num_evictions=0)
        return {"num_running": self._num_running(), "num_waiting": len(self._waiting), "num_preemptions": 0,
                "kv_cache": kv, "encoder": {"num_forwards": self.num_forwards,
                                            "num_batched_tokens": self.num_batched_tokens}}


def join_pair(tok: Any | None, family: str, text_1: str | list[int],
              text_2: str | list[int]) -> list[int]:
    """One pair as the cross-encoder's tokenizer joins two texts (BERT: [CLS] a [SEP] b
    [SEP]; XLM-R: <s> a </s></s> b </s>); token-id prompts are joined the same way, with
    the tokenizer's cls and sep ids. ``family``: EncoderConfig.family, or "decoder" for a
    decoder sequence classifier: its tokenizer's own pair encoding (vLLM's: the tokenizer
    called on text and text_pair; Llama's: <s> a <s> b, Qwen2's: a b, nothing between),
    token ids through the same build_inputs_with_special_tokens. "concat": the one text
    text_1 + text_2 (vLLM's use_pad_token false, a reranker made from a causal LM); token
    ids as given, one after the other (a text beside them encoded without special tokens)."""
    if tok is None:
        raise ValueError("this model has no tokenizer: a cross-encoder needs one to join the "
                         "two texts of a pair")
    if family == "concat":
        if isinstance(text_1, str) and isinstance(text_2, str):
            return list(tok(text_1 + text_2)["input_ids"])
        ids = [tok.encode(t, add_special_tokens=False) if isinstance(t, str) else list(t)
               for t in (text_1, text_2)]
        return [int(t) for t in ids[0] + ids[1]]
    if isinstance(text_1, str) and isinstance(text_2, str):
        return list(tok(text_1, text_2)["input_ids"])
    a = tok.encode(text_1, add_special_tokens=False) if isinstance(text_1, str) else list(text_1)
    b = tok.encode(text_2, add_special_tokens=False) if isinstance(text_2, str) else list(text_2)
    if family == "decoder":
        return [int(t) for t in tok.build_inputs_with_special_tokens(a, b)]
    cls_id, sep_id = tok.cls_token_id, tok.sep_token_id
    if cls_id is None or sep_id is None:
        raise ValueError("the tokenizer has no cls / sep token to join a pair of token-id prompts")
    middle = [sep_id, sep_id] if family == "roberta" else [sep_id]
    return [cls_id, *a, *middle, *b, sep_id]


def _load_tokenizer(path: str | None, trust_remote_code: bool = False) -> Any | None:
    if path is None or not os.path.isdir(path):
        return None
    if not any(os.path.isfile(os.path.join(path, f)) for f in
               ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "sentencepiece.bpe.model")):
        return None
    from flashpage.engine.tokenizer import auto_tokenizer

    return auto_tokenizer(path, trust_remote_code)
