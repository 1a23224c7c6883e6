"""Which side misses where our W4A16 kernel and its bf16 reference (cuBLAS over the
dequantized weight) disagree: both against an fp32 reference, at the 8B shapes whose GPU
checks failed in run 164 (tests/kernels/test_int4_gemm.py's weights: row 0's scales 40x).

    python3 benchmarks/int4_check.py        (CUDA)
    python3 benchmarks/int4_check.py --tiles   (CUDA) run 201's question: which of the swapped
        GEMM's decode paths goes wrong under fp16 x (the fragment tiles' sums were off by
        ~3e4 there): every tile form (older / fragment, per weight / on the sums, fp16 /
        x-typed scales) at 64 and 128 rows of a 4096 x 4096 weight in groups of 128, its
        max error against fp32 beside the 16-bit reference's, bf16 and fp16, and the
        decoded weight of a one-hot x against the reference's
    python3 benchmarks/int4_check.py --bits    (CUDA) the fragment per-weight tile at 128 and
        256 rows (x-typed scales: the packed 16-bit PTX) on one-hot rows, as
        test_fragment_per_weight_bits_on_the_gpu: how many weights differ from the
        reference's, and the first few (feature, k, q, z, scale, ours, reference)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

from test_int4_gemm import _weight  # noqa: E402 (the tests' weights)

from flashpage.kernels.int4_gemm import (  # noqa: E402
    Int4GemmConfig,
    dequantize_int4_ref,
    int4_linear_ref,
    w4a16_gemm,
    w4a16_matmul,
)


def tiles() -> None:
    """--tiles: each decode path's error under bf16 and fp16 x (see the module docstring)."""
    forms = {"older sums pm64": Int4GemmConfig(64, 64, 128, 0, 4, 4, per_weight=False),
             "older per weight wm64": Int4GemmConfig(64, 64, 128, 0, 4, 4),
             "fragment sums fpm64": Int4GemmConfig(64, 64, 128, 0, 4, 4, per_weight=False,
                                                   fragment=True),
             "fragment per weight fwm64": Int4GemmConfig(64, 64, 128, 0, 4, 4, fragment=True),
             "fragment sums fpm128 t": Int4GemmConfig(128, 64, 128, 0, 4, 3, per_weight=False,
                                                      tma=True, fragment=True)}
    n = k = 4096
    for dt in (torch.bfloat16, torch.float16):
        for scale_dt in (torch.float16, dt):
            qw, scales, zeros, _ = _weight(n, k, 128, 7)
            scales = scales.to(scale_dt)
            eye = torch.eye(k, device="cuda", dtype=dt)[:64]
            want_w = dequantize_int4_ref(qw, scales, zeros, dt)[:, :64].t().float()
            for m in (64, 128):
                x = torch.randn(m, k, device="cuda", dtype=dt)
                ref32 = x.float() @ dequantize_int4_ref(qw, scales, zeros, torch.float32).t()
                ref16 = (int4_linear_ref(x, qw, scales, zeros).float() - ref32).abs().max().item()
                for name, cfg in forms.items():
                    try:
                        got = w4a16_gemm(x, qw, scales, zeros, config=cfg).float()
                        err = f"{(got - ref32).abs().max().item():.4g}"
                        w = w4a16_gemm(eye, qw, scales, zeros, config=cfg).float()
                        werr = f"{(w - want_w).abs().max().item():.4g}"
                    except Exception as e:  # noqa: BLE001 (a diagnostic: report and go on)
                        err, werr = f"error: {e}", "-"
                    print(f"x {str(dt)[6:]} scales {str(scale_dt)[6:]} m={m} {name}: max |ours - "
                          f"fp32| {err} (16-bit ref {ref16:.4g}); one-hot weight max diff {werr}",
                          flush=True)


def bits() -> None:
    """--bits: where the per-weight fragment tile's decoded weights miss the reference's."""
    n, k = 192, 512
    for dt in (torch.bfloat16, torch.float16):
        for g in (32, 128):
            qw, scales, zeros, q = _weight(n, k, g, g, dt)
            x = torch.eye(k, dtype=dt, device="cuda")[:256]
            want = dequantize_int4_ref(qw, scales, zeros, dt)[:, :256].t()
            for bm in (128, 256):
                for tma in (True, False):
                    cfg = Int4GemmConfig(bm, 64, 128, 1, 4, 3 if bm == 256 else 4, fragment=True, tma=tma)
                    try:
                        got = w4a16_gemm(x, qw, scales, zeros, config=cfg)
                    except Exception as e:  # noqa: BLE001 (a diagnostic: report and go on)
                        print(f"{str(dt)[6:]} g={g} {cfg.name}: error {e}", flush=True)
                        continue
                    bad = (got != want).nonzero().tolist()
                    print(f"{str(dt)[6:]} g={g} {cfg.name}: {len(bad)} of {want.numel()} weights differ; "
                          f"rows (k) with a miss {sorted({r for r, _ in bad})[:12]}, features "
                          f"{sorted({c for _, c in bad})[:12]}", flush=True)
                    for kk, f in bad[:6]:
                        print(f"   feature {f} k {kk}: q {int(q[f, kk])} z {int(zeros[f, kk // g])} "
                              f"scale {float(scales[f, kk // g])!r} ours {float(got[kk, f])!r} "
                              f"ref {float(want[kk, f])!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", action="store_true", help="each decode path under bf16 / fp16 x")
    ap.add_argument("--bits", action="store_true", help="where the per-weight fragment tile misses")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("int4_check.py needs a CUDA GPU")
    if args.bits:
        bits()
        return
    if args.tiles:
        tiles()
        return
    for n, k, m in [(4096, 14336, 16), (4096, 4096, 300), (6144, 4096, 1)]:
        qw, scales, zeros, _ = _weight(n, k, 128, 7)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ours = w4a16_matmul(x, qw, scales, zeros).float()
        ref16 = int4_linear_ref(x, qw, scales, zeros).float()
        ref32 = x.float() @ dequantize_int4_ref(qw, scales, zeros, torch.float32).t()
        print(f"{n}x{k} m={m}: |out| mean {ref32.abs().mean().item():.3f}, column 0 "
              f"{ref32[:, 0].abs().mean().item():.3f}; max |ours - fp32| "
              f"{(ours - ref32).abs().max().item():.4f}, max |bf16 ref - fp32| "
              f"{(ref16 - ref32).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
