"""Fused small ops benchmark (GPU): GB/s of each kernel beside the unfused PyTorch sequence
it replaces and the copy bandwidth, all in one run.

Llama-3-8B shapes, bf16, 16384 tokens (a full prefill chunk; every tensor is far larger
than the 60 MB L2): hidden 4096, intermediate 14336, 32 q / 8 kv heads of 128, a paged
cache of block_size 16 written at random slots. GB/s counts the bytes each op must move:
every input read once, every output written once. Times are triton.testing.do_bench
medians.

    python benchmarks/fused_ops.py --out $OUT

writes $OUT/fused_ops.json and $OUT/fused_ops.md (``--only norm``: the RMSNorm and
LayerNorm rows alone, to fused_ops_norm.json / .md).

    python benchmarks/fused_ops.py --only kv_write --out $OUT

times only the K/V cache write, old tile kernel beside the row kernel and its variants,
two ways (kv_write.json / kv_write.md): do_bench as above (triton zeroes a 256 MB buffer
before each call, so up to an L2's worth of its dirty lines is written back during the
timed call: a fixed cost that weighs on a 134 MB op), and CUDA-graph replays rotating
over 3 independent sets of inputs and caches (no buffer zeroed in between; each call
pays only for its own bytes, as in a model). Beside them, a plain copy of the same bytes
timed both ways, the ceiling of that method at that size. Slots: random (as above) and
prefill-like (random blocks, the tokens of a block in order).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
from gpu_timing import time_graph
from triton.testing import do_bench

from flashpage.kernels import cache_write, silu_mul
from flashpage.kernels.cache_write import (
    _write_kv,
    _write_mla,
    write_kv_cache,
    write_kv_cache_ref,
    write_mla_cache,
    write_mla_cache_ref,
)
from flashpage.kernels.kv_cache_write import KV_WRITE_VARIANTS, kv_write_name, write_kv_rows
from flashpage.kernels.layer_norm import layer_norm, layer_norm_ref
from flashpage.kernels.rms_norm import rms_norm
from flashpage.kernels.rotary import apply_rotary, compute_cos_sin_cache, rotary_and_cache_write
from flashpage.kernels.silu_mul import gelu_tanh_and_mul, silu_and_mul

N, HIDDEN, INTER, HQ, HKV, D, BS = 16384, 4096, 14336, 32, 8, 128, 16
MLA_WIDTH = 512 + 64
DT = torch.bfloat16
E = 2  # bytes per bf16 element
DEV = "cuda"
WRITE_TILES = [(2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (16384, 8), (16384, 16)]


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def hf_rms_norm(x, weight, eps, residual=None):
    """What HF Llama runs: the residual add, then six elementwise kernels."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def hf_rope(positions, q, k, cos_sin):
    """HF's apply_rotary_pos_emb on a flat batch (cos/sin gathered per token), in place."""
    half = cos_sin.shape[1] // 2
    cs = cos_sin[positions]
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1).to(q.dtype)[:, None]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1).to(q.dtype)[:, None]
    q.copy_(q * cos + rotate_half(q) * sin)
    k.copy_(k * cos + rotate_half(k) * sin)


def copy_bandwidth() -> float:
    """4 GiB device-to-device copy, bytes read + written; do_bench warms up first (25 ms)."""
    big = torch.randn(2 * 1024**3, device=DEV).to(DT)  # 4 GiB
    dst = torch.empty_like(big)
    return 2 * big.numel() * E / bench(lambda: dst.copy_(big)) / 1e9


def record(rows, name, nbytes, fused, unfused, note=""):
    row = dict(op=name, mbytes=round(nbytes / 1e6, 1), note=note)
    for label, fn in (("fused", fused), ("torch", unfused)):
        if fn is None:
            row[label] = "-"
            continue
        try:
            row[label] = round(nbytes / bench(fn) / 1e9)
        except Exception as ex:  # keep going: one failure must not hide the rest
            row[label] = f"n/a: {type(ex).__name__}: {str(ex)[:80]}"
    rows.append(row)
    print(json.dumps(row), flush=True)


