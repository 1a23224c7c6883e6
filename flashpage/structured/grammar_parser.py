"""GBNF / EBNF text -> rules: name -> syntax tree (``regex_parser``'s nodes, ``Ref`` for a
rule), and the scanner it shares with ``lark_parser.py``.

GBNF / EBNF as llama.cpp and xgrammar write it (vLLM's ``grammar``): ``name ::= body``, the
start rule ``root``; a body is alternatives ``|`` of sequences of ``"literals"`` (or
``'...'``) with escapes ``\\n \\t \\r \\\\ \\" \\xhh \\uhhhh \\Uhhhhhhhh``, classes ``[a-z]`` /
``[^"\\\\]``, ``.`` (any character), rule names and ``( )`` groups, each quantified by
``* + ?`` or ``{m}`` ``{m,}`` ``{m,n}``; ``#`` comments; rules may span lines (a rule ends
where the next ``name ::=`` begins).

Errors are StructuredOutputsError naming what is wrong and where (line, column).
"""

from __future__ import annotations

from flashpage.sampling_params import StructuredOutputsError
from flashpage.structured.regex_parser import (
    EMPTY,
    MAX_CODEPOINT,
    MAX_REPEAT,
    Alt,
    CharSet,
    Concat,
    Node,
    Ref,
    Repeat,
    literal,
    negate,
    normalize,
)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "b": "\b", "0": "\0"}
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
ANY_CHAR = negate(())


class Grammar:
    """Rules by name (in the order written) and the start rule's name."""

    def __init__(self, rules: dict[str, Node], root: str, where: dict[str, str]) -> None:
        self.rules = rules
        self.root = root
        self.where = where  # rule name -> "line L, column C" of its definition


class Scanner:
    """A position in the text, with the shared pieces of both dialects' syntax."""

    comment = "#"

    def __init__(self, text: str) -> None:
        self.t = text
        self.pos = 0
        self.rules: dict[str, tuple[Node, str]] = {}

    def where(self, at: int | None = None) -> str:
        at = self.pos if at is None else at
        line = self.t.count("\n", 0, at) + 1
        col = at - (self.t.rfind("\n", 0, at) + 1) + 1
        return f"line {line}, column {col}"

    def error(self, message: str, at: int | None = None) -> StructuredOutputsError:
        return StructuredOutputsError(f"grammar: {message} at {self.where(at)}")

    def peek(self, k: int = 0) -> str:
        return self.t[self.pos + k] if self.pos + k < len(self.t) else ""

    def skip(self, newlines: bool = True) -> None:
        """Past blanks and comments (and newlines, unless told not to)."""
        while self.pos < len(self.t):
            c = self.t[self.pos]
            if c in " \t\r\f" or (newlines and c == "\n"):
                self.pos += 1
            elif self.t.startswith(self.comment, self.pos):
                end = self.t.find("\n", self.pos)
                self.pos = len(self.t) if end == -1 else end
            else:
                return

    def name(self) -> str:
        start = self.pos
        while self.peek() and self.peek() in NAME_CHARS:
            self.pos += 1
        return self.t[start: self.pos]

    def define(self, name: str, node: Node, at: int) -> None:
        if name in self.rules:
            raise self.error(f"rule '{name}' is defined twice (first at {self.rules[name][1]})", at)
        self.rules[name] = (node, self.where(at))

    def char(self, quote: str) -> str:
        """One character of a literal or class, an escape read."""
        at = self.pos
        c = self.peek()
        if not c or c == "\n":
            raise self.error("unterminated " + ("character class" if quote == "]" else "string literal"), at)
        self.pos += 1
        if c != "\\":
            return c
        e = self.peek()
        self.pos += 1
        if e in _ESCAPES:
            return _ESCAPES[e]
        if e in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[e]
            digits = self.t[self.pos: self.pos + width]
            if len(digits) < width or any(d not in "0123456789abcdefABCDEF" for d in digits) \
                    or int(digits, 16) > MAX_CODEPOINT:
                raise self.error(f"bad escape \\{e}{digits}", at)
            self.pos += width
            return chr(int(digits, 16))
        if not e or e.isalnum():
            raise self.error(f"bad escape \\{e}", at)
        return e

    def string(self) -> str:
        quote = self.peek()
        self.pos += 1
        out = []
        while self.peek() != quote:
            out.append(self.char(quote))
        self.pos += 1
        return "".join(out)

    def char_class(self) -> Node:
        at = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            lo = self.char("]")
            hi = lo
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                hi = self.char("]")
                if ord(hi) < ord(lo):
                    raise self.error(f"bad character range {lo!r}-{hi!r}", at)
            ranges.append((ord(lo), ord(hi)))
        self.pos += 1
        out = normalize(ranges)
        return CharSet(negate(out) if negated else out)

    def braces(self) -> tuple[int, int | None]:
        """``{m}``, ``{m,}``, ``{m,n}`` (the position on the brace)."""
        at = self.pos
        close = self.t.find("}", self.pos)
        body = self.t[self.pos + 1: close].replace(" ", "") if close != -1 else ""
        lo_s, comma, hi_s = body.partition(",")
        if close == -1 or not lo_s.isdecimal() or not (hi_s.isdecimal() or hi_s == ""):
            raise self.error("bad repetition: {m}, {m,} or {m,n}", at)
        lo = int(lo_s)
        hi = (int(hi_s) if hi_s else None) if comma else lo
        if hi is not None and hi < lo:
            raise self.error("bad repetition: min greater than max", at)
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"repeat bounds over {MAX_REPEAT} are not supported", at)
        self.pos = close + 1
        return lo, hi


