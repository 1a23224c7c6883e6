"""How much KV cache memory holds real token states: preallocation vs paging (PagedAttention §2-3).

Every policy runs the SAME workload through the REAL scheduler (flashpage.engine.scheduler)
and the real block manager (flashpage.kv_cache); only the allocation policy differs:

  (a) reserve max_model_len     at admission, a contiguous region of max_model_len slots
  (b) reserve prompt+max_tokens at admission, prompt + the request's max_tokens slots
  (b*) reserve prompt+output    the same with an oracle that knows the real output length
  (c) paged, block size B       blocks allocated as tokens arrive (B = 1, 16, 32, 128)

(a)/(b) are KVCacheManager with block_size 1 that takes the whole reservation at
admission; they ignore external fragmentation (favourable to them). The KV pool is a
fixed number of token slots (default 32768: e.g. a 13B fp16 model with ~25 GiB of KV
cache at 800 KiB per token, the paper's A100-40GB setting).

Workload (fixed seed): N requests arrive at once (the server is saturated);
prompt ~ round(LogNormal(ln 128, 1.0)) clipped to [4, 1536]; the model's real output
~ round(LogNormal(ln 192, 1.0)) (a ShareGPT-like long tail); the client's max_tokens =
min(1024, max_model_len - prompt); the request stops by EOS at min(output, max_tokens).
Metrics are averaged over the steps while requests are still queued (memory-bound):

  token states / allocated  -- slots holding a token's K/V ÷ slots allocated or reserved
  token states / pool       -- the same ÷ the whole pool
  requests at once          -- running requests per step (the batch memory allows)

A second run: many requests sharing a long system prompt, paged (B=16) with and without
prefix caching: logical tokens per physical slot and requests that fit at once.

A third: long contexts (prompts ~ LogNormal(ln 4096, 0.5) clipped to [512, 12288], outputs
~ LogNormal(ln 512, 0.7), max_model_len 16384) for a model whose every layer attends within
a 1024-token window (``--window``), paged (B=16, prefix caching on) keeping every token
against giving blocks behind the window back (what the engine does for such a model).

A fourth: the same long contexts for a model whose layers mix that window with full
attention (``--mixed-ratio`` windowed layers to each full one: Gemma 3's 5), one table for
all layers (every layer keeps every token) against the engine's KV cache groups
(kv_cache/hybrid.py: the windowed groups give blocks back), in the same memory.

Usage: flashpage bench memory [--requests 1000] [--out benchmarks/results/memory.md] [--plot F.png]
       [--plot benchmarks/results/memory.png]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from flashpage.engine.scheduler import Scheduler
from flashpage.engine.sequence import Request
from flashpage.kv_cache.hybrid import HybridKVCacheManager, group_layers
from flashpage.kv_cache.kv_cache_manager import KVCacheBlock, KVCacheManager
from flashpage.sampling_params import SamplingParams

EOS = 0


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    outputs: list[int]  # real output length (EOS after that many tokens)

    def describe(self) -> str:
        p = [len(x) for x in self.prompts]
        return (f"{len(p)} requests; prompt mean {statistics.mean(p):.0f} (median "
                f"{statistics.median(p):.0f}, max {max(p)}), output mean "
                f"{statistics.mean(self.outputs):.0f} (median {statistics.median(self.outputs):.0f}, "
                f"max {max(self.outputs)}), max_tokens mean {statistics.mean(self.max_tokens):.0f}")


def _lognormal(name: str, n: int, max_model_len: int, seed: int, prompt: tuple[float, float, int, int],
               output: tuple[float, float], max_out: int) -> Workload:
    """n requests, prompt ~ round(LogNormal(ln median, sigma)) clipped to [lo, hi] (and
    below max_model_len), real output ~ round(LogNormal(ln median, sigma)), the client's
    max_tokens = min(max_out, what max_model_len leaves)."""
    rng = random.Random(seed)
    (p_med, p_sigma, lo, hi), (o_med, o_sigma) = prompt, output
    prompts, max_tokens, outputs = [], [], []
    for _ in range(n):
        plen = min(max(lo, round(rng.lognormvariate(math.log(p_med), p_sigma))), hi, max_model_len - 1)
        mt = min(max_out, max_model_len - plen)
        out = min(max(1, round(rng.lognormvariate(math.log(o_med), o_sigma))), mt)
        prompts.append([rng.randrange(1, 32000) for _ in range(plen)])
        max_tokens.append(mt)
        outputs.append(out)
    return Workload(name, prompts, max_tokens, outputs)


def sharegpt_like(n: int, max_model_len: int, seed: int = 0) -> Workload:
    return _lognormal("sharegpt-like", n, max_model_len, seed, (128, 1.0, 4, 1536), (192, 1.0), 1024)


def shared_system_prompt(n: int, system_len: int, seed: int = 1) -> Workload:
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(system_len)]
    prompts, max_tokens, outputs = [], [], []
    for _ in range(n):
        ulen = max(1, round(rng.lognormvariate(math.log(64), 0.8)))
        prompts.append(system + [rng.randrange(1, 32000) for _ in range(ulen)])
        max_tokens.append(512)
        outputs.append(min(512, max(1, round(rng.lognormvariate(math.log(128), 0.8)))))
    return Workload(f"{system_len}-token shared system prompt", prompts, max_tokens, outputs)


def long_context(n: int, max_model_len: int, seed: int = 2) -> Workload:
    return _lognormal("long contexts", n, max_model_len, seed, (4096, 0.5, 512, 12288), (512, 0.7),
                      2048)


class ReservingKVCacheManager(KVCacheManager):
    """Preallocation baseline: at admission a request takes ``reserve(request)`` slots at
    once (block_size 1, no sharing); token states are counted as they are written."""

    def __init__(self, num_slots: int, reserve: Callable[[Request], int]) -> None:
        super().__init__(num_slots, 1, enable_prefix_caching=False)
        self.reserve = reserve

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[KVCacheBlock] | None:
        rid = request.request_id
        if not self.get_blocks(rid):
            need = self.reserve(request)
            assert need >= request.num_computed_tokens + num_new_tokens
            got = super().allocate_slots(request, need - request.num_computed_tokens)
            if got is None:
                return None
            self._num_stored[rid] = request.num_computed_tokens + num_new_tokens
            return got
        if request.num_computed_tokens + num_new_tokens > len(self.get_blocks(rid)):
            raise AssertionError("a request outgrew its reservation")
        return super().allocate_slots(request, num_new_tokens)


@dataclass
class Result:
    policy: str
    util_alloc: float  # token states / allocated slots
    util_pool: float  # token states / pool slots
    running_mean: float
    running_max: int
    steps: int
    preemptions: int
    recompute_frac: float  # extra scheduled tokens ÷ the tokens a run without preemption needs
    logical_per_slot: float  # tokens of all requests' contexts ÷ physical slots used
    seconds: float


def simulate(policy: str, wl: Workload, kv: KVCacheManager | HybridKVCacheManager, max_model_len: int,
             budget: int = 4096, max_num_seqs: int = 4096, watermark: float = 0.0) -> Result:
    t0 = time.perf_counter()
    s = Scheduler(max_num_seqs, budget, max_model_len, kv, watermark=watermark)
    target: dict[str, int] = {}
    for i, (p, mt, o) in enumerate(zip(wl.prompts, wl.max_tokens, wl.outputs, strict=True)):
        rid = f"q{i}"
        target[rid] = o
        s.add_request(Request(rid, p, SamplingParams(max_tokens=mt), eos_token_id=EOS))
    pool_slots = kv.num_blocks * kv.block_size
    util_a, util_p, running, logical = [], [], [], []
    scheduled_total = 0
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        scheduled_total += out.total_num_scheduled_tokens
        if s.waiting:  # saturated: memory is what limits the batch
            st = kv.stats()
            if st.slots_allocated:
                util_a.append(st.tokens_stored / st.slots_allocated)
                util_p.append(st.tokens_stored / pool_slots)
                logical.append(sum(kv.num_stored_tokens(r.request_id) for r in s.running)
                               / st.slots_allocated)
            running.append(s.num_running)
        sampled = {}
        for req, n in out.scheduled:
            if req.num_computed_tokens + n == req.num_tokens:
                done = req.num_output_tokens + 1 >= target[req.request_id]
                sampled[req.request_id] = EOS if done else 1 + (req.num_tokens % 31999)
        s.update_from_output(out, sampled)
        steps += 1
    needed = sum(len(p) + o - 1 for p, o in zip(wl.prompts, wl.outputs, strict=True))
    assert kv.num_free_blocks == kv.num_usable_blocks
    return Result(
        policy=policy,
        util_alloc=statistics.mean(util_a) if util_a else float("nan"),
        util_pool=statistics.mean(util_p) if util_p else float("nan"),
        running_mean=statistics.mean(running) if running else float("nan"),
        running_max=max(running, default=0),
        steps=steps,
        preemptions=s.num_preemptions,
        recompute_frac=scheduled_total / needed - 1.0,
        logical_per_slot=statistics.mean(logical) if logical else float("nan"),
        seconds=time.perf_counter() - t0,
    )


def run_window(num_requests: int, pool_slots: int, window: int,
               max_model_len: int = 16384) -> tuple[list[Result], Workload]:
    """The long-context workload, paged (B=16, prefix caching on), every token kept vs the
    blocks behind a ``window`` every layer shares given back."""
    wl = long_context(num_requests, max_model_len)
    out = []
    for w in (None, window):
        kv = KVCacheManager(pool_slots // 16, 16, enable_prefix_caching=True, sliding_window=w)
        name = "paged, block 16, every token kept" if w is None else \
            f"paged, block 16, blocks behind the {w}-token window released"
        out.append(simulate(name, wl, kv, max_model_len))
    return out, wl


def run_mixed(num_requests: int, pool_slots: int, window: int, ratio: int,
              max_model_len: int = 16384) -> tuple[list[Result], Workload]:
    """The long-context workload for a model of ``ratio`` windowed layers to each full one
    (``pool_slots`` tokens of every layer's K/V): one table for all layers against the
    KV cache groups, which hold blocks of one layer's slot (group_layers: g = 1 here)."""
    wl = long_context(num_requests, max_model_len)
    lay = group_layers([window] * ratio + [None])
    assert lay is not None and lay.num_slots == 1
    layers = ratio + 1
    one = KVCacheManager(pool_slots // 16, 16, enable_prefix_caching=True)
    groups = HybridKVCacheManager(pool_slots * layers // 16, 16, True, lay.windows)
    return [simulate("paged, block 16, one table for all layers", wl, one, max_model_len),
            simulate(f"paged, block 16, KV cache groups (1 full + {ratio} windowed)", wl, groups,
                     max_model_len)], wl


def run(num_requests: int, pool_slots: int, max_model_len: int, shared_len: int,
        block_sizes: tuple[int, ...] = (1, 16, 32, 128)) -> tuple[list[Result], list[Result],
                                                                  Workload, Workload]:
    wl = sharegpt_like(num_requests, max_model_len)
    mt = dict(zip((f"q{i}" for i in range(num_requests)), wl.max_tokens, strict=True))
    out = dict(zip((f"q{i}" for i in range(num_requests)), wl.outputs, strict=True))
    results = [
        simulate("(a) reserve max_model_len", wl,
                 ReservingKVCacheManager(pool_slots, lambda r: max_model_len), max_model_len),
        simulate("(b) reserve prompt + max_tokens", wl,
                 ReservingKVCacheManager(pool_slots,
                                         lambda r: r.num_prompt_tokens + mt[r.request_id]),
                 max_model_len),
        simulate("(b*) reserve prompt + real output (oracle)", wl,
                 ReservingKVCacheManager(pool_slots,
                                         lambda r: r.num_prompt_tokens + out[r.request_id]),
                 max_model_len),
    ]
    for bs in block_sizes:
        kv = KVCacheManager(pool_slots // bs, bs, enable_prefix_caching=False)
        results.append(simulate(f"(c) paged, block {bs}", wl, kv, max_model_len))
    # The engine's default: prefix caching on. No shared prefixes here, but a preempted
    # request finds its own freed blocks still cached and recomputes less.
    kv = KVCacheManager(pool_slots // 16, 16, enable_prefix_caching=True)
    results.append(simulate("(c) paged, block 16, prefix caching on", wl, kv, max_model_len))
    # ... and with the engine's admission watermark (1% of blocks kept free for growth).
    kv = KVCacheManager(pool_slots // 16, 16, enable_prefix_caching=True)
    results.append(simulate("(c) paged, block 16, prefix caching, 1% watermark (engine default)",
                            wl, kv, max_model_len, watermark=0.01))

    shared = shared_system_prompt(num_requests, shared_len)
    sharing = []
    for prefix in (False, True):
        kv = KVCacheManager(pool_slots // 16, 16, enable_prefix_caching=prefix)
        name = f"paged, block 16, prefix caching {'on' if prefix else 'off'}"
        sharing.append(simulate(name, shared, kv, max_model_len))
    return results, sharing, wl, shared


def markdown(results: list[Result], sharing: list[Result], wl: Workload, shared: Workload,
             pool_slots: int, max_model_len: int) -> str:
    lines = [
        f"KV pool: {pool_slots} token slots; max_model_len {max_model_len}; real scheduler "
        "(token budget 4096, chunked prefill, FIFO, preemption by recompute) and real block "
        "manager; averages over the steps while requests are queued.",
        "",
        f"Workload: {wl.name}: {wl.describe()}.",
        "",
        "| policy | token states / allocated KV | token states / whole pool | requests at once "
        "(mean / max) | steps to drain | preemptions | recomputed tokens |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(f"| {r.policy} | {100 * r.util_alloc:.1f}% | {100 * r.util_pool:.1f}% | "
                     f"{r.running_mean:.1f} / {r.running_max} | {r.steps} | {r.preemptions} | "
                     f"{100 * r.recompute_frac:.1f}% |")
    b16 = next(r for r in results if r.policy == "(c) paged, block 16")
    lines += [
        "",
        f"Paged blocks of 16 keep {100 * b16.util_alloc:.1f}% of the allocated KV memory holding "
        f"token states (target >= 96%), against {100 * results[0].util_alloc:.1f}% and "
        f"{100 * results[1].util_alloc:.1f}% for preallocation (the paper: 20.4-38.2%), and fit "
        f"{b16.running_mean / results[1].running_mean:.1f}x the requests of (b) in the same memory. "
        "The price is preemption: admission fills the pool, growth then preempts the most "
        "recently admitted request, which is recomputed (prefill work, batched; less with "
        "prefix caching, which keeps a preempted request's blocks findable). Keeping 1% of "
        "the blocks free at admission (the engine's default watermark) cuts that to "
        f"{100 * results[-1].recompute_frac:.1f}% of the tokens for "
        f"{100 * (results[-1].steps / results[-2].steps - 1):.1f}% more steps.",
    ]
    off, on = sharing
    lines += [
        "",
        f"Prefix sharing: {shared.name}: {shared.describe()}.",
        "",
        "| policy | logical context tokens per physical slot | requests at once (mean / max) "
        "| steps to drain | preemptions |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in sharing:
        lines.append(f"| {r.policy} | {r.logical_per_slot:.2f} | {r.running_mean:.1f} / "
                     f"{r.running_max} | {r.steps} | {r.preemptions} |")
    lines += [
        "",
        f"Prefix caching fits {on.running_mean / off.running_mean:.1f}x the requests at once "
        f"and drains the queue in {100 * on.steps / off.steps:.0f}% of the steps.",
    ]
    return "\n".join(lines)


def _comparison(res: list[Result], head: str, verdict: str) -> str:
    """A two-policy table (the baseline first) under ``head``, then ``verdict`` formatted
    with the second's ``ratio`` of requests at once and ``share`` (%) of the steps."""
    base, other = res
    lines = [head, "",
             "| policy | requests at once (mean / max) | steps to drain | preemptions | recomputed tokens |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in res:
        lines.append(f"| {r.policy} | {r.running_mean:.1f} / {r.running_max} | {r.steps} | "
                     f"{r.preemptions} | {100 * r.recompute_frac:.1f}% |")
    lines += ["", verdict.format(ratio=other.running_mean / base.running_mean,
                                 share=100 * other.steps / base.steps)]
    return "\n".join(lines)


def window_markdown(res: list[Result], wl: Workload, window: int) -> str:
    return _comparison(res, f"Sliding window: {wl.name}: {wl.describe()}; a {window}-token window "
                            "on every layer (the kind Mistral 7B v0.1 has: 4096 of 32k).",
                       "Giving blocks behind the window back fits {ratio:.1f}x the requests at "
                       "once and drains the queue in {share:.0f}% of the steps.")


def mixed_markdown(res: list[Result], window: int, ratio: int) -> str:
    return _comparison(res, f"Mixed windows: the same long contexts; {ratio} layers of a {window}-token "
                            "window to each full-attention layer (Gemma 3's pattern), the same memory.",
                       "KV cache groups fit {ratio:.1f}x the requests at once and drain the "
                       "queue in {share:.0f}% of the steps.")


def plot(results: list[Result], sharing: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.6), gridspec_kw={"width_ratios": [3, 3, 1.2]})
    short = {"(a)": "(a) reserve max_model_len", "(b)": "(b) reserve prompt+max_tokens",
             "(b*)": "(b*) reserve prompt+output"}
    labels = [short.get(r.policy.split()[0], r.policy.replace("(c) paged, block ", "(c) paged B=")
                        .replace(", prefix caching on", " + prefix cache")) for r in results]
    colors = ["#c44e52"] * 3 + ["#4c72b0"] * (len(results) - 3)
    ax = axes[0]
    vals = [100 * r.util_alloc for r in results]
    ax.bar(range(len(results)), vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(i, v + 1, f"{v:.1f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(results)), labels, fontsize=8, rotation=35, ha="right")
    ax.set_ylabel("% of allocated KV slots holding token states")
    ax.set_ylim(0, 110)
    ax.set_title("KV memory holding real token states")
    ax = axes[1]
    vals = [r.running_mean for r in results]
    ax.bar(range(len(results)), vals, color=colors)
    for i, v in enumerate(vals):
        ax.text(i, v + 0.5, f"{v:.0f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(results)), labels, fontsize=8, rotation=35, ha="right")
    ax.set_ylabel("running requests per step (mean)")
    ax.set_title("Requests that fit at once (same memory)")
    ax = axes[2]
    vals = [r.running_mean for r in sharing]
    ax.bar([0, 1], vals, color=["#4c72b0", "#55a868"])
    for i, v in enumerate(vals):
        ax.text(i, v + 0.5, f"{v:.0f}", ha="center", fontsize=8)
    ax.set_xticks([0, 1], ["prefix\ncaching off", "prefix\ncaching on"], fontsize=8)
    ax.set_title("Shared system prompt")
    ax.set_ylabel("running requests per step (mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--pool-slots", type=int, default=32768, help="KV cache size in token slots")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--shared-prompt-len", type=int, default=1024)
    ap.add_argument("--window", type=int, default=1024,
                    help="the sliding window of the long-context run (0: skip that run)")
    ap.add_argument("--window-requests", type=int, default=200)
    ap.add_argument("--window-pool-slots", type=int, default=131072)
    ap.add_argument("--mixed-ratio", type=int, default=5,
                    help="windowed layers to each full one in the mixed-window run (0: skip it)")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    args = ap.parse_args(argv)
    results, sharing, wl, shared = run(args.requests, args.pool_slots, args.max_model_len,
                                       args.shared_prompt_len)
    text = markdown(results, sharing, wl, shared, args.pool_slots, args.max_model_len)
    if args.window:
        wres, wwl = run_window(args.window_requests, args.window_pool_slots, args.window)
        text += (f"\n\nKV pool {args.window_pool_slots} token slots, max_model_len 16384.\n\n"
                 + window_markdown(wres, wwl, args.window))
        if args.mixed_ratio:
            mres, _ = run_mixed(args.window_requests, args.window_pool_slots, args.window,
                                args.mixed_ratio)
            text += "\n\n" + mixed_markdown(mres, args.window, args.mixed_ratio)
    cmd = "flashpage bench memory " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# KV memory efficiency (CPU simulation, no GPU needed)\n\n`{cmd.strip()}` "
            f"({time.strftime('%Y-%m-%d')})\n\n" + text)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.plot:
        plot(results, sharing, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
