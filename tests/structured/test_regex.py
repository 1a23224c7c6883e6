"""The regex engine against Python's ``re``: random patterns, random strings (and strings
drawn from each pattern's language), the byte-level DFA's verdict equal to
``re.fullmatch(pattern, s, re.ASCII)`` on every one; UTF-8 range splitting by brute
force; unsupported syntax named in the error."""

from __future__ import annotations

import random
import re

import pytest

from flashpage.structured.automaton import AutomatonTooLarge, ByteNFA, LazyDFA
from flashpage.structured.regex_parser import Alt, CharSet, Concat, Node, Repeat, parse_regex
from flashpage.structured.utf8 import utf8_sequences

ALPHABET = "ab0 9-.\n\t\x0b{}é€🙂"  # 1-, 2-, 3- and 4-byte characters; \x0b: \s in ASCII
ATOMS = ["a", "b", "0", r"\.", "-", " ", "é", "🙂", ".", r"\d", r"\w", r"\s", r"\D", r"\W",
         "[ab]", "[^a]", "[0-9-]", "[a-zé]", r"[^\d\s]", "[]a]", r"[\x00-\x7f]", r"\u20ac",
         r"\{", "[.]", r"[^\u00e0-\U0001F600]", "x{"]


def random_pattern(rng: random.Random, depth: int = 3, in_loop: bool = False) -> str:
    """A random pattern. No unbounded loop inside another: Python's backtracking ``re``
    (the reference) takes exponential time on those, not our DFA."""
    kind = rng.randrange(6) if depth > 0 else 0
    if kind <= 1:
        return rng.choice(ATOMS)
    if kind == 2:
        return "".join(random_pattern(rng, depth - 1, in_loop) for _ in range(rng.randint(2, 3)))
    if kind == 3:
        return "(" + "|".join(random_pattern(rng, depth - 1, in_loop)
                              for _ in range(rng.randint(2, 3))) + ")"
    bounded = ["?", "{2}", "{1,3}", "{,2}", "{0,1}", "{1,2}?"]
    q = rng.choice(bounded if in_loop else bounded + ["*", "+", "{2,}", "*?", "+?"])
    inner = random_pattern(rng, depth - 1, in_loop or q not in bounded)
    return f"(?:{inner}){q}"


def sample(node: Node, rng: random.Random, loops: int = 2) -> str:
    """A random string of the node's language (bounded loops)."""
    if isinstance(node, CharSet):
        while True:
            lo, hi = rng.choice(node.ranges)
            cp = rng.randint(lo, min(hi, lo + 300))
            if not 0xD800 <= cp <= 0xDFFF:
                return chr(cp)
    if isinstance(node, Concat):
        return "".join(sample(x, rng, loops) for x in node.items)
    if isinstance(node, Alt):
        return sample(rng.choice(node.options), rng, loops)
    assert isinstance(node, Repeat)
    n = rng.randint(node.min, node.max if node.max is not None else node.min + loops)
    return "".join(sample(node.node, rng, loops) for _ in range(n))


def check(pattern: str, strings: list[str]) -> None:
    dfa = LazyDFA(ByteNFA(parse_regex(pattern)))
    compiled = re.compile(pattern, re.ASCII)
    for s in strings:
        want = compiled.fullmatch(s) is not None
        assert dfa.matches(s.encode()) == want, (pattern, s, want)


@pytest.mark.parametrize("seed", range(40))
def test_random_patterns_agree_with_re(seed):
    rng = random.Random(seed)
    for _ in range(10):
        pattern = random_pattern(rng)
        tree = parse_regex(pattern)
        drawn = [sample(tree, rng) for _ in range(40)]
        assert all(re.fullmatch(pattern, s, re.ASCII) for s in drawn), pattern  # the sampler's own check
        mutated = []
        for s in drawn[:20]:  # near misses: one character inserted, removed or replaced
            i = rng.randint(0, len(s))
            c = rng.choice(ALPHABET)
            mutated += [s[:i] + c + s[i:], s[:i] + s[i + 1:], s[:i] + c + s[i + 1:]]
        noise = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))) for _ in range(100)]
        check(pattern, drawn + mutated + noise + [""])


