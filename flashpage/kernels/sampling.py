"""Sampling from softmax(x / T) in one pass over the logits: the Gumbel-max trick.

    token = argmax_i (x_i / T + G_i),   G_i = -log(E_i),  E_i ~ Exp(1) independent

is an exact sample of softmax(x / T): it is the exponential race argmax_i p_i / E_i in log
space, so it needs no softmax, no normalisation and no sort. Each row's logits are read
once (any float dtype, as the model gives them), the noise is made in registers from
Philox, and each program keeps a running (max, index) per lane. A row is split over
several programs (chunks of the vocabulary) so that one row of a 128k vocabulary still
spreads over the GPU; a second, tiny kernel takes the best of each row's chunks.

Rows with temperature <= 0 take the plain argmax of their logits (no noise). Ties go to
the first index, as ``torch.argmax``. NaN logits are never chosen.

**The noise of a row** depends only on its Philox key (``seeds[r]``, 64 bits), its
counter word (``positions[r]``) and ``n_rounds``, never on the batch, the chunking or the
launch shape: vocabulary entry ``i`` takes 32-bit word ``j`` of

    philox(key, counter = (g * W + q, position, 0, 0)),  g = i // 4W, j = (i // W) % 4, q = i % W

with ``W = NOISE_WIDTH``: one Philox call gives four words, used by four entries W apart,
so a program loads four contiguous W-wide pieces and no value changes lanes.
``gumbel_noise_ref`` computes the same noise in torch (to rounding of the logs).

**From 32 random bits r to noise.** U = (r + 1/2) / 2^32 lies in (0, 1), never 0 or 1;
E2 = -log2(U), except near U = 1 (v = 1 - U < 1/16, v computed exactly from r ^ ~0),
where log2(U) would lose its digits and E2 is the series of -log2(1 - v). The noise is
G2 = -log2(E2) = log2(e) * G + log2(ln 2): Gumbel noise in base-2 units, so the scores
are log2(e) * (x / T + G) minus a constant, same argmax, and each log is one MUFU
instruction on the GPU (``lg2.approx``, absolute error < 2^-22; libdevice's logf was ~20
instructions). The largest noise, from the smallest E2 (2^-33 log2 e), is 32.5; the
plain -log(-log(U)) in fp32 rounds U to 1 about once in 2^25 draws, and that token
would win whatever its logit.

**The scores** are ``x * (log2(e) / T) + G2`` in fp32, the factor rounded once (IEEE
division), the product and the sum each rounded (no fused multiply-add), so torch given
the same noise (``noise_out``) computes the very same scores: ``sample_gumbel_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

NOISE_WIDTH = 256  # W above: part of the noise's definition, not a tuning knob
_GROUP = 4 * NOISE_WIDTH
LOG2E = 1.4426950408889634
# Compile options on CUDA: no contraction of x * scale + G into an fma, so torch given the
# same noise computes the same scores (the noise's own fmas are explicit).
CUDA_OPTIONS = {"enable_fp_fusion": False}


@dataclass(frozen=True)
class SamplingConfig:
    """Launch shape of ``sample_gumbel``: the tokens never depend on it, except through
    n_rounds, which is part of the noise's definition (the engine keeps the default).

    programs_per_sm: the vocabulary of each row is cut into chunks so that about this
    many programs per SM run in all (no more chunks than groups of 4W entries);
    groups_per_chunk fixes the chunk size instead (tests: many chunks at small vocab).
    """

    # H200 run 33 (benchmarks/sampler.py): 16 programs of 8 warps per SM read 128k-token
    # bf16 rows in 73 us at batch 256 and 14.4 us at 32 (4 of 4 warps: 85 and 16.6)
    programs_per_sm: int = 16
    num_warps: int = 8
    n_rounds: int = 10  # Philox rounds (Philox4x32-10, as cuRAND and tl.rand)
    groups_per_chunk: int | None = None


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    if FAST_LOG:  # one MUFU instruction (lg2.approx, absolute error < 2^-22) instead of ~20
        return libdevice.fast_log2f(x)
    else:  # the interpreter has no fast_log2f
        return tl.log2(x)


@triton.jit
def _gumbel2(r, FAST_LOG: tl.constexpr):
    """r uint32 [W] -> Gumbel noise in base-2 units, G2 = -log2(-log2(U)) fp32 [W]."""
    # (r + 1/2) 2^-32 as one fma: the same rounding as the sum, scaling by 2^-32 is exact.
    u = tl.fma(r.to(tl.float32), 2.3283064365386963e-10, 1.1641532182693481e-10)
    v = tl.fma((r ^ 0xFFFFFFFF).to(tl.float32), 2.3283064365386963e-10, 1.1641532182693481e-10)
    # -log2(1 - v) = log2(e) (v + v^2/2 + ...): six terms leave < 2^-24 relative for
    # v < 1/16. Explicit fmas: the kernel is compiled without contraction (see scores).
    series = tl.fma(v, 0.24044917348149389, 0.28853900817779266)
    series = tl.fma(series, v, 0.36067376022224085)
    series = tl.fma(series, v, 0.48089834696298783)
    series = tl.fma(series, v, 0.7213475204444817)
    series = tl.fma(series, v, 1.4426950408889634)
    e2 = tl.where(v < 0.0625, series * v, -_log2(u, FAST_LOG))
    return -_log2(e2, FAST_LOG)


@triton.jit
def _piece(row_ptr, noise_row_ptr, idx, vocab, scale, r, best, best_i,
           SAMPLE: tl.constexpr, WRITE_NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
    """One W-wide piece: scores of entries idx [W], folded into each lane's (best, index).
    Lanes see their entries in increasing order, so a strict > keeps the first index."""
    mask = idx < vocab
    x = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32)
    if SAMPLE:
        g = _gumbel2(r, FAST_LOG)
        if WRITE_NOISE:
            tl.store(noise_row_ptr + idx, g, mask=mask)
        s = x * scale + g
    else:
        s = x
    take = s > best
    return tl.where(take, s, best), tl.where(take, idx, best_i)


@triton.jit
def _scan_chunk(row_ptr, noise_row_ptr, vocab, g0, g1, scale, key, pos,
                W: tl.constexpr, N_ROUNDS: tl.constexpr, SAMPLE: tl.constexpr,
                WRITE_NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
    """Groups [g0, g1) of one row -> (max score, its first index)."""
    q = tl.arange(0, W)
    best = tl.full([W], float("-inf"), tl.float32)
    best_i = g0 * 4 * W + q  # an all -inf chunk answers its first entry, as argmax does
    for g in range(g0, g1):
        base = g * 4 * W
        if SAMPLE:
            ctr = (g * W + q).to(tl.uint32)
            zero = ctr * 0
            r0, r1, r2, r3 = tl.philox(key, ctr, zero + pos, zero, zero, N_ROUNDS)
        else:
            r0, r1, r2, r3 = q, q, q, q  # unused
        best, best_i = _piece(row_ptr, noise_row_ptr, base + q, vocab, scale, r0, best,
                              best_i, SAMPLE, WRITE_NOISE, FAST_LOG)
        best, best_i = _piece(row_ptr, noise_row_ptr, base + W + q, vocab, scale, r1, best,
                              best_i, SAMPLE, WRITE_NOISE, FAST_LOG)
        best, best_i = _piece(row_ptr, noise_row_ptr, base + 2 * W + q, vocab, scale, r2,
                              best, best_i, SAMPLE, WRITE_NOISE, FAST_LOG)
        best, best_i = _piece(row_ptr, noise_row_ptr, base + 3 * W + q, vocab, scale, r3,
                              best, best_i, SAMPLE, WRITE_NOISE, FAST_LOG)
    m = tl.max(best, axis=0)
    return m, tl.min(tl.where(best == m, best_i, 2147483647), axis=0)


@triton.jit(do_not_specialize=["n_groups", "groups_per_chunk", "num_chunks"])
def _gumbel_max_partials(logits_ptr, stride_row, vocab, temps_ptr, seeds_ptr, pos_ptr,
                         part_val_ptr, part_idx_ptr, noise_ptr, stride_noise,
                         n_groups, groups_per_chunk, num_chunks,
                         W: tl.constexpr, N_ROUNDS: tl.constexpr, HAS_POS: tl.constexpr,
                         WRITE_NOISE: tl.constexpr, FAST_LOG: tl.constexpr):
    """grid (rows, chunks): the (max score, first index) of one chunk of one row."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    g0 = chunk * groups_per_chunk
    g1 = tl.minimum(g0 + groups_per_chunk, n_groups)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    noise_row_ptr = noise_ptr + row.to(tl.int64) * stride_noise
    t = tl.load(temps_ptr + row)
    key = tl.load(seeds_ptr + row)
    if HAS_POS:
        pos = tl.load(pos_ptr + row).to(tl.uint32)
    else:
        pos = tl.full((), 0, tl.uint32)
    if t > 0.0:
        scale = tl.math.div_rn(1.4426950408889634, t)  # log2(e) / T, rounded once
        m, i = _scan_chunk(row_ptr, noise_row_ptr, vocab, g0, g1, scale, key, pos,
                           W, N_ROUNDS, True, WRITE_NOISE, FAST_LOG)
    else:
        m, i = _scan_chunk(row_ptr, noise_row_ptr, vocab, g0, g1, 1.0, key, pos,
                           W, N_ROUNDS, False, False, FAST_LOG)
    tl.store(part_val_ptr + row * num_chunks + chunk, m)
    tl.store(part_idx_ptr + row * num_chunks + chunk, i)


