"""GPU timing (and inputs) shared by the kernel benchmarks (run as ``python3
benchmarks/<name>.py``, so this module is importable as ``gpu_timing``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def capture_graph(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn()``, after two eager warm-up calls on a side
    stream, replayed once (its first replay out of the way)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_replay(graph: torch.cuda.CUDAGraph) -> float:
    """Seconds of one replay of ``graph``, between two events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def event_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Median microseconds of single eager ``fn()`` calls, each between two CUDA events
    after one warm call: the GPU's time of a call with its launches' host gaps in it."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def time_graph(fn: Callable[[], object], calls: int = 1, reps: int = 20) -> float:
    """Median seconds of one ``fn()`` call: a CUDA graph of ``calls`` calls (capture_graph),
    replayed ``reps`` times after three warm replays, each replay between two events."""
    graph = capture_graph(fn, calls)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    times = [time_replay(graph) / calls for _ in range(reps)]
    del graph
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], calls: int = 10) -> float:
    """Median milliseconds of one ``fn()`` call from CUDA-graph replays (time_graph): the
    kernels' own time, without the host's per-call work (argument checks, planning), which
    under do_bench outweighs a small kernel (run 186's windowed decodes timed 56-206 us
    for 1-4 MB of keys)."""
    return time_graph(fn, calls) * 1e3


def graph_kernel_times(fn: Callable[[], object], reps: int = 5) -> dict[str, float]:
    """Seconds of GPU time per kernel name in one replay of a CUDA graph of ``fn()``, under
    torch.profiler (CUPTI records each kernel a graph launches): where a call's time goes
    between its kernels; what time_graph measures beyond their sum is gaps between them."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    del graph
    return {e.key: e.self_device_time_total / 1e6 / reps
            for e in prof.key_averages() if e.self_device_time_total > 0}


def copy_bandwidth() -> float:
    """A 4 GiB device-to-device copy, GB/s of bytes read + written.

    Events around each copy, outside a graph, as tools/gpu_baselines.py does: median of
    20 after 100 warm-up copies that bring the clocks up. (A graph-captured ``copy_`` read
    only 2.7 TB/s on an H200 here, 2026-11-30, against 4.27 TB/s this way.)
    """
    n = 2 * 1024**3
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(100):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times) / 1e9


def paged_cache(batch: int, ctx: int, kv_heads: int, head_dim: int, g: torch.Generator,
                page: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random bf16 paged K/V cache of ``batch`` sequences of ``ctx`` tokens on CUDA, the
    blocks in random order: (key_cache, value_cache [blocks, page, kv_heads, head_dim],
    block_tables [batch, blocks per sequence] int32, seq_lens [batch] int32)."""
    blocks = -(-ctx // page)
    kc = torch.randn(batch * blocks, page, kv_heads, head_dim, generator=g, device="cuda").bfloat16()
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * blocks, generator=g, device="cuda").int().view(batch, blocks)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return kc, vc, tables, lens


def run_attention_cases(name: str, doc: str | None, decode_rows: Callable[[int, int], list[dict]],
                        prefill_rows: Callable[[int], list[dict]]) -> None:
    """The main of the attention-variant benchmarks (attention_alibi / _sinks / _softcap.py):
    ``--out``; decode at 1 x 8192, 32 x 2048, 128 x 1024 and prefill of 1024 / 4096 / 8192
    tokens, one JSON row per case printed and all in $OUT/<name>.json."""
    import argparse
    import json
    import os
    import sys

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"{name}.py needs a CUDA GPU")
        sys.exit(1)
    rows: list[dict] = []
    for batch, ctx in ((1, 8192), (32, 2048), (128, 1024)):
        rows += decode_rows(batch, ctx)
    for tokens in (1024, 4096, 8192):
        rows += prefill_rows(tokens)
    for r in rows:
        print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
