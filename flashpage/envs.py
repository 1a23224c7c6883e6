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


def skinny_gemm(default: bool = False) -> bool:
    """FLASHPAGE_SKINNY_GEMM=1: time our decode-batch GEMM (kernels/gemv.py) against cuBLAS
    at start-up and use it where it wins; =0: never. Unset: ``default``, which the engine
    makes on for fp8 weights only (there the alternative is W8A8, an activation-quantizing
    kernel before each GEMM) and off for 16-bit ones: it won per call (qkv and the LM head
    at one row) but has not yet been shown to win end to end (BENCHMARKS.md)."""
    value = os.environ.get("FLASHPAGE_SKINNY_GEMM", "").strip()
    return default if not value else value == "1"


def gemv_row() -> bool:
    """FLASHPAGE_GEMV: one-row linears (a single sequence decoding) through our GEMV
    (kernels/gemv.py ``gemv_row``: weights requested before the previous kernel ends,
    RMSNorm and SiLU·mul fused into the linears after them) instead of cuBLAS. On by
    default ("0" turns it off): one sequence of the 8B shape decoded at 237.9 tok/s
    against 215.9 with cuBLAS on the H200 (BENCHMARKS.md, session 6). Read when a decode
    graph is captured."""
    return os.environ.get("FLASHPAGE_GEMV", "1").strip().lower() not in ("0", "off", "")


