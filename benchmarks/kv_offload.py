"""What the host KV tier (--kv-offloading-size) buys: a prompt's time to first token when
its prefix comes back from host memory, against computing it (a prompt never seen) and
against a hit on the GPU prefix cache, in one engine (random --config weights).

For each input length and iteration: a new random prompt P runs once (cold: every token
computed), filler prompts then take the whole GPU pool so that P's cached blocks are
evicted (and, offloading on, stored to the host tier), P runs again (host: its full blocks
loaded back), and once more (gpu: its blocks now cached on the GPU). Each run is
``generate([P], max_tokens=1)`` timed to its end, so what is measured is the TTFT of a
request that arrives alone. The cached-token counts each run reports are printed beside it
(host: every full block of P should come from the host, none from the GPU). The baseline
in the same run: one pinned 1 GiB host-to-device copy's GB/s.

``--neighbours N`` adds what the loads cost everyone else: N requests decode, P (its prefix
evicted to the host just before) arrives among them, and each engine step is timed from
P's arrival to its first token: the neighbours' longest step in that window against their
median step before it, and P's TTFT there. Loads are asynchronous by default (only P waits
for them); ``FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS=0`` runs them before the step's forward (all
wait), the A/B:

    python benchmarks/kv_offload.py --config llama-3-8b --input-lens 1024 4096 16384 --json-out $OUT/kv_offload.json
    python benchmarks/kv_offload.py --input-lens 4096 16384 --neighbours 32 --json-out $OUT/async.json
    FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS=0 python benchmarks/kv_offload.py --input-lens 4096 16384 --neighbours 32 --json-out $OUT/sync.json
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


def host_to_device_gbps(nbytes: int = 1 << 30, iters: int = 5) -> float:
    """The baseline the loads are held to: one pinned host buffer copied to the device,
    median GB/s of ``iters`` copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for _ in range(iters + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates[1:])


NEIGHBOUR_TOKENS = 64 + 160  # a neighbour's prompt and the most tokens it decodes here


