"""One-row linears (a single sequence decoding) on the GPU: cuBLAS against our GEMV
(kernels/gemv.py ``gemv_row``), alone and in the chain a decode step runs them in.

Llama-3-8B shapes, bf16, 32 layers of distinct weights (so every call streams its
weight from HBM, as in a model: 14 GB, far past the L2) plus the LM head:
qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down 4096x14336 (its input the
gate/up row: SiLU·mul first, fused into ours), lm_head 128256x4096.

- ``shapes``: each projection alone, a CUDA graph of its 32 layers' calls (the LM head:
  one call), GB/s of weight read; cuBLAS (``F.linear``, SiLU·mul kernel before down),
  then each ``ROW_CANDIDATES`` tile, with and without PDL.
- ``chain``: the step without attention, a CUDA graph of 32 x [RMSNorm + residual, qkv,
  o_proj (on the first 4096 of qkv's outputs: attention's stand-in), RMSNorm + residual,
  gate_up, down] then the final norm and the LM head; time per step against the
  weight-read limit (weight bytes / the copy bandwidth measured in the run). cuBLAS
  (norms and SiLU·mul our kernels, PDL per FLASHPAGE_PDL's default) against
  ``gemv_row`` with PDL on and off, each candidate tile (one tile for every shape;
  ``row-default`` is ``default_row_config``'s per-shape choice), and the default with
  each RMSNorm moved into the next GEMV's prologue (``+ norms``: 1 norm kernel, not 65),
  then that with each whole-row tile for the down projection (K = 14336).

    python benchmarks/gemv.py --out $OUT     # $OUT/gemv.json, gemv.md
    python benchmarks/gemv.py --fp8 --out $OUT   # e4m3 weights, a scale per row
                                                 # ($OUT/gemv_fp8.*; baseline: W8A8 _scaled_mm)
    python benchmarks/gemv.py --fp8 --only shapes --kinds down --pdl 1 \
        --tiles n16k512w8,n32k256w8 --out $OUT   # a sweep: these tiles, this shape

``--down-silu separate`` runs our SiLU·mul kernel before a plain GEMV (``none``: no SiLU·mul
at all, the GEMV alone over the gate half). ``--tiles`` (names as ``RowConfig.name`` prints them, without ``row-``) replaces
``ROW_CANDIDATES``; ``--down-tiles`` adds chain variants (default + norms) with each as the
down projection's tile.

``--fp8``: the weights quantized as ``quantization="fp8"`` keeps them (layers/quant.py); the
baseline is the path such a layer runs without our GEMV (the activation quantized per token,
then ``torch._scaled_mm``), GB/s and the weight-read limit count one byte a weight.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HIDDEN, INTER, QKV, VOCAB, LAYERS = 4096, 14336, 6144, 128256, 32
DT = torch.bfloat16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", choices=["shapes", "chain"], default=None)
    ap.add_argument("--fp8", action="store_true", help="e4m3 weights with per-row scales")
    ap.add_argument("--tiles", default=None, help="comma-separated tiles (n16k512w8,...)")
    ap.add_argument("--down-tiles", default="", help="chain variants with these down tiles")
    ap.add_argument("--kinds", default="qkv,o_proj,gate_up,down,lm_head")
    ap.add_argument("--pdl", choices=["0", "1", "both"], default="both")
    ap.add_argument("--down-silu", choices=["fused", "separate", "none"], default="fused",
                    help="down's SiLU·mul: in our GEMV's prologue, our kernel before it, or "
                         "none (a plain GEMV over the gate half)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemv.py needs a CUDA GPU")
        return 1
    from gpu_timing import copy_bandwidth, time_graph

    from flashpage.kernels.gemv import ROW_CANDIDATES, RowConfig, gemv_row
    from flashpage.kernels.rms_norm import rms_norm
    from flashpage.kernels.silu_mul import silu_and_mul
    from flashpage.layers.quant import fp8_linear, quantize_fp8_rowwise

    torch.manual_seed(0)
    copy = copy_bandwidth()
    print(f"copy bandwidth {copy:,.0f} GB/s")

    scales: dict[int, torch.Tensor] = {}  # fp8 weight's data_ptr -> its row scales

    def weights(n, k, count=LAYERS):
        ws = [torch.randn(n, k, device="cuda", dtype=DT) / k ** 0.5 for _ in range(count)]
        if not args.fp8:
            return ws
        out = []
        for w in ws:
            q, scale = quantize_fp8_rowwise(w)
            scales[q.data_ptr()] = scale
            out.append(q)
        return out

    layers = {"qkv": weights(QKV, HIDDEN), "o_proj": weights(HIDDEN, HIDDEN),
              "gate_up": weights(2 * INTER, HIDDEN), "down": weights(HIDDEN, INTER)}
    lm_head = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=DT) / HIDDEN ** 0.5  # 16-bit (as the engine's)
    norm_w = torch.rand(HIDDEN, device="cuda", dtype=DT) + 0.5
    x_in = {"qkv": torch.randn(1, HIDDEN, device="cuda", dtype=DT),
            "o_proj": torch.randn(1, HIDDEN, device="cuda", dtype=DT),
            "gate_up": torch.randn(1, HIDDEN, device="cuda", dtype=DT),
            "down": torch.randn(1, 2 * INTER, device="cuda", dtype=DT),
            "lm_head": torch.randn(1, HIDDEN, device="cuda", dtype=DT)}
    def tiles(names: str) -> list[RowConfig]:
        out = []
        for name in filter(None, names.split(",")):
            m = re.fullmatch(r"(?:row-)?n(\d+)k(\d+)w(\d+)", name.strip())
            if m is None:
                raise SystemExit(f"--tiles: {name!r} is not a tile name such as n16k512w8")
            out.append(RowConfig(*map(int, m.groups())))
        return out

    candidates = tiles(args.tiles) if args.tiles is not None else list(ROW_CANDIDATES)
    configs: list[RowConfig | None] = [None, *candidates]
    pdls = {"0": [False], "1": [True], "both": [False, True]}[args.pdl]
    kinds = args.kinds.split(",")
    results: dict = {"copy_gbps": copy, "shapes": [], "chain": []}

    def linear(kind, x, w, cfg, pdl):
        silu = kind == "down"
        scale = scales.get(w.data_ptr())
        if cfg == "cublas":
            a = silu_and_mul(x) if silu else x
            return F.linear(a, w) if scale is None else fp8_linear(a, w, scale)
        if silu and args.down_silu != "fused":
            x = silu_and_mul(x, pdl=pdl) if args.down_silu == "separate" else x[:, :INTER]
            silu = False
        return gemv_row(x, w, config=cfg, silu_mul=silu, pdl=pdl, scale=scale)

    if args.only in (None, "shapes"):
        for kind, ws in [*layers.items(), ("lm_head", [lm_head])]:
            if kind not in kinds:
                continue
            nbytes = sum(w.numel() * w.element_size() for w in ws)
            for cfg in ["cublas", *configs]:
                for pdl in ([False] if cfg == "cublas" else pdls):
                    t = time_graph(lambda kind=kind, ws=ws, cfg=cfg, pdl=pdl:
                                   [linear(kind, x_in[kind], w, cfg, pdl) for w in ws])
                    name = cfg if cfg == "cublas" else (cfg.name if cfg else "row-default")
                    row = {"shape": kind, "kernel": name, "pdl": pdl, "us_per_call": t / len(ws) * 1e6,
                           "gbps": nbytes / t / 1e9, "of_copy": nbytes / t / 1e9 / copy}
                    results["shapes"].append(row)
                    print(f"{kind:8s} {name:18s} pdl={int(pdl)} {row['us_per_call']:8.1f} us "
                          f"{row['gbps']:7.0f} GB/s ({row['of_copy']:.0%} of copy)")

    if args.only in (None, "chain"):
        total = (sum(w.numel() * w.element_size() for ws in layers.values() for w in ws)
                 + lm_head.numel() * lm_head.element_size())
        limit = total / (copy * 1e9)
        x0 = torch.randn(1, HIDDEN, device="cuda", dtype=DT)

        def step(cfg, pdl, fuse=False, down_cfg=None):
            """The model's order: norm (+ residual) -> qkv -> o_proj -> norm + residual ->
            gate_up -> down, 32 times, then the final norm and the LM head; ``fuse``:
            each norm inside the next GEMV's prologue (gemv_row's ``norm``)."""
            x, res = x0, None
            for i in range(LAYERS):
                for kind in ("qkv", "gate_up"):
                    if fuse:
                        new_res = torch.empty_like(x) if res is not None else None
                        w = layers[kind][i]
                        h = gemv_row(x, w, config=cfg, pdl=pdl, norm=(norm_w, 1e-5),
                                     residual=res, residual_out=new_res, scale=scales.get(w.data_ptr()))
                        res = new_res if res is not None else x
                    else:
                        if res is None:
                            res, x = x, rms_norm(x, norm_w, 1e-5, pdl=pdl)
                        else:
                            x, res = rms_norm(x, norm_w, 1e-5, res, pdl=pdl)
                        h = linear(kind, x, layers[kind][i], cfg, pdl)
                    if kind == "qkv":
                        x = linear("o_proj", h[:, :HIDDEN], layers["o_proj"][i], cfg, pdl)
                    else:
                        x = linear("down", h, layers["down"][i], down_cfg or cfg, pdl)
            h, _ = rms_norm(x, norm_w, 1e-5, res, pdl=pdl)
            return linear("lm_head", h, lm_head, cfg, pdl)

        variants = [("cublas", False, False), ("cublas", True, False)]
        variants += [(cfg, pdl, False) for cfg in configs for pdl in pdls]
        variants += [(None, pdl, True) for pdl in pdls]
        variants += [(None, True, True, c) for c in configs if c and c.block_k >= INTER]
        variants += [(None, True, True, c) for c in tiles(args.down_tiles)]
        for cfg, pdl, fuse, *down in variants:
            down_cfg = down[0] if down else None
            t = time_graph(lambda cfg=cfg, pdl=pdl, fuse=fuse, down_cfg=down_cfg:
                           step(cfg, pdl, fuse, down_cfg), reps=10)
            name = cfg if cfg == "cublas" else (cfg.name if cfg else "row-default")
            name += " + norms" if fuse else ""
            name += f", down {down_cfg.name}" if down_cfg else ""
            row = {"kernel": name, "pdl": pdl, "ms_per_step": t * 1e3, "limit_ms": limit * 1e3,
                   "of_limit": limit / t, "tok_per_s_equiv": 1 / t}
            results["chain"].append(row)
            print(f"chain {name:26s} pdl={int(pdl)} {t * 1e3:6.3f} ms/step "
                  f"({limit / t:.1%} of the weight-read limit {limit * 1e3:.3f} ms)")

    os.makedirs(args.out, exist_ok=True)
    stem = "gemv_fp8" if args.fp8 else "gemv"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["| shape | kernel | PDL | us per call | GB/s | of copy |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['kernel']} | {int(r['pdl'])} | {r['us_per_call']:.1f} | "
              f"{r['gbps']:,.0f} | {r['of_copy']:.0%} |" for r in results["shapes"]]
    lines += ["", "| chain kernel | PDL | ms per step | of the weight-read limit |", "|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {int(r['pdl'])} | {r['ms_per_step']:.3f} | {r['of_limit']:.1%} |"
              for r in results["chain"]]
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(f"copy bandwidth {copy:,.0f} GB/s\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
