"""Prefill attention throughput: ours (contiguous and paged) beside SDPA's flash and cuDNN
backends and flex_attention, all measured in one run, bf16, 32 heads. "ours" / "paged" are the
Triton kernel; at head_dim 128 on Hopper also "gluon" (flash_prefill_gluon, contiguous) and
"engine16" / "engine128" (paged_prefill as the engine calls it: the Gluon paged kernel).

    python benchmarks/attention_prefill.py --out DIR [--tune] [--jobs 12]

TFLOP/s counts 4 * B * H * S^2 * D (half of it when causal), the convention of the
anchors table. Times are triton.testing.do_bench medians (L2 flushed between reps).
Writes DIR/prefill.json (every measurement) and DIR/prefill.md (the table).

--tune also times a few tile configurations per (head_dim, causal) and reports the
best beside the default; --jobs N compiles all kernels first in N processes (Triton
and Inductor cache to disk), so the timed process only loads them. --paged-all times
every candidate over the paged caches too (else only the default and the best);
--dims and --causal-only narrow the table (the targets are D=128, causal).
`--smoke` runs a tiny version on the CPU (Triton interpreter) to check the script.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import tests.conftest  # noqa: F401  (its numpy fix for the interpreter)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashpage.kernels.flash_prefill import (  # noqa: E402
    PrefillConfig,
    default_config,
    flash_attn_varlen,
    hopper_candidates,
    paged_prefill,
)

SHAPES = [(8, 1024), (2, 4096), (1, 16384)]
HEADS = 32
PAGE_SIZES = (16, 128)


def tflops(b: int, s: int, h: int, d: int, causal: bool, ms: float) -> float:
    f = 4 * b * h * s * s * d / (2 if causal else 1)
    return round(f / (ms * 1e-3) / 1e12, 1)


def candidates(d: int) -> list[PrefillConfig]:
    """Hopper tile configurations tried by --tune (the default is always among them; the
    list and what run 32 measured: flash_prefill.hopper_candidates)."""
    return hopper_candidates(d)


def smoke_candidates() -> list[PrefillConfig]:
    """`--smoke --tune`: interpreter-sized tiles, the TMA path among them."""
    c = PrefillConfig
    return [c(32, 16, 4, 1), c(16, 16, 4, 1, use_tma=True)]


def cfg_name(c: PrefillConfig) -> str:
    return (f"{c.block_m}x{c.block_n}/w{c.num_warps}/s{c.num_stages}"
            f"{'/tma' if c.use_tma else ''}{'/ws' if c.warp_specialize else ''}"
            f"{'' if c.m_fastest else '/heads-first'}")


def make_inputs(b: int, s: int, h: int, hkv: int, d: int, dev: str, seed: int = 0):
    # the CPU interpreter computes bf16 wrongly: the smoke run uses fp16
    dt = torch.bfloat16 if dev == "cuda" else torch.float16
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(b * s, h, d, generator=g, device=dev, dtype=dt)
    k = torch.randn(b * s, hkv, d, generator=g, device=dev, dtype=dt)
    v = torch.randn(b * s, hkv, d, generator=g, device=dev, dtype=dt)
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=dev)
    return q, k, v, cu


def make_paged(k: torch.Tensor, v: torch.Tensor, b: int, s: int, bs: int):
    """K/V scattered over a shuffled block pool, as the engine's cache holds them."""
    nb = s // bs
    perm = torch.randperm(b * nb, device=k.device)
    tables = perm.view(b, nb).to(torch.int32)
    kc = torch.empty(b * nb, bs, *k.shape[1:], dtype=k.dtype, device=k.device)
    vc = torch.empty_like(kc)
    kc[perm] = k.view(b * nb, bs, *k.shape[1:])
    vc[perm] = v.view(b * nb, bs, *v.shape[1:])
    seq_lens = torch.full((b,), s, dtype=torch.int32, device=k.device)
    return kc, vc, tables, seq_lens


def gluon_covers(d: int, dev: str) -> bool:
    """The Gluon FA3-style kernels (head_dim 128, sm_90) run here: their columns are timed."""
    return dev == "cuda" and d == 128 and torch.cuda.get_device_capability()[0] == 9


def engine_fn(q, k, v, cu, s, causal, paged=None):
    """What the engine runs: the Gluon kernel over contiguous K/V, or paged_prefill with no
    explicit config (its own dispatch: the Gluon paged kernel on Hopper over 16-bit caches)."""
    if paged is None:
        from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

        return lambda: flash_prefill_gluon(q, k, v, cu, s, causal=causal)
    kc, vc, tables, seq_lens = paged
    return lambda: paged_prefill(q, kc, vc, tables, cu, seq_lens, s, s, causal=causal)


