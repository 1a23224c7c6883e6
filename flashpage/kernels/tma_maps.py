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

``l2_promotion(n)``: within it every map is re-encoded with an L2 promotion of n bytes (the
size of the DRAM fill an L2 miss of a TMA load asks for; Triton 3.6 always encodes 128). The
map is encoded again through libcuda's cuTensorMapEncodeTiled with Triton's arguments, once
at 128 to find where Triton's object holds the map (its bytes must match exactly, else
RuntimeError) and once at n, written over it. A bench knob (benchmarks/decode_gluon_knobs.py
``--l2``): 256-byte rows read as two 128-byte halves (the 16-bit paged decode's boxes, the MLA
latents) might fill from DRAM in one request.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

L2_PROMOTIONS = {0: 0, 64: 1, 128: 2, 256: 3}  # bytes -> CUtensorMapL2promotion

CAPACITY = 64  # maps remembered (q, k, v of a few shapes and layers' worth of buffers)

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


def encode_args(args: tuple) -> tuple:
    """Triton's fill_tma_descriptor arguments (address, swizzle, element size, CUtensorMap data
    type, box, shape, strides in elements, padding) as cuTensorMapEncodeTiled takes them:
    (data type, rank, address, dims innermost first, the rank - 1 outer strides in bytes,
    box innermost first, swizzle, OOB fill) -- driver.c's translation."""
    address, swizzle, elem_size, elem_type, box, shape, strides, padding = args
    rank = len(box)
    if not (len(shape) == len(strides) == rank) or strides[-1] != 1:
        raise ValueError(f"box {box}, shape {shape}, strides {strides}: a rank-{rank} map with unit inner stride")
    dims = [int(d) for d in reversed(shape)]
    byte_strides = [int(st) * elem_size for st in reversed(strides[:-1])]
    return (elem_type, rank, address, dims, byte_strides, [int(b) for b in reversed(box)], swizzle,
            1 if padding == 1 else 0)


def encode(args: tuple, promotion_bytes: int) -> bytes:
    """The 128-byte CUtensorMap for Triton's fill_tma_descriptor ``args``, under an L2
    promotion of ``promotion_bytes`` (0, 64, 128, 256). Needs libcuda (a GPU machine)."""
    import ctypes

    elem_type, rank, address, dims, byte_strides, box, swizzle, fill = encode_args(args)
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    buf = ctypes.create_string_buffer(256)
    at = -ctypes.addressof(buf) % 128  # CUtensorMap is 64-byte aligned; 128 as Triton's
    res = fn(ctypes.c_void_p(ctypes.addressof(buf) + at), ctypes.c_int(elem_type), u32(rank),
             ctypes.c_void_p(address), (u64 * 5)(*dims), (u64 * 5)(*byte_strides), (u32 * 5)(*box),
             (u32 * 5)(*([1] * rank)), ctypes.c_int(0), ctypes.c_int(swizzle),
             ctypes.c_int(L2_PROMOTIONS[promotion_bytes]), ctypes.c_int(fill))
    if res != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({res}) for {args}")
    return buf.raw[at:at + 128]


def _promoting(real: Callable, promotion_bytes: int) -> Callable:
    import ctypes

    def fill(*args):
        m = real(*args)
        raw = ctypes.string_at(id(m), type(m).__basicsize__)  # the map sits inside the object
        at = raw.find(encode(args, 128))
        if at < 0:
            raise RuntimeError("Triton's tensor map differs from cuTensorMapEncodeTiled's at 128-byte promotion")
        ctypes.memmove(id(m) + at, encode(args, promotion_bytes), 128)
        return m

    fill.real = real  # type: ignore[attr-defined]  # cached_tma_maps inside leaves it alone
    return fill


@contextlib.contextmanager
def l2_promotion(promotion_bytes: int, utils: Any = None) -> Iterator[None]:
    """Within: every TMA map a launch encodes is re-encoded with this L2 promotion (bytes: 0,
    64, 128 = Triton's, 256). Outside a memo (cached_tma_maps under it keeps the plain
    encoder: every map fresh)."""
    if promotion_bytes not in L2_PROMOTIONS:
        raise ValueError(f"L2 promotion must be one of {sorted(L2_PROMOTIONS)} bytes, got {promotion_bytes}")
    if utils is None:
        import triton

        utils = triton.runtime.driver.active.utils
    real = utils.fill_tma_descriptor
    utils.fill_tma_descriptor = _promoting(real, promotion_bytes)
    try:
        yield
    finally:
        utils.fill_tma_descriptor = real
