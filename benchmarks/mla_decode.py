"""MLA decode benchmark (GPU): GB/s of latent read, beside torch and the copy bandwidth.

Everything in one run, so ratios hold when the machine's speed drifts:

- the device-to-device copy bandwidth (bytes read + written, as tools/gpu_baselines.py);
- our Triton kernel over a paged latent cache (bf16, 512 + 64, random block tables);
- the PyTorch reference on a contiguous latent: two batched matmuls and a softmax
  (SDPA has no kernel for a 576 head dim).

Each figure is the median over CUDA-graph replays of several calls; the calls rotate
over independent latents (>= 1 GiB in all) so small shapes are not timed out of L2 and a graph
replay's own launch (~5 us on an H200) is under 2% of it (256 MB until session 13: one 302 MB
call a graph at 8 x 32768, whose launch gap counted as ~6% of the call).
GB/s = batch * context * 576 * 2 bytes / time. ``--sweep`` also times tile configs and
split counts. Usage: ``python benchmarks/mla_decode.py --out $OUT/mla.jsonl [--sweep]``.

``--final`` (issue 4 / 6, benchmarks/mla_final.sh) times the MLA cache write, the old
64-wide tile kernel beside the 16-byte unit kernel and its candidate tiles
(``triton.testing.do_bench`` medians, as benchmarks/fused_ops.py); then, at 16 heads over
batch 8-128 and contexts 4k-32k, the old two-kernel split merge
(``fuse_merge_max_splits=0``) beside the new default (the merge inside the main kernel
for <= 4 splits) and both at a ladder of split counts (dropped past ``--budget-s``).
The copy bandwidth is measured at the start and the end.

``--chunks-ab`` times the value dims in column chunks (``MLADecodeConfig.qk_chunks``:
Q K^T as independent mma chains) against the unchunked default tile, at 16 heads on
CHUNKS_AB_SHAPES over bf16 and fp8 latents, the configs in turn three times; JSON lines
to ``--out``, a markdown table per cache dtype to ``--out`` with ``.md``:

    python benchmarks/mla_decode.py --chunks-ab --precompile 8
    python benchmarks/mla_decode.py --chunks-ab --out $OUT/mla_chunks_ab.jsonl

``--pdl-ab`` times, at 16 heads on PDL_AB_SHAPES, the default path (default config and
split rule, merge kernel included: what the engine calls) with programmatic dependent
launch off and on (FLASHPAGE_PDL, kernels/pdl.py), alternating off/on three times, the
median of each, beside the copy bandwidth of the same run: JSON lines to ``--out``, the
markdown table to ``--out`` with its suffix replaced by ``.md``.

    python benchmarks/mla_decode.py --pdl-ab --precompile 8
    python benchmarks/mla_decode.py --pdl-ab --out $OUT/mla_pdl_ab.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import torch
from gpu_timing import copy_bandwidth, graph_kernel_times
from gpu_timing import time_graph as _time_graph

from flashpage.kernels import cache_write, mla_cache_write
from flashpage.kernels.mla_decode import (
    CANDIDATE_CONFIGS,
    QK_CHUNK_CONFIGS,
    MLADecodeConfig,
    config_name,
    default_config,
    mla_decode,
    mla_decode_flops,
    pick_num_splits,
)

RANK, ROPE = 512, 64
D = RANK + ROPE
SHAPES = [(1, 1024), (1, 4096), (1, 32768), (4, 8192), (8, 32768), (16, 16384), (32, 4096),
          (64, 8192), (128, 1024), (128, 2048), (128, 4096)]
SWEEP_CONFIGS = {heads: [c for c in CANDIDATE_CONFIGS if (c.block_h == 16) == (heads == 16)]
                 for heads in (16, 128)}
SPLIT_LADDER = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
ROT_BYTES = 1024 * 2**20  # a graph's calls read >= this (mla_decode_gluon.py --rot-mb sets it)


def _compile_one(job: tuple[int, int, bool | tuple[int, ...], MLADecodeConfig]) -> str:
    """Compile one kernel variant by running it once on tiny inputs (fills Triton's cache)."""
    heads, page, split, cfg = job
    t = time.time()
    if heads == "write":  # a cache-write kernel: cfg is the tile (None: the old kernel)
        # 48 tokens: a multiple of 16, as the timed sizes (Triton specialises on it)
        lat = torch.randn(48, D, dtype=torch.bfloat16, device="cuda")
        kv = torch.zeros(8, 16, D, dtype=torch.bfloat16, device="cuda")
        slots = torch.randperm(128, device="cuda")[:48]
        if cfg is None:
            cache_write._write_mla(lat, kv, slots, *cache_write.MLA_TILE)
        else:
            mla_cache_write.write_mla_cache_vec(lat, kv, slots, cfg)
        torch.cuda.synchronize()
        return f"write {cfg}: {time.time() - t:.1f}s"
    splits = split if isinstance(split, tuple) else (2 if split else 1,)
    q = torch.randn(1, heads, D, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(4, page, D, dtype=torch.bfloat16, device="cuda")
    tables = torch.arange(4, dtype=torch.int32, device="cuda")[None]
    lens = torch.tensor([3 * page], dtype=torch.int32, device="cuda")
    for s in splits:
        mla_decode(q, kv, tables, lens, kv_lora_rank=RANK, sm_scale=0.1, config=cfg, num_splits=s)
    torch.cuda.synchronize()
    return f"{heads} {page} {split} {cfg}: {time.time() - t:.1f}s"


def _compile_all(workers: int, compile_one, jobs: list) -> None:
    """``compile_one`` over ``jobs`` in ``workers`` spawned processes (Triton caches the
    kernels on disk, so the timed process only loads them)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for msg in ex.map(compile_one, jobs):
            print("  compiled", msg, flush=True)
    print(f"precompiled {len(jobs)} variants in {time.time() - t:.0f} s", flush=True)


def precompile(workers: int, sweep: bool, pages: list[int]) -> None:
    """Compile every variant the run needs in parallel processes (compiles take seconds)."""

    jobs = []
    for heads in (16, 128):
        default = default_config(heads, torch.device("cuda"))
        cfgs = {default, *(SWEEP_CONFIGS[heads] if sweep else [])}
        for cfg in cfgs:
            for page in pages if cfg == default else pages[:1]:
                jobs += [(heads, page, split, cfg) for split in (False, True)]
    # The merge kernel compiles once per power-of-two split count.
    jobs.append((16, pages[0], (3, 5, 9, 17, 33, 65, 129, 256), default_config(16, torch.device("cuda"))))
    _compile_all(workers, _compile_one, jobs)


def precompile_final(workers: int) -> None:
    """The kernels of ``--final``: the old path with every merge size its ladder uses,
    the fused path, and the cache-write kernels (old tile, every new tile)."""

    old, new = final_configs()
    jobs: list = [(16, 64, (1, 2), old), (16, 64, (2,), new)]
    jobs += [(16, 64, (s,), old) for s in (3, 5, 9, 17, 33)]  # merge kernels by power of two
    jobs += [("write", None, None, tile) for tile in [None, *mla_cache_write.CANDIDATE_TILES]]
    _compile_all(workers, _compile_one, jobs)


PDL_AB_SHAPES = [(8, 32768), (16, 16384), (32, 4096), (64, 8192)]
PDL_AB_HEADS = 16
PDL_AB_ROUNDS = 3


def _compile_pdl_ab(job: tuple[int, int, int, bool]) -> str:
    """The default path once, PDL off or on, on tiny inputs with the shape's batch and
    block-table width (the same config, split count and specialisations)."""
    batch, ctx, page, pdl = job
    t = time.time()
    q = torch.randn(batch, PDL_AB_HEADS, D, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(4, page, D, dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros(batch, math.ceil(ctx / page), dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), 3 * page, dtype=torch.int32, device="cuda")
    mla_decode(q, kv, tables, lens, kv_lora_rank=RANK, sm_scale=0.1, pdl=pdl)
    torch.cuda.synchronize()
    return f"{batch} x {ctx} pdl={pdl}: {time.time() - t:.1f}s"


def precompile_pdl_ab(workers: int, page: int) -> None:

    jobs = [(b, c, page, p) for b, c in PDL_AB_SHAPES for p in (False, True)]
    _compile_all(workers, _compile_pdl_ab, jobs)


def _set_pdl(on: bool) -> None:
    os.environ["FLASHPAGE_PDL"] = "1" if on else "0"


def run_pdl_ab(f, args) -> None:
    """Default path, PDL off vs on (FLASHPAGE_PDL, read when each graph is captured),
    alternating off/on PDL_AB_ROUNDS times per shape; medians; one table."""
    from flashpage.kernels.pdl import pdl_supported

    dev = torch.device("cuda")
    if not pdl_supported(dev):
        print("PDL needs compute capability >= 9: both settings would time the same kernels")
    name = torch.cuda.get_device_name()
    copy_start = copy_bandwidth()
    torch.cuda.empty_cache()
    emit(f, section="env", gpu=name, torch=torch.__version__, copy_gbps=round(copy_start))
    print(f"{name}  copy {copy_start:.0f} GB/s", flush=True)
    t0 = time.time()
    rows = []
    cfg = default_config(PDL_AB_HEADS, dev)
    for batch, ctx in PDL_AB_SHAPES:
        case = Case(batch, ctx, PDL_AB_HEADS, args.page)
        splits = pick_num_splits(batch, math.ceil(PDL_AB_HEADS / cfg.block_h), ctx, dev,
                                 programs_per_sm=cfg.programs_per_sm)
        # PDL changes when the kernels start, not what they compute: bit-exact.
        outs = [mla_decode(case.q[0], case.pool, case.tables[0], case.lens, kv_lora_rank=RANK,
                           sm_scale=case.scale, pdl=p) for p in (False, True)]
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(PDL_AB_ROUNDS):
            for setting in ("off", "on"):
                _set_pdl(setting == "on")
                times[setting].append(time_graph(case.ours()))
        _set_pdl(False)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = dict(section="pdl_ab", heads=PDL_AB_HEADS, batch=batch, ctx=ctx, page=args.page,
                   config=config_name(cfg), splits=splits, calls_per_graph=case.rot,
                   equal=bool(torch.equal(*outs)),
                   off_us=round(med["off"] / case.rot * 1e6, 2),
                   on_us=round(med["on"] / case.rot * 1e6, 2),
                   off_gbps=round(gbps(case, med["off"])), on_gbps=round(gbps(case, med["on"])),
                   off_all_us=[round(t / case.rot * 1e6, 2) for t in times["off"]],
                   on_all_us=[round(t / case.rot * 1e6, 2) for t in times["on"]])
        emit(f, **row)
        rows.append(row)
        print(f"{batch}x{ctx}: off {row['off_gbps']} on {row['on_gbps']} GB/s "
              f"({row['off_us']} / {row['on_us']} us), equal {row['equal']}", flush=True)
        del case, outs
        torch.cuda.empty_cache()
    took = time.time() - t0
    copy_end = copy_bandwidth()
    copy = max(copy_start, copy_end)
    emit(f, section="env", copy_gbps_end=round(copy_end), seconds=round(took))
    lines = [f"MLA decode, PDL off vs on (FLASHPAGE_PDL), {PDL_AB_HEADS} heads, bf16, "
             f"{RANK}+{ROPE}, page {args.page}, default config and split rule (merge kernel "
             f"included), {name}, torch {torch.__version__}. Per call: median of "
             f"{PDL_AB_ROUNDS} CUDA-graph timings per setting, taken off/on alternately; GB/s "
             f"of latent read (% of copy {copy:.0f} GB/s: start {copy_start:.0f}, end "
             f"{copy_end:.0f}).", "",
             "| batch × context | config/splits | off µs | off GB/s (% of copy) | on µs "
             "| on GB/s (% of copy) | on/off speed | outputs equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch']} × {r['ctx']} | {r['config']}/sp{r['splits']} | {r['off_us']} "
                     f"| {r['off_gbps']} ({100 * r['off_gbps'] / copy:.0f}%) | {r['on_us']} "
                     f"| {r['on_gbps']} ({100 * r['on_gbps'] / copy:.0f}%) "
                     f"| {r['off_us'] / r['on_us']:.3f}× | {r['equal']} |")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as md:
        md.write("\n".join(lines) + "\n")
    print("\n".join(lines))


KV_DTYPE_SHAPES = [(8, 32768), (16, 16384), (32, 4096), (64, 8192), (128, 4096)]


# Over an fp8 latent the pipelined loop gathers the value operand's bytes from shared
# memory one at a time and widens each tile twice (once per dot; CPU-compiled SASS, sm_90:
# 1,186 instructions per 32-entry iteration and 116 bytes of spills, against 897 over
# bf16). "r" (prefetch): the tile loaded a step ahead into registers and widened once
# (766 at 4 warps, 506 per warp at 8). Run 18 timed fewer stages and other tile sizes
# (0.7-1.03x the default; only 16x32w4s2 kept). Timed over both caches.
MLA_FP8_CANDIDATES = [MLADecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2),
                      MLADecodeConfig(16, 32, 4, 1, prefetch=True), MLADecodeConfig(16, 32, 8, 1, prefetch=True),
                      MLADecodeConfig(16, 16, 4, 1, prefetch=True), MLADecodeConfig(16, 64, 8, 1, prefetch=True)]


def run_kv_dtype(f, args) -> None:
    """The default path over a bf16 and a float8_e4m3fn latent cache, 16 heads, shape by
    shape in one run: GB/s of the bytes each reads, and latent tokens per second."""
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    copy_start = copy_bandwidth()
    torch.cuda.empty_cache()
    emit(f, section="env", gpu=name, torch=torch.__version__, copy_gbps=round(copy_start))
    cfg = default_config(16, dev)
    rows = []
    for batch, ctx in KV_DTYPE_SHAPES:
        row: dict = dict(section="kv_dtype", heads=16, batch=batch, ctx=ctx, page=args.page,
                         config=config_name(cfg))
        for label, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            case = Case(batch, ctx, 16, args.page, dtype)
            t = time_graph(case.ours())
            row[f"{label}_us"] = round(t / case.rot * 1e6, 2)
            row[f"{label}_gbps"] = round(gbps(case, t))
            row[f"{label}_mtok_s"] = round(batch * ctx * case.rot / t / 1e6)
            # tile configs that may suit a one-byte cache better, timed over both caches
            cands = [dataclasses.replace(c, programs_per_sm=cfg.programs_per_sm) for c in MLA_FP8_CANDIDATES]
            row[f"{label}_candidates_gbps"] = {
                config_name(c): round(gbps(case, time_graph(case.ours(c)))) for c in cands}
            del case
            torch.cuda.empty_cache()
        row["speedup"] = round(row["bf16_us"] / row["fp8_us"], 3)
        emit(f, **row)
        rows.append(row)
        print(json.dumps(row), flush=True)
    copy = max(copy_start, copy_bandwidth())
    lines = [f"MLA decode over a bf16 and a float8_e4m3fn latent cache, 16 heads, {RANK}+{ROPE}, "
             f"page {args.page}, default config and split rule, {name}; GB/s of the bytes each "
             f"reads (% of copy {copy:.0f} GB/s), Mtok/s = batch × context / time.", "",
             "| batch × context | bf16 µs | bf16 GB/s | fp8 µs | fp8 GB/s | fp8 speed-up "
             "| bf16 Mtok/s | fp8 Mtok/s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch']} × {r['ctx']} | {r['bf16_us']} | {r['bf16_gbps']} "
                     f"({100 * r['bf16_gbps'] / copy:.0f}%) | {r['fp8_us']} | {r['fp8_gbps']} "
                     f"({100 * r['fp8_gbps'] / copy:.0f}%) | {r['speedup']}× | {r['bf16_mtok_s']} "
                     f"| {r['fp8_mtok_s']} |")
    for label in ("bf16", "fp8"):
        lines += ["", f"{label} candidates (GB/s): " + "; ".join(
            f"{r['batch']}×{r['ctx']}: " + ", ".join(f"{k} {v}" for k, v in r[f"{label}_candidates_gbps"].items())
            for r in rows)]
    with open(os.path.splitext(args.out)[0] + ".md", "w") as md:
        md.write("\n".join(lines) + "\n")
    print("\n".join(lines))


CHUNKS_AB_SHAPES = [(8, 32768), (16, 16384), (32, 4096), (64, 8192), (128, 4096)]
CHUNKS_AB_ROUNDS = 3


def chunks_ab_configs(fp8: bool) -> list[MLADecodeConfig]:
    """``--chunks-ab``'s configs at 16 heads over a bf16 (``fp8`` False) or fp8 latent
    cache: first the unchunked form of that cache's default tile (the baseline; the
    default before qk_chunks), then the chunked candidates of its kind (prefetch tiles for
    fp8, pipelined ones for bf16)."""
    base = dataclasses.replace(default_config(16, torch.device("cuda"), fp8=fp8), qk_chunks=1)
    return [base, *(c for c in QK_CHUNK_CONFIGS if c.prefetch == fp8)]


def _chunks_ab_splits(cfg: MLADecodeConfig, batch: int, ctx: int) -> int:
    return pick_num_splits(batch, 1, ctx, torch.device("cuda"), programs_per_sm=cfg.programs_per_sm)


def _compile_chunks_ab(job: tuple[bool, MLADecodeConfig, tuple[int, ...], int]) -> str:
    """One config over one cache dtype, at every split count the A/B times (the main
    kernel split or not, the merge kernel per power of two), on tiny inputs."""
    fp8, cfg, splits, page = job
    t = time.time()
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q = torch.randn(1, 16, D, dtype=torch.bfloat16, device="cuda")
    kv = torch.randn(4, page, D, device="cuda").to(dtype)
    tables = torch.arange(4, dtype=torch.int32, device="cuda")[None]
    lens = torch.tensor([3 * page], dtype=torch.int32, device="cuda")
    for s_ in splits:
        mla_decode(q, kv, tables, lens, kv_lora_rank=RANK, sm_scale=0.1, config=cfg, num_splits=s_)
    torch.cuda.synchronize()
    return f"{'fp8' if fp8 else 'bf16'} {config_name(cfg)} splits {splits}: {time.time() - t:.1f}s"


def precompile_chunks_ab(workers: int, page: int) -> None:

    jobs = [(fp8, c, tuple(sorted({_chunks_ab_splits(c, b, n) for b, n in CHUNKS_AB_SHAPES})), page)
            for fp8 in (False, True) for c in chunks_ab_configs(fp8)]
    _compile_all(workers, _compile_chunks_ab, jobs)


def run_chunks_ab(f, args) -> None:
    """The chunked Q K^T (qk_chunks) against the unchunked default tile at 16 heads, over
    bf16 and fp8 latents: per shape, every config timed CHUNKS_AB_ROUNDS times, the
    configs in turn each round (so drift hits them alike), medians; one table per cache
    dtype (markdown to --out with its suffix replaced by .md)."""
    name = torch.cuda.get_device_name()
    copy_start = copy_bandwidth()
    torch.cuda.empty_cache()
    emit(f, section="env", gpu=name, torch=torch.__version__, copy_gbps=round(copy_start))
    print(f"{name}  copy {copy_start:.0f} GB/s", flush=True)
    t0 = time.time()
    rows = []
    for fp8 in (False, True):
        cfgs = chunks_ab_configs(fp8)
        for batch, ctx in CHUNKS_AB_SHAPES:
            case = Case(batch, ctx, 16, args.page, torch.float8_e4m3fn if fp8 else torch.bfloat16)
            lat0 = case.contiguous(0)
            errs = {config_name(c): case.check(lat0, c) for c in cfgs}
            del lat0
            times: dict[str, list[float]] = {config_name(c): [] for c in cfgs}
            for _ in range(CHUNKS_AB_ROUNDS):
                for c in cfgs:
                    times[config_name(c)].append(time_graph(case.ours(c)))
            row = dict(section="chunks_ab", kv="fp8" if fp8 else "bf16", heads=16, batch=batch,
                       ctx=ctx, page=args.page, calls_per_graph=case.rot,
                       splits={config_name(c): _chunks_ab_splits(c, batch, ctx) for c in cfgs},
                       rel_err={k: float(f"{v:.1e}") for k, v in errs.items()},
                       us={k: round(statistics.median(v) / case.rot * 1e6, 2) for k, v in times.items()},
                       gbps={k: round(gbps(case, statistics.median(v))) for k, v in times.items()},
                       all_us={k: [round(t / case.rot * 1e6, 2) for t in v] for k, v in times.items()})
            emit(f, **row)
            rows.append(row)
            print(f"{row['kv']} {batch}x{ctx}: " + ", ".join(f"{k} {v}" for k, v in row["gbps"].items())
                  + f" GB/s; max rel err {max(errs.values()):.1e}", flush=True)
            del case
            torch.cuda.empty_cache()
    copy_end = copy_bandwidth()
    copy = max(copy_start, copy_end)
    emit(f, section="env", copy_gbps_end=round(copy_end), seconds=round(time.time() - t0))
    lines = [f"MLA decode, value dims in qk_chunks column chunks vs unchunked (c1: the default "
             f"before), 16 heads, {RANK}+{ROPE}, page {args.page}, split rule of each config's "
             f"programs per SM, {name}, torch {torch.__version__}. GB/s of the bytes read (% of "
             f"copy {copy:.0f} GB/s: start {copy_start:.0f}, end {copy_end:.0f}), × = speed "
             f"against the first column; medians of {CHUNKS_AB_ROUNDS} CUDA-graph timings "
             "per config, taken in turn."]
    for kv in ("bf16", "fp8"):
        sub = [r for r in rows if r["kv"] == kv]
        if not sub:
            continue
        keys = list(sub[0]["gbps"])
        lines += ["", f"**{kv} latents**", "", "| batch × context | " + " | ".join(keys)
                  + " | max rel err |", "| --- |" + " --- |" * (len(keys) + 1)]
        for r in sub:
            g, b0 = r["gbps"], r["gbps"][keys[0]]
            lines.append(f"| {r['batch']} × {r['ctx']} | " + " | ".join(
                f"{g[k]} ({100 * g[k] / copy:.0f}%, {g[k] / b0:.2f}×, sp{r['splits'][k]})" for k in keys)
                + f" | {max(r['rel_err'].values()):.0e} |")
    with open(os.path.splitext(args.out)[0] + ".md", "w") as md:
        md.write("\n".join(lines) + "\n")
    print("\n".join(lines))


# --splits-ab: the bf16 default (16 heads) at the batch <= 32 shapes of issue 4, over split
# counts around the rule's: at 32 x 4096 the rule's 8 splits write and read back fp32
# partials of ~11% of the latent bytes.
SPLITS_AB_SHAPES = [(8, 32768), (16, 16384), (32, 4096), (32, 8192)]
SPLITS_AB_COUNTS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 33, 48]


def _default_env(f) -> tuple[str, float, MLADecodeConfig]:
    """The GPU's name, the copy bandwidth and the bf16 default config at 16 heads, emitted
    as the run's env row."""
    name = torch.cuda.get_device_name()
    copy = copy_bandwidth()
    torch.cuda.empty_cache()
    cfg = default_config(16, torch.device("cuda"))
    emit(f, section="env", gpu=name, copy_gbps=round(copy), config=config_name(cfg))
    return name, copy, cfg


def run_splits_ab(f, args) -> None:
    """Split counts for the bf16 default at SPLITS_AB_SHAPES (table: --out with .md)."""
    name, copy, cfg = _default_env(f)
    lines = [f"MLA decode, bf16 default {config_name(cfg)}, 16 heads, {RANK}+{ROPE}, page {args.page}, "
             f"{name}: GB/s of latent bytes (% of copy {copy:.0f} GB/s) by split count; * = the rule's.",
             "", "| batch × context | " + " | ".join(f"sp{n}" for n in SPLITS_AB_COUNTS) + " |",
             "| --- |" + " --- |" * len(SPLITS_AB_COUNTS)]
    for batch, ctx in SPLITS_AB_SHAPES:
        case = Case(batch, ctx, 16, args.page)
        rule = _chunks_ab_splits(cfg, batch, ctx)
        row = {}
        for n in SPLITS_AB_COUNTS:
            if batch * n > 8 * 132 or ctx // n < 256:
                continue
            row[n] = round(gbps(case, time_graph(case.ours(cfg, num_splits=n))))
        emit(f, section="splits_ab", batch=batch, ctx=ctx, rule=rule, gbps=row)
        lines.append(f"| {batch} × {ctx} | " + " | ".join(
            (f"{row[n]} ({100 * row[n] / copy:.0f}%){'*' if n == rule else ''}" if n in row else "-")
            for n in SPLITS_AB_COUNTS) + " |")
        print(lines[-1], flush=True)
        del case
        torch.cuda.empty_cache()
    with open(os.path.splitext(args.out)[0] + ".md", "w") as md:
        md.write("\n".join(lines) + "\n")


# (batch, context) below 85% of copy: each timed at the default split count for that
# context, then at 1/2 and 1/4 of the context with the same split count.
OVERHEAD_SHAPES = [(8, 32768), (16, 16384), (32, 4096)]


def run_overhead(f, args) -> None:
    """Where the short ranges' time goes, per OVERHEAD_SHAPES shape: the default call
    (main kernel + merge kernel) at three contexts and one split count, fitted as
    t = fixed + bytes / bandwidth (least squares), and the merge kernel alone over the
    same partials, all graph-timed (table: --out with .md)."""
    from flashpage.kernels.mla_decode import _merge

    name, copy, cfg = _default_env(f)
    lines = [f"MLA decode, bf16 default {config_name(cfg)}, 16 heads, {RANK}+{ROPE}, page {args.page}, "
             f"{name}, copy {copy:.0f} GB/s. Per call: µs at the context and 1/2, 1/4 of it with the "
             "same split count; the fit t = fixed + bytes / bandwidth over the three; the merge "
             "kernel alone.", "",
             "| batch × context | splits | µs at ctx/4, ctx/2, ctx | fitted fixed µs | fitted GB/s "
             "(% of copy) | merge kernel alone µs | GB/s at ctx (% of copy) | in the call at ctx: main, "
             "merge, gaps µs (profiler) | main kernel alone GB/s (% of copy) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for batch, ctx in OVERHEAD_SHAPES:
        splits = _chunks_ab_splits(cfg, batch, ctx)
        pts = []
        for c in (ctx // 4, ctx // 2, ctx):
            case = Case(batch, c, 16, args.page)
            pts.append((case.bytes, time_graph(case.ours(cfg, num_splits=splits)) / case.rot))
            del case
            torch.cuda.empty_cache()
        n = len(pts)
        mx, my = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
        slope = sum((b - mx) * (t - my) for b, t in pts) / sum((b - mx) ** 2 for b, _ in pts)
        fixed, bw = my - slope * mx, 1 / slope
        mid_o = torch.randn(batch, 16, splits, RANK, device="cuda")  # RANK: a power of two
        mid_lse = torch.randn(batch, 16, splits, device="cuda")
        out = torch.empty(batch, 16, RANK, dtype=torch.bfloat16, device="cuda")

        def merges(mid_o=mid_o, mid_lse=mid_lse, out=out, n=20):  # 20 calls a graph
            for _ in range(n):
                _merge(mid_o, mid_lse, out, RANK)
        merge = time_graph(merges) / 20
        # The call at ctx split by kernel (profiler): the main kernel, the merge kernel, and
        # the rest of the graph-timed call (launch gaps between them).
        case = Case(batch, ctx, 16, args.page)
        per_kernel = graph_kernel_times(case.ours(cfg, num_splits=splits))
        main_s = sum(t for k, t in per_kernel.items() if "merge" not in k) / case.rot
        merge_s = sum(t for k, t in per_kernel.items() if "merge" in k) / case.rot
        del case
        torch.cuda.empty_cache()
        row = dict(section="overhead", batch=batch, ctx=ctx, splits=splits,
                   us=[round(t * 1e6, 2) for _, t in pts], fixed_us=round(fixed * 1e6, 2),
                   fitted_gbps=round(bw / 1e9), merge_us=round(merge * 1e6, 2),
                   in_call_main_us=round(main_s * 1e6, 2), in_call_merge_us=round(merge_s * 1e6, 2),
                   in_call_gap_us=round(pts[-1][1] * 1e6 - (main_s + merge_s) * 1e6, 2),
                   kernels={k: round(t * 1e6, 2) for k, t in per_kernel.items()})
        emit(f, **row)
        g = pts[-1][0] / pts[-1][1] / 1e9
        lines.append(f"| {batch} × {ctx} | {splits} | {', '.join(str(u) for u in row['us'])} | "
                     f"{row['fixed_us']} | {row['fitted_gbps']} ({100 * bw / 1e9 / copy:.0f}%) | "
                     f"{row['merge_us']} | {g:.0f} ({100 * g / copy:.0f}%) | {row['in_call_main_us']}, "
                     f"{row['in_call_merge_us']}, {row['in_call_gap_us']} | "
                     f"{pts[-1][0] / main_s / 1e9:.0f} ({100 * pts[-1][0] / main_s / 1e9 / copy:.0f}%) |")
        print(lines[-1], flush=True)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as md:
        md.write("\n".join(lines) + "\n")


def final_configs() -> tuple[MLADecodeConfig, MLADecodeConfig]:
    """(old, new) at 16 heads: the new default, and it with the merge kernel always."""
    new = default_config(16, torch.device("cuda"))
    return dataclasses.replace(new, fuse_merge_max_splits=0), new


def time_graph(fn) -> float:
    """Median seconds of one replay of a graph that runs ``fn`` once (15 replays)."""
    return _time_graph(fn, reps=15)


def emit(f, **row) -> None:
    line = json.dumps(row)
    f.write(line + "\n")
    f.flush()


class Case:
    """``rot`` independent paged latents + contiguous copies, and queries, for one shape."""

    def __init__(self, batch: int, ctx: int, heads: int, page: int,
                 kv_dtype: torch.dtype = torch.bfloat16) -> None:
        self.batch, self.ctx, self.heads, self.page = batch, ctx, heads, page
        self.bytes = batch * ctx * D * kv_dtype.itemsize
        self.rot = max(1, min(32, math.ceil(ROT_BYTES / self.bytes)))
        nblk = math.ceil(ctx / page)
        total = self.rot * batch * nblk
        self.pool = torch.randn(total, page, D, device="cuda").to(kv_dtype)
        perm = torch.randperm(total, device="cuda").int()
        self.tables = [perm[i * batch * nblk:(i + 1) * batch * nblk].view(batch, nblk)
                       for i in range(self.rot)]
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.q = [torch.randn(batch, heads, D, dtype=torch.bfloat16, device="cuda")
                  for _ in range(self.rot)]
        self.out = torch.empty(batch, heads, RANK, dtype=torch.bfloat16, device="cuda")
        self.scale = 1.0 / math.sqrt(192)

    def ours(self, config=None, num_splits=None):
        def fn():
            for i in range(self.rot):
                mla_decode(self.q[i], self.pool, self.tables[i], self.lens, kv_lora_rank=RANK,
                           sm_scale=self.scale, out=self.out, config=config,
                           num_splits=num_splits)
        return fn

    def contiguous(self, i: int) -> torch.Tensor:
        flat = self.pool.view(-1, D)
        pos = torch.arange(self.ctx, device="cuda")
        t = self.tables[i].long()
        slots = t[:, pos // self.page] * self.page + pos % self.page
        return flat[slots]  # [B, ctx, D]

    def torch_ref(self):
        lat = [self.contiguous(i) for i in range(self.rot)]

        def fn():
            for i in range(self.rot):
                s = torch.bmm(self.q[i], lat[i].transpose(1, 2)).float() * self.scale
                p = torch.softmax(s, dim=-1).to(torch.bfloat16)
                torch.bmm(p, lat[i][..., :RANK], out=self.out)
        return fn, lat

    def check(self, lat0: torch.Tensor, config=None) -> float:
        """‖ours - fp32 reference‖ / ‖reference‖ on the first rotation (output poisoned)."""
        self.out.fill_(float("nan"))
        mla_decode(self.q[0], self.pool, self.tables[0], self.lens, kv_lora_rank=RANK,
                   sm_scale=self.scale, out=self.out, config=config)
        got = self.out.float()
        s = torch.bmm(self.q[0].float(), lat0.float().transpose(1, 2)) * self.scale
        ref = torch.bmm(torch.softmax(s, -1), lat0[..., :RANK].float())
        return float((got - ref).norm() / ref.norm())


def gbps(case: Case, t: float) -> float:
    return case.bytes * case.rot / t / 1e9


def tflops(case: Case, t: float) -> float:
    return mla_decode_flops(case.heads, case.batch * case.ctx, RANK, ROPE) * case.rot / t / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mla_decode.jsonl")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--precompile", type=int, default=0, metavar="WORKERS",
                    help="compile the kernel variants in this many processes, then exit")
    ap.add_argument("--final", action="store_true",
                    help="the MLA cache write, then old vs new split merge at 16 heads")
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="--final: past this many seconds, time only old and new, no ladder")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="the default path at 16 heads, PDL off vs on (table: --out with .md)")
    ap.add_argument("--chunks-ab", action="store_true",
                    help="qk_chunks vs unchunked at 16 heads over bf16 and fp8 latents "
                         "(table: --out with .md)")
    ap.add_argument("--splits-ab", action="store_true",
                    help="split counts for the bf16 default at batch <= 32 (table: --out with .md)")
    ap.add_argument("--overhead", action="store_true",
                    help="fixed cost per call of the short ranges: a context ladder fit and the "
                         "merge kernel alone (table: --out with .md)")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16",
                    help="fp8: the default path at 16 heads over a bf16 and an fp8 latent cache "
                         "(table: --out with .md)")
    args = ap.parse_args()
    if args.precompile:
        if args.chunks_ab:
            precompile_chunks_ab(args.precompile, args.page)
        elif args.pdl_ab:
            precompile_pdl_ab(args.precompile, args.page)
        elif args.final:
            precompile_final(args.precompile)
        else:
            precompile(args.precompile, args.sweep, [args.page, 16])
        return
    # the first mode asked for runs; none: the sweep (run)
    modes = [(args.final, run_final), (args.pdl_ab, run_pdl_ab), (args.chunks_ab, run_chunks_ab),
             (args.splits_ab, run_splits_ab), (args.overhead, run_overhead),
             (args.kv_dtype == "fp8", run_kv_dtype), (True, run)]
    fn = next(fn for on, fn in modes if on)
    with open(args.out, "w") as f:
        fn(f, args)


