"""A practical regex subset parsed into a small syntax tree over Unicode code points.

Supported: literals and escapes (``\\n \\t \\xhh \\uhhhh \\Uhhhhhhhh \\N{name}``, any escaped
punctuation), ``.`` (any character but newline, as Python's default), character classes
with ranges and negation, ``\\d \\w \\s`` and their negations (ASCII meanings, as
``re.ASCII``: JSON's digits, not every script's), groups (capturing, named, ``(?:...)``),
alternation, ``* + ?`` (lazy forms too: the language is the same), ``{m} {m,n} {m,} {,n}``,
and ``^`` / ``$`` at the very start / end of the pattern (the whole output must match
anyway). Everything else is a ValueError naming it: backreferences, lookarounds, word
boundaries, inline flags, possessive quantifiers, conditionals.

The tree has four node kinds: ``CharSet`` (sorted disjoint code point ranges), ``Concat``,
``Alt`` and ``Repeat``; ``Concat(())`` is the empty string. Grammars (``grammar.py``) add a
fifth, ``Ref``, a rule's name, which they replace or turn into calls before any automaton.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field

MAX_CODEPOINT = 0x10FFFF
MAX_REPEAT = 10_000  # a bound beyond this is almost surely a mistake, and a huge automaton

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent inclusive ranges


@dataclass(frozen=True)
class CharSet:
    ranges: Ranges


@dataclass(frozen=True)
class Concat:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    node: Node
    min: int
    max: int | None  # None: unbounded


@dataclass(frozen=True)
class Ref:
    """A grammar rule's name where its text goes (``grammar.py``); never made by a regex."""
    name: str
    where: str = field(default="", compare=False)  # "line L, column C" in the grammar


Node = CharSet | Concat | Alt | Repeat | Ref
EMPTY = Concat(())


