"""Encoder outputs shared between requests (vLLM's encoder cache).

An image's rows (its tower's and projector's output, Qwen3-VL's deepstack features with
them) are a function of its preprocessed data alone, which ``MultiModalInput.digest`` names
(the pixels' bytes, shape and dtype, the grid or size where rows depend on them). The cache
keeps the rows of the last inputs encoded, keyed by (digest, length), on the device, so a
request whose image another request already brought is not encoded again: the same product
image asked about in many prompts, an image re-sent in each turn of a conversation whose
earlier turns left the prefix cache, an image placed after per-request text (which the
prefix cache cannot share: its blocks follow different text).

Its size is counted in rows (vLLM counts encoder tokens too): inputs are kept until the rows
of those cached pass ``capacity``, the least recently used dropped first. An entry whose
input a running request also holds costs no memory of its own (the same tensor); what the
cache adds to the device's memory is at most ``capacity`` rows, reserved by the engine
before the KV cache is sized (LLMEngine._encoder_bytes). An input longer than the capacity
is never kept. The engine clears it where the rows would go stale or the memory is wanted
back: a weight write, sleep, reset_prefix_cache.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

Key = tuple[bytes, int]
Entry = tuple[torch.Tensor, "torch.Tensor | None"]


class EncoderCache:
    """Least-recently-used (digest, length) -> (rows, deepstack features or None)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the encoder cache's capacity must be >= 0 rows, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[Key, Entry] = OrderedDict()
        self.rows = 0  # rows of the inputs kept
        # inputs looked up and found (vLLM's mm cache counters; prometheus: encoder_cache_*)
        self.queries = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> Entry | None:
        self.queries += 1
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return entry

    def put(self, key: Key, rows: torch.Tensor, deepstack: torch.Tensor | None = None) -> None:
        n = key[1]
        if n > self.capacity or key in self._entries:
            return
        while self.rows + n > self.capacity:
            (_, old), _ = self._entries.popitem(last=False)
            self.rows -= old
        self._entries[key] = (rows, deepstack)
        self.rows += n

    def clear(self) -> None:
        self._entries.clear()
        self.rows = 0
