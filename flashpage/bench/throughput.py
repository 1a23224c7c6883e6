"""`flashpage bench throughput`: offline output tokens/s on nano-vllm's workload, beside
transformers' generate on the same prompts in the same run, and the roofline estimate.

Default workload: 256 requests, input and output lengths uniform in 100-1024, random
token ids, ignore_eos (every request generates exactly its output length).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flashpage.bench.common import (
    bench_parser,
    build_bench_llm,
    hf_generate_throughput,
    hf_model,
    make_workload,
    result_header,
    sync,
    weight_bytes,
    write_json,
)


def roofline(engine, wl, bandwidth: float | None, flops: float | None, batch: int) -> dict:
    """Lower bound on time: every decode step reads all weights once (steps = output tokens
    / batch) plus the KV cache it attends to; every token costs 2 x params FLOPs."""
    mc = engine.model_config
    wbytes = weight_bytes(engine.model)
    params = sum(p.numel() * (8 if p.dtype == torch.int32 else 1)  # int4: 8 values a word
                 for p in {p.data_ptr(): p for p in engine.model.parameters()}.values())
    tokens = wl.num_prompt_tokens + wl.num_output_tokens
    steps = wl.num_output_tokens / batch
    kv_per_token = mc.kv_bytes_per_token(str(engine.dtype).replace("torch.", ""))
    # Mean context during decode ~ prompt + half the output; KV read once per output token.
    kv_bytes = sum((len(p) + o / 2) * o for p, o in zip(wl.prompts, wl.output_lens, strict=True)) * kv_per_token
    out = {"weight_bytes": wbytes, "decode_steps_at_batch": steps}
    if bandwidth:
        out["memory_seconds"] = (steps * wbytes + kv_bytes) / bandwidth
    if flops:
        out["compute_seconds"] = 2 * params * tokens / flops
    if "memory_seconds" in out or "compute_seconds" in out:
        t = max(out.get("memory_seconds", 0.0), out.get("compute_seconds", 0.0))
        out["roofline_output_tok_per_s"] = wl.num_output_tokens / t
    return out


def measure_ceilings(device: torch.device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        return None, None
    import triton.testing

    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    bw = 2 * n / (ms * 1e-3)
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: x @ x, return_mode="median")
    fl = 2 * 8192**3 / (ms * 1e-3)
    return bw, fl


def main(argv: list[str] | None = None) -> int:
    from flashpage.sampling_params import SamplingParams

    p = bench_parser("flashpage bench throughput", __doc__)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--temperature", type=float, default=0.6, help="nano-vllm's benchmark uses 0.6")
    p.add_argument("--hf-requests", type=int, default=None,
                   help="run transformers on only the first N requests (it is slow); scaled as tok/s")
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--workload-seed", type=int, default=0)
    args = p.parse_args(argv)

    llm, config = build_bench_llm(args)
    engine = llm.engine
    wl = make_workload(args.num_requests, tuple(args.input_len), tuple(args.output_len),
                       engine.model_config.vocab_size, args.workload_seed, avoid=engine.placeholder_token_ids())
    params = [SamplingParams(temperature=args.temperature, max_tokens=o, ignore_eos=True,
                             detokenize=False) for o in wl.output_lens]
    # Warm-up: compile kernels, capture graphs, touch the allocator.
    llm.generate(wl.prompts[:4], [SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)] * 4,
                 use_tqdm=False)
    sync(engine.device)
    timeline = _record_steps(engine)
    spans = _record_gpu_spans(engine)
    jit = _JitRecorder()
    t0 = time.perf_counter()
    with jit:
        outs = llm.generate(wl.prompts, params, use_tqdm=True)
        sync(engine.device)
    dt = time.perf_counter() - t0
    timeline.append((time.perf_counter(), 0, 0))
    failed = [o.error for o in outs if o.error is not None]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(outs)} requests failed; the first: {failed[0]}")
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == wl.num_output_tokens, (produced, wl.num_output_tokens)
    result = {
        **result_header("throughput", engine, config, args),
        "workload": {"requests": args.num_requests, "input_len": list(args.input_len),
                     "output_len": list(args.output_len), "prompt_tokens": wl.num_prompt_tokens,
                     "output_tokens": wl.num_output_tokens, "temperature": args.temperature},
        "flashpage": {"seconds": dt, "output_tok_per_s": produced / dt,
                      "total_tok_per_s": (produced + wl.num_prompt_tokens) / dt,
                      "preemptions": engine.scheduler.num_preemptions,
                      "kv_blocks": engine.num_blocks,
                      "steps": _step_summary(timeline, _gpu_ms(spans)),
                      # kernels Triton compiled (or loaded from its disk cache) inside the timed
                      # run: each one a specialization the warm-up did not reach
                      "jit_compiles": jit.counts()},
    }
    bw, fl = measure_ceilings(engine.device)
    if bw and fl:
        result["ceilings"] = {"copy_GBps": bw / 1e9, "bf16_matmul_TFLOPs": fl / 1e12}
    result["roofline"] = roofline(engine, wl, bw, fl, min(args.max_num_seqs, args.num_requests))
    if args.hf:
        n = args.hf_requests or args.num_requests
        sub = type(wl)(wl.prompts[:n], wl.output_lens[:n])
        model = hf_model(engine)
        hf = hf_generate_throughput(model, sub, args.hf_batch_size)
        hf["subset"] = n < args.num_requests
        hf["batch_size"] = args.hf_batch_size
        result["transformers"] = hf
        result["speedup_vs_transformers"] = result["flashpage"]["output_tok_per_s"] / hf["output_tok_per_s"]
    write_json(args.json_out, result)
    return 0


class _JitRecorder:
    """Within: the names of the Triton / Gluon kernels that get a new specialization
    (Triton's ``jit_cache_hook``: called before each in-process compile, whether the binary
    then comes from the disk cache or the compiler). Chains any hook already set."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._knobs: Any = None
        self._prev: Any = None

    def _hook(self, *, fn, **kwargs):
        self.names.append(getattr(fn, "name", str(fn)))
        return self._prev(fn=fn, **kwargs) if self._prev else None

    def __enter__(self) -> _JitRecorder:
        try:
            import triton
        except ImportError:
            return self
        self._knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
        if self._knobs is not None and hasattr(self._knobs, "jit_cache_hook"):
            self._prev = self._knobs.jit_cache_hook
            self._knobs.jit_cache_hook = self._hook
        else:
            self._knobs = None
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook = self._prev

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.names:
            out[n] = out.get(n, 0) + 1
        return out