@triton.jit(do_not_specialize=["num_chunks"])
def _merge_chunks(part_val_ptr, part_idx_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    """grid (rows,): the best of a row's chunks; equal maxima -> the first index (chunks
    are in vocabulary order)."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    mask = c < num_chunks
    v = tl.load(part_val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    i = tl.load(part_idx_ptr + row * num_chunks + c, mask=mask, other=2147483647)
    m = tl.max(v, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(v == m, i, 2147483647), axis=0).to(tl.int64))


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a few chunks per row, to exercise the merge
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def chunking(n: int, vocab: int, device: torch.device,
             config: SamplingConfig = SamplingConfig()) -> tuple[int, int]:
    """(groups per chunk, chunks per row) for n rows of ``vocab`` entries."""
    n_groups = triton.cdiv(vocab, _GROUP)
    per_chunk = config.groups_per_chunk
    if per_chunk is None:
        chunks = max(1, triton.cdiv(config.programs_per_sm * _num_sms(device), max(n, 1)))
        per_chunk = triton.cdiv(n_groups, min(chunks, n_groups))
    return per_chunk, triton.cdiv(n_groups, per_chunk)


def sample_gumbel(logits: torch.Tensor, vocab: int, temperatures: torch.Tensor,
                  seeds: torch.Tensor, positions: torch.Tensor | None = None, *,
                  noise_out: torch.Tensor | None = None,
                  config: SamplingConfig = SamplingConfig()) -> torch.Tensor:
    """One token per row, sampled from softmax(logits[r, :vocab] / temperatures[r]).

    logits [n, >=vocab] (any float dtype, unit stride along the vocabulary; entries past
    ``vocab`` are never read); temperatures fp32 [n] (<= 0: plain argmax); seeds int64
    [n] (each row's Philox key); positions int64 [n] (the counter word beside it, below
    2^32; None: 0) -> int64 [n]. noise_out fp32 [n, vocab], contiguous: receives each
    sampled row's noise G2 (rows with temperature <= 0 are left as they were), for
    tests. Two launches, no host sync, no allocation that depends on values: capturable.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor, got {logits.dtype} {tuple(logits.shape)}")
    n = logits.shape[0]
    if not 0 < vocab <= logits.shape[1]:
        raise ValueError(f"vocab must be in [1, {logits.shape[1]}], got {vocab}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    for name, t, dtype in (("temperatures", temperatures, torch.float32),
                           ("seeds", seeds, torch.int64), ("positions", positions, torch.int64)):
        if t is not None and (t.shape != (n,) or t.dtype != dtype or t.device != dev):
            raise ValueError(f"{name} must be {dtype} [{n}] on {dev}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if noise_out is not None and (noise_out.shape != (n, vocab) or noise_out.dtype != torch.float32
                                  or not noise_out.is_contiguous() or noise_out.device != dev):
        raise ValueError(f"noise_out must be contiguous float32 [{n}, {vocab}] on {dev}")
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    per_chunk, chunks = chunking(n, vocab, dev, config)
    part_val = torch.empty((n, chunks), dtype=torch.float32, device=dev)
    part_idx = torch.empty((n, chunks), dtype=torch.int32, device=dev)
    noise = noise_out if noise_out is not None else part_val  # not written without noise_out
    cuda = dev.type == "cuda"
    _gumbel_max_partials[(n, chunks)](
        logits, logits.stride(0), vocab, temperatures, seeds,
        positions if positions is not None else seeds, part_val, part_idx,
        noise, vocab, triton.cdiv(vocab, _GROUP), per_chunk, chunks,
        W=NOISE_WIDTH, N_ROUNDS=config.n_rounds, HAS_POS=positions is not None,
        WRITE_NOISE=noise_out is not None, FAST_LOG=cuda, num_warps=config.num_warps,
        **(CUDA_OPTIONS if cuda else {}))
    # One BLOCK_C for every batch up to 256 chunks (a 262k vocabulary): no compile per size.
    _merge_chunks[(n,)](part_val, part_idx, out, chunks,
                        BLOCK_C=max(triton.next_power_of_2(chunks), 256), num_warps=1)
    return out


def sample_gumbel_ref(logits: torch.Tensor, vocab: int, temperatures: torch.Tensor,
                      noise: torch.Tensor) -> torch.Tensor:
    """What ``sample_gumbel`` computes, given its noise (fp32 [n, vocab], ``noise_out``):
    argmax(x * (log2(e) / T) + G2) for rows with T > 0, argmax(x) for the others -> int64 [n]."""
    x = logits[:, :vocab].float()
    t = temperatures.float()[:, None]
    scale = torch.tensor(LOG2E, dtype=torch.float32, device=x.device) / t
    return torch.where(t > 0, x * scale + noise, x).argmax(dim=-1)


_M32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b) >> 32 and (a * b) mod 2^32 for a constant a < 2^32 and b [..] int64 in
    [0, 2^32), without int64 overflow (a split in 16-bit halves)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    hi_part, lo_part = a_hi * b, a_lo * b  # < 2^48 each
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & _M32
    return hi, lo


