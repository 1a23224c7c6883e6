"""What sleep mode costs an RLHF loop: sleep(level) and wake_up() wall times, the device
memory given back, and the first generate after waking (random --config weights, CUDA
graphs on). With fixed addresses (the default on CUDA: engine/cumem.py) the graphs are
kept through the sleep; ``FLASHPAGE_SLEEP_FIXED_ADDRESSES=0`` frees the storages and
captures the graphs again in wake_up, the A/B:

    python benchmarks/sleep_wake.py --config llama-3-8b --json-out $OUT/sleep_fixed.json
    FLASHPAGE_SLEEP_FIXED_ADDRESSES=0 python benchmarks/sleep_wake.py --config llama-3-8b --json-out $OUT/sleep_recapture.json

The baseline in the same run: a generate of the same prompts before any sleep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from flashpage.bench.common import resolve_config
from flashpage.llm import LLM
from flashpage.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3-8b")
    ap.add_argument("--level", type=int, default=1, choices=(1, 2))
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--json-out")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    llm = LLM(random_weights_config=resolve_config(args.config), enable_sleep_mode=True,
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=2048)
    eng = llm.engine
    prompts = [{"prompt_token_ids": list(range(100 + i, 228 + i))} for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False, logprobs=2)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def free() -> int:
        return torch.cuda.mem_get_info()[0] if cuda else 0

    def gen() -> tuple[float, list[list[int]], list]:
        # no prefix hits: a prompt step of the whole prompt each time, as after a sleep
        # (which resets the cache); a hit's shorter step may round otherwise
        assert eng.reset_prefix_cache()
        sync()
        t0 = time.perf_counter()
        out = llm.generate(prompts, params, use_tqdm=False)
        sync()
        return ((time.perf_counter() - t0) * 1e3, [list(o.outputs[0].token_ids) for o in out],
                [o.outputs[0].logprobs or [] for o in out])

    def divergence(got: list[list[int]], lps: list) -> dict:
        """Where tokens first differ from before the sleep: how many prompts, the largest
        chosen-logprob change before that point, and the top-2 margin (before the sleep) at
        each first difference: a near tie flipped by rounding, or a real change."""
        moved, margins = 0.0, []
        for w, g, lw, lg in zip(want, got, want_lps, lps, strict=True):
            k = next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), len(w))
            moved = max([moved] + [abs(a.logprob - b.logprob) for a, b in zip(lw[:k], lg[:k], strict=True)])
            if k < len(w) and len(lw[k].top) >= 2:
                margins.append(round(lw[k].top[0][1] - lw[k].top[1][1], 4))
        return {"prompts_differing": len(margins), "max_logprob_change_before": round(moved, 5),
                "top2_margin_at_first_difference": margins}

    gen()
    base_ms, want, want_lps = gen()
    rows = []
    for _ in range(args.cycles):
        f0 = free()
        t0 = time.perf_counter()
        llm.sleep(args.level)
        sleep_ms = (time.perf_counter() - t0) * 1e3
        f1 = free()
        t0 = time.perf_counter()
        llm.wake_up(tags=["weights"])
        if args.level == 2:
            llm.reload_weights()
        llm.wake_up(tags=["kv_cache"])
        sync()
        wake_ms = (time.perf_counter() - t0) * 1e3
        ms, got, lps = gen()
        rows.append({"sleep_ms": round(sleep_ms, 1), "wake_ms": round(wake_ms, 1),
                     "freed_gib": round((f1 - f0) / 2**30, 2), "first_generate_ms": round(ms, 1),
                     "same_tokens": got == want, **({} if got == want else divergence(got, lps))})
        print(rows[-1], flush=True)
    state = eng.sleep_state
    res = {"config": args.config, "level": args.level,
           "fixed_addresses": bool(state is not None and state.keeps_graphs),
           "device": torch.cuda.get_device_name() if cuda else "cpu",
           "weights_gib": round(state.nbytes("weights") / 2**30, 2) if state else None,
           "kv_cache_gib": round(state.nbytes("kv_cache") / 2**30, 2) if state else None,
           "generate_ms_before": round(base_ms, 1),
           "sleep_ms": statistics.median(r["sleep_ms"] for r in rows),
           "wake_ms": statistics.median(r["wake_ms"] for r in rows),
           "first_generate_ms": statistics.median(r["first_generate_ms"] for r in rows),
           "rows": rows, "env": os.environ.get("FLASHPAGE_SLEEP_FIXED_ADDRESSES", "")}
    print(f"fixed addresses {res['fixed_addresses']}: sleep({args.level}) {res['sleep_ms']} ms "
          f"(weights {res['weights_gib']} GiB, KV {res['kv_cache_gib']} GiB), wake_up {res['wake_ms']} ms, "
          f"first generate {res['first_generate_ms']} ms (before any sleep {res['generate_ms_before']})",
          flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