def bench_norm(rows):
    x = torch.randn(N, HIDDEN, device=DEV, dtype=DT)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, device=DEV, dtype=DT)
    record(rows, "rms_norm", 2 * x.numel() * E, lambda: rms_norm(x, w, 1e-5), lambda: hf_rms_norm(x, w, 1e-5))
    record(rows, "rms_norm + residual", 4 * x.numel() * E, lambda: rms_norm(x, w, 1e-5, res),
           lambda: hf_rms_norm(x, w, 1e-5, res), "reads x, residual; writes out, x + residual")
    bench_layer_norm(rows, x, res)


def bench_layer_norm(rows, x, res):
    """Starcoder2's LayerNorm (weight and bias; Cohere's has no bias), against the layer's
    torch path (layer_norm_ref: the add, an fp32 copy, torch's layer_norm, weight, bias and
    the rounding as separate kernels) and against torch's own one-kernel layer_norm on bf16
    (no residual add; its rounding of the weight product differs slightly). Then Command-R+'s
    per-head q norm: weight [heads, head_dim] over q, a strided view of the qkv output."""
    w = torch.randn(HIDDEN, device=DEV, dtype=DT)
    b = torch.randn(HIDDEN, device=DEV, dtype=DT)
    nbytes = 2 * x.numel() * E
    record(rows, "layer_norm (weight, bias)", nbytes, lambda: layer_norm(x, w, b, 1e-5),
           lambda: layer_norm_ref(x, w, b, 1e-5), "torch: fp32 layer_norm, then * w + b, rounded")
    record(rows, "layer_norm + residual", 2 * nbytes, lambda: layer_norm(x, w, b, 1e-5, res),
           lambda: layer_norm_ref(x, w, b, 1e-5, res), "reads x, residual; writes out, x + residual")
    record(rows, "layer_norm vs torch's bf16 kernel", nbytes, lambda: layer_norm(x, w, b, 1e-5),
           lambda: F.layer_norm(x, (HIDDEN,), w, b, 1e-5), "torch: F.layer_norm on bf16, one kernel")
    record(rows, "layer_norm (weight, no bias), 1 row", 2 * HIDDEN * E, lambda: layer_norm(x[:1], w, None, 1e-5),
           lambda: layer_norm_ref(x[:1], w, None, 1e-5), "a decode step's: launch-bound")
    qkv = torch.randn(N, (HQ + 2 * HKV) * D, device=DEV, dtype=DT)
    q = qkv[:, :HQ * D].view(N, HQ, D)
    wq = torch.randn(HQ, D, device=DEV, dtype=DT)
    record(rows, "layer_norm per-head q", 2 * q.numel() * E, lambda: layer_norm(q, wq, None, 1e-5),
           lambda: layer_norm_ref(q, wq, None, 1e-5), f"q [{N}, {HQ}, {D}] of a qkv output, weight [{HQ}, {D}]")


def bench_silu(rows):
    gu = torch.randn(N, 2 * INTER, device=DEV, dtype=DT)
    record(rows, "silu_and_mul", 3 * N * INTER * E, lambda: silu_and_mul(gu),
           lambda: F.silu(gu[:, :INTER]) * gu[:, INTER:], f"[{N}, 2×{INTER}] -> [{N}, {INTER}]")
    default = silu_mul._BLOCK
    for block in (2048, 4096):  # tile-size sweep, reported beside the default
        silu_mul._BLOCK = block
        record(rows, f"silu_and_mul (BLOCK {block})", 3 * N * INTER * E, lambda: silu_and_mul(gu),
               None, "tile sweep")
    silu_mul._BLOCK = default
    record(rows, "gelu_tanh_and_mul", 3 * N * INTER * E, lambda: gelu_tanh_and_mul(gu),
           lambda: F.gelu(gu[:, :INTER], approximate="tanh") * gu[:, INTER:],
           f"Gemma's MLP activation, [{N}, 2×{INTER}] -> [{N}, {INTER}]")


