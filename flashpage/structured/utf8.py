"""Code point ranges as UTF-8 byte-range sequences, so an automaton can run over bytes.

A range of code points whose UTF-8 encodings share a length splits into pieces that are
each a product of byte ranges: ``[0x80, 0x7FF]`` is ``[C2-DF][80-BF]``. Every code point
in the range is encoded by exactly one sequence, and a sequence matches only encodings of
code points in the range (surrogates, which UTF-8 cannot encode, are left out).
"""

from __future__ import annotations

ByteSeq = tuple[tuple[int, int], ...]  # one (lo, hi) byte range per position

_LENGTH_ENDS = (0x7F, 0x7FF, 0xFFFF)  # last code point of 1-, 2- and 3-byte encodings
_SURROGATES = (0xD800, 0xDFFF)


def utf8_sequences(lo: int, hi: int) -> list[ByteSeq]:
    """The byte-range sequences matching exactly the UTF-8 encodings of ``[lo, hi]``."""
    out: list[ByteSeq] = []
    _split(lo, hi, out)
    return out


def _split(lo: int, hi: int, out: list[ByteSeq]) -> None:
    if lo > hi:
        return
    s_lo, s_hi = _SURROGATES
    if lo <= s_hi and hi >= s_lo:
        _split(lo, s_lo - 1, out)
        _split(s_hi + 1, hi, out)
        return
    for end in _LENGTH_ENDS:
        if lo <= end < hi:
            _split(lo, end, out)
            _split(end + 1, hi, out)
            return
    if hi <= 0x7F:
        out.append(((lo, hi),))
        return
    n = len(chr(lo).encode("utf-8"))
    # Split until every continuation position spans either one value or its full range:
    # then the code points are exactly the product of the byte ranges.
    for i in range(1, n):
        m = (1 << (6 * i)) - 1  # the low bits the last i continuation bytes hold
        if lo & ~m != hi & ~m:
            if lo & m:
                _split(lo, lo | m, out)
                _split((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _split(lo, (hi & ~m) - 1, out)
                _split(hi & ~m, hi, out)
                return
    a, b = chr(lo).encode("utf-8"), chr(hi).encode("utf-8")
    out.append(tuple(zip(a, b, strict=True)))