def philox_ref(seeds: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor,
               c2: torch.Tensor | None = None, c3: torch.Tensor | None = None,
               n_rounds: int = 10) -> list[torch.Tensor]:
    """Philox4x32 in torch, as ``tl.philox`` computes it: key seeds [n] int64 (low word
    first), counter words c0 [n, m] and c1, c2, c3 broadcastable to it (None: 0), values
    in [0, 2^32) -> the four int64 words [n, m]."""
    k0 = (seeds & _M32)[:, None]
    k1 = ((seeds >> 32) & _M32)[:, None]
    zero = torch.zeros_like(c0)
    x0, x1 = c0, c1.expand_as(c0)
    x2 = zero if c2 is None else c2.expand_as(c0)
    x3 = zero if c3 is None else c3.expand_as(c0)
    for _ in range(n_rounds):
        hi_b, lo_b = _mulhilo(0xCD9E8D57, x2)
        hi_a, lo_a = _mulhilo(0xD2511F53, x0)
        x0, x1, x2, x3 = hi_b ^ x1 ^ k0, lo_b, hi_a ^ x3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return [x0, x1, x2, x3]


def gumbel_noise_ref(seeds: torch.Tensor, positions: torch.Tensor | None, vocab: int,
                     n_rounds: int = 10) -> torch.Tensor:
    """The noise G2 of ``sample_gumbel`` (module docstring) in torch -> fp32 [n, vocab];
    equal to the kernel's up to the rounding of its logs."""
    n, w = seeds.shape[0], NOISE_WIDTH
    i = torch.arange(vocab, device=seeds.device)
    g, j, q = i // (4 * w), (i // w) % 4, i % w
    ctr = (g * w + q)[None, :].expand(n, vocab)
    pos = positions if positions is not None else torch.zeros_like(seeds)
    words = philox_ref(seeds, ctr, (pos & _M32)[:, None], n_rounds=n_rounds)
    r = torch.stack(words).gather(0, j[None, None, :].expand(1, n, vocab))[0]
    two_m32 = 2.0**-32
    u = (r.float() + 0.5) * two_m32
    v = ((r ^ _M32).float() + 0.5) * two_m32
    coef = [LOG2E / k for k in range(1, 7)]
    series = torch.full_like(v, coef[-1])
    for c in reversed(coef[:-1]):
        series = series * v + c
    e2 = torch.where(v < 0.0625, series * v, -torch.log2(u))
    return -torch.log2(e2)
