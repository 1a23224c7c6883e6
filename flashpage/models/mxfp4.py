"""MXFP4 checkpoints (OCP microscaling FP4; GPT-OSS's released experts): read by
dequantizing to the model dtype at load.

A weight ``W`` of shape [*prefix, K] is stored as two tensors::

    W_blocks  uint8 [*prefix, K / 32, 16]   two FP4 (e2m1) values a byte: the low nibble
                                            is the even element, the high nibble the odd one
    W_scales  uint8 [*prefix, K / 32]       one power-of-two scale per 32 values (e8m0):
                                            2 ** (scale - 127)

An e2m1 nibble is a sign bit over 3 magnitude bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
GPT-OSS's experts hold ``gate_up_proj`` [E, hidden, 2I] and ``down_proj`` [E, I, hidden]
(transformers' layout, x @ W) but store them transposed, quantized along the input dim:
``gate_up_proj_blocks`` [E, 2I, hidden / 32, 16], ``down_proj_blocks`` [E, hidden, I / 32,
16]; ``mxfp4_weights`` gives them back in transformers' layout (views of the dequantized
tensors; models/gpt_oss.py then takes them to its own), under the names without the
suffix. ``quantize_mxfp4`` writes the format (round to the nearest e2m1 value after a
power-of-two scale that keeps each block's largest magnitude within 6): the tests' way of
making such a checkpoint from a tiny model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# e2m1 by nibble: bit 3 the sign, bits 0-2 the magnitude
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32,
                     lut: torch.Tensor | None = None) -> torch.Tensor:
    """blocks uint8 [*prefix, G, 16], scales uint8 [*prefix, G] -> [*prefix, G * 32] in
    ``dtype``, one leading slice at a time (the fp32 intermediate of a whole released
    expert tensor would be gigabytes). Each value is the e2m1 value times 2 ** (scale -
    127) in fp32 (exact: an fp32 subnormal at scale 0, inf at 255 for a nonzero value),
    rounded once to ``dtype``. ``lut``: FP4_VALUES already on blocks' device (a module's
    buffer: no host-to-device copy, so a CUDA graph may capture the call)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do "
                         f"not fit: blocks [..., G, {BLOCK // 2}] with scales [..., G] expected")
    lut = (torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device) if lut is None
           else lut.to(torch.float32))
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * BLOCK, dtype=dtype, device=blocks.device)
    flat_b = blocks.reshape(-1, *blocks.shape[-2:]) if blocks.dim() > 2 else blocks[None]
    flat_s = scales.reshape(-1, scales.shape[-1]) if scales.dim() > 1 else scales[None]
    flat_o = out.view(-1, out.shape[-1]) if out.dim() > 1 else out[None]
    rows = max(1, (1 << 22) // max(1, flat_b.shape[1] * BLOCK))  # ~16 MB of fp32 a slice
    for r0 in range(0, flat_b.shape[0], rows):
        b = flat_b[r0:r0 + rows].long()
        vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [r, G, 32]
        # 2 ** (s - 127) built from its bits (s = 0: the subnormal 1 << 22; 255: inf), not
        # exp2: CUDA's exp2 is a few ulps off among fp32 subnormals (run 190)
        s = flat_s[r0:r0 + rows].int()
        scale = torch.where(s == 0, 1 << 22, s << 23).view(torch.float32)[..., None]
        flat_o[r0:r0 + rows] = (vals * scale).flatten(-2).to(dtype)
    return out


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[*prefix, K] (K a multiple of 32) -> (blocks uint8 [*prefix, K / 32, 16], scales uint8
    [*prefix, K / 32]): per block the scale 2 ** ceil(log2(max |w| / 6)), then each value
    rounded to the nearest e2m1 value (ties to the smaller index)."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"the last dim ({w.shape[-1]}) must be a multiple of {BLOCK}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)
    amax = x.abs().amax(-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = x / torch.exp2(exp)[..., None]
    mags = torch.tensor(FP4_VALUES[:8])
    idx = (scaled.abs()[..., None] - mags).abs().argmin(-1)  # nearest magnitude
    idx = idx | ((scaled < 0).long() << 3)
    nib = idx.to(torch.uint8)
    blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def mxfp4_weights(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                  enabled: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs with each ``X_blocks`` / ``X_scales`` pair of an
    MXFP4 one replaced by ``X`` dequantized to ``dtype`` and transposed to [E, in, out]
    (GPT-OSS's x @ W layout, as a view: no copy); other tensors pass as they are. ``enabled``: the config says
    MXFP4 (quantization_config); a block tensor otherwise, or a half pair, is a ValueError."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, t
            continue
        base = name.removesuffix(suffix)
        if not enabled:
            raise ValueError(f"checkpoint tensor {name!r} is MXFP4 but config.json has no "
                             "quantization_config with quant_method 'mxfp4'")
        pair = pending.setdefault(base, {})
        pair[suffix] = t
        if len(pair) == 2:
            del pending[base]
            w = dequantize_mxfp4(pair["_blocks"], pair["_scales"], dtype)
            # a view: GPT-OSS's loader turns it back to [E, out, in] (models/gpt_oss.py)
            yield base, w.transpose(-1, -2) if w.dim() == 3 else w
    if pending:
        halves = ", ".join(f"{b}{next(iter(p))}" for b, p in sorted(pending.items()))
        raise ValueError(f"MXFP4 tensors without their other half (blocks / scales): {halves}")