def bench_rotary_and_cache(rows):
    """q, k, v are views of one qkv projection output, as in the model."""
    qkv = torch.randn(N, (HQ + 2 * HKV) * D, device=DEV, dtype=DT)
    q, k, v = (t.view(N, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D)
    cos_sin = compute_cos_sin_cache(inv_freq, 131072)
    positions = torch.randint(0, 131072, (N,), device=DEV)
    num_blocks = 2 * N // BS
    key_cache = torch.zeros(num_blocks, BS, HKV, D, device=DEV, dtype=DT)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * BS, device=DEV)[:N]
    qk_bytes = (q.numel() + k.numel()) * E
    table_bytes = N * D * 4  # one fp32 cos/sin row per token
    record(rows, "rotary (q, k in place)", 2 * qk_bytes + table_bytes,
           lambda: apply_rotary(positions, q, k, cos_sin), lambda: hf_rope(positions, q, k, cos_sin))
    record(rows, "write_kv_cache", 4 * k.numel() * E,
           lambda: write_kv_cache(k, v, key_cache, value_cache, slots),
           lambda: write_kv_cache_ref(k, v, key_cache, value_cache, slots),
           f"default tile {cache_write.KV_TILE}")
    for tile in WRITE_TILES:  # (elements per tensor per program, warps)
        record(rows, f"write_kv_cache {tile}", 4 * k.numel() * E,
               lambda tile=tile: _write_kv(k, v, key_cache, value_cache, slots, *tile), None, "tile sweep")
    record(rows, "rotary + kv cache write", 2 * qk_bytes + table_bytes + 3 * v.numel() * E,
           lambda: rotary_and_cache_write(positions, q, k, v, cos_sin, key_cache, value_cache, slots),
           lambda: (hf_rope(positions, q, k, cos_sin), write_kv_cache_ref(k, v, key_cache, value_cache, slots)),
           "reads q, k, v; writes q, k, key/value cache")


def bench_mla_write(rows):
    """At the prefill chunk (16384 tokens: 38 MB, ~9 us at copy speed, so launch and tail
    weigh), and at 4x that, where the kernel streams."""
    for n in (N, 4 * N):
        bench_mla_write_tokens(rows, n)


def bench_mla_write_tokens(rows, n):
    latent = torch.randn(n, MLA_WIDTH, device=DEV, dtype=DT)
    num_blocks = 2 * n // BS
    kv_cache = torch.zeros(num_blocks, BS, MLA_WIDTH, device=DEV, dtype=DT)
    slots = torch.randperm(num_blocks * BS, device=DEV)[:n]
    nbytes = 2 * latent.numel() * E
    record(rows, f"write_mla_cache ({n} tokens)", nbytes,
           lambda: write_mla_cache(latent, kv_cache, slots),
           lambda: write_mla_cache_ref(latent, kv_cache, slots),
           f"latent 512 + 64, default tile {cache_write.MLA_TILE}")
    for tile in WRITE_TILES:
        record(rows, f"write_mla_cache ({n} tokens) {tile}", nbytes,
               lambda tile=tile: _write_mla(latent, kv_cache, slots, *tile), None, "tile sweep")


KV_SETS = 3  # independent inputs + caches rotated in the graph: 3 x 134 MB, far past the L2


