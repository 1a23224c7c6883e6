"""The Gluon FA3-style prefill (kernels/flash_prefill_gluon.py) beside our Triton prefill
(``flash_attn_varlen``, its default config) and SDPA's cuDNN and flash backends, one run,
bf16, 32 heads, head_dim 128.

    python benchmarks/prefill_gluon.py --out $OUT      # ~2-3 minutes on an H200

Shapes: 2 x 4096 and 1 x 16384 causal (the targets), 8 x 1024 causal, 2 x 4096 full.
TFLOP/s counts 4 * B * H * S^2 * D, half of it when causal; each time is the median of
triton.testing.do_bench. Gluon variants (launcher knobs, see flash_prefill_gluon), static
schedules first: ``gluon_run72`` (run 72's default: static, all pairs in one chunk, no PV
overlap, one Q buffer), ``gluon_grid`` (one program per work tile, default order),
``gluon_grid_all`` (one per tile, all pairs), ``gluon_snake_all`` (static boustrophedon, all
pairs); ``gluon`` (the defaults: persistent, dynamic schedule (a global tile counter the
kernel zeroes itself), the work order in chunks of default_head_group (head, sequence)
pairs, heaviest first within each, ping-pong, PV overlap, two Q buffers), ``gluon_memset``
(the counter zeroed by a memset before each launch), ``gluon_no_overlap`` (the softmax waits
for its own P.V), ``gluon_no_pingpong``, ``gluon_q1`` (one Q buffer: the next tile's Q loads
only once this one's last S is done), ``gluon_stages3`` (3-deep K/V ring, so one Q buffer),
``gluon_hg1`` / ``gluon_hg_x4`` / ``gluon_hg_all`` (chunks of 1 pair, 4x the default, all
pairs). Every output is checked against SDPA flash first (rel err < 1e-2; a failure is
recorded as a string, never raised: a hang is not, so run this under ``timeout``); past
--budget seconds the remaining Gluon variants are skipped (recorded as such). Writes
$OUT/prefill_gluon.json after every measurement and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HEADS, D = 32, 128
SHAPES = [(2, 4096, True), (1, 16384, True), (8, 1024, True), (2, 4096, False)]


def _hg(b: int, s: int, factor: int) -> int:
    from flashpage.kernels.flash_prefill_gluon import default_head_group

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return min(HEADS * b, factor * default_head_group(-(-s // 128), HEADS * b, sms))


# name -> (batch, seqlen) -> launcher keywords
GLUON_VARIANTS: dict[str, Callable[[int, int], dict]] = {
    # the static schedules first: a hang in the dynamic one's counter or tile posting would
    # leave them timed (in the JSON, written after every column)
    "gluon_run72": lambda b, s: {"schedule": "static", "pv_overlap": False, "head_group": HEADS * b,
                                 "q_buffers": 1},
    "gluon_grid": lambda b, s: {"persistent": False},
    "gluon_grid_all": lambda b, s: {"persistent": False, "head_group": HEADS * b},
    "gluon_snake_all": lambda b, s: {"schedule": "snake", "head_group": HEADS * b},
    "gluon": lambda b, s: {},
    "gluon_memset": lambda b, s: {"schedule": "dynamic_memset"},
    "gluon_no_overlap": lambda b, s: {"pv_overlap": False},
    "gluon_no_pingpong": lambda b, s: {"pingpong": False},
    "gluon_q1": lambda b, s: {"q_buffers": 1},
    "gluon_q2": lambda b, s: {"q_buffers": 2},
    "gluon_stages3": lambda b, s: {"num_stages": 3},
    "gluon_hg1": lambda b, s: {"head_group": 1},
    "gluon_hg_x4": lambda b, s: {"head_group": _hg(b, s, 4)},
    "gluon_hg_all": lambda b, s: {"head_group": HEADS * b},
}
COLUMNS = [*GLUON_VARIANTS, "triton", "sdpa_cudnn", "sdpa_flash"]


def tflops(b: int, s: int, causal: bool, ms: float) -> float:
    return round(4 * b * HEADS * s * s * D / (2 if causal else 1) / (ms * 1e-3) / 1e12, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=200.0,
                    help="seconds after which the remaining Gluon variants are skipped")
    ap.add_argument("--variants", default="", help="comma-separated Gluon variants (default: all)")
    ap.add_argument("--causal-only", action="store_true", help="only the causal shapes")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every column this many times, in turn, and keep the median")
    args = ap.parse_args()
    chosen = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(chosen) - set(GLUON_VARIANTS))
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {sorted(GLUON_VARIANTS)}")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (sm_90 for the Gluon kernel)")
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashpage.kernels.flash_prefill import flash_attn_varlen
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

    t0 = time.time()
    rows = []
    for b, s, causal in SHAPES:
        if args.causal_only and not causal:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b * s, HEADS, D, generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
        q4, k4, v4 = (t.view(b, s, HEADS, D).transpose(1, 2) for t in (q, k, v))

        def sdpa(be, causal=causal, q4=q4, k4=k4, v4=v4):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)

        ref = sdpa(SDPBackend.FLASH_ATTENTION).transpose(1, 2).reshape(b * s, HEADS, D).float()
        kwargs = {name: make(b, s) for name, make in GLUON_VARIANTS.items() if not chosen or name in chosen}
        fns = {name: (lambda kw=kw, causal=causal, q=q, k=k, v=v, cu=cu, s=s:
                      flash_prefill_gluon(q, k, v, cu, s, causal=causal, **kw))
               for name, kw in kwargs.items()}
        fns["triton"] = lambda causal=causal, q=q, k=k, v=v, cu=cu, s=s: flash_attn_varlen(
            q, k, v, cu, cu, s, s, causal=causal)
        fns["sdpa_cudnn"] = lambda: sdpa(SDPBackend.CUDNN_ATTENTION).transpose(1, 2)
        fns["sdpa_flash"] = lambda: sdpa(SDPBackend.FLASH_ATTENTION).transpose(1, 2)
        row: dict = dict(batch=b, seqlen=s, heads=HEADS, head_dim=D, causal=causal,
                         gluon_kwargs=kwargs, default_head_group=_hg(b, s, 1))
        times: dict[str, list[float]] = {}
        for rnd in range(args.rounds):  # the columns in turn each round: drift hits them alike
            for name, fn in fns.items():
                if isinstance(row.get(name), str):
                    continue  # failed or skipped in an earlier round
                if name.startswith("gluon") and time.time() - t0 > args.budget:
                    row[name] = f"n/a: skipped, past --budget {args.budget:.0f} s"
                    print(f"  {b}x{s} {name}: {row[name]}", flush=True)
                    continue
                try:
                    if rnd == 0:
                        o = fn().reshape(ref.shape).float()
                        torch.cuda.synchronize()
                        err = ((o - ref).norm() / ref.norm()).item()
                        if not err < 1e-2:
                            raise RuntimeError(f"wrong output: rel err {err:.3g}")
                    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                    times.setdefault(name, []).append(tflops(b, s, causal, ms))
                    row[name] = statistics.median(times[name])
                    row.setdefault("rounds", {})[name] = times[name]
                except Exception as ex:  # recorded, the other columns still run
                    row[name] = f"n/a: {type(ex).__name__}: {str(ex)[:160]}"
                print(f"  {b}x{s} {'causal' if causal else 'full'} {name}: {row[name]}", flush=True)
                env = save(args.out, t0, [*rows, row])  # after every column: a hang keeps these
        rows.append(row)
        del q, k, v, q4, k4, v4, ref
    print(render(rows, env))


def save(out: str, t0: float, rows: list[dict]) -> dict:
    env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, seconds=round(time.time() - t0, 1))
    os.makedirs(out, exist_ok=True)
    (Path(out) / "prefill_gluon.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    return env


def render(rows: list[dict], env: dict) -> str:
    def cell(x) -> str:
        return f"{x:.0f}" if isinstance(x, float) else "n/a"

    def ratio(r, a, b) -> str:
        x, y = r.get(a), r.get(b)
        return f"{x / y:.2f}x" if isinstance(x, float) and isinstance(y, float) else "n/a"

    lines = [f"TFLOP/s, bf16, {HEADS} heads, head_dim {D} ({env['device']}, torch {env['torch']}, "
             f"triton {env['triton']}, {env['seconds']} s)", "",
             "| shape | " + " | ".join(COLUMNS)
             + " | gluon / cuDNN | gluon / flash | best gluon | best / cuDNN |",
             "|---" * (len(COLUMNS) + 5) + "|"]
    for r in rows:
        shape = f"{r['batch']}x{r['seqlen']} {'causal' if r['causal'] else 'full'}"
        timed = {c: r[c] for c in GLUON_VARIANTS if isinstance(r.get(c), float)}
        best = max(timed, key=lambda c: timed[c]) if timed else "gluon"
        lines.append(f"| {shape} | " + " | ".join(cell(r.get(c)) for c in COLUMNS)
                     + f" | {ratio(r, 'gluon', 'sdpa_cudnn')} | {ratio(r, 'gluon', 'sdpa_flash')}"
                     + f" | {best} | {ratio(r, best, 'sdpa_cudnn')} |")
    fails = [(r["batch"], r["seqlen"], c, r[c]) for r in rows for c in COLUMNS
             if isinstance(r.get(c), str)]
    lines += [f"- {b}x{s} {c}: {why}" for b, s, c, why in fails]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