def normalize(ranges: list[tuple[int, int]]) -> Ranges:
    """Sort and merge overlapping or adjacent ranges."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def negate(ranges: Ranges) -> Ranges:
    """Every code point not in ``ranges`` (normalized input)."""
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return tuple(out)


_DIGIT = normalize([(0x30, 0x39)])
_WORD = normalize([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
_SPACE = normalize([(0x09, 0x0D), (0x20, 0x20)])
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE, "D": negate(_DIGIT),
                  "W": negate(_WORD), "S": negate(_SPACE)}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
ANY_BUT_NEWLINE = negate(((0x0A, 0x0A),))


def literal(text: str) -> Node:
    """The node matching exactly ``text``."""
    return Concat(tuple(CharSet(((ord(c), ord(c)),)) for c in text))


def parse_regex(pattern: str) -> Node:
    """``pattern`` -> its syntax tree; ValueError naming what is wrong or unsupported."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex must be a string, got {type(pattern).__name__}")
    return _Parser(pattern).parse()


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.pos = 0
        self.end = len(pattern)
        if pattern.startswith("^"):
            self.pos = 1
        if self.end > self.pos and pattern.endswith("$") and not _escaped(pattern, self.end - 1):
            self.end -= 1

    def error(self, message: str, at: int | None = None) -> ValueError:
        return ValueError(f"regex {self.p!r}: {message} at position {self.pos if at is None else at}")

    def peek(self) -> str | None:
        return self.p[self.pos] if self.pos < self.end else None

    def take(self) -> str:
        if self.pos >= self.end:
            raise self.error("unexpected end of pattern")
        c = self.p[self.pos]
        self.pos += 1
        return c

    def parse(self) -> Node:
        node = self.alternation()
        if self.pos < self.end:  # only a stray ')' stops an alternation early
            raise self.error("unbalanced parenthesis")
        return node

    def alternation(self) -> Node:
        options = [self.concat()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concat())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def concat(self) -> Node:
        items: list[Node] = []
        while (c := self.peek()) is not None and c not in "|)":
            items.append(self.quantified())
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def quantified(self) -> Node:
        start = self.pos
        node = self.atom()
        quantified = False
        while (q := self.quantifier()) is not None:
            if quantified:
                raise self.error("multiple repeat", start)
            lo, hi = q
            node = Repeat(node, lo, hi)
            quantified = True
            if self.peek() == "?":  # lazy: the same language
                self.pos += 1
            elif self.peek() == "+":
                raise self.error("possessive quantifiers are not supported")
        return node

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if c != "{":
            return None
        close = self.p.find("}", self.pos, self.end)
        body = self.p[self.pos + 1: close] if close != -1 else ""
        lo_s, comma, hi_s = body.partition(",")
        if close == -1 or not (lo_s.isdecimal() or lo_s == "") or not (hi_s.isdecimal() or hi_s == "") \
                or not (lo_s or comma) or not body.isascii():
            return None  # not a quantifier: '{' is a literal, as in Python
        at = self.pos
        self.pos = close + 1
        lo = int(lo_s) if lo_s else 0
        hi = (int(hi_s) if hi_s else None) if comma else lo
        if hi is not None and hi < lo:
            raise self.error("min repeat greater than max repeat", at)
        if max(lo, hi or 0) > MAX_REPEAT:
            raise self.error(f"repeat bounds over {MAX_REPEAT} are not supported", at)
        return lo, hi

    def atom(self) -> Node:
        at = self.pos
        c = self.take()
        if c == "(":
            return self.group(at)
        if c == "[":
            return CharSet(self.char_class())
        if c == ".":
            return CharSet(ANY_BUT_NEWLINE)
        if c == "\\":
            esc = self.escape(in_class=False)
            return CharSet(esc) if isinstance(esc, tuple) else literal(esc)
        if c in "*+?":
            raise self.error("nothing to repeat", at)
        if c == "{" and self.quantifier_here(at):
            raise self.error("nothing to repeat", at)
        if c in "^$":
            raise self.error(f"'{c}' is only supported at the start (^) or end ($) of the pattern", at)
        return literal(c)

    def quantifier_here(self, at: int) -> bool:
        saved = self.pos
        self.pos = at
        try:
            return self.quantifier() is not None
        finally:
            self.pos = saved

    def group(self, at: int) -> Node:
        if self.peek() == "?":
            self.pos += 1
            kind = self.take()
            if kind == ":":
                pass
            elif kind == "P" and self.peek() == "<":
                close = self.p.find(">", self.pos, self.end)
                name = self.p[self.pos + 1: close] if close != -1 else ""
                if not name.isidentifier():
                    raise self.error("bad group name", at)
                self.pos = close + 1
            elif kind == "P" and self.peek() == "=":
                raise self.error("backreferences are not supported", at)
            elif kind in "=!" or (kind == "<" and self.peek() in ("=", "!")):
                raise self.error("lookaround assertions are not supported", at)
            elif kind == ">":
                raise self.error("atomic groups are not supported", at)
            elif kind == "(":
                raise self.error("conditional groups are not supported", at)
            elif kind == "#":
                raise self.error("comments are not supported", at)
            else:
                raise self.error("inline flags and other (?...) extensions are not supported", at)
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ), unterminated subpattern", at)
        self.pos += 1
        return node

    def char_class(self) -> Ranges:
        at = self.pos - 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.pos >= self.end:
                raise self.error("unterminated character set", at)
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            lo = self.class_item(c)
            if isinstance(lo, tuple):  # \d and friends: no range may start here
                if self.peek() == "-" and self.pos + 1 < self.end and self.p[self.pos + 1] != "]":
                    raise self.error("bad character range")
                ranges.extend(lo)
                continue
            if self.peek() == "-" and self.pos + 1 < self.end and self.p[self.pos + 1] != "]":
                self.pos += 1
                hi = self.class_item(self.take())
                if isinstance(hi, tuple) or ord(hi) < ord(lo):
                    raise self.error("bad character range")
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        out = normalize(ranges)
        return negate(out) if negated else out

    def class_item(self, c: str) -> str | Ranges:
        if c != "\\":
            return c
        if self.peek() == "b":  # backspace inside a class
            self.pos += 1
            return "\b"
        return self.escape(in_class=True)

    def escape(self, in_class: bool) -> str | Ranges:
        """After a backslash: one character, or the ranges of a class escape."""
        at = self.pos - 1
        c = self.take()
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES:
            return _CHAR_ESCAPES[c]
        if c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.pos: self.pos + width]
            if len(digits) < width or self.pos + width > self.end or any(
                    d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"incomplete escape \\{c}{digits}", at)
            self.pos += width
            cp = int(digits, 16)
            if cp > MAX_CODEPOINT:
                raise self.error(f"bad escape \\{c}{digits}", at)
            return chr(cp)
        if c == "N":
            close = self.p.find("}", self.pos, self.end)
            if self.peek() != "{" or close == -1:
                raise self.error("missing { in \\N{...}", at)
            name = self.p[self.pos + 1: close]
            try:
                ch = unicodedata.lookup(name)
            except KeyError:
                raise self.error(f"undefined character name {name!r}", at) from None
            self.pos = close + 1
            return ch
        if c == "0":  # up to two more octal digits
            digits = ""
            while len(digits) < 2 and (d := self.peek()) is not None and d in "01234567":
                digits += d
                self.pos += 1
            return chr(int(digits or "0", 8))
        if c.isdigit():
            raise self.error("backreferences are not supported", at)
        if c in "bBAZG" and not in_class:
            raise self.error(f"\\{c} (anchors and word boundaries) is not supported", at)
        if c.isascii() and c.isalnum():
            raise self.error(f"bad escape \\{c}", at)
        return c


def _escaped(pattern: str, i: int) -> bool:
    """Whether pattern[i] is preceded by an odd number of backslashes."""
    n = 0
    while i - n - 1 >= 0 and pattern[i - n - 1] == "\\":
        n += 1
    return n % 2 == 1
