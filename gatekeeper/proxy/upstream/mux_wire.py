"""The multiplexed upstream's request on the wire: its header fields (pure; the response head is ``client_codec``'s).

The same rules as the HTTP/1.1 head, so a request cannot be classified as one thing and sent as another. Credentials are
HPACK never-indexed literals (RFC 7541 7.1.3) and never memoized."""

from __future__ import annotations

import re
from collections.abc import Set as AbstractSet

from gatekeeper.proxy.h2wire.hpack_encode import NEVER, WITHOUT, literal
from gatekeeper.proxy.messages import Headers
from gatekeeper.proxy.upstream.exchange import TARGET, TOKEN
from gatekeeper.proxy.upstream.hop_by_hop import refuse_named_fields

_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")
SECRET = frozenset({"authorization", "proxy-authorization", "cookie"})
_METHOD = {"GET": b"\x82", "POST": b"\x83"}
_SCHEME_HTTPS = b"\x87"
MEMO_ENTRIES = 4096
MEMO_MAX_BYTES = 512
_memo: dict[tuple[str, str], bytes] = {}
"""(name, value) -> its encoded field, for fields that are neither credentials nor long (checked once, then reused)."""
_memo_removed: AbstractSet[str] | None = None
"""The ``removed`` set the memo's fields passed."""


def authority_field(authority: str) -> bytes:
    """The backend's ``:authority``, encoded once per pool."""
    return literal(b":authority", authority.encode("ascii"), WITHOUT)


def request_block(method: str, target: str, authority: bytes, headers: Headers, removed: AbstractSet[str]) -> bytes:
    """The request's HPACK header block, pseudo-headers first; ValueError when anything may not go out.

    Nothing is indexed, so there is no dynamic table to keep in step, and ordinary fields' encodings are memoized (per
    ``removed`` set). A non-zero ``content-length`` is refused: only bodiless requests come here."""
    global _memo_removed
    fields = _memo
    if removed is not _memo_removed:
        fields.clear()
        _memo_removed = removed
    method_field = _METHOD.get(method)
    path_field = fields.get((":path", target))  # a target seen before was checked then
    if method_field is None or path_field is None:
        if not TOKEN.fullmatch(method) or not TARGET.fullmatch(target):
            raise ValueError(f"refusing to send {method[:16]!r} {target[:64]!r} upstream")
        method_field = method_field or literal(b":method", method.encode("ascii"), WITHOUT)
        if path_field is None:
            path_field = literal(b":path", target.encode("ascii"), WITHOUT)
            if len(target) <= MEMO_MAX_BYTES:
                if len(fields) >= MEMO_ENTRIES:
                    fields.clear()
                fields[(":path", target)] = path_field
    out = [method_field, _SCHEME_HTTPS, authority, path_field]
    connection = ""
    for name, value in headers:
        hit = fields.get((name, value))
        if hit is not None:
            out.append(hit)
            continue
        lower = name.lower()
        if lower in removed or lower[:1] == ":":
            if lower == "connection":
                connection = value if not connection else f"{connection}, {value}"
            continue
        if lower == "content-length":
            if value.strip("0"):
                raise ValueError(f"content-length {value[:32]!r} on a request without a body")
            continue
        if not _NAME.fullmatch(lower):
            raise ValueError(f"refusing header name {lower[:32]!r}")
        if "\r" in value or "\n" in value or "\x00" in value:
            raise ValueError("CR, LF or NUL in a request header")
        secret = lower in SECRET
        encoded = literal(lower.encode("ascii"), value.encode("utf-8", "surrogateescape"),
                          NEVER if secret else WITHOUT)
        if not secret and len(name) + len(value) <= MEMO_MAX_BYTES:
            if len(fields) >= MEMO_ENTRIES:
                fields.clear()
            fields[(name, value)] = encoded
        out.append(encoded)
    if connection:
        refuse_named_fields(connection, removed)
    return b"".join(out)
