"""The completions API's ``prompt_embeds`` (vLLM's): each item the base64 of a
``torch.save``d float tensor [num_tokens, hidden] (a leading batch axis of 1 is dropped),
read with ``torch.load(weights_only=True)``: no pickled code runs. Shape, dtype and size
against the model are the engine's checks (engine/prompt_embeds.py)."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch

from flashpage.server.protocol import APIError, bad_request

FIELD = "prompt_embeds"


def decode_prompt_embeds(raw: Any, max_prompts: int) -> list[torch.Tensor]:
    """The field (a string or a list of strings) -> its tensors; a 400 naming the field and
    the item for anything that is not base64 of a saved tensor."""
    items = [raw] if isinstance(raw, str) else list(raw)
    if not items:
        raise bad_request(f"{FIELD} is empty", FIELD)
    if len(items) > max_prompts:
        raise bad_request(f"at most {max_prompts} prompts per request, got {len(items)}", FIELD)
    return [_decode_one(item, i) for i, item in enumerate(items)]


def _decode_one(item: str, i: int) -> torch.Tensor:
    where = f"{FIELD}[{i}]"
    try:
        data = base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where} is not valid base64", FIELD) from None
    try:
        t = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # torch.load raises many kinds (pickle, zip, unpickler refusals)
        raise bad_request(f"{where} is not a torch.save'd tensor: {type(e).__name__}: "
                          f"{str(e)[:200]}", FIELD) from None
    if not isinstance(t, torch.Tensor):
        raise bad_request(f"{where} holds a {type(t).__name__}, not a tensor", FIELD)
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.dim() == 3 and t.shape[0] == 1:  # [1, tokens, hidden], as transformers' inputs_embeds
        t = t[0]
    return t


def check_embeds_request(echo: bool | None, beam: bool | None) -> None:
    """What the completions endpoint does not do with prompt_embeds: a 400 naming it."""
    if echo:
        raise bad_request("echo with prompt_embeds: there is no prompt text to echo", "echo")
    if beam:
        raise bad_request("use_beam_search with prompt_embeds is not supported", "use_beam_search")


__all__ = ["APIError", "FIELD", "check_embeds_request", "decode_prompt_embeds"]
