"""Lark's basic grammar syntax (outlines' CFGs) -> rules, as ``grammar_parser.py`` reads GBNF.

``name: body`` (``?name`` / ``!name`` / ``name.2`` read as ``name``), the start rule
``start``; terminals (UPPERCASE names) are rules too; ``"literal"`` (``"..."i``
case-insensitive), ``/regex/`` (no flags), ``"a".."z"``, ``[optional]``, ``( )``, ``* + ?``,
``~ n`` / ``~ n..m``, ``-> alias`` (ignored), ``//`` comments, a rule continued on the next
line by a leading ``|``; ``%import common.NAME`` (or ``common (A, B)``) for Lark's common
terminals; ``%ignore X`` lets ``X*`` come before every terminal a rule uses (a literal, a
/regex/, a TERMINAL) and at the end, which is where Lark's lexer skips it. Lark's lexer is
not otherwise modelled: a terminal is matched as its characters, not as the longest token.
"""

from __future__ import annotations

import re

from flashpage.structured.grammar_parser import NAME_CHARS, Scanner, alt, rule_refs, seq
from flashpage.structured.regex_parser import (
    EMPTY,
    MAX_REPEAT,
    CharSet,
    Concat,
    Node,
    Ref,
    Repeat,
    literal,
    normalize,
    parse_regex,
)

IGNORE = "%ignore"  # the rule %ignore's terminals make (a name no grammar can write)


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


# Lark's common.lark terminals that %import can name (ESCAPED_STRING without its lookbehind).
_LARK_COMMON = r"""
DIGIT: "0".."9"
HEXDIGIT: "a".."f" | "A".."F" | DIGIT
INT: DIGIT+
SIGNED_INT: ["+"|"-"] INT
DECIMAL: INT "." INT? | "." INT
_EXP: ("e"|"E") SIGNED_INT
FLOAT: INT _EXP | DECIMAL _EXP?
SIGNED_FLOAT: ["+"|"-"] FLOAT
NUMBER: FLOAT | INT
SIGNED_NUMBER: ["+"|"-"] NUMBER
ESCAPED_STRING: /"([^"\\\n]|\\.)*"/
LCASE_LETTER: "a".."z"
UCASE_LETTER: "A".."Z"
LETTER: UCASE_LETTER | LCASE_LETTER
WORD: LETTER+
CNAME: ("_"|LETTER) ("_"|LETTER|DIGIT)*
WS_INLINE: (" "|/\t/)+
WS: /[ \t\f\r\n]/+
CR: /\r/
LF: /\n/
NEWLINE: (CR? LF)+
"""


