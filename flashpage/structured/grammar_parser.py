"""Grammar text -> rules: name -> syntax tree (``regex_parser``'s nodes, ``Ref`` for a rule).

Two dialects, told apart by ``::=``:

- GBNF / EBNF as llama.cpp and xgrammar write it (vLLM's ``grammar``): ``name ::= body``,
  the start rule ``root``; a body is alternatives ``|`` of sequences of ``"literals"``
  (or ``'...'``) with escapes ``\\n \\t \\r \\\\ \\" \\xhh \\uhhhh \\Uhhhhhhhh``, classes
  ``[a-z]`` / ``[^"\\\\]``, ``.`` (any character), rule names and ``( )`` groups, each
  quantified by ``* + ?`` or ``{m}`` ``{m,}`` ``{m,n}``; ``#`` comments; rules may span lines
  (a rule ends where the next ``name ::=`` begins).
- Lark's basic syntax (outlines' CFGs): ``name: body`` (``?name`` / ``!name`` / ``name.2``
  read as ``name``), the start rule ``start``; terminals (UPPERCASE names) are rules too;
  ``"literal"`` (``"..."i`` case-insensitive), ``/regex/`` (no flags), ``"a".."z"``,
  ``[optional]``, ``( )``, ``* + ?``, ``~ n`` / ``~ n..m``, ``-> alias`` (ignored), ``//``
  comments, a rule continued on the next line by a leading ``|``; ``%import common.NAME``
  (or ``common (A, B)``) for Lark's common terminals. ``%ignore`` is refused: whitespace
  between terminals has to be written into the rules.

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
    parse_regex,
)

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "b": "\b", "0": "\0"}
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
ANY_CHAR = negate(())

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


class Grammar:
    """Rules by name (in the order written) and the start rule's name."""

    def __init__(self, rules: dict[str, Node], root: str, where: dict[str, str]) -> None:
        self.rules = rules
        self.root = root
        self.where = where  # rule name -> "line L, column C" of its definition


def parse_grammar(text: str) -> Grammar:
    """GBNF (if the text has ``::=``) or Lark -> a Grammar whose start rule exists."""
    if not isinstance(text, str):
        raise StructuredOutputsError(f"structured outputs: grammar must be a string, got {text!r}")
    if "::=" in text:
        g = _GbnfParser(text).parse()
        root, dialect = "root", "GBNF"
    else:
        g = _LarkParser(text).parse()
        root, dialect = "start", "Lark"
    if not g:
        raise StructuredOutputsError(f"grammar: no rules (a {dialect} grammar needs a '{root}' rule)")
    if root not in g:
        raise StructuredOutputsError(f"grammar: no '{root}' rule (the {dialect} grammar starts there)")
    rules = {name: node for name, (node, _) in g.items()}
    return Grammar(rules, root, {name: at for name, (_, at) in g.items()})


class _Scanner:
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
        while self.peek() and self.peek() in _NAME_CHARS:
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


def _seq(items: list[Node]) -> Node:
    return items[0] if len(items) == 1 else Concat(tuple(items))


def _alt(options: list[Node]) -> Node:
    return options[0] if len(options) == 1 else Alt(tuple(options))


class _GbnfParser(_Scanner):
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
        return _alt(options)

    def sequence(self) -> Node:
        items: list[Node] = []
        while True:
            self.skip()
            c = self.peek()
            if c in ("", "|", ")") or self.at_rule_start():
                return _seq(items) if items else EMPTY
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
        if c in _NAME_CHARS:
            return Ref(self.name(), self.where(at))
        raise self.error(f"unexpected {c!r}")


class _LarkParser(_Scanner):
    comment = "//"

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.depth = 0  # inside ( ) or [ ]: newlines are blanks there
        self.imports: list[tuple[str, str, int]] = []  # (common name, local name, position)

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
                self.define(name, self.expansions(), at)
            self.skip(newlines=False)
            if self.pos < len(self.t) and self.peek() != "\n":
                raise self.error(f"unexpected {self.peek()!r}")
            self.skip()
        self.add_imports()
        return self.rules

    def directive(self) -> None:
        at = self.pos
        self.pos += 1
        word = self.name()
        self.skip(newlines=False)
        if word != "import":
            what = "%ignore (write the whitespace into the rules instead)" if word == "ignore" else f"%{word}"
            raise self.error(f"{what} is not supported", at)
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
        common = _LarkParser(_LARK_COMMON).parse()
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
        return _alt(options)

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
                return _seq(items) if items else EMPTY
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
            return node if c == "(" else Repeat(node, 0, 1)
        if c == '"':
            text = self.string()
            if self.t.startswith("..", self.pos) and self.peek(2) == '"':
                self.pos += 2
                end = self.string()
                if len(text) != 1 or len(end) != 1 or end < text:
                    raise self.error("a range is two single characters, the first not after the second", at)
                return CharSet(((ord(text), ord(end)),))
            if self.peek() == "i" and self.peek(1) not in _NAME_CHARS:
                self.pos += 1
                return Concat(tuple(CharSet(normalize([(ord(x), ord(x)) for x in {ch, ch.lower(), ch.upper()}
                                                       if len(x) == 1])) for ch in text))
            return literal(text)
        if c == "/":
            return self.regexp()
        if c and c in _NAME_CHARS:
            return Ref(self.name(), self.where(at))
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
