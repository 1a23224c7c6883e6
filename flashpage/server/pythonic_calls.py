"""``pythonic`` tool calls (vLLM's ``--tool-call-parser pythonic``: Llama 3.2, Llama 4, ToolACE
and others): the whole answer is a Python list of calls with keyword arguments,

    [get_weather(city="Paris", unit='c'), get_time(zone=None, opts={"dst": True, "n": [1, 2.5]})]

optionally between Llama 4's ``<|python_start|>`` and ``<|python_end|>``. Read with Python's
own parser (``ast``, never evaluated): each item a call of a plain name, keyword arguments
only, each value a literal (strings in any quote style with their escapes, numbers, True /
False / None, lists, tuples, dicts with string keys, nested; ``-1``), written as JSON
(True -> true, None -> null, a tuple a list) the way the other formats' arguments are
(server/partial_json.py's ``dumps``). Anything else (text around the list, positional
arguments, an argument given twice, ``a.b()``, an f-string, a set) is not a call: the answer is content.

Streamed one argument at a time: a call's header goes out once its name and ``(`` are
written, then each ``key=value`` once the ``,`` or ``)`` after it is (its text parsed alone
by ``ast``, as the whole list will be), and the closing ``}`` with the ``)``. A scanner
finds those commas and parentheses outside strings, comments and brackets; what it cannot
follow stops the stream (the whole answer, read at the end, decides). So the pieces add up
to the non-streamed arguments, and a long string argument goes out whole when it ends.
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import Any

from flashpage.server.partial_json import Members, dumps
from flashpage.server.tool_stream import CallReader, StreamedCall, new_call_id
from flashpage.server.tools import ToolCall, ToolParser

START, END = "<|python_start|>", "<|python_end|>"
_WS = " \t\r\n"
# what matters inside a string: its quote, a backslash (it escapes the next character, a
# newline too, in raw strings as well), a newline (the end of a one-line string: not Python)
_IN_STRING = {q: re.compile(f"[{q}\\\\\n]") for q in "'\""}
_CLOSER = {"(": ")", "[": "]", "{": "}"}


def _parse(source: str) -> ast.expr:
    """Python's reading of an expression; ValueError if it is not one."""
    try:
        with warnings.catch_warnings():  # "\d" in a string: a SyntaxWarning, not our business
            warnings.simplefilter("ignore")
            return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(str(e)) from e