def gemv_whole_row() -> int | None:
    """FLASHPAGE_GEMV_WHOLE_ROW: the widest weight row the one-row GEMV loads whole
    (a power of two up to 16384; unset: kernels/gemv.MAX_WHOLE_ROW, 8192). For A/Bs: at
    16384 the 8B down projection ran 18% slower end to end (BENCHMARKS.md, run 41)."""
    value = os.environ.get("FLASHPAGE_GEMV_WHOLE_ROW", "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"FLASHPAGE_GEMV_WHOLE_ROW must be a power of two in 16..16384, got {value!r}")
    return int(value)


def decode_warp_split() -> bool:
    """Paged decode over an fp8 cache with each warp on its own 16-key piece of a tile and
    its own softmax state (kernels/paged_decode.DecodeConfig.warp_split) where that won on
    the H200 (64 programs and up); FLASHPAGE_DECODE_WARP_SPLIT=0 keeps the shared-state
    loop. Read when a config is chosen (a decode graph keeps the one it captured)."""
    return os.environ.get("FLASHPAGE_DECODE_WARP_SPLIT", "1") != "0"


def decode_gluon() -> bool:
    """Paged decode over an fp8 cache on Hopper through the Gluon kernel
    (kernels/paged_decode_gluon.py) where it covers the call (unsplit grids, block size 16,
    head_dim 128, no window), in its persistent keys_m form: 1.27-1.46x the Triton warp-split
    loop at the engine's batches on the H200 (run 79, benchmarks/decode_gluon_knobs.py).
    FLASHPAGE_DECODE_GLUON=0 keeps the Triton kernel; a variant name picks that form
    (decode_gluon_variant). Read when a config is chosen (a decode graph keeps the one it
    captured)."""
    return os.environ.get("FLASHPAGE_DECODE_GLUON", "1") != "0"


def decode_gluon_variant() -> str | None:
    """FLASHPAGE_DECODE_GLUON set to a variant name of the persistent Gluon decode
    (paged_decode_gluon.VARIANTS: default, keys_m) runs that one instead of the engine's
    (keys_m; groups over 8 always run default); None for 1 / unset."""
    v = os.environ.get("FLASHPAGE_DECODE_GLUON", "1")
    return None if v in ("0", "1") else v


def decode_gluon_bf16() -> bool:
    """Paged decode over a bf16/fp16 cache on Hopper through the persistent Gluon keys_m kernel
    (kernels/paged_decode_gluon_bf16.py) where it covers the call
    (paged_decode.gluon_bf16_unsupported: unsplit grids, block size 16, head_dim 128, GQA groups
    of 1-8, no window): 0.96-1.01x SDPA cuDNN and 1.00-1.09x the Triton kernel at issue 6's
    shapes (run 86), 8B bf16 end to end 10,943 vs 10,720 tok/s (run 88).
    FLASHPAGE_DECODE_GLUON_BF16=0 keeps the Triton kernel. Read when a config is chosen (a
    decode graph keeps the one it captured)."""
    return os.environ.get("FLASHPAGE_DECODE_GLUON_BF16", "1") != "0"


def prefill_gluon() -> bool:
    """Paged prefill (flash_prefill.paged_prefill, the triton backend's prompt chunks and
    prefix hits) on Hopper through the Gluon FA3-style kernel
    (kernels/flash_prefill_gluon.paged_prefill_gluon) where it covers the call
    (flash_prefill.gluon_prefill_unsupported: bf16/fp16 cache in q's dtype, head_dim 128,
    block size a power of two >= 16, no window): 1.18-1.32x the Triton paged kernel at block
    16 (run 87), 8B bf16 end to end 10,631 vs 10,596 tok/s (run 84), its GPU tests and the
    engine's passing with it (run 82). FLASHPAGE_PREFILL_GLUON=0 keeps the Triton kernel.
    Read at each call."""
    return os.environ.get("FLASHPAGE_PREFILL_GLUON", "1") != "0"


def prefill_producer() -> str:
    """FLASHPAGE_PREFILL_PRODUCER: the Gluon paged prefill's K/V producer ("tma", "gather",
    "tma1"; unset or empty: flash_prefill_gluon.engine_options' choice by block size), for
    A/B runs. Read at each call; a bad value is a ValueError there."""
    return os.environ.get("FLASHPAGE_PREFILL_PRODUCER", "").strip()


def fast_launch() -> bool:
    """JIT kernels launched straight through their compiled form after their first launch
    (kernels/fast_launch.py: the Gluon prefill, RMSNorm, rotary, SiLU-mul; ~40-60 us less host
    time a Gluon prefill call, an 8B 128-token prompt's first token 32.6 -> 26.7 ms on an H200,
    runs 119-123). FLASHPAGE_FAST_LAUNCH=0 sends every launch through Triton's JIT. Read at each
    call."""
    return os.environ.get("FLASHPAGE_FAST_LAUNCH", "1") != "0"


def prefill_graphs() -> bool:
    """FLASHPAGE_PREFILL_GRAPHS: capture CUDA graphs for short prompt-only steps (up to 4
    requests, up to 1024 tokens; engine/cuda_graph.PrefillGraphs) beside the decode graphs.
    On by default ("0" turns it off). Read when the engine starts."""
    return os.environ.get("FLASHPAGE_PREFILL_GRAPHS", "1").strip().lower() not in ("0", "off", "")


def piecewise_graphs() -> str:
    """FLASHPAGE_PIECEWISE_GRAPHS: capture the forward in pieces around its attention layers
    for the steps no whole-step graph takes (decodes beside prompt chunks, more than 4
    prompts) of up to 1024 tokens (engine/cuda_graph.PiecewiseGraphs; attention runs eagerly
    between the pieces). "on" (the default) where the model supports them, "off" (or "0")
    nowhere, "all" also for models whose pieces are built but not yet validated on a GPU
    (``supports_piecewise_graphs = False``; no model today). Read when the engine starts."""
    value = os.environ.get("FLASHPAGE_PIECEWISE_GRAPHS", "on").strip().lower()
    if value in ("0", "off", "false", ""):
        return "off"
    if value in ("1", "on", "true"):
        return "on"
    if value == "all":
        return "all"
    raise ValueError(f"FLASHPAGE_PIECEWISE_GRAPHS must be on, off or all, got {value!r}")


def mla_gluon() -> str:
    """FLASHPAGE_MLA_GLUON: which Gluon kernel takes the triton backend's MLA decode on Hopper
    where it covers the call (mla_gluon_unsupported: bf16/fp16 latents in q's dtype, kv_lora_rank
    512 + rope 64, heads a multiple of 16, a power-of-two block size >= 16). Unset or "": "auto",
    the warpgroup-MMA kernel (kernels/mla_decode_wgmma.py) for 16 heads, where it is the fastest
    (H200 runs 105-109: 87-89% of copy at 8-16 sequences of 16-32k keys against Triton's 83-85%,
    ahead at every shape of issue 4's sweep; V2-Lite's decode steps 0.6-1.1% shorter), the
    Triton kernel for more heads (compute-bound there: Triton's is faster at 128); "0": the
    Triton kernel always; "1" (or "gluon"): the persistent mma.sync kernel
    (kernels/mla_decode_gluon.py); "wgmma": the wgmma one at any head count. Read when a step
    plans its MLA decode (its first layer; a decode graph keeps the kernel it captured); another value is a ValueError naming it."""
    value = os.environ.get("FLASHPAGE_MLA_GLUON", "").strip()
    if value == "":
        return "auto"
    if value == "0":
        return ""
    if value in ("1", "gluon"):
        return "gluon"
    if value == "wgmma":
        return "wgmma"
    raise ValueError(f"FLASHPAGE_MLA_GLUON must be unset, 0, 1 (gluon) or wgmma, got {value!r}")


def fused_merge() -> bool:
    """FLASHPAGE_FUSED_MERGE=1: split paged decode merges its splits in the last program of
    each (sequence, KV head) instead of a second kernel. Off by default: in the H200 run
    of 2026-11-30 (attention_decode.py --compare) it was slower than the merge kernel,
    3,158 vs 3,308 GB/s at 1 x 32768 and 4,206 vs 4,252 at 8 x 32768."""
    return os.environ.get("FLASHPAGE_FUSED_MERGE", "0") == "1"


def fused_router() -> bool:
    """MoE routing after the router GEMM in one kernel (kernels/moe_router.py) instead of
    ~5 small torch ops per layer, beside the fused MoE kernel; FLASHPAGE_FUSED_ROUTER=0
    turns it off. On by default since the H200 run of 2026-11-30 (run 48, decode_ab):
    DeepSeek-V2-Lite one sequence 261.4 tok/s against 252.9 with the torch routing, same
    process. Read at each call: a decode graph keeps the value it was captured with."""
    return os.environ.get("FLASHPAGE_FUSED_ROUTER", "1") != "0"


def fused_moe() -> bool:
    """FLASHPAGE_FUSED_MOE (default 1; 0 turns it off): decode-batch MoE through our fused
    Triton kernel (kernels/fused_moe.py: only the routed experts' weights are read) instead
    of every expert on every token. On the H200 it took DeepSeek-V2-Lite from 2,305 to
    2,713 output tok/s (BENCHMARKS.md, session 3)."""
    return os.environ.get("FLASHPAGE_FUSED_MOE", "1") != "0"


def mxfp4() -> str:
    """FLASHPAGE_MXFP4: how the engine holds an MXFP4 checkpoint's experts (GPT-OSS's
    released ones; models/gpt_oss.py). ``auto`` (the default): kept in MXFP4 (4.25 bits a
    weight: gpt-oss-20b's experts ~9.5 GiB instead of ~36 in bf16, gpt-oss-120b's ~57 GiB
    instead of ~214, which only then fits one H200) where the fused MoE kernel runs them
    (CUDA, the triton backend, FLASHPAGE_FUSED_MOE not 0), dequantized elsewhere; in bf16
    the kernel (its "scaled" form) is level with the bf16 fused kernel at gpt-oss-20b's
    shape (run 191). ``dequant``: dequantized to the model dtype at load. ``kernel``:
    always kept, on any device (the CPU runs the fused kernel through Triton's interpreter
    when asked, and its torch paths dequantize per call: tests). Kept experts run the fused
    kernel up to 512 tokens a step and dequantize one expert at a time past it (layers/moe.py
    FusedExperts). Read when the engine loads the model."""
    value = os.environ.get("FLASHPAGE_MXFP4", "auto").strip().lower() or "auto"
    if value not in ("auto", "dequant", "kernel"):
        raise ValueError(f"FLASHPAGE_MXFP4 must be auto, dequant or kernel, got {value!r}")
    return value


def fp8_moe() -> str:
    """FLASHPAGE_FP8_MOE: how the engine holds a block-scaled fp8 checkpoint's routed experts
    (quant_method fp8 with weight_block_size [128, 128]: DeepSeek-V3, Qwen3-30B-A3B-FP8,
    Qwen3-235B-A22B-FP8; models/fp8_checkpoint.py). ``auto`` (the default): kept in e4m3 with
    their fp32 block scales (one byte a weight, half of bf16) where the fused fp8 MoE kernel
    runs them (kernels/fused_moe_fp8.py: CUDA with e4m3 support, sm_89+, the triton backend,
    FLASHPAGE_FUSED_MOE not 0), dequantized to the model dtype elsewhere. ``dequant``:
    always dequantized at load (the path before the kernel). ``kernel``: always kept, on any
    device (the CPU's torch paths then dequantize the experts they need at each call, the
    very weights ``dequant`` holds: tests). Experts whose hidden or intermediate size is not
    a whole number of 128-blocks, or whose checkpoint names the loader does not know as
    routed experts (Mixtral's w1 / w2 / w3), are dequantized whatever this says. Read when
    the engine loads the model."""
    value = os.environ.get("FLASHPAGE_FP8_MOE", "auto").strip().lower() or "auto"
    if value not in ("auto", "dequant", "kernel"):
        raise ValueError(f"FLASHPAGE_FP8_MOE must be auto, dequant or kernel, got {value!r}")
    return value


def int4_moe() -> str:
    """FLASHPAGE_INT4_MOE: how the engine holds an AWQ / GPTQ (int4) checkpoint's routed
    experts (Mixtral, Qwen2-MoE, Qwen3-MoE: models/int4_checkpoint.py). ``auto`` (the
    default): kept packed (half a byte a weight plus a scale and a zero point a group) where
    the fused int4 MoE kernel runs them (kernels/fused_moe_int4.py: CUDA, the triton
    backend, FLASHPAGE_FUSED_MOE not 0), dequantized to the model dtype elsewhere.
    ``dequant``: always dequantized at load. ``kernel``: always kept, on any device (the
    CPU's torch paths then dequantize the experts they need at each call, the very weights
    ``dequant`` holds: tests). A layer whose experts the file does not hold all in int4, or
    whose groups are not multiples of 16 dividing the sizes, is dequantized whatever this
    says. Read when the engine loads the model."""
    value = os.environ.get("FLASHPAGE_INT4_MOE", "auto").strip().lower() or "auto"
    if value not in ("auto", "dequant", "kernel"):
        raise ValueError(f"FLASHPAGE_INT4_MOE must be auto, dequant or kernel, got {value!r}")
    return value


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



def lora_kernels() -> bool | None:
    """FLASHPAGE_LORA_KERNELS: each LoRA linear adds its adapters' delta through the two
    gathered kernels (kernels/lora.py: every token reads only its own slot's A and B) at
    steps of up to kernels/lora.KERNEL_MAX_TOKENS tokens, instead of two dense GEMMs over
    every slot's columns and a mask. "auto" (the default): on CUDA; "1": on the CPU too,
    through Triton's interpreter (tests; slow); "0": never. Read when the engine builds
    its LoRA layers."""
    mode = os.environ.get("FLASHPAGE_LORA_KERNELS", "auto").strip().lower()
    return {"1": True, "0": False}.get(mode)


def server_dev_mode() -> bool:
    """FLASHPAGE_SERVER_DEV_MODE=1 (or vLLM's VLLM_SERVER_DEV_MODE): the server takes vLLM's
    development endpoints, POST /sleep, POST /wake_up and GET /is_sleeping (sleep mode, for
    RLHF trainers); without it those paths do not exist, as in vLLM."""
    value = (os.environ.get("FLASHPAGE_SERVER_DEV_MODE") or os.environ.get("VLLM_SERVER_DEV_MODE")
             or "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def allow_runtime_lora_updating() -> bool:
    """FLASHPAGE_ALLOW_RUNTIME_LORA_UPDATING=1 (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    the server takes POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs
    --enable-lora); without it those paths do not exist, as in vLLM."""
    value = (os.environ.get("FLASHPAGE_ALLOW_RUNTIME_LORA_UPDATING")
             or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") or "")
    return value.strip().lower() in ("1", "true", "yes", "on")


_INT4_KERNELS = {"": "gemv", "gemv": "gemv", "gemm": "gemm", "1": "gemm", "true": "gemm",
                 "on": "gemm", "dequant": "dequant", "0": "dequant", "false": "dequant",
                 "off": "dequant"}


def int4_fused_norm() -> bool:
    """FLASHPAGE_INT4_FUSED_NORM=1: at one-row steps an int4 linear computes the RMSNorm
    before it in its GEMV's prologue (kernels/int4_gemv ``norm=``, layers/int4.fuses_norm).
    Off by default: the 8B's batch-1 int4 decode ran at 264 tok/s with it and the int4
    GEMV's PDL launches on, against 312 without either (H200, runs 178-179; which of the
    two cost it is not yet measured). Read when a decode graph is captured."""
    return os.environ.get("FLASHPAGE_INT4_FUSED_NORM", "0").strip().lower() in ("1", "on", "true")


def int4_kernel() -> str:
    """FLASHPAGE_INT4_KERNEL: how CUDA runs int4 (AWQ / GPTQ) linears (layers/int4.py).
    Unset or ``gemv``: kernels/int4_gemv.py's row-wise GEMV up to layers/int4.GEMV_ROWS
    (64) rows, kernels/int4_gemm.py's swapped GEMM (w4a16_gemm) up to GEMM_MAX_ROWS, the
    weight dequantized by a kernel and multiplied by cuBLAS above. ``gemm``
    (or 1, as before the GEMV): kernels/int4_gemm.py's tl.dot kernel up to GEMM_ROWS (128)
    rows (on an H200, run 165, it read 0.25-0.5 TB/s: slower than dequantizing).
    ``dequant`` (or 0): dequantize + cuBLAS at every row count."""
    value = os.environ.get("FLASHPAGE_INT4_KERNEL", "").strip().lower()
    if value not in _INT4_KERNELS:
        raise ValueError(f"FLASHPAGE_INT4_KERNEL must be gemv, gemm or dequant (or 1 / 0), "
                         f"got {value!r}")
    return _INT4_KERNELS[value]


def kv_offload_async_loads() -> bool:
    """FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS: KV offloading's loads from the host on a stream of
    their own, only the requests reading them waiting (the default on CUDA); "0" runs them
    on the compute stream before the step's forward, which then waits for them (the form
    before session 31, for A/Bs). Read when the engine starts."""
    return os.environ.get("FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS", "1").strip() != "0"


def sleep_fixed_addresses() -> bool:
    """FLASHPAGE_SLEEP_FIXED_ADDRESSES: sleep mode on CUDA allocates the weights and the KV
    cache in memory whose pages it gives back while keeping the addresses (engine/cumem.py),
    so the CUDA graphs live through a sleep (the default); "0" frees the storages instead and
    captures the graphs again on wake_up (the form before session 31). Read when the engine
    starts."""
    return os.environ.get("FLASHPAGE_SLEEP_FIXED_ADDRESSES", "1").strip() != "0"


def media_fetch_timeout() -> float:
    """FLASHPAGE_MEDIA_FETCH_TIMEOUT: seconds an image URL's fetch may take (default 5, vLLM's
    VLLM_IMAGE_FETCH_TIMEOUT; engine/media.py)."""
    value = os.environ.get("FLASHPAGE_MEDIA_FETCH_TIMEOUT", "").strip()
    return float(value) if value else 5.0


def media_max_bytes() -> int:
    """FLASHPAGE_MEDIA_MAX_BYTES: the most encoded bytes an image URL may hold (default 32 MiB;
    engine/media.py)."""
    value = os.environ.get("FLASHPAGE_MEDIA_MAX_BYTES", "").strip()
    return int(value) if value else 32 << 20


def video_fetch_timeout() -> float:
    """FLASHPAGE_VIDEO_FETCH_TIMEOUT: seconds a video URL's fetch may take (default 30, vLLM's
    VLLM_VIDEO_FETCH_TIMEOUT; engine/media.py)."""
    value = os.environ.get("FLASHPAGE_VIDEO_FETCH_TIMEOUT", "").strip()
    return float(value) if value else 30.0


def audio_fetch_timeout() -> float:
    """FLASHPAGE_AUDIO_FETCH_TIMEOUT: seconds an audio URL's fetch may take (default 10, vLLM's
    VLLM_AUDIO_FETCH_TIMEOUT; engine/media.py)."""
    value = os.environ.get("FLASHPAGE_AUDIO_FETCH_TIMEOUT", "").strip()
    return float(value) if value else 10.0


def video_max_bytes() -> int:
    """FLASHPAGE_VIDEO_MAX_BYTES: the most encoded bytes a video (URL, file or bytes) may hold
    (default 256 MiB; engine/media.py, engine/video_io.py)."""
    value = os.environ.get("FLASHPAGE_VIDEO_MAX_BYTES", "").strip()
    return int(value) if value else 256 << 20


def files_max_bytes() -> int:
    """FLASHPAGE_FILES_MAX_BYTES: the most bytes the server's Files API keeps at once, uploads
    and batch results together (default 512 MiB; server/files.py): an upload past it is a
    413 naming this variable. Read at each upload."""
    value = os.environ.get("FLASHPAGE_FILES_MAX_BYTES", "").strip()
    if not value:
        return 512 << 20
    if not value.isdigit():
        raise ValueError(f"FLASHPAGE_FILES_MAX_BYTES must be a number of bytes, got {value!r}")
    return int(value)
