"""Sleep mode (vLLM's ``enable_sleep_mode``): give the device memory of the weights and the
KV cache back while the engine idles (an RLHF trainer's turn), and take it again.

Every tensor keeps its Python object: what is released is its *storage*
(``untyped_storage().resize_(0)``, as FSDP frees parameters), and waking resizes the same
storage back and fills it. So the model's parameters, the attention layers' ``kv_cache``
pairs and the runner's ``kv_caches`` list stay the objects everyone holds; only the
addresses change (the allocator hands out new memory). The CUDA graphs, which bake those
addresses in, are therefore dropped at ``sleep`` and captured again once both the weights
and the KV cache are awake (LLMEngine.wake_up).

With a ``CuMemPool`` (engine/cumem.py; on CUDA by default, ``FLASHPAGE_SLEEP_FIXED_ADDRESSES
=0`` turns it off) the weights and the KV cache were allocated at start-up in memory whose
pages can be given back while the addresses stay: sleep unmaps the pages, wake_up maps
fresh ones at the same addresses, and the CUDA graphs are kept, not captured again
(vLLM's CuMemAllocator). There a group is the pool's allocations under its tag
(``_FixedGroup``), saved and restored as byte ranges: level 1 keeps every byte of the
weights' allocations (parameters, buffers, any other tensor made while loading), level 2
every byte but the parameters'.

Two groups, vLLM's tags::

    "weights"   every storage under the model's parameters and buffers
    "kv_cache"  every storage under the runner's K/V (or MLA latent) cache tensors

``sleep(level=1)``: the weights' bytes copied to host memory (pinned on CUDA) first, then
both groups released; the KV cache's contents are discarded (the engine resets the prefix
cache). ``sleep(level=2)``: the parameters are discarded too; only the buffers (rotary
tables, quantization scales, ...) are kept on the host, so that ``load_weights`` /
``reload_weights`` need only the checkpoint's tensors. Waking a group re-allocates it:
weights from their host copy (level 1) or zeroed until loaded (level 2; buffers from
theirs), the KV cache zeroed (the null block of a sliding window is read as zeros).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flashpage.engine.cumem import CuMemPool

TAGS = ("weights", "kv_cache")


class EngineBusyError(RuntimeError):
    """sleep / load_weights / reload_weights while requests are in flight."""


class EngineSleepingError(ValueError):
    """A request or a forward while part of the engine is asleep: the message says which
    part and the ``wake_up`` call that brings it back. (A ValueError, so the server answers
    the request with it rather than counting it as a failure of the engine.)"""


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """vLLM's ``tags``: None (every group) or some of "weights", "kv_cache"; a ValueError
    naming an unknown one."""
    if tags is None:
        return TAGS
    if isinstance(tags, str):
        tags = [tags]
    out = tuple(dict.fromkeys(tags))
    bad = [t for t in out if t not in TAGS]
    if bad:
        raise ValueError(f"unknown wake_up tag(s) {bad}: use {list(TAGS)} (or none for both)")
    return out


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (a tied weight, or views of one tensor, once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        key = s.data_ptr() if s.nbytes() else id(s)
        if key not in seen:
            if not s.resizable():
                raise RuntimeError(f"a tensor of shape {tuple(t.shape)} lives in memory torch did "
                                   "not allocate (not resizable): sleep mode cannot release it")
            seen[key] = s
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``'s bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


@dataclass
class _Group:
    """Storages released together: each with its size, and its host copy (None: discarded)."""

    storages: list[torch.UntypedStorage]
    sizes: list[int]
    host: list[torch.Tensor | None] = field(default_factory=list)
    asleep: bool = False

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def release(self, keep: list[bool], pin: bool) -> None:
        """Copy the storages marked in ``keep`` to the host (one buffer, pinned with
        ``pin``: one allocation, and copies the device runs back to back), then free every
        storage."""
        total = sum(n for n, k in zip(self.sizes, keep, strict=True) if k)
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin) if total else None
        self.host, off = [], 0
        for s, n, k in zip(self.storages, self.sizes, keep, strict=True):
            host = None
            if k and n and buf is not None:
                host = buf[off:off + n]
                host.copy_(_bytes_of(s), non_blocking=pin)
                off += n
            self.host.append(host)
        if pin:
            torch.cuda.synchronize()  # the copies (and any step still reading) done
        for s in self.storages:
            s.resize_(0)
        self.asleep = True

    def restore(self) -> None:
        """Allocate every storage again: its host copy back, else zeros (a discarded
        weight reads as 0, never as stale memory, until it is loaded)."""
        for s, n, host in zip(self.storages, self.sizes, self.host, strict=True):
            s.resize_(n)
            if host is not None:
                _bytes_of(s).copy_(host, non_blocking=host.is_pinned())
            elif n:
                _bytes_of(s).zero_()
        if self.storages and self.storages[0].device.type == "cuda":
            torch.cuda.synchronize()
        self.host = []
        self.asleep = False


def _ranges_minus(start: int, end: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` without the (sorted, possibly overlapping) ``holes``."""
    out, at = [], start
    for a, b in holes:
        a, b = max(a, start), min(b, end)
        if a >= b:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out


