"""What LoRA adapters cost: the same greedy batch with and without ``enable_lora``.

One model shape (random --config weights, or --model), random PEFT adapters of that shape
written to a temporary folder (every attention and MLP projection, rank --rank), then per
batch size, each mode timed over the same prompts (output tokens/s and the mean step):

- base: an engine without LoRA
- lora, none: an engine with ``max_loras`` slots, no request naming an adapter (the delta
  still runs: the kernels launch and read no weights; the dense path computes every slot's
  columns, masked)
- lora, one: every request under one adapter
- lora, mixed: requests spread over ``--max-loras`` adapters, all in the same steps

    python benchmarks/lora.py --config llama-3-8b --batch-sizes 1 16 64 --max-loras 4 --rank 16 --json-out $OUT/lora.json

The engine adds the delta through kernels/lora.py's gathered kernels on CUDA at steps of up
to KERNEL_MAX_TOKENS tokens; FLASHPAGE_LORA_KERNELS=0 in the environment times the dense
torch path instead (A/B).

``--kernels`` (GPU only) times the delta alone instead, per adapted linear of the 8B shape
(qkv 4096 -> 6144 with n = 3 x rank, o 4096 -> 4096, gate_up 4096 -> 28672, down
14336 -> 4096), ``--max-loras`` slots: the dense torch path (shrink GEMM over every slot,
mask, expand addmm) against lora_shrink + lora_expand, beside the base GEMM, at
T = 1, 16, 64, 256 with tokens over all slots (mixed), one slot, or none; us per call, the
median of CUDA-graph replays of 20 calls (benchmarks/gpu_timing.py):

    python benchmarks/lora.py --kernels --max-loras 4 --rank 16 --json-out $OUT/lora_kernels.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from flashpage import LLM, LoRARequest, SamplingParams
from flashpage.bench.common import resolve_config


def write_adapters(llm: LLM, root: Path, n: int, rank: int) -> list[LoRARequest]:
    """``n`` random adapters (std 0.02, alpha = 2 rank) over every target of the model."""
    from safetensors.torch import save_file

    assert llm.engine.lora is not None
    targets = llm.engine.lora.targets
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for path, shape in targets.items():
            key = f"base_model.model.{path}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, shape.in_features, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(shape.out_features, rank, generator=g) * 0.02
        folder = root / f"adapter{i}"
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        short = sorted({p.rsplit(".", 1)[-1] for p in targets})
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": short,
             "bias": "none"}))
        out.append(LoRARequest(f"adapter{i}", i + 1, str(folder)))
    return out


def _time(llm: LLM, prompts: list[list[int]], params: SamplingParams,
          loras: list[LoRARequest | None], iters: int) -> dict[str, Any]:
    eng = llm.engine
    llm.generate(prompts, params, lora_request=loras, use_tqdm=False)  # warm (slots loaded)
    best = None
    for _ in range(iters):
        n0 = eng.scheduler.num_steps
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        run = {"tok_s": tokens / dt, "step_ms": 1e3 * dt / max(eng.scheduler.num_steps - n0, 1)}
        if best is None or run["tok_s"] > best["tok_s"]:
            best = run
    assert best is not None
    return best


# (name, in, out, slices) of the 8B shape's adapted linears
KERNEL_SHAPES = (("qkv", 4096, 6144, 3), ("o", 4096, 4096, 1), ("gate_up", 4096, 28672, 2),
                 ("down", 14336, 4096, 1))


def kernel_bench(num_slots: int, rank: int, tokens: tuple[int, ...] = (1, 16, 64, 256),
                 dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """us per call of the dense delta, the kernels' and the base GEMM, per shape, T and mix."""
    if not torch.cuda.is_available():
        raise SystemExit("--kernels needs a CUDA GPU")
    rows: list[dict[str, Any]] = []
    for name, k, out, slices in KERNEL_SHAPES:
        rows += _bench_shape(name, k, out, slices * rank, num_slots, tokens, dtype)
        torch.cuda.empty_cache()
    return rows


