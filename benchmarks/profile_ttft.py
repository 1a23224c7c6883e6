"""Where a short prompt's time to first token goes on the host (GPU): one request of
--input-len tokens, max_tokens 1, random weights of --config, timed N times (median), then
the same under cProfile (top functions by own and by cumulative time), and the GPU time of
one such request's kernels (torch.profiler: the sum of kernel durations). A TTFT far above
the kernels' sum is host time: Python and launches the GPU waits on.

    python benchmarks/profile_ttft.py --config llama-3-8b --out $OUT

With --decodes N: N requests decoding and a new prompt of --input-len tokens joining every
step (a mixed step, as each arrival makes while others decode); the timed unit is one step.

Writes $OUT/profile_ttft.json and $OUT/profile_ttft.txt (the cProfile tables).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
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
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--decodes", type=int, default=0, help="requests decoding beside each prompt")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    llm = LLM(random_weights_config=resolve_config(args.config),
              gpu_memory_utilization=args.gpu_memory_utilization)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def new_prompt(n: int) -> list[int]:  # a new prompt each time: no prefix-cache hit
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    eng = llm.engine
    if args.decodes:
        long_params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True, detokenize=False)
        for _ in range(args.decodes):
            eng.add_request(None, new_prompt(64), long_params)
        for _ in range(4):
            eng.step()

    def one(i: int) -> None:
        if args.decodes:  # one mixed step
            eng.add_request(None, new_prompt(args.input_len), params)
            eng.step()
        else:
            llm.generate([new_prompt(args.input_len)], params, use_tqdm=False)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i in range(3):
        one(i)
    sync()
    walls = []
    for i in range(args.iters):
        t0 = time.perf_counter()
        one(i)
        sync()
        walls.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(args.iters):
        one(i)
    sync()
    prof.disable()
    from torch.profiler import ProfilerActivity, profile

    kernels = []
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            one(0)
            sync()
        kernels = [e for e in tp.key_averages() if e.self_device_time_total > 0]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in kernels)
    res = {"config": args.config, "input_len": args.input_len, "decodes": args.decodes, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "request_ms_median": round(statistics.median(walls) * 1e3, 2),
           "request_ms_all": [round(w * 1e3, 2) for w in walls],
           "gpu_kernel_ms": round(gpu_ms, 2), "kernel_launches": launches,
           "fast_launch": os.environ.get("FLASHPAGE_FAST_LAUNCH", "1")}
    print(json.dumps(res, indent=1))
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60)
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:25]
    table = "\n".join(f"{e.self_device_time_total / 1e3:9.3f} ms {e.count:6d}x {e.key[:110]}" for e in top)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_ttft.json").write_text(json.dumps(res, indent=1))
    (out / "profile_ttft.txt").write_text(s.getvalue() + "\n\nGPU kernels of one request:\n" + table + "\n")
    print(s.getvalue()[:7000])


if __name__ == "__main__":
    main()
