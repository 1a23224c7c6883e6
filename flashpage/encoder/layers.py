"""What the rotary encoder families (modernbert.py, nomic_bert.py) share: the unpadded view
of a padded batch (Ragged) and rotary embeddings over the first ``rotary_dim`` channels of
each head, in either layout:

    rotate-half (NeoX, ``interleaved`` False): channel i pairs with i + rotary_dim / 2
    interleaved (GPT-J, True):                 channel 2i pairs with 2i + 1

cos / sin are made in fp32 from the positions, and q / k rotated in fp32 (then cast back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                   interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] -> cos, sin [N, rotary_dim] fp32, each frequency repeated as the layout
    pairs channels (halves repeated, or each one twice in a row)."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                       device=positions.device) / rotary_dim)
    freqs = positions.float()[:, None] * inv[None, :]
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x [N, heads, d]: its first rotary_dim channels (cos / sin [N, rotary_dim]) rotated,
    the rest passed through; returned in x's dtype."""
    xf = x.float()
    r = cos.shape[-1]
    xr = xf[..., :r]
    if interleaved:
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        rot = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), dim=-1)
    out = xr * cos[:, None] + rot * sin[:, None]
    if r < x.shape[-1]:
        out = torch.cat((out, xf[..., r:]), dim=-1)
    return out.to(x.dtype)


# A local layer's queries go in blocks of at least this many rows, each block against the
# keys its window reaches (block + 2 * half of them), once the sequence is long enough for
# that to beat one [T, T] band (T >= 2 * (block + 2 * half)).
LOCAL_BLOCK_MIN = 64


class Ragged:
    """A padded batch's real tokens, and its attention over them (what the mask needs is
    built once a forward, shared by every layer).

    idx     [N] int64  flat indices (b * T + t) of the real tokens, or None when there is
                       no padding (the flat view is then the batch itself)
    masks   "global": [B, 1, 1, T] key mask (None: no padding)
            "local":  [B, 1, T, T] band & keys, |q - k| <= half (None: every pair is
                      within the window and there is no padding)
    blocks  a long local layer's plan instead of its band: queries in nb blocks of
            ``block`` rows, block i against keys i * block - half .. (i + 1) * block + half
            (width = block + 2 * half), and its mask [B * nb, 1, block, width]::

                keys  |<- half ->|<------- block ------->|<- half ->|
                query rows r = 0 .. block - 1 see key slots j with 0 <= j - r <= 2 * half

    In every case attention costs O(T x width) or O(T^2) only where it must.
    """

    def __init__(self, b: int, t: int, valid: torch.Tensor | None, window: int,
                 device: torch.device) -> None:
        self.b, self.t = b, t
        self.idx = None if valid is None else valid.reshape(-1).nonzero().squeeze(1)
        keys = None if valid is None else valid[:, None, None, :]  # [B, 1, 1, T]
        self.masks: dict[str, torch.Tensor | None] = {"global": keys, "local": keys}
        self.half = half = window // 2
        self.block = max(LOCAL_BLOCK_MIN, 2 * half)
        self.blocks: torch.Tensor | None = None
        if not window or t - 1 <= half:  # every pair within the window: local is global
            return
        width = self.block + 2 * half
        if t >= 2 * width:
            nb = -(-t // self.block)
            real = torch.zeros(b, half + nb * self.block + half, dtype=torch.bool, device=device)
            real[:, half: half + t] = True if valid is None else valid
            slots = real.unfold(1, width, self.block)  # [B, nb, width]: key slot j is real
            r = torch.arange(self.block, device=device)[:, None]
            j = torch.arange(width, device=device)[None, :]
            band = (j - r >= 0) & (j - r <= 2 * half)  # [block, width]
            self.blocks = (band[None, None] & slots[:, :, None, :]).reshape(b * nb, 1, self.block, width)
            return
        pos = torch.arange(t, device=device)
        band = ((pos[:, None] - pos[None, :]).abs() <= half)[None, None]  # [1, 1, T, T]
        self.masks["local"] = band if keys is None else band & keys

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...], the real tokens in batch order."""
        x = x.reshape(self.b * self.t, *x.shape[2:])
        return x if self.idx is None else x.index_select(0, self.idx)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...], zeros where there is no token."""
        if self.idx is not None:
            out = x.new_zeros(self.b * self.t, *x.shape[1:])
            x = out.index_copy(0, self.idx, x)
        return x.view(self.b, self.t, *x.shape[1:])

    def attention(self, qkv: torch.Tensor, local: bool = False) -> torch.Tensor:
        """Bidirectional attention over each prompt's own tokens (a local layer's: those
        within the window): qkv [N, 3, heads, d] (q, k rotated) -> [N, heads * d]. SDPA's
        default scale, 1 / sqrt(d)."""
        n, _, heads, d = qkv.shape
        q, k, v = self.padded(qkv).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [B, heads, T, d]
        if local and self.blocks is not None:
            out = self._blocked(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.masks["local" if local else "global"])
        return self.flat(out.transpose(1, 2)).reshape(n, heads * d)

    def _blocked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A long local layer, block by block (class docstring): [B, heads, T, d] -> same."""
        assert self.blocks is not None
        b, heads, t, d = q.shape
        half, block = self.half, self.block
        nb = self.blocks.shape[0] // b
        width = block + 2 * half
        qb = F.pad(q, (0, 0, 0, nb * block - t)).view(b, heads, nb, block, d)
        qb = qb.transpose(1, 2).reshape(b * nb, heads, block, d)

        def windows(x: torch.Tensor) -> torch.Tensor:  # [B, heads, T, d] -> [B * nb, heads, width, d]
            x = F.pad(x, (0, 0, half, nb * block - t + half)).unfold(2, width, block)  # [B, h, nb, d, w]
            return x.permute(0, 2, 1, 4, 3).reshape(b * nb, heads, width, d)

        out = F.scaled_dot_product_attention(qb, windows(k), windows(v), attn_mask=self.blocks)
        out = out.view(b, nb, heads, block, d).transpose(1, 2).reshape(b, heads, nb * block, d)
        return out[:, :, :t]
