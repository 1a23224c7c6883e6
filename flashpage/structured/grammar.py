"""A grammar's text -> the byte automaton its guide walks.

``grammar_parser.py`` (GBNF, told by a line starting ``name ::=``) or ``lark_parser.py`` reads the text
into rules; here they are checked (every name used is
defined; no left recursion) and compiled one of two ways:

- no rule reaches itself: every reference is replaced by its rule's body, giving one regex
  tree, and the regex machinery (``automaton.LazyDFA``) takes it as it is: exact, and as
  cheap as the regex it spells;
- recursive (or too large once inlined): ``pushdown.PushdownDFA``, whose states are the
  pushdown configurations the output reaches (same interface, exact too). Rules on no
  cycle are still inlined where they are used, so only the start rule and the recursive
  ones are calls: fewer and shorter stacks, fewer configurations to walk the vocabulary
  from.

Both end where the start rule (``root`` / ``start``) may end: eos is allowed there only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from flashpage.sampling_params import StructuredOutputsError
from flashpage.structured.automaton import ByteNFA, LazyDFA, TableDFA
from flashpage.structured.grammar_parser import GbnfParser, Grammar, rule_refs
from flashpage.structured.lark_parser import LarkParser
from flashpage.structured.pushdown import GrammarNFA, ItemDFA, PushdownDFA
from flashpage.structured.regex_parser import Alt, CharSet, Concat, Node, Ref, Repeat

_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.M)  # a line starting "name ::="
MAX_INLINE_SIZE = 20_000  # nodes (repeats counted out) past which a grammar is not inlined


def parse_grammar(text: str) -> Grammar:
    """GBNF (if a line starts ``name ::=``) or Lark -> a Grammar whose start rule exists."""
    if not isinstance(text, str):
        raise StructuredOutputsError(f"structured outputs: grammar must be a string, got {text!r}")
    if _GBNF_RULE.search(text):
        g = GbnfParser(text).parse()
        root, dialect = "root", "GBNF"
    else:
        g = LarkParser(text).parse()
        root, dialect = "start", "Lark"
    if not g:
        raise StructuredOutputsError(f"grammar: no rules (a {dialect} grammar needs a '{root}' rule)")
    if root not in g:
        raise StructuredOutputsError(f"grammar: no '{root}' rule (the {dialect} grammar starts there)")
    rules = {name: node for name, (node, _) in g.items()}
    return Grammar(rules, root, {name: at for name, (_, at) in g.items()})


def compile_grammar(text: str) -> TableDFA:
    """The automaton of a GBNF or Lark grammar; StructuredOutputsError naming what is wrong."""
    g = parse_grammar(text)
    for name, node in g.rules.items():
        for ref in _find_refs(node):
            if ref.name not in g.rules:
                raise StructuredOutputsError(
                    f"grammar: rule '{ref.name}' is used (in '{name}', {ref.where}) but not defined")
    order = _reachable(g)
    sizes: dict[str, int] = {}
    none: frozenset[str] = frozenset()
    if _cycle(g, order, lambda n: rule_refs(g.rules[n])) is None and _size(g, g.root, sizes, none) <= MAX_INLINE_SIZE:
        return LazyDFA(ByteNFA(_inline(g, g.root, {}, none)))
    nullable = _nullable(g)
    left = _cycle(g, order, lambda n: sorted(_first_refs(g.rules[n], nullable)))
    if left is not None:
        raise StructuredOutputsError(
            f"grammar: rule '{left[0]}' is left-recursive ({' -> '.join(left)} before any "
            "character is read); rewrite it with repetition, e.g. expr ::= term (\"+\" term)*")
    # Rules on no cycle are inlined where they are used (fewer calls: fewer, shorter stacks),
    # unless large; the start rule and the recursive ones stay rules.
    keep = {n for n in order if _reaches_itself(g, n)} | {g.root}
    sizes = {}
    keep |= {n for n in order if n not in keep and _size(g, n, sizes, frozenset(keep)) > MAX_INLINE_SIZE // 10}
    kept = frozenset(keep)
    calls = [n for n in order if n in kept]
    memo: dict[str, Node] = {}
    index = {name: i for i, name in enumerate(calls)}
    bodies = [_inline_node(g, g.rules[n], memo, kept) for n in calls]
    return PushdownDFA(ItemDFA(GrammarNFA(bodies, index)))


def _find_refs(node: Node) -> list[Ref]:
    if isinstance(node, Ref):
        return [node]
    if isinstance(node, Concat | Alt):
        return [r for item in (node.items if isinstance(node, Concat) else node.options)
                for r in _find_refs(item)]
    if isinstance(node, Repeat):
        return _find_refs(node.node)
    return []


def _reachable(g: Grammar) -> list[str]:
    """The rules the start rule reaches, the start rule first."""
    order, seen = [g.root], {g.root}
    for name in order:
        for ref in rule_refs(g.rules[name]):
            if ref not in seen:
                seen.add(ref)
                order.append(ref)
    return order


def _cycle(g: Grammar, order: list[str], edges: Callable[[str], Iterable[str]]) -> list[str] | None:
    """A path ``a -> ... -> a`` through ``edges`` (name -> names), or None."""
    color: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in order:
        if root in color:
            continue
        path: list[str] = [root]
        stack = [iter(edges(root))]
        color[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                color[path.pop()] = 2
                stack.pop()
            elif color.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            elif nxt not in color:
                color[nxt] = 1
                path.append(nxt)
                stack.append(iter(edges(nxt)))
    return None


def _reaches_itself(g: Grammar, name: str) -> bool:
    seen: set[str] = set()
    todo = rule_refs(g.rules[name])
    while todo:
        n = todo.pop()
        if n == name:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(rule_refs(g.rules[n]))
    return False


def _size(g: Grammar, name: str, memo: dict[str, int], keep: frozenset[str]) -> int:
    """How many nodes ``name`` inlines into (repeats counted out); ``keep``: rules that stay
    references (1 node each)."""
    if name not in memo:
        memo[name] = _node_size(g, g.rules[name], memo, keep)
    return memo[name]


def _node_size(g: Grammar, node: Node, memo: dict[str, int], keep: frozenset[str]) -> int:
    if isinstance(node, Ref):
        return 1 if node.name in keep else _size(g, node.name, memo, keep)
    if isinstance(node, Concat):
        return 1 + sum(_node_size(g, n, memo, keep) for n in node.items)
    if isinstance(node, Alt):
        return 1 + sum(_node_size(g, n, memo, keep) for n in node.options)
    if isinstance(node, Repeat):
        return 1 + _node_size(g, node.node, memo, keep) * max(1, node.min, node.max or 0)
    return 1


def _inline(g: Grammar, name: str, memo: dict[str, Node], keep: frozenset[str]) -> Node:
    if name not in memo:
        memo[name] = _inline_node(g, g.rules[name], memo, keep)
    return memo[name]


def _inline_node(g: Grammar, node: Node, memo: dict[str, Node], keep: frozenset[str]) -> Node:
    """``node`` with every reference to a rule not in ``keep`` replaced by its body."""
    if isinstance(node, Ref):
        return node if node.name in keep else _inline(g, node.name, memo, keep)
    if isinstance(node, Concat):
        return Concat(tuple(_inline_node(g, n, memo, keep) for n in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(_inline_node(g, n, memo, keep) for n in node.options))
    if isinstance(node, Repeat):
        return Repeat(_inline_node(g, node.node, memo, keep), node.min, node.max)
    return node


def _nullable(g: Grammar) -> set[str]:
    """The rules that can match the empty string."""
    out: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, node in g.rules.items():
            if name not in out and _node_nullable(node, out):
                out.add(name)
                changed = True
    return out


def _node_nullable(node: Node, nullable: set[str]) -> bool:
    if isinstance(node, Ref):
        return node.name in nullable
    if isinstance(node, CharSet):
        return False
    if isinstance(node, Concat):
        return all(_node_nullable(n, nullable) for n in node.items)
    if isinstance(node, Alt):
        return any(_node_nullable(n, nullable) for n in node.options)
    return node.min == 0 or _node_nullable(node.node, nullable)


def _first_refs(node: Node, nullable: set[str]) -> set[str]:
    """The rules ``node`` may call before reading a character."""
    if isinstance(node, Ref):
        return {node.name}
    if isinstance(node, Concat):
        out: set[str] = set()
        for n in node.items:
            out |= _first_refs(n, nullable)
            if not _node_nullable(n, nullable):
                break
        return out
    if isinstance(node, Alt):
        return set().union(*(_first_refs(n, nullable) for n in node.options))
    if isinstance(node, Repeat):
        return _first_refs(node.node, nullable) if node.max != 0 else set()
    return set()