class LarkParser(Scanner):
    comment = "//"

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.depth = 0  # inside ( ) or [ ]: newlines are blanks there
        self.imports: list[tuple[str, str, int]] = []  # (common name, local name, position)
        # %ignore X: X* may come before every terminal a rule uses, and at the very end
        self.ignoring = re.search(r"^[ \t]*%ignore\b", text, re.M) is not None
        self.ignored: list[Node] = []
        self.in_rule = False  # parsing a rule's body (not a terminal's): its terminals take X*

    def parse(self) -> dict[str, tuple[Node, str]]:
        self.skip()
        while self.pos < len(self.t):
            at = self.pos
            if self.peek() == "%":
                self.directive()
            else:
                if self.peek() in ("?", "!"):
                    self.pos += 1
                name = self.name()
                if not name or name[0].isdigit() or "-" in name:
                    raise self.error(f"expected a rule or terminal name, found {self.peek()!r}")
                if self.peek() == ".":  # a priority: the language is the same
                    self.pos += 1
                    self.skip(newlines=False)
                    if self.peek() == "-":
                        self.pos += 1
                    if not self.name().isdecimal():
                        raise self.error("expected a priority number after '.'")
                self.skip(newlines=False)
                if self.peek() != ":":
                    raise self.error(f"expected ':' after '{name}'")
                self.pos += 1
                self.in_rule = not _is_terminal(name)
                self.define(name, self.expansions(), at)
            self.skip(newlines=False)
            if self.pos < len(self.t) and self.peek() != "\n":
                raise self.error(f"unexpected {self.peek()!r}")
            self.skip()
        self.add_imports()
        if self.ignored:
            self.rules[IGNORE] = (Repeat(alt(self.ignored), 0, None), "%ignore")
            if "start" in self.rules:
                node, where = self.rules["start"]
                self.rules["start"] = (Concat((node, Ref(IGNORE))), where)
        return self.rules

    def directive(self) -> None:
        at = self.pos
        self.pos += 1
        word = self.name()
        self.skip(newlines=False)
        if word == "ignore":
            self.in_rule = False
            self.ignored.append(self.expansions())
            return
        if word != "import":
            raise self.error(f"%{word} is not supported", at)
        path = self.name()
        self.skip(newlines=False)
        names: list[tuple[str, str]] = []
        if self.peek() == ".":
            self.pos += 1
            name = self.name()
            self.skip(newlines=False)
            alias = name
            if self.t.startswith("->", self.pos):
                self.pos += 2
                self.skip(newlines=False)
                alias = self.name()
            names.append((name, alias))
        elif self.peek() == "(":
            self.pos += 1
            while True:
                self.skip()
                name = self.name()
                if not name:
                    raise self.error("expected a name in %import ( ... )")
                names.append((name, name))
                self.skip()
                if self.peek() == ")":
                    self.pos += 1
                    break
                if self.peek() != ",":
                    raise self.error("expected ',' or ')' in %import ( ... )")
                self.pos += 1
        if path != "common" or not names:
            raise self.error("only %import common.NAME (Lark's common terminals) is supported", at)
        self.imports.extend((n, a, at) for n, a in names)

    def add_imports(self) -> None:
        if not self.imports:
            return
        common = LarkParser(_LARK_COMMON).parse()
        todo = []
        for name, alias, at in self.imports:
            if name not in common:
                raise self.error(f"common.{name} is not one of the terminals flashpage knows", at)
            self.define(alias, common[name][0], at)
            todo.append(common[name][0])
        while todo:  # the common terminals they use, unless the grammar defines its own
            node = todo.pop()
            for ref in rule_refs(node):
                if ref not in self.rules:
                    self.rules[ref] = (common[ref][0], "Lark's common.lark")
                    todo.append(common[ref][0])

    def skip_inline(self) -> None:
        """Past blanks; past a newline only inside brackets or before a continuing '|'."""
        self.skip(newlines=self.depth > 0)
        if self.peek() == "\n":
            save = self.pos
            self.skip()
            if self.peek() != "|":
                self.pos = save

    def expansions(self) -> Node:
        options = [self.expansion()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.expansion())
        return alt(options)

    def expansion(self) -> Node:
        items: list[Node] = []
        while True:
            self.skip_inline()
            c = self.peek()
            if self.t.startswith("->", self.pos):  # an alias names the tree node: no effect here
                self.pos += 2
                self.skip(newlines=False)
                if not self.name():
                    raise self.error("expected a name after '->'")
                self.skip_inline()
                c = self.peek()
            if c in ("", "\n", "|", ")", "]"):
                return seq(items) if items else EMPTY
            items.append(self.quantified())

    def quantified(self) -> Node:
        node = self.atom()
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.pos += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
                node = Repeat(node, lo, hi)
                continue
            save = self.pos
            self.skip(newlines=False)
            if self.peek() != "~":
                self.pos = save
                return node
            at = self.pos
            self.pos += 1
            self.skip(newlines=False)
            lo_s = self.name()
            hi_s = lo_s
            if self.t.startswith("..", self.pos):
                self.pos += 2
                hi_s = self.name()
            if not lo_s.isdecimal() or not hi_s.isdecimal() or int(hi_s) < int(lo_s):
                raise self.error("bad repetition: '~ n' or '~ n..m'", at)
            if int(hi_s) > MAX_REPEAT:
                raise self.error(f"repeat bounds over {MAX_REPEAT} are not supported", at)
            node = Repeat(node, int(lo_s), int(hi_s))

    def atom(self) -> Node:
        at = self.pos
        node, terminal = self.bare_atom()
        if terminal and self.in_rule and self.ignoring:
            return Concat((Ref(IGNORE, self.where(at)), node))
        return node

    def bare_atom(self) -> tuple[Node, bool]:
        """The next atom, and whether it is a terminal (a literal, a regex, a TERMINAL)."""
        at = self.pos
        c = self.peek()
        if c in ("(", "["):
            self.pos += 1
            self.depth += 1
            node = self.expansions()
            self.skip()
            self.depth -= 1
            close = ")" if c == "(" else "]"
            if self.peek() != close:
                raise self.error(f"missing '{close}' for the '{c}' here", at)
            self.pos += 1
            return (node if c == "(" else Repeat(node, 0, 1)), False
        if c == '"':
            text = self.string()
            if self.t.startswith("..", self.pos) and self.peek(2) == '"':
                self.pos += 2
                end = self.string()
                if len(text) != 1 or len(end) != 1 or end < text:
                    raise self.error("a range is two single characters, the first not after the second", at)
                return CharSet(((ord(text), ord(end)),)), True
            if self.peek() == "i" and self.peek(1) not in NAME_CHARS:
                self.pos += 1
                return Concat(tuple(CharSet(normalize([(ord(x), ord(x)) for x in {ch, ch.lower(), ch.upper()}
                                                       if len(x) == 1])) for ch in text)), True
            return literal(text), True
        if c == "/":
            return self.regexp(), True
        if c and c in NAME_CHARS:
            name = self.name()
            return Ref(name, self.where(at)), _is_terminal(name)
        raise self.error(f"unexpected {c!r}")

    def regexp(self) -> Node:
        at = self.pos
        self.pos += 1
        start = self.pos
        while self.peek() != "/":
            if self.peek() in ("", "\n"):
                raise self.error("unterminated /regex/", at)
            self.pos += 2 if self.peek() == "\\" else 1
        pattern = self.t[start: self.pos].replace("\\/", "/")
        self.pos += 1
        flags = self.name()
        if flags:
            raise self.error(f"regex flags ({flags}) are not supported", at)
        try:
            return parse_regex(pattern)
        except ValueError as e:
            raise self.error(str(e), at) from None
