"""Every FLASHPAGE_* environment variable, typed, in one place."""

from __future__ import annotations

import os


def attention_backend() -> str | None:
    """FLASHPAGE_ATTENTION_BACKEND: force an attention backend (torch_native, triton, flex)."""
    return os.environ.get("FLASHPAGE_ATTENTION_BACKEND") or None


def log_level() -> str:
    """FLASHPAGE_LOG_LEVEL: logging level name (default INFO)."""
    return os.environ.get("FLASHPAGE_LOG_LEVEL", "INFO").upper()


def cache_dir() -> str:
    """FLASHPAGE_CACHE_DIR: where converted tokenizers are kept (default ~/.cache/flashpage)."""
    return os.environ.get("FLASHPAGE_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "flashpage"))


def skinny_gemm() -> bool:
    """FLASHPAGE_SKINNY_GEMM=1: time our decode-batch GEMM (kernels/gemv.py) against cuBLAS
    at start-up and use it where it wins. Off by default: it won per call (qkv and the LM
    head at one row) but has not yet been shown to win end to end (BENCHMARKS.md)."""
    return os.environ.get("FLASHPAGE_SKINNY_GEMM", "0") == "1"


def gemv_row() -> bool:
    """FLASHPAGE_GEMV: one-row linears (a single sequence decoding) through our GEMV
    (kernels/gemv.py ``gemv_row``: weights requested before the previous kernel ends,
    SiLU·mul fused into the down projection) instead of cuBLAS. "1" on, "0" off (the
    default until it is shown to win end to end). Read when a decode graph is captured."""
    return os.environ.get("FLASHPAGE_GEMV", "0").strip().lower() in ("1", "on", "auto")


def fused_moe() -> bool:
    """FLASHPAGE_FUSED_MOE (default 1; 0 turns it off): decode-batch MoE through our fused
    Triton kernel (kernels/fused_moe.py: only the routed experts' weights are read) instead
    of every expert on every token. On the H200 it took DeepSeek-V2-Lite from 2,305 to
    2,713 output tok/s (BENCHMARKS.md, session 3)."""
    return os.environ.get("FLASHPAGE_FUSED_MOE", "1") != "0"


def pdl() -> str:
    """FLASHPAGE_PDL: programmatic dependent launch of our decode-path Triton kernels
    (Hopper and newer; kernels/pdl.py), so a kernel's launch overlaps the tail of the one
    before it. "auto" (the default): every decode-path kernel except the two that timed
    slower with it on the H200 (unsplit paged decode, 0.91x at 32 x 4096; MLA decode,
    0.97-0.99x); "1"/"all": every one; "0": none."""
    mode = os.environ.get("FLASHPAGE_PDL", "auto").strip().lower()
    return {"1": "all", "": "0", "off": "0", "none": "0"}.get(mode, mode)


def sampler_kernel() -> bool | None:
    """FLASHPAGE_SAMPLER_KERNEL: sample with the one-pass Gumbel-max kernel
    (kernels/sampling.py). "auto" (the default): on CUDA; "1": always (on the CPU through
    Triton's interpreter); "0": never (the torch path: softmax, exponential noise, argmax)."""
    mode = os.environ.get("FLASHPAGE_SAMPLER_KERNEL", "auto").strip().lower()
    return {"1": True, "0": False}.get(mode)
