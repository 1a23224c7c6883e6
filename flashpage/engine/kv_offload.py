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
right after ``schedule()`` and before the forward:

* stores: per tensor one ``index_select`` of the evicted blocks into a device staging
  tensor ``[n, block_bytes]`` (on the compute stream: before the forward reuses the
  blocks), then one device-to-host copy per run of consecutive host ids, non_blocking
  into pinned memory on a side stream (CUDA), so it overlaps the forward;
* loads: one host-to-device copy per run into a staging tensor, then per tensor one
  ``index_copy_`` into the destination blocks. Asynchronous (the default on CUDA): on a
  load stream of their own, the step's loads one ``LoadBatch`` whose event the scheduler
  polls; only the requests reading those blocks wait (kv_cache/host_cache.py), the forward
  of this step and the next ones run beside the copies. ``FLASHPAGE_KV_OFFLOAD_ASYNC_LOADS
  =0``: on the compute stream before the forward, which then waits for them.

Ordering on CUDA, with the host tensor touched by nothing but these copies (never by the
CPU, so no synchronization is needed):

* the compute stream first waits for the loads whose readers were freed while they ran
  (``HostBlockCache.orphaned``): their blocks may be stored or written again this step;
* a store's side-stream copies wait for the compute stream (its gather), and for the loads
  still reading a host block it overwrites (each load batch records an event, kept with
  its host blocks until it has passed);
* a load waits for the compute stream (the store gathers reading the blocks it fills, and
  the forwards that wrote them before they were freed) and only for the stores of the host
  blocks it reads (each batch of stores records an event, kept with its host blocks until
  it has passed): a block stored this very step, or in a step whose copy is still running.
  Other loads run beside the stores, host to device while they go device to host (PCIe
  carries both at once): a host hit evicts a GPU block whose content is stored first, so
  waiting for every store serialized the two (run 217: 48-49 GB/s for both together, a
  pinned copy alone 54.9);
* a staging tensor read on the side stream is kept from reuse until that copy ends
  (``record_stream``).

On the CPU every copy is synchronous and in program order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashpage import envs
from flashpage.config import ConfigError
from flashpage.kv_cache.host_cache import HostBlockCache, LoadBatch

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
        cuda = device.type == "cuda"
        # asynchronous loads on the CPU too: there the copies are done at flush, and the
        # requests reading them compute from the next step on, as on CUDA once they pass
        self.host = HostBlockCache(num_blocks, async_loads=envs.kv_offload_async_loads())
        self.memory = torch.empty((num_blocks, self.block_bytes), dtype=torch.uint8,
                                  pin_memory=self.pin)
        self.stage_blocks = max(1, STAGE_BYTES // self.block_bytes)
        # the stores' device-to-host copies (CUDA): beside the forward, not before it
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        # asynchronous loads' host-to-device copies: beside the forwards, only readers wait
        self.load_stream = torch.cuda.Stream(device) if cuda and self.host.async_loads else None
        # copies not known to have passed: (event after them, the host blocks they touch)
        self._stored: list[tuple[torch.cuda.Event, set[int]]] = []
        self._loaded: list[tuple[torch.cuda.Event, set[int]]] = []

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
        host = self.host
        stores, loads = host.take_ops()
        batch = host.last_batch
        orphans = host.take_orphaned()
        if self.copy_stream is None:  # CPU: synchronous copies in program order
            for c in range(0, len(stores), self.stage_blocks):
                self._store(sorted(stores[c:c + self.stage_blocks], key=lambda s: s[1]))
            for c in range(0, len(loads), self.stage_blocks):
                self._load(sorted(loads[c:c + self.stage_blocks]))
            if batch is not None:
                batch.finished = True
            return len(stores), len(loads)
        compute = torch.cuda.current_stream(self.device)
        for b in orphans:  # freed under their loads: written again (or stored) from now on
            if isinstance(b.event, torch.cuda.Event):
                compute.wait_event(b.event)
        self._stored = [(e, ids) for e, ids in self._stored if not e.query()]
        self._loaded = [(e, ids) for e, ids in self._loaded if not e.query()]
        for c in range(0, len(stores), self.stage_blocks):
            self._store(sorted(stores[c:c + self.stage_blocks], key=lambda s: s[1]))
        if loads:
            self._queue_loads(loads, compute, batch)
        return len(stores), len(loads)

    def _queue_loads(self, loads: list[tuple[int, int]], compute: torch.cuda.Stream,
                     batch: LoadBatch | None) -> None:
        """The loads on the load stream (asynchronous; ``batch`` gets their event) or on
        the compute stream (before the step's forward)."""
        stream = self.load_stream or compute
        if stream is not compute:
            stream.wait_stream(compute)  # store gathers of these blocks, their last forwards
        read = {h for h, _ in loads}
        for e, ids in self._stored:  # only the stores of the host blocks they read
            if not ids.isdisjoint(read):
                stream.wait_event(e)
        with torch.cuda.stream(stream):
            for c in range(0, len(loads), self.stage_blocks):
                self._load(sorted(loads[c:c + self.stage_blocks]))
            done = torch.cuda.Event()
            done.record()
        self._loaded.append((done, read))
        if batch is not None:
            if stream is compute:
                batch.finished = True  # before anything the step runs
            else:
                batch.event = done

    def wait_for_a_load(self) -> None:
        """Block until the oldest load batch in flight has passed (a step with nothing to
        run while requests wait for the host: no spinning)."""
        b = self.host.oldest_in_flight()
        if b is not None and isinstance(b.event, torch.cuda.Event):
            b.event.synchronize()
        self.host.settle()

    def _store(self, pairs: list[tuple[int, int]]) -> None:
        """GPU blocks -> host blocks, ``pairs`` of (GPU id, host id) sorted by host id."""
        src = self._index([g for g, _ in pairs])
        stage = torch.cat([v.index_select(0, src) for v in self.views], dim=1)
        runs = _runs([h for _, h in pairs])
        if self.copy_stream is None:
            for i, h, n in runs:
                self.memory[h:h + n].copy_(stage[i:i + n])
            return
        written = {h for _, h in pairs}
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        for e, ids in self._loaded:  # loads still reading a host block it overwrites
            if not ids.isdisjoint(written):
                self.copy_stream.wait_event(e)
        with torch.cuda.stream(self.copy_stream):
            for i, h, n in runs:
                self.memory[h:h + n].copy_(stage[i:i + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        stage.record_stream(self.copy_stream)
        self._stored.append((done, written))

    def _load(self, pairs: list[tuple[int, int]]) -> None:
        """Host blocks -> GPU blocks, ``pairs`` of (host id, GPU id) sorted by host id, on
        the current stream."""
        stage = torch.empty((len(pairs), self.block_bytes), dtype=torch.uint8, device=self.device)
        for i, h, n in _runs([h for h, _ in pairs]):
            stage[i:i + n].copy_(self.memory[h:h + n], non_blocking=self.pin)
        dst = self._index([g for _, g in pairs])
        for v, off in zip(self.views, self.offsets, strict=True):
            v.index_copy_(0, dst, stage[:, off:off + v.shape[1]])
