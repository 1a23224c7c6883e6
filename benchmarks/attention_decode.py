"""Paged decode benchmark (GPU): GB/s of K+V read, beside PyTorch and the copy bandwidth.

GQA 32 query heads / 8 KV heads / head_dim 128, bf16, block_size 16, random block
tables. Measured in one run, so the ratios hold when the machine's speed drifts:

- copy: a 4 GiB device-to-device copy (bytes read + written), the memory ceiling, timed
  with events outside a graph after a warm-up (a graph-captured ``copy_`` read only
  ~2.7 TB/s on an H200: not a ceiling), at the start and at the end of the run;
- ours: flashpage.kernels.paged_decode with its default config and split rule;
- cudnn, flash: SDPA on a contiguous [B, Hkv, ctx, D] K/V (enable_gqa);
- gather_sdpa: the paged cache gathered through the block table, then SDPA.

GB/s = 2 * batch * context * Hkv * D * 2 bytes (the real context only) / time.
Each time is the median over CUDA-graph replays of a graph holding several calls that
rotate over independent inputs (>= 256 MB in all), so no shape is timed out of the L2
and Python launch overhead is not counted. ``--sweep`` also times every candidate config
(``paged_decode.CANDIDATE_CONFIGS``) at every split count up to ~32 programs per SM, and
prints, per shape, the default beside the best and the best split count of each config.

    python benchmarks/attention_decode.py --precompile 12 --sweep   # fill Triton's cache
    python benchmarks/attention_decode.py --out $OUT --sweep [--budget-s 150]

writes $OUT/decode.json and $OUT/decode.md.

    python benchmarks/attention_decode.py --precompile 8 --compare
    python benchmarks/attention_decode.py --out $OUT --compare

times, per COMPARE_SHAPES shape, the previous default (the same config with the split
merge kernel) beside the current default (``paged_decode`` as called, in-kernel merge on
Hopper small grids) and a few variants of the new path, with SDPA cuDNN and the copy
bandwidth of the same run (compare.json / compare.md).

    python benchmarks/attention_decode.py --precompile 8 --pdl-ab
    python benchmarks/attention_decode.py --out $OUT --pdl-ab

times, per PDL_AB_SHAPES shape, the default path (default config and split rule, merge
included: what the engine calls) with programmatic dependent launch off and on
(FLASHPAGE_PDL, kernels/pdl.py), alternating off/on three times, the median of each, with
the copy bandwidth of the same run (pdl_ab.json / pdl_ab.md).

    python benchmarks/attention_decode.py --out $OUT --kv-dtype fp8

times, per KV_DTYPE_SHAPES shape, the default path (what paged_decode picks) over a bf16
cache and over a float8_e4m3fn cache of the same shape, in one run: GB/s of the bytes
each actually reads (fp8: 1 byte a value), the fp8 run's "bf16-equivalent" GB/s (the bytes
a bf16 cache of that context holds, over the fp8 time) and context tokens per second
(batch * context / time, one layer), with the copy bandwidth (kv_dtype.json / kv_dtype.md).
``--kv-dtype bf16`` (the default) runs the modes above.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.nn.functional as F
from gpu_timing import copy_bandwidth, time_graph
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashpage.kernels.paged_decode import (
    CANDIDATE_CONFIGS,
    DecodeConfig,
    _launch,
    choose_num_splits,
    config_name,
    default_config,
)

HQ, HKV, D, BS = 32, 8, 128, 16
# The target shapes (batch >= 32 with context >= 2k; batch 1-8 with context >= 32k), then
# shapes between them for the split rule.
SHAPES = [(32, 2048), (32, 4096), (64, 4096), (128, 2048), (128, 8192),
          (1, 32768), (2, 32768), (4, 65536), (8, 32768), (1, 131072),
          (1, 4096), (2, 8192), (4, 16384), (8, 8192), (16, 4096), (16, 16384)]
SPLIT_LADDER = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256]
ROTATE_BYTES = 256 * 2**20


# Issue 6's rows: the split target (1 x 32768), batch >= 32 against cuDNN, and a split
# grid already at ~99%.
COMPARE_SHAPES = [(1, 32768), (32, 4096), (128, 2048), (8, 32768)]
# Variants of the new path timed beside the defaults at split shapes: (config, splits).
COMPARE_VARIANTS = [
    (DecodeConfig(64, 4, 5, programs_per_sm=2, fused_merge=True), 32),
    (DecodeConfig(64, 4, 5, programs_per_sm=2, fused_merge=True), 64),
    (DecodeConfig(32, 4, 5, fused_merge=True), 64),
    (DecodeConfig(64, 4, 3, fused_merge=True), 64),
]


# Several KV heads per program (contiguous 512 B-2 KB pieces of each cache row), for the
# batch >= 32 rows against cuDNN: {batch: [(config, splits)]}, ~128-512 programs each.
ROWS_2 = DecodeConfig(32, 4, 3, heads_per_program=2)
ROWS_4 = DecodeConfig(16, 4, 3, heads_per_program=4)
ROWS_8 = DecodeConfig(16, 8, 3, heads_per_program=8)
COMPARE_ROW_VARIANTS = {
    32: [(ROWS_2, 1), (ROWS_2, 2), (ROWS_4, 2), (ROWS_4, 4), (ROWS_8, 8)],
    128: [(ROWS_2, 1), (ROWS_4, 1), (ROWS_4, 2), (ROWS_8, 2)],
}


def compare_jobs(dev) -> list:
    """(config, splits) pairs --compare runs, for precompile (splits only pick the merge)."""
    old = dataclasses.replace(default_config(dev, D, 8), fused_merge=False)
    cfgs = {old, default_config(dev, D, 8), default_config(dev, D), *(c for c, _ in COMPARE_VARIANTS)}
    # Split counts 1 (unsplit), 2, 4 and 33: the merge chunk / merge kernel's padded split count.
    jobs = [(c, (1, 2, 4, 33)) for c in cfgs]
    return jobs + [(ROWS_2, (1, 2)), (ROWS_4, (1, 2, 4)), (ROWS_8, (2, 8))]


def compare(args, dev, sms) -> None:
    """Old default vs new default (and variants) on COMPARE_SHAPES, one run."""
    copy_before = copy_bandwidth()
    print(f"copy bandwidth {copy_before:.0f} GB/s", flush=True)
    rows = []
    for batch, ctx in COMPARE_SHAPES:
        shape = Shape(batch, ctx)
        new = default_config(dev, D, batch * HKV)
        old = dataclasses.replace(new, fused_merge=False)
        splits = choose_num_splits(batch, HKV, ctx, sms, programs_per_sm=new.programs_per_sm)
        row = dict(batch=batch, context=ctx, auto_splits=splits, new_config=config_name(new),
                   old_config=config_name(old),
                   old=gbps(shape, shape.ours(num_splits=splits, config=old)),
                   new=gbps(shape, shape.ours()))  # exactly what paged_decode picks
        variants = [(c, s_) for c, s_ in COMPARE_VARIANTS if splits > 1 and s_ * batch * HKV <= 8 * sms]
        variants += COMPARE_ROW_VARIANTS.get(batch, [])
        row["variants"] = {f"{config_name(c)}/sp{s_}": gbps(shape, shape.ours(num_splits=s_, config=c))
                           for c, s_ in variants}
        k, v = shape.contiguous()
        row["cudnn"] = gbps(shape, shape.sdpa(k, v, SDPBackend.CUDNN_ATTENTION))
        del k, v
        rows.append(row)
        print(json.dumps(row), flush=True)
        del shape
        torch.cuda.empty_cache()
    copy, meta = run_meta(copy_before)
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)

    def pct(x):
        return f"{100 * x / copy:.0f}%" if isinstance(x, int) else "-"

    def vs(x, c):
        return f"{x / c:.2f}×" if isinstance(x, int) and isinstance(c, int) else "-"
    lines = [f"Paged decode, old vs new default, GQA {HQ}/{HKV}, head_dim {D}, block_size {BS}, bf16, "
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}. GB/s of K+V read, CUDA-graph "
             f"replays over rotated inputs; copy {round(copy)} GB/s (before {round(copy_before)}, "
             f"after {meta['copy_after_gbps']}).", "",
             "| batch × context | old default | GB/s | % of copy | × cuDNN | new default | GB/s | % of copy "
             "| × cuDNN | SDPA cuDNN | variants (GB/s, % of copy) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        var = ", ".join(f"{n_} {g} ({pct(g)})" for n_, g in r.get("variants", {}).items()) or "-"
        lines.append(f"| {r['batch']} × {r['context']} | {r['old_config']}/sp{r['auto_splits']} | {r['old']} "
                     f"| {pct(r['old'])} | {vs(r['old'], r['cudnn'])} | {r['new_config']}/sp{r['auto_splits']} "
                     f"| {r['new']} | {pct(r['new'])} | {vs(r['new'], r['cudnn'])} | {r['cudnn']} | {var} |")
    write_table(args.out, "compare.md", lines)


# Issue 6's rows, and batch 1 x 1024: the engine's one-sequence case (launch-bound).
PDL_AB_SHAPES = [(1, 32768), (8, 32768), (32, 4096), (128, 2048), (1, 1024)]
PDL_AB_ROUNDS = 3


def pdl_ab_jobs() -> list:
    """(batch, context, pdl) per variant --pdl-ab compiles (tiny inputs of the same layout)."""
    return [(b, c, p) for b, c in PDL_AB_SHAPES for p in (False, True)]


def _compile_pdl_ab(job) -> str:
    """Run the default path once, PDL off or on, on tiny inputs with the shape's batch and
    block-table width (the same config, split count and specialisations)."""
    batch, ctx, pdl = job
    t = time.time()
    kc = torch.randn(8, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(batch, ctx // BS, dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    _launch(q, kc, kc, tables, lens, sm_scale=None, window_size=None, out=None, num_splits=None,
            pdl=pdl)
    torch.cuda.synchronize()
    return f"{batch} x {ctx} pdl={pdl}: {time.time() - t:.1f}s"


PDL_MODES = {"off": "0", "auto": "auto", "on": "1"}  # FLASHPAGE_PDL per setting


def _set_pdl(mode: str) -> None:
    os.environ["FLASHPAGE_PDL"] = PDL_MODES[mode]


def pdl_ab(args, dev, sms) -> None:
    """The default path with PDL off and on (FLASHPAGE_PDL, read when each graph is
    captured), off/on alternating PDL_AB_ROUNDS times per shape; medians."""
    import statistics

    from flashpage.kernels.pdl import pdl_supported

    if not pdl_supported(dev):
        print("PDL needs compute capability >= 9: both settings would time the same kernels")
    copy_before = copy_bandwidth()
    print(f"copy bandwidth {copy_before:.0f} GB/s", flush=True)
    t0 = time.time()
    rows = []
    for batch, ctx in PDL_AB_SHAPES:
        shape = Shape(batch, ctx)
        cfg = default_config(dev, D, batch * HKV)
        splits = choose_num_splits(batch, HKV, ctx, sms, programs_per_sm=cfg.programs_per_sm)
        # Bit-exact check on the first rotation: PDL changes when kernels start, not what
        # they compute.
        outs = [_launch(shape.q[0], shape.key_cache, shape.value_cache, shape.tables[0],
                        shape.seq_lens, sm_scale=None, window_size=None, out=None,
                        num_splits=None, pdl=p) for p in (False, True)]
        times: dict[str, list[float]] = {m: [] for m in PDL_MODES}
        for _ in range(PDL_AB_ROUNDS):
            for name in PDL_MODES:
                _set_pdl(name)
                times[name].append(time_graph(shape.ours(), shape.calls()))
        _set_pdl("off")
        med = {k_: statistics.median(v_) for k_, v_ in times.items()}
        row = dict(batch=batch, context=ctx, config=config_name(cfg), splits=splits,
                   calls_per_graph=shape.calls(), equal=bool(torch.equal(*outs)))
        for m in PDL_MODES:
            row[f"{m}_us"] = round(med[m] * 1e6, 2)
            row[f"{m}_gbps"] = round(shape.kv_bytes / med[m] / 1e9)
            row[f"{m}_all_us"] = [round(t_ * 1e6, 2) for t_ in times[m]]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del shape, outs
        torch.cuda.empty_cache()
    took = time.time() - t0
    copy, meta = run_meta(copy_before, rounds=PDL_AB_ROUNDS, seconds=round(took))
    with open(os.path.join(args.out, "pdl_ab.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"Paged decode, FLASHPAGE_PDL=0 (off) / auto (the default) / 1 (on), default config and split rule, merge "
             f"included, GQA {HQ}/{HKV}, head_dim {D}, block_size {BS}, bf16, {meta['gpu']}, torch "
             f"{meta['torch']}, triton {meta['triton']}. Per call: median of {PDL_AB_ROUNDS} "
             f"CUDA-graph timings per setting, taken in turn, each graph many calls "
             f"over rotated inputs; copy {round(copy)} GB/s (before {round(copy_before)}, "
             f"after {meta['copy_after_gbps']}).", "",
             "| batch × context | config/splits | off µs | off GB/s (% of copy) | auto µs "
             "| auto GB/s (% of copy) | on µs | on GB/s (% of copy) | auto/off speed "
             "| on/off speed | outputs equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [f"{r['batch']} × {r['context']}", f"{r['config']}/sp{r['splits']}"]
        for m in PDL_MODES:
            cells += [str(r[f"{m}_us"]), f"{r[f'{m}_gbps']} ({100 * r[f'{m}_gbps'] / copy:.0f}%)"]
        cells += [f"{r['off_us'] / r['auto_us']:.3f}×", f"{r['off_us'] / r['on_us']:.3f}×", str(r["equal"])]
        lines.append("| " + " | ".join(cells) + " |")
    write_table(args.out, "pdl_ab.md", lines)


# --kv-dtype fp8: the batch >= 32 targets and the split (few sequences, long context) ones.
KV_DTYPE_SHAPES = [(32, 4096), (64, 4096), (128, 2048), (1, 32768), (8, 32768)]
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# Tile configs worth timing over an fp8 cache (the bf16 defaults were tuned for 16-bit
# K/V). Compiled for sm_90 on the CPU (2026-11-30): the pipelined loop copies fp8 tiles
# to shared memory partly 8 bytes at a time (cp.async.ca 8) and gathers V's bytes back
# one at a time (ld.shared.b8: the dot reduces over V's keys, which are not contiguous);
# the hand-prefetched one loads 16 bytes per instruction, widens in registers and reads
# fp16 tiles back with ldmatrix; n64w8p 128 registers, n128w8p 190, n128w4p spills.
# Run 18 (fp16 dots): n128w4s3 best or within 1% at every shape (now the fp8 default);
# n64w8s1p, n128w8s1p, n32w4s1p and n128w8s3 15-40% behind it (dropped from the list);
# run 20: n64w4s1p, n256w4s2, n256w8s3 5-20% behind (dropped). "v" (prefetch_v): V one
# tile ahead in registers, K pipelined: no byte gathers, ~20% fewer instructions per tile.
# Run 23: n128w4s3v (the default since) 2-8% ahead of n128w4s4, n128w4s3h, n64w4s5v,
# n128w4s4v at batch >= 8; the two-heads kernel r2/r4 far behind (dropped). Now more
# resident warps per SM (ptxas: n128w4s3v 212 registers, 2 programs per SM; n64w4s4v 140,
# 3; n64w8s4v 115, 2 of 8 warps). Each candidate's output is checked against the default's.
FP8_CANDIDATES = [DecodeConfig(128, 4, 3), DecodeConfig(64, 4, 4, prefetch_v=True),
                  DecodeConfig(64, 8, 4, prefetch_v=True), DecodeConfig(128, 8, 3, prefetch_v=True),
                  DecodeConfig(128, 8, 4, prefetch_v=True), DecodeConfig(64, 8, 3, prefetch_v=True)]


def kv_dtype_ab(args, dev, sms) -> None:
    """The default path over a bf16 and an fp8 cache, shape by shape, in one run."""
    copy_before = copy_bandwidth()
    print(f"copy bandwidth {copy_before:.0f} GB/s", flush=True)
    rows = []
    for batch, ctx in KV_DTYPE_SHAPES:
        cfg = default_config(dev, D, batch * HKV)
        cfg8 = default_config(dev, D, batch * HKV, fp8=True)
        row: dict = dict(batch=batch, context=ctx, config=config_name(cfg), fp8_config=config_name(cfg8),
                         splits=choose_num_splits(batch, HKV, ctx, sms, programs_per_sm=cfg.programs_per_sm),
                         fp8_splits=choose_num_splits(batch, HKV, ctx, sms, programs_per_sm=cfg8.programs_per_sm))
        for name, dtype in KV_DTYPES.items():
            shape = Shape(batch, ctx, dtype)
            try:
                t = time_graph(shape.ours(), shape.calls())
                row[f"{name}_us"] = round(t * 1e6, 2)
                row[f"{name}_gbps"] = round(shape.kv_bytes / t / 1e9)  # bytes actually read
                row[f"{name}_mtok_s"] = round(batch * ctx / t / 1e6)  # context tokens per second
            except Exception as ex:  # one failing dtype must not hide the other
                row[f"{name}_error"] = f"{type(ex).__name__}: {str(ex)[:120]}"
            del shape
            torch.cuda.empty_cache()
        shape = Shape(batch, ctx, KV_DTYPES["fp8"])
        cands = {}
        kw = dict(sm_scale=None, window_size=None, out=None)
        base = _launch(shape.q[0], shape.key_cache, shape.value_cache, shape.tables[0], shape.seq_lens,
                       num_splits=row["fp8_splits"], **kw)
        diffs = {}
        for cand in FP8_CANDIDATES:
            try:
                c = dataclasses.replace(cand, programs_per_sm=cfg.programs_per_sm)
                got = _launch(shape.q[0], shape.key_cache, shape.value_cache, shape.tables[0], shape.seq_lens,
                              num_splits=row["splits"], config=c, **kw)
                diffs[config_name(cand)] = round((got.float() - base.float()).abs().max().item(), 4)
                t = time_graph(shape.ours(row["splits"], c), shape.calls())
                cands[config_name(cand)] = round(shape.kv_bytes / t / 1e9)
            except Exception as ex:  # keep going
                cands[config_name(cand)] = f"{type(ex).__name__}"
        row["fp8_candidates_gbps"] = cands
        row["fp8_candidates_max_abs_diff_vs_default"] = diffs
        del shape
        torch.cuda.empty_cache()
        if "fp8_us" in row and "bf16_us" in row:
            row["fp8_bf16_equiv_gbps"] = round(2 * row["fp8_gbps"])  # a bf16 cache's bytes, fp8's time
            row["speedup"] = round(row["bf16_us"] / row["fp8_us"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    copy, meta = run_meta(copy_before)
    with open(os.path.join(args.out, "kv_dtype.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)

    def cell(r, key):
        return f"{r[key]} ({100 * r[key] / copy:.0f}%)" if key in r else "-"

    lines = [f"Paged decode over a bf16 and a float8_e4m3fn cache, default config and split rule, GQA "
             f"{HQ}/{HKV}, head_dim {D}, block_size {BS}, bf16 queries, {meta['gpu']}, torch {meta['torch']}, "
             f"triton {meta['triton']}. CUDA-graph replays over rotated inputs; GB/s of the bytes each "
             f"reads (% of copy {round(copy)} GB/s: before {round(copy_before)}, after {meta['copy_after_gbps']}); "
             "fp8 bf16-equivalent: a bf16 cache's bytes over the fp8 time; Mtok/s: batch × context / time.", "",
             "| batch × context | config/splits | bf16 µs | bf16 GB/s | fp8 µs | fp8 GB/s | fp8 bf16-equiv. GB/s "
             "| fp8 speed-up | bf16 Mtok/s | fp8 Mtok/s | fp8, other configs (GB/s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch']} × {r['context']} | {r['config']}/sp{r['splits']}, "
                     f"fp8 {r['fp8_config']}/sp{r['fp8_splits']} | {r.get('bf16_us', '-')} "
                     f"| {cell(r, 'bf16_gbps')} | {r.get('fp8_us', '-')} | {cell(r, 'fp8_gbps')} "
                     f"| {cell(r, 'fp8_bf16_equiv_gbps')} | {r.get('speedup', '-')}× "
                     f"| {r.get('bf16_mtok_s', '-')} | {r.get('fp8_mtok_s', '-')} "
                     f"| {', '.join(f'{n_} {g}' for n_, g in r.get('fp8_candidates_gbps', {}).items())} |")
    write_table(args.out, "kv_dtype.md", lines)


# --layout-ab: the cache's memory order. NHD [blocks, BS, Hkv, D] (the engine's) keeps a
# KV head's row of one token in 256 contiguous bytes, the next token's 2 KB further on;
# HND [blocks, Hkv, BS, D] keeps a head's whole page (4 KB at BS 16) together, as
# SDPA's contiguous [B, Hkv, S, D] does. The kernels take strides, so one compiled
# kernel reads either (the engine would allocate HND and hand out the permuted view).
LAYOUT_AB_SHAPES = [(32, 4096), (64, 4096), (128, 2048), (128, 8192), (8, 32768), (1, 32768)]
LAYOUT_AB_ROUNDS = 3


def layout_ab(args, dev, sms) -> None:
    """Ours over NHD and HND caches (default config; HND also with the other grid order)
    and SDPA cuDNN on contiguous KV, in turn LAYOUT_AB_ROUNDS times per shape; medians."""
    import statistics

    copy_before = copy_bandwidth()
    print(f"copy bandwidth {copy_before:.0f} GB/s", flush=True)
    rows = []
    for batch, ctx in LAYOUT_AB_SHAPES:
        cfg = default_config(dev, D, batch * HKV)
        splits = choose_num_splits(batch, HKV, ctx, sms, programs_per_sm=cfg.programs_per_sm)
        other = dataclasses.replace(cfg, heads_fastest=not cfg.heads_fastest)
        nhd, hnd = Shape(batch, ctx), Shape(batch, ctx, layout="hnd")
        hnd.key_cache.copy_(nhd.key_cache)
        hnd.value_cache.copy_(nhd.value_cache)
        hnd.q.copy_(nhd.q)
        hnd.tables.copy_(nhd.tables)
        outs = [_launch(s_.q[0], s_.key_cache, s_.value_cache, s_.tables[0], s_.seq_lens,
                        sm_scale=None, window_size=None, out=None, num_splits=None)
                for s_ in (nhd, hnd)]
        k, v = nhd.contiguous()
        fns = {"nhd": nhd.ours(), "hnd": hnd.ours(), f"hnd_{config_name(other)}": hnd.ours(splits, other),
               "cudnn": nhd.sdpa(k, v, SDPBackend.CUDNN_ATTENTION)}
        times: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(LAYOUT_AB_ROUNDS):
            for n, fn in fns.items():
                try:
                    times[n].append(time_graph(fn, nhd.calls()))
                except Exception as ex:  # keep going
                    print(f"{n}: {type(ex).__name__}: {str(ex)[:100]}", flush=True)
        row = dict(batch=batch, context=ctx, config=config_name(cfg), splits=splits,
                   equal=bool(torch.equal(*outs)))
        for n, ts in times.items():
            if ts:
                row[f"{n}_gbps"] = round(nhd.kv_bytes / statistics.median(ts) / 1e9)
        if "cudnn_gbps" in row:
            row["nhd_x_cudnn"] = round(row["nhd_gbps"] / row["cudnn_gbps"], 3)
            row["hnd_x_cudnn"] = round(row["hnd_gbps"] / row["cudnn_gbps"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del nhd, hnd, k, v, outs, fns
        torch.cuda.empty_cache()
    copy = max(copy_before, copy_bandwidth())
    with open(os.path.join(args.out, "layout_ab.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), copy_gbps=round(copy), rows=rows), f, indent=1)
    print(f"copy {copy:.0f} GB/s; GB/s of K+V read:")
    for r in rows:
        print(" ", {k_: v_ for k_, v_ in r.items() if k_ not in ("config",)})


# --tiles: candidate tile configs over a bf16 and an fp8 cache, beside SDPA cuDNN, after the
# block ids were carried one tile ahead (session 5: every num_stages now buffers num_stages - 1
# K/V tiles; before, a 3-stage loop waited for each tile in the iteration after its issue,
# which Nsight Compute showed as 13% of the fp8 loop's stall samples). Splits: each
# config's own programs_per_sm rule. Rounds in turn, the best of each.
TILES_SHAPES = [(32, 4096), (64, 4096), (128, 2048), (128, 8192), (8, 32768), (1, 32768)]
TILES_ROUNDS = 2
TILES_BF16 = [DecodeConfig(64, 4, 2, heads_fastest=True), DecodeConfig(64, 4, 3, programs_per_sm=2),
              DecodeConfig(64, 8, 3, programs_per_sm=2), DecodeConfig(32, 4, 4, programs_per_sm=2)]
# Run 29's fp8 default (n128w4s3: 190 registers, 2 programs per SM) beside register caps
# that let 3 fit (ptxas spills 8-24 bytes) and 64-key tiles (120 registers: 4 per SM).
TILES_FP8 = [DecodeConfig(128, 4, 3, programs_per_sm=2),
             DecodeConfig(128, 4, 3, programs_per_sm=3, max_regs=168),
             DecodeConfig(128, 4, 3, programs_per_sm=3, prefetch_v=True, max_regs=168),
             DecodeConfig(128, 4, 2, programs_per_sm=3, max_regs=168),
             DecodeConfig(64, 4, 3, programs_per_sm=4), DecodeConfig(64, 4, 4, programs_per_sm=4),
             DecodeConfig(128, 4, 3, programs_per_sm=2, prefetch_v=True)]


# --warp-split (session 7): each warp its own 16-key piece of a tile with its own softmax
# state (DecodeConfig.warp_split: no cross-warp reduction or P exchange per tile). sm_90
# SASS compiled on the CPU: 500 instructions per 64-key fp8 tile (835 before), 168
# registers; bf16 281 (610), 202 registers.
WARP_SPLIT_BF16 = [DecodeConfig(64, 4, 3, programs_per_sm=2, warp_split=True),
                   DecodeConfig(64, 4, 2, programs_per_sm=2, warp_split=True),
                   DecodeConfig(32, 2, 3, programs_per_sm=4, warp_split=True)]
# Not yet timed: a register cap of 128 (sm_90 ptxas: 8 bytes of spill, 645 instructions per
# tile instead of 597) lets 4 split programs fit per SM instead of 3.
WARP_SPLIT_FP8 = [DecodeConfig(64, 4, 3, programs_per_sm=3, warp_split=True),
                  DecodeConfig(64, 4, 4, programs_per_sm=3, warp_split=True),
                  DecodeConfig(32, 2, 3, programs_per_sm=6, warp_split=True),
                  DecodeConfig(64, 4, 3, programs_per_sm=4, warp_split=True, max_regs=128)]


def best_of_rounds(shape, fns: dict, label: str) -> dict[str, float]:
    """Each function's best graph time over TILES_ROUNDS rounds, the functions in turn
    within a round; one that fails is reported and left out."""
    best: dict[str, float] = {}
    for _ in range(TILES_ROUNDS):
        for key, fn in fns.items():
            try:
                t = time_graph(fn, shape.calls())
                best[key] = min(best.get(key, t), t)
            except Exception as ex:  # keep going
                print(f"{label} {key}: {type(ex).__name__}: {str(ex)[:100]}", flush=True)
    return best


def tiles(args, dev, sms, bf16_cands=None, fp8_cands=None, out_name="tiles") -> None:
    """TILES_BF16 / TILES_FP8 (or the lists given) and each dtype's default on TILES_SHAPES,
    with SDPA cuDNN on contiguous bf16 KV ({out_name}.json / {out_name}.md)."""
    bf16_cands = TILES_BF16 if bf16_cands is None else bf16_cands
    fp8_cands = TILES_FP8 if fp8_cands is None else fp8_cands
    copy_before = copy_bandwidth()
    print(f"copy bandwidth {copy_before:.0f} GB/s", flush=True)
    rows = []
    for batch, ctx in TILES_SHAPES:
        row: dict = dict(batch=batch, context=ctx)
        for name, dtype in KV_DTYPES.items():
            shape = Shape(batch, ctx, dtype)
            dflt = default_config(dev, D, batch * HKV, fp8=name == "fp8")
            row[f"{name}_default"] = config_name(dflt)
            fns = {"default": shape.ours()}
            base = _launch(shape.q[0], shape.key_cache, shape.value_cache, shape.tables[0], shape.seq_lens,
                           sm_scale=None, window_size=None, out=None, num_splits=None)
            diffs = {}
            for cand in bf16_cands if name == "bf16" else fp8_cands:
                sp = choose_num_splits(batch, HKV, ctx, sms, programs_per_sm=cand.programs_per_sm)
                key = f"{config_name(cand)}/sp{sp}"
                fns[key] = shape.ours(sp, cand)
                got = _launch(shape.q[0], shape.key_cache, shape.value_cache, shape.tables[0],
                              shape.seq_lens, sm_scale=None, window_size=None, out=None, num_splits=sp,
                              config=cand)
                diffs[key] = round((got.float() - base.float()).abs().max().item(), 4)
            if name == "bf16":
                k, v = shape.contiguous()
                fns["cudnn"] = shape.sdpa(k, v, SDPBackend.CUDNN_ATTENTION)
            best = best_of_rounds(shape, fns, name)
            row[name] = {key: round(shape.kv_bytes / t / 1e9) for key, t in best.items()}
            row[f"{name}_max_abs_diff_vs_default"] = diffs
            del shape, fns
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    copy, meta = run_meta(copy_before)
    with open(os.path.join(args.out, f"{out_name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"Paged decode tile candidates, GQA {HQ}/{HKV}, head_dim {D}, block_size {BS}, bf16 q, "
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}; GB/s of the bytes each cache "
             f"holds (fp8: half of bf16's), best of {TILES_ROUNDS} rounds of CUDA-graph replays; copy "
             f"{round(copy)} GB/s (before {round(copy_before)}, after {meta['copy_after_gbps']}).", "",
             "| batch × context | dtype | default | default GB/s | × cuDNN (bf16 time / fp8 time for fp8) "
             "| SDPA cuDNN | candidates (GB/s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cud = r["bf16"].get("cudnn")
        for name in KV_DTYPES:
            g = r[name].get("default")
            if name == "bf16":
                ratio = f"{g / cud:.3f}×" if g and cud else "-"
            else:  # the same tokens: a bf16 cache's bytes are twice fp8's
                ratio = f"{2 * g / cud:.3f}× cuDNN-equiv." if g and cud else "-"
            cands = ", ".join(f"{k_} {v_}" for k_, v_ in r[name].items() if k_ not in ("default", "cudnn"))
            pct = f"({100 * g / copy:.0f}%)" if g else ""
            lines.append(f"| {r['batch']} × {r['context']} | {name} | {r[f'{name}_default']} | {g} "
                         f"{pct} | {ratio} | {cud if name == 'bf16' else ''} | {cands} |")
    write_table(args.out, f"{out_name}.md", lines)


def split_options(batch: int, ctx: int, sms: int) -> list[int]:
    """Split counts worth timing: up to ~32 programs per SM, >= 64 keys per split."""
    cap = min(ctx // 64, max(1, -(-32 * sms // (batch * HKV))))
    return [s for s in SPLIT_LADDER if s <= cap]


def _compile_one(job) -> str:
    """Run one config once on tiny inputs of the benchmark's layout (fills Triton's cache)."""
    cfg, splits, *dtype = job  # (config, split counts[, "bf16" | "fp8"])
    t = time.time()
    kc = torch.randn(8, BS, HKV, D, device="cuda", dtype=torch.bfloat16).to(KV_DTYPES[(dtype or ["bf16"])[0]])
    q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(8, dtype=torch.int32, device="cuda")[None]
    lens = torch.tensor([100], dtype=torch.int32, device="cuda")
    for s in splits:
        _launch(q, kc, kc, tables, lens, sm_scale=None, window_size=None, out=None, num_splits=s,
                config=cfg)
    torch.cuda.synchronize()
    return f"{config_name(cfg) if cfg else 'merge'} {splits}: {time.time() - t:.1f}s"


def precompile(workers: int, sweep: bool, compare_only: bool = False, pdl: bool = False,
               tiles_only: bool = False) -> None:
    """Compile the variants the run needs in parallel processes (each takes seconds)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    dev = torch.device("cuda")
    if pdl:
        t = time.time()
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            for msg in ex.map(_compile_pdl_ab, pdl_ab_jobs()):
                print("  compiled", msg, flush=True)
        print(f"precompiled the --pdl-ab variants in {time.time() - t:.0f} s", flush=True)
        return
    if tiles_only:
        sp = (1, 4, 6, 8, 33, 49, 66)
        jobs = [(c, sp, "bf16") for c in {*TILES_BF16, default_config(dev, D), default_config(dev, D, 8)}]
        jobs += [(c, sp, "fp8") for c in {*TILES_FP8, default_config(dev, D, fp8=True),
                                          default_config(dev, D, 8, fp8=True)}]
    elif compare_only:
        jobs = compare_jobs(dev)
    else:
        cfgs = {default_config(dev, D), default_config(dev, D, 1), *(CANDIDATE_CONFIGS if sweep else [])}
        jobs = [(cfg, (1, 2)) for cfg in cfgs]
        # The merge kernel compiles once per power-of-two split count.
        jobs += [(default_config(torch.device("cuda"), D), (3, 5, 9, 17, 33, 65, 129, 256))]
    t = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for msg in ex.map(_compile_one, jobs):
            print("  compiled", msg, flush=True)
    print(f"precompiled {len(jobs)} jobs in {time.time() - t:.0f} s", flush=True)