def to_json(node: ast.expr) -> Any:
    """A Python literal's tree as a JSON value (objects as ``Members``); ValueError for
    anything JSON has no value for, or that is not a literal."""
    if isinstance(node, ast.Constant):
        if node.value is None or isinstance(node.value, (str, int, float)):  # bool is an int
            return node.value
    elif (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
          and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        number: float = node.operand.value  # type: ignore[assignment]
        return -number if isinstance(node.op, ast.USub) else number
    elif isinstance(node, (ast.List, ast.Tuple)):
        return [to_json(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        pairs = []
        for k, v in zip(node.keys, node.values, strict=True):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise ValueError("a dict key that is not a string")  # or **other
            pairs.append((k.value, to_json(v)))
        return Members(pairs)
    raise ValueError(f"not a literal: {ast.dump(node)[:60]}")


def literal(text: str) -> Any:
    """``ast.literal_eval``'s reading of text (leading spaces and tabs ignored), as JSON."""
    return to_json(_parse(text.lstrip(" \t")))


def _arguments(call: ast.expr) -> list[tuple[str, Any]]:
    """A call's keyword arguments as (name, JSON value); ValueError if it is not a call of a
    name with keyword arguments only."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.args:
        raise ValueError("not a call of a name with keyword arguments")
    out: list[tuple[str, Any]] = []
    for kw in call.keywords:
        if kw.arg is None or any(kw.arg == k for k, _ in out):  # Python refuses f(a=1, a=2) too
            raise ValueError("**arguments, or an argument given twice")
        out.append((kw.arg, to_json(kw.value)))
    return out


def _unwrap(text: str) -> str:
    body = text.strip()
    if body.startswith(START):
        body = body[len(START):]
    if body.endswith(END):
        body = body[:-len(END)]
    return body.strip()


class PythonicParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = _unwrap(text)
        if not body.startswith("["):
            return text, []
        try:
            tree = _parse(body)
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = [ToolCall(c.func.id, dumps(Members(args)))  # type: ignore[attr-defined]
                     for c in tree.elts for args in [_arguments(c)]]
        except ValueError:
            return text, []
        return None, calls

    def hold(self, text: str) -> int:
        body = text.lstrip()
        if not body:
            return 0  # only whitespace yet: a call may follow
        if body.startswith("[") or body.startswith(START) or START.startswith(body):
            return len(text) - len(body)
        return len(text)

    def reader(self) -> CallReader:
        return _PythonicReader()


def _string_end(text: str, at: int, quote: str, triple: bool) -> tuple[int, int | None]:
    """Reading on from ``at`` inside a string opened with ``quote`` (three of them:
    ``triple``): (where to read on from next time, the index after its closing quote or None
    if the text ends first, or -1 if it is not a string)."""
    while True:
        m = _IN_STRING[quote].search(text, at)
        if m is None:
            return len(text), None
        i, c = m.start(), m.group()
        if c == "\\":
            if i + 1 >= len(text):
                return i, None
            at = i + 2
        elif c == "\n":
            if not triple:
                return i, -1
            at = i + 1
        elif not triple:
            return i + 1, i + 1
        elif text.startswith(quote * 3, i):
            return i + 3, i + 3
        elif len(text) - i < 3 and text[i:] == quote * (len(text) - i):
            return i, None  # the closing quotes may be coming
        else:
            at = i + 1


class _PythonicReader(CallReader):
    """Whitespace, ``<|python_start|>``, ``[``; then calls (a name, ``(``, arguments apart by
    commas, ``)``) apart by commas; ``]``, whitespace, ``<|python_end|>``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0
        self.state = "start"  # start, list, name, args, between, after
        self.tagged = False  # <|python_start|> or <|python_end|> read, in start / after
        self.mark = 0  # where the name or argument being read began
        self.brackets: list[str] = []  # open inside the argument being read
        self.string: tuple[str, bool] | None = None  # the quote (and if tripled) of the string being read
        self.call: StreamedCall | None = None
        self.keys: list[str] = []  # the call's arguments so far
        self.comma = False  # list state: a comma came last

    def feed(self, text: str) -> None:
        while not self.dead and self.pos < len(text):
            if not getattr(self, "_" + self.state)(text):
                return

    def _skip_ws(self, text: str) -> bool:
        while self.pos < len(text) and text[self.pos] in _WS:
            self.pos += 1
        return self.pos < len(text)

    def _tag(self, text: str, tag: str) -> bool | None:
        """Read ``tag`` once where the state allows it: True if read, None if the text may be
        its start, False if not there."""
        if self.tagged:
            return False
        if text.startswith(tag, self.pos):
            self.pos, self.tagged = self.pos + len(tag), True
            return True
        return None if tag.startswith(text[self.pos:]) else False

    # each state reads on: True to go on, False to wait for more text (or dead)
    def _start(self, text: str) -> bool:
        if not self._skip_ws(text):
            return False
        if text[self.pos] == "[":
            self.pos, self.state, self.tagged = self.pos + 1, "list", False
            return True
        got = self._tag(text, START)
        self.dead = got is False
        return bool(got)

    def _list(self, text: str) -> bool:
        if not self._skip_ws(text):
            return False
        c = text[self.pos]
        if c == "]" and self.calls and self.comma:  # [f(), ]
            self.pos, self.state = self.pos + 1, "after"
        elif c.isidentifier():
            self.mark, self.state = self.pos, "name"
        else:
            self.dead = True
        return True

    def _name(self, text: str) -> bool:
        while self.pos < len(text) and (text[self.pos].isidentifier() or text[self.pos].isdigit()):
            self.pos += 1
        if not self._skip_ws(text):
            return False
        if text[self.pos] != "(":
            self.dead = True
            return True
        try:
            node = _parse(text[self.mark:self.pos].strip())
        except ValueError:
            node = None
        if not isinstance(node, ast.Name):
            self.dead = True
            return True
        self.call = StreamedCall(new_call_id(), node.id)
        self.calls.append(self.call)
        self.pos += 1
        self.mark, self.keys, self.brackets, self.state = self.pos, [], [], "args"
        return True

    def _args(self, text: str) -> bool:
        """Up to the next ``,`` or ``)`` outside strings, comments and brackets."""
        while self.pos < len(text):
            if self.string is not None:
                self.pos, end = _string_end(text, self.pos, *self.string)
                if end is None:
                    return False
                self.dead, self.string = end < 0, None
                if self.dead:
                    return True
                continue
            c = text[self.pos]
            if c in "'\"":
                if len(text) - self.pos < 3 and text[self.pos:] == c * (len(text) - self.pos):
                    return False  # "" may be empty or open a triple-quoted string
                triple = text.startswith(c * 3, self.pos)
                self.string, self.pos = (c, triple), self.pos + (3 if triple else 1)
                continue
            if c == "#":
                end = text.find("\n", self.pos)
                if end < 0:
                    return False
                self.pos = end + 1
                continue
            if c in "([{":
                self.brackets.append(c)
            elif c in ")]}" and self.brackets:
                if _CLOSER[self.brackets.pop()] != c:
                    self.dead = True
                    return True
            elif c in ",)]}" and not self.brackets:
                self._argument(text[self.mark:self.pos], closes=c == ")", bad=c in "]}")
                self.pos += 1
                self.mark = self.pos
                return True
            self.pos += 1
        return False

    def _argument(self, source: str, closes: bool, bad: bool) -> None:
        """One argument's text read, before a ``,`` or (``closes``) the call's ``)``."""
        call = self.call
        assert call is not None
        if bad:
            self.dead = True
            return
        if source.strip(_WS):
            try:
                [(key, value)] = _arguments(_parse(f"f({source})"))
            except ValueError:
                self.dead = True
                return
            if key in self.keys:  # f(a=1, a=2): not a call
                self.dead = True
                return
            call.partial += ("{" if not self.keys else ", ") + f"{dumps(key)}: {dumps(value)}"
            self.keys.append(key)
        elif not closes:  # f(,) or f(a=1,,)
            self.dead = True
            return
        if closes:
            call.partial += "}" if self.keys else "{}"
            self.state, self.call = "between", None

    def _between(self, text: str) -> bool:
        if not self._skip_ws(text):
            return False
        c = text[self.pos]
        if c in ",]":
            self.pos += 1
            self.state, self.comma = ("list", True) if c == "," else ("after", False)
        else:
            self.dead = True
        return True

    def _after(self, text: str) -> bool:
        if not self._skip_ws(text):
            return False
        got = self._tag(text, END)
        self.dead = got is False
        return bool(got)
