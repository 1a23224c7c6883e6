"""Sampler benchmark (GPU): the torch sampling path against the Gumbel-max kernel
(kernels/sampling.py), Llama-3 vocabulary (128,256), bf16 logits as the model gives
them, T = 0.6, no top-k/top-p, at batch 1, 32 and 256.

Rows:
- torch: what ``Sampler._sample`` runs for such a batch: logits[:, :V].float(), / T,
  softmax, exponential_ noise, probs / noise, row_argmax (~7 passes over fp32 [n, V]).
- kernel: ``sample_gumbel`` (one read of the bf16 logits), default config, then a sweep
  of its launch shape (programs per SM, warps) and of Philox rounds (7: other noise).
- kernel greedy (all T = 0, no noise: the read alone) and torch argmax of the bf16 logits
  (read-bound references).
- Sampler.launch, eager, host work included (what the engine pays per step): torch path
  (use_kernel=False) against the kernel path, wall-clock per call.

Device times are CUDA-graph replays (gpu_timing.time_graph); each graph's calls rotate
over enough copies of the logits to pass ~3x the 60 MB L2 where that takes <= 32 copies
(batch 1 stays L2-resident: 256 KB, as it is in the engine right after the LM head).
GB/s counts the bf16 logits read once (n x V x 2 bytes).

    python benchmarks/sampler.py --out $OUT       # GPU: $OUT/sampler.json, sampler.md
    python benchmarks/sampler.py --smoke          # CPU: Triton's interpreter, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import tests.conftest  # noqa: F401  (its numpy fix for the interpreter)

import torch  # noqa: E402

from flashpage.engine.sampler import Sampler, row_argmax  # noqa: E402
from flashpage.engine.sequence import Request  # noqa: E402
from flashpage.kernels.sampling import SamplingConfig, sample_gumbel  # noqa: E402
from flashpage.sampling_params import SamplingParams  # noqa: E402

VOCAB, PADDED, TEMP = 128256, 128256, 0.6
L2_BYTES = 60 * 2**20
SWEEP = [SamplingConfig(programs_per_sm=p, num_warps=w) for w in (4, 8) for p in (2, 4, 8, 16)]
SWEEP += [SamplingConfig(n_rounds=7), SamplingConfig(n_rounds=7, num_warps=8, programs_per_sm=8)]


def torch_path(logits: torch.Tensor, temps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Sampler._sample's device work for unseeded, unfiltered, non-greedy rows."""
    x = logits[:, :vocab].float()
    probs = torch.softmax(x / temps, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    return row_argmax(probs / noise)


def copies_for(nbytes: int, smoke: bool) -> int:
    return 1 if smoke else max(1, min(32, -(-3 * L2_BYTES // nbytes)))


def timer(smoke: bool):
    if smoke:
        def wall(fn, calls):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - t0) / calls
        return lambda fns: wall(lambda: [f() for f in fns], 1) / len(fns)
    from gpu_timing import time_graph

    def graph(fns):
        it = iter(range(10**9))
        return time_graph(lambda: fns[next(it) % len(fns)](), calls=len(fns), reps=20)
    return graph


def eager_launch(sampler: Sampler, logits: torch.Tensor, reqs: list[Request], calls: int) -> float:
    """Wall-clock per Sampler.launch, host work included, device drained at the end."""
    for _ in range(3):
        sampler.launch(logits, reqs)
    if logits.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        sampler.launch(logits, reqs)
    if logits.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def bench_batch(n: int, vocab: int, padded: int, dev: str, smoke: bool) -> list[dict]:
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    nbytes = n * vocab * torch.tensor([], dtype=dtype).element_size()
    k = copies_for(nbytes, smoke)
    sets = [(4 * torch.randn(n, padded, device=dev)).to(dtype) for _ in range(k)]
    temps = torch.full((n,), TEMP, device=dev)
    zeros = torch.zeros(n, device=dev)
    seeds = torch.randint(0, 1 << 62, (n,), device=dev)
    pos = torch.arange(n, device=dev)
    time_fns = timer(smoke)
    rows: list[dict] = []

    def record(name: str, fns, note: str = "") -> None:
        try:
            t = time_fns(fns)
            row = dict(batch=n, path=name, us=round(t * 1e6, 1), gbps=round(nbytes / t / 1e9),
                       note=note)
        except Exception as ex:  # keep going: one failure must not hide the rest
            row = dict(batch=n, path=name, us=None, gbps=None,
                       note=f"n/a: {type(ex).__name__}: {str(ex)[:120]}")
        rows.append(row)
        print(json.dumps(row), flush=True)

    # Sanity: greedy through the kernel is argmax; a sampled token is in range.
    assert torch.equal(sample_gumbel(sets[0], vocab, zeros, seeds), sets[0][:, :vocab].argmax(-1))
    record("torch", [lambda x=x: torch_path(x, temps[:, None], vocab) for x in sets],
           "float() copy, /T, softmax, exponential_, /, row_argmax")
    record("kernel", [lambda x=x: sample_gumbel(x, vocab, temps, seeds, pos) for x in sets],
           f"default: programs_per_sm={SamplingConfig().programs_per_sm} "
           f"num_warps={SamplingConfig().num_warps} n_rounds={SamplingConfig().n_rounds}")
    for cfg in SWEEP if not smoke else SWEEP[:1]:
        record("kernel", [lambda x=x, cfg=cfg: sample_gumbel(x, vocab, temps, seeds, pos,
                                                             config=cfg) for x in sets],
               f"sweep: programs_per_sm={cfg.programs_per_sm} num_warps={cfg.num_warps} "
               f"n_rounds={cfg.n_rounds}")
    record("kernel greedy", [lambda x=x: sample_gumbel(x, vocab, zeros, seeds) for x in sets],
           "all T = 0: the read and the argmax, no noise")
    record("torch argmax", [lambda x=x: row_argmax(x[:, :vocab]) for x in sets],
           "row_argmax of the logits as given: read-bound reference")
    record("torch greedy", [lambda x=x: row_argmax(x[:, :vocab].float()) for x in sets],
           "the engine's greedy path before: float() copy, row_argmax")

    params = SamplingParams(temperature=TEMP)
    reqs = [Request(str(i), [1, 2, 3], params) for i in range(n)]
    calls = 3 if smoke else 50
    for name, kernel in (("Sampler.launch torch", False), ("Sampler.launch kernel", True)):
        try:
            t = eager_launch(Sampler(vocab, use_kernel=kernel), sets[0], reqs, calls)
            row = dict(batch=n, path=name, us=round(t * 1e6, 1), gbps=round(nbytes / t / 1e9),
                       note="eager, wall-clock, host work included")
        except Exception as ex:
            row = dict(batch=n, path=name, us=None, gbps=None,
                       note=f"n/a: {type(ex).__name__}: {str(ex)[:120]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def to_markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| batch | path | us per call | GB/s of logits | note |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        us = "n/a" if r["us"] is None else f"{r['us']:,}"
        gb = "n/a" if r["gbps"] is None else f"{r['gbps']:,}"
        lines.append(f"| {r['batch']} | {r['path']} | {us} | {gb} | {r['note']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for sampler.json and sampler.md")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, runs on the CPU")
    ap.add_argument("--batches", default="1,32,256")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.smoke:
        sys.exit("no CUDA GPU: use --smoke")
    vocab, padded = (3000, 3008) if args.smoke else (VOCAB, PADDED)
    batches = [1, 4] if args.smoke else [int(b) for b in args.batches.split(",")]
    rows = []
    for n in batches:
        rows += bench_batch(n, vocab, padded, dev, args.smoke)
    name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (interpreter, smoke)"
    header = (f"# Sampler on {name}\n\nvocab {vocab}, T = {TEMP}, "
              f"{'bf16' if dev == 'cuda' else 'fp32'} logits, torch {torch.__version__}")
    md = to_markdown(rows, header)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sampler.json"), "w") as f:
            json.dump(dict(device=name, vocab=vocab, temperature=TEMP, rows=rows), f, indent=1)
        with open(os.path.join(args.out, "sampler.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
