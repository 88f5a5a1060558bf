"""Go's ``time.ParseDuration``, for query parameters the apiserver reads with it (``?timeout=``).

The proxy must read a client's ``timeout`` exactly as kube-apiserver does: a value Go refuses is a 400
there, so it is one here, and a value both accept means the same deadline on both sides.
"""

from __future__ import annotations

_UNITS = {
    "ns": 1, "us": 1_000, "\u00b5s": 1_000, "\u03bcs": 1_000, "ms": 1_000_000,
    "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000,
}
_MAX_NS = (1 << 63) - 1
_DIGITS = frozenset("0123456789")


class DurationError(ValueError):
    """The text is not a Go duration; the message is Go's (``time: invalid duration "x"``)."""


def go_duration_ns(text: str) -> int:
    """Nanoseconds of a Go duration string (``"1m30s"``, ``"1.5h"``, ``"-2s"``, ``"0"``), as Go reads it."""
    quoted = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    s = text
    negative = False
    if s and s[0] in "+-":
        negative = s[0] == "-"
        s = s[1:]
    if s == "0":
        return 0
    if not s:
        raise DurationError(f"time: invalid duration {quoted}")
    total = 0
    while s:
        i = 0
        while i < len(s) and s[i] in _DIGITS:
            i += 1
        whole, s = s[:i], s[i:]
        frac = ""
        if s.startswith("."):
            j = 1
            while j < len(s) and s[j] in _DIGITS:
                j += 1
            frac, s = s[1:j], s[j:]
        if not whole and not frac:
            raise DurationError(f"time: invalid duration {quoted}")  # no digits at all ("." or "s")
        k = 0
        while k < len(s) and s[k] != "." and s[k] not in _DIGITS:
            k += 1
        unit, s = s[:k], s[k:]
        if not unit:
            raise DurationError(f"time: missing unit in duration {quoted}")
        scale = _UNITS.get(unit)
        if scale is None:
            raise DurationError(f'time: unknown unit "{unit}" in duration {quoted}')
        value = int(whole or "0") * scale
        if frac:
            value += int(frac) * scale // 10 ** len(frac)  # Go truncates sub-nanosecond fractions
        total += value
        if total > _MAX_NS + (1 if negative else 0):
            raise DurationError(f"time: invalid duration {quoted}")
    return -total if negative else total


def go_duration(text: str) -> float:
    """Seconds of a Go duration string; :class:`DurationError` for what Go refuses."""
    return go_duration_ns(text) / 1e9
