"""Mixtures of experts: a top-k gate, routed experts, shared experts.

DeepSeek-V2/V3's (``DeepseekMoE``), Mixtral's, Qwen2-MoE's, Qwen3-MoE's and OLMoE's
(``SparseMoeBlock``, in the Llama body of models/llama.py and OLMoE's of models/olmoe.py),
and Granite MoE's (``models/granite.GraniteMoeBlock``): all route with ``MoEGate`` and run
their routed experts as ``FusedExperts``. GPT-OSS's experts (``models/gpt_oss.GptOssExperts``,
behind its own router) are a FusedExperts with per-expert biases and the clamped SwiGLU.

Parameter names are those of transformers 5.x, so its state_dicts load by name::

    gate.weight                    [E, hidden]          fp32 (kept fp32, as HF does)
    gate.e_score_correction_bias   [E]                  fp32, V3 (noaux_tc) only
    experts.gate_up_proj           [E, 2 * I, hidden]   gate rows first, then up
    experts.down_proj              [E, hidden, I]
    shared_experts.gate_up_proj.weight  [2 * I_s, hidden]  HF's gate_proj and up_proj, merged
    shared_experts.down_proj.weight     [hidden, I_s]      I_s = I * n_shared_experts

Checkpoints on disk (original DeepSeek ones, and those ``save_pretrained`` writes) hold
one tensor per expert, ``experts.{e}.{gate,up,down}_proj.weight``; the experts module
fuses those on load (see ``FusedExperts._load_from_state_dict``); the shared experts'
gate_proj / up_proj stack on load the same way (``layers/mlp.GatedMLP``).

Routing, as transformers computes it (fp32 logits):

- V2 (``softmax``): ``greedy`` = top-k of the softmax; ``group_limited_greedy`` = keep the
  ``topk_group`` groups with the highest max score, then top-k. Weights are the softmax
  scores times ``routed_scaling_factor``; transformers ignores ``norm_topk_prob`` here
  (every V2 checkpoint sets it false), and so do we, to stay token-identical.
- V3 (``sigmoid`` + ``noaux_tc``): choose with ``sigmoid + e_score_correction_bias``;
  groups are ranked by the sum of their two best, the best ``topk_group`` kept, top-k
  within; weights are the *uncorrected* sigmoid scores, normalised if
  ``norm_topk_prob``, times ``routed_scaling_factor``. transformers' V3 always routes
  this way, whatever ``topk_method``/``scoring_func`` say (its config has neither).
- Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE (``greedy``): top-k of the softmax,
  the k weights then divided by their sum (Mixtral always, Qwen and OLMoE if
  ``norm_topk_prob``; Granite MoE always: transformers' softmax over the k best logits is
  the same), no scaling.

Experts run one of three ways, chosen by the token count alone (a shape, so a CUDA graph
captured for a batch size always replays the same path):

- **grouped** (more than ``sync_free_max_tokens`` tokens: long prompt chunks): the
  (token, slot) pairs are sorted by expert, each expert runs one matmul over its
  contiguous slice. The slice sizes are read back to the host once per layer, which is
  cheap in eager mode but cannot be captured;
- **sync-free** (decode batches and short chunks): static shapes, no host sync.
  For very few pairs (``3 * tokens * top_k <= E``) each pair's expert weights are
  gathered and run as batched matmuls (less weight traffic than reading every expert);
  otherwise every expert runs on every token as one batched matmul per projection and
  each token keeps the outputs of its top-k. Up to ~200 tokens per expert this costs the
  same memory traffic as the grouped path (every expert read once); past that the
  wasted FLOPs grow, hence the limit;
- **fused kernel** (``fused_kernel`` set, same token range as sync-free, which it
  replaces): ``kernels/fused_moe.py`` sorts the pairs by expert on the device into
  blocks of a static worst-case count and runs one grouped GEMM per projection over
  them, so only the routed experts' weights are read; no host sync either. The engine
  turns it on (:func:`set_fused_moe`) with the triton backend on CUDA unless
  ``FLASHPAGE_FUSED_MOE=0``: on the H200 it reads 1.7-4x less than sync-free at 1-16
  tokens and took DeepSeek-V2-Lite from 2,305 to 2,713 output tok/s. Experts held in
  MXFP4 (``FusedExperts(mxfp4=True)``: GPT-OSS's checkpoints where this kernel runs them)
  take its MXFP4 variant (``fused_moe_mxfp4``: 4.25 bits a weight read); the torch paths
  dequantize them per call. So do experts held in block-scaled fp8 (``hold_fp8``: the
  routed experts of DeepSeek-V3's and Qwen3-*-FP8's checkpoints, models/fp8_checkpoint.py),
  which take ``kernels/fused_moe_fp8.py`` (one byte a weight read), and experts held in
  int4 (``hold_int4``: an AWQ / GPTQ checkpoint's, models/int4_checkpoint.py), which take
  ``kernels/fused_moe_int4.py`` (half a byte a weight read).

All three weight each expert output in fp32, round it to the model dtype, then sum per token;
all three take the optional biases and activation (``FusedExperts(bias=, activation=)``).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from flashpage import envs
from flashpage.config import DEEPSEEK_FAMILY, ModelConfig
from flashpage.kernels.fused_moe import ClampedSwiGLU
from flashpage.layers.fp32 import KeepFp32
from flashpage.layers.mlp import GatedMLP
from flashpage.models.mxfp4 import BLOCK as MXFP4_BLOCK
from flashpage.models.mxfp4 import FP4_VALUES, dequantize_mxfp4


def routing_method(config: ModelConfig) -> str:
    """'greedy', 'group_limited_greedy' (softmax scoring) or 'noaux_tc' (sigmoid)."""
    if config.model_type == "deepseek_v3" or config.topk_method == "noaux_tc":
        return "noaux_tc"
    if config.topk_method in ("greedy", "group_limited_greedy"):
        return config.topk_method
    raise ValueError(f"unsupported MoE topk_method {config.topk_method!r} "
                     "(supported: greedy, group_limited_greedy, noaux_tc)")


class MoEGate(KeepFp32, nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not config.n_routed_experts:
            raise ValueError("MoEGate needs n_routed_experts")
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.method = routing_method(config)
        self.n_group = config.n_group or 1
        self.topk_group = config.topk_group or 1
        # transformers' V2 ignores norm_topk_prob on its softmax routes; Mixtral and Qwen use it
        self.norm_topk_prob = config.norm_topk_prob and (
            self.method == "noaux_tc" or config.architecture not in DEEPSEEK_FAMILY)
        self.routed_scaling_factor = config.routed_scaling_factor
        if self.method != "greedy" and self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.num_experts}) must be a multiple of "
                             f"n_group ({self.n_group})")
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size,
                                               dtype=torch.float32))
        if self.method == "noaux_tc":
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(self.num_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    # The routing after the logits GEMM may go through kernels/moe_router.py (set by
    # set_fused_moe beside the fused MoE kernel; unless FLASHPAGE_FUSED_ROUTER=0,
    # read at each call, so a decode graph takes the value at its capture).
    fused_route: bool = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights fp32 [N, top_k], expert ids int64 [N, top_k])."""
        logits = F.linear(x.float(), self.weight.float())
        if self.fused_route and envs.fused_router():
            from flashpage.kernels.moe_router import moe_route

            return moe_route(logits, self.top_k, self.method, n_group=self.n_group,
                             topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                             scale=self.routed_scaling_factor, bias=self.e_score_correction_bias)
        n = logits.shape[0]
        if self.method == "noaux_tc":
            scores = logits.sigmoid()
            bias = self.e_score_correction_bias
            assert bias is not None  # registered for noaux_tc
            choice = scores + bias
            per_group = choice.view(n, self.n_group, -1)
            group_scores = per_group.topk(2, dim=-1).values.sum(-1)
            choice = self._mask_groups(choice, group_scores, float("-inf"))
            ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1)
            if self.method == "group_limited_greedy":
                group_scores = scores.view(n, self.n_group, -1).amax(-1)
                scores = self._mask_groups(scores, group_scores, 0.0)
            weights, ids = scores.topk(self.top_k, dim=-1, sorted=False)
            if self.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.routed_scaling_factor, ids

    def _mask_groups(self, scores: torch.Tensor, group_scores: torch.Tensor,
                     fill: float) -> torch.Tensor:
        """Set the scores of experts outside the ``topk_group`` best groups to ``fill``."""
        keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        mask = mask.repeat_interleave(self.num_experts // self.n_group, dim=1)
        return scores.masked_fill(~mask, fill)


# The engine captures decode graphs for batches of up to 512 requests (one token each,
# engine/cuda_graph.py): every captured size must take the sync-free path.
SYNC_FREE_MAX_TOKENS = 512


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, act: ClampedSwiGLU) -> torch.Tensor:
    """GPT-OSS's activation as transformers computes it (GptOssExperts._apply_gate, op for
    op, so each step rounds in the model dtype as the fused kernel's contract says):
    (up.clamp(-limit, limit) + 1) * g * sigmoid(g * alpha), g = gate.clamp(max=limit)."""
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


