"""What the rotary encoder families (modernbert.py, nomic_bert.py) share: the unpadded view
of a padded batch (Ragged) and rotary embeddings over the first ``rotary_dim`` channels of
each head, in either layout:

    rotate-half (NeoX, ``interleaved`` False): channel i pairs with i + rotary_dim / 2
    interleaved (GPT-J, True):                 channel 2i pairs with 2i + 1

cos / sin are made in fp32 from the positions, and q / k rotated in fp32 (then cast back).
"""

from __future__ import annotations

import torch


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


class Ragged:
    """Where a padded batch's real tokens are, and the masks its attention needs (built once
    a forward, shared by every layer).

    idx    [N] int64  flat indices (b * T + t) of the real tokens, or None when there is
                      no padding (the flat view is then the batch itself)
    masks  per kind ("global", "local"): a bool mask SDPA broadcasts over heads, or None
    """

    def __init__(self, b: int, t: int, valid: torch.Tensor | None, window: int,
                 device: torch.device) -> None:
        self.b, self.t = b, t
        self.idx = None if valid is None else valid.reshape(-1).nonzero().squeeze(1)
        keys = None if valid is None else valid[:, None, None, :]  # [B, 1, 1, T]
        self.masks: dict[str, torch.Tensor | None] = {"global": keys, "local": keys}
        half = window // 2
        if window and t - 1 > half:  # some pair is further apart than the window
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
