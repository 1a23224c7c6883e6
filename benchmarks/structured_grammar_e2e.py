"""A batch of requests free, under a recursive JSON grammar (the pushdown guide) and under
json_object (the regex guide): output tokens/s, how many outputs parse as JSON, and the
host time the guides took (mask computation included), per mode.

    python benchmarks/structured_grammar_e2e.py                 # the default model
    python benchmarks/structured_grammar_e2e.py --model DIR --batch 32 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.structured_masks import JSON_GBNF  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args()
    from flashpage import LLM, SamplingParams, StructuredOutputsParams
    from flashpage.structured import guide as guide_mod

    spent = [0.0]
    allowed = guide_mod.CompiledGuide.allowed

    def timed(self, state):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return allowed(self, state)
        finally:
            spent[0] += time.perf_counter() - t0

    guide_mod.CompiledGuide.allowed = timed  # type: ignore[method-assign]
    kw = {"device": args.device} if args.device else {}
    llm = LLM(args.model, **kw) if args.model else LLM(**kw)
    prompts = [[{"role": "user", "content": f"Describe city number {i} as a JSON object with a name, "
                                            "a population and a list of landmarks."}] for i in range(args.batch)]
    modes = {"free": None, "json gbnf (pushdown)": StructuredOutputsParams(grammar=JSON_GBNF),
             "json_object (regex)": StructuredOutputsParams(json_object=True)}
    llm.chat(prompts[:2], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    results = {}
    print(f"{'mode':<22} {'tok/s':>8} {'tokens':>7} {'stop':>5} {'json ok':>8} {'guide host s':>13}")
    for name, spec in modes.items():
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, structured_outputs=spec)
                  for i in range(args.batch)]
        spent[0] = 0.0
        t0 = time.perf_counter()
        outs = [o.outputs[0] for o in llm.chat(prompts, params, use_tqdm=False)]
        wall = time.perf_counter() - t0
        tokens = sum(len(o.token_ids) for o in outs)
        ok = 0
        for o in outs:
            try:
                json.loads(o.text)
                ok += 1
            except ValueError:
                pass
        stops = sum(o.finish_reason == "stop" for o in outs)
        results[name] = {"tok_s": tokens / wall, "tokens": tokens, "stop": stops, "json_ok": ok,
                         "guide_host_s": spent[0], "wall_s": wall}
        print(f"{name:<22} {tokens / wall:>8.0f} {tokens:>7} {stops:>5} {ok:>8} {spent[0]:>13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
