"""Which header fields stay on their hop (RFC 9110 7.6.1), for every upstream path both ways. One module, so the
HTTP/1.1, HTTP/2 and upgrade paths cannot drift apart on what a hop is."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from gatekeeper.proxy.messages import HOP_BY_HOP, Headers

# The adapter handles 100-continue with the client; Host is the backend's.
REQUEST_DROP = frozenset({"host", "expect"})
REQUEST_REMOVED = HOP_BY_HOP | REQUEST_DROP
"""What never leaves on a request (the front stage dropped what ``Connection`` names)."""


def refuse_named_fields(connection: str, removed: AbstractSet[str]) -> None:
    """ValueError when a ``Connection`` value names a field that is not in ``removed``: the front stage dropped what
    it names (``auth.drop_connection_named``), so a request that still carries one did not pass it, and both encoders
    send nothing rather than a field the backend would treat as hop-by-hop."""
    if not {t.strip().lower() for t in connection.split(",") if t.strip()} <= removed:
        raise ValueError(f"Connection names fields still present: {connection[:64]!r}")


_NAMES: dict[bytes, str] = {}
"""Response header names as received -> lower-case text: an apiserver sends the same dozen names all day."""
MAX_NAMES = 512
"""Names past this many are decoded every time (a backend cannot grow the table without bound)."""


KEEP_UPGRADE = frozenset({"upgrade", "connection"})
"""The hop-by-hop fields a 101 keeps: they are its point."""


def response_headers(raw: Sequence[tuple[bytes, bytes]], keep: frozenset[str] = frozenset()) -> Headers:
    """Raw response headers as lower-case text pairs, without hop-by-hop ones and those ``Connection`` names, but for
    ``keep``."""
    out: Headers = []
    named: list[str] | None = None
    names = _NAMES
    for k, v in raw:
        name = names.get(k)
        if name is None:
            name = k.decode("latin-1").lower()
            if len(names) < MAX_NAMES:
                names[k] = name
        if name in HOP_BY_HOP:
            if name == "connection":
                named = [*(named or []), v.decode("latin-1")]
            if name not in keep:
                continue
        out.append((name, v.decode("utf-8", "surrogateescape")))
    if named:
        tokens = {t.strip().lower() for v in named for t in v.split(",")} - keep
        out = [(k, v) for k, v in out if k not in tokens]
    return out
