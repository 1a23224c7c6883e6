"""The int4 GEMV at small and odd shapes (the tiny test models': K = 128 in one group) and
the 8B ones, every row count 1-16, bf16: its error against an fp32 linear of the
dequantized weight, beside cuBLAS-over-the-bf16-dequantized-weight's own, per form (the
default, the tensor-core and the CUDA-core forms). A form far worse than cuBLAS is a bug.

    python3 benchmarks/int4_gemv_check.py        (CUDA)
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("int4_gemv_check.py needs a CUDA GPU")
    from flashpage.kernels.int4_gemm import pack_int4
    from flashpage.kernels.int4_gemv import Int4GemvConfig, default_config, int4_gemv
    from flashpage.models.int4_formats import quantize_int4

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    worst: dict[str, float] = {}
    for n, k, group in ((256, 128, 128), (128, 128, 128), (256, 128, 32), (384, 256, 128),
                        (6144, 4096, 128), (4096, 14336, 128)):
        w = torch.randn(n, k, generator=g) * 0.05
        q, s, z = quantize_int4(w, group)
        qw, s, z = pack_int4(q).to(dev), s.to(dev), z.to(dev)
        deq = ((q.float() - z.cpu().float().repeat_interleave(group, 1))
               * s.cpu().float().repeat_interleave(group, 1)).to(dev)
        for m in range(1, 17):
            x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
            ref = x.float() @ deq.t()
            cub = (x @ deq.to(torch.bfloat16).t()).float()
            scale = ref.abs().max().item()
            base = (cub - ref).abs().max().item() / scale
            forms = {"default": default_config(m, n, k),
                     "dot+asm": Int4GemvConfig(64, 128, 0, 4, dot=True, asm=True),
                     "dot": Int4GemvConfig(64, 128, 0, 4, dot=True),
                     "fma": Int4GemvConfig(64, 128, 0, 4)}
            line = []
            for name, cfg in forms.items():
                y = int4_gemv(x, qw, s, z, config=cfg).float()
                err = (y - ref).abs().max().item() / scale
                worst[name] = max(worst.get(name, 0.0), err / max(base, 1e-6))
                line.append(f"{name} {err:.2e}")
            print(f"N={n:5d} K={k:5d} G={group:3d} m={m:2d}  cuBLAS {base:.2e}  " + "  ".join(line))
    print("worst error / cuBLAS's per form:", {k: round(v, 2) for k, v in worst.items()})


if __name__ == "__main__":
    main()
