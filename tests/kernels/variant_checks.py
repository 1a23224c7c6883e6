"""The kernel checks the attention-variant tests share (test_alibi_kernels, test_attention_sinks,
test_chunked_attention): a variant is one more keyword to our kernels and to their references
(``alibi_slopes``, ``sinks``, ``chunk_size``). Each check runs our kernel with it against the
reference with it, and asserts the reference without it differs: the check could fail."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton is imported by the kernel modules
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_flash_prefill import _close, _ragged, _to_paged  # noqa: E402  (tests/kernels)
from test_paged_decode import check, make_case  # noqa: E402

from flashpage.kernels.flash_prefill import (  # noqa: E402
    flash_attn_varlen,
    paged_prefill,
    paged_prefill_ref,
)
from flashpage.kernels.paged_decode import _launch, paged_decode_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_decode_variant(seq_lens, hq, hkv, d, block_size, dtype, *, splits, config, window=None,
                         seed=0, **variant) -> None:
    """paged decode (``_launch``: an explicit split count and config) with ``variant``
    against paged_decode_ref with it; every output element must be written."""
    q, kc, vc, bt, lens = make_case(seq_lens, hq, hkv, d, block_size, dtype, seed=seed, device=DEV)
    out = torch.full_like(q, float("nan"))
    _launch(q, kc, vc, bt, lens, sm_scale=None, out=out, num_splits=splits, window_size=window,
            config=config, **variant)
    ref = paged_decode_ref(q, kc, vc, bt, lens, window_size=window, **variant)
    check(out, ref, dtype)
    assert rel(paged_decode_ref(q, kc, vc, bt, lens, window_size=window), ref) > 0.05


def check_prefill_variant(q_lens, prefixes, hq, hkv, d, dtype, block_size, *, seed, window=None,
                          cfg=None, **variant) -> None:
    """paged_prefill and flash_attn_varlen with ``variant`` against the reference, output and
    lse: queries after cached prefixes (chunked prefill, prefix hits) sit at positions
    prefix + i; every output row must be written."""
    q, k, v, cq, ck, mq, mk = _ragged(q_lens, prefixes, hq, hkv, d, dtype, seed=seed)
    kc, vc, tables, seq_lens = _to_paged(k, v, ck, block_size)
    kw = dict(window_size=window, return_lse=True, **variant)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    out = q.new_full(q.shape, float("nan"))
    out, lse = paged_prefill(q, kc, vc, tables, cq, seq_lens, mq, mk, out=out, _config=cfg, **kw)
    ref, ref_lse = paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk, **kw)
    _close(out, ref, dtype)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=1e-4)
    flat, flat_lse = flash_attn_varlen(q, k, v, cq, ck, mq, mk, _config=cfg, **kw)
    _close(flat, ref, dtype)
    torch.testing.assert_close(flat_lse, ref_lse, atol=tol, rtol=1e-4)
    plain = paged_prefill_ref(q, kc, vc, tables, cq, seq_lens, mq, mk, window_size=window)
    assert rel(plain, ref) > 0.05