def ours_fn(q, k, v, cu, s, causal, cfg, paged=None):
    if paged is None:
        return lambda: flash_attn_varlen(q, k, v, cu, cu, s, s, causal=causal, _config=cfg)
    kc, vc, tables, seq_lens = paged
    return lambda: paged_prefill(q, kc, vc, tables, cu, seq_lens, s, s, causal=causal, _config=cfg)


def make_flex(b: int, s: int, d: int, causal: bool, dev: str):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 64  # one compile per shape; never fall back to eager
    fa = torch.compile(flex_attention, dynamic=False)
    bm = None
    if causal:
        bm = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s, device=dev)
    return lambda q4, k4, v4: fa(q4, k4, v4, block_mask=bm)


def _compile_job(job: tuple) -> tuple[str, str]:
    """Run one kernel once on small inputs (or flex on the real shape) to fill the disk caches."""
    torch.cuda.set_device(0)
    key = repr(job)
    try:
        if job[0] == "ours":
            _, d, causal, cfg_t, bs = job
            cfg = PrefillConfig(*cfg_t)
            q, k, v, cu = make_inputs(2, 256, HEADS, HEADS, d, "cuda")
            paged = make_paged(k, v, 2, 256, bs) if bs else None
            ours_fn(q, k, v, cu, 256, causal, cfg, paged)()
        else:
            _, b, s, d, causal = job
            q, k, v, _ = make_inputs(b, s, HEADS, HEADS, d, "cuda")
            q4, k4, v4 = (t.view(b, s, HEADS, d).transpose(1, 2) for t in (q, k, v))
            make_flex(b, s, d, causal, "cuda")(q4, k4, v4)
        torch.cuda.synchronize()
        return key, "ok"
    except Exception as ex:  # reported, and the timed pass skips the config
        return key, f"{type(ex).__name__}: {str(ex)[:300]}"


