"""Sampling parameters, named and validated as in vLLM."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsError(ValueError):
    """A structured-outputs spec that cannot be used (bad regex or schema, unsupported)."""


@dataclass
class StructuredOutputsParams:
    """What the output must look like, as vLLM (>= 0.10) asks for it: exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text): the output is a JSON text valid
      against it (the supported subset: ``structured/json_schema.py``);
    - ``regex``: the whole output matches it (``structured/regex_parser.py``'s subset);
    - ``choice``: the output is one of these strings;
    - ``json_object=True``: the output is a JSON object (nesting bounded, 4 levels);
    - ``grammar``: the output is a sentence of this context-free grammar, written as GBNF /
      EBNF (``root ::= ...``, llama.cpp's and xgrammar's dialect) or in Lark's basic syntax
      (``start: ...``); recursion allowed, left recursion refused
      (``structured/grammar_parser.py`` and
      ``lark_parser.py`` list the syntax).

    ``disable_any_whitespace``: no whitespace between JSON tokens; ``whitespace_pattern``:
    the regex used there instead of the default ``[ ]?`` (outlines' option).

    ``reasoning`` (ours; the server sets it with ``--reasoning-parser``): a reasoning model
    thinks first, unconstrained, and the pattern starts after ``</think>`` (and optional
    whitespace): ``"first"``: the output starts inside the thinking (DeepSeek-R1, or a
    template that opened ``<think>``); ``"optional"``: only if it opens with ``<think>``
    (Qwen3); None: the pattern from the first token (``structured/reasoning_prefix.py``).
    """

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                "structured outputs take exactly one of json, regex, choice, grammar, json_object"
                f" (got {', '.join(given) if given else 'none'})")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise StructuredOutputsError(
                f"structured outputs: grammar must be a non-empty string (GBNF or Lark), got {self.grammar!r}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise StructuredOutputsError(f"structured outputs: regex must be a string, got {self.regex!r}")
        if self.choice is not None and (
                not isinstance(self.choice, list | tuple) or not self.choice
                or any(not isinstance(c, str) for c in self.choice) or not any(self.choice)):
            raise StructuredOutputsError(
                f"structured outputs: choice must be a non-empty list of strings, got {self.choice!r}")
        if self.json is not None and not isinstance(self.json, str | dict | bool):
            raise StructuredOutputsError(
                f"structured outputs: json must be a JSON schema (object or text), got {self.json!r}")
        if self.json_object not in (None, True, False):
            raise StructuredOutputsError("structured outputs: json_object must be a boolean")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise StructuredOutputsError("structured outputs: whitespace_pattern must be a string")
        if self.reasoning not in (None, "first", "optional"):
            raise StructuredOutputsError(
                f"structured outputs: reasoning must be 'first', 'optional' or None, got {self.reasoning!r}")

    def cache_key(self) -> tuple[Any, ...]:
        """Hashable and equal for equal specs (a schema's key order kept: it orders the output)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            value = _json.dumps(value)
        elif self.kind == "choice":
            value = tuple(value)
        return (self.kind, value, self.disable_any_whitespace, self.whitespace_pattern, self.reasoning)


GuidedDecodingParams = StructuredOutputsParams  # vLLM < 0.10's name for the same thing


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen)
    # logprobs of each prompt token given the ones before it (None for the first), with this
    # many alternatives: vLLM's; such a request takes no prefix-cache hit (each position's
    # logits are computed)
    prompt_logprobs: int | None = None
    # token id -> added to its logit before penalties and temperature (OpenAI's logit_bias:
    # -100 bans a token in practice, +100 all but forces it); values in [-100, 100]
    logit_bias: dict[int, float] | None = None
    # the only tokens that may be sampled (vLLM's; e.g. an answer among A-D): every other
    # token's logit is -inf, before logit_bias and penalties
    allowed_token_ids: list[int] | None = None
    # words the output may not contain (vLLM's): each word's tokens, with and without a
    # leading space; the last token of one is barred wherever the output ends in the rest
    bad_words: list[str] | None = None
    # keep only the prompt's last this many tokens (vLLM's; a long chat history that would
    # not fit the context is cut from the front instead of refused)
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (benchmarks; stop strings need text)
    # the output's shape (vLLM's): a JSON schema, regex, choice or any JSON object; the
    # request ends ("stop") once nothing but eos could follow
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM < 0.10's name: moved to the above
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop = [self.stop]
        else:
            self._stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise StructuredOutputsError("give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise StructuredOutputsError(f"structured_outputs: {e}") from None
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}")
        if self._stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or self.truncate_prompt_tokens < 1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, list | tuple)
                or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list | tuple) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise StructuredOutputsError("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}")
                if (not isinstance(b, int | float) or isinstance(b, bool) or not math.isfinite(b)
                        or not -100.0 <= b <= 100.0):
                    raise ValueError(f"logit_bias of token {t} must be a number in [-100, 100], got {b!r}")


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams. ``temperature`` is accepted for compatibility: the beams are
    chosen by the model's log-probabilities, which it does not change."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.beam_width > 10:  # 2 * width alternatives a step, within logprobs' limit of 20
            raise ValueError(f"beam_width must be at most 10, got {self.beam_width}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
