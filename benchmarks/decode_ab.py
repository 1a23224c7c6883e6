"""A/B of decode-step switches on one engine, same machine, alternating.

Machine-to-machine spread on the device pool is a few percent, as large as what a
kernel switch is worth, so switches are compared inside one process: the engine is
built once (random weights of --config), then for each round and each setting the
FLASHPAGE_* variables are set, the decode CUDA graphs re-captured (PDL is fixed at
capture), and one request of --input-len / --output-len tokens is
timed as `flashpage bench latency` times it (decode tok/s = (output - 1) / (total - TTFT)).

    python3 benchmarks/decode_ab.py --config llama-3-8b --gpu-memory-utilization 0.6 \\
        --max-num-seqs 8 --setting base= --setting pdl=FLASHPAGE_PDL=1 \\
        --setting all=FLASHPAGE_PDL=1 --json-out $OUT/decode_ab.json

A setting is NAME=VAR=VALUE[;VAR=VALUE...]; "NAME=" is the defaults. Variables a setting
does not name are unset (the SWITCHES below; one read only at start-up, FLASHPAGE_FUSED_MOE
or FLASHPAGE_SKINNY_GEMM, keeps its start-up value).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SWITCHES = ("FLASHPAGE_PDL", "FLASHPAGE_FUSED_MOE", "FLASHPAGE_SKINNY_GEMM", "FLASHPAGE_GEMV",
            "FLASHPAGE_FUSED_MERGE", "FLASHPAGE_GEMV_WHOLE_ROW", "FLASHPAGE_FUSED_ROUTER",
            "FLASHPAGE_DECODE_WARP_SPLIT")


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition("=")
    env = {}
    for item in filter(None, rest.split(";")):
        var, eq, val = item.partition("=")
        if not eq or not var.startswith("FLASHPAGE_"):
            raise SystemExit(f"--setting {text!r}: expected NAME=FLASHPAGE_VAR=VALUE[;...]")
        env[var] = val
    return name, env


def main() -> int:
    import torch

    from flashpage.bench.common import (
        bench_parser,
        build_bench_llm,
        make_workload,
        result_header,
        sync,
    )
    from flashpage.sampling_params import SamplingParams

    p = bench_parser("decode_ab.py", __doc__)
    p.add_argument("--setting", action="append", default=[], help="NAME=VAR=VALUE[;...] (repeat)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    args = p.parse_args()
    settings = [parse_setting(s) for s in args.setting] or [("base", {})]
    llm, config = build_bench_llm(args)
    engine = llm.engine
    runner = engine.runner
    wl = make_workload(args.batch_size, (args.input_len, args.input_len),
                       (args.output_len, args.output_len), engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=False)
    max_bs = runner.graphs.max_bs if runner.graphs is not None else None
    results: dict[str, list[float]] = {name: [] for name, _ in settings}
    for rnd in range(args.rounds):
        for name, env in settings:
            for var in SWITCHES:
                os.environ.pop(var, None)
            os.environ.update(env)
            if max_bs is not None:
                runner.graphs = None
                torch.cuda.empty_cache()
                runner.capture_decode_graphs(max_bs, engine.max_model_len)
            llm.generate(wl.prompts, SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False),
                         use_tqdm=False)
            for _ in range(args.iters):
                sync(engine.device)
                t0 = time.perf_counter()
                outs = llm.generate(wl.prompts, params, use_tqdm=False)
                sync(engine.device)
                total = time.perf_counter() - t0
                ttft = outs[0].metrics.ttft if outs[0].metrics and outs[0].metrics.ttft else 0.0
                results[name].append(args.batch_size * (args.output_len - 1) / max(total - ttft, 1e-9))
            print(f"round {rnd} {name:>12}: decode "
                  f"{statistics.median(results[name][-args.iters:]):.1f} tok/s", flush=True)
    out = {**result_header("decode_ab", engine, config, args),
           "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
           "settings": {name: {"env": env, "decode_tok_per_s": results[name],
                               "median": statistics.median(results[name])} for name, env in settings}}
    for name, _ in settings:
        print(f"{name:>12}: median {out['settings'][name]['median']:.1f} tok/s over "
              f"{len(results[name])} runs")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
