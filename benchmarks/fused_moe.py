"""MoE experts benchmark (GPU): the fused Triton kernel beside the torch paths it
replaces up to SYNC_FREE_MAX_TOKENS tokens (sync-free: as it picks, and each of its two
ways on its own, gathered and every expert on every token) and the grouped path (one
matmul per used expert, one host sync), with the copy bandwidth, in one run.

Two expert shapes (``--model``), T tokens each, uniform random top-k routing (seeded):

- deepseek-v2-lite (benchmarks/configs/deepseek-v2-lite: E=64, top-6, hidden 2048,
  moe_intermediate 1408, bf16: 1.1 GB of expert weights per layer), T in {1, 4, 16, 64, 256};
- gpt-oss-20b (benchmarks/configs/gpt-oss-20b: E=32, top-4, hidden 2880, intermediate
  2880, bf16: 1.6 GB per layer; per-expert biases and the clamped SwiGLU,
  models/gpt_oss.GptOssExperts), T in {1, 8, 32, 64, 128, 512}; beside the bf16 paths the same
  experts held as its checkpoint holds them, MXFP4 (0.42 GB per layer, random bytes, scales
  around 2 ** -7): the fused kernel reading them (``fused mxfp4``), and the grouped path
  that dequantizes one expert at a time (``torch grouped, mxfp4 dequantized``: what a
  prompt past 512 tokens runs).

LAYERS copies of the weights are cycled so no call finds the previous call's weights in
the 60 MB L2, as in a model.

GB/s = bytes of the weights the tokens need (the distinct routed experts' gate_up + down,
in the format the path reads: bf16, or MXFP4's 4.25 bits a weight for the mxfp4 rows,
``needed MB``) / time: the same numerator for every bf16 path, so the column compares them
directly; `all experts` gives what the every-expert path actually reads. An mxfp4 row's
time against the bf16 fused row's is the speed-up; its GB/s how near the copy ceiling its
smaller reads get. Times: CUDA events around
ITERS calls after a warm-up, eager (outside a graph); all but grouped also inside a CUDA
graph (launch overhead gone, as in decode steps; grouped cannot be captured). The
gathered path copies each (token, slot) pair's expert weights: it is left out where that
copy would pass GATHER_MAX_BYTES (the sync-free path takes it only for 3 * T * k <= E).
The copy ceiling: a 1 GiB device-to-device copy timed the same way, bytes read + written.

    python benchmarks/fused_moe.py --out $OUT                     # ~30-60 s on an H200
    python benchmarks/fused_moe.py --sweep --out $OUT             # also tile configs of ours
    python benchmarks/fused_moe.py --model gpt-oss-20b --out $OUT
    python benchmarks/fused_moe.py --model gpt-oss-20b --mxfp4-sweep --out $OUT
                              # MXFP4 forms and tiles (MXFP4_TILES: 18 configs a size; run 192's
                              # 14 took 94 s)
    python benchmarks/fused_moe.py --fp8 --out $OUT                # ~80-160 s on an H200
    python benchmarks/fused_moe.py --int4 --out $OUT               # ~1-3 min on an H200 (untimed)

``--fp8``: block-scaled fp8 experts (kernels/fused_moe_fp8.py) at Qwen3-30B-A3B's expert
shape (FP8_SHAPE: hidden 2048, moe_intermediate 768, 128 experts, top-8; the shape of
Qwen3-30B-A3B-FP8's experts, 128 x 128 blocks), T in {1, 8, 32, 128, 512}: the bf16 fused
kernel, then the fp8 one on the same weights quantized per block (its default config, and
each of its modes at the default's rows a block: weight-only, W8A8 unswapped with a
quantizer launch between the GEMMs, W8A8 unswapped quantizing the activation in gate_up's
epilogue; W8A8 unswapped at 64 rows, where its dots are e4m3 warpgroup MMAs; and the
swapped W8A8 form at 16 and 32 rows, the weights' features the warpgroup MMA's M, on fp16
wgmmas (e4m3 widened: the unswapped tile's sums) and on e4m3 ones ("swap e4m3": Hopper's
e4m3 accumulator, ~0.5% off), and on e4m3 ones at 16 quantizing the activation in gate_up;
each row's name is its config's, "swap" in it where swapped); GB/s over the bytes each reads
(bf16: 2 a weight, fp8: 1 plus the tiles' scales), and each output's relative difference
from the bf16 kernel's (W8A8 rounds the activations: ~5%). Writes $OUT/fused_moe_fp8.json
and .md.

``--int4``: int4 experts kept packed (kernels/fused_moe_int4.py: an AWQ / GPTQ checkpoint's,
Qwen3-30B-A3B-AWQ / -GPTQ-Int4's shape, groups of 128 along K) at the same shape and T:
the bf16 fused kernel on the dequantized weights, then the int4 kernel's default config
and INT4_TILES: its "dot" form with K tiles of 128 at 16 / 32 / 64 rows a block and its
former decode default, its "swap" form (paths named "int4 swap ...") at 16 / 32 / 64 rows
and 1 / 3 stages; GB/s over the bytes
each reads (bf16: 2 a weight, int4: half a byte plus an fp16 scale and a uint8 zero per
128), each output's relative difference from the bf16 kernel's (bf16 rounding: < 1%).
Writes $OUT/fused_moe_int4.json and .md.

Without --fp8 / --int4 it writes $OUT/fused_moe.json and $OUT/fused_moe.md (deepseek-v2-lite),
or $OUT/fused_moe_<model>.json / .md for another model. Without a GPU it runs tiny shapes in
the Triton interpreter (a smoke test of the script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flashpage
GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import tests.conftest  # noqa: F401  (its numpy fix for the interpreter)

import dataclasses  # noqa: E402

from flashpage.config import ModelConfig  # noqa: E402
from flashpage.kernels.fused_moe import (  # noqa: E402
    FusedMoEConfig,
    default_config,
    fused_moe,
    fused_moe_mxfp4,
)
from flashpage.kernels.fused_moe_fp8 import FusedMoEFp8Config, fused_moe_fp8  # noqa: E402
from flashpage.kernels.fused_moe_fp8 import default_config as fp8_default_config  # noqa: E402
from flashpage.kernels.fused_moe_int4 import FusedMoEInt4Config, fused_moe_int4  # noqa: E402
from flashpage.kernels.fused_moe_int4 import default_config as int4_default_config  # noqa: E402
from flashpage.kernels.int4_gemm import dequantize_int4_ref, pack_int4  # noqa: E402
from flashpage.layers.moe import FusedExperts  # noqa: E402
from flashpage.models.gpt_oss import GptOssExperts  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
MODELS = {"deepseek-v2-lite": [1, 4, 16, 64, 256], "gpt-oss-20b": [1, 8, 32, 64, 128, 512]}
GATHER_MAX_BYTES = 4 << 30
LAYERS = 4 if GPU else 1
ITERS = 40 if GPU else 2
DEV = "cuda" if GPU else "cpu"
DT = torch.bfloat16 if GPU else torch.float32  # the interpreter computes bf16 wrongly
SWEEP = [FusedMoEConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
         for bm in (16, 32) for bn, bk, w, s in ((32, 128, 4, 3), (64, 128, 4, 3),
                                                 (64, 64, 4, 4), (128, 64, 8, 3))]
# --mxfp4-sweep: (form, block_n, block_k, warps, stages) at the default config's block_m and
# at twice it (up to 64: fewer blocks an expert, so fewer upcasts of its weights). "scaled":
# its default and the one tile level with it in run 192 (n128 k64, n32 k64, k128 s4 and 8
# warps lost there at every size); "swap" (the weight tile as wgmma's first operand, decoded
# in its register fragment; K tiles of 128 only) at 64 / 128 rows of weights, unpipelined
# (its layout as compiled on the CPU) and 3 stages; "swap_scaled" (tl.dot_scaled, the same
# orientation).
MXFP4_TILES = [("tile", 32, 128, 4, 3), ("scaled", 64, 128, 4, 3), ("scaled", 64, 64, 4, 4),
               ("swap", 64, 128, 4, 1), ("swap", 64, 128, 4, 3), ("swap", 128, 128, 4, 1),
               ("swap", 128, 128, 8, 1), ("swap_scaled", 64, 128, 4, 3),
               ("swap_scaled", 128, 64, 4, 3)]


def mxfp4_sweep(t: int, k: int, e: int) -> list[FusedMoEConfig]:
    bm = default_config(t * k, e).block_m
    return [FusedMoEConfig(m, bn, bk, w, s, mxfp4_form=form)
            for m in sorted({bm, min(64, 2 * bm)}) for form, bn, bk, w, s in MXFP4_TILES
            if GPU or not form.endswith("scaled")]  # tl.dot_scaled: bf16 only


def make_layers(cfg: ModelConfig, hidden: int, inter: int, mxfp4: bool = False) -> list[FusedExperts]:
    """LAYERS FusedExperts (GptOssExperts for GPT-OSS: with biases) with random bf16
    weights on the device (built on meta, so no fp32 copy is ever allocated); ``mxfp4``:
    GptOssExperts holding MXFP4 (random e2m1 bytes, e8m0 scales 2 ** -7 +- 2: weights of
    ~0.02, the 16-bit ones' scale)."""
    layers = []
    g = torch.Generator(device=DEV).manual_seed(0)

    def param(*shape: int, scale: float) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(*shape, device=DEV, dtype=DT, generator=g) * scale,
                                  requires_grad=False)

    for _ in range(LAYERS):
        if mxfp4:
            with torch.device(DEV):
                ex = GptOssExperts(dataclasses.replace(cfg, mxfp4_kernel=True))
            ex.to(DT)
            for name, buf in ex.named_buffers():
                if name.endswith("_blocks"):
                    buf.random_(0, 256, generator=g)
                elif name.endswith("_scales"):
                    buf.random_(118, 123, generator=g)
            assert ex.gate_up_proj_bias is not None and ex.down_proj_bias is not None
            ex.gate_up_proj_bias.data.normal_(0, 0.1, generator=g)
            ex.down_proj_bias.data.normal_(0, 0.1, generator=g)
            layers.append(ex)
            continue
        with torch.device("meta"):
            ex = GptOssExperts(cfg) if cfg.architecture == "GptOssForCausalLM" else FusedExperts(cfg)
        e = ex.num_experts
        ex.gate_up_proj = param(e, 2 * inter, hidden, scale=hidden ** -0.5)
        ex.down_proj = param(e, hidden, inter, scale=inter ** -0.5)
        if ex.gate_up_proj_bias is not None:
            ex.gate_up_proj_bias = param(e, 2 * inter, scale=0.1)
            ex.down_proj_bias = param(e, hidden, scale=0.1)
        layers.append(ex)
    return layers