def seq(items: list[Node]) -> Node:
    return items[0] if len(items) == 1 else Concat(tuple(items))


def alt(options: list[Node]) -> Node:
    return options[0] if len(options) == 1 else Alt(tuple(options))


class GbnfParser(Scanner):
    def parse(self) -> dict[str, tuple[Node, str]]:
        self.skip()
        while self.pos < len(self.t):
            at = self.pos
            name = self.name()
            if not name:
                raise self.error(f"expected a rule name, found {self.peek()!r}")
            self.skip()
            if not self.t.startswith("::=", self.pos):
                raise self.error(f"expected '::=' after rule name '{name}'")
            self.pos += 3
            self.define(name, self.alternation(), at)
            self.skip()
        return self.rules

    def at_rule_start(self) -> bool:
        """Whether a ``name ::=`` begins here (the end of the rule before it)."""
        save = self.pos
        try:
            if not self.name():
                return False
            self.skip()
            return self.t.startswith("::=", self.pos)
        finally:
            self.pos = save

    def alternation(self) -> Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.sequence())
        return alt(options)

    def sequence(self) -> Node:
        items: list[Node] = []
        while True:
            self.skip()
            c = self.peek()
            if c in ("", "|", ")") or self.at_rule_start():
                return seq(items) if items else EMPTY
            items.append(self.quantified())

    def quantified(self) -> Node:
        node = self.atom()
        while True:
            save = self.pos
            self.skip(newlines=False)
            c = self.peek()
            if not c or c not in "*+?{":
                self.pos = save
                return node
            if c == "{":
                lo, hi = self.braces()
            else:
                self.pos += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            node = Repeat(node, lo, hi)

    def atom(self) -> Node:
        at = self.pos
        c = self.peek()
        if c in ('"', "'"):
            return literal(self.string())
        if c == "[":
            return self.char_class()
        if c == ".":
            self.pos += 1
            return CharSet(ANY_CHAR)
        if c == "(":
            self.pos += 1
            node = self.alternation()
            self.skip()
            if self.peek() != ")":
                raise self.error("missing ')' for the '(' here", at)
            self.pos += 1
            return node
        if c in NAME_CHARS:
            return Ref(self.name(), self.where(at))
        raise self.error(f"unexpected {c!r}")


def rule_refs(node: Node) -> list[str]:
    """The rule names ``node`` uses."""
    if isinstance(node, Ref):
        return [node.name]
    if isinstance(node, Concat):
        return [r for item in node.items for r in rule_refs(item)]
    if isinstance(node, Alt):
        return [r for item in node.options for r in rule_refs(item)]
    if isinstance(node, Repeat):
        return rule_refs(node.node)
    return []
