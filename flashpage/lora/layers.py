"""Adapter slots of one linear, and the batched delta that mixes adapters in one step.

A linear with LoRA holds every slot's weights stacked, zero-padded to the engine's
``max_lora_rank`` R, one rank block per slice of its output (qkv_proj: q, k, v; gate_up:
gate, up; the others one), so ``n = slices * R`` columns per slot and S slots::

    a  [S * n, in]     rows s*n + j*R .. s*n + j*R + r - 1: slice j's A of slot s's adapter
    b  [out, S * n]    slice j's rows of the output, the same columns: its B (x scaling)

The step's tokens each carry a slot (``LoRAState.token_slots``, -1: none). For x [T, in]:

    xa    = x @ a^T                              [T, S * n]   every slot's shrink at once
    xa   *= (token_slots[t] == column's slot)    keep each token's own slot's columns
    y    += xa @ b^T                             [T, out]     each token's own B

Two dense GEMMs with S * n inner columns and a compare: shapes depend on T alone, there is
no host sync and no per-slot split, so the same code runs in CUDA graphs (the slot map is
a static buffer each step writes). The cost over the base GEMM is about
2 S n / min(in, out) (4 slots x 3 slices x rank 16 at 4096 wide: 9% on qkv_proj), and at
decode steps its five kernels per linear cost more than the FLOPs.

So at steps of up to ``kernels/lora.KERNEL_MAX_TOKENS`` tokens, on CUDA, the same delta runs
as two gathered kernels (``lora_shrink``, ``lora_expand``: each token reads only its own
slot's A rows and B columns, y updated in place, nothing read or written for tokens
without an adapter); FLASHPAGE_LORA_KERNELS=0 keeps the dense path, =1 runs the kernels on
the CPU too, through Triton's interpreter (tests). Same semantics: the shrink's fp32 sums
rounded to the activations' dtype, the expand accumulated in fp32 and added to y once.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from flashpage import envs


class LoRAState:
    """What every LoRA linear of one engine reads each step: ``token_slots`` int64
    [max_tokens], the slot of each of the step's tokens (rows past them: -1). The model
    runner writes it before the forward; graphs read it in place."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)

    @property
    def max_tokens(self) -> int:
        return self.token_slots.shape[0]


class LoRALinear:
    """One linear's slots (attached as ``linear.lora``; not an nn.Module, so its weights
    stay out of state dicts and checkpoint loading). ``slices``: (output row offset, rows)
    of each adaptable piece of the output, in order."""

    def __init__(self, state: LoRAState, in_features: int, out_features: int,
                 slices: list[tuple[int, int]], num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.state = state
        self.slices = slices
        self.max_rank = max_rank
        self.cols = len(slices) * max_rank  # per slot
        self.a = torch.zeros(num_slots * self.cols, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(out_features, num_slots * self.cols, device=device, dtype=dtype)
        self.col_slot = torch.arange(num_slots, device=device).repeat_interleave(self.cols)
        # steps of up to this many tokens run kernels/lora.py's kernels (0: never)
        self.kernel_max_tokens = 0
        if _use_kernels(envs.lora_kernels(), device):
            from flashpage.kernels.lora import KERNEL_MAX_TOKENS

            self.kernel_max_tokens = KERNEL_MAX_TOKENS

    def set_slot(self, slot: int, pieces: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` <- ``pieces`` {slice index: (A [r, in], B [rows, r] scaled)};
        slices left out hold zeros (the adapter does not touch them)."""
        c0 = slot * self.cols
        self.a[c0:c0 + self.cols].zero_()
        self.b[:, c0:c0 + self.cols].zero_()
        for j, (a, b) in pieces.items():
            off, rows = self.slices[j]
            r = a.shape[0]
            c = c0 + j * self.max_rank
            self.a[c:c + r].copy_(a)
            self.b[off:off + rows, c:c + r].copy_(b)

    def uses_kernels(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether ``apply(x, y)`` runs kernels/lora.py's kernels (else the dense path)."""
        return (x.dim() == 2 and x.shape[0] <= self.kernel_max_tokens
                and x.dtype == y.dtype == self.a.dtype and y.stride(-1) == 1)

    def apply(self, x: torch.Tensor, y: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """y + each token's adapter delta; x [T, in], y [T, out] (the base output), which
        the kernels update in place. ``silu_mul``: x is the gate/up output [T, 2 in] and the
        delta is taken of silu(gate) * up (only where ``uses_kernels``: the shrink computes
        it on the fly)."""
        t = x.shape[0]
        if t > self.state.max_tokens:
            raise RuntimeError(f"a LoRA step of {t} tokens, more than the slot map's "
                               f"{self.state.max_tokens}")
        slots = self.state.token_slots[:t]
        if self.uses_kernels(x, y):
            from flashpage.kernels.lora import lora_expand, lora_shrink

            if x.stride(1) != 1:
                x = x.contiguous()
            xa = lora_shrink(x, self.a, slots, self.cols, silu_mul=silu_mul)
            return lora_expand(xa, self.b, slots, self.cols, y)
        if silu_mul:
            raise ValueError("apply(silu_mul=True) needs the kernels (uses_kernels)")
        xa = F.linear(x, self.a) * (slots[:, None] == self.col_slot[None, :]).to(x.dtype)
        return torch.addmm(y, xa, self.b.t())


def _use_kernels(mode: bool | None, device: torch.device) -> bool:
    """FLASHPAGE_LORA_KERNELS: None (auto) on CUDA; True on the CPU too where Triton's
    interpreter runs (tests: Triton is optional there); False never."""
    if mode is False or device.type not in ("cuda", "cpu"):
        return False
    if device.type == "cuda":
        return True
    if not mode or os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def lora_delta_ref(x: torch.Tensor, token_slots: list[int],
                   slot_pieces: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]],
                   slices: list[tuple[int, int]], out_features: int) -> torch.Tensor:
    """``LoRALinear.apply(x, 0)``'s reference, one token at a time in fp32: token t's
    delta is, for each slice j of its slot's adapter, B_j (A_j x_t) at that slice's rows."""
    out = torch.zeros(x.shape[0], out_features, dtype=torch.float32)
    for t, s in enumerate(token_slots):
        for j, (a, b) in slot_pieces.get(s, {}).items():
            off, rows = slices[j]
            out[t, off:off + rows] = b.float() @ (a.float() @ x[t].float())
    return out
