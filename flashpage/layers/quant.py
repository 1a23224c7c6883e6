"""Online weight quantization: FP8 (``quantization="fp8"``, vLLM's ``--quantization fp8``) and int4.

A 16-bit (or fp32) checkpoint is loaded as usual; then every attention and dense-MLP
linear (``ColumnParallelLinear`` / ``RowParallelLinear`` whose ``quantizable`` is left on)
keeps its weight as float8_e4m3fn with one fp32 scale per output row:

    scale[n] = amax_k |W[n, k]| / 448          (448: e4m3's largest finite value)
    Wq[n, k] = e4m3(W[n, k] / scale[n])        (round to nearest even)
    W[n, k] ~ scale[n] * Wq[n, k]              (relative error <= 2^-4 for normal values)

Left in 16 bits: embeddings, the LM head (tied or not: logits are the most sensitive
product and one row of it is read per token anyway), norms, the MoE router and MLA's
``kv_b_proj`` (its weight is absorbed into queries and outputs, read as a matrix rather
than called as a linear).

Routed MoE experts (``layers/moe.FusedExperts``) are quantized where their fused kernel
keeps them (``quantize_model(experts=)``): "fp8" to 128 x 128 block e4m3 with fp32 block
scales (kernels/fused_moe_fp8.py), the int4 methods to int4 groups (kernels/
fused_moe_int4.py), the layouts a block-fp8 / AWQ / GPTQ checkpoint's experts load into;
elsewhere they stay 16-bit.

How a quantized linear of M rows runs (``_ParallelLinear.forward``):

    CUDA, one row (row_gemv)        kernels/gemv.gemv_row with the scale: W8A16
    CUDA, rows tuned to ours        kernels/gemv.skinny_linear with the scale: W8A16
    CUDA, otherwise (bf16 / fp16)   W8A8: x quantized per token (dynamic scales, one
                                    kernel: kernels/fp8_quant.py; graph-capturable), then
                                    torch._scaled_mm with row-wise scales (sm_89+, N and
                                    K multiples of 16)
    elsewhere (CPU, fp32, old GPUs) the weight dequantized to x's dtype, then F.linear

``quantization="int4"`` (or vLLM's "rtn" with RTN_NUM_BITS=4) rounds the same linears to
4-bit integers in groups along K instead (``_ParallelLinear.quantize_int4``: the int4 layout
AWQ / GPTQ checkpoints load into, run by layers/int4.py).

A checkpoint whose weights are already fp8 (config.json's quantization_config) is loaded
into this same form, its e4m3 values and per-tensor or per-channel scales as stored, one
scale per output row (models/fp8_checkpoint.py); ``quantize_model`` then leaves those
linears as they are, and the ones the checkpoint left 16-bit (``quantizable = False``).

A block-scaled checkpoint (DeepSeek-V3, Qwen3-FP8: ``weight_block_size`` [bn, bk]) keeps
its e4m3 values with their tiles' scales, ``weight_scale`` fp32 [ceil(N/bn), ceil(K/bk)]
and ``weight_block`` (bn, bk) on the linear (``hold_fp8(block)``), run by
``fp8_block_linear`` (kernels/fp8_block_gemm.py), after the one-row GEMV:

    CUDA, one row (row_gemv)           kernels/gemv.gemv_row with the block scales: W8A16,
                                       norm / SiLU·mul prologues and PDL as per-row fp8
    CUDA, M <= BLOCK_W8A16_ROWS (16)   w8a16_block_matmul: the weight tile widened to x's
                                       dtype in registers, its block scale on the fp32
                                       partial sum; K split (the decode sizes: bandwidth)
    CUDA, 16-bit x, sm_89+             W8A8: x quantized per token per bk-group (one
                                       kernel), w8a8_block_matmul on the e4m3 tensor cores,
                                       both scales on each K tile's partial sum
    CUDA otherwise (fp32, old GPUs)    w8a16_block_matmul
    elsewhere (CPU)                    the weight dequantized (scale * value, fp32) to x's
                                       dtype, then F.linear: the dequantized checkpoint's
                                       very weights (correct, not fast)
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from flashpage.config import check_quantization

logger = logging.getLogger("flashpage")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Scales are floored so an all-zero row (or token) quantizes to zeros, not NaN.
MIN_SCALE = 1e-12


# ----------------------------------------------------------------------------- the math
def quantize_fp8_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (float8_e4m3fn [N, K], fp32 scales [N]), symmetric,
    one scale per row: scale = amax(|row|) / 448, each value divided by its row's scale in
    fp32 and rounded to nearest even (no value can exceed 448, so nothing saturates)."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got {tuple(w.shape)}")
    if not w.is_floating_point() or w.dtype.itemsize == 1:
        raise ValueError(f"cannot quantize a {w.dtype} weight (an fp8 checkpoint's weights are "
                         "read with their scales: models/fp8_checkpoint.py)")
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_rowwise(q: torch.Tensor, scale: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference inverse: scale[n] * q[n, k] in fp32, then ``dtype``."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, 1]): each row by its own amax
    (dynamic activation scales). Torch ops, no host sync; on the GPU the engine runs
    kernels/fp8_quant.quantize_per_token instead (one launch, the same bits)."""
    x32 = x.float()
    # amax / 448 divided as a tensor by a tensor: CUDA divides by a Python scalar through its
    # reciprocal (an ulp off at times; run 147), the kernel's div_rn is IEEE's
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A16 reference: x [..., K] @ dequantized(q)^T in fp32 (+ bias), in x's dtype."""
    y = x.float() @ dequantize_fp8_rowwise(q, scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def w8a8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What ``scaled_mm_linear`` computes, emulated exactly in fp32 on any device: x
    quantized per token, the fp8 x fp8 products summed in fp32, both scales applied to
    the sum, then the bias; x [M, K] -> [M, N] in ``out_dtype`` (default x's)."""
    xq, xs = quantize_fp8_per_token(x)
    y = (xq.float() @ q.float().t()) * xs * scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


# ----------------------------------------------------------------------------- GPU paths
def scaled_mm_supported(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``scaled_mm_linear`` takes this call: CUDA with e4m3 tensor cores (sm_89+),
    16-bit activations, N and K multiples of 16 (``_scaled_mm``'s layout rule)."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    n, k = q.shape
    if n % 16 or k % 16:
        return False
    from flashpage.kernels.device import cuda_capability

    return cuda_capability(x.device) >= (8, 9)


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 on the GPU: x [M, K] (bf16/fp16) quantized per token (one Triton kernel,
    kernels/fp8_quant.py), then one ``torch._scaled_mm(x_fp8 [M, K] row-major, q^T [K, N]
    column-major, scale_a [M, 1], scale_b [1, N], bias, out_dtype=bf16)`` (row-wise
    scaling). fp16 activations get a bf16 product cast back (row-wise scaling is bf16-out
    on every torch that has it)."""
    from flashpage.kernels.fp8_quant import quantize_per_token

    xq, xs = quantize_per_token(x)
    b = bias.to(torch.bfloat16) if bias is not None and bias.dtype != torch.bfloat16 else bias
    y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.view(1, -1), bias=b,
                         out_dtype=torch.bfloat16)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


# Rows up to which a block-scaled linear runs weight-only on CUDA (W8A8 above): not timed
# on a GPU yet (benchmarks/fp8_block_gemm.py prints both paths at 1-2048 rows).
BLOCK_W8A16_ROWS = 16


def block_fp8_path(x: torch.Tensor, block: tuple[int, int]) -> str:
    """The path of a block-scaled linear over x [M, K] in ``block`` (bn, bk) tiles: "w8a16",
    "w8a8" or "dequant" (see the module's docstring). W8A8 needs K tiles of 32 at least
    (an e4m3 tl.dot's smallest K on sm_90: blocks 16 wide failed to compile, run 179). It
    reads only shapes, dtypes and the device's capability: the same at every graph replay."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return "dequant"
    from flashpage.kernels.device import cuda_capability
    from flashpage.kernels.fp8_block_ref import tile_k

    if (x.shape[0] > BLOCK_W8A16_ROWS and x.dtype != torch.float32 and tile_k(block[1]) >= 32
            and cuda_capability(x.device) >= (8, 9)):
        return "w8a8"
    return "w8a16"


def fp8_block_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """A block-scaled fp8 linear: x [..., K] -> [..., N], q e4m3 [N, K], scale fp32
    [ceil(N/bn), ceil(K/bk)], along ``block_fp8_path``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    path = block_fp8_path(x2, block)
    if path == "w8a8":
        from flashpage.kernels.fp8_block_gemm import w8a8_block_linear

        y = w8a8_block_linear(x2, q, scale, block, bias)
    elif path == "w8a16":
        from flashpage.kernels.fp8_block_gemm import w8a16_block_matmul

        y = w8a16_block_matmul(x2, q, scale, block, bias)
    else:
        from flashpage.kernels.fp8_block_ref import dequantize_fp8_block

        y = F.linear(x2, dequantize_fp8_block(q, scale, block, x2.dtype), bias)
    return y.view(*lead, q.shape[0])


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """A quantized linear's general path: x [..., K] -> [..., N]. W8A8 ``_scaled_mm``
    where it runs, else the weight dequantized to x's dtype (CPU, fp32 models, old GPUs:
    correct, not fast: it rebuilds the 16-bit weight on every call)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] and scaled_mm_supported(x2, q):
        y = scaled_mm_linear(x2.contiguous(), q, scale, bias)
    else:
        w = (q.to(torch.float32) * scale[:, None]).to(x.dtype)
        y = F.linear(x2, w, bias)
    return y.view(*lead, q.shape[0])


# ----------------------------------------------------------------------------- the model
def moe_kernel_keeps(kind: str, device: torch.device | None, fused_moe: bool) -> bool:
    """Whether routed experts in ``kind`` ("fp8" or "int4") are kept for their fused kernel
    (a checkpoint's as loaded, a 16-bit model's quantized): FLASHPAGE_FP8_MOE /
    FLASHPAGE_INT4_MOE "kernel", or "auto" where the fused MoE kernel runs (``fused_moe``:
    CUDA, the triton backend, FLASHPAGE_FUSED_MOE not 0) and, for fp8, e4m3 dots do
    (sm_89+)."""
    from flashpage import envs

    mode = envs.fp8_moe() if kind == "fp8" else envs.int4_moe()
    if mode != "auto":
        return mode == "kernel"
    if not fused_moe or device is None or device.type != "cuda":
        return False
    if kind == "fp8":
        from flashpage.kernels.device import cuda_capability

        return cuda_capability(device) >= (8, 9)
    return True


def experts_kept_by_default(model: nn.Module, method: str) -> bool:
    """Whether ``quantize_model`` quantizes routed experts when its caller does not say:
    ``moe_kernel_keeps`` with the model's CUDA device and the fused MoE kernel taken to run
    there (FLASHPAGE_FUSED_MOE not 0). The engine passes its own choice instead (it also
    knows the attention backend)."""
    from flashpage import envs

    dev = next((p.device for p in model.parameters() if p.is_cuda), None)
    return moe_kernel_keeps("fp8" if method == "fp8" else "int4", dev,
                            dev is not None and envs.fused_moe())


@torch.no_grad()
def quantize_model(model: nn.Module, method: str | None, experts: bool | None = None) -> int:
    """Quantize every quantizable linear of ``model`` in place (``method`` "fp8", "int4" /
    "rtn"; None: nothing), and with ``experts`` its routed experts (layers/moe.FusedExperts)
    where their fused kernel takes them: "fp8" to 128 x 128 block e4m3 with fp32 block
    scales (FusedExperts.quantize_fp8: hidden and expert intermediate sizes whole blocks),
    the int4 methods to int4 groups (FusedExperts.quantize_int4, the groups the linears
    take: ``int4_group_for``); the layout an fp8 / int4 checkpoint's experts load into
    (hold_fp8 / hold_int4), run by kernels/fused_moe_fp8.py / fused_moe_int4.py. Experts
    that cannot (GPT-OSS's biases and activation, sizes not whole blocks, groups the kernel
    does not take) stay 16-bit, with a warning naming why; ``experts`` False (the engine:
    FLASHPAGE_FP8_MOE / FLASHPAGE_INT4_MOE dequant, or auto where the fused kernel does
    not run) leaves them all 16-bit; None: ``experts_kept_by_default``.
    Returns how many it quantized (linears, plus one a layer's experts; those quantized
    before are left). Tied weights (an LM head sharing the embedding) and linears marked
    ``quantizable = False`` stay as they are. Layer by layer, each 16-bit weight dropped
    once quantized; on CUDA the freed memory goes back to the device, so the KV cache
    sized next sees it."""
    from flashpage.config import ONLINE_INT4_METHODS, int4_group_for, online_int4_group_size
    from flashpage.layers.linear import VocabEmbedding, _ParallelLinear
    from flashpage.layers.moe import FusedExperts

    check_quantization(method)
    if method is None:
        return 0
    int4_group = online_int4_group_size(method) if method in ONLINE_INT4_METHODS else None
    if experts is None:
        experts = experts_kept_by_default(model, method)
    embedded = {p.data_ptr() for m in model.modules()
                if isinstance(m, nn.Embedding | VocabEmbedding) for p in m.parameters()}
    count, candidates, before, after = 0, 0, 0, 0
    moe_layers, moe_left, moe_before, moe_after = 0, [], 0, 0
    for name, m in model.named_modules():
        if isinstance(m, FusedExperts):
            candidates += 1
            if m.mxfp4 or m.fp8 or m.int4:  # a checkpoint's, kept as loaded: left
                continue
            h, inter = m.gate_up_proj.shape[2], m.intermediate
            groups = (int4_group_for(h, int4_group), int4_group_for(inter, int4_group))
            why = (m.fp8_unsupported() if method == "fp8" else m.int4_unsupported(*groups))
            if not experts or why is not None:
                moe_left.append(f"{name} ({why})" if why is not None else name)
                continue
            size = m.expert_bytes()
            if method == "fp8":
                m.quantize_fp8()
            else:
                m.quantize_int4(*groups)
            moe_before, moe_after = moe_before + size, moe_after + m.expert_bytes()
            moe_layers += 1
            if m.gate_up_proj.is_cuda:  # this layer's 16-bit experts back before the next's
                torch.cuda.empty_cache()
            count += 1
            continue
        if not isinstance(m, _ParallelLinear) or not m.quantizable:
            continue
        if m.weight.data_ptr() in embedded:
            continue
        candidates += 1
        if m.is_quantized or m.is_int4:  # quantized before (an fp8 / int4 checkpoint): left
            continue
        k = m.weight.shape[1]
        if method in ONLINE_INT4_METHODS and k % 8:
            continue  # no int4 layout for it (K a multiple of 8): left 16-bit
        before += m.weight.numel() * m.weight.element_size()
        if method in ONLINE_INT4_METHODS:
            m.quantize_int4(int4_group_for(k, int4_group))
            after += sum(t.numel() * t.element_size() for t in (m.weight, m.w4_scales, m.w4_zeros)
                         if t is not None)
        else:
            m.quantize_fp8()
            after += m.weight.numel() + 4 * m.weight.shape[0]  # e4m3 values, fp32 scales
        count += 1
    if candidates == 0:
        raise ValueError(f"quantization={method!r}: this model has no linear layer to quantize")
    if moe_left:
        env = "FLASHPAGE_FP8_MOE" if method == "fp8" else "FLASHPAGE_INT4_MOE"
        reason = (f"the fused {method if method == 'fp8' else 'int4'} MoE kernel does not run "
                  f"them here ({env}: auto keeps them on CUDA with the triton backend, "
                  "kernel everywhere)" if not experts else "their fused kernel cannot run them")
        log = logger.warning if experts else logger.info
        log("%s weights: %d MoE layers' routed experts left 16-bit, %s: %s%s", method,
            len(moe_left), reason, moe_left[0],
            f" and {len(moe_left) - 1} more" if len(moe_left) > 1 else "")
    if count == 0:
        return 0
    experts_note = (f", {moe_layers} MoE layers' routed experts {moe_before / 2**20:.1f} MiB "
                    f"-> {moe_after / 2**20:.1f} MiB" if moe_layers else "")
    logger.info("%s weights: %d linears, %.1f MiB -> %.1f MiB%s", method, count - moe_layers,
                before / 2**20, after / 2**20, experts_note)
    dev = next((p.device for p in model.parameters() if p.is_cuda), None)
    if dev is not None:
        torch.cuda.empty_cache()  # the 16-bit weights' memory back for the KV cache
    if dev is not None and method == "fp8":
        from flashpage.kernels.device import cuda_capability

        if cuda_capability(dev) < (8, 9):
            logger.warning("this GPU has no e4m3 tensor cores (sm_89+): steps of more rows than "
                           "the decode GEMMs take dequantize each weight per call (slow)")
    return count


def quantized_linears(model: nn.Module) -> list[str]:
    """Names of the linears of ``model`` that hold fp8 weights (tests, reports)."""
    return [name for name, m in model.named_modules()
            if getattr(m, "weight_scale", None) is not None and m.weight.dtype == FP8_DTYPE]


def dequantized_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_parameters`` with every fp8 or int4 weight dequantized to the model's 16/32-bit
    dtype (what a transformers copy of the model is given: benchmarks' baselines); block-fp8
    MoE experts (FusedExperts.hold_fp8) too, their scale parameters left out, and int4 ones
    (FusedExperts.hold_int4)."""
    buffers = dict(model.named_buffers())
    experts4 = {f"{name}.{proj}": (getattr(m, f"{proj}_w4_scales"), getattr(m, f"{proj}_w4_zeros"))
                for name, m in model.named_modules() if getattr(m, "int4", False) is True
                for proj in ("gate_up_proj", "down_proj")}
    experts = {f"{name}.{proj}": getattr(m, f"{proj}_scale")
               for name, m in model.named_modules() if getattr(m, "fp8", False) is True
               for proj in ("gate_up_proj", "down_proj")}
    scales = {name.removesuffix("_scale"): b for name, b in buffers.items()
              if name.endswith("weight_scale")}
    blocks = {f"{name}.weight": m.weight_block for name, m in model.named_modules()
              if getattr(m, "weight_block", None) is not None}
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()
                  and p.dtype != FP8_DTYPE), torch.float32)
    for name, p in model.named_parameters():
        scale = scales.get(name)
        int4 = buffers.get(name.removesuffix("weight") + "w4_scales")
        if name in experts4:
            from flashpage.kernels.fused_moe_int4 import dequantize_experts_int4

            yield name, dequantize_experts_int4(p.data, *experts4[name], dtype)
        elif name.removesuffix("_scale") in experts:
            if name in experts:
                from flashpage.kernels.fp8_block_ref import dequantize_experts_fp8

                yield name, dequantize_experts_fp8(p.data, experts[name], dtype)
        elif int4 is not None:
            from flashpage.kernels.int4_gemm import dequantize_int4_ref

            zeros = buffers[name.removesuffix("weight") + "w4_zeros"]
            yield name, dequantize_int4_ref(p.data, int4, zeros, dtype)
        elif name in blocks:
            from flashpage.kernels.fp8_block_ref import dequantize_fp8_block

            assert scale is not None
            yield name, dequantize_fp8_block(p.data, scale, blocks[name], dtype)
        else:
            yield name, p.data if scale is None else dequantize_fp8_rowwise(p.data, scale, dtype)