@pytest.mark.parametrize("pattern", [
    r"\d+", r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?", r"[\w.-]+@\w+\.(com|org)", r"(ab){2,3}",
    r"a{,}", r"a{,2}b", r"x{", r"x{1,a}", r"{}", r"a{ 1}", r"[]a]+", r"[^]]", r"[a-]", r"[-a]",
    r"\x41\u00e9\U0001F642", r"\N{EURO SIGN}", r"\0\012", r"[\b]", r"(?P<year>\d{4})-(\d\d)",
    r"^abc$", r"a\$", r"\\$", r"(a|)+b", r"(?:a*)*", r"(a|ab)(c|bcd)(d*)", r".{3}", r"[^a-c]*",
    r"\S+\s\W", "(yes|no|maybe)", r"[\u00e0-\u00ff]{2}", r"[^\x00-\x7f]+", r"a*?b+?c??",
])
def test_hand_patterns_agree_with_re(pattern):
    rng = random.Random(0)
    tree = parse_regex(pattern)
    strings = [sample(tree, rng) for _ in range(50)]
    strings += ["".join(rng.choice(ALPHABET + "xyzABC$\\]") for _ in range(rng.randint(0, 5)))
                for _ in range(300)]
    check(pattern, strings)


@pytest.mark.parametrize("pattern, message", [
    (r"(a)\1", "backreferences"),
    (r"(?P<x>a)(?P=x)", "backreferences"),
    (r"a(?=b)", "lookaround"),
    (r"a(?!b)", "lookaround"),
    (r"(?<=a)b", "lookaround"),
    (r"(?<!a)b", "lookaround"),
    (r"\bword\b", "anchors and word boundaries"),
    (r"(?i)abc", "inline flags"),
    (r"a*+", "possessive"),
    (r"(?>a)", "atomic"),
    (r"a**", "multiple repeat"),
    (r"*a", "nothing to repeat"),
    (r"{2}", "nothing to repeat"),
    (r"(ab", r"missing \)"),
    (r"ab)", "unbalanced parenthesis"),
    (r"[ab", "unterminated character set"),
    (r"[z-a]", "bad character range"),
    (r"[\d-z]", "bad character range"),
    (r"a{3,1}", "min repeat greater than max repeat"),
    (r"a^b", "only supported at the start"),
    (r"\q", r"bad escape \\q"),
    (r"\x4", "incomplete escape"),
    (r"a{100000}", "repeat bounds over"),
])
def test_unsupported_or_invalid_is_named(pattern, message):
    with pytest.raises(ValueError, match=message):
        parse_regex(pattern)


def test_automaton_size_limits():
    with pytest.raises(AutomatonTooLarge, match="more than 10000 automaton states"):
        ByteNFA(parse_regex(r"(\w{100}){100}"), max_states=10_000)
    # the classic subset-construction blow-up: 2^13 states, found lazily while walking
    dfa = LazyDFA(ByteNFA(parse_regex("(a|b)*a(a|b){12}")), max_states=1000)
    rng = random.Random(0)
    with pytest.raises(AutomatonTooLarge, match="grew past 1000 states"):
        for _ in range(1000):
            dfa.matches("".join(rng.choice("ab") for _ in range(30)).encode())


def test_utf8_sequences_cover_exactly_the_range():
    rng = random.Random(0)
    bounds = [0, 0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x10FFFF]
    cases = [(rng.choice(bounds), rng.choice(bounds)) for _ in range(30)]
    cases += [(a, a + rng.randint(0, 5000)) for a in (rng.randint(0, 0x10FFFF - 5000) for _ in range(30))]
    for lo, hi in cases:
        lo, hi = min(lo, hi), max(lo, hi)
        seqs = utf8_sequences(lo, hi)
        probes = {lo, hi, (lo + hi) // 2} | {rng.randint(lo, hi) for _ in range(200)}
        probes |= {max(0, lo - 1), min(0x10FFFF, hi + 1), 0xD800, 0xE000, 0x7FF, 0x800}
        for cp in probes:
            if 0xD800 <= cp <= 0xDFFF:
                continue
            enc = chr(cp).encode()
            hits = sum(len(s) == len(enc) and all(a <= b <= c for (a, c), b in zip(s, enc, strict=True))
                       for s in seqs)
            assert hits == (1 if lo <= cp <= hi else 0), (lo, hi, cp, seqs)


def test_dfa_runs_over_bytes_of_partial_characters():
    dfa = LazyDFA(ByteNFA(parse_regex("é+")))
    s = dfa.walk(dfa.start, "é".encode()[:1])  # half a character: alive, not accepting
    assert s != 0 and not dfa.accepting[s]
    s = dfa.walk(s, "é".encode()[1:])
    assert dfa.accepting[s]
    assert dfa.walk(s, "é".encode()) != 0
    assert dfa.walk(s, "è".encode()) == 0 and dfa.walk(s, b"\xc3\x28") == 0  # another, invalid