def run(f, args) -> None:
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    copy = copy_start = copy_bandwidth()
    torch.cuda.empty_cache()
    emit(f, section="env", gpu=dev, torch=torch.__version__, copy_gbps=round(copy))
    print(f"{dev}  copy {copy:.0f} GB/s", flush=True)

    rows = []
    for heads in (16, 128):
        for batch, ctx in SHAPES:
            for page in sorted({args.page, 16}) if (batch, ctx) in ((32, 4096), (8, 32768)) \
                    else [args.page]:
                case = Case(batch, ctx, heads, page)
                fn_ref, lat = case.torch_ref()
                err = case.check(lat[0])
                cfg0 = default_config(heads, torch.device("cuda"))
                head_blocks = math.ceil(heads / cfg0.block_h)
                splits = pick_num_splits(batch, head_blocks, ctx, torch.device("cuda"),
                                         programs_per_sm=cfg0.programs_per_sm)
                t_ours = time_graph(case.ours())
                t_ref = time_graph(fn_ref)
                row = dict(section="mla", heads=heads, batch=batch, ctx=ctx, page=page,
                           splits=splits, rel_err=float(f"{err:.1e}"),
                           ours_gbps=round(gbps(case, t_ours)),
                           ours_tflops=round(tflops(case, t_ours), 1),
                           torch_gbps=round(gbps(case, t_ref)),
                           pct_copy=round(100 * gbps(case, t_ours) / copy, 1),
                           us=round(t_ours / case.rot * 1e6, 1))
                if args.sweep and page == args.page:
                    # Every candidate config at every split count up to ~4 waves of
                    # resident programs (>= 64 keys per split); heads 128 only its
                    # configs at the default split count (compute-bound: no target).
                    cap = min(ctx // 64, max(1, 4 * 2 * 132 // (batch * head_blocks)))
                    ladder = [s_ for s_ in SPLIT_LADDER if s_ <= cap] if heads == 16 else [splits]
                    for cfg in SWEEP_CONFIGS[heads]:
                        key = config_name(cfg)
                        try:
                            row["err_" + key] = float(f"{case.check(lat[0], cfg):.1e}")
                            for s_ in ladder:
                                row[f"cfg_{key}/sp{s_}"] = round(gbps(case, time_graph(
                                    case.ours(cfg, num_splits=s_))))
                        except Exception as ex:  # out of resources etc.: record, go on
                            row["cfg_" + key] = f"err {type(ex).__name__}: {str(ex)[:80]}"
                    pts = {k[4:]: v for k, v in row.items() if k.startswith("cfg_") and isinstance(v, int)}
                    if pts:
                        best = max(pts, key=pts.get)
                        row["best"], row["best_gbps"] = best, pts[best]
                emit(f, **row)
                rows.append(row)
                print(f"H{heads} {batch}x{ctx} page {page}: ours {row['ours_gbps']} GB/s "
                      f"({row['pct_copy']}% copy), torch {row['torch_gbps']}, err {err:.1e}",
                      flush=True)
                del case, lat, fn_ref
                torch.cuda.empty_cache()

    copy_end = copy_bandwidth()
    emit(f, section="env", copy_gbps_end=round(copy_end))
    copy = max(copy, copy_end)  # % of copy below: against the higher of the two
    for r in rows:
        r["pct_copy"] = round(100 * r["ours_gbps"] / copy, 1)
    print(f"\n# MLA decode, bf16, latent {RANK}+{ROPE}, {dev}, copy {copy:.0f} GB/s "
          f"(start {round(copy_start)}, end {round(copy_end)}; {time.time() - t0:.0f} s)")
    print("| heads | batch x ctx | page | splits | ours GB/s | % copy | TFLOP/s | torch GB/s "
          "| ours/torch | rel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['heads']} | {r['batch']} x {r['ctx']} | {r['page']} | {r['splits']} "
              f"| {r['ours_gbps']} | {r['pct_copy']} | {r['ours_tflops']} | {r['torch_gbps']} "
              f"| {r['ours_gbps'] / max(r['torch_gbps'], 1):.2f} | {r['rel_err']:.0e} |")
    if args.sweep:
        print("\n# sweep (GB/s): per config, its best split count; the best overall")
        for r in rows:
            if "best" not in r:
                continue
            per = {}
            for k, v in r.items():
                if k.startswith("cfg_") and isinstance(v, int):
                    name, sp = k[4:].split("/sp")
                    if v > per.get(name, ("", -1))[1]:
                        per[name] = (sp, v)
            errs = max((v for k, v in r.items() if k.startswith("err_")), default=0.0)
            print(f"H{r['heads']} {r['batch']}x{r['ctx']}: default {r['ours_gbps']} (sp{r['splits']}) "
                  f"best {r['best']}={r['best_gbps']} ({100 * r['best_gbps'] / copy:.0f}%) | "
                  + " ".join(f"{n}/sp{sp}={v}" for n, (sp, v) in per.items())
                  + f" | max err {errs:.0e}")


FINAL_SHAPES = [(8, 4096), (8, 32768), (16, 16384), (32, 4096), (32, 32768), (64, 8192),
                (128, 4096), (128, 32768)]
FINAL_SPLITS = (1, 2, 4, 8, 16, 33)  # full waves of the 264 slots at the batches timed


def run_final(f, args) -> None:
    """Old vs new at 16 heads (page ``args.page``), then the cache write; one table each."""
    t0 = time.time()
    dev = torch.cuda.get_device_name()
    copy_start = copy_bandwidth()
    torch.cuda.empty_cache()
    emit(f, section="env", gpu=dev, torch=torch.__version__, copy_gbps=round(copy_start))
    print(f"{dev}  copy {copy_start:.0f} GB/s", flush=True)
    writes = bench_write(f)  # first: short, and its own table
    old, new = final_configs()
    always = dataclasses.replace(new, fuse_merge_max_splits=1 << 20)
    rows = []
    for batch, ctx in FINAL_SHAPES:
        case = Case(batch, ctx, 16, args.page)
        splits = pick_num_splits(batch, 1, ctx, torch.device("cuda"),
                                 programs_per_sm=new.programs_per_sm)
        lat0 = case.contiguous(0)
        row = dict(section="final", heads=16, batch=batch, ctx=ctx, page=args.page,
                   splits=splits, err_old=float(f"{case.check(lat0, old):.1e}"),
                   err_new=float(f"{case.check(lat0, new):.1e}"),
                   err_fused=float(f"{case.check(lat0, always):.1e}"))
        del lat0
        row["old"] = round(gbps(case, time_graph(case.ours(old))))
        row["new"] = round(gbps(case, time_graph(case.ours(new))))
        cap = min(ctx // 256, 4 * 2 * 132 // batch)
        if time.time() - t0 > args.budget_s:
            cap = 0  # out of time: old and new only
        for s_ in sorted({*(s for s in FINAL_SPLITS if s <= cap), *([splits] if cap else [])}):
            row[f"unfused/sp{s_}"] = round(gbps(case, time_graph(case.ours(old, s_))))
            if s_ > 1:
                row[f"fused/sp{s_}"] = round(gbps(case, time_graph(case.ours(always, s_))))
        pts = {k: v for k, v in row.items() if "/sp" in k}
        row["best"] = max(pts, key=pts.get) if pts else "new"
        pts.setdefault("new", row["new"])
        emit(f, **row)
        rows.append(row)
        print(f"{batch}x{ctx}: old {row['old']} new {row['new']} GB/s (sp{splits}), best "
              f"{row['best']} {pts[row['best']]}, err {row['err_old']}/{row['err_new']}"
              f"/{row['err_fused']}", flush=True)
        del case
        torch.cuda.empty_cache()

    copy_end = copy_bandwidth()
    copy = max(copy_start, copy_end)
    emit(f, section="env", copy_gbps_end=round(copy_end))

    def pct(v: float) -> str:
        return f"{v:,} ({100 * v / copy:.0f}%)"

    print(f"\n# MLA decode, 16 heads, bf16, 512+64, page {args.page}, {dev}: GB/s of latent "
          f"read (% of copy {copy:.0f} GB/s: start {copy_start:.0f}, end {copy_end:.0f}); "
          f"{time.time() - t0:.0f} s")
    print("| batch x ctx | splits | old: merge kernel | new default | best of ladder | "
          "rel err old / new / fused |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['batch']} x {r['ctx']} | {r['splits']} | {pct(r['old'])} | {pct(r['new'])} "
              f"| {r['best']}: {pct(r[r['best']])} | {r['err_old']:.0e} / {r['err_new']:.0e} / "
              f"{r['err_fused']:.0e} |")
    print("\nladder (GB/s), unfused | fused, by split count:")
    for r in rows:
        print(f"{r['batch']}x{r['ctx']}: " + " ".join(
            f"sp{k.split('/sp')[1]}={r[k]}" + (f"|{r.get('fused/sp' + k.split('/sp')[1])}"
                                               if "fused/sp" + k.split("/sp")[1] in r else "")
            for k in r if k.startswith("unfused/")))
    print("\n# MLA cache write, bf16, 576-wide rows, block size 16, random slots: GB/s of "
          "latent read + written (% of copy)")
    print("| tokens | MB moved | old (_write_mla, tile "
          f"{cache_write.MLA_TILE}) | new default {mla_cache_write.MLA_WRITE_TILE} | "
          "new tiles (units, warps) |")
    print("| --- | --- | --- | --- | --- |")
    for w in writes:
        tiles = " ".join(f"{k[4:]}={pct(v)}" for k, v in w.items() if k.startswith("new "))
        print(f"| {w['tokens']} | {w['mbytes']} | {pct(w['old'])} | {pct(w['new'])} | {tiles} |")


def bench_write(f) -> list[dict]:
    """Old and new MLA cache write at a prefill chunk (16384 tokens) and at 4x that,
    measured as benchmarks/fused_ops.py does; every written row is checked first."""
    from triton.testing import do_bench

    def bench(fn) -> float:
        return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3

    rows = []
    for n in (16384, 65536):
        rows.append(_bench_write_tokens(f, n, bench))
        torch.cuda.empty_cache()
    return rows


def _bench_write_tokens(f, n: int, bench) -> dict:
    latent = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
    num_blocks = 2 * n // 16
    kv = torch.zeros(num_blocks, 16, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * 16, device="cuda")[:n]
    nbytes = 2 * latent.numel() * 2
    mla_cache_write.write_mla_cache_vec(latent, kv, slots)
    ok = bool(torch.equal(kv.view(-1, D)[slots], latent))

    def gb(fn) -> int:
        return round(nbytes / bench(fn) / 1e9)

    row = dict(section="write", tokens=n, mbytes=round(nbytes / 1e6, 1), correct=ok,
               old=gb(lambda: cache_write._write_mla(latent, kv, slots, *cache_write.MLA_TILE)),
               new=gb(lambda: mla_cache_write.write_mla_cache_vec(latent, kv, slots)))
    for tile in mla_cache_write.CANDIDATE_TILES:
        row[f"new {tile}"] = gb(
            lambda tile=tile: mla_cache_write.write_mla_cache_vec(latent, kv, slots, tile))
    emit(f, **row)
    print(f"write {n} tokens: old {row['old']} new {row['new']} GB/s, correct {ok}", flush=True)
    return row


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    main()
