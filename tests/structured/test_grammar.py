"""Grammars (GBNF and Lark) against recognizers written independently in this file:
random walks through each grammar's automaton produce only strings the recognizer accepts,
random edits of valid strings are judged alike by both, masks over a small vocabulary equal
brute force for a recursive grammar, and bad grammars are errors naming what and where."""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from flashpage.sampling_params import StructuredOutputsError, StructuredOutputsParams
from flashpage.structured.automaton import LazyDFA, TableDFA
from flashpage.structured.compiler import GuideCompiler
from flashpage.structured.grammar import compile_grammar
from flashpage.structured.guide import CompiledGuide, GuideState, TokenIndex
from flashpage.structured.pushdown import PushdownDFA

ARITH = r"""
# arithmetic, + - * / over integers, parentheses nested
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
ARITH_LARK = r"""
start: expr
?expr: term (("+"|"-") term)*   // the same language as ARITH
?term: factor (("*"|"/") factor)*
?factor: INT
       | "(" expr ")"
%import common.INT
"""
JSON_GBNF = r"""
root   ::= value
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ( pair ("," ws pair)* )? "}"
pair   ::= string ":" ws value
array  ::= "[" ( value ("," ws value)* )? "]"
string ::= "\"" ( [^"\\\x00-\x1F] | "\\" ["\\/nt] | "\\u" [0-9a-f]{4} )* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)?
ws     ::= " "?
"""
JSON_LARK = r"""
?start: value
?value: object | array | string
      | SIGNED_NUMBER -> number
      | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""
PARENS = r"""
root ::= pair*
pair ::= "(" pair* ")" | "[" pair* "]"
"""
LIST_GBNF = r"""
root ::= "[" ( item ( sep item )* )? "]"
item ::= [a-z]+ | "'" [^'\n]* "'"
sep  ::= "," " "?
"""
LIST_RE = r"\[(([a-z]+|'[^'\n]*')(, ?([a-z]+|'[^'\n]*'))*)?\]"
LIST_LARK = r"""
start: "[" [item (SEP item)*] "]"
item: /[a-z]+/ | "'" /[^'\n]*/ "'"
SEP: "," " "~0..1
"""


def arith_ok(s: str) -> bool:
    """A recursive-descent recognizer of ARITH's language."""
    pos = 0

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while pos < len(s) and s[pos] in "+-":
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while pos < len(s) and s[pos] in "*/":
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            if not expr() or pos >= len(s) or s[pos] != ")":
                return False
            pos += 1
            return True
        start = pos
        while pos < len(s) and s[pos] in "0123456789":
            pos += 1
        return pos > start

    return expr() and pos == len(s)


_STRING = re.compile(r'"([^"\\\x00-\x1f]|\\["\\/nt]|\\u[0-9a-f]{4})*"')
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")


def json_ok(s: str) -> bool:
    """A recursive-descent recognizer of JSON_GBNF's language (JSON with at most one space
    after ',' and ':', no exponents, lowercase \\u escapes)."""
    pos = 0

    def lit(t: str) -> bool:
        nonlocal pos
        if s.startswith(t, pos):
            pos += len(t)
            return True
        return False

    def token(rx: re.Pattern[str]) -> bool:
        nonlocal pos
        m = rx.match(s, pos)
        if m:
            pos = m.end()
        return m is not None

    def items(close: str, item: Callable[[], bool]) -> bool:
        if lit(close):
            return True
        if not item():
            return False
        while lit(","):
            lit(" ")
            if not item():
                return False
        return lit(close)

    def pair() -> bool:
        if not token(_STRING) or not lit(":"):
            return False
        lit(" ")
        return value()

    def value() -> bool:
        if lit("{"):
            return items("}", pair)
        if lit("["):
            return items("]", value)
        return token(_STRING) or token(_NUMBER) or lit("true") or lit("false") or lit("null")

    return value() and pos == len(s)


_LARK_TOKEN = re.compile(r'[ \t\f\r\n]*(?:("([^"\\\n]|\\.)*")|([+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?)'
                         r'|([][{}:,]|true|false|null))')