def kv_write_sets(pattern: str):
    """KV_SETS of (k, v, key_cache, value_cache, slots): k, v views of a qkv output."""
    sets = []
    for _ in range(KV_SETS):
        qkv = torch.randn(N, (HQ + 2 * HKV) * D, device=DEV, dtype=DT)
        _, k, v = (t.view(N, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
        num_blocks = 2 * N // BS
        key_cache = torch.zeros(num_blocks, BS, HKV, D, device=DEV, dtype=DT)
        value_cache = torch.zeros_like(key_cache)
        if pattern == "random slots":
            slots = torch.randperm(num_blocks * BS, device=DEV)[:N]
        else:  # prefill-like: random blocks, the tokens of each block in order
            blocks = torch.randperm(num_blocks, device=DEV)[: N // BS]
            slots = (blocks[:, None] * BS + torch.arange(BS, device=DEV)).flatten()
        sets.append((k, v, key_cache, value_cache, slots))
    return sets


def bench_kv_write() -> list[dict]:
    """Old tile kernel, the row kernel's default and variants, and a same-size copy, each
    timed by do_bench and by graph replays rotating over KV_SETS sets."""
    rows = []
    for pattern in ("random slots", "prefill-like slots"):
        rows += bench_kv_write_pattern(pattern)
        torch.cuda.empty_cache()
    return rows


def bench_kv_write_pattern(pattern: str) -> list[dict]:
    nbytes = 4 * N * HKV * D * E
    sets = kv_write_sets(pattern)
    src = [torch.randn(nbytes // 2 // E, device=DEV).to(DT) for _ in range(KV_SETS)]
    dst = [torch.empty_like(x) for x in src]
    impls = {"tile (4096, 8): old default": lambda i: _write_kv(*sets[i], 4096, 8),
             "write_kv_cache: new default": lambda i: write_kv_cache(*sets[i])}
    for cfg in KV_WRITE_VARIANTS:
        impls[f"rows {kv_write_name(cfg)}"] = lambda i, cfg=cfg: write_kv_rows(*sets[i], cfg)
    impls["copy of the same bytes"] = lambda i: dst[i].copy_(src[i])
    return time_two_ways(impls, nbytes, pattern)


def time_two_ways(impls, nbytes: int, pattern: str, suffix: str = "") -> list[dict]:
    """Each impl(i) (i: which of KV_SETS input sets) timed by do_bench on set 0 and as graph
    replays rotating over the sets; GB/s rows."""
    rows = []
    for name, call in impls.items():
        state = {"i": 0}

        def rotate(call=call, state=state):
            state["i"] = (state["i"] + 1) % KV_SETS
            call(state["i"])
        row = dict(op=name + suffix, slots=pattern, mbytes=round(nbytes / 1e6, 1))
        try:
            row["do_bench"] = round(nbytes / bench(lambda call=call: call(0)) / 1e9)
            row["graph"] = round(nbytes / time_graph(rotate, 4 * KV_SETS) / 1e9)
        except Exception as ex:  # keep going: one failure must not hide the rest
            row["error"] = f"{type(ex).__name__}: {str(ex)[:100]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_mla_write_graph() -> list[dict]:
    """write_mla_cache (default kernel) and a same-size copy, do_bench and graph replays
    rotating over KV_SETS sets, at the prefill chunk (N tokens) and 4x that."""
    rows = []
    for n in (N, 4 * N):
        for pattern in ("random slots", "prefill-like slots"):
            nbytes = 2 * n * MLA_WIDTH * E
            sets = []
            for _ in range(KV_SETS):
                latent = torch.randn(n, MLA_WIDTH, device=DEV, dtype=DT)
                num_blocks = 2 * n // BS
                cache = torch.zeros(num_blocks, BS, MLA_WIDTH, device=DEV, dtype=DT)
                if pattern == "random slots":
                    slots = torch.randperm(num_blocks * BS, device=DEV)[:n]
                else:
                    blocks = torch.randperm(num_blocks, device=DEV)[: n // BS]
                    slots = (blocks[:, None] * BS + torch.arange(BS, device=DEV)).flatten()
                sets.append((latent, cache, slots))
            src = [torch.randn(nbytes // 2 // E, device=DEV).to(DT) for _ in range(KV_SETS)]
            dst = [torch.empty_like(x) for x in src]
            impls = {"write_mla_cache: default": lambda i, sets=sets: write_mla_cache(*sets[i]),
                     "copy of the same bytes": lambda i, src=src, dst=dst: dst[i].copy_(src[i])}
            rows += time_two_ways(impls, nbytes, pattern, f" ({n} tokens)")
            del sets, src, dst
            torch.cuda.empty_cache()
    return rows


def kv_write_precompile() -> None:
    """Each kernel kv_write times, once, at its exact shapes (the same specialisations)."""
    k, v, key_cache, value_cache, slots = kv_write_sets("random slots")[0]
    _write_kv(k, v, key_cache, value_cache, slots, 4096, 8)
    write_kv_cache(k, v, key_cache, value_cache, slots)
    for cfg in KV_WRITE_VARIANTS:
        write_kv_rows(k, v, key_cache, value_cache, slots, cfg)
    torch.cuda.synchronize()
    print(f"kv_write: compiled {2 + len(KV_WRITE_VARIANTS)} kernels", flush=True)


def kv_write_main(out: str, mla: bool = False) -> None:
    copy = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = bench_mla_write_graph() if mla else bench_kv_write()
    name = "mla_write" if mla else "kv_write"
    copy_end = copy_bandwidth()
    print(f"copy bandwidth at the end {copy_end:.0f} GB/s", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_gbps=round(max(copy, copy_end)), copy_start_gbps=round(copy),
                copy_end_gbps=round(copy_end), tokens=N)
    copy = max(copy, copy_end)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)

    def pct(x):
        return f"{100 * x / copy:.0f}%" if isinstance(x, int) else "-"
    what = (f"write_mla_cache, latent [tokens, {MLA_WIDTH}]" if mla else
            f"write_kv_cache, {N} tokens, K/V [{N}, {HKV}, {D}] views of a qkv output")
    lines = [f"{what}, block_size {BS}, "
             f"bf16, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}. GB/s of bytes moved "
             f"(read once, written once); 4 GiB copy {round(copy)} GB/s (the better of start "
             f"{meta['copy_start_gbps']} and end {round(copy_end)}).", "",
             "| kernel | slots | do_bench (L2 zeroed before) | % of copy | graph, 3 sets rotated | % of copy |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        db, gr = r.get("do_bench", r.get("error", "-")), r.get("graph", "-")
        lines.append(f"| {r['op']} | {r['slots']} | {db} | {pct(db)} | {gr} | {pct(gr)} |")
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", choices=["kv_write", "mla_write", "norm"], default=None,
                    help="time only the K/V (or MLA latent) cache write, two ways; or only the "
                         "RMSNorm and LayerNorm rows (fused_ops_norm.json / .md)")
    ap.add_argument("--precompile", action="store_true",
                    help="with --only kv_write: run each kernel once at the benchmark's shape (fills "
                         "Triton's cache; may run beside other untimed GPU work), then exit")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    if args.only == "mla_write":
        kv_write_main(args.out, mla=True)
        return
    if args.only == "kv_write":
        if args.precompile:
            kv_write_precompile()
        else:
            kv_write_main(args.out)
        return
    copy = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows: list[dict] = []
    sections = (bench_norm,) if args.only == "norm" else (
        bench_norm, bench_silu, bench_rotary_and_cache, bench_mla_write)
    for section in sections:
        section(rows)
        torch.cuda.empty_cache()
    copy_end = copy_bandwidth()
    print(f"copy bandwidth at the end {copy_end:.0f} GB/s", flush=True)
    copy = max(copy, copy_end)  # % of copy against the better of the two

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_gbps=round(copy), copy_end_gbps=round(copy_end), tokens=N)
    name = "fused_ops_norm" if args.only == "norm" else "fused_ops"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"Fused ops, Llama-3-8B shapes, {N} tokens, bf16, {meta['gpu']}, torch {meta['torch']}, "
             f"triton {meta['triton']}. GB/s of the bytes each op must move; copy bandwidth "
             f"{round(copy)} GB/s.", "",
             "| op | MB moved | fused (ours) | % of copy | unfused torch | speed-up | note |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ok = isinstance(r["fused"], int)
        pct = f"{100 * r['fused'] / copy:.0f}%" if ok else "-"
        up = f"{r['fused'] / r['torch']:.1f}×" if ok and isinstance(r["torch"], int) and r["torch"] else "-"
        lines.append(f"| {r['op']} | {r['mbytes']} | {r['fused']} | {pct} | {r['torch']} | {up} | {r['note']} |")
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
