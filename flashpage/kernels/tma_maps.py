"""Encoded TMA descriptors (CUtensorMap) remembered across launches of host-descriptor kernels.

Triton 3.6's launcher turns every host ``TensorDescriptor`` argument into a CUtensorMap on
every launch (``driver.active.utils.fill_tma_descriptor``, i.e. cuTensorMapEncodeTiled);
the Gluon prefill passes three, and Nsight put their encoding at ~10% of a 2 x 4096 call.
The map is a pure function of its arguments (address, swizzle, element size and type, box,
shape, strides, padding) and holds no reference to the tensor, so a map made once for those
arguments serves every later launch with the same ones; a freed tensor whose address is
reused with the same geometry gets the very same bytes. The launcher copies the map by
value into the kernel's parameters, so a CUDA graph captures the bytes, not the cache.

``cached_tma_maps()`` swaps the memo in for the duration of one launch (other kernels in
the process keep the plain encoder); ``fill_calls`` counts the real encodings (tests).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

# Maps remembered (128 bytes each). Every layer has its own K and V cache: an 8B model's 64
# cache maps and its q buffers, taken in turn each step, never hit an LRU of 64.
CAPACITY = 1024

_maps: OrderedDict[tuple, Any] = OrderedDict()
fill_calls = 0


def _key(args: tuple) -> tuple:
    return tuple(tuple(a) if isinstance(a, list | tuple) else a for a in args)


def _memo(real: Callable) -> Callable:
    def fill(*args):
        global fill_calls
        key = _key(args)
        m = _maps.get(key)
        if m is None:
            fill_calls += 1
            m = _maps[key] = real(*args)
            if len(_maps) > CAPACITY:
                _maps.popitem(last=False)
        else:
            _maps.move_to_end(key)
        return m

    fill.real = real  # type: ignore[attr-defined]
    return fill


@contextlib.contextmanager
def cached_tma_maps(utils: Any = None, enabled: bool = True) -> Iterator[None]:
    """Within: ``utils.fill_tma_descriptor`` (default: Triton's active driver's) remembers its
    maps (LRU of CAPACITY). Nested uses and ``enabled=False`` leave it as it is."""
    if not enabled:
        yield
        return
    if utils is None:
        import triton

        utils = triton.runtime.driver.active.utils
    real = getattr(utils, "fill_tma_descriptor", None)
    if real is None or hasattr(real, "real"):  # another Triton's launcher, or nested
        yield
        return
    try:
        utils.fill_tma_descriptor = _memo(real)
    except (AttributeError, TypeError):  # a read-only driver object: encode every call
        yield
        return
    try:
        yield
    finally:
        utils.fill_tma_descriptor = real


def clear() -> None:
    _maps.clear()


def descriptor(memo: dict, kind: str, t: Any, make: Callable[[Any], Any]) -> Any:
    """``make(t)`` (a host TensorDescriptor over tensor ``t``), remembered in ``memo`` under
    ``kind`` and t's address, shape, strides and dtype: a KV cache's descriptors made once for
    as long as the caller keeps ``memo``. A remembered one serves only while the tensor it was
    made over still lies at that address: a descriptor's base is a view of its tensor, so when
    sleep mode (without fixed addresses) moves a cache's storage the descriptor follows it,
    and another cache given the old address must not get it (it read layer 3's K/V in layer
    5's attention after a wake_up)."""
    ptr = t.data_ptr()
    key = (kind, ptr, t.shape, t.stride(), t.dtype)
    hit = memo.get(key)
    if hit is None or hit[1].data_ptr() != ptr:
        hit = memo[key] = (make(t), t)
    return hit[0]