def lark_json_ok(s: str) -> bool:
    """JSON_LARK's language: Lark's tokens (ESCAPED_STRING, SIGNED_NUMBER, punctuation),
    whitespace skipped between them, then a recursive descent over the tokens."""
    tokens, pos = [], 0
    while (m := _LARK_TOKEN.match(s, pos)) and m.end() > pos and pos < len(s.rstrip(" \t\f\r\n")):
        tokens.append("s" if m.group(1) else "n" if m.group(3) else m.group(6))
        pos = m.end()
    if s[pos:].strip(" \t\f\r\n"):
        return False
    i = 0

    def value() -> bool:
        nonlocal i
        if i >= len(tokens):
            return False
        t = tokens[i]
        i += 1
        if t in ("s", "n", "true", "false", "null"):
            return True
        if t not in ("[", "{"):
            return False
        close = "]" if t == "[" else "}"
        if i < len(tokens) and tokens[i] == close:
            i += 1
            return True
        while True:
            if close == "}":
                if tokens[i: i + 2] != ["s", ":"]:
                    return False
                i += 2
            if not value() or i >= len(tokens):
                return False
            i += 1
            if tokens[i - 1] == close:
                return True
            if tokens[i - 1] != ",":
                return False

    return value() and i == len(tokens)


def parens_ok(s: str) -> bool:
    stack = []
    for c in s:
        if c in "([":
            stack.append(c)
        elif not stack or stack.pop() + c not in ("()", "[]"):
            return False
    return not stack


def list_ok(s: str) -> bool:
    return re.fullmatch(LIST_RE, s) is not None


CASES: list[tuple[str, str, Callable[[str], bool], type]] = [
    ("arith", ARITH, arith_ok, PushdownDFA),
    ("arith lark", ARITH_LARK, arith_ok, PushdownDFA),
    ("json", JSON_GBNF, json_ok, PushdownDFA),
    ("json lark", JSON_LARK, lark_json_ok, PushdownDFA),
    ("parens", PARENS, parens_ok, PushdownDFA),
    ("list", LIST_GBNF, list_ok, LazyDFA),
    ("list lark", LIST_LARK, list_ok, LazyDFA),
]
VALID = {
    "arith": ["1", "(1+2)*3", "((4))", "12*(3-4)/5", "0/0-0"],
    "arith lark": ["7", "(8)", "1*(2+(3))"],
    "json": ['{"a": [1, -2.5, {"b": null}], "c": "x\\n\\u00e9"}', "[]", '""', "[[[]]]", "-0.5"],
    "json lark": [' { "a" : [ 1 , -2.5e3 , true ] ,"b":null } \n', "[]", '"x\\q"', "[[+.5, 1.]]"],
    "parens": ["", "()", "([])()", "[[(())]]"],
    "list": ["[]", "[a]", "[ab, 'c d',e]", "['']"],
    "list lark": ["[]", "[a,b]", "['x y', z]"],
}


def walk(dfa: TableDFA, rng: random.Random, max_len: int = 40) -> bytes | None:
    """A random byte path from the start that ends in an accepting state, or None."""
    s, out = dfa.start, bytearray()
    for _ in range(max_len):
        if dfa.accepting[s] and rng.random() < 0.25:
            return bytes(out)
        dfa.ensure_rows(np.asarray([s]))
        live = np.flatnonzero(dfa.table[s])
        if live.size == 0:
            break
        ascii_ = live[live < 128]  # mostly ASCII, so the recognizers' corner cases come up
        b = int(rng.choice(ascii_ if ascii_.size and rng.random() < 0.9 else live))
        out.append(b)
        s = dfa.step(s, b)
    return bytes(out) if dfa.accepting[s] else None


@pytest.mark.parametrize("name, text, ok, kind", CASES, ids=[c[0] for c in CASES])
def test_random_walks_are_in_the_language(name, text, ok, kind):
    dfa = compile_grammar(text)
    assert type(dfa) is kind  # recursive grammars run as pushdown automata, the rest inline
    rng = random.Random(0)
    walks = [w for w in (walk(dfa, rng) for _ in range(300)) if w is not None]
    assert len(walks) > 100 and len(set(walks)) > 20, walks[:5]
    for w in walks:
        assert ok(w.decode("utf-8")), (name, w)
    for s in VALID[name]:
        assert dfa.matches(s.encode()), (name, s)