def _measurer(row: dict, ref: torch.Tensor | None, smoke: bool, records: list):
    """measure(name, fn, check): time fn into row[name] as TFLOP/s (after checking its output
    against ref, when given); a failure is recorded as a string, never raised."""
    b, s, h, d, causal = (row[x] for x in ("batch", "seqlen", "heads", "head_dim", "causal"))
    ref = row.setdefault("_ref", ref) if ref is not None else row.get("_ref")

    def measure(name, fn, check=True):
        try:
            o = fn()
            if check and ref is not None:
                o = o.float().reshape(ref.shape)
                err = ((o - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    raise RuntimeError(f"wrong output: rel err {err:.3g}")
            row[name] = tflops(b, s, h, d, causal, bench_ms(fn, smoke))
        except Exception as ex:
            row[name] = f"n/a: {type(ex).__name__}: {str(ex)[:120]}"
        records.append(dict(batch=b, seqlen=s, head_dim=d, causal=causal, name=name,
                            value=row[name]))
        return row[name]

    return measure


def bench_ms(fn, smoke: bool) -> float:
    if smoke:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/prefill_run")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--causal-only", action="store_true")
    ap.add_argument("--paged-all", action="store_true",
                    help="with --tune: every candidate over the paged caches, not only the best")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    shapes = [(2, 64), (1, 96)] if smoke else SHAPES
    heads = 4 if smoke else HEADS
    dims = (64,) if smoke else tuple(args.dims)
    causals = (True,) if args.causal_only else (False, True)
    env = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if not smoke:
        import triton

        env |= {"gpu": torch.cuda.get_device_name(), "cap": torch.cuda.get_device_capability(),
                "triton": triton.__version__}
    print(json.dumps(env), flush=True)
    tune = args.tune and not smoke
    use_flex = not (args.no_flex or smoke)
    paged_all = args.paged_all and (tune or smoke)

    # 1. compile everything in parallel processes
    if args.jobs > 0 and not smoke:
        jobs = []
        for d in dims:
            for causal in causals:
                cfgs = candidates(d) if tune else [default_config(torch.device(dev), d,
                                                                  torch.bfloat16, causal)]
                default = default_config(torch.device(dev), d, torch.bfloat16, causal)
                for cfg in cfgs:
                    for bs in (0, *PAGE_SIZES) if cfg == default or paged_all else (0,):
                        jobs.append(("ours", d, causal, tuple(cfg.__dict__.values()), bs))
                if use_flex:
                    jobs += [("flex", b, s, d, causal) for b, s in shapes]
        jobs.sort(key=lambda j: j[0] != "flex")  # the slow flex compiles first
        t0 = time.perf_counter()
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            compile_status = dict(pool.map(_compile_job, jobs, chunksize=1))
        bad = {k: v for k, v in compile_status.items() if v != "ok"}
        print(f"compiled {len(jobs)} variants in {time.perf_counter() - t0:.0f}s; "
              f"{len(bad)} failed", flush=True)
        for k, v in bad.items():
            print(f"  compile failed {k}: {v}", flush=True)

    # 2. time
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows, records = [], []

    def save() -> str:
        (out_dir / "prefill.json").write_text(json.dumps(dict(env=env, rows=rows,
                                                              records=records), indent=1))
        md = render(rows, env, " ".join(sys.argv))
        (out_dir / "prefill.md").write_text(md)
        return md

    for d in dims:
        for causal in causals:
            default = default_config(torch.device(dev), d, torch.bfloat16, causal)
            cfgs = candidates(d) if tune else [default]
            if smoke and args.tune:  # the interpreter runs every code path of the candidates
                cfgs = smoke_candidates()
            if default not in cfgs:
                cfgs = [default, *cfgs]
            per_cfg: dict[PrefillConfig, list[float]] = {c: [] for c in cfgs}
            shape_rows = []
            for b, s in shapes:
                q, k, v, cu = make_inputs(b, s, heads, heads, d, dev)
                q4, k4, v4 = (t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))
                ref = F.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(),
                                                     is_causal=causal) if smoke else None
                if ref is None:
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        ref = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal).float()
                ref = ref.transpose(1, 2).reshape(b * s, heads, d)
                row = dict(batch=b, seqlen=s, heads=heads, head_dim=d, causal=causal)

                measure = _measurer(row, ref, smoke, records)

                for cfg in cfgs:
                    r = measure(f"ours[{cfg_name(cfg)}]", ours_fn(q, k, v, cu, s, causal, cfg))
                    per_cfg[cfg].append(r if isinstance(r, float) else 0.0)
                shape_rows.append((row, q, k, v, cu, q4, k4, v4))
            # best config over the shapes (geometric mean; a failure counts as 0)
            best = max(cfgs, key=lambda c, p=per_cfg: math.prod(max(x, 1e-3) for x in p[c]))
            for row, q, k, v, cu, q4, k4, v4 in shape_rows:
                b, s = row["batch"], row["seqlen"]
                row["ours"] = row[f"ours[{cfg_name(default)}]"]
                row["default_cfg"] = cfg_name(default)
                row["best_cfg"] = cfg_name(best)
                row["ours_best"] = row[f"ours[{cfg_name(best)}]"]
                measure = _measurer(row, None, smoke, records)
                gluon = gluon_covers(d, dev)
                if gluon:
                    measure("gluon", engine_fn(q, k, v, cu, s, causal))
                for bs in PAGE_SIZES:
                    if s % bs:
                        continue
                    paged = make_paged(k, v, b, s, bs)
                    measure(f"paged{bs}", ours_fn(q, k, v, cu, s, causal, default, paged))
                    if gluon:
                        measure(f"engine{bs}", engine_fn(q, k, v, cu, s, causal, paged))
                    if best != default and not paged_all:
                        measure(f"paged{bs}_best", ours_fn(q, k, v, cu, s, causal, best, paged))
                    for cfg in cfgs if paged_all else ():
                        if cfg != default:
                            measure(f"paged{bs}[{cfg_name(cfg)}]",
                                    ours_fn(q, k, v, cu, s, causal, cfg, paged))
                    del paged
                if not smoke:
                    _, kg, vg, _ = make_inputs(b, s, heads, heads // 4, d, dev, seed=1)
                    measure("ours_gqa4", ours_fn(q, kg, vg, cu, s, causal, default), check=False)
                    del kg, vg
                    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                     ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                        def sdpa(be=be, causal=causal, q4=q4, k4=k4, v4=v4):
                            with sdpa_kernel(be):
                                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)
                        measure(name, lambda f=sdpa: f().transpose(1, 2))
                row.pop("_ref", None)
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
            del shape_rows
            torch.cuda.empty_cache() if not smoke else None

    # 3. flex_attention last: if its compiles run long, everything else is already saved
    if use_flex:
        for row in rows:
            b, s, d, causal = row["batch"], row["seqlen"], row["head_dim"], row["causal"]
            q, k, v, _ = make_inputs(b, s, heads, heads, d, dev)
            q4, k4, v4 = (t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal).float()
            measure = _measurer(row, ref.transpose(1, 2).reshape(b * s, heads, d), smoke, records)
            flex = make_flex(b, s, d, causal, dev)
            measure("flex", lambda q4=q4, k4=k4, v4=v4, f=flex: f(q4, k4, v4).transpose(1, 2))
            row.pop("_ref", None)
            print(json.dumps({x: row[x] for x in ("batch", "seqlen", "head_dim", "causal", "flex")}),
                  flush=True)
            save()
    print(save())