class FusedExperts(nn.Module):
    """All routed experts' weights as 3-D tensors; forward runs them sync-free (torch or the
    fused kernel) or grouped.

    ``bias``: per-expert biases ``gate_up_proj_bias`` [E, 2I] (gate half first) and
    ``down_proj_bias`` [E, hidden], added to each projection (GPT-OSS's). ``activation``:
    None for silu(gate) * up, a ClampedSwiGLU for GPT-OSS's. Every path, and the fused
    kernel, takes both.

    ``mxfp4``: the weights held as MXFP4 (GPT-OSS's released experts, models/mxfp4.py) in
    the fused kernel's layout instead of the 16-bit ``gate_up_proj`` / ``down_proj`` (then
    None): uint8 buffers ``gate_up_proj_blocks`` [E, 2I, H / 2] (two e2m1 values a byte,
    the low nibble first along H), ``gate_up_proj_scales`` [E, 2I, H / 32] (e8m0),
    ``down_proj_blocks`` [E, H, I / 2], ``down_proj_scales`` [E, H, I / 32]: 4.25 bits a
    weight. The fused kernel reads them as they are (kernels/fused_moe.fused_moe_mxfp4);
    the torch paths dequantize what they need to the activation dtype at each call
    (gathered: the pairs' experts; every expert on every token: the whole layer, one
    transient 16-bit copy of it; grouped: one expert at a time), the same weights the
    dequantize-at-load path holds, at the cost of that extra write and read per call.

    ``hold_fp8`` (a block-fp8 checkpoint's experts, models/fp8_checkpoint.py):
    ``gate_up_proj`` / ``down_proj`` become float8_e4m3fn with fp32 block scales
    ``gate_up_proj_scale`` [E, 2I / 128, H / 128] and ``down_proj_scale`` [E, H / 128,
    I / 128] (W = scale of its 128 x 128 block * value, the checkpoint's ``weight_scale_inv``
    tiles stacked), read as they are by kernels/fused_moe_fp8.fused_moe_fp8 and dequantized
    per call by the torch paths, as MXFP4's.

    ``hold_int4`` (an AWQ / GPTQ checkpoint's experts, models/int4_checkpoint.py): the
    packed layout of kernels/int4_gemm.py an expert a leading index, ``gate_up_proj`` int32
    [E, 2I, H / 8] and ``down_proj`` int32 [E, H, I / 8], with buffers
    ``gate_up_proj_w4_scales`` / ``gate_up_proj_w4_zeros`` (uint8) [E, 2I, H / G] and
    ``down_proj_w4_scales`` / ``down_proj_w4_zeros`` [E, H, I / G] (G the file's group
    size, or the row); read as they are by kernels/fused_moe_int4.fused_moe_int4 and
    dequantized per call by the torch paths."""

    # Up to sync_free_max_tokens (MXFP4: always): the Triton grouped kernel instead of
    # forward_sync_free.
    # Per instance through set_fused_moe (needs Triton on CUDA, or its CPU interpreter).
    fused_kernel: bool = False
    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    # mxfp4 only (otherwise absent)
    gate_up_proj_blocks: torch.Tensor
    gate_up_proj_scales: torch.Tensor
    down_proj_blocks: torch.Tensor
    down_proj_scales: torch.Tensor
    fp4_lut: torch.Tensor
    # fp8 only (hold_fp8; otherwise absent)
    gate_up_proj_scale: nn.Parameter
    down_proj_scale: nn.Parameter
    gate_up_proj_bias: nn.Parameter | None
    down_proj_bias: nn.Parameter | None
    # int4 only (hold_int4; otherwise absent)
    gate_up_proj_w4_scales: torch.Tensor
    gate_up_proj_w4_zeros: torch.Tensor
    down_proj_w4_scales: torch.Tensor
    down_proj_w4_zeros: torch.Tensor

    def __init__(self, config: ModelConfig, bias: bool = False,
                 activation: ClampedSwiGLU | None = None, mxfp4: bool = False) -> None:
        super().__init__()
        assert config.n_routed_experts
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.intermediate = config.moe_intermediate_size
        self.sync_free_max_tokens = SYNC_FREE_MAX_TOKENS
        self.activation = activation
        self.mxfp4 = mxfp4
        self.fp8 = False  # hold_fp8
        self.int4 = False  # hold_int4
        h, e, two_i = config.hidden_size, self.num_experts, 2 * self.intermediate
        if mxfp4:
            if h % MXFP4_BLOCK or self.intermediate % MXFP4_BLOCK:
                raise ValueError(f"MXFP4 experts need hidden_size ({h}) and the experts' "
                                 f"intermediate size ({self.intermediate}) to be multiples of "
                                 f"{MXFP4_BLOCK}")
            u8 = torch.uint8
            self.register_parameter("gate_up_proj", None)
            self.register_parameter("down_proj", None)
            self.register_buffer("gate_up_proj_blocks", torch.zeros(e, two_i, h // 2, dtype=u8))
            self.register_buffer("gate_up_proj_scales",
                                 torch.zeros(e, two_i, h // MXFP4_BLOCK, dtype=u8))
            self.register_buffer("down_proj_blocks",
                                 torch.zeros(e, h, self.intermediate // 2, dtype=u8))
            self.register_buffer("down_proj_scales",
                                 torch.zeros(e, h, self.intermediate // MXFP4_BLOCK, dtype=u8))
            self.register_buffer("fp4_lut", torch.tensor(FP4_VALUES), persistent=False)
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(e, two_i, h))
            self.down_proj = nn.Parameter(torch.empty(e, h, self.intermediate))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(self.num_experts, 2 * self.intermediate))
            self.down_proj_bias = nn.Parameter(torch.zeros(self.num_experts, h))
        else:
            self.register_parameter("gate_up_proj_bias", None)
            self.register_parameter("down_proj_bias", None)

    def fp8_unsupported(self) -> str | None:
        """Why these experts cannot hold block-fp8 weights (hold_fp8), or None."""
        from flashpage.kernels.fp8_block_ref import EXPERT_BLOCK

        if self.mxfp4 or self.gate_up_proj_bias is not None or self.activation is not None:
            return "MXFP4, biases or GPT-OSS's activation"
        h = self.gate_up_proj.shape[2]
        if h % EXPERT_BLOCK or self.intermediate % EXPERT_BLOCK:
            return (f"hidden size {h} or expert intermediate size {self.intermediate} not a "
                    f"multiple of {EXPERT_BLOCK}")
        return None

    def hold_fp8(self) -> None:
        """Hold a block-fp8 checkpoint's experts (the class docstring): e4m3 weights and
        fp32 block scales, empty, filled by loading (load_expert_weight)."""
        from flashpage.kernels.fp8_block_ref import EXPERT_BLOCK as B

        if (why := self.fp8_unsupported()) is not None:
            raise ValueError(f"these experts cannot hold block-fp8 weights: {why}")
        dev = self.gate_up_proj.device
        e, two_i, h = self.gate_up_proj.shape
        inter = self.intermediate

        def empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=dev), requires_grad=False)

        self.gate_up_proj = empty(e, two_i, h, dtype=torch.float8_e4m3fn)
        self.down_proj = empty(e, h, inter, dtype=torch.float8_e4m3fn)
        self.gate_up_proj_scale = empty(e, two_i // B, h // B, dtype=torch.float32)
        self.down_proj_scale = empty(e, h // B, inter // B, dtype=torch.float32)
        self.fp8 = True

    def int4_unsupported(self, group: int | None, down_group: int | None | bool = True,
                         ) -> str | None:
        """Why these experts cannot hold int4 weights in groups of ``group`` (None: a row)
        for the fused int4 kernel (hold_int4), or None; ``down_group``: down_proj's groups
        where they differ from gate_up_proj's (quantize_int4; True: the same)."""
        from flashpage.kernels.fused_moe_int4 import kernel_supports

        if self.mxfp4 or self.fp8 or self.int4 or self.gate_up_proj_bias is not None \
                or self.activation is not None:
            return "MXFP4, fp8, int4 already, biases or GPT-OSS's activation"
        h, inter = self.gate_up_proj.shape[2], self.intermediate
        g2 = group if down_group is True else down_group
        return kernel_supports(h, inter, group or h, g2 or inter)

    def hold_int4(self, group: int | None, scale_dtype: torch.dtype) -> None:
        """Hold an int4 checkpoint's experts (the class docstring): packed words, per-group
        scales (``scale_dtype``, the file's) and zero points, empty, filled by loading
        (load_expert_weight)."""
        if (why := self.int4_unsupported(group)) is not None:
            raise ValueError(f"these experts cannot hold int4 weights: {why}")
        dev = self.gate_up_proj.device
        e, two_i, h = self.gate_up_proj.shape
        inter = self.intermediate
        g1, g2 = group or h, group or inter

        def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=dev)

        self.gate_up_proj = nn.Parameter(empty(e, two_i, h // 8, dtype=torch.int32),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(empty(e, h, inter // 8, dtype=torch.int32),
                                      requires_grad=False)
        self.register_buffer("gate_up_proj_w4_scales", empty(e, two_i, h // g1, dtype=scale_dtype))
        self.register_buffer("gate_up_proj_w4_zeros", empty(e, two_i, h // g1, dtype=torch.uint8))
        self.register_buffer("down_proj_w4_scales", empty(e, h, inter // g2, dtype=scale_dtype))
        self.register_buffer("down_proj_w4_zeros", empty(e, h, inter // g2, dtype=torch.uint8))
        self.int4 = True

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Quantize the loaded 16/32-bit experts to what hold_fp8 holds (quantization="fp8"):
        each expert's 128 x 128 blocks by their own amax / 448 (kernels/fp8_block_ref.
        quantize_fp8_block, DeepSeek-V3's checkpoints' recipe), one projection and one
        expert at a time, each 16-bit projection dropped once its e4m3 copy is made (the
        peak: one projection's e4m3 beside the layer's 16-bit weights and one expert's
        fp32 temporaries)."""
        from flashpage.kernels.fp8_block_ref import EXPERT_BLOCK as B
        from flashpage.kernels.fp8_block_ref import quantize_fp8_block

        if (why := self.fp8_unsupported()) is not None or self.fp8 or self.int4:
            raise ValueError(f"these experts cannot be quantized to block fp8: "
                             f"{why or 'they are quantized already'}")
        for proj in ("gate_up_proj", "down_proj"):
            w = getattr(self, proj).data
            e, n, k = w.shape
            q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=w.device)
            scale = torch.empty(e, n // B, k // B, dtype=torch.float32, device=w.device)
            for i in range(e):
                q[i], scale[i] = quantize_fp8_block(w[i], (B, B))
            del w
            setattr(self, proj, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{proj}_scale", nn.Parameter(scale, requires_grad=False))
        self.fp8 = True

    @torch.no_grad()
    def quantize_int4(self, group: int | None, down_group: int | None) -> None:
        """Quantize the loaded 16/32-bit experts to what hold_int4 holds (quantization="int4"
        / "rtn"): each expert's rows in int4 groups along K, ``group`` for gate_up_proj (K =
        hidden) and ``down_group`` for down_proj (K = intermediate; None: one a row), round
        to nearest, asymmetric, fp16 scales (models/int4_formats.quantize_int4, as the dense
        linears' quantize_int4), packed (kernels/int4_gemm.pack_int4); one projection and
        one expert at a time, each 16-bit projection dropped once packed."""
        from flashpage.kernels.int4_gemm import pack_int4
        from flashpage.models.int4_formats import quantize_int4

        if (why := self.int4_unsupported(group, down_group)) is not None:
            raise ValueError(f"these experts cannot be quantized to int4: {why}")
        for proj, g in (("gate_up_proj", group), ("down_proj", down_group)):
            w = getattr(self, proj).data
            e, n, k = w.shape
            gk = g or k
            words = torch.empty(e, n, k // 8, dtype=torch.int32, device=w.device)
            scales = torch.empty(e, n, k // gk, dtype=torch.float16, device=w.device)
            zeros = torch.empty(e, n, k // gk, dtype=torch.uint8, device=w.device)
            for i in range(e):
                q, scales[i], zeros[i] = quantize_int4(w[i], g)
                words[i] = pack_int4(q)
            del w
            setattr(self, proj, nn.Parameter(words, requires_grad=False))
            self.register_buffer(f"{proj}_w4_scales", scales)
            self.register_buffer(f"{proj}_w4_zeros", zeros)
        self.int4 = True

    def expert_bytes(self) -> int:
        """Bytes the routed experts' weights take as held (values, and scales / zeros where
        quantized; not the biases): quantize_model's report."""
        names = ["gate_up_proj", "down_proj"]
        if self.mxfp4:
            names = [f"{p}_{s}" for p in names for s in ("blocks", "scales")]
        elif self.fp8:
            names += ["gate_up_proj_scale", "down_proj_scale"]
        elif self.int4:
            names += [f"{p}_w4_{s}" for p in names for s in ("scales", "zeros")]
        return sum(getattr(self, n).nbytes for n in names)

    def read_fraction(self, tokens: int) -> float:
        """The share of these weights a step of ``tokens`` tokens reads at most (each token
        reads top_k experts)."""
        return min(1.0, tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, hidden], weights fp32 [N, K], ids int64 [N, K] -> sum_k weights * expert_k(x).
        Kept MXFP4 experts take the fused kernel at every token count where it runs: the
        grouped path would dequantize each used expert at every call (gpt-oss-120b's prompt
        steps took 7.5-8.9 s so, run 192). So do kept fp8 and int4 experts."""
        if self.fused_kernel and (self.mxfp4 or self.fp8 or self.int4):
            return self.forward_fused(x, weights, ids)
        if x.shape[0] <= self.sync_free_max_tokens:
            if self.fused_kernel:
                return self.forward_fused(x, weights, ids)
            return self.forward_sync_free(x, weights, ids)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"MoE over {x.shape[0]} tokens syncs with the host and cannot be captured in a "
                f"CUDA graph; capture at most {self.sync_free_max_tokens} tokens")
        return self.forward_grouped(x, weights, ids)

    def forward_sync_free(self, x: torch.Tensor, weights: torch.Tensor,
                          ids: torch.Tensor) -> torch.Tensor:
        """Same contract as :meth:`forward`; static shapes, no host sync (CUDA-graph safe)."""
        n, k = ids.shape
        if 3 * n * k <= self.num_experts:
            ys = self._gathered(x, ids)
        else:
            ys = self._all_experts(x, ids)
        return (ys * weights[..., None]).to(x.dtype).sum(1)

    def forward_fused(self, x: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
        """Same contract as :meth:`forward`; the Triton grouped kernel, reading only the
        routed experts' weights. Static shapes, no host sync (CUDA-graph safe)."""
        from flashpage.kernels.fused_moe import fused_moe, fused_moe_mxfp4

        if self.int4:
            from flashpage.kernels.fused_moe_int4 import fused_moe_int4

            return fused_moe_int4(x, self.gate_up_proj, self.gate_up_proj_w4_scales,
                                  self.gate_up_proj_w4_zeros, self.down_proj,
                                  self.down_proj_w4_scales, self.down_proj_w4_zeros, ids, weights)
        if self.fp8:
            from flashpage.kernels.fused_moe_fp8 import fused_moe_fp8

            return fused_moe_fp8(x, self.gate_up_proj, self.gate_up_proj_scale, self.down_proj,
                                 self.down_proj_scale, ids, weights)
        if self.mxfp4:
            return fused_moe_mxfp4(x, self.gate_up_proj_blocks, self.gate_up_proj_scales,
                                   self.down_proj_blocks, self.down_proj_scales, ids, weights,
                                   gate_up_bias=self.gate_up_proj_bias,
                                   down_bias=self.down_proj_bias, activation=self.activation)
        return fused_moe(x, self.gate_up_proj, self.down_proj, ids, weights,
                         gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                         activation=self.activation)

    def _weight(self, proj: str, dtype: torch.dtype,
                experts: torch.Tensor | int | None = None) -> torch.Tensor:
        """``proj`` ("gate_up_proj" or "down_proj") in 16 bits, all experts or ``experts``
        (an index tensor: index_select; an int: that expert's): the parameter, or for MXFP4
        the blocks, for fp8 the e4m3 values times their block scales, for int4 the packed
        words with their scales and zeros, dequantized now to ``dtype``."""
        names = ((f"{proj}_blocks", f"{proj}_scales") if self.mxfp4
                 else (proj, f"{proj}_scale") if self.fp8
                 else (proj, f"{proj}_w4_scales", f"{proj}_w4_zeros") if self.int4 else (proj,))
        # e4m3 indexed as its bytes (index_select over float8 is not in every torch build)
        ts = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
              for t in (getattr(self, n) for n in names)]
        if isinstance(experts, int):
            ts = [t[experts] for t in ts]
        elif experts is not None:
            ts = [t.index_select(0, experts) for t in ts]
        if self.int4:
            from flashpage.kernels.fused_moe_int4 import dequantize_experts_int4

            if isinstance(experts, int):
                return dequantize_experts_int4(ts[0][None], ts[1][None], ts[2][None], dtype)[0]
            return dequantize_experts_int4(ts[0], ts[1], ts[2], dtype)
        if self.fp8:
            from flashpage.kernels.fp8_block_ref import dequantize_experts_fp8

            q, s = ts[0].view(torch.float8_e4m3fn), ts[1]
            if isinstance(experts, int):
                return dequantize_experts_fp8(q[None], s[None], dtype)[0]
            return dequantize_experts_fp8(q, s, dtype)
        if not self.mxfp4:
            return ts[0]
        blocks, scales = ts
        return dequantize_mxfp4(blocks.unflatten(-1, (scales.shape[-1], MXFP4_BLOCK // 2)),
                                scales, dtype, lut=self.fp4_lut)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        """[..., 2I] (gate, then up) -> [..., I]."""
        gate, up = h.chunk(2, dim=-1)
        if self.activation is None:
            return F.silu(gate) * up
        return clamped_swiglu(gate, up, self.activation)

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pair with its own expert's weights: -> [N, K, hidden]."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        xs = x[:, None, :].expand(n, k, x.shape[1]).reshape(n * k, 1, x.shape[1])
        gate_up = self._weight("gate_up_proj", x.dtype, flat)
        h = torch.bmm(xs, gate_up.transpose(1, 2))  # [P, 1, 2I]
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias.index_select(0, flat)[:, None]
        y = torch.bmm(self._act(h), self._weight("down_proj", x.dtype, flat).transpose(1, 2))
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias.index_select(0, flat)[:, None]
        return y.view(n, k, x.shape[1])

    def _all_experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, then each token's top-k picked: -> [N, K, hidden]."""
        n, k = ids.shape
        gate_up = self._weight("gate_up_proj", x.dtype)
        e, two_i, hidden = gate_up.shape
        # One GEMM against all experts' gate/up rows at once: [N, E * 2I].
        h = F.linear(x, gate_up.view(e * two_i, hidden)).view(n, e, two_i)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias
        act = self._act(h).transpose(0, 1)  # [E, N, I] (a strided view, no copy)
        y = torch.bmm(act, self._weight("down_proj", x.dtype).transpose(1, 2))  # [E, N, hidden]
        if self.down_proj_bias is not None:
            y = y + self.down_proj_bias[:, None]
        rows = ids * n + torch.arange(n, device=x.device)[:, None]  # row of (expert, token)
        return y.reshape(-1, x.shape[1]).index_select(0, rows.reshape(-1)).view(n, k, x.shape[1])

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
        """Same contract as :meth:`forward`; one matmul per used expert, one host sync."""
        n, k = ids.shape
        flat_ids = ids.reshape(-1)
        order = flat_ids.argsort(stable=True)  # (token, slot) pairs grouped by expert
        token = order // k
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one sync
        xs = x.index_select(0, token)
        ys = torch.empty_like(xs)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            seg = xs[start:start + c]
            h = F.linear(seg, self._weight("gate_up_proj", x.dtype, e))
            if self.gate_up_proj_bias is not None:
                h = h + self.gate_up_proj_bias[e]
            y = F.linear(self._act(h), self._weight("down_proj", x.dtype, e))
            if self.down_proj_bias is not None:
                y = y + self.down_proj_bias[e]
            ys[start:start + c] = y
            start += c
        # Weight in fp32, then back to the model dtype before the sum (as transformers).
        ys = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, ys)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        """Accept per-expert tensors (``experts.{e}.gate_proj.weight`` ...) and fuse them."""
        key = f"{prefix}0.gate_proj.weight"
        if key in state_dict and f"{prefix}gate_up_proj" not in state_dict:
            gate_up, down = [], []
            for e in range(self.num_experts):
                p = f"{prefix}{e}."
                gate_up.append(torch.cat([state_dict.pop(p + "gate_proj.weight"),
                                          state_dict.pop(p + "up_proj.weight")], dim=0))
                down.append(state_dict.pop(p + "down_proj.weight"))
            state_dict[f"{prefix}gate_up_proj"] = torch.stack(gate_up)
            state_dict[f"{prefix}down_proj"] = torch.stack(down)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


# Checkpoints hold one tensor per routed expert; we keep them fused, [E, ...] per layer.
# (``weight_scale``: a block-fp8 expert's scales, as models/fp8_checkpoint.py yields them
# for experts that hold fp8; ``w4_scales`` / ``w4_zeros``: an int4 expert's, as
# models/int4_checkpoint.py yields them for experts that hold int4)
EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\."
                         r"(?P<kind>weight|weight_scale|w4_scales|w4_zeros)$")
_KIND_SUFFIX = {"weight": "", "weight_scale": "_scale", "w4_scales": "_w4_scales",
                "w4_zeros": "_w4_zeros"}
# the dtypes of held (not 16/32-bit) expert values: a tensor of one goes only into another
_PACKED = (torch.float8_e4m3fn, torch.int32)


def load_expert_weight(targets: dict[str, torch.Tensor], m: re.Match[str], tensor: torch.Tensor,
                       pieces: dict[str, set[tuple[int, str]]], loaded: set[str]) -> None:
    """A checkpoint's ``...experts.{e}.{gate,up,down}_proj.weight`` (``m``: EXPERT_NAME's
    match) -> rows [:I] / [I:] of ``gate_up_proj[e]``, or ``down_proj[e]``, of the
    FusedExperts in ``targets`` (name -> parameter); the fused name joins ``loaded`` once
    every expert's pieces have arrived (``pieces``: what arrived so far). A block-fp8
    expert's ``weight_scale`` goes the same way into ``gate_up_proj_scale`` (rows of
    128-blocks: [:I / 128] / [I / 128:]) or ``down_proj_scale``; an int4 expert's packed
    words, ``w4_scales`` and ``w4_zeros`` the same way by rows (output features)."""
    prefix, e, proj = m["prefix"], int(m["e"]), m["proj"]
    suffix = _KIND_SUFFIX[m["kind"]]
    fused = f"{prefix}.{'down_proj' if proj == 'down' else 'gate_up_proj'}{suffix}"
    if fused not in targets:
        raise ValueError(f"checkpoint tensor {m.string!r} has no place in the model "
                         "(this layer has no routed experts)")
    param = targets[fused]
    num_experts = param.shape[0]
    if e >= num_experts:
        raise ValueError(f"{m.string}: expert {e} >= the model's {num_experts} experts")
    dst = param.data[e]
    if proj != "down":
        inter = dst.shape[0] // 2
        dst = dst[:inter] if proj == "gate" else dst[inter:]
    if dst.shape != tensor.shape:
        raise ValueError(f"{m.string}: checkpoint shape {tuple(tensor.shape)} != {tuple(dst.shape)}")
    if (dst.dtype in _PACKED or tensor.dtype in _PACKED) and dst.dtype != tensor.dtype:
        raise ValueError(f"{m.string}: a {tensor.dtype} tensor for {fused} ({dst.dtype}): fp8 "
                         "and int4 experts take the checkpoint's values and scales as stored")
    dst.copy_(tensor)
    got = pieces.setdefault(fused, set())
    got.add((e, proj))
    if len(got) == num_experts * (1 if proj == "down" else 2):
        loaded.add(fused)


def set_fused_moe(model: nn.Module, enabled: bool) -> None:
    """Run every MoE layer of ``model`` through the fused Triton kernel up to
    ``sync_free_max_tokens`` tokens (True) or the torch sync-free path (False); with it,
    the routing may take kernels/moe_router.py (``MoEGate.fused_route``)."""
    for m in model.modules():
        if isinstance(m, FusedExperts):
            m.fused_kernel = enabled
        elif isinstance(m, MoEGate):
            m.fused_route = enabled


class DeepseekMLP(GatedMLP):
    """SiLU-gated MLP: the shared experts, and the dense layers before
    ``first_k_dense_replace`` (gate and up merged; HF's names load, layers/mlp.py)."""


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts; forward takes [..., hidden] and keeps the shape."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"DeepSeek MoE supports hidden_act 'silu', got {config.hidden_act!r}")
        if not 0 < config.num_experts_per_tok <= (config.n_routed_experts or 0):
            raise ValueError(f"num_experts_per_tok ({config.num_experts_per_tok}) must be in "
                             f"1..n_routed_experts ({config.n_routed_experts})")
        self.gate = MoEGate(config)
        self.experts = FusedExperts(config)
        self.shared_experts = (
            DeepseekMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts > 0 else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        # transformers builds a zero-width shared MLP when n_shared_experts == 0.
        if self.shared_experts is None:
            for key in [k for k in state_dict if k.startswith(f"{prefix}shared_experts.")]:
                if state_dict[key].numel() == 0:
                    del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class SparseMoeBlock(nn.Module):
    """Mixtral's, Qwen2-MoE's, Qwen3-MoE's and OLMoE's MoE MLP (transformers 5's module names):
    ``gate`` (softmax top-k, MoEGate), ``experts`` (FusedExperts of moe_intermediate_size),
    and for Qwen2-MoE ``shared_expert`` (GatedMLP of shared_expert_intermediate_size) whose
    output, times sigmoid(``shared_expert_gate``(x)) (one logit a token), joins the routed
    experts'. forward takes [..., hidden] and keeps the shape."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = MoEGate(config)
        self.experts = FusedExperts(config)
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


__all__ = ["EXPERT_NAME", "SYNC_FREE_MAX_TOKENS", "DeepseekMLP", "DeepseekMoE", "FusedExperts",
           "MoEGate", "SparseMoeBlock", "clamped_swiglu", "load_expert_weight", "routing_method",
           "set_fused_moe"]