@pytest.mark.parametrize("name, text, ok, kind", CASES, ids=[c[0] for c in CASES])
def test_edited_strings_judged_as_the_recognizer_does(name, text, ok, kind):
    """Valid strings with characters dropped, doubled or swapped in: accepted exactly when
    the recognizer accepts them."""
    dfa = compile_grammar(text)
    rng = random.Random(1)
    alphabet = sorted(set("".join(VALID[name])) | set("()[]{}\",: 'a1-+*/.\n"))
    both = [0, 0]
    for _ in range(400):
        s = list(rng.choice(VALID[name]))
        for _ in range(rng.randint(1, 2)):
            i = rng.randrange(len(s) + 1)
            op = rng.randrange(3)
            if op == 0 and i < len(s):
                del s[i]
            elif op == 1:
                s.insert(i, rng.choice(alphabet))
            elif i < len(s):
                s[i] = rng.choice(alphabet)
        t = "".join(s)
        want = ok(t)
        both[want] += 1
        assert dfa.matches(t.encode()) == want, (name, t)
    assert min(both) > 20  # both verdicts exercised


VOCAB: list[bytes | None] = [None, None, b"(", b")", b"[", b"]", b"()", b"((", b"))", b")(",
                             b"([", b"])", b"[]", b"x", b"(x", None, b"]]", b")]"]
EOS = 1


def parens_viable(s: bytes) -> bool:
    """Whether ``s`` can be completed into PARENS's language."""
    stack = []
    for c in s.decode():
        if c in "([":
            stack.append(c)
        elif c not in ")]" or not stack or stack.pop() + c not in ("()", "[]"):
            return False
    return True


def test_masks_equal_brute_force_for_a_recursive_grammar():
    guide = CompiledGuide(compile_grammar(PARENS), TokenIndex(VOCAB, [EOS]))
    rng = random.Random(2)
    for _ in range(40):
        state, prefix = GuideState(guide), b""
        for _ in range(12):
            want = {i for i, b in enumerate(VOCAB) if b and parens_viable(prefix + b)}
            assert set(guide.allowed(state.state).tolist()) == want, prefix
            mask = set(state.mask(torch.device("cpu")).nonzero().flatten().tolist())
            assert mask == want | ({EOS} if parens_ok(prefix.decode()) else set()), prefix
            t = rng.choice(sorted(want))
            state.advance(t)
            prefix += VOCAB[t] or b""


@pytest.mark.parametrize("text, message", [
    ("root ::= a", r"rule 'a' is used \(in 'root', line 1, column 10\) but not defined"),
    ("expr ::= [0-9]", "no 'root' rule"),
    ("num: /[0-9]+/", "no 'start' rule"),
    ("// only a comment", "no rules"),
    ("root ::= root \"+\" [0-9] | [0-9]", r"'root' is left-recursive \(root -> root"),
    ("root ::= a\na ::= b? \"x\"\nb ::= a \"y\"", r"'a' is left-recursive \(a -> b -> a"),
    ("start: sum\nsum: sum \"+\" NUMBER | NUMBER\n%import common.NUMBER", "'sum' is left-recursive"),
    ("root ::= \"abc", r"unterminated string literal at line 1, column 14"),
    ("root ::= [a-", "unterminated character class"),
    ("root ::= [z-a]", "bad character range"),
    ("root ::= (\"a\" | \"b\"", r"missing '\)'"),
    ("root ::= \"a\"\nroot ::= \"b\"", r"rule 'root' is defined twice \(first at line 1, column 1\)"),
    ("root \"a\"\nb ::= \"c\"", "expected '::=' after rule name 'root'"),
    ("root ::= \"a\"{3,1}", "min greater than max"),
    ("root ::= \"\\q\"", r"bad escape \\q"),
    ("root ::= \"a\" ) \"b\"", r"expected a rule name, found '\)' at line 1, column 14"),
    ("start: \"a\"\n%declare X", "%declare is not supported at line 2"),
    ("start: /a/i", r"regex flags \(i\) are not supported"),
    ("start: /a(?=b)/", "lookaround"),
    ("start: X\n%import common.NOPE", "common.NOPE is not one of"),
    ("start: \"a\" ~ 3..1", "bad repetition"),
])
def test_bad_grammars_are_named_errors(text, message):
    with pytest.raises(StructuredOutputsError, match=message):
        compile_grammar(text)


