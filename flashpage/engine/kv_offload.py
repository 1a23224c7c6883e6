"""KV cache offloading: the host tier's memory and its copies (vLLM's
``--kv-offloading-size GiB --kv-offloading-backend native``; SGLang's HiCache).

The bookkeeping (which host block holds which prefix block, LRU, the step's pending
stores and loads) is kv_cache/host_cache.py, pure Python; this module owns the tensor
and runs the copies. A host block is one row of bytes holding one GPU block of every
cache tensor of every layer, back to back::

    host : uint8 [num_host_blocks, block_bytes]           (pinned where CUDA is present)
    row  : | layer 0 K | layer 0 V | layer 1 K | ... |    (MLA: | layer 0 latent | ... |)

Each cache tensor ``[num_blocks, block_size, ...]`` (any dtype: fp8 caches travel as
their bytes) is viewed as ``uint8 [num_blocks, bytes]``. ``flush`` runs once a step,
right after ``schedule()`` and before the forward, on the compute stream:

* stores: per tensor one ``index_select`` of the evicted blocks into a device staging
  tensor ``[n, block_bytes]`` (on the compute stream: before the forward reuses the
  blocks), then one device-to-host copy per run of consecutive host ids, non_blocking
  into pinned memory on a side stream (CUDA), so it overlaps the forward;
* loads: one host-to-device copy per run into a staging tensor, then per tensor one
  ``index_copy_`` into the destination blocks, on the compute stream (before the forward
  reads them).

Ordering on CUDA, with the host tensor touched by nothing but these copies (never by the
CPU, so no synchronization is needed):

* a store's side-stream copies wait for the compute stream (its gather, and every load
  queued before, which may read a host block the store now overwrites);
* a load waits only for the stores of the host blocks it reads (each batch of stores
  records an event, kept with its host blocks until it has passed): a block stored this
  very step, or in a step whose copy is still running. Other loads run beside the stores, host to device
  while they go device to host (PCIe carries both at once): a host hit evicts a GPU block
  whose content is stored first, so waiting for every store serialized the two (run 217:
  48-49 GB/s for both together, a pinned copy alone 54.9);
* a staging tensor read on the side stream is kept from reuse until that copy ends
  (``record_stream``).

On the CPU every copy is synchronous and in program order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashpage.config import ConfigError
from flashpage.kv_cache.host_cache import HostBlockCache

KV_OFFLOADING_BACKENDS = ("native",)
STAGE_BYTES = 256 << 20  # the most device staging memory one batch of copies takes


def cache_tensors(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | torch.Tensor]) -> list[torch.Tensor]:
    """Every cache tensor of the runner's ``kv_caches`` (K and V of each layer, or MLA's
    latent), in order, each as ``uint8 [num_blocks, bytes of one block]``."""
    out = []
    for c in kv_caches:
        for t in (c if isinstance(c, tuple) else (c,)):
            out.append(t.view(torch.uint8).view(t.shape[0], -1))
    return out


def host_block_bytes(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | torch.Tensor]) -> int:
    """Bytes one host block takes: one GPU block of every cache tensor."""
    return sum(t.shape[1] for t in cache_tensors(kv_caches))


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first index, first id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, h in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == h:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((i, h, 1))
    return runs


class KVOffloader:
    """The host tier of one engine: its block map (``host``, attached to the KV cache
    manager) and its memory; ``flush`` runs the step's copies."""

    def __init__(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor] | torch.Tensor],
                 size_gib: float, device: torch.device) -> None:
        self.views = cache_tensors(kv_caches)
        widths = [t.shape[1] for t in self.views]
        self.block_bytes = sum(widths)
        self.offsets = [sum(widths[:i]) for i in range(len(widths))]
        num_blocks = int(size_gib * (1 << 30)) // self.block_bytes
        if num_blocks < 1:
            raise ConfigError(f"kv_offloading_size {size_gib} GiB holds no KV block: one block of "
                              f"every layer takes {self.block_bytes} bytes "
                              f"({self.block_bytes / (1 << 30):.6f} GiB)")
        self.device = device
        self.pin = device.type == "cuda"
        self.host = HostBlockCache(num_blocks)
        self.memory = torch.empty((num_blocks, self.block_bytes), dtype=torch.uint8,
                                  pin_memory=self.pin)
        self.stage_blocks = max(1, STAGE_BYTES // self.block_bytes)
        # the stores' device-to-host copies (CUDA): beside the forward, not before it
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the stores' copies not known to have passed: (event after them, their host blocks)
        self._stored: list[tuple[torch.cuda.Event, set[int]]] = []

    @property
    def num_blocks(self) -> int:
        return self.host.num_blocks

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        t = torch.tensor(ids, dtype=torch.int64)
        if self.pin:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    @torch.no_grad()
    def flush(self) -> tuple[int, int]:
        """Queue the step's copies (stores, then loads). Returns (blocks stored, loaded)."""
        stores, loads = self.host.take_ops()
        if self._stored:  # forget the stores that have passed
            self._stored = [(e, ids) for e, ids in self._stored if not e.query()]
        for c in range(0, len(stores), self.stage_blocks):
            self._store(sorted(stores[c:c + self.stage_blocks], key=lambda s: s[1]))
        if loads and self._stored:
            read = {h for h, _ in loads}
            compute = torch.cuda.current_stream(self.device)
            for e, ids in self._stored:
                if not ids.isdisjoint(read):
                    compute.wait_event(e)
        for c in range(0, len(loads), self.stage_blocks):
            self._load(sorted(loads[c:c + self.stage_blocks]))
        return len(stores), len(loads)

    def _store(self, pairs: list[tuple[int, int]]) -> None:
        """GPU blocks -> host blocks, ``pairs`` of (GPU id, host id) sorted by host id."""
        src = self._index([g for g, _ in pairs])
        stage = torch.cat([v.index_select(0, src) for v in self.views], dim=1)
        runs = _runs([h for _, h in pairs])
        if self.copy_stream is None:
            for i, h, n in runs:
                self.memory[h:h + n].copy_(stage[i:i + n])
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for i, h, n in runs:
                self.memory[h:h + n].copy_(stage[i:i + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        stage.record_stream(self.copy_stream)
        self._stored.append((done, {h for _, h in pairs}))

    def _load(self, pairs: list[tuple[int, int]]) -> None:
        """Host blocks -> GPU blocks, ``pairs`` of (host id, GPU id) sorted by host id."""
        stage = torch.empty((len(pairs), self.block_bytes), dtype=torch.uint8, device=self.device)
        for i, h, n in _runs([h for h, _ in pairs]):
            stage[i:i + n].copy_(self.memory[h:h + n], non_blocking=self.pin)
        dst = self._index([g for _, g in pairs])
        for v, off in zip(self.views, self.offsets, strict=True):
            v.index_copy_(0, dst, stage[:, off:off + v.shape[1]])
