"""What the throughput and latency benchmarks share: model choice, workload, HF baseline."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_REPO = Path(__file__).resolve().parents[2]
# Real configs: ../shared/configs beside the checkout, and copies in benchmarks/configs
# (the GPU machine gets the repository only).
CONFIG_DIRS = [_REPO.parent / "shared" / "configs", _REPO / "benchmarks" / "configs"]


def bench_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser with the model choice and every engine flag."""
    from flashpage.cli import add_engine_arguments

    p = argparse.ArgumentParser(prog=prog, description=doc)
    add_model_arguments(p)
    add_engine_arguments(p)
    return p


def build_bench_llm(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The LLM a benchmark runs (random weights when --config names a shape), and that config."""
    from flashpage.cli import build_llm

    config = resolve_config(args.config)
    args.random_weights_config = config
    return build_llm(args), config


def result_header(benchmark: str, engine: Any, config: str | None,
                  args: argparse.Namespace) -> dict[str, Any]:
    """What every benchmark result starts with: what ran, where, and when."""
    import datetime

    return {
        "benchmark": benchmark,
        "date": datetime.date.today().isoformat(),
        "device": device_name(engine.device),
        "model": config or args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
        "dtype": str(engine.dtype).replace("torch.", ""),
        "attention_backend": engine.backend_name,
        "kv_cache_dtype": str(getattr(engine, "kv_dtype", engine.dtype)).replace("torch.", ""),
        "quantization": getattr(engine.config, "quantization", None),
        # Which decode-batch GEMM each linear shape uses at 1/2/4/8 rows (timed at start-up).
        "decode_gemm": {shape: {str(rows): pick for rows, (pick, _) in by_rows.items()}
                        for shape, by_rows in getattr(engine, "skinny_report", {}).items()},
        # Kernel switches that change GPU timing (flashpage/envs.py).
        "switches": {k: v for k, v in os.environ.items() if k.startswith("FLASHPAGE_")},
    }


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="random weights of this shape: a config.json, its folder, or a name "
                        "under ../shared/configs (e.g. llama-3-8b)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also run transformers' generate on the same prompts (default on)")
    p.add_argument("--json-out", default=None, help="write the results as JSON here")


def resolve_config(name: str | None) -> str | None:
    if name is None:
        return None
    if os.path.exists(name):
        return name
    for d in CONFIG_DIRS:
        if (d / name).exists():
            return str(d / name)
    raise ValueError(f"--config {name!r}: not a path, nor a folder under "
                     + " or ".join(str(d) for d in CONFIG_DIRS))


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int,
                  seed: int = 0, avoid: set[int] | frozenset[int] = frozenset()) -> Workload:
    """nano-vllm's benchmark workload: lengths uniform in the ranges, random token ids;
    ``avoid`` (an image model's placeholders: LLMEngine.placeholder_token_ids) replaced by the
    next id not among them."""
    g = torch.Generator().manual_seed(seed)
    ins = torch.randint(in_range[0], in_range[1] + 1, (num,), generator=g).tolist()
    outs = torch.randint(out_range[0], out_range[1] + 1, (num,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in ins]
    if avoid:
        prompts = [[next(u % vocab for u in range(t, t + len(avoid) + 1) if u % vocab not in avoid)
                    if t in avoid else t for t in p] for p in prompts]
    return Workload(prompts, outs)


def hf_model(engine: Any) -> Any:
    """A transformers model of the engine's shape and weights (same dtype and device)."""
    import transformers

    src = engine.source
    dtype, device = engine.dtype, engine.device
    if src.kind == "hf":
        return transformers.AutoModelForCausalLM.from_pretrained(
            src.path, dtype=dtype).to(device).eval()
    if src.kind == "gguf":
        folder, name = os.path.split(src.path)
        return transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=dtype).to(device).eval()
    cfg = transformers.AutoConfig.for_model(**_hf_config_dict(engine.model_config.raw))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    # Same weights as ours (the speed does not depend on them, but it costs nothing).
    from flashpage.layers.quant import dequantized_parameters

    named = getattr(engine.model, "hf_weights", lambda: dequantized_parameters(engine.model))
    ours = dict(named())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ours and ours[name].shape == p.shape:
                p.copy_(ours[name])
    return model.eval()


def _hf_config_dict(raw: dict[str, Any]) -> dict[str, Any]:
    d = dict(raw)
    d.pop("architectures", None)
    return d


@torch.inference_mode()
def hf_generate_throughput(model: Any, wl: Workload, batch_size: int, pad_id: int = 0) -> dict[str, Any]:
    """transformers' generate over the workload in batches (left-padded, ignoring eos).

    Each batch generates until its longest requested output; only the requested output
    tokens are counted, so padding and over-generation count against it, as they would
    for a user serving this workload with it."""
    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    total_time, done = 0.0, 0
    for start in range(0, len(wl.prompts), batch_size):
        prompts = wl.prompts[start:start + batch_size]
        outs = wl.output_lens[start:start + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(outs),
                       min_new_tokens=max(outs), do_sample=False, pad_token_id=pad_id)
        sync(device)
        total_time += time.perf_counter() - t0
        done += sum(outs)
    return {"requests": len(wl.prompts), "output_tokens": done, "seconds": total_time,
            "output_tok_per_s": done / total_time}


def sync(device: torch.device | None = None) -> None:
    """Wait for ``device``'s work (None: the current CUDA device, if any) before reading a
    clock."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], iters: int, device: torch.device | None = None) -> float:
    """The median wall time of ``iters`` calls of ``fn`` after one warm-up call, each timed
    to its device work's end (``sync``)."""
    fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def weight_bytes(model: torch.nn.Module, tokens: int | None = None) -> int:
    """Bytes of the model's parameters (tied ones once). With ``tokens``: what a step of
    that many tokens reads at most, i.e. a module with ``read_fraction`` (the routed
    experts of an MoE layer) counts only that share. The embedding table counts whole in
    both (a step reads one row per token: the limit this gives is a conservative one, as
    ANCHORS.md's weight-read limit is)."""
    share: dict[int, float] = {}
    if tokens is not None:
        for m in model.modules():
            fraction = getattr(m, "read_fraction", None)
            if callable(fraction):
                for p in [*m.parameters(), *m.buffers()]:
                    share[p.data_ptr()] = float(fraction(tokens))
    seen: set[int] = set()
    total = 0.0
    # fp8 scales; int4 scales and zeros; MXFP4 experts' e2m1 blocks and e8m0 scales
    scales = [b for name, b in model.named_buffers()
              if name.endswith(("weight_scale", "w4_scales", "w4_zeros", "_proj_blocks",
                                "_proj_scales"))]
    tensors: list[torch.Tensor] = [*model.parameters(), *scales]
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size() * share.get(t.data_ptr(), 1.0)
    return int(total)


def write_json(path: str | None, result: dict[str, Any]) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
