"""Prompts given as input embeddings (vLLM's EmbedsPrompt, ``enable_prompt_embeds``).

A request whose prompt is a float tensor ``[num_tokens, width]`` (width: what the model's
token embedding gives, ``hidden_size``, or OPT's ``word_embed_proj_dim``) has no prompt
token ids. The engine gives it placeholder ids (``EMBEDS_PLACEHOLDER_ID``, 0, as vLLM; never
``sequence.PLACEHOLDER``, which means "a token still being sampled") so that every count
the scheduler and the KV cache manager keep (``num_tokens``, ``num_computed_tokens``,
blocks) is the usual one; the request keeps the tensor on the host (``Request.
prompt_embeds``, in the model's dtype) and each step the model runner copies the rows of
the positions it schedules (``gather``): chunked prefill takes rows ``[start, end)``, a
preempted request recomputes from row 0 again. Rows past the prompt (generated tokens)
are ordinary tokens, looked up in the model's embedding table.

Prefix caching: a digest of the embeddings (``digest``: SHA-256 of dtype, shape and
bytes) is spliced into the request's block-hash chain at block 0 (``prefix_cache.chain``),
and the first block's parent content id carries the digest too, compared exactly. So two identical embeds
prompts share their blocks (the second hits), while an embeds prompt never shares a block
with a token prompt (even one whose ids embed to the same rows) nor with another embeds
prompt that differs anywhere, even in its later rows (the chain's root is the whole
tensor's digest: prefixes of embeds prompts are not shared).
"""

from __future__ import annotations

import hashlib

import torch

EMBEDS_PLACEHOLDER_ID = 0
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_prompt_embeds(embeds: object, width: int, max_model_len: int, dtype: torch.dtype,
                        *, enabled: bool, keep_last: int | None = None) -> torch.Tensor:
    """The request's embeddings as a contiguous CPU tensor in ``dtype`` (only the last
    ``keep_last`` rows: truncate_prompt_tokens); a ValueError naming what is wrong (not
    enabled, not a 2-D float tensor, empty, the wrong width, too long, not finite)."""
    if not enabled:
        raise ValueError("prompt_embeds given, but the engine was started without "
                         "enable_prompt_embeds (LLM(..., enable_prompt_embeds=True), "
                         "flashpage serve --enable-prompt-embeds)")
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor [num_tokens, {width}], "
                         f"got {type(embeds).__name__}")
    if embeds.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"prompt_embeds must be a floating-point tensor (float32, float16, "
                         f"bfloat16), got dtype {str(embeds.dtype).replace('torch.', '')}")
    if embeds.dim() != 2:
        raise ValueError(f"prompt_embeds must be 2-D [num_tokens, {width}], got "
                         f"{embeds.dim()}-D shape {tuple(embeds.shape)}")
    if embeds.shape[0] == 0:
        raise ValueError("prompt_embeds is empty (0 tokens)")
    if embeds.shape[1] != width:
        raise ValueError(f"prompt_embeds has hidden size {embeds.shape[1]}, but the model's "
                         f"input embeddings have hidden size {width}")
    if keep_last is not None and embeds.shape[0] > keep_last:
        embeds = embeds[-keep_last:]
    if embeds.shape[0] >= max_model_len:
        raise ValueError(f"prompt_embeds has {embeds.shape[0]} tokens but max_model_len is "
                         f"{max_model_len}: no room for any output token")
    out = embeds.detach().to("cpu", dtype).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise ValueError("prompt_embeds holds inf or NaN values (after conversion to "
                         f"{str(dtype).replace('torch.', '')})")
    return out


def digest(embeds: torch.Tensor) -> bytes:
    """32 bytes naming the tensor's exact contents (dtype, shape, bytes): the root of its
    request's prefix-cache chain."""
    # SHA-256: the CPU's SHA instructions make it ~1.8x blake2b's speed on an image's MBs
    # (3.3 -> 1.9 ms for 896 x 896 uint8 pixels, where Gemma 3's admission spent its time)
    h = hashlib.sha256()
    h.update(f"{embeds.dtype}:{tuple(embeds.shape)}".encode())
    x = embeds.contiguous()
    # the buffer itself, not a bytes copy of it (numpy has no bfloat16: its bytes as uint8)
    h.update((x.view(torch.uint8) if x.dtype == torch.bfloat16 else x).numpy().data)
    return h.digest()
