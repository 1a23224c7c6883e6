"""AWQ and GPTQ 4-bit tensors, to and from our one int4 layout (kernels/int4_gemm.py:
qweight int32 [N, K/8] packed along K, scales [N, K/G], zeros uint8 [N, K/G]).

Both formats keep a linear's weight transposed ([in = K, out = N]), 8 nibbles to an int32
word, with scales [K/G, N] (fp16) and zero points packed like the weights:

    AWQ (AutoAWQ, version "gemm")
      qweight  int32 [K, N/8]    8 output columns per word, in AWQ's interleaved order:
                                 nibble i (bits 4i..4i+3) holds column 8c + AWQ_ORDER[i]
      qzeros   int32 [K/G, N/8]  packed as qweight
      scales   fp16  [K/G, N]    w = (q - z) * s
    GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq", desc_act false)
      qweight  int32 [K/8, N]    8 input rows per word: nibble j of word r holds k = 8r + j
      qzeros   int32 [K/G, N/8]  8 output columns per word, plain order, each stored as z - 1
                                 (the format's historical off-by-one: read as stored + 1,
                                 so a stored 15 means 16, as the CUDA kernels read it)
      scales   fp16  [K/G, N]    w = (q - z) * s
      g_idx    int32 [K]         k // G (anything else is act-order: not read)

``quantize_int4`` is our own round-to-nearest group quantizer (min-max, asymmetric, or
symmetric around 8); ``awq_tensors`` / ``gptq_tensors`` write its result in the two
layouts (tests and benchmarks build checkpoints with them).
"""

from __future__ import annotations

import torch

from flashpage.kernels.int4_gemm import pack_int4, unpack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE = tuple(AWQ_ORDER.index(j) for j in range(8))  # column j sits in nibble ...


def _unpack_cols(packed: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """int32 [R, C/8] -> int32 [R, C]: nibble i of word c is column 8c + i (AWQ: 8c +
    AWQ_ORDER[i])."""
    q = unpack_int4(packed)
    if awq:
        q = q.reshape(packed.shape[0], -1, 8)[..., list(AWQ_REVERSE)]
    return q.reshape(packed.shape[0], -1)


def _pack_cols(q: torch.Tensor, awq: bool = False) -> torch.Tensor:
    """The inverse of ``_unpack_cols``."""
    if awq:
        q = q.reshape(q.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(q.shape[0], -1)
    return pack_int4(q)


def _layout(q_kn: torch.Tensor, z: torch.Tensor, scales: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (pack_int4(q_kn.t().contiguous()), scales.t().contiguous(),
            z.t().contiguous().to(torch.uint8))


def awq_to_layout(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ's (qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]) -> ours."""
    return _layout(_unpack_cols(qweight, awq=True), _unpack_cols(qzeros, awq=True), scales)


def gptq_to_layout(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's (qweight [K/8, N], qzeros [K/G, N/8], scales [K/G, N]) -> ours."""
    q = unpack_int4(qweight.t().contiguous()).t()  # [K, N]: word r's nibble j is row 8r + j
    return _layout(q, _unpack_cols(qzeros) + 1, scales)


def quantize_int4(w: torch.Tensor, group_size: int | None, symmetric: bool = False,
                  scale_dtype: torch.dtype = torch.float16,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int32 [N, K] in 0..15, scales [N, K/G] ``scale_dtype``, zeros uint8
    [N, K/G]) with w ~ (q - z) * s per group of ``group_size`` along K (None: the row).
    Asymmetric: s = (max - min) / 15 over the group (with 0 inside the range), z =
    round(-min / s) kept in 1..15 (so GPTQ's stored z - 1 never wraps); symmetric: z = 8,
    s = amax / 7. q = clamp(round(w / s) + z, 0, 15) with s as stored."""
    n, k = w.shape
    g = group_size or k
    if k % g or g % 8:
        raise ValueError(f"K={k} is not a multiple of the group size {g} (itself a multiple of 8)")
    wg = w.float().reshape(n, k // g, g)
    if symmetric:
        s = (wg.abs().amax(-1) / 7).clamp(min=1e-8).to(scale_dtype).float()
        z = torch.full_like(s, 8)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype).float()
        z = torch.round(-lo / s).clamp(1, 15)
    q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, 15)
    return q.reshape(n, k).to(torch.int32), s.to(scale_dtype), z.to(torch.uint8)


def awq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                ) -> dict[str, torch.Tensor]:
    """``quantize_int4``'s result (q [N, K], scales / zeros [N, K/G]) as AWQ stores it."""
    return {"qweight": _pack_cols(q.t().contiguous(), awq=True),
            "qzeros": _pack_cols(zeros.t().contiguous().to(torch.int32), awq=True),
            "scales": scales.t().contiguous()}


def gptq_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 ) -> dict[str, torch.Tensor]:
    """... and as GPTQ stores it (zeros as z - 1, g_idx k // G)."""
    k, g = q.shape[1], q.shape[1] // scales.shape[1]
    return {"qweight": pack_int4(q).t().contiguous(),
            "qzeros": _pack_cols((zeros.t().to(torch.int32) - 1) & 0xF),
            "scales": scales.t().contiguous(),
            "g_idx": torch.arange(k, dtype=torch.int32) // g}
