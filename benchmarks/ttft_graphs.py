"""Prompt steps with and without their CUDA graphs, in one process.

One engine of random --config weights, its graphs swapped in and out between requests:
"whole" (the prompt-only step graphs, PrefillGraphs, where a step fits them), "piecewise"
(PiecewiseGraphs: all but attention), "eager" (neither). Modes in turn (whole, piecewise,
eager, whole, ...: the same machine state for each), every prompt new (no prefix hit).

1. Time to first token: for each prompt length and batch (requests arriving together),
   requests of max_tokens 1; also the GPU time of one such step's kernels (torch.profiler's
   sum, eager): what the step would take with no host time at all.
2. Mixed steps (--decodes): that many requests decoding, a new prompt of each --mixed-lens
   length joining every step (max_tokens 1): ms per step, piecewise against eager and
   against "replanned" (piecewise with each layer planning its attention kernels anew, as
   before kernels/plan.py). --cprofile: the host profile of the first shape's piecewise steps.

    python benchmarks/ttft_graphs.py --config llama-3-8b --out $OUT

Writes $OUT/ttft_graphs.json; prints one line per shape.
"""

from __future__ import annotations

import argparse
import json
import logging
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
    ap.add_argument("--decodes", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--mixed-lens", type=int, nargs="*", default=[16, 128, 512])
    ap.add_argument("--mixed-steps", type=int, default=10, help="timed steps per mode, 3 rounds")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--cprofile", action="store_true",
                    help="also profile the host side of the first mixed shape's piecewise steps "
                         "(cProfile, top functions into mixed_cprofile.txt) and time its kernels")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    # the engine's start-up lines: each graph kind's capture time and reserved memory
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    t0 = time.perf_counter()
    llm = LLM(random_weights_config=resolve_config(args.config),
              gpu_memory_utilization=args.gpu_memory_utilization)
    start_s = time.perf_counter() - t0
    runner = llm.engine.runner
    whole, pieces = runner.prefill_graphs, runner.piecewise
    if pieces is None:
        raise SystemExit("the engine captured no piecewise graphs (FLASHPAGE_PIECEWISE_GRAPHS=off, "
                         "eager, a backend without them, or a model waiting for =all)")

    import flashpage.kernels.plan as plan_mod

    planned = plan_mod.planned

    def replanned(plans, key, make, *tensors):  # the attention kernels planned in every layer
        make().launch(*tensors)

    def mode(name: str) -> None:
        """whole / piecewise / eager; "replanned": piecewise with each layer's attention
        planning its kernels anew (as before kernels/plan.py), the plans' same-run baseline."""
        runner.prefill_graphs = whole if name == "whole" else None
        runner.piecewise = pieces if name in ("whole", "piecewise", "replanned") else None
        plan_mod.planned = replanned if name == "replanned" else planned  # type: ignore[assignment]

    # a model without whole prompt-step graphs (DeepSeek): piecewise against eager only
    modes = ("whole", "piecewise", "eager") if whole is not None else ("piecewise", "eager")
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    sync = torch.cuda.synchronize

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def one(n: int, batch: int) -> float:
        prompts = [prompt(n) for _ in range(batch)]
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
            key = whole.key(batch, n * batch) if whole is not None else None
            ms: dict[str, list[float]] = {m: [] for m in modes}
            for m in modes:  # warm: the first request of a shape compiles nothing new
                mode(m)
                one(n, batch)
            for _ in range(args.iters):
                for m in modes:
                    mode(m)
                    ms[m].append(one(n, batch))
            mode("eager")
            with profile(activities=[ProfilerActivity.CUDA]) as tp:
                one(n, batch)
                sync()
            kernels = [e for e in tp.key_averages() if e.self_device_time_total > 0]
            row = dict(input_len=n, batch=batch, whole_graph=list(key) if key else None,
                       piecewise_bucket=pieces.bucket(n * batch),
                       gpu_kernel_ms_eager=round(sum(e.self_device_time_total for e in kernels) / 1e3, 2),
                       launches_eager=sum(e.count for e in kernels))
            for m in modes:
                row[f"ttft_ms_{m}"] = round(statistics.median(ms[m]), 2)
                row[f"ms_{m}"] = [round(x, 2) for x in ms[m]]
            rows.append(row)
            print(f"{n:6d} tokens x {batch}: whole {row.get('ttft_ms_whole', float('nan')):7.2f} ms, "
                  f"piecewise {row['ttft_ms_piecewise']:7.2f}, eager {row['ttft_ms_eager']:7.2f}; kernels "
                  f"{row['gpu_kernel_ms_eager']:7.2f} ms in {row['launches_eager']} launches; whole graph "
                  f"{key}, piecewise bucket {row['piecewise_bucket']}", flush=True)
    mixed = []
    eng = llm.engine

    def profile_mixed(n: int) -> None:
        """Where a piecewise mixed step's host time goes (cProfile over 10 steps), and its
        kernels' own time (torch.profiler, one more step)."""
        import cProfile
        import io
        import pstats

        mode("piecewise")
        pr = cProfile.Profile()
        sync()
        pr.enable()
        for _ in range(10):
            eng.add_request(None, prompt(n), params)
            eng.step()
        sync()
        pr.disable()
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            eng.add_request(None, prompt(n), params)
            eng.step()
            sync()
        kernels = [e for e in tp.key_averages() if e.self_device_time_total > 0]
        text = io.StringIO()
        text.write(f"kernels of one piecewise step: {sum(e.self_device_time_total for e in kernels) / 1e3:.2f} ms "
                   f"in {sum(e.count for e in kernels)} launches\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(pr, stream=text).sort_stats(key).print_stats(45)
        (Path(args.out) / "mixed_cprofile.txt").write_text(text.getvalue())
    long_params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True, detokenize=False)
    for d in args.decodes:
        ids = [eng.add_request(None, prompt(64), long_params) for _ in range(d)]
        for _ in range(4):  # their prompts, then decoding
            eng.step()
        for n in args.mixed_lens:
            per: dict[str, list[float]] = {m: [] for m in ("piecewise", "replanned", "eager")}
            for _ in range(3):
                for m in per:
                    mode(m)
                    eng.add_request(None, prompt(n), params)
                    eng.step()  # warm: the pipeline holds steps of this kind
                    sync()
                    t = time.perf_counter()
                    for _ in range(args.mixed_steps):
                        eng.add_request(None, prompt(n), params)
                        eng.step()
                    sync()
                    per[m].append((time.perf_counter() - t) * 1e3 / args.mixed_steps)
            if args.cprofile and not mixed:
                profile_mixed(n)
            row = dict(decodes=d, input_len=n, piecewise_bucket=pieces.bucket(d + n),
                       step_ms_piecewise=round(statistics.median(per["piecewise"]), 2),
                       step_ms_replanned=round(statistics.median(per["replanned"]), 2),
                       step_ms_eager=round(statistics.median(per["eager"]), 2),
                       rounds=per)
            mixed.append(row)
            print(f"{d:4d} decodes + a {n}-token prompt a step: piecewise {row['step_ms_piecewise']:7.2f} ms "
                  f"a step, replanned {row['step_ms_replanned']:7.2f}, eager {row['step_ms_eager']:7.2f} "
                  f"(bucket {row['piecewise_bucket']})", flush=True)
        eng.abort_request(ids)
        while eng.has_unfinished_requests():
            eng.step()
    mode("whole")
    res = dict(config=args.config, device=torch.cuda.get_device_name(), engine_start_s=round(start_s, 1),
               token_buckets=pieces.token_buckets, seq_slots=whole.seq_slots if whole is not None else None,
               rows=rows, mixed=mixed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft_graphs.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