def time_calls(fn: Callable[[int], object], iters: int = ITERS) -> float:
    """Seconds per call of fn(i), i cycling over the layers; events, after a warm-up."""
    for i in range(max(3, LAYERS)):
        fn(i % LAYERS)
    if not GPU:
        t0 = time.perf_counter()
        for i in range(iters):
            fn(i % LAYERS)
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(iters):
        fn(i % LAYERS)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def time_graph(fn: Callable[[int], object], reps: int = 10) -> float:
    """Seconds per call inside a CUDA graph of 2 * LAYERS calls (every layer twice)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(LAYERS):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    calls = 2 * LAYERS
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % LAYERS)
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / (reps * calls)


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB copy (about one layer's experts), bytes read + written."""
    if not GPU:
        return 0.0  # no copy ceiling without a GPU
    src = torch.empty(2**29, device=DEV, dtype=DT).normal_()
    dst = [torch.empty_like(src) for _ in range(LAYERS)]  # cycle: not the last call's lines
    t = time_calls(lambda i: dst[i].copy_(src), iters=20)
    return 2 * src.numel() * src.element_size() / t / 1e9


def routing(t: int, k: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random top-k (distinct per token) and fp32 weights, on the device."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).topk(k, dim=-1).indices
    return ids.to(DEV), (torch.rand(t, k, generator=g) * 0.5).to(DEV)


def bench_tokens(layers: list[FusedExperts], t: int, k: int, sweep: bool,
                 mx_layers: list[FusedExperts] | None = None, mx_sweep: bool = False
                 ) -> list[dict]:
    ex0 = layers[0]
    e, two_i, hidden = ex0.gate_up_proj.shape
    expert_bytes = 3 * (two_i // 2) * hidden * ex0.gate_up_proj.element_size()
    mx_expert_bytes = 3 * (two_i // 2) * hidden * 17 // 32  # half a byte + a byte per 32
    ids, w = routing(t, k, e, seed=t)
    x = torch.randn(t, hidden, device=DEV, dtype=DT)
    distinct = ids.unique().numel()
    needed = distinct * expert_bytes
    with torch.no_grad():
        ours, ref = layers[0].forward_fused(x, w, ids), layers[0].forward_sync_free(x, w, ids)
    base = dict(tokens=t, distinct_experts=distinct, needed_mb=round(needed / 1e6, 1),
                all_experts_mb=round(e * expert_bytes / 1e6),
                max_diff_vs_sync_free=float((ours.float() - ref.float()).abs().max()))

    def weighted(ys: torch.Tensor) -> torch.Tensor:  # as forward_sync_free finishes
        return (ys * w[..., None]).to(x.dtype).sum(1)

    picks = "gathered" if 3 * t * k <= e else "all experts"
    paths: dict[str, Callable[[int], object]] = {
        f"fused (default {default_config(t * k, e).name})": lambda i: layers[i].forward_fused(x, w, ids),
        f"torch sync-free ({picks})": lambda i: layers[i].forward_sync_free(x, w, ids),
        "torch all experts": lambda i: weighted(layers[i]._all_experts(x, ids)),
        "torch gathered": lambda i: weighted(layers[i]._gathered(x, ids)),
        "torch grouped": lambda i: layers[i].forward_grouped(x, w, ids),
    }
    mx_paths: dict[str, Callable[[int], object]] = {}
    if mx_layers is not None:
        mx = mx_layers
        mx_paths = {
            f"fused mxfp4 (default {default_config(t * k, e, DT).mxfp4_form} "
            f"{default_config(t * k, e, DT).name})":
                lambda i: mx[i].forward_fused(x, w, ids),
            "torch grouped, mxfp4 dequantized": lambda i: mx[i].forward_grouped(x, w, ids),
        }
        configs = (SWEEP if sweep else []) + (mxfp4_sweep(t, k, e) if mx_sweep else [])
        if configs:
            for cfg in configs:
                mx_paths[f"fused mxfp4 {cfg.mxfp4_form} {cfg.name}"] = lambda i, cfg=cfg: fused_moe_mxfp4(
                    x, mx[i].gate_up_proj_blocks, mx[i].gate_up_proj_scales,
                    mx[i].down_proj_blocks, mx[i].down_proj_scales, ids, w, cfg,
                    gate_up_bias=mx[i].gate_up_proj_bias, down_bias=mx[i].down_proj_bias,
                    activation=mx[i].activation)
        with torch.no_grad():  # against the same MXFP4 weights dequantized (sync-free)
            mx_diff = float((mx[0].forward_fused(x, w, ids).float()
                             - mx[0].forward_sync_free(x, w, ids).float()).abs().max())
        mx_needed = distinct * mx_expert_bytes
        mx_base = dict(base, needed_mb=round(mx_needed / 1e6, 1),
                       all_experts_mb=round(e * mx_expert_bytes / 1e6),
                       max_diff_vs_sync_free=mx_diff)
    rows = []
    gather_bytes = t * k * expert_bytes
    if gather_bytes > GATHER_MAX_BYTES:
        del paths["torch gathered"]
        rows.append(dict(base, path="torch gathered",
                         error=f"skipped: it would copy {gather_bytes / 1e9:.1f} GB of weights"))
        print(json.dumps(rows[-1]), flush=True)
    if sweep:
        for cfg in SWEEP:
            paths[f"fused {cfg.name}"] = lambda i, cfg=cfg: fused_moe(
                x, layers[i].gate_up_proj, layers[i].down_proj, ids, w, cfg,
                gate_up_bias=layers[i].gate_up_proj_bias, down_bias=layers[i].down_proj_bias,
                activation=layers[i].activation)
    runs = [(name, fn, base, needed) for name, fn in paths.items()]
    if mx_paths:
        runs += [(name, fn, mx_base, mx_needed) for name, fn in mx_paths.items()]
    for name, fn, row_base, row_needed in runs:
        row = dict(row_base, path=name)
        try:
            with torch.no_grad():
                sec = time_calls(fn)
                row.update(eager_us=round(sec * 1e6, 1), eager_gbs=round(row_needed / sec / 1e9))
                if GPU and "grouped" not in name:
                    sec = time_graph(fn)
                    row.update(graph_us=round(sec * 1e6, 1),
                               graph_gbs=round(row_needed / sec / 1e9))
        except Exception as ex:  # keep going: one failure must not hide the rest
            row["error"] = f"{type(ex).__name__}: {str(ex)[:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _ratio(gbs: float | None, copy_gbs: float) -> str:
    return f"{gbs / copy_gbs:.0%}" if gbs and copy_gbs else "-"


def _table(title: str, bytes_note: str, copy_gbs: float, rows: list[dict], diff_head: str,
           diff_key: str) -> str:
    """The markdown of a run's rows: a path a row, its eager / graph times and GB/s (needed
    weight bytes, ``bytes_note`` says how counted, / time) and its ``diff_key`` column."""
    dev = torch.cuda.get_device_name() if GPU else "CPU (Triton interpreter: smoke test only)"
    lines = [f"# {title}, {dev}", "",
             f"torch {torch.__version__}; copy bandwidth (1 GiB, read + written): "
             f"{copy_gbs:,.0f} GB/s. GB/s = needed weight bytes ({bytes_note}) / time.",
             "", "| T | distinct experts | needed MB | path | eager µs | eager GB/s | graph µs "
             f"| graph GB/s | graph / copy | {diff_head} |", "| --- " * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['distinct_experts']} | {r['needed_mb']} | {r['path']} "
                     f"| {r.get('eager_us', '-')} | {r.get('eager_gbs', '-')} | "
                     f"{r.get('graph_us', '-')} | {r.get('graph_gbs', '-')} | "
                     f"{_ratio(r.get('graph_gbs'), copy_gbs)} | "
                     f"{r.get(diff_key, float('nan')):.3g} |"
                     + (f" {r['error']}" if "error" in r else ""))
    return "\n".join(lines) + "\n"


def to_markdown(model: str, copy_gbs: float, rows: list[dict]) -> str:
    return _table(f"MoE experts, {model} shapes", "distinct routed experts, in the format the "
                  "path reads: bf16, or 4.25 bits a weight for mxfp4", copy_gbs, rows,
                  "max diff vs sync-free", "max_diff_vs_sync_free")


# --fp8: Qwen3-30B-A3B's experts (E, top-k, hidden, moe_intermediate) and token counts; on
# the CPU (interpreter) a tiny stand-in
FP8_SHAPE = (128, 8, 2048, 768) if GPU else (8, 2, 128, 128)
FP8_TOKENS = [1, 8, 32, 128, 512] if GPU else [3]
# each mode at the default config's rows a block, W8A8 at 64 (its e4m3 warpgroup MMAs), and
# the swapped W8A8 form (fp16 or e4m3 wgmmas at 16 and 32 rows; 64 spills) at 16 and 32 rows
FP8_MODES: dict[str, Callable[[FusedMoEFp8Config], FusedMoEFp8Config]] = {
    "w8a16": lambda d: FusedMoEFp8Config(block_m=d.block_m, block_n=32 if d.block_m > 16 else 64,
                                         w8a8=False),
    "w8a8 unswapped": lambda d: FusedMoEFp8Config(block_m=d.block_m, w8a8=True),
    "w8a8 unswapped, activation quantized in gate_up": lambda d: FusedMoEFp8Config(
        block_m=d.block_m, gate_up_block_n=128, block_n=128, w8a8=True),
    "w8a8 unswapped at 64 rows": lambda d: FusedMoEFp8Config(block_m=64, w8a8=True),
    "w8a8 swapped at 16 rows": lambda d: FusedMoEFp8Config(block_m=16, w8a8=True, swap=True),
    "w8a8 swapped at 32 rows": lambda d: FusedMoEFp8Config(block_m=32, w8a8=True, swap=True),
    "w8a8 swapped e4m3 at 16 rows": lambda d: FusedMoEFp8Config(block_m=16, swap=True,
                                                                swap_mma="e4m3"),
    "w8a8 swapped e4m3 at 32 rows": lambda d: FusedMoEFp8Config(block_m=32, swap=True,
                                                                swap_mma="e4m3"),
    # swapped on e4m3 wgmmas, gate_up 128 wide quantizing the activation in its epilogue
    # (no spill at 16 rows: one launch fewer, half the gate_up programs; on fp16 wgmmas it
    # spills, 160 B a thread)
    "w8a8 swapped e4m3 at 16 rows, activation quantized in gate_up": lambda d: FusedMoEFp8Config(
        block_m=16, gate_up_block_n=128, w8a8=True, swap=True, swap_mma="e4m3"),
}


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 [E, N, K], fp32 [E, N / 128, K / 128]): each 128 x 128 tile by its
    amax / 448, as the checkpoints are made (kernels/fp8_block_ref.quantize_fp8_block)."""
    e, n, k = w.shape
    tiles = w.float().view(e, n // 128, 128, k // 128, 128)
    scale = (tiles.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12)
    q = (tiles / scale[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(e, n, k), scale


def _time_paths(paths: dict[str, tuple[str, Callable[[int], object]]], t: int, distinct: int,
                needed: dict[str, int], want: torch.Tensor) -> list[dict]:
    """Each path (name -> (its bytes' key in ``needed``, a call of layer i)) checked against
    ``want`` (the bf16 kernel's output: the relative difference) and timed eagerly and, on
    the GPU, under a CUDA graph; a row each, printed as it comes."""
    rows: list[dict] = []
    for name, (fmt, fn) in paths.items():
        row: dict = dict(tokens=t, distinct_experts=distinct,
                         needed_mb=round(needed[fmt] / 1e6, 1), path=name)
        try:
            with torch.no_grad():
                got = fn(0)
                assert isinstance(got, torch.Tensor)
                row["rel_diff_vs_bf16"] = float((got.float() - want).norm() / want.norm())
                sec = time_calls(fn)
                row.update(eager_us=round(sec * 1e6, 1), eager_gbs=round(needed[fmt] / sec / 1e9))
                if GPU:
                    sec = time_graph(fn)
                    row.update(graph_us=round(sec * 1e6, 1),
                               graph_gbs=round(needed[fmt] / sec / 1e9))
        except Exception as ex:  # keep going: one failure must not hide the rest
            row["error"] = f"{type(ex).__name__}: {str(ex)[:120]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _quant_case(t: int, k: int, e: int, hidden: int, inter: int, bf16: list,
                kind: str, bytes_a_weight: Callable[[int], int]):
    """--fp8 / --int4's inputs at T = t: routing, x, the distinct experts, the weight bytes
    each path needs (bf16: 2 a weight; ``kind``: ``bytes_a_weight`` of an expert's weight
    count) and the bf16 kernel's output (what each path's rel. diff is against)."""
    expert_values = 3 * inter * hidden
    ids, w = routing(t, k, e, seed=t)
    x = torch.randn(t, hidden, device=DEV, dtype=DT)
    distinct = ids.unique().numel()
    needed = {"bf16": distinct * expert_values * 2, kind: distinct * bytes_a_weight(expert_values)}
    with torch.no_grad():
        want = fused_moe(x, *bf16[0], ids, w).float()
    return ids, w, x, distinct, needed, want


def _write_quant_results(out: Path, name: str, title: str, bytes_note: str, shape: dict,
                         copy_gbs: float, rows: list[dict], t0: float) -> None:
    """$OUT/{name}.json and .md of --fp8 / --int4's rows."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(dict(shape=shape, copy_gbs=copy_gbs, rows=rows),
                                                 indent=1))
    (out / f"{name}.md").write_text(_table(
        f"{title}, {shape}", f"distinct routed experts: bf16 2 bytes a weight, {bytes_note}",
        copy_gbs, rows, "rel. diff vs bf16", "rel_diff_vs_bf16"))
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


def fp8_tokens(t: int, k: int, e: int, hidden: int, inter: int, bf16: list, fp8: list) -> list[dict]:
    """--fp8's rows at T = t: the bf16 fused kernel, the fp8 one's default and its modes."""
    ids, w, x, distinct, needed, want = _quant_case(
        t, k, e, hidden, inter, bf16, "fp8", lambda v: v + 4 * v // 128 ** 2)
    default = fp8_default_config(t * k, e, x)
    paths: dict[str, tuple[str, Callable[[int], object]]] = {
        f"bf16 fused ({default_config(t * k, e).name})":
            ("bf16", lambda i: fused_moe(x, *bf16[i], ids, w)),
        f"fp8 fused (default {default.name})":
            ("fp8", lambda i: fused_moe_fp8(x, *fp8[i], ids, w)),
    }
    for mode, make in FP8_MODES.items():
        cfg = make(default)
        paths[f"fp8 {mode} ({cfg.name})"] = (
            "fp8", lambda i, cfg=cfg: fused_moe_fp8(x, *fp8[i], ids, w, cfg))
    return _time_paths(paths, t, distinct, needed, want)


def fp8_main(out: Path, tokens: list[int]) -> None:
    e, k, hidden, inter = FP8_SHAPE
    t0 = time.perf_counter()
    g = torch.Generator(device=DEV).manual_seed(0)
    bf16, fp8 = [], []
    for _ in range(LAYERS):
        gu = torch.randn(e, 2 * inter, hidden, device=DEV, generator=g) * hidden ** -0.5
        dn = torch.randn(e, hidden, inter, device=DEV, generator=g) * inter ** -0.5
        qgu, sgu = quantize_experts(gu)
        qdn, sdn = quantize_experts(dn)
        del gu, dn
        fp8.append((qgu, sgu, qdn, sdn))
        # the bf16 kernel's weights: the fp8 ones dequantized (the same experts)
        bf16.append(tuple((q.float().view(e, q.shape[1] // 128, 128, q.shape[2] // 128, 128)
                           * s[:, :, None, :, None]).view(q.shape).to(DT)
                          for q, s in ((qgu, sgu), (qdn, sdn))))
    copy_gbs = copy_bandwidth()
    print(json.dumps(dict(copy_gbs=copy_gbs)), flush=True)
    rows: list[dict] = []
    for t in tokens:
        rows += fp8_tokens(t, k, e, hidden, inter, bf16, fp8)
    _write_quant_results(out, "fused_moe_fp8", "MoE experts in block fp8",
                         "fp8 1 plus the tiles' fp32 scales",
                         dict(experts=e, top_k=k, hidden=hidden, moe_intermediate=inter),
                         copy_gbs, rows, t0)


# --int4: the same shape (FP8_SHAPE) and tokens, groups of 128 (the checkpoints'; on the CPU
# stand-in too)
INT4_GROUP = 128
# The tiles timed beside the default (each named by FusedMoEInt4Config.name; "swap ..." the
# swap form's): "dot" with K tiles of 128 (8 warps: they do not spill on sm_90) at each row
# count and its decode default before "swap" (K tiles of 64, 4 warps); "swap" at 16 / 32 /
# 64 rows, 1 and 3 stages (none spills on sm_90: tests/kernels/test_fused_moe_int4_swap.py)
INT4_TILES = [
    FusedMoEInt4Config(16, 64, 128, 8), FusedMoEInt4Config(32, 64, 128, 8),
    FusedMoEInt4Config(64, 64, 128, 8), FusedMoEInt4Config(16, 64, 64, 4),
    FusedMoEInt4Config(16, 64, 128, 4, 3, form="swap"),
    FusedMoEInt4Config(16, 64, 128, 4, 1, form="swap"),
    FusedMoEInt4Config(32, 64, 128, 4, 1, form="swap"),
    FusedMoEInt4Config(32, 64, 128, 4, 3, form="swap"),
    FusedMoEInt4Config(64, 64, 128, 4, 1, form="swap"),
]


def quantize_int4_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (int32 [E, N, K/8], fp16 scales, uint8 zeros [E, N, K/128]): our
    asymmetric group quantizer (models/int4_formats.quantize_int4, AWQ's min-max form) over
    every expert's rows at once."""
    from flashpage.models.int4_formats import quantize_int4

    e, n, k = w.shape
    q, s, z = quantize_int4(w.reshape(e * n, k), INT4_GROUP)
    return (pack_int4(q).view(e, n, k // 8), s.view(e, n, -1), z.view(e, n, -1))


def int4_tokens(t: int, k: int, e: int, hidden: int, inter: int, bf16: list, int4: list) -> list[dict]:
    """--int4's rows at T = t: the bf16 fused kernel, the int4 one's default and its tiles."""
    ids, w, x, distinct, needed, want = _quant_case(
        t, k, e, hidden, inter, bf16, "int4", lambda v: v // 2 + 3 * v // INT4_GROUP)
    default = int4_default_config(t * k, e, DT, (INT4_GROUP, INT4_GROUP))
    paths: dict[str, tuple[str, Callable[[int], object]]] = {
        f"bf16 fused ({default_config(t * k, e).name})":
            ("bf16", lambda i: fused_moe(x, *bf16[i], ids, w)),
        f"int4 fused (default {default.name})":
            ("int4", lambda i: fused_moe_int4(x, *int4[i], ids, w)),
    }
    for cfg in INT4_TILES:
        if cfg != default:
            paths[f"int4 {cfg.name}"] = (
                "int4", lambda i, cfg=cfg: fused_moe_int4(x, *int4[i], ids, w, cfg))
    return _time_paths(paths, t, distinct, needed, want)


def int4_main(out: Path, tokens: list[int]) -> None:
    e, k, hidden, inter = FP8_SHAPE
    t0 = time.perf_counter()
    g = torch.Generator(device=DEV).manual_seed(0)
    bf16, int4 = [], []
    for _ in range(LAYERS):
        experts = []
        for n, kk in ((2 * inter, hidden), (hidden, inter)):
            wt = torch.randn(e, n, kk, device=DEV, generator=g) * kk ** -0.5
            experts.append(quantize_int4_experts(wt))
            del wt
        int4.append((*experts[0], *experts[1]))
        # the bf16 kernel's weights: the int4 ones dequantized (the same experts)
        bf16.append(tuple(dequantize_int4_ref(q.view(-1, q.shape[2]), s.view(-1, s.shape[2]),
                                              z.view(-1, z.shape[2]), DT).view(e, q.shape[1], -1)
                          for q, s, z in experts))
    copy_gbs = copy_bandwidth()
    print(json.dumps(dict(copy_gbs=copy_gbs)), flush=True)
    rows: list[dict] = []
    for t in tokens:
        rows += int4_tokens(t, k, e, hidden, inter, bf16, int4)
    _write_quant_results(out, "fused_moe_int4", "MoE experts in int4 (W4A16)",
                         "int4 half a byte plus an fp16 scale and a uint8 zero per "
                         f"{INT4_GROUP}",
                         dict(experts=e, top_k=k, hidden=hidden, moe_intermediate=inter,
                              group=INT4_GROUP), copy_gbs, rows, t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true", help="also time tile configs of ours")
    ap.add_argument("--mxfp4-sweep", action="store_true",
                    help="also time each MXFP4 form (tile, scaled, swap, swap_scaled) at "
                         "MXFP4_TILES (~2 min on an H200)")
    ap.add_argument("--model", choices=sorted(MODELS), default="deepseek-v2-lite",
                    help="whose expert shapes (and token counts) to time")
    ap.add_argument("--fp8", action="store_true",
                    help="block-fp8 experts (kernels/fused_moe_fp8.py) beside the bf16 fused "
                         "kernel at Qwen3-30B-A3B's expert shape (--model unused)")
    ap.add_argument("--int4", action="store_true",
                    help="int4 experts kept packed (kernels/fused_moe_int4.py, groups of 128) "
                         "beside the bf16 fused kernel at Qwen3-30B-A3B's expert shape "
                         "(--model unused)")
    ap.add_argument("--tokens", default=None,
                    help="--fp8 / --int4's token counts, comma-separated (default "
                         f"{','.join(map(str, FP8_TOKENS))}; e.g. 2048,8192 for prompt-size batches)")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else FP8_TOKENS
    if args.int4:
        int4_main(Path(args.out), tokens)
        return
    if args.fp8:
        fp8_main(Path(args.out), tokens)
        return
    cfg = ModelConfig.from_hf(CONFIGS / args.model)
    hidden, inter = (cfg.hidden_size, cfg.moe_intermediate_size) if GPU else (64, 32)
    tokens = MODELS[args.model] if GPU else [1, 4]
    t0 = time.perf_counter()
    layers = make_layers(cfg, hidden, inter)
    # GPT-OSS's checkpoint experts are MXFP4: also as the engine holds them (FLASHPAGE_MXFP4)
    mx_layers = (make_layers(dataclasses.replace(cfg, hidden_size=hidden, moe_intermediate_size=inter),
                             hidden, inter, mxfp4=True)
                 if cfg.architecture == "GptOssForCausalLM" else None)
    copy_gbs = copy_bandwidth()
    print(json.dumps(dict(copy_gbs=copy_gbs)), flush=True)
    rows = []
    for t in tokens:
        rows += bench_tokens(layers, t, cfg.num_experts_per_tok, args.sweep, mx_layers,
                             args.mxfp4_sweep)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "fused_moe" if args.model == "deepseek-v2-lite" else f"fused_moe_{args.model}"
    (out / f"{stem}.json").write_text(json.dumps(dict(model=args.model, copy_gbs=copy_gbs,
                                                      rows=rows), indent=1))
    (out / f"{stem}.md").write_text(to_markdown(args.model, copy_gbs, rows))
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
