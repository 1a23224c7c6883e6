"""Multimodal rows: prompt positions whose input embeddings an encoder gives (an image's
``<image>`` positions), the rest of the prompt embedded as tokens.

A model that takes such inputs has an encoder beside it (LLaVA's: models/llava.py
LlavaImageEncoder) with two hooks, the whole of what the engine asks of a family:

- ``prepare(ids, multi_modal_data) -> (ids, [MultiModalInput])``, on the host at
  admission (add_request): checks and preprocesses the data, expands each placeholder
  token to its rows' count (the prompt's ids then say where each input's rows go);
- ``encode([data]) -> [rows]``, on the device: a batch of inputs to their rows
  ``[length, hidden]``.

The request keeps its inputs (``Request.mm_inputs``). The model runner encodes an input the
first time a step schedules one of its positions (all of a step's pending inputs in one
batch; an input whose positions all came from the prefix cache is never encoded), keeps its
rows on the request (on the device; the pixel data is dropped), and gives the model each
step's slice of them as InputEmbeds, spliced over the token embeddings as a prompt given as
embeddings is (engine/prompt_embeds.py). Chunked prefill takes any slice of an input's rows;
a preempted request keeps them and recomputes from position 0 without encoding again.

Prefix caching: a request's chain is rooted in ``chain_digest`` of its inputs (each
input's offset, length and data digest), as a prompt given as embeddings is rooted in its
embeddings' digest (kv_cache/prefix_cache.cache_root): blocks are shared only between
requests with the same inputs at the same positions, so no block holding one image's K/V
reaches a request with another. The choice costs the text before the first image: it is
shared only with requests of the same images, never with text-only ones (vLLM, which puts
each input's hash into the blocks it overlaps, shares it; kept simple here, the chain's
exact comparison unchanged).
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(eq=False)
class MultiModalInput:
    """One input's rows in a request's prompt: positions ``[offset, offset + length)``.
    ``data``: what the encoder takes (an image's pixel values [3, S, S] on the host), None
    once encoded; ``rows``: the encoder's output [length, hidden] on the device, kept for
    the request's life (preemption recomputes from it); ``digest``: the data's identity."""

    offset: int
    length: int
    digest: bytes
    data: torch.Tensor | None
    rows: torch.Tensor | None = None


class MultiModalEncoder(Protocol):
    def prepare(self, ids: list[int], data: Any) -> tuple[list[int], list[MultiModalInput]]: ...

    def encode(self, data: list[torch.Tensor]) -> list[torch.Tensor]: ...


def chain_digest(inputs: list[MultiModalInput]) -> bytes:
    """32 bytes naming a request's inputs where they sit: the root of its prefix-cache
    chain (module docstring)."""
    h = hashlib.blake2b(b"multimodal", digest_size=32)
    for mi in inputs:
        h.update(struct.pack("<qq", mi.offset, mi.length) + mi.digest)
    return h.digest()


def encode_pending(encoder: MultiModalEncoder, inputs: list[MultiModalInput]) -> None:
    """Encode ``inputs`` (not yet encoded) in one batch; each keeps its rows, drops its data."""
    if not inputs:
        return
    rows = encoder.encode([mi.data for mi in inputs if mi.data is not None])
    if len(rows) != len(inputs):
        raise RuntimeError(f"the encoder gave {len(rows)} outputs for {len(inputs)} inputs")
    for mi, r in zip(inputs, rows, strict=True):
        if r.shape[0] != mi.length:
            raise RuntimeError(f"the encoder gave {r.shape[0]} rows for an input of {mi.length} positions")
        mi.rows, mi.data = r, None


def overlapping(inputs: list[MultiModalInput], start: int, end: int) -> list[MultiModalInput]:
    """The inputs with a position in ``[start, end)``."""
    return [mi for mi in inputs if mi.offset < end and start < mi.offset + mi.length]


def step_rows(inputs: list[MultiModalInput], start: int, end: int
              ) -> list[tuple[int, torch.Tensor]]:
    """The rows a step computing positions ``[start, end)`` takes from ``inputs`` (each
    encoded): (the first one's index within the step, the rows)."""
    out = []
    for mi in overlapping(inputs, start, end):
        assert mi.rows is not None
        a, b = max(start, mi.offset), min(end, mi.offset + mi.length)
        out.append((a - start, mi.rows[a - mi.offset:b - mi.offset]))
    return out


# a chat template that walks a message's content parts: a loop over (any variable's)
# ['content'] / .content, or a selectattr over it (llava-hf's); a filter such as
# ``content | trim`` prints a string and does not count
_CONTENT = r"""\w+(\[\s*['"]content['"]\s*\]|\.content)"""
_LOOPS_PARTS = re.compile(rf"for\s+\w+\s+in\s+{_CONTENT}|{_CONTENT}\s*\|\s*selectattr")


def template_reads_parts(template: object) -> bool:
    """Whether a chat template loops over a message's content parts (vLLM's "openai"
    content format) rather than printing it as a string: such a template must be given
    ``[{"type": "text", "text": ...}]`` (a string would be walked character by character,
    its text lost) and shows an image part's placeholder itself."""
    return isinstance(template, str) and _LOOPS_PARTS.search(template) is not None


def as_text_parts(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each message whose content is a string, with it as one text part."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m.get("content"), str) else m for m in conversation]
