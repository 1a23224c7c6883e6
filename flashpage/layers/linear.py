"""Linear layers shaped for tensor parallelism (world size 1 today).

A column-parallel layer splits its output features across ranks, a row-parallel one
its input features (followed by an all-reduce). With ``tp_size == 1`` both are plain
linears; the split lives in ``weight_loader`` so checkpoints load unchanged when a
world size > 1 arrives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from flashpage import envs
from flashpage.layers.int4 import fuses_norm as int4_fuses_norm
from flashpage.layers.int4 import fuses_silu_mul, int4_linear
from flashpage.layers.norm import RMSNorm
from flashpage.layers.quant import FP8_DTYPE, fp8_block_linear, fp8_linear, quantize_fp8_rowwise

if TYPE_CHECKING:
    from flashpage.lora.layers import LoRALinear

logger = logging.getLogger("flashpage")


@dataclass
class PendingNorm:
    """``norm(x, residual)`` not computed yet: a linear that runs ``gemv_row`` computes the
    RMSNorm in its GEMV's prologue and writes x + residual to ``residual_out``; any other
    path computes it first (``compute``). Without ``residual`` the input is norm(x) and
    nothing is written. Decoder layers pass one to the first linear of attention and of
    the MLP at one-row decode steps (models/common.PreNormDecoderLayer)."""

    x: torch.Tensor
    residual: torch.Tensor | None
    norm: nn.Module  # layers/norm.RMSNorm: weight, eps
    residual_out: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def compute(self) -> torch.Tensor:
        if self.residual is None:
            return self.norm(self.x)
        h, r = self.norm(self.x, self.residual)
        assert self.residual_out is not None
        self.residual_out.copy_(r)
        return h


class _ParallelLinear(nn.Module):
    """``skinny``: {rows: GemvConfig} where our decode-batch GEMM (kernels/gemv.py) beat
    cuBLAS at start-up (``tune_skinny_gemms``); empty = always cuBLAS. ``silu_input``
    marks an MLP's down projection, whose ``silu_mul_forward`` takes the gate/up output.
    ``row_gemv``: one-row inputs may go through ``kernels/gemv.gemv_row`` (set by the
    engine beside our fused kernels on a GPU; used while FLASHPAGE_GEMV is on).
    ``weight_scale``: None, or fp32 [N] once ``quantize_fp8`` has made ``weight``
    float8_e4m3fn (layers/quant.py) or ``hold_fp8`` has made it ready for an fp8
    checkpoint's; ``quantizable = False`` keeps a layer 16-bit. ``weight_block``: None, or
    (bn, bk) when a block-scaled fp8 checkpoint's weight is held as stored (``hold_fp8(block)``):
    ``weight_scale`` is then fp32 [ceil(N/bn), ceil(K/bk)], one per tile, and the layer runs
    ``gemv_row`` (one row, block scales) or ``fp8_block_linear`` (never the tuned skinny
    GEMM, whose scales are per row). ``w4_scales`` / ``w4_zeros``:
    None, or the groups' scales and zero points once ``hold_int4`` has made ``weight`` an
    AWQ / GPTQ checkpoint's packed int4 (layers/int4.py).
    ``lora``: the adapter slots the engine attached with ``enable_lora`` (flashpage/lora/):
    each token's adapter delta is added to the base output. The SiLU·mul stays fused into
    the down projection's GEMV where the delta runs through kernels/lora.py (its shrink
    takes silu(g)·u on the fly); the RMSNorm never moves into the GEMV with LoRA (below)."""

    split_dim: int = 0
    skinny: dict[int, Any]
    silu_input: bool = False
    row_gemv: bool = False
    quantizable: bool = True
    weight_scale: torch.Tensor | None
    weight_block: tuple[int, int] | None = None
    w4_scales: torch.Tensor | None
    w4_zeros: torch.Tensor | None
    lora: LoRALinear | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.skinny = {}
        shape = [out_features, in_features]
        if shape[self.split_dim] % tp_size:
            raise ValueError(f"dimension {shape[self.split_dim]} is not divisible by tp_size {tp_size}")
        shape[self.split_dim] //= tp_size
        self.weight = nn.Parameter(torch.empty(shape))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            n = shape[0]
            self.bias = nn.Parameter(torch.empty(n))
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.register_buffer("weight_scale", None)
        self.register_buffer("w4_scales", None)
        self.register_buffer("w4_zeros", None)

    @property
    def is_quantized(self) -> bool:
        """Whether the weight is fp8 (scales per row; int4 is ``is_int4``)."""
        return self.weight_scale is not None

    @property
    def is_int4(self) -> bool:
        return self.w4_scales is not None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * (8 if self.is_int4 else 1)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def quantize_fp8(self) -> None:
        """Replace the loaded weight by its row-wise e4m3 form and scales (after loading:
        ``weight_loader`` copies into a 16-bit weight)."""
        q, scale = quantize_fp8_rowwise(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale
        self.skinny = {}  # configs timed for the 16-bit weight

    def quantize_int4(self, group_size: int | None) -> None:
        """Replace the loaded 16-bit weight by int4 groups of ``group_size`` along K (None:
        one a row), round to nearest, asymmetric, fp16 scales (models/int4_formats.
        quantize_int4), packed into our layout (kernels/int4_gemm.py): quantization="int4"."""
        from flashpage.kernels.int4_gemm import pack_int4
        from flashpage.models.int4_formats import quantize_int4

        q, scales, zeros = quantize_int4(self.weight.data, group_size)
        self.weight = nn.Parameter(pack_int4(q), requires_grad=False)
        self.w4_scales, self.w4_zeros = scales, zeros
        self.skinny = {}

    def hold_fp8(self, block: tuple[int, int] | None = None) -> None:
        """Hold an fp8 checkpoint's weight (models/fp8_checkpoint.py): ``weight`` becomes an
        empty float8_e4m3fn [N, K] and ``weight_scale`` an empty fp32 [N], both filled by
        loading (e4m3 values as stored, each row's scale); with ``block`` (bn, bk) the
        scales are the tiles', fp32 [ceil(N/bn), ceil(K/bk)]."""
        w = self.weight
        n, k = w.shape
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
        self.weight_scale = torch.empty(shape, dtype=torch.float32, device=w.device)
        self.weight_block = block
        self.skinny = {}

    def hold_int4(self, group_size: int, scale_dtype: torch.dtype) -> None:
        """Hold an int4 checkpoint's weight (models/int4_checkpoint.py) in our layout
        (kernels/int4_gemm.py): ``weight`` becomes an empty int32 [N, K/8], ``w4_scales``
        an empty ``scale_dtype`` [N, K/G] and ``w4_zeros`` an empty uint8 [N, K/G], all
        filled by loading."""
        n, k = self.weight.shape
        if k % group_size or group_size % 8:
            raise ValueError(f"K={k} is not a multiple of the group size {group_size} (itself "
                             "a multiple of 8)")
        dev = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, k // 8, dtype=torch.int32, device=dev),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w4_scales = torch.empty(n, k // group_size, dtype=scale_dtype, device=dev)
        self.w4_zeros = torch.empty(n, k // group_size, dtype=torch.uint8, device=dev)
        self.skinny = {}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if self.is_quantized and param is self.weight and loaded.dtype != FP8_DTYPE:
            raise RuntimeError("weights load before quantization (the layer holds fp8 already)")
        dim = self.split_dim if param.dim() > 1 or self.split_dim == 0 else None
        if dim is not None and self.tp_size > 1:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(loaded)

    def _use_row_gemv(self, x: torch.Tensor) -> bool:
        return (self.row_gemv and x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1
                and envs.gemv_row())

    def fuses_norm(self, x: torch.Tensor, norm: nn.Module) -> bool:
        """Whether ``forward(PendingNorm(x, ..., norm, ...))`` computes the norm inside
        our GEMV (one row, rows short enough to load whole, our kernels on, no LoRA)."""
        if self.lora is not None:
            # The delta's shrink needs the normed row, which the GEMV computes only in its
            # registers: fusing would mean the shrink normalizing x again in its own
            # prologue (and running before the GEMV writes residual_out, which may alias
            # residual). Not done yet: the norm runs as its own kernel.
            return False
        if not (isinstance(norm, RMSNorm) and norm.fused and x.is_contiguous()):
            return False  # the prologues compute RMSNorm (a fused LayerNorm runs on its own)
        if self.w4_scales is not None:  # int4: the chain GEMV's prologue (layers/int4.py)
            k = self.in_features
            return (norm.weight.dtype == x.dtype and int4_fuses_norm(
                tuple(x.shape), x.dtype, x.is_cuda, k, k // self.w4_scales.shape[1]))
        if not self._use_row_gemv(x):
            return False  # (and Triton, an optional dependency, stays unimported on the CPU)
        from flashpage.kernels.gemv import WHOLE_ROW_LIMIT

        return x.shape[1] <= WHOLE_ROW_LIMIT and norm.weight.dtype == x.dtype

    def forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if self.lora is not None:
            if isinstance(x, PendingNorm):
                x = x.compute()
            return self.lora.apply(x, self._forward(x))
        return self._forward(x)

    def _forward(self, x: torch.Tensor | PendingNorm) -> torch.Tensor:
        if isinstance(x, PendingNorm):
            if not self.fuses_norm(x.x, x.norm):
                return self.forward(x.compute())
            from flashpage.kernels.gemv import gemv_row

            norm_w, eps = cast(torch.Tensor, x.norm.weight), float(cast(float, x.norm.eps))
            if self.w4_scales is not None:
                from flashpage.kernels.int4_gemv import int4_gemv

                assert self.w4_zeros is not None
                return int4_gemv(x.x, self.weight, self.w4_scales, self.w4_zeros, self.bias,
                                 norm=(norm_w, eps), residual=x.residual,
                                 residual_out=x.residual_out)
            return gemv_row(x.x, self.weight, self.bias, norm=(norm_w, eps),
                            residual=x.residual, residual_out=x.residual_out,
                            scale=self.weight_scale, block=self.weight_block)
        if self._use_row_gemv(x):
            from flashpage.kernels.gemv import gemv_row

            return gemv_row(x, self.weight, self.bias, scale=self.weight_scale,
                            block=self.weight_block)
        if self.weight_block is not None:
            assert self.weight_scale is not None
            return fp8_block_linear(x, self.weight, self.weight_scale, self.weight_block, self.bias)
        if self.skinny and x.dim() == 2 and (cfg := self.skinny.get(x.shape[0])) is not None:
            from flashpage.kernels.gemv import skinny_linear

            return skinny_linear(x, self.weight, self.bias, cfg, scale=self.weight_scale)
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        if self.w4_scales is not None:
            assert self.w4_zeros is not None
            return int4_linear(x, self.weight, self.w4_scales, self.w4_zeros, self.bias)
        return F.linear(x, self.weight, self.bias)

    def silu_mul_forward(self, h: torch.Tensor) -> torch.Tensor | None:
        """linear(silu(gate) * up) from the gate/up output h [M, 2K] in one kernel, when
        tuned for M rows (an int4 weight: at the int4 GEMV's rows on CUDA, layers/int4.py
        ``fuses_silu_mul``); None otherwise (the caller runs SiLU·mul, then ``forward``).
        With LoRA only where the delta runs through kernels/lora.py, whose shrink takes
        the same gate/up output (the dense delta would need the activation materialized)."""
        if self.lora is None:
            return self._silu_mul_base(h)
        if not self.lora.uses_kernels(h, h):
            return None
        y = self._silu_mul_base(h)
        return None if y is None else self.lora.apply(h, y, silu_mul=True)

    def _silu_mul_base(self, h: torch.Tensor) -> torch.Tensor | None:
        if self.w4_scales is not None:
            assert self.w4_zeros is not None
            k, g = self.in_features, self.in_features // self.w4_scales.shape[1]
            if not fuses_silu_mul(tuple(h.shape), h.dtype, h.is_cuda, k, g):
                return None
            from flashpage.kernels.int4_gemv import int4_gemv

            return int4_gemv(h, self.weight, self.w4_scales, self.w4_zeros, self.bias,
                             silu_mul=True)
        if self._use_row_gemv(h):
            from flashpage.kernels.gemv import gemv_row

            return gemv_row(h, self.weight, self.bias, silu_mul=True, scale=self.weight_scale,
                            block=self.weight_block)
        if self.skinny and h.dim() == 2 and (cfg := self.skinny.get(h.shape[0])) is not None:
            from flashpage.kernels.gemv import skinny_linear

            return skinny_linear(h, self.weight, self.bias, cfg, silu_mul=True,
                                 scale=self.weight_scale)
        return None


def set_row_gemv(model: nn.Module, enabled: bool) -> int:
    """Allow (or forbid) ``gemv_row`` in every 16-bit or fp8 linear of ``model`` (scales per
    row or per block); returns how many layers may use it."""
    count = 0
    for m in model.modules():
        if isinstance(m, _ParallelLinear):
            m.row_gemv = enabled and (m.weight.dtype in (torch.float16, torch.bfloat16)
                                      or m.is_quantized)
            count += m.row_gemv
    return count


def tune_skinny_gemms(model: nn.Module, rows: tuple[int, ...] = (1, 2, 4, 8),
                      dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Time our decode-batch GEMM against the path a layer runs otherwise for every
    distinct linear shape of ``model`` (on the GPU; 16-bit weights against cuBLAS, fp8
    ones, with activations of ``dtype``, against W8A8 ``_scaled_mm``) at each row count,
    and route the layers to ours where it wins.
    Returns {shape: {rows: (config name or "cublas", {candidate: us})}}."""
    from flashpage.kernels.gemv_tune import pick_config

    layers = [m for m in model.modules() if isinstance(m, _ParallelLinear)]
    groups: dict[tuple[Any, ...], list[_ParallelLinear]] = {}
    for m in layers:
        w = m.weight
        if m.weight_block is not None:
            continue  # block-scaled fp8: layers/quant.fp8_block_linear picks its own path
        if w.is_cuda and (w.dtype in (torch.float16, torch.bfloat16) or m.is_quantized):
            groups.setdefault((tuple(w.shape), w.dtype, m.silu_input), []).append(m)
    report: dict[str, Any] = {}
    for (shape, wdt, silu), mods in groups.items():
        fp8 = wdt == FP8_DTYPE
        key = f"{shape[0]}x{shape[1]}{' fp8' if fp8 else ''}{' (silu_mul)' if silu else ''}"
        report[key] = {}
        w, scale = mods[0].weight, mods[0].weight_scale

        def w8a8(a: torch.Tensor, w: torch.Tensor = w, scale: Any = scale) -> torch.Tensor:
            return fp8_linear(a, w, scale)

        for m_rows in rows:
            if fp8:
                cfg, times = pick_config(w, m_rows, silu_mul=silu, scale=scale,
                                         dtype=dtype or torch.bfloat16, baseline=w8a8)
            else:
                cfg, times = pick_config(w, m_rows, silu_mul=silu)
            report[key][m_rows] = (cfg.name if cfg else "cublas", times)
            if cfg is not None:
                for mod in mods:
                    mod.skinny[m_rows] = cfg
        picks = {r: v[0] for r, v in report[key].items()}
        logger.info("decode GEMM %s x%d layers: %s", key, len(mods), picks)
    return report


class ColumnParallelLinear(_ParallelLinear):
    split_dim = 0


class RowParallelLinear(_ParallelLinear):
    split_dim = 1
    # With tp_size > 1 the forward would all-reduce its partial sums here.


class VocabEmbedding(nn.Module):
    """Token embedding (vocab-parallel later); ``weight`` keeps HF's name."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
