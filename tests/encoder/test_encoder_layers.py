"""What the rotary encoders share (flashpage/encoder/layers.py): Ragged's attention over a
padded batch's real tokens equals each prompt's own masked softmax, global and local
(|q - k| <= half), through the [T, T] band and through query blocks against the keys
their window reaches, for ragged lengths, windows wider and narrower than a block, and
sequences that do not fill their last block; rotary in both layouts, partial too."""

from __future__ import annotations

import math

import pytest
import torch

from flashpage.encoder import layers
from flashpage.encoder.layers import Ragged, apply_rotary, rotary_cos_sin


def _naive(qkv: torch.Tensor, half: int | None) -> torch.Tensor:
    """One prompt: qkv [T, 3, heads, d] -> [T, heads * d], float64 sums."""
    q, k, v = qkv.double().unbind(1)
    t, heads, d = q.shape
    out = torch.zeros(t, heads, d, dtype=torch.float64)
    for i in range(t):
        keys = [j for j in range(t) if half is None or abs(i - j) <= half]
        s = torch.einsum("hd,jhd->hj", q[i], k[keys]) / math.sqrt(d)
        out[i] = torch.einsum("hj,jhd->hd", s.softmax(-1), v[keys])
    return out.reshape(t, heads * d)


@pytest.mark.parametrize("lengths,window,block_min,path", [
    ([37, 20, 37, 5], 8, 4, "blocks"),  # T 37 >= 2 x (8 + 8); its last block part-filled
    ([40, 40], 8, 4, "blocks"),         # no padding
    ([50, 1, 16], 12, 2, "blocks"),     # block = window (12 > block_min), a 1-token prompt
    ([12, 7, 3], 8, 4, "band"),         # T 12 < 2 x width: one [T, T] band
    ([5, 4], 16, 4, "keys"),            # every pair within the window: the key mask alone
])
def test_attention_equals_each_prompt_alone(lengths, window, block_min, path, monkeypatch):
    monkeypatch.setattr(layers, "LOCAL_BLOCK_MIN", block_min)
    g = torch.Generator().manual_seed(sum(lengths) + window)
    b, t, heads, d = len(lengths), max(lengths), 3, 8
    valid = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    ragged = Ragged(b, t, None if min(lengths) == t else valid, window, torch.device("cpu"))
    half = window // 2
    assert (ragged.blocks is not None) == (path == "blocks")
    assert (ragged.masks["local"] is not None and ragged.masks["local"].shape[-2] == t) == (path == "band")
    qkv = torch.randn(sum(lengths), 3, heads, d, generator=g)
    starts = [sum(lengths[:i]) for i in range(b)]
    for local in (False, True):
        got = ragged.attention(qkv, local)
        assert got.shape == (sum(lengths), heads * d) and torch.isfinite(got).all()
        for s, n in zip(starts, lengths, strict=True):
            want = _naive(qkv[s: s + n], half if local else None)
            torch.testing.assert_close(got[s: s + n].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_rotary_turns_channel_pairs(interleaved, rotary_dim):
    """Each pair (i, i + r/2) or (2i, 2i + 1) of the first r channels turned by
    position x theta^(-2i/r) as a complex number; the rest untouched."""
    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([0, 1, 2, 7, 30])
    got = apply_rotary(x, *rotary_cos_sin(pos, rotary_dim, 100.0, interleaved), interleaved)
    want = x.clone()
    for n, p in enumerate(pos.tolist()):
        for i in range(rotary_dim // 2):
            a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + rotary_dim // 2)
            z = complex(1, 0) * torch.complex(x[n, :, a], x[n, :, c]) * complex(
                math.cos(p * 100.0 ** (-2 * i / rotary_dim)), math.sin(p * 100.0 ** (-2 * i / rotary_dim)))
            want[n, :, a], want[n, :, c] = z.real, z.imag
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
