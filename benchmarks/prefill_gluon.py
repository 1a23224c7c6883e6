"""The Gluon FA3-style prefill (kernels/flash_prefill_gluon.py) beside our Triton prefill
(``flash_attn_varlen``, its default config) and SDPA's cuDNN and flash backends, one run,
bf16, 32 heads, head_dim 128.

    python benchmarks/prefill_gluon.py --out $OUT      # ~1-2 minutes on an H200

Shapes: 2 x 4096 and 1 x 16384 causal (the targets), 8 x 1024 causal, 2 x 4096 full.
TFLOP/s counts 4 * B * H * S^2 * D, half of it when causal; each time is the median of
triton.testing.do_bench. Gluon variants: ``gluon`` (the defaults: persistent, one program per
SM, ping-pong on, every head's last query tile first), ``gluon_grid`` (one program per work
tile), ``gluon_no_pingpong``, ``gluon_m_fastest`` (one head's query tiles adjacent),
``gluon_stages3`` (3-deep K/V ring). Every output is checked against SDPA flash first (rel
err < 1e-2; a failure is recorded as a string, never raised: a hang is not, so run this
under ``timeout``). Writes $OUT/prefill_gluon.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HEADS, D = 32, 128
SHAPES = [(2, 4096, True), (1, 16384, True), (8, 1024, True), (2, 4096, False)]
GLUON_VARIANTS = {"gluon": {}, "gluon_grid": {"persistent": False},
                  "gluon_no_pingpong": {"pingpong": False}, "gluon_m_fastest": {"m_fastest": True},
                  "gluon_stages3": {"num_stages": 3}}
COLUMNS = [*GLUON_VARIANTS, "triton", "sdpa_cudnn", "sdpa_flash"]


def tflops(b: int, s: int, causal: bool, ms: float) -> float:
    return round(4 * b * HEADS * s * s * D / (2 if causal else 1) / (ms * 1e-3) / 1e12, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (sm_90 for the Gluon kernel)")
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashpage.kernels.flash_prefill import flash_attn_varlen
    from flashpage.kernels.flash_prefill_gluon import flash_prefill_gluon

    t0 = time.time()
    rows = []
    for b, s, causal in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b * s, HEADS, D, generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
        q4, k4, v4 = (t.view(b, s, HEADS, D).transpose(1, 2) for t in (q, k, v))

        def sdpa(be, causal=causal, q4=q4, k4=k4, v4=v4):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)

        ref = sdpa(SDPBackend.FLASH_ATTENTION).transpose(1, 2).reshape(b * s, HEADS, D).float()
        fns = {name: (lambda kw=kw, causal=causal, q=q, k=k, v=v, cu=cu, s=s:
                      flash_prefill_gluon(q, k, v, cu, s, causal=causal, **kw))
               for name, kw in GLUON_VARIANTS.items()}
        fns["triton"] = lambda causal=causal, q=q, k=k, v=v, cu=cu, s=s: flash_attn_varlen(
            q, k, v, cu, cu, s, s, causal=causal)
        fns["sdpa_cudnn"] = lambda: sdpa(SDPBackend.CUDNN_ATTENTION).transpose(1, 2)
        fns["sdpa_flash"] = lambda: sdpa(SDPBackend.FLASH_ATTENTION).transpose(1, 2)
        row: dict = dict(batch=b, seqlen=s, heads=HEADS, head_dim=D, causal=causal)
        for name, fn in fns.items():
            try:
                o = fn().reshape(ref.shape).float()
                torch.cuda.synchronize()
                err = ((o - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    raise RuntimeError(f"wrong output: rel err {err:.3g}")
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                row[name] = tflops(b, s, causal, ms)
            except Exception as ex:  # recorded, the other columns still run
                row[name] = f"n/a: {type(ex).__name__}: {str(ex)[:160]}"
            print(f"  {b}x{s} {'causal' if causal else 'full'} {name}: {row[name]}", flush=True)
        rows.append(row)
        del q, k, v, q4, k4, v4, ref
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__, seconds=round(time.time() - t0, 1))
        out = Path(args.out)
        os.makedirs(out, exist_ok=True)  # written after every shape: a later hang keeps these
        (out / "prefill_gluon.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print(render(rows, env))


def render(rows: list[dict], env: dict) -> str:
    def cell(x) -> str:
        return f"{x:.0f}" if isinstance(x, float) else "n/a"

    def ratio(r, a, b) -> str:
        x, y = r.get(a), r.get(b)
        return f"{x / y:.2f}x" if isinstance(x, float) and isinstance(y, float) else "n/a"

    lines = [f"TFLOP/s, bf16, {HEADS} heads, head_dim {D} ({env['device']}, torch {env['torch']}, "
             f"triton {env['triton']}, {env['seconds']} s)", "",
             "| shape | " + " | ".join(COLUMNS) + " | gluon / cuDNN | gluon / triton |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for r in rows:
        shape = f"{r['batch']}x{r['seqlen']} {'causal' if r['causal'] else 'full'}"
        lines.append(f"| {shape} | " + " | ".join(cell(r.get(c)) for c in COLUMNS)
                     + f" | {ratio(r, 'gluon', 'sdpa_cudnn')} | {ratio(r, 'gluon', 'triton')} |")
    fails = [(r["batch"], r["seqlen"], c, r[c]) for r in rows for c in COLUMNS
             if isinstance(r.get(c), str)]
    lines += [f"- {b}x{s} {c}: {why}" for b, s, c, why in fails]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