class _FixedGroup:
    """A tag's allocations in a CuMemPool: their pages unmapped on release and mapped again
    (same addresses) on restore; the byte ranges asked for copied to the host and back,
    the rest zeroed."""

    def __init__(self, pool: CuMemPool, tag: str) -> None:
        self.pool, self.tag = pool, tag
        self.host: list[torch.Tensor | None] = []
        self._saved: list[tuple[int, int]] = []  # (address, bytes) of each host piece
        self.asleep = False

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes(self.tag)

    def owns(self, storage: torch.UntypedStorage) -> bool:
        p = storage.data_ptr()
        return any(a.ptr <= p < a.ptr + a.size for a in self.pool.tagged(self.tag))

    def _view(self, ptr: int, n: int) -> torch.Tensor:
        from flashpage.engine.cumem import device_bytes

        return device_bytes(ptr, n, self.pool.device)

    def release(self, holes: list[tuple[int, int]] | None, pin: bool, keep: bool) -> None:
        """Copy the allocations' bytes (``keep``; without the ``holes``' ranges) to one
        host buffer, then unmap every allocation."""
        pieces: list[tuple[int, int]] = []
        if keep:
            for a in sorted(self.pool.tagged(self.tag), key=lambda a: a.ptr):
                pieces += [(x, y - x) for x, y in _ranges_minus(a.ptr, a.ptr + a.size, holes or [])]
        total = sum(n for _, n in pieces)
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=pin) if total else None
        self.host, self._saved, off = [], pieces, 0
        for ptr, n in pieces:
            assert buf is not None
            h = buf[off:off + n]
            h.copy_(self._view(ptr, n), non_blocking=pin)
            self.host.append(h)
            off += n
        self.pool.unmap(self.tag)  # synchronizes: the copies done first
        self.asleep = True

    def drop_host(self, holes: list[tuple[int, int]]) -> None:
        """Forget the saved bytes inside ``holes`` (level 2 over level 1)."""
        host: list[torch.Tensor | None] = []
        saved: list[tuple[int, int]] = []
        for h, (ptr, n) in zip(self.host, self._saved, strict=True):
            for x, y in _ranges_minus(ptr, ptr + n, holes):
                assert h is not None
                host.append(h[x - ptr:y - ptr].clone())
                saved.append((x, y - x))
        self.host, self._saved = host, saved

    def restore(self) -> None:
        self.pool.remap(self.tag)
        for a in self.pool.tagged(self.tag):
            self._view(a.ptr, a.size).zero_()
        for h, (ptr, n) in zip(self.host, self._saved, strict=True):
            assert h is not None
            self._view(ptr, n).copy_(h, non_blocking=h.is_pinned())
        torch.cuda.synchronize(self.pool.device)
        self.host, self._saved = [], []
        self.asleep = False


