"""Time to first token with and without the prompt-step CUDA graphs, in one process.

One engine of random --config weights; for each prompt length and batch (requests arriving
together), requests of max_tokens 1 are timed with the engine's prompt graphs on and off in
turn (on, off, on, off, ...: the same machine state for both), each a new random prompt (no
prefix hit). Also the GPU time of one such step's kernels (torch.profiler's sum, graphs
off): what a step would take with no host time at all.

    python benchmarks/ttft_graphs.py --config llama-3-8b --out $OUT

Writes $OUT/ttft_graphs.json; prints one line per (length, batch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from flashpage.bench.common import resolve_config
from flashpage.llm import LLM
from flashpage.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3-8b")
    ap.add_argument("--input-lens", type=int, nargs="+", default=[16, 128, 512, 1000, 2000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--iters", type=int, default=20, help="timed requests per mode and shape")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    t0 = time.perf_counter()
    llm = LLM(random_weights_config=resolve_config(args.config),
              gpu_memory_utilization=args.gpu_memory_utilization)
    start_s = time.perf_counter() - t0
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    if graphs is None:
        raise SystemExit("the engine captured no prompt graphs (FLASHPAGE_PREFILL_GRAPHS=0, eager, "
                         "or a backend/model without them)")
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    sync = torch.cuda.synchronize

    def one(n: int, batch: int) -> float:
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for _ in range(batch)]
        sync()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        return (time.perf_counter() - t) * 1e3

    from torch.profiler import ProfilerActivity, profile

    rows = []
    for n in args.input_lens:
        for batch in args.batches:
            if n * batch > llm.engine.config.max_num_batched_tokens:
                continue
            key = graphs.key(batch, n * batch)
            ms: dict[str, list[float]] = {"on": [], "off": []}
            for mode in ("on", "off"):  # warm: the first request of a shape compiles nothing new
                runner.prefill_graphs = graphs if mode == "on" else None
                one(n, batch)
            for _ in range(args.iters):
                for mode in ("on", "off"):
                    runner.prefill_graphs = graphs if mode == "on" else None
                    ms[mode].append(one(n, batch))
            runner.prefill_graphs = None
            with profile(activities=[ProfilerActivity.CUDA]) as tp:
                one(n, batch)
                sync()
            kernels = [e for e in tp.key_averages() if e.self_device_time_total > 0]
            row = dict(input_len=n, batch=batch, graph=list(key) if key else None,
                       ttft_ms_on=round(statistics.median(ms["on"]), 2),
                       ttft_ms_off=round(statistics.median(ms["off"]), 2),
                       gpu_kernel_ms_eager=round(sum(e.self_device_time_total for e in kernels) / 1e3, 2),
                       launches_eager=sum(e.count for e in kernels),
                       ms_on=[round(x, 2) for x in ms["on"]], ms_off=[round(x, 2) for x in ms["off"]])
            rows.append(row)
            print(f"{n:6d} tokens x {batch}: graphs {row['ttft_ms_on']:8.2f} ms, eager "
                  f"{row['ttft_ms_off']:8.2f} ms ({row['ttft_ms_off'] / row['ttft_ms_on']:.2f}x), kernels "
                  f"{row['gpu_kernel_ms_eager']:7.2f} ms in {row['launches_eager']} launches; graph {key}",
                  flush=True)
    runner.prefill_graphs = graphs
    res = dict(config=args.config, device=torch.cuda.get_device_name(), engine_start_s=round(start_s, 1),
               token_buckets=graphs.token_buckets, seq_slots=graphs.seq_slots, rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft_graphs.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