def _bench_shape(name: str, k: int, out: int, n: int, num_slots: int, tokens: tuple[int, ...],
                 dtype: torch.dtype) -> list[dict[str, Any]]:
    import torch.nn.functional as F
    from gpu_timing import time_graph  # benchmarks/, the script's folder

    from flashpage.kernels.lora import default_shrink_config, lora_expand, lora_shrink

    w = torch.randn(out, k, device="cuda", dtype=dtype) * 0.02
    a = torch.randn(num_slots * n, k, device="cuda", dtype=dtype) * 0.02
    b = torch.randn(out, num_slots * n, device="cuda", dtype=dtype) * 0.02
    col_slot = torch.arange(num_slots, device="cuda").repeat_interleave(n)
    rows = []
    for t in tokens:
        x = torch.randn(t, k, device="cuda", dtype=dtype)
        y = torch.zeros(t, out, device="cuda", dtype=dtype)
        base_us = 1e6 * time_graph(lambda x=x: F.linear(x, w), calls=20)
        for mix in ("mixed", "one", "none"):
            slots = {"mixed": torch.arange(t, device="cuda") % num_slots,
                     "one": torch.zeros(t, dtype=torch.long, device="cuda"),
                     "none": torch.full((t,), -1, device="cuda")}[mix]

            def dense(x=x, y=y, slots=slots):
                xa = F.linear(x, a) * (slots[:, None] == col_slot[None, :]).to(x.dtype)
                return torch.addmm(y, xa, b.t())

            def kernels(x=x, y=y, slots=slots):
                return lora_expand(lora_shrink(x, a, slots, n), b, slots, n, y)

            looped_cfg = replace(default_shrink_config(t), slot_grid=False)

            def looped(x=x, y=y, slots=slots, cfg=looped_cfg):  # the shrink's slots in one program
                return lora_expand(lora_shrink(x, a, slots, n, cfg), b, slots, n, y)

            row: dict[str, Any] = {
                "linear": name, "in": k, "out": out, "n": n, "tokens": t, "mix": mix,
                "base_us": base_us, "dense_us": 1e6 * time_graph(dense, calls=20),
                "kernels_us": 1e6 * time_graph(kernels, calls=20),
                "looped_us": 1e6 * time_graph(looped, calls=20)}
            rows.append(row)
            print(f"{name:8s} T {t:4d}  {mix:5s}  base GEMM {row['base_us']:7.1f} us  dense "
                  f"delta {row['dense_us']:7.1f} us  kernels {row['kernels_us']:7.1f} us  "
                  f"({row['dense_us'] / row['kernels_us']:.2f}x; slots looped "
                  f"{row['looped_us']:7.1f} us)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/lora.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama-3-8b", help="random weights of this config")
    p.add_argument("--model", default=None, help="a checkpoint instead of --config")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--json-out", default=None)
    p.add_argument("--kernels", action="store_true",
                   help="time the delta's kernels against the dense path per linear (GPU)")
    args = p.parse_args(argv)
    if args.kernels:
        rows = kernel_bench(args.max_loras, args.rank)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"args": vars(args), "kernels": rows},
                                                      indent=2))
        return 0
    cfg = None if args.model else resolve_config(args.config)
    kw: dict[str, Any] = dict(device=args.device, random_weights_config=cfg,
                              max_model_len=args.input_len + args.output_len + 16,
                              max_num_seqs=max(args.batch_sizes))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    results: dict[str, Any] = {"args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        lora_llm = LLM(args.model, enable_lora=True, max_loras=args.max_loras,
                       max_lora_rank=args.rank, **kw)
        vocab = lora_llm.engine.model_config.vocab_size
        adapters = write_adapters(lora_llm, Path(tmp), args.max_loras, args.rank)
        for bs in args.batch_sizes:
            prompts = torch.randint(3, vocab, (bs, args.input_len), generator=g).tolist()
            modes = {"lora, none": [None] * bs, "lora, one": [adapters[0]] * bs,
                     "lora, mixed": [adapters[i % len(adapters)] for i in range(bs)]}
            for mode, loras in modes.items():
                r = _time(lora_llm, prompts, params, loras, args.iters)
                results["runs"].append({"batch": bs, "mode": mode, **r})
                print(f"bs {bs:4d}  {mode:12s}  {r['tok_s']:9.1f} tok/s  {r['step_ms']:7.2f} ms/step",
                      flush=True)
        del lora_llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        base = LLM(args.model, **kw)
        for bs in args.batch_sizes:
            prompts = torch.randint(3, vocab, (bs, args.input_len), generator=g).tolist()
            r = _time(base, prompts, params, [None] * bs, args.iters)
            results["runs"].append({"batch": bs, "mode": "base", **r})
            print(f"bs {bs:4d}  {'base':12s}  {r['tok_s']:9.1f} tok/s  {r['step_ms']:7.2f} ms/step",
                  flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
