"""Which side misses where our W4A16 kernel and its bf16 reference (cuBLAS over the
dequantized weight) disagree: both against an fp32 reference, at the 8B shapes whose GPU
checks failed in run 164 (tests/kernels/test_int4_gemm.py's weights: row 0's scales 40x).

    python3 benchmarks/int4_check.py        (CUDA)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

from test_int4_gemm import _weight  # noqa: E402 (the tests' weights)

from flashpage.kernels.int4_gemm import (  # noqa: E402
    dequantize_int4_ref,
    int4_linear_ref,
    w4a16_matmul,
)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("int4_check.py needs a CUDA GPU")
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
