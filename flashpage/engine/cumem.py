"""Device memory whose pages can be given back while its addresses stay (sleep mode).

CUDA's virtual memory management splits an allocation in two: an address range
(``cuMemAddressReserve``) and the physical pages mapped into it (``cuMemCreate`` +
``cuMemMap``). ``CuMemPool`` hands torch's caching allocator such allocations through a
pluggable allocator (``torch._C._cuda_customAllocator`` over two ctypes callbacks, in a
``torch.cuda.MemPool`` per tag entered with ``use_mem_pool``): every tensor made inside
``CuMemPool.use(tag)`` lives in them. ``unmap(tag)`` gives the pages of that tag's
allocations back to the driver (another process may take them) and keeps the address
ranges reserved; ``remap(tag)`` maps fresh pages at the same addresses. So every tensor,
view and CUDA graph that holds those addresses stays valid through a sleep: nothing is
captured again (vLLM's CuMemAllocator does this from C; here the driver is called through
ctypes, and Python runs only when torch asks its pool for a new segment).

Contents are not kept: what a caller wants back it copies out before ``unmap`` and in
after ``remap`` (engine/sleep.py).
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_ALLOC_TYPE_PINNED = 1
_LOCATION_DEVICE = 1
_ACCESS_READWRITE = 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CuMemError(RuntimeError):
    """A CUDA driver call of the virtual memory API failed (its name and error code)."""


_driver: ctypes.CDLL | None = None


def _cu(name: str, *args) -> None:
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    rc = getattr(_driver, name)(*args)
    if rc != 0:
        err = ctypes.c_char_p()
        _driver.cuGetErrorString(rc, ctypes.byref(err))
        raise CuMemError(f"{name} failed: CUDA error {rc} ({(err.value or b'?').decode()})")


def _ensure_context(device: int) -> None:
    """The device's primary context current on this thread (torch made it current on the
    thread that first used CUDA; the driver API needs it on the calling one)."""
    ctx = ctypes.c_void_p()
    _cu("cuCtxGetCurrent", ctypes.byref(ctx))
    if not ctx.value:
        _cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), ctypes.c_int(device))
        _cu("cuCtxSetCurrent", ctx)


@dataclass
class _Allocation:
    ptr: int
    size: int
    device: int
    tag: str
    handle: int | None  # the physical pages mapped now (None: unmapped)
    trimmed: bool = False  # unmapped while it holds no tensor (CuMemPool.trim)


def _prop(device: int) -> _AllocProp:
    p = _AllocProp()
    p.type = _ALLOC_TYPE_PINNED
    p.location.type = _LOCATION_DEVICE
    p.location.id = device
    return p


def _map(a: _Allocation) -> None:
    handle = ctypes.c_ulonglong()
    _cu("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(a.size), ctypes.byref(_prop(a.device)),
        ctypes.c_ulonglong(0))
    try:
        _cu("cuMemMap", ctypes.c_ulonglong(a.ptr), ctypes.c_size_t(a.size), ctypes.c_size_t(0), handle,
            ctypes.c_ulonglong(0))
    except CuMemError:
        _cu("cuMemRelease", handle)
        raise
    desc = _AccessDesc()
    desc.location.type = _LOCATION_DEVICE
    desc.location.id = a.device
    desc.flags = _ACCESS_READWRITE
    _cu("cuMemSetAccess", ctypes.c_ulonglong(a.ptr), ctypes.c_size_t(a.size), ctypes.byref(desc),
        ctypes.c_size_t(1))
    a.handle = handle.value


def _unmap(a: _Allocation) -> None:
    if a.handle is None:
        return
    _cu("cuMemUnmap", ctypes.c_ulonglong(a.ptr), ctypes.c_size_t(a.size))
    _cu("cuMemRelease", ctypes.c_ulonglong(a.handle))
    a.handle = None


_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


def available() -> bool:
    """Whether this torch and machine can run a CuMemPool (CUDA, the pluggable allocator)."""
    return (torch.cuda.is_available() and hasattr(torch._C, "_cuda_customAllocator")
            and hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"))


_KEEP: list[object] = []  # callbacks torch's allocator may still call: never collected


class _Segments:
    """What the callbacks share: the live allocations and the tag being allocated. Kept
    apart from CuMemPool so that a callback running while the pool is torn down (torch
    frees its segments late) still finds it."""

    def __init__(self, granularity: int) -> None:
        self.granularity = granularity
        self.allocations: dict[int, _Allocation] = {}
        self.tag = "weights"
        self.lock = threading.Lock()

    def alloc(self, size: int, device: int, stream: int) -> int:
        try:
            _ensure_context(device)
            size = -(-size // self.granularity) * self.granularity
            ptr = ctypes.c_ulonglong()
            _cu("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
            a = _Allocation(ptr.value, size, device, self.tag, None)
            try:
                _map(a)
            except CuMemError:
                _cu("cuMemAddressFree", ptr, ctypes.c_size_t(size))
                raise
            with self.lock:
                self.allocations[a.ptr] = a
            return a.ptr
        except Exception:  # a callback must not raise into C: torch sees NULL (out of memory)
            return 0

    def free(self, ptr: int, size: int, device: int, stream: int) -> None:
        with self.lock:
            a = self.allocations.pop(ptr or 0, None)
        if a is None:
            return
        try:
            _unmap(a)
            _cu("cuMemAddressFree", ctypes.c_ulonglong(a.ptr), ctypes.c_size_t(a.size))
        except CuMemError:
            pass  # nothing a free can report to


class CuMemPool:
    """Allocations at fixed addresses for tensors made inside ``use(tag)``; ``unmap`` /
    ``remap`` give a tag's pages back and take them again."""

    def __init__(self, device: torch.device) -> None:
        if not available():
            raise RuntimeError("fixed-address sleep memory needs CUDA and torch's pluggable "
                               "allocator (torch._C._cuda_customAllocator, torch.cuda.MemPool)")
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        _ensure_context(self.index)
        gran = ctypes.c_size_t()
        _cu("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(_prop(self.index)),
            ctypes.c_int(0))
        self.granularity = gran.value
        self._segments = seg = _Segments(gran.value)
        alloc_cb, free_cb = _ALLOC_FN(seg.alloc), _FREE_FN(seg.free)
        _KEEP.append((seg, alloc_cb, free_cb))
        alloc_ptr = ctypes.cast(alloc_cb, ctypes.c_void_p).value or 0
        free_ptr = ctypes.cast(free_cb, ctypes.c_void_p).value or 0
        self._allocator = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
        # a MemPool per tag: torch's allocator reuses a pool's free blocks before asking for a
        # new segment, so with one pool the K/V tensors landed in blocks the weights' load had
        # freed, under the weights' tag (run 221)
        self.pools: dict[str, torch.cuda.MemPool] = {}

    @property
    def allocations(self) -> dict[int, _Allocation]:
        return self._segments.allocations

    @contextmanager
    def use(self, tag: str):
        """Tensors made inside live in this pool's memory under ``tag``."""
        seg = self._segments
        pool = self.pools.get(tag)
        if pool is None:
            pool = self.pools[tag] = torch.cuda.MemPool(self._allocator)
        prev, seg.tag = seg.tag, tag
        try:
            self._untrim(tag)  # torch may hand out a free segment: pages under it again
            with torch.cuda.use_mem_pool(pool, device=self.device):
                yield
        finally:
            seg.tag = prev
            self.trim(tag)

    def trim(self, tag: str) -> int:
        """Unmap the pages of ``tag``'s segments that hold no live tensor (a load's
        temporaries: the 8B's fp32 copies left its weights' pool at 30.9 GiB for 15 GiB of
        weights, run 224, and torch 2.11 has no call that empties one pool's cache). torch
        keeps them as free blocks of the pool; ``use(tag)`` maps them again before anything
        can be allocated there. Returns the bytes given back."""
        try:
            segments = torch.cuda.memory_snapshot()
        except RuntimeError:
            return 0
        free = {sg["address"] for sg in segments
                if sg.get("allocated_size", 1) == 0 and sg.get("device") == self.index}
        _ensure_context(self.index)
        n = 0
        for a in self.tagged(tag):
            if a.ptr in free and a.handle is not None:
                _unmap(a)
                a.trimmed = True
                n += a.size
        return n

    def _untrim(self, tag: str) -> None:
        for a in self.tagged(tag, trimmed=True):
            if a.trimmed:
                _map(a)
                a.trimmed = False

    def tagged(self, tag: str, trimmed: bool = False) -> list[_Allocation]:
        """``tag``'s allocations (those trimmed, holding no tensor, only with ``trimmed``)."""
        with self._segments.lock:
            return [a for a in self.allocations.values() if a.tag == tag and (trimmed or not a.trimmed)]

    def nbytes(self, tag: str) -> int:
        return sum(a.size for a in self.tagged(tag))

    def mapped_bytes(self, tag: str) -> int:
        return sum(a.size for a in self.tagged(tag) if a.handle is not None)

    def unmap(self, tag: str) -> int:
        """Give the pages of ``tag``'s allocations back (their addresses stay reserved; any
        work reading them must have finished: this synchronizes). Returns the bytes freed."""
        torch.cuda.synchronize(self.device)
        _ensure_context(self.index)
        freed = 0
        for a in self.tagged(tag):
            if a.handle is not None:
                _unmap(a)
                freed += a.size
        return freed

    def remap(self, tag: str) -> None:
        """Fresh pages under ``tag``'s allocations, at the same addresses (contents undefined)."""
        _ensure_context(self.index)
        for a in self.tagged(tag):
            if a.handle is None:
                _map(a)


class _Interface:
    """An object torch.as_tensor reads as device memory (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def device_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of device memory at ``ptr`` (not owned)."""
    return torch.as_tensor(_Interface(ptr, nbytes), device=device)
