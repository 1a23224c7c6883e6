"""A recursive grammar as a byte automaton the guides can walk: a pushdown automaton whose
configurations become DFA states, one at a time, as the output reaches them.

Every rule's body compiles into one byte NFA (``GrammarNFA``), a rule reference becoming a
call edge (callee, return state). ``ItemDFA`` is the subset construction of it inside a
rule: an item is a set of NFA states of one rule, with byte transitions (a lazy table, as
a regex's), its calls (callee's start item, the item to return to) and whether the rule
may end there.

A configuration is a set of stacks (several while the text read so far parses more than
one way), each a tuple of items: the bottom ones are where to return, the top one reads
the next byte. ``_expand`` makes a set of stacks ready to read: a top item that calls
pushes the callee's start (a return item that could only return at once is not pushed, so
right recursion - ``list ::= item ("," list)?`` - does not deepen the stack), a top item
whose rule may end pops, and the root rule ending makes the configuration accepting.
Only stacks whose top reads bytes are kept. Left recursion (a rule calling itself before
reading anything) would push forever: ``grammar.py`` refuses it first.

``PushdownDFA`` numbers configurations as DFA states and builds a state's row of 256
transitions when first needed (one byte step of every stack's top item, bytes that move
every stack alike grouped), so ``guide.py`` walks the vocabulary through it exactly as
through a regex's DFA, and a configuration's allowed tokens are computed once per guide.
Configurations are exact (the whole stack), so the masks are too; the cost is one state per
distinct (stack, position), bounded by ``MAX_PUSHDOWN_STATES``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from flashpage.structured.automaton import (
    MAX_DFA_STATES,
    MAX_NFA_STATES,
    AutomatonTooLarge,
    ByteNFA,
    LazyDFA,
    TableDFA,
)
from flashpage.structured.regex_parser import Node, Ref

MAX_PUSHDOWN_STATES = 100_000  # rows of 256 int32: 100 MB at most per grammar
MAX_STACKS = 1_000  # parses of one prefix followed at once: past it the grammar is too ambiguous

Stack = tuple[int, ...]


class GrammarNFA(ByteNFA):
    """Every rule's body in one byte NFA: rule ``r`` runs from ``starts[r]`` to its accept
    state; ``calls[q]`` lists (callee rule, return state) for a reference leaving ``q``."""

    def __init__(self, rules: list[Node], index: dict[str, int], max_states: int = MAX_NFA_STATES) -> None:
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []
        self.calls: list[list[tuple[int, int]]] = []
        self.max_states = max_states
        self.index = index
        self.starts: list[int] = []
        ends: list[int] = []
        for node in rules:
            s, e = self._build(node)
            self.starts.append(s)
            ends.append(e)
        self.start, self.accept = self.starts[0], ends[0]
        self.accepts = frozenset(ends)

    def _new(self) -> int:
        sid = super()._new()
        self.calls.append([])
        return sid

    def _build(self, node: Node) -> tuple[int, int]:
        if isinstance(node, Ref):
            s, e = self._new(), self._new()
            self.calls[s].append((self.index[node.name], e))
            return s, e
        return super()._build(node)


class ItemDFA(LazyDFA):
    """The subset construction inside each rule: items, their byte rows, calls and ends."""

    def __init__(self, nfa: GrammarNFA, max_states: int = MAX_DFA_STATES) -> None:
        self.gnfa = nfa
        super().__init__(nfa, max_states)
        self.rule_starts = [self._add(self._closure([s])) for s in nfa.starts]
        self._calls: dict[int, tuple[tuple[int, int], ...]] = {}
        self._reads: dict[int, bool] = {}

    def _closure_of(self, q: int) -> frozenset[int]:
        nfa, seen, stack = self.gnfa, {q}, [q]
        while stack:
            for t in nfa.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(s for s in seen if nfa.edges[s] or nfa.calls[s] or s in nfa.accepts)

    def _is_accepting(self, states: frozenset[int]) -> bool:
        return not states.isdisjoint(self.gnfa.accepts)

    def calls(self, item: int) -> tuple[tuple[int, int], ...]:
        """(callee's start item, item to return to) for each reference leaving ``item``."""
        out = self._calls.get(item)
        if out is None:
            out = self._calls[item] = tuple(sorted(
                {(self.rule_starts[r], self._add(self._closure([t])))
                 for q in self._sets[item] for r, t in self.gnfa.calls[q]}))
        return out

    def reads(self, item: int) -> bool:
        """Whether ``item`` has byte transitions."""
        out = self._reads.get(item)
        if out is None:
            out = self._reads[item] = any(self.gnfa.edges[q] for q in self._sets[item])
        return out

    def only_returns(self, item: int) -> bool:
        """Whether all ``item`` can do is end its rule (a tail position)."""
        return self.accepting[item] and not self.reads(item) and not self.calls(item)


class PushdownDFA(TableDFA):
    """Configurations (sets of stacks of items) as lazily built DFA states; see the module
    docstring. State 0 is dead; an accepting state may have no live transitions (only eos)."""

    def __init__(self, items: ItemDFA, max_states: int = MAX_PUSHDOWN_STATES) -> None:
        super().__init__(max_states)
        self.items = items
        self._ids: dict[tuple[frozenset[Stack], bool], int] = {}
        self._configs: list[frozenset[Stack]] = []
        dead = self._config(frozenset(), False)
        self.table[dead] = dead
        self.has_row[dead] = True
        self.start = self._config(*self._expand([(items.start,)]))

    def _config(self, stacks: frozenset[Stack], accepting: bool) -> int:
        key = (stacks, accepting)
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = self._new_state(accepting)
            self._configs.append(stacks)
        return sid

    def stacks(self, state: int) -> frozenset[Stack]:
        return self._configs[state]

    def _expand(self, stacks: Iterable[Stack]) -> tuple[frozenset[Stack], bool]:
        """The stacks ready to read a byte, calls made and ended rules returned from, and
        whether the root rule may end here."""
        items = self.items
        seen: set[Stack] = set()
        ready: set[Stack] = set()
        accepting = False
        work = list(stacks)
        while work:
            st = work.pop()
            if st in seen:
                continue
            seen.add(st)
            if len(seen) > MAX_STACKS:
                raise AutomatonTooLarge(f"the grammar is too ambiguous: over {MAX_STACKS} parses "
                                        "of one prefix at once")
            top = st[-1]
            if items.reads(top):
                ready.add(st)
            for callee, ret in items.calls(top):
                below = st[:-1] if items.only_returns(ret) else (*st[:-1], ret)
                work.append((*below, callee))
            if items.accepting[top]:
                if len(st) == 1:
                    accepting = True
                else:
                    work.append(st[:-1])
        return frozenset(ready), accepting

    def _build_row(self, s: int) -> None:
        stacks = sorted(self._configs[s])
        if not stacks:
            self.table[s] = 0
            self.has_row[s] = True
            return
        tops = np.asarray([st[-1] for st in stacks], dtype=np.int64)
        self.items.ensure_rows(tops)
        moves = self.items.table[tops].T  # [256, stacks]: each byte's next top per stack
        cols, inverse = np.unique(moves, axis=0, return_inverse=True)
        targets = []
        for col in cols.tolist():
            moved = [(*st[:-1], t) for st, t in zip(stacks, col, strict=True) if t]
            targets.append(self._config(*self._expand(moved)) if moved else 0)
        self.table[s] = np.asarray(targets, dtype=np.int32)[inverse.reshape(-1)]
        self.has_row[s] = True
