"""Token-level guides: which tokens keep a request's output inside its pattern.

A ``CompiledGuide`` is one pattern's lazy DFA beside the tokenizer's vocabulary; every
request with the same spec shares it. For a DFA state, the allowed tokens are those whose
whole byte string leads from that state to a live state; eos is allowed where the state
accepts. Computed the first time a request reaches the state, then cached (as token ids
and as a bool mask per device), so a state costs one vocabulary walk however many
requests pass through it.

The walk runs every token at once, one byte column per iteration (numpy): ``TokenIndex``
holds the vocabulary as a padded byte matrix; tokens die as their path reaches the dead
state and are harvested when their bytes end, so an iteration touches only the tokens
still alive. ``GuideState`` is one request's current state, advanced on the host with
each token read back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from flashpage.structured.automaton import AutomatonTooLarge, TableDFA

logger = logging.getLogger("flashpage")

MAX_CACHED_MASKS = 4096  # per guide; past it the cache starts over (masks are vocab bytes each)


class TokenIndex:
    """The vocabulary as byte strings, laid out for walking all tokens through a DFA.

    ids   int64 [n]     token ids that have bytes (special tokens and eos left out)
    data  uint8 [n, L]  their bytes, zero-padded to the longest token's L
    lens  int64 [n]     their lengths (>= 1)
    """

    def __init__(self, token_bytes: Sequence[bytes | None], eos_ids: Sequence[int]) -> None:
        eos = set(eos_ids)
        self.vocab_size = len(token_bytes)
        self.token_bytes = [None if i in eos else b for i, b in enumerate(token_bytes)]
        ids = [i for i, b in enumerate(self.token_bytes) if b]
        self.ids = np.asarray(ids, dtype=np.int64)
        self.lens = np.asarray([len(self.token_bytes[i] or b"") for i in ids], dtype=np.int64)
        width = int(self.lens.max()) if ids else 1
        buf = bytearray(len(ids) * width)
        for row, i in enumerate(ids):
            b = self.token_bytes[i] or b""
            buf[row * width: row * width + len(b)] = b
        self.data = np.frombuffer(bytes(buf), dtype=np.uint8).reshape(len(ids), width)
        self.eos_ids = tuple(sorted(e for e in eos if 0 <= e < self.vocab_size))

    def allowed(self, dfa: TableDFA, state: int) -> np.ndarray:
        """Token ids (sorted int64) whose bytes lead from ``state`` to a live state."""
        if state == 0:
            return np.zeros(0, dtype=np.int64)
        rows = np.arange(len(self.ids))
        st = np.full(len(rows), state, dtype=np.int32)
        found: list[np.ndarray] = []
        col = 0
        while rows.size:
            ended = self.lens[rows] == col
            if ended.any():
                found.append(rows[ended])
                rows, st = rows[~ended], st[~ended]
                if not rows.size:
                    break
            dfa.ensure_rows(st)
            st = dfa.table[st, self.data[rows, col]]
            alive = st != 0
            rows, st = rows[alive], st[alive]
            col += 1
        if not found:
            return np.zeros(0, dtype=np.int64)
        return np.sort(self.ids[np.concatenate(found)])


class CompiledGuide:
    """One pattern's DFA and its per-state allowed tokens over one vocabulary."""

    def __init__(self, dfa: TableDFA, index: TokenIndex) -> None:
        self.dfa = dfa
        self.index = index
        self.start = dfa.start
        self._allowed: dict[int, np.ndarray] = {}
        self._masks: dict[tuple[int, bool, str], torch.Tensor] = {}

    def allowed(self, state: int) -> np.ndarray:
        """Token ids allowed from ``state``, eos not included (cached)."""
        ids = self._allowed.get(state)
        if ids is None:
            if len(self._allowed) >= MAX_CACHED_MASKS:
                self._allowed.clear()
            ids = self._allowed[state] = self.index.allowed(self.dfa, state)
        return ids

    def accepting(self, state: int) -> bool:
        return self.dfa.accepting[state]

    def can_continue(self, state: int) -> bool:
        """Whether a token other than eos may follow ``state`` (False past the automaton's
        limits, as ``mask`` then allows none)."""
        try:
            return self.allowed(state).size > 0
        except AutomatonTooLarge as e:
            logger.warning("structured output guide stopped: %s", e)
            return False

    def mask(self, state: int, allow_eos: bool, device: torch.device) -> torch.Tensor:
        """bool [vocab_size]: the tokens that may come next from ``state`` (eos where the
        pattern may end, if ``allow_eos``); cached per state on ``device``."""
        key = (state, allow_eos, str(device))
        m = self._masks.get(key)
        if m is None:
            try:
                ids = self.allowed(state)
            except AutomatonTooLarge as e:  # a drafted state (speculative decoding): nothing
                logger.warning("structured output guide stopped: %s", e)
                ids = np.zeros(0, dtype=np.int64)
            if allow_eos and self.accepting(state) and self.index.eos_ids:
                ids = np.concatenate([ids, np.asarray(self.index.eos_ids, dtype=np.int64)])
            host = torch.zeros(self.index.vocab_size, dtype=torch.bool)
            host[torch.from_numpy(ids)] = True
            if len(self._masks) >= MAX_CACHED_MASKS:
                self._masks.clear()
            m = self._masks[key] = host.to(device)
        return m

    def next_state(self, state: int, token_id: int) -> int:
        """The state after ``token_id`` (0, dead, for a token the pattern does not allow)."""
        if not 0 <= token_id < self.index.vocab_size:
            return 0
        b = self.index.token_bytes[token_id]
        try:
            return 0 if b is None else self.dfa.walk(state, b)
        except AutomatonTooLarge as e:  # past the automaton's limits: as if not allowed
            logger.warning("structured output guide stopped: %s", e)
            return 0


class GuideState:
    """One request's place in its guide. ``allow_eos`` False (ignore_eos): the request runs
    until nothing but eos could follow, or to max_tokens."""

    def __init__(self, guide: CompiledGuide, allow_eos: bool = True) -> None:
        self.guide = guide
        self.allow_eos = allow_eos
        self.state = guide.start
        # speculative decoding: the state after this step's drafts, which the step's sampled
        # row (after the last draft) is masked for; None otherwise
        self.lookahead: int | None = None

    def states_along(self, tokens: list[int]) -> list[int]:
        """The states after each prefix of ``tokens`` from the current one: [state, after
        tokens[0], ...] up to the first token the pattern does not allow (excluded)."""
        out = [self.state]
        for t in tokens:
            nxt = self.guide.next_state(out[-1], t)
            if nxt == 0:
                break
            out.append(nxt)
        return out

    def advance(self, token_id: int) -> None:
        try:
            self.state = self.guide.next_state(self.state, token_id)
            self.guide.allowed(self.state)  # built now, on the host, not inside the next step
        except AutomatonTooLarge as e:  # the request ends; the engine goes on
            logger.warning("structured output guide stopped: %s", e)
            self.state = 0

    def is_finished(self) -> bool:
        """Nothing but eos may follow: the output is complete (or, if the state does not
        accept, no token of this vocabulary can continue it)."""
        return self.guide.allowed(self.state).size == 0

    def mask(self, device: torch.device) -> torch.Tensor:
        state = self.state if self.lookahead is None else self.lookahead
        return self.guide.mask(state, self.allow_eos, device)
