"""A GGUF file's metadata and tensor table, read without building the vocabulary.

``gguf.GGUFReader`` turns every metadata value into numpy views, one per string of the
tokenizer's vocabulary and merges too: ~3 s for SmolLM2's 49,152 tokens and 48,900
merges on this project's CPU, on every start of the default model, though the engine
only needs the config keys and the tensors (the tokenizer is converted once and cached,
engine/tokenizer.py). ``GGUFFile`` walks the same format (https://github.com/ggml-org/
ggml/blob/master/docs/gguf.md: header, key/value metadata, tensor infos, aligned data)
and keeps arrays longer than ``MAX_ARRAY`` as a ``GGUFArray`` (element type and count)
without decoding them. Tensors are numpy views of the memory-mapped file, shaped as
GGUFReader shapes them, so ``gguf.quants.dequantize`` takes them unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_ARRAY = 64  # longer metadata arrays are skipped, not decoded

# GGUF value types: (struct format, size) of the scalars; 8 = string, 9 = array.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array too long to decode: its element type (a GGUF value type) and
    length."""

    elem_type: int
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order (innermost first), as GGUFReader's ``shape``
    data: np.ndarray  # raw: typed for float/int tensors, uint8 rows for quantized ones


class GGUFFile:
    """``fields``: metadata key -> str / int / float / bool / list (short arrays) or
    ``GGUFArray``; ``tensors``: ``GGUFTensor`` in file order. ValueError on a file that
    is not GGUF version 2 or 3, or is cut short."""

    def __init__(self, path: str) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = path
        self._mm = np.memmap(path, mode="r")
        self._buf = memoryview(self._mm)  # type: ignore[arg-type]
        self._offs = 0
        if bytes(self._take(4)) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        (version,) = self._unpack("<I", 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._unpack("<QQ", 16)
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I", 4)
            self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I", 4)
            dims = self._unpack(f"<{n_dims}Q", 8 * n_dims)
            ttype, offset = self._unpack("<IQ", 12)
            infos.append((name, dims, ttype, offset))
        align = int(self.fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: invalid general.alignment {align}")
        start = -(-self._offs // align) * align
        typed = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset in infos:
            qtype = GGMLQuantizationType(ttype)
            n_elems = int(np.prod(dims)) if dims else 1
            block, type_size = GGML_QUANT_SIZES[qtype]
            np_shape = tuple(reversed(dims))
            begin = start + offset
            if qtype.name in typed:
                dtype: Any = typed[qtype.name]
                count = n_elems
            else:
                dtype, count = np.uint8, n_elems * type_size // block
                np_shape = quant_shape_to_byte_shape(np_shape, qtype)
            end = begin + count * np.dtype(dtype).itemsize
            if end > len(self._mm):
                raise ValueError(f"{path}: tensor {name} runs past the end of the file")
            data = np.ndarray((count,), dtype=dtype, buffer=self._mm, offset=begin)
            self.tensors.append(GGUFTensor(name, qtype, tuple(int(d) for d in dims),
                                           data.reshape(np_shape)))

    # -------------------------------------------------------------------- parsing
    def _take(self, n: int) -> memoryview:
        if self._offs + n > len(self._buf):
            raise ValueError(f"{self.path}: the file ends inside its header")
        out = self._buf[self._offs:self._offs + n]
        self._offs += n
        return out

    def _unpack(self, fmt: str, size: int) -> tuple[Any, ...]:
        return struct.unpack(fmt, self._take(size))

    def _string(self) -> str:
        (n,) = self._unpack("<Q", 8)
        return bytes(self._take(n)).decode("utf-8", errors="replace")

    def _skip_string(self) -> None:
        (n,) = self._unpack("<Q", 8)
        self._take(n)

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ", 12)
            if count > MAX_ARRAY:
                self._skip(etype, count)
                return GGUFArray(etype, count)
            return [self._value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        fmt, size = _SCALARS[vtype]
        (value,) = self._unpack(fmt, size)
        if vtype == 6:  # float32 (1e-5 reads back as 9.9999997e-06): 7 significant digits
            return float(f"{value:.7g}")
        return value

    def _skip(self, etype: int, count: int) -> None:
        if etype in _SCALARS:
            self._take(_SCALARS[etype][1] * count)
        elif etype == _STRING:
            for _ in range(count):
                self._skip_string()
        else:  # arrays of arrays: walk them
            for _ in range(count):
                self._value(etype)