class SleepState:
    """The engine's two groups of device memory and which of them sleep (``LLMEngine``
    owns one when ``enable_sleep_mode``; the policy, what may run when, is the engine's)."""

    def __init__(self, model: torch.nn.Module, kv_caches: Iterable[torch.Tensor | tuple[torch.Tensor, ...]],
                 device: torch.device, pool: CuMemPool | None = None) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        params = [p for _, p in model.named_parameters()]
        buffers = [b for _, b in model.named_buffers() if b is not None]
        self.weights = _Group(_unique_storages([*params, *buffers]), [])
        # a storage is a parameter's (level 2 discards it) unless only buffers use it
        param_ptrs = {s.data_ptr() for s in _unique_storages(params) if s.nbytes()}
        self._is_param = [s.data_ptr() in param_ptrs for s in self.weights.storages]
        self.weights.sizes = [s.nbytes() for s in self.weights.storages]
        flat: list[torch.Tensor] = []
        for c in kv_caches:
            flat.extend(c if isinstance(c, tuple) else (c,))
        self.kv_cache = _Group(_unique_storages(flat), [])
        self.kv_cache.sizes = [s.nbytes() for s in self.kv_cache.storages]
        # fixed addresses (engine/cumem.py): the pool's allocations, the graphs kept
        self.fixed: dict[str, _FixedGroup] | None = None
        self._param_ranges: list[tuple[int, int]] = []
        if pool is not None:
            self.fixed = {t: _FixedGroup(pool, t) for t in TAGS}
            outside = [s for s in self.weights.storages if s.nbytes() and not self.fixed["weights"].owns(s)]
            outside += [s for s in self.kv_cache.storages if s.nbytes() and not self.fixed["kv_cache"].owns(s)]
            if outside:
                ptrs = {s.data_ptr() for s in outside}
                named = [f"{n} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
                         for n, t in [*model.named_parameters(remove_duplicate=False),
                                      *model.named_buffers(remove_duplicate=False)]
                         if t is not None and t.untyped_storage().data_ptr() in ptrs]
                raise RuntimeError(f"{len(outside)} weight / KV storage(s) ({sum(s.nbytes() for s in outside)} "
                                   f"bytes) were not allocated in the sleep pool: {named[:8]}")
            self._param_ranges = sorted((s.data_ptr(), s.data_ptr() + s.nbytes())
                                        for s in _unique_storages(params) if s.nbytes())
        self.level = 0  # the level of the last sleep (0: never slept / fully awake)
        # after a level-2 sleep the parameters hold nothing until a load: set by wake_up,
        # cleared by load_weights / reload_weights
        self.weights_discarded = False

    @property
    def keeps_graphs(self) -> bool:
        """Whether the addresses survive a sleep (the CUDA graphs are kept)."""
        return self.fixed is not None

    @property
    def is_sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: any group asleep."""
        return self.group("weights").asleep or self.group("kv_cache").asleep

    def asleep(self) -> list[str]:
        return [t for t in TAGS if self.group(t).asleep]

    def group(self, tag: str) -> _Group | _FixedGroup:
        if self.fixed is not None:
            return self.fixed[tag]
        return self.weights if tag == "weights" else self.kv_cache

    def nbytes(self, tag: str) -> int:
        return self.group(tag).nbytes

    def sleep(self, level: int) -> None:
        """Release both groups (one already asleep stays so; level 2 over a level-1 sleep
        drops the parameters' host copies)."""
        if self.fixed is not None:
            self._sleep_fixed(level, self.fixed)
            return
        if not self.weights.asleep:
            keep = [True] * len(self._is_param) if level == 1 else [not p for p in self._is_param]
            self.weights.release(keep, self.pin)
        elif level == 2:
            # the buffers' bytes copied out of the one host buffer, so that it is freed
            self.weights.host = [None if p or h is None else h.clone()
                                 for p, h in zip(self._is_param, self.weights.host, strict=True)]
        self.weights_discarded |= level == 2
        if not self.kv_cache.asleep:
            self.kv_cache.release([False] * len(self.kv_cache.storages), self.pin)
        self.level = max(self.level, level)
        if self.device.type == "cuda":
            # cuBLAS's workspaces (32 MiB a stream on Hopper) come from torch's allocator and
            # outlive the graphs captured with them: 96 MiB stayed allocated with no tensor
            # behind it after sleep(1), and each wake_up's recapture added 32 more (run 217).
            # The engine dropped its graphs first; cuBLAS allocates them again on next use.
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()  # back to the driver: another process may take it

    def _sleep_fixed(self, level: int, fixed: dict[str, _FixedGroup]) -> None:
        w, kv = fixed["weights"], fixed["kv_cache"]
        if not w.asleep:
            w.release(self._param_ranges if level == 2 else None, self.pin, keep=True)
        elif level == 2:
            w.drop_host(self._param_ranges)
        self.weights_discarded |= level == 2
        if not kv.asleep:
            kv.release(None, self.pin, keep=False)
        self.level = max(self.level, level)
        # cuBLAS's workspaces stay: the kept graphs were captured with them
        torch.cuda.empty_cache()

    def wake_up(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            g = self.group(tag)
            if g.asleep:
                g.restore()
        if not self.is_sleeping:
            self.level = 0

    def check_awake(self) -> None:
        """An EngineSleepingError naming what sleeps and the call that wakes it."""
        asleep = self.asleep()
        if asleep:
            call = "wake_up()" if len(asleep) == 2 else f"wake_up(tags={asleep})"
            raise EngineSleepingError(
                f"the engine is asleep ({' and '.join(asleep)} released by sleep(level="
                f"{self.level})): call {call} before generating")
        if self.weights_discarded:
            raise EngineSleepingError(
                "the weights were discarded by sleep(level=2): call load_weights(...) or "
                "reload_weights() before generating")