class _Tokenizer:
    """Just enough of a HF tokenizer for token_bytes: decode() per token."""

    def __init__(self, vocab: list[bytes | None] = VOCAB) -> None:
        self.vocab = vocab
        self.all_special_ids = [i for i, b in enumerate(vocab) if b is None]

    def __len__(self) -> int:
        return len(self.vocab)

    def convert_ids_to_tokens(self, ids):
        return [str(i) for i in ids]

    def decode(self, ids):
        return (self.vocab[ids[0]] or b"").decode()


def test_compiler_takes_grammars_and_names_their_errors():
    compiler = GuideCompiler(_Tokenizer(), len(VOCAB), [EOS])
    g = compiler.compile(StructuredOutputsParams(grammar=PARENS))
    assert compiler.compile(StructuredOutputsParams(grammar=PARENS)) is g
    assert set(g.allowed(g.start).tolist()) == {2, 4, 6, 7, 10, 12}
    with pytest.raises(StructuredOutputsError, match="matches only the empty string"):
        compiler.compile(StructuredOutputsParams(grammar='root ::= ""'))
    with pytest.raises(StructuredOutputsError, match="no token of this tokenizer can begin"):
        compiler.compile(StructuredOutputsParams(grammar='root ::= "{" root? "}"'))
    with pytest.raises(StructuredOutputsError, match="not defined"):
        compiler.compile(StructuredOutputsParams(grammar="root ::= nope"))


def test_lark_syntax_pieces():
    assert compile_grammar('start: "a ::= b"').matches(b"a ::= b")  # Lark, though it has '::='
    dfa = compile_grammar('start: a "-" b\na: "x"i ~ 2\nb: ["q"] ("0".."3")+ -> digits\n'
                          '    | /z+/\n%import common (WS, INT)')
    for s, want in [("xX-q012", True), ("Xx-3", True), ("xx-zz", True), ("xx-", False),
                    ("xxx-1", False), ("xx-q4", False), ("xx-qz", False)]:
        assert dfa.matches(s.encode()) == want, s


def test_right_recursion_does_not_deepen_the_stack():
    """``list ::= item ("," list)?`` returns from every call at once: the configuration
    after each element is the same one, so a long list costs no new states."""
    dfa = compile_grammar('root ::= "[" list "]"\nlist ::= [0-9] ("," list)?')
    assert isinstance(dfa, PushdownDFA)
    s = dfa.walk(dfa.start, b"[1,2")
    n = dfa.num_states
    assert dfa.walk(s, b",3,4,5,6,7,8") == s and dfa.num_states == n
    assert dfa.accepting[dfa.walk(s, b"]")]


def test_too_ambiguous_a_grammar_ends_the_request_not_the_engine():
    """Each 'a' more doubles the ways ``e`` parses: past MAX_STACKS the request's guide
    stops (nothing allowed, so it ends) and nothing raises; a grammar ambiguous from its
    very start is refused when compiled."""
    grammar = 'root ::= e\ne ::= "a" | "a" e e | "a" e "b" e | "a" e "c" e e'
    guide = CompiledGuide(compile_grammar(grammar), TokenIndex([None, None, b"a", b"b", b"c"], [EOS]))
    state = GuideState(guide)
    for _ in range(40):
        if state.is_finished():
            break
        state.advance(2)
    assert state.state == 0 and state.is_finished()
    vocab: list[bytes | None] = [None, None, b"a", b"a" * 40]  # one token past the limit
    with pytest.raises(StructuredOutputsError, match=r"\(grammar\): the grammar is too ambiguous"):
        GuideCompiler(_Tokenizer(vocab), len(vocab), [EOS]).compile(StructuredOutputsParams(grammar=grammar))


def test_a_grammar_too_large_to_inline_runs_as_calls():
    """No recursion, but inlined it would be 4^9 nodes: the large rules stay calls."""
    rules = ['r0 ::= "x" | "yz"'] + [f"r{i} ::= r{i - 1} | r{i - 1} | r{i - 1} | r{i - 1}" for i in range(1, 9)]
    dfa = compile_grammar("root ::= r8 \"!\" r8\n" + "\n".join(rules))
    assert isinstance(dfa, PushdownDFA)
    assert [dfa.matches(s) for s in (b"x!yz", b"yz!x", b"x!", b"xx!x", b"x!y")] == [True, True, False, False, False]
