"""Where a decode step's time goes: scheduler, input preparation, forward (graph or eager),
sampler, and the rest, each timed with a device sync around it (so the sum is slower
than a real step; the split is what matters).

Usage: python benchmarks/profile_engine_step.py --config llama-3-8b --batch 256 --context 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from flashpage.bench.common import make_workload, resolve_config
from flashpage.llm import LLM
from flashpage.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="llama-3-8b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--kernel-table", action="store_true",
                   help="also list the GPU kernels of a few decode steps per batch (torch.profiler)")
    p.add_argument("--prefill-table", type=int, default=0, metavar="TOKENS",
                   help="also list the kernels of one step of this many prompt tokens "
                        "(prompts of --context tokens; e.g. 8192 = a full default budget)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8 (as for flashpage run)")
    args = p.parse_args()
    llm = LLM(random_weights_config=resolve_config(args.config),
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(args.batch),
              kv_cache_dtype=args.kv_cache_dtype)
    eng = llm.engine
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = defaultdict(list)

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            t0 = time.perf_counter()
            r = fn(*a, **k)
            sync()
            times[name].append(time.perf_counter() - t0)
            return r
        return wrapper

    runner = eng.runner
    runner.prepare = timed("prepare", runner.prepare)
    runner.sampler.launch = timed("sampler", runner.sampler.launch)
    if runner.graphs is not None:
        runner.graphs.run = timed("forward_graph", runner.graphs.run)
    runner.model.forward = timed("forward_eager", runner.model.forward)
    eng.scheduler.schedule = timed("schedule", eng.scheduler.schedule)
    eng.scheduler.advance = timed("advance", eng.scheduler.advance)
    eng.scheduler.resolve = timed("resolve", eng.scheduler.resolve)
    for bs in args.batch:
        wl = make_workload(bs, (args.context, args.context), (args.steps, args.steps),
                           eng.model_config.vocab_size, avoid=eng.placeholder_token_ids())
        # More tokens than will be timed: every request is still running when the timed
        # steps end (the first run let early admissions finish, so its "batch 256" steps
        # had ~100 requests); the rest is aborted.
        params = SamplingParams(temperature=0.6, max_tokens=4 * args.steps + 64, ignore_eos=True,
                                detokenize=False)
        eng_steps: list[float] = []
        for rid, prompt in enumerate(wl.prompts):
            eng.add_request(f"b{bs}-{rid}", prompt, params)
        # Prefill steps first (not timed), then decode steps.
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
            eng.step(final_only=True)
        times.clear()
        while len(eng_steps) < args.steps:
            assert eng.scheduler.num_running == bs, "a request stopped running: lower --batch"
            t0 = time.perf_counter()
            eng.step(final_only=True)
            eng_steps.append(time.perf_counter() - t0)
        if args.kernel_table:
            _kernel_table(eng, bs, steps=5)
        eng.abort_request([f"b{bs}-{rid}" for rid in range(bs)])
        while eng.has_unfinished_requests():
            eng.step(final_only=True)
        print(f"batch {bs} (all running), context {args.context}: step median "
              f"{statistics.median(eng_steps) * 1e3:.2f} ms (synced parts below)")
        for name, ts in sorted(times.items()):
            print(f"  {name:14s} {statistics.median(ts) * 1e3:8.3f} ms  x{len(ts)}")
    if args.prefill_table:
        _prefill_table(eng, args.prefill_table, args.context)


def _prefill_table(eng, tokens: int, context: int) -> None:
    """Kernels of one step made only of prompt chunks, ``tokens`` of them."""
    n = max(1, tokens // context)
    wl = make_workload(n, (context, context), (1, 1), eng.model_config.vocab_size,
                       avoid=eng.placeholder_token_ids())
    params = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True, detokenize=False)
    for rid, prompt in enumerate(wl.prompts):
        eng.add_request(f"prefill-{rid}", prompt, params)
    t0 = time.perf_counter()
    _kernel_table(eng, f"prefill of {n} x {context} tokens", steps=1)
    print(f"  (profiled step took {(time.perf_counter() - t0) * 1e3:.1f} ms with the profiler on)")
    while eng.has_unfinished_requests():
        eng.step(final_only=True)


def _kernel_table(eng, bs: int | str, steps: int) -> int:
    """Profile `steps` engine steps and print the kernels that take the GPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            eng.step(final_only=True)
        sync()
    # Kernels carry their own device time; CPU ops only their children's (self time 0).
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in rows)
    print(f"  kernels at batch {bs}: {total / steps / 1e3:.3f} ms of GPU time per step")
    for e in rows[:14]:
        print(f"    {e.self_device_time_total / steps:9.1f} us/step  x{e.count // steps:<4d} {e.key[:90]}")
    return steps


if __name__ == "__main__":
    main()