def neighbours_row(llm: LLM, length: int, n: int, prompt, run, evict) -> dict:
    """N requests decoding when P (its prefix on the host) arrives: the step times of the
    engine from P's arrival to its first token, against the neighbours' median step."""
    eng = llm.engine
    decode = SamplingParams(temperature=0.0, max_tokens=NEIGHBOUR_TOKENS - 64, ignore_eos=True,
                            detokenize=False)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    rounds = []
    for _ in range(3):  # the first warms the shapes
        p = prompt(length)
        run(p)
        evict()  # P's blocks to the host
        ids = [eng.add_request(None, prompt(64), decode) for _ in range(n)]
        before = []
        for _ in range(24):  # prefill, then decode steps
            t0 = time.perf_counter()
            eng.step()
            before.append(time.perf_counter() - t0)
        loads0 = eng.kv_manager.stats().host_loads
        t_arrive = time.perf_counter()
        pid = eng.add_request(None, p, one)
        window, ttft = [], None
        while ttft is None:
            t0 = time.perf_counter()
            outs = eng.step()
            window.append(time.perf_counter() - t0)
            if any(o.request_id == pid and o.outputs[0].token_ids for o in outs):
                ttft = time.perf_counter() - t_arrive
            if len(window) > 500:
                raise RuntimeError("P got no token in 500 steps")
        loaded = eng.kv_manager.stats().host_loads - loads0
        eng.abort_request(ids)
        while eng.has_unfinished_requests():
            eng.step()
        rounds.append({"median_step_ms": statistics.median(before[8:]) * 1e3,
                       "max_step_ms": max(window) * 1e3, "steps": len(window),
                       "ttft_ms": ttft * 1e3, "blocks_loaded": loaded})
    keep = rounds[1:]
    row = {"input_len": length, "neighbours": n,
           **{k: round(statistics.median(r[k] for r in keep), 2) for k in keep[0]},
           "rounds": keep}
    print(f"{length:6d} tokens from the host among {n} decoding: their step {row['median_step_ms']:.2f} ms "
          f"before, longest {row['max_step_ms']:.2f} ms while it loads ({row['steps']} steps, "
          f"{row['blocks_loaded']} blocks); its TTFT {row['ttft_ms']:.2f} ms", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3-8b")
    ap.add_argument("--input-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--host-gib", type=float, default=8.0, help="--kv-offloading-size")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--neighbours", type=int, default=0,
                    help="also time N decoding requests' steps while a prefix loads from the host")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    longest = max(args.input_lens)
    # P and one filler fit, two fillers do not (and the neighbours' blocks on top)
    pool_blocks = 2 * (longest // args.block_size) + 64 + args.neighbours * (-(-NEIGHBOUR_TOKENS // args.block_size))
    llm = LLM(random_weights_config=resolve_config(args.config), num_gpu_blocks=pool_blocks,
              block_size=args.block_size, max_model_len=longest + 16,
              kv_offloading_size=args.host_gib)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    moved: dict[str, tuple[int, int]] = {}  # per mode: blocks stored to / loaded from the host

    def run(p: list[int]) -> tuple[float, int, int, int, int]:
        kv0 = llm.engine.kv_manager.stats()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        m, kv = out.metrics, llm.engine.kv_manager.stats()
        return (dt * 1e3, (m.num_cached_tokens if m else -1), (m.num_host_cached_tokens if m else -1),
                kv.host_stores - kv0.host_stores, kv.host_loads - kv0.host_loads)

    def evict() -> None:  # fillers worth the whole pool: every block P left cached is reused
        n = min(longest, 8192)
        for _ in range(-(-pool_blocks * args.block_size // n) + 1):
            run(prompt(n))

    block_bytes = llm.engine.offload.block_bytes if llm.engine.offload is not None else 0
    run(prompt(64))  # compile and warm up outside the timings
    rows = []
    for length in args.input_lens:
        per: dict[str, list[float]] = {"cold": [], "host": [], "gpu": []}
        cached: dict[str, tuple[int, int]] = {}
        for _ in range(args.iters + 1):  # the first round warms this length's shapes
            p = prompt(length)
            first = run(p)
            evict()
            host = run(p)
            gpu = run(p)
            for name, r in (("cold", first), ("host", host), ("gpu", gpu)):
                per[name].append(r[0])
                cached[name] = (r[1], r[2])
                moved[name] = (r[3], r[4])
        row = {"input_len": length}
        for name, ms in per.items():
            row[f"{name}_ms"] = round(statistics.median(ms[1:]), 2)
            row[f"{name}_ms_all"] = [round(x, 2) for x in ms[1:]]
            row[f"{name}_cached_tokens"], row[f"{name}_host_cached_tokens"] = cached[name]
            row[f"{name}_blocks_stored"], row[f"{name}_blocks_loaded"] = moved[name]
        # the bytes the host run moved (its loads, and the stores of the blocks they evicted,
        # which the loads wait for) over what it took beyond the GPU hit
        moved_bytes = (row["host_blocks_stored"] + row["host_blocks_loaded"]) * block_bytes
        row["host_copy_gbps"] = round(moved_bytes / max(row["host_ms"] - row["gpu_ms"], 1e-3) / 1e6, 1)
        rows.append(row)
        print(f"{length:6d} tokens: cold {row['cold_ms']:8.2f} ms | from the host {row['host_ms']:8.2f} ms "
              f"(cached {row['host_cached_tokens']}, host {row['host_host_cached_tokens']}) | "
              f"GPU hit {row['gpu_ms']:8.2f} ms (cached {row['gpu_cached_tokens']}) | "
              f"host / cold {row['host_ms'] / row['cold_ms']:.2f}; the host run stored "
              f"{row['host_blocks_stored']} and loaded {row['host_blocks_loaded']} blocks: "
              f"{row['host_copy_gbps']} GB/s beyond the GPU hit", flush=True)
    itl = [neighbours_row(llm, n, args.neighbours, prompt, run, evict) for n in args.input_lens] \
        if args.neighbours else []
    h2d = host_to_device_gbps() if torch.cuda.is_available() else None
    if h2d is not None:
        print(f"baseline: one pinned 1 GiB host-to-device copy {h2d:.1f} GB/s", flush=True)
    res = {"h2d_pinned_gbps": h2d, "config": args.config, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "host_gib": args.host_gib, "gpu_blocks": pool_blocks, "block_size": args.block_size, "rows": rows,
           "async_loads": os.environ.get("FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS", "1") != "0",
           "neighbours": args.neighbours, "neighbour_rows": itl}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