def _record_steps(engine) -> list[tuple[float, int, int]]:
    """(time scheduled, requests, tokens) of every step from now on. Consecutive
    schedule() calls are one step apart (with async scheduling, one launch apart)."""
    steps: list[tuple[float, int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append((time.perf_counter(), len(out.scheduled), out.total_num_scheduled_tokens))
        return out

    engine.scheduler.schedule = recording
    return steps


def _record_gpu_spans(engine) -> list[tuple[Any, Any]]:
    """A CUDA event pair around the device work of every step from now on (empty on the
    CPU): recorded on the step's stream before its first launch and after its last, so a
    span is the time the GPU spent on that step's work, launch gaps inside it included,
    and not the idle time before it (a step whose host work ran late starts late)."""
    spans: list[tuple[Any, Any]] = []
    if engine.device.type != "cuda":
        return spans
    execute = engine.runner.execute

    def recording(out):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        result = execute(out)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        spans.append((start, end))
        return result

    engine.runner.execute = recording
    return spans


def _gpu_ms(spans: list[tuple[Any, Any]]) -> list[float] | None:
    """Milliseconds of each recorded span (after the run's final sync); None: none recorded."""
    return [a.elapsed_time(b) for a, b in spans] if spans else None


def _step_summary(timeline: list[tuple[float, int, int]], gpu_ms: list[float] | None = None) -> dict:
    """Where the wall time went: steps with prompt tokens vs decode-only steps by batch;
    with ``gpu_ms`` (one per step, in order) also the GPU's time per step in each group
    (wall time well above it: the host, not the GPU, set the pace)."""
    groups: dict[str, list[float]] = {}
    gpu: dict[str, list[float]] = {}
    for i, ((t, seqs, tokens), (t_next, _, _)) in enumerate(zip(timeline, timeline[1:], strict=False)):
        if not seqs:
            continue
        if tokens > seqs:
            key = "with_prompt_tokens"
        else:
            key = next(f"decode_batch_{lo}_{hi}" for lo, hi in
                       ((1, 31), (32, 127), (128, 1 << 20)) if lo <= seqs <= hi)
        groups.setdefault(key, []).append(t_next - t)
        if gpu_ms is not None and i < len(gpu_ms):
            gpu.setdefault(key, []).append(gpu_ms[i])
    summary: dict[str, dict[str, Any]] = {
        k: {"steps": len(v), "seconds": round(sum(v), 3), "ms_per_step": round(1e3 * sum(v) / len(v), 3)}
        for k, v in sorted(groups.items())}
    for k, v in gpu.items():
        summary[k]["gpu_ms_per_step"] = round(sum(v) / len(v), 3)
    if "with_prompt_tokens" in gpu:  # each prompt step apart: a one-off stall shows as one outlier
        summary["with_prompt_tokens"]["gpu_ms"] = [round(x, 1) for x in gpu["with_prompt_tokens"]]
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
