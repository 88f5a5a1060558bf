"""The multiplexed upstream's request side on the wire: header fields and HEADERS frames (pure).

The same rules as the HTTP/1.1 head (:func:`exchange.encode_request_head`) hold,
so a request cannot be classified as one thing and sent as another whichever
client carries it: the method must be a token, the target origin-form visible
ASCII, byte for byte as classified; a CR, LF or NUL in any header, a
pseudo-header from the client, a hop-by-hop header (and any the ``Connection``
header names) never goes out. HTTP/2 adds its own: names are sent lower-case
(RFC 9113 8.2.1) and only ``Host``'s value survives, as ``:authority`` of the
*backend* (the client's Host is dropped as on the HTTP/1.1 path).

Credentials (``authorization``, ``proxy-authorization``, ``cookie``) are
HPACK never-indexed literals: they never enter either side's dynamic table.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from hpack import NeverIndexedHeaderTuple

from gatekeeper.proxy.listen import h2_frames as f
from gatekeeper.proxy.messages import Headers

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(r"/[\x21-\x7e]*")
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")
SECRET = frozenset({"authorization", "proxy-authorization", "cookie"})
_SCHEME = (b":scheme", b"https")


def request_fields(method: str, target: str, authority: str, headers: Headers,
                   removed: Collection[str]) -> list[tuple[bytes, bytes]]:
    """The request's HPACK fields, pseudo-headers first; ValueError when anything may not go out.

    Only bodiless requests take this path, so a non-zero ``content-length`` is refused
    (the backend would wait for a body that never comes).
    """
    if not _TOKEN.fullmatch(method) or not _TARGET.fullmatch(target):
        raise ValueError(f"refusing to send {method[:16]!r} {target[:64]!r} upstream")
    named: set[str] = set()
    for k, v in headers:
        if k.lower() == "connection":
            named |= {t.strip().lower() for t in v.split(",")}
    fields: list[tuple[bytes, bytes]] = [
        (b":method", method.encode("ascii")), _SCHEME, (b":authority", authority.encode("ascii")),
        (b":path", target.encode("ascii")),
    ]
    values: list[str] = []
    for name, value in headers:
        lower = name.lower()
        if lower in removed or lower in named or lower[:1] == ":":
            continue
        if lower == "content-length":
            if value.strip("0"):
                raise ValueError(f"content-length {value[:32]!r} on a request without a body")
            continue
        if not _NAME.fullmatch(lower):
            raise ValueError(f"refusing header name {lower[:32]!r}")
        values.append(value)
        raw = (lower.encode("ascii"), value.encode("utf-8", "surrogateescape"))
        fields.append(NeverIndexedHeaderTuple(*raw) if lower in SECRET else raw)
    text = "".join(values)
    if "\r" in text or "\n" in text or "\x00" in text:
        raise ValueError("CR, LF or NUL in a request header")
    return fields


def headers_frames(sid: int, block: bytes, max_frame: int) -> bytes:
    """A bodiless request's HEADERS (END_STREAM), with CONTINUATION frames when the block is larger than one frame."""
    if len(block) <= max_frame:
        return f.header(f.HEADERS, f.END_STREAM | f.END_HEADERS, sid, len(block)) + block
    parts = [block[i:i + max_frame] for i in range(0, len(block), max_frame)]
    out = [f.header(f.HEADERS, f.END_STREAM, sid, len(parts[0])), parts[0]]
    for i, part in enumerate(parts[1:], start=2):
        out += (f.header(f.CONTINUATION, f.END_HEADERS if i == len(parts) else 0, sid, len(part)), part)
    return b"".join(out)
