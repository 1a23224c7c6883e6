"""StructuredOutputsParams -> a CompiledGuide for one tokenizer, cached by spec.

Every kind but a grammar becomes a regex first (a JSON schema through ``json_schema.py``,
a choice as the alternation of its escaped strings), then a byte NFA, a lazy DFA and the
guide over the vocabulary; a grammar becomes a lazy DFA or a pushdown automaton with the
same interface (``grammar.py``). Compiling happens when a request is added, so a bad spec is that
request's ValueError (a StructuredOutputsError) and nobody else's; the start state's
tokens are computed then too, which refuses patterns no token can begin.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from flashpage.sampling_params import StructuredOutputsError, StructuredOutputsParams
from flashpage.structured.automaton import ByteNFA, LazyDFA, TableDFA
from flashpage.structured.grammar import compile_grammar
from flashpage.structured.guide import CompiledGuide, TokenIndex
from flashpage.structured.json_schema import WHITESPACE, json_object_regex, json_schema_to_regex
from flashpage.structured.reasoning_prefix import ThinkingThenDFA
from flashpage.structured.regex_parser import parse_regex
from flashpage.structured.vocab import token_bytes

MAX_CACHED_GUIDES = 64


def spec_to_regex(spec: StructuredOutputsParams) -> str:
    """The regex a spec's outputs must match in full."""
    ws = "" if spec.disable_any_whitespace else spec.whitespace_pattern or WHITESPACE
    if spec.regex is not None:
        return spec.regex
    if spec.choice is not None:
        return "|".join(re.escape(c) for c in spec.choice)
    if spec.json_object:
        return json_object_regex(ws)
    if spec.json is not None:
        return json_schema_to_regex(spec.json, ws)
    raise StructuredOutputsError(f"structured outputs: {spec.kind} is not supported")


class GuideCompiler:
    """Guides for one engine's tokenizer; the vocabulary index is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int],
                 max_cached: int = MAX_CACHED_GUIDES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos_ids)
        self.max_cached = max_cached
        self._index: TokenIndex | None = None
        self._guides: OrderedDict[tuple[Any, ...], CompiledGuide] = OrderedDict()

    @property
    def index(self) -> TokenIndex:
        if self._index is None:
            self._index = TokenIndex(token_bytes(self.tokenizer, self.vocab_size), self.eos_ids)
        return self._index

    def compile(self, spec: StructuredOutputsParams) -> CompiledGuide:
        """The guide of ``spec`` (cached); StructuredOutputsError naming what is wrong."""
        key = spec.cache_key()
        guide = self._guides.get(key)
        if guide is not None:
            self._guides.move_to_end(key)
            return guide
        try:
            dfa: TableDFA
            if spec.grammar is not None:
                dfa = compile_grammar(spec.grammar)
            else:
                dfa = LazyDFA(ByteNFA(parse_regex(spec_to_regex(spec))))
            if spec.reasoning is not None:  # free thinking first (structured/reasoning_prefix.py)
                dfa = ThinkingThenDFA(dfa, spec.reasoning)
            guide = CompiledGuide(dfa, self.index)
            start_ids = guide.allowed(guide.start)  # the first walk may pass the automaton's limits
        except StructuredOutputsError:
            raise
        except (ValueError, RecursionError) as e:
            what = "nesting too deep" if isinstance(e, RecursionError) else str(e)
            raise StructuredOutputsError(f"structured outputs ({spec.kind}): {what}") from None
        if start_ids.size == 0:
            if dfa.accepting[dfa.start] and not dfa.is_live(dfa.start):
                why = "matches only the empty string: there is nothing to generate"
            elif dfa.is_live(dfa.start):
                why = "no token of this tokenizer can begin a match"
            else:
                why = "matches no text at all"
            raise StructuredOutputsError(f"structured outputs ({spec.kind}): the pattern {why}")
        self._guides[key] = guide
        if len(self._guides) > self.max_cached:
            self._guides.popitem(last=False)
        return guide
