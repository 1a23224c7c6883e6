"""A regex's syntax tree as a byte-level NFA (Thompson's construction), and a DFA over it
built lazily, one state and one transition row at a time.

Running over bytes, not characters, lets a tokenizer's tokens be walked as they are:
byte-level BPE tokens are byte strings, and one may end inside a multi-byte character.
Character sets become UTF-8 byte-range sequences (``utf8.py``), so the DFA accepts
exactly the UTF-8 encodings of the strings the regex matches.

DFA layout (what ``guide.py`` reads)::

    table   : int32 [capacity, 256]   table[s, b] = the state after byte b from state s
                                      (-1: row not built yet, see ``ensure_rows``)
    has_row : bool [capacity]         whether row s is built
    state 0 is dead (no match possible from it); ``start`` is the initial state
"""

from __future__ import annotations

import numpy as np

from flashpage.structured.regex_parser import Alt, CharSet, Concat, Node, Repeat
from flashpage.structured.utf8 import utf8_sequences

MAX_NFA_STATES = 500_000
MAX_DFA_STATES = 200_000


class AutomatonTooLarge(ValueError):
    """A pattern whose automaton would exceed the size limits."""


class ByteNFA:
    """States with byte-range edges ``(lo, hi, target)`` and epsilon edges."""

    def __init__(self, node: Node, max_states: int = MAX_NFA_STATES) -> None:
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []
        self.max_states = max_states
        self.start, self.accept = self._build(node)

    def _new(self) -> int:
        if len(self.edges) >= self.max_states:
            raise AutomatonTooLarge(f"the pattern needs more than {self.max_states} automaton "
                                    "states (large repeat counts or schemas)")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def _build(self, node: Node) -> tuple[int, int]:
        """A fragment (start, end) matching ``node``; ``end`` has no outgoing edges yet."""
        if isinstance(node, CharSet):
            s, e = self._new(), self._new()
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):
                    cur = s
                    for k, (blo, bhi) in enumerate(seq):
                        nxt = e if k == len(seq) - 1 else self._new()
                        self.edges[cur].append((blo, bhi, nxt))
                        cur = nxt
            return s, e
        if isinstance(node, Concat):
            s = e = self._new()
            for item in node.items:
                a, b = self._build(item)
                self.eps[e].append(a)
                e = b
            return s, e
        if isinstance(node, Alt):
            s, e = self._new(), self._new()
            for option in node.options:
                a, b = self._build(option)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        if isinstance(node, Repeat):
            s = e = self._new()
            for _ in range(node.min):
                a, b = self._build(node.node)
                self.eps[e].append(a)
                e = b
            if node.max is None:  # a loop through one more copy
                loop = self._new()
                a, b = self._build(node.node)
                self.eps[e].append(loop)
                self.eps[loop].append(a)
                self.eps[b].append(loop)
                return s, loop
            end = self._new()
            for _ in range(node.max - node.min):  # optional copies, each may skip to the end
                a, b = self._build(node.node)
                self.eps[e].append(a)
                self.eps[e].append(end)
                e = b
            self.eps[e].append(end)
            return s, end
        raise TypeError(f"unknown regex node {node!r}")


class TableDFA:
    """A DFA whose transition rows are built on demand: ``table``, ``has_row`` and
    ``accepting`` as the module docstring lays them out, state 0 dead. Subclasses say how
    a state's row is built (``_build_row``) and add states with ``_new_state``; this is
    all ``guide.py`` reads, so a regex's LazyDFA and a grammar's pushdown automaton
    (``pushdown.py``) serve the same guides."""

    def __init__(self, max_states: int) -> None:
        self.max_states = max_states
        self.accepting: list[bool] = []
        self.table = np.full((64, 256), -1, dtype=np.int32)
        self.has_row = np.zeros(64, dtype=bool)
        self.start = 0

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def _new_state(self, accepting: bool) -> int:
        sid = len(self.accepting)
        if sid >= self.max_states:
            raise AutomatonTooLarge(f"the pattern's automaton grew past {self.max_states} states")
        if sid >= self.table.shape[0]:
            grow = self.table.shape[0]
            self.table = np.concatenate([self.table, np.full((grow, 256), -1, np.int32)])
            self.has_row = np.concatenate([self.has_row, np.zeros(grow, dtype=bool)])
        self.accepting.append(accepting)
        return sid

    def _build_row(self, s: int) -> None:
        raise NotImplementedError

    def ensure_rows(self, states: np.ndarray) -> None:
        """Build the rows of every state in ``states`` (int array) that has none yet."""
        missing = states[~self.has_row[states]]
        if missing.size:
            for s in np.unique(missing).tolist():
                self._build_row(s)

    def step(self, s: int, byte: int) -> int:
        if not self.has_row[s]:
            self._build_row(s)
        return int(self.table[s, byte])

    def walk(self, s: int, data: bytes) -> int:
        """The state after ``data`` from ``s`` (0 once dead)."""
        for b in data:
            if s == 0:
                return 0
            s = self.step(s, b)
        return s

    def matches(self, data: bytes) -> bool:
        return self.accepting[self.walk(self.start, data)]

    def is_live(self, s: int) -> bool:
        """Whether some byte leads from ``s`` to a state that is not dead."""
        if not self.has_row[s]:
            self._build_row(s)
        return bool(self.table[s].any())


class LazyDFA(TableDFA):
    """The subset construction of a ByteNFA, built on demand.

    A DFA state is the set of NFA states reachable after some input, keeping only those
    that matter (with byte edges, or the accepting one), so equivalent sets share a state.
    """

    def __init__(self, nfa: ByteNFA, max_states: int = MAX_DFA_STATES) -> None:
        super().__init__(max_states)
        self.nfa = nfa
        self._closures: dict[int, frozenset[int]] = {}
        self._ids: dict[frozenset[int], int] = {}
        self._sets: list[frozenset[int]] = []
        dead = self._add(frozenset())
        self.table[dead] = dead
        self.has_row[dead] = True
        self.start = self._add(self._closure([nfa.start]))

    def _closure(self, states: list[int] | set[int]) -> frozenset[int]:
        out: set[int] = set()
        for q in states:
            c = self._closures.get(q)
            if c is None:
                c = self._closures[q] = self._closure_of(q)
            out |= c
        return frozenset(out)

    def _closure_of(self, q: int) -> frozenset[int]:
        nfa, seen, stack = self.nfa, {q}, [q]
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(s for s in seen if nfa.edges[s] or s == nfa.accept)

    def _add(self, states: frozenset[int]) -> int:
        sid = self._ids.get(states)
        if sid is None:
            sid = self._ids[states] = self._new_state(self._is_accepting(states))
            self._sets.append(states)
        return sid

    def _is_accepting(self, states: frozenset[int]) -> bool:
        return self.nfa.accept in states

    def _build_row(self, s: int) -> None:
        buckets: list[list[int]] = [[] for _ in range(256)]
        edges = self.nfa.edges
        for q in self._sets[s]:
            for lo, hi, t in edges[q]:
                for b in range(lo, hi + 1):
                    buckets[b].append(t)
        memo: dict[tuple[int, ...], int] = {(): 0}
        row = self.table[s]
        for b, targets in enumerate(buckets):
            key = tuple(sorted(set(targets)))
            sid = memo.get(key)
            if sid is None:
                sid = memo[key] = self._add(self._closure(set(key)))
                row = self.table[s]  # _add may have grown (reallocated) the table
            row[b] = sid
        self.has_row[s] = True