def _fmt(x) -> str:
    return f"{x:.0f}" if isinstance(x, float) else ("" if x is None else "err")


def render(rows: list[dict], env: dict, cmd: str) -> str:
    cols = [("ours", "ours"), ("paged16", "paged bs16"), ("paged128", "paged bs128"),
            ("ours_gqa4", "ours GQA 32/8"), ("gluon", "Gluon"), ("engine16", "engine paged bs16"),
            ("engine128", "engine paged bs128"), ("sdpa_flash", "SDPA flash"),
            ("sdpa_cudnn", "SDPA cuDNN"), ("flex", "flex")]
    lines = [f"Prefill attention, bf16, {rows[0]['heads'] if rows else HEADS} heads, TFLOP/s "
             f"(causal counts half). {env}", f"`{cmd}`", "",
             "| B x S | causal | D | " + " | ".join(c[1] for c in cols)
             + " | ours/cuDNN | ours/flash | paged16/ours | Gluon/cuDNN | Gluon/flash | engine16/Gluon"
             " | best cfg (TFLOP/s) |",
             "|" + " --- |" * (len(cols) + 10)]
    for r in rows:
        def ratio(a, b, r=r):
            x, y = r.get(a), r.get(b)
            return f"{x / y:.2f}" if isinstance(x, float) and isinstance(y, float) and y else ""
        best = f"{r.get('best_cfg', '')} ({_fmt(r.get('ours_best'))})"
        lines.append(f"| {r['batch']}x{r['seqlen']} | {'yes' if r['causal'] else 'no'} | "
                     f"{r['head_dim']} | " + " | ".join(_fmt(r.get(c[0])) for c in cols)
                     + f" | {ratio('ours', 'sdpa_cudnn')} | {ratio('ours', 'sdpa_flash')} | "
                     f"{ratio('paged16', 'ours')} | {ratio('gluon', 'sdpa_cudnn')} | "
                     f"{ratio('gluon', 'sdpa_flash')} | {ratio('engine16', 'gluon')} | {best} |")
    lines.append("\nours / paged: the Triton kernel (flash_attn_varlen, paged_prefill with its config); Gluon:"
                 " flash_prefill_gluon (head_dim 128, sm_90); engine paged: paged_prefill as the engine calls it"
                 " (no config: the Gluon paged kernel where it covers the call)")
    lines.append(f"\nours = default config ({', '.join(sorted({r['default_cfg'] for r in rows}))})")
    lines += candidate_table(rows)
    return "\n".join(lines) + "\n"


def candidate_table(rows: list[dict]) -> list[str]:
    """Every timed configuration per row: contiguous, paged, and their ratios."""
    out = ["", "Configurations (same run; paged columns where timed):", "",
           "| B x S | causal | D | config | ours | paged bs16 | paged bs128 | ours/cuDNN "
           "| ours/flash | paged16/ours |", "|" + " --- |" * 10]
    for r in rows:
        for key in [k for k in r if k.startswith("ours[")]:
            name = key[5:-1]

            def paged(bs, name=name, r=r):
                if f"paged{bs}[{name}]" in r:
                    return r[f"paged{bs}[{name}]"]
                if name == r.get("default_cfg"):
                    return r.get(f"paged{bs}")
                return r.get(f"paged{bs}_best") if name == r.get("best_cfg") else None

            x, p16 = r[key], paged(16)

            def ratio(a, b):
                return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) and b else ""
            out.append(f"| {r['batch']}x{r['seqlen']} | {'yes' if r['causal'] else 'no'} | "
                       f"{r['head_dim']} | {name} | {_fmt(x)} | {_fmt(p16)} | {_fmt(paged(128))} | "
                       f"{ratio(x, r.get('sdpa_cudnn'))} | {ratio(x, r.get('sdpa_flash'))} | "
                       f"{ratio(p16, x)} |")
    return out


if __name__ == "__main__":
    main()
