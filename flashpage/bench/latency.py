"""`flashpage bench latency`: one request (default 128 prompt tokens, 128 output tokens),
decode tokens/s and time to first token, beside transformers' generate on the same
prompt in the same run and the weight-read limit (copy bandwidth / weight bytes).
"""

from __future__ import annotations

import statistics
import time

import torch

from flashpage.bench.common import (
    bench_parser,
    build_bench_llm,
    hf_model,
    make_workload,
    result_header,
    sync,
    weight_bytes,
    write_json,
)
from flashpage.bench.throughput import measure_ceilings


def main(argv: list[str] | None = None) -> int:
    from flashpage.sampling_params import SamplingParams

    p = bench_parser("flashpage bench latency", __doc__)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    llm, config = build_bench_llm(args)
    engine = llm.engine
    wl = make_workload(args.batch_size, (args.input_len, args.input_len),
                       (args.output_len, args.output_len), engine.model_config.vocab_size, avoid=engine.placeholder_token_ids())
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=False)
    llm.generate(wl.prompts, SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    runs, ttfts = [], []
    for _ in range(args.iters):
        sync(engine.device)
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        sync(engine.device)
        runs.append(time.perf_counter() - t0)
        m = outs[0].metrics
        if m is not None and m.ttft is not None:
            ttfts.append(m.ttft)
    total = statistics.median(runs)
    ttft = statistics.median(ttfts) if ttfts else 0.0
    decode_tps = args.batch_size * (args.output_len - 1) / max(total - ttft, 1e-9)
    result = {
        **result_header("latency", engine, config, args),
        "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
        "flashpage": {"seconds": total, "ttft_s": ttft, "decode_tok_per_s": decode_tps,
                      "output_tok_per_s": args.batch_size * args.output_len / total},
    }
    bw, _ = measure_ceilings(engine.device)
    if bw:
        wb = weight_bytes(engine.model, tokens=args.batch_size)  # MoE: the routed experts read
        result["weight_read_limit_tok_per_s"] = args.batch_size * bw / wb
        result["fraction_of_limit"] = decode_tps / result["weight_read_limit_tok_per_s"]
        result["copy_GBps"] = bw / 1e9
    if args.hf:
        model = hf_model(engine)
        model.generation_config.eos_token_id = None
        ids = torch.tensor(wl.prompts, device=engine.device)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
            hf_runs = []
            for _ in range(args.iters):
                sync(engine.device)
                t0 = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                               min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
                sync(engine.device)
                hf_runs.append(time.perf_counter() - t0)
        hf_t = statistics.median(hf_runs)
        result["transformers"] = {"seconds": hf_t,
                                  "output_tok_per_s": args.batch_size * args.output_len / hf_t}
        result["speedup_vs_transformers"] = hf_t / total
    write_json(args.json_out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
