"""attention/bidirectional.py's batched path (every image run of a step in one masked SDPA
call) against the run-by-run fp32 reference (torch_native.masked_attention under
image_mask): runs of different lengths, partial runs (a prefix hit inside an image), runs
not at a block boundary, GQA, a sliding window and none, shuffled block tables."""
from __future__ import annotations

import pytest
import torch

from flashpage.attention.backend import AttentionMetadata
from flashpage.attention.bidirectional import attend_within_images, image_mask
from flashpage.attention.torch_native import gather_paged, masked_attention


def _md(runs, seq_lens, tables) -> AttentionMetadata:
    n = len(seq_lens)
    z = torch.zeros(n, dtype=torch.int32)
    return AttentionMetadata(0, n, z, torch.tensor(seq_lens), tables, torch.zeros(0, dtype=torch.long),
                             0, max(seq_lens), 0, 0, seq_lens_cpu=list(seq_lens), bidirectional=runs)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_batched_equals_run_by_run(window, hq, hkv):
    g = torch.Generator().manual_seed(0)
    bs, d, blocks = 4, 16, 64
    kc = torch.randn(blocks, bs, hkv, d, generator=g)
    vc = torch.randn(blocks, bs, hkv, d, generator=g)
    tables = torch.randperm(blocks, generator=g)[:3 * 20].view(3, 20).int()
    # (request, first row in the step, rows, first position, image start, image end)
    runs = [(0, 0, 12, 7, 7, 19),     # a whole image after 7 text tokens
            (1, 12, 5, 30, 25, 35),   # the last 5 rows of an image whose start was a prefix hit
            (2, 17, 9, 2, 2, 11),     # another request's image, shorter
            (2, 30, 6, 50, 50, 56)]   # its second image, later in the step
    seq_lens = [19, 35, 56]
    n = 36
    q = torch.randn(n, hq, d, generator=g)
    out = torch.randn(n, hq, d, generator=g)
    want = out.clone()
    for seq, row, rows, pos, lo, hi in runs:
        k_lo = 0 if window is None else max(0, pos - window + 1)
        kk = gather_paged(kc, tables[seq], hi)[k_lo:]
        vv = gather_paged(vc, tables[seq], hi)[k_lo:]
        mask = image_mask(pos, rows, k_lo, hi, lo, hi, window, q.device)
        want[row:row + rows] = masked_attention(q[row:row + rows].transpose(0, 1), kk.transpose(0, 1),
                                                vv.transpose(0, 1), mask, 0.25, None).transpose(0, 1)
    md = _md(runs, seq_lens, tables)
    attend_within_images(out, q, (kc, vc), md, scale=0.25, sliding_window=window, softcap=None)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert f"bidirectional:{window}" in md.extra  # planned once for the step's layers
    # rows outside the runs keep the backend's output
    untouched = torch.ones(n, dtype=torch.bool)
    for _, row, rows, *_ in runs:
        untouched[row:row + rows] = False
    assert untouched.any()
    again = out.clone()
    attend_within_images(again, q, (kc, vc), md, scale=0.25, sliding_window=window, softcap=None)
    torch.testing.assert_close(again, out)


def test_an_image_past_the_context_is_refused():
    kc = torch.zeros(8, 4, 1, 8)
    md = _md([(0, 0, 4, 0, 0, 4)], [3], torch.arange(8).view(1, 8).int())
    with pytest.raises(RuntimeError, match="must not cut it"):
        attend_within_images(torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), (kc, kc), md, scale=1.0,
                             sliding_window=None, softcap=None)
