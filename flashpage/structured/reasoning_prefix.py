"""Structured outputs after a reasoning model's thinking (``StructuredOutputsParams.reasoning``):
the thinking ``... </think>`` is left free and the pattern starts after it, as vLLM starts
its grammar once the reasoning parser sees the reasoning end.

``ThinkingThenDFA`` wraps a pattern's automaton (a LazyDFA or a grammar's pushdown, any
``TableDFA``) in front of which it allows:

- ``"first"`` (deepseek_r1, or a prompt whose template opened ``<think>``): any text without
  ``</think>``, then ``</think>``, then optional whitespace, then the pattern;
- ``"optional"`` (qwen3 and the others): the same if the output opens (after whitespace) with
  ``<think>``; else the pattern from the first byte.

Its states are small sets of component states, built lazily (a subset construction):
``("open", j)`` j bytes of an opening ``<think>`` read (after optional whitespace),
``("think", k)`` inside the thinking with k bytes of ``</think>`` matched (KMP over the tag),
``("gap",)`` whitespace after the tag, ``("in", s)`` the pattern's state s. Accepting where a
pattern state accepts. The thinking's bytes are any bytes, so every token is allowed there:
masks cost one state per tag prefix, cached as the pattern's are.
"""

from __future__ import annotations

from flashpage.structured.automaton import MAX_DFA_STATES, TableDFA

START, END = b"<think>", b"</think>"
REASONING_MODES = ("first", "optional")
_SPACE = frozenset(b" \t\n\r")

Component = tuple[str, int]


def _kmp_table(tag: bytes) -> list[list[int]]:
    """next[k][b]: how much of ``tag`` is matched after byte b with k matched (k < len)."""
    nxt = [[0] * 256 for _ in tag]
    for k in range(len(tag)):
        for b in range(256):
            seen = tag[:k] + bytes([b])
            m = min(len(seen), len(tag))
            while m and not tag.startswith(seen[len(seen) - m:]):
                m -= 1
            nxt[k][b] = m
    return nxt


_END_NEXT = _kmp_table(END)


class ThinkingThenDFA(TableDFA):
    def __init__(self, inner: TableDFA, mode: str, max_states: int = MAX_DFA_STATES) -> None:
        if mode not in REASONING_MODES:
            raise ValueError(f"reasoning must be one of {', '.join(REASONING_MODES)}, got {mode!r}")
        super().__init__(max_states)
        self.inner = inner
        self._ids: dict[frozenset[Component], int] = {}
        self._sets: list[frozenset[Component]] = []
        dead = self._add(frozenset())
        self.table[dead] = dead
        self.has_row[dead] = True
        if mode == "first":
            first: set[Component] = {("think", 0)}
        else:
            first = {("open", 0), ("in", inner.start)}
        self.start = self._add(frozenset(first))

    def _add(self, comps: frozenset[Component]) -> int:
        sid = self._ids.get(comps)
        if sid is None:
            accepting = any(kind == "in" and self.inner.accepting[s] for kind, s in comps)
            sid = self._ids[comps] = self._new_state(accepting)
            self._sets.append(comps)
        return sid

    def _after_end(self) -> set[Component]:
        return {("gap", 0), ("in", self.inner.start)}

    def _next(self, comp: Component, b: int) -> set[Component]:
        kind, k = comp
        if kind == "in":
            s = self.inner.step(k, b)
            return {("in", s)} if s else set()
        if kind == "gap":
            return self._after_end() if b in _SPACE else set()
        if kind == "open":
            if k == 0 and b in _SPACE:
                return {("open", 0)}
            if b == START[k]:
                return {("think", 0)} if k + 1 == len(START) else {("open", k + 1)}
            return set()
        m = _END_NEXT[k][b]  # "think"
        return self._after_end() if m == len(END) else {("think", m)}

    def _build_row(self, s: int) -> None:
        comps = self._sets[s]
        row = self.table[s]
        memo: dict[frozenset[Component], int] = {frozenset(): 0}
        for b in range(256):
            nxt: set[Component] = set()
            for c in comps:
                nxt |= self._next(c, b)
            key = frozenset(nxt)
            sid = memo.get(key)
            if sid is None:
                sid = memo[key] = self._add(key)
                row = self.table[s]  # _add may have grown (reallocated) the table
            row[b] = sid
        self.has_row[s] = True