class Shape:
    """R independent copies of a batch's K/V: paged (random block tables) and contiguous."""

    def __init__(self, batch: int, ctx: int, kv_dtype: torch.dtype = torch.bfloat16,
                 layout: str = "nhd"):
        self.batch, self.ctx = batch, ctx
        self.kv_bytes = 2 * batch * ctx * HKV * D * kv_dtype.itemsize
        self.copies = max(1, -(-ROTATE_BYTES // self.kv_bytes))
        nblk = ctx // BS
        total = self.copies * batch * nblk
        if layout == "hnd":  # [blocks, Hkv, BS, D] in memory, seen as [blocks, BS, Hkv, D]
            self.key_cache = torch.randn(total, HKV, BS, D, device="cuda").to(kv_dtype).transpose(1, 2)
            self.value_cache = torch.randn(total, HKV, BS, D, device="cuda").to(kv_dtype).transpose(1, 2)
        else:
            self.key_cache = torch.randn(total, BS, HKV, D, device="cuda").to(kv_dtype)
            self.value_cache = torch.randn(total, BS, HKV, D, device="cuda").to(kv_dtype)
        perm = torch.randperm(total, device="cuda", dtype=torch.int32)
        self.tables = perm.view(self.copies, batch, nblk)
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.q = torch.randn(self.copies, batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.i = 0

    def next(self) -> int:
        self.i = (self.i + 1) % self.copies
        return self.i

    def calls(self) -> int:
        # Every copy in turn, repeated until a graph reads >= 1 GB (~0.25 ms at 4 TB/s).
        return self.copies * max(1, -(-(2**30) // (self.copies * self.kv_bytes)))

    def ours(self, num_splits=None, config=None):
        def fn():
            i = self.next()
            _launch(self.q[i], self.key_cache, self.value_cache, self.tables[i], self.seq_lens,
                    sm_scale=None, window_size=None, out=self.out, num_splits=num_splits,
                    config=config)
        return fn

    def contiguous(self):
        # [copies, B, Hkv, ctx, D] gathered once, outside the timing
        k = self.key_cache[self.tables.long()].view(self.copies, self.batch, self.ctx, HKV, D)
        v = self.value_cache[self.tables.long()].view(self.copies, self.batch, self.ctx, HKV, D)
        return k.transpose(2, 3).contiguous(), v.transpose(2, 3).contiguous()

    def sdpa(self, k, v, backend):
        q4 = self.q.unsqueeze(3)  # [copies, B, Hq, 1, D]

        def fn():
            i = self.next()
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q4[i], k[i], v[i], enable_gqa=True)
        return fn

    def gather_sdpa(self):
        q4 = self.q.unsqueeze(3)

        def fn():
            i = self.next()
            t = self.tables[i].long()
            k = self.key_cache[t].view(self.batch, self.ctx, HKV, D).transpose(1, 2)
            v = self.value_cache[t].view(self.batch, self.ctx, HKV, D).transpose(1, 2)
            F.scaled_dot_product_attention(q4[i], k, v, enable_gqa=True)
        return fn


# The engine's decode batches (8B shape, default workload): contexts 101-2048 at random, or
# all 1024 as in profile_engine_step.py; bytes per layer as the engine reads them.
ENGINE_SHAPES = [(256, "1024"), (256, "ragged"), (128, "ragged"), (64, "ragged"), (128, "2048")]
ENGINE_FP8 = [DecodeConfig(64, 4, 3, programs_per_sm=4),
              DecodeConfig(64, 4, 3, programs_per_sm=3, warp_split=True),
              DecodeConfig(64, 4, 3, programs_per_sm=3, warp_split=True, heads_fastest=True),
              DecodeConfig(64, 4, 3, programs_per_sm=4, warp_split=True, max_regs=128),
              DecodeConfig(32, 2, 3, programs_per_sm=6, warp_split=True, heads_fastest=True),
              DecodeConfig(64, 4, 2, programs_per_sm=3, warp_split=True, heads_fastest=True),
              DecodeConfig(64, 4, 4, programs_per_sm=3, warp_split=True, heads_fastest=True)]
ENGINE_BF16 = [DecodeConfig(64, 4, 2, heads_fastest=True), DecodeConfig(64, 4, 3, programs_per_sm=2)]


class RaggedShape:
    """One batch of decode requests with given contexts (random block tables over a pool as
    large as the contexts need), rotated over independent copies like Shape; ``order``
    "sorted" puts the longest contexts first (the grid's batch index in descending length)."""

    def __init__(self, lens: list[int], kv_dtype: torch.dtype, order: str = "given"):
        if order == "sorted":
            lens = sorted(lens, reverse=True)
        self.batch, self.ctx = len(lens), max(lens)
        self.kv_bytes = 2 * sum(lens) * HKV * D * kv_dtype.itemsize
        nblk = -(-self.ctx // BS)
        per_copy = 2 * self.batch * nblk * BS * HKV * D * kv_dtype.itemsize
        self.copies = max(1, -(-ROTATE_BYTES // per_copy))
        total = self.copies * self.batch * nblk
        self.key_cache = torch.randn(total, BS, HKV, D, device="cuda").to(kv_dtype)
        self.value_cache = torch.randn(total, BS, HKV, D, device="cuda").to(kv_dtype)
        self.tables = torch.randperm(total, device="cuda", dtype=torch.int32).view(self.copies, self.batch, nblk)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.q = torch.randn(self.copies, self.batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty(self.batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.i = 0

    next = Shape.next
    calls = Shape.calls
    ours = Shape.ours


def engine_shapes(args, dev, sms) -> None:
    """The fp8 and bf16 decode configs at the engine's batches (ENGINE_SHAPES): uniform and
    ragged contexts, given and longest-first order, each config at its own split rule and
    the warp split also at 2 and 4 splits (engine_shapes.json / engine_shapes.md)."""
    copy_before = copy_bandwidth()
    print(f"copy bandwidth {copy_before:.0f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch, kind in ENGINE_SHAPES:
        if kind == "ragged":
            lens = torch.randint(101, 2049, (batch,), generator=gen).tolist()
        else:
            lens = [int(kind)] * batch
        for name, dtype in KV_DTYPES.items():
            for order in ("given", "sorted") if kind == "ragged" else ("given",):
                shape = RaggedShape(lens, dtype, order)
                fns = {}
                for cand in ENGINE_FP8 if name == "fp8" else ENGINE_BF16:
                    sp = choose_num_splits(batch, HKV, shape.ctx, sms, programs_per_sm=cand.programs_per_sm)
                    fns[f"{config_name(cand)}/sp{sp}"] = shape.ours(sp, cand)
                    if cand == ENGINE_FP8[1]:  # the warp split, batch-major
                        for more in (2, 4):
                            fused = dataclasses.replace(cand, fused_merge=True)
                            fns[f"{config_name(fused)}/sp{more}"] = shape.ours(more, fused)
                best = best_of_rounds(shape, fns, name)
                row = dict(batch=batch, contexts=kind, dtype=name, order=order, mean_context=sum(lens) / batch,
                           us={k_: round(t * 1e6, 1) for k_, t in best.items()},
                           gbps={k_: round(shape.kv_bytes / t / 1e9) for k_, t in best.items()})
                rows.append(row)
                print(json.dumps(row), flush=True)
                del shape, fns
                torch.cuda.empty_cache()
    copy, meta = run_meta(copy_before)
    with open(os.path.join(args.out, "engine_shapes.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"Paged decode at the engine's batches, GQA {HQ}/{HKV}, head_dim {D}, block_size {BS}, "
             f"{meta['gpu']}, triton {meta['triton']}; GB/s of the bytes the contexts hold (% of copy "
             f"{round(copy)} GB/s), best of {TILES_ROUNDS} rounds of CUDA-graph replays.", "",
             "| batch | contexts | dtype | order | configs: GB/s (% of copy) |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = ", ".join(f"{k_} {g} ({100 * g / copy:.0f}%)" for k_, g in r["gbps"].items())
        lines.append(f"| {r['batch']} | {r['contexts']} | {r['dtype']} | {r['order']} | {cells} |")
    write_table(args.out, "engine_shapes.md", lines)


def gbps(shape: Shape, fn) -> float | str:
    try:
        return round(shape.kv_bytes / time_graph(fn, shape.calls()) / 1e9)
    except Exception as ex:  # one refusing backend must not hide the rest
        return f"n/a: {type(ex).__name__}: {str(ex)[:80]}"


def write_table(out_dir: str, name: str, lines: list[str]) -> None:
    """A mode's markdown table: written to out_dir/name and printed."""
    text = "\n".join(lines)
    with open(os.path.join(out_dir, name), "w") as f:
        f.write(text + "\n")
    print(text)


def run_meta(copy_before: float, **extra) -> tuple[float, dict]:
    """The copy bandwidth again at the end of a run; the ceiling (the better of the two)
    and the run's metadata (GPU, versions, both copy measurements, ``extra``)."""
    copy_after = copy_bandwidth()
    copy = max(copy_before, copy_after)
    return copy, dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                      triton=__import__("triton").__version__, copy_gbps=round(copy),
                      copy_before_gbps=round(copy_before), copy_after_gbps=round(copy_after), **extra)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="stop sweeping new shapes after this many seconds of sweep")
    ap.add_argument("--precompile", type=int, default=0, metavar="WORKERS",
                    help="compile the kernel variants in this many processes, then exit")
    ap.add_argument("--compare", action="store_true",
                    help="old vs new default on COMPARE_SHAPES only (compare.json / compare.md)")
    ap.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="bf16",
                    help="fp8: the default path over a bf16 and an fp8 cache (kv_dtype.json / kv_dtype.md)")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="the default path with PDL off vs on on PDL_AB_SHAPES (pdl_ab.json / pdl_ab.md)")
    ap.add_argument("--tiles", action="store_true",
                    help="tile candidates over bf16 and fp8 caches beside SDPA cuDNN (tiles.json / tiles.md)")
    ap.add_argument("--warp-split", action="store_true",
                    help="--tiles over the warp-split candidates (warp_split.json / warp_split.md)")
    ap.add_argument("--engine-shapes", action="store_true",
                    help="decode configs at the engine's batches, ragged contexts (engine_shapes.json / .md)")
    ap.add_argument("--layout-ab", action="store_true",
                    help="NHD vs HND cache memory order beside SDPA cuDNN (layout_ab.json)")
    args = ap.parse_args()
    if args.precompile:
        precompile(args.precompile, args.sweep, args.compare, args.pdl_ab, args.tiles)
        return
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.compare:
        compare(args, dev, sms)
        return
    if args.pdl_ab:
        pdl_ab(args, dev, sms)
        return
    if args.kv_dtype == "fp8":
        kv_dtype_ab(args, dev, sms)
        return
    if args.layout_ab:
        layout_ab(args, dev, sms)
        return
    if args.tiles:
        tiles(args, dev, sms)
        return
    if args.engine_shapes:
        engine_shapes(args, dev, sms)
        return
    if args.warp_split:
        tiles(args, dev, sms, WARP_SPLIT_BF16, WARP_SPLIT_FP8, "warp_split")
        return
    copy_before = copy_bandwidth()
    print(f"copy bandwidth {copy_before:.0f} GB/s", flush=True)

    # Phase 1: the default path and the PyTorch baselines, for every shape.
    rows = []
    for batch, ctx in SHAPES:
        shape = Shape(batch, ctx)
        default = default_config(dev, D, batch * HKV)  # what paged_decode picks on its own
        splits = choose_num_splits(batch, HKV, ctx, sms, programs_per_sm=default.programs_per_sm)
        row = dict(batch=batch, context=ctx, kv_gb=round(shape.kv_bytes / 1e9, 3), auto_splits=splits,
                   default_config=config_name(default), ours=gbps(shape, shape.ours()))
        k, v = shape.contiguous()
        row["cudnn"] = gbps(shape, shape.sdpa(k, v, SDPBackend.CUDNN_ATTENTION))
        row["flash"] = gbps(shape, shape.sdpa(k, v, SDPBackend.FLASH_ATTENTION))
        del k, v
        row["gather_sdpa"] = gbps(shape, shape.gather_sdpa())
        rows.append(row)
        print(json.dumps(row), flush=True)
        del shape
        torch.cuda.empty_cache()

    # Phase 2: every candidate config at every split count, shape by shape, within a budget.
    if args.sweep:
        t0 = time.time()
        for row in rows:
            if time.time() - t0 > args.budget_s:
                print(f"sweep budget spent: {row['batch']} x {row['context']} and later not swept", flush=True)
                break
            shape = Shape(row["batch"], row["context"])
            sweep = {}
            for cfg in CANDIDATE_CONFIGS:
                for s in split_options(row["batch"], row["context"], sms):
                    sweep[f"{config_name(cfg)}/sp{s}"] = gbps(shape, shape.ours(num_splits=s, config=cfg))
            row["sweep"] = sweep
            ok = {k_: v_ for k_, v_ in sweep.items() if isinstance(v_, int)}
            if not ok:
                print(f"{row['batch']} x {row['context']}: every swept config failed", flush=True)
                continue
            best = max(ok, key=ok.get)
            row["sweep_best"], row["sweep_best_gbps"] = best, ok[best]
            per_cfg = {}
            for cfg in CANDIDATE_CONFIGS:
                name = config_name(cfg)
                pts = {k_: v_ for k_, v_ in ok.items() if k_.startswith(name + "/")}
                if pts:
                    k_best = max(pts, key=pts.get)
                    per_cfg[name] = (k_best.split("/sp")[1], pts[k_best])
            row["best_split_per_config"] = per_cfg
            print(f"{row['batch']} x {row['context']}: default {row['ours']} ({row['auto_splits']} sp), "
                  f"best {best} {ok[best]}; per config " + ", ".join(
                      f"{n} sp{s_}={g}" for n, (s_, g) in per_cfg.items()), flush=True)
            del shape
            torch.cuda.empty_cache()
        print(f"sweep took {time.time() - t0:.0f} s", flush=True)

    copy, meta = run_meta(copy_before, sms=sms,
                          shape=f"GQA {HQ}/{HKV} heads, head_dim {D}, block_size {BS}, bf16")
    with open(os.path.join(args.out, "decode.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"Paged decode, {meta['shape']}, {meta['gpu']}, torch {meta['torch']}, "
             f"triton {meta['triton']}. GB/s of K+V read; copy bandwidth {round(copy)} GB/s "
             f"(measured before and after: {round(copy_before)}, {meta['copy_after_gbps']}).", "",
             "| batch × context | ours (default config, auto splits) | % of copy | × cuDNN "
             "| SDPA cuDNN (contiguous) | SDPA flash (contiguous) | gather + SDPA (paged) "
             "| best swept | % of copy | × cuDNN |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def pct(x):
        return f"{100 * x / copy:.0f}%" if isinstance(x, int) else "-"

    def vs(x, c):
        return f"{x / c:.2f}×" if isinstance(x, int) and isinstance(c, int) else "-"

    for r in rows:
        ours, best = r["ours"], r.get("sweep_best_gbps", "-")
        lines.append(f"| {r['batch']} × {r['context']} | {ours} ({r['default_config']}/sp{r['auto_splits']}) "
                     f"| {pct(ours)} "
                     f"| {vs(ours, r['cudnn'])} | {r['cudnn']} | {r['flash']} | {r['gather_sdpa']} "
                     f"| {r.get('sweep_best', '-')}: {best} | {pct(best)} | {vs(best, r['cudnn'])} |")
    write_table(args.out, "decode.md", lines)


if __name__ == "__main__":
    main()
