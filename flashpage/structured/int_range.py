"""A regex matching the decimal integers in ``[lo, hi]`` (JSON's form: no leading zeros, no
``-0``), either bound open. Ranges split by digit count, then by leading digit:
``[13, 47]`` is ``1[3-9]|[23][0-9]|4[0-7]``."""

from __future__ import annotations


def int_range_regex(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"empty integer range [{lo}, {hi}]")
    parts: list[str] = []
    if lo is None or lo < 0:  # negatives: "-" and the magnitudes [max(1, -hi), -lo]
        mag_lo = 1 if hi is None or hi >= 0 else -hi
        mag_hi = None if lo is None else -lo
        parts += ["-" + p for p in _nonnegative(mag_lo, mag_hi)]
    if hi is None or hi >= 0:
        parts += _nonnegative(max(lo or 0, 0), hi)
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _nonnegative(lo: int, hi: int | None) -> list[str]:
    """Alternatives matching ``[lo, hi]``, 0 <= lo (hi None: unbounded)."""
    out: list[str] = []
    digits = len(str(lo))
    while hi is None or lo <= hi:
        if hi is None and digits > 1 and lo == 10 ** (digits - 1):
            out.append(f"[1-9][0-9]{{{digits - 1},}}")  # every number this long or longer
            return out
        top = 10 ** digits - 1
        out += _same_length(str(lo), str(top if hi is None else min(top, hi)))
        lo, digits = top + 1, digits + 1
    return out


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives matching the digit strings of one length in [lo, hi] (lo <= hi)."""
    if lo == hi:
        return [lo]
    if len(lo) == 1:
        return [_digits(lo, hi)]
    if lo[0] == hi[0]:
        return [lo[0] + r for r in _same_length(lo[1:], hi[1:])]
    rest = len(lo) - 1
    out: list[str] = []
    first, last = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * rest:  # lo's leading digit, only from lo's tail up
        out += [lo[0] + r for r in _same_length(lo[1:], "9" * rest)]
        first += 1
    tail: list[str] = []
    if hi[1:] != "9" * rest:
        tail = [hi[0] + r for r in _same_length("0" * rest, hi[1:])]
        last -= 1
    if first <= last:  # every tail under these leading digits
        out.append(_digits(str(first), str(last)) + (f"[0-9]{{{rest}}}" if rest > 1 else "[0-9]"))
    return out + tail


def _digits(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"
