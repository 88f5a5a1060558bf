"""HTTP/2 header blocks (pure): request block -> method, target, headers; response -> HEADERS block.

Checks RFC 9113 8.2/8.3 header rules with C-speed scans (a bearer token is a kilobyte). A malformed request is a
:class:`MalformedRequest` that resets only its stream, never a connection error taking the client's other streams down.
``cookie`` crumbs are joined and ``:authority`` becomes ``host`` for the HTTP/1.1 upstream."""

from __future__ import annotations

import re
from collections.abc import Iterable

from gatekeeper.proxy.adapter import HOP_BY_HOP, encode_header
from gatekeeper.proxy.h2wire.hpack_decode import CREDENTIALS
from gatekeeper.proxy.h2wire.hpack_encode import NeverIndexed
from gatekeeper.proxy.messages import Headers

_BAD_NAME = re.compile(rb"[^!#$%&'*+\-.^_`|~0-9a-z]")
"""Anything but a lower-case token character (RFC 9110 5.6.2; HTTP/2 forbids upper case)."""
_EDGE_WHITESPACE = (0x20, 0x09)


_CONTROLS_TO_NUL = bytes(0 if (b < 0x20 and b != 0x09) or b == 0x7F else b for b in range(256))
"""Every byte Go's ``httpguts.ValidHeaderFieldValue`` refuses (controls but HTAB, and DEL) maps to NUL."""


def _bad_value(value: bytes) -> bool:
    """A control byte other than HTAB anywhere, or SP/HTAB at either end (``value`` is not empty).

    Stricter than RFC 9113 (NUL, CR, LF) because Go's server (the apiserver) resets the stream for any control byte or
    DEL, and on the multiplexed upstream that ejected the apiserver for every client. One translate and one memchr: a
    regex was ~5x slower on a token."""
    return (0x00 in value.translate(_CONTROLS_TO_NUL)
            or value[0] in _EDGE_WHITESPACE or value[-1] in _EDGE_WHITESPACE)
REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path"})
CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                                 b"upgrade"})


FIELD_MEMO_ENTRIES = 512
FIELD_MEMO_MAX_BYTES = 1024
"""Never memoized: no credential is kept as a cache key (as in ``identity/tokens``)."""
_checked_fields: dict[tuple[bytes, bytes], tuple[str, str]] = {}
"""Regular fields that passed every per-field check, as text: clients repeat the same fields on every request.

Keyed by the exact bytes, so a hit would pass again; bounded (``FIELD_MEMO_MAX_BYTES``, ``FIELD_MEMO_ENTRIES``,
cleared when full). The order rules are still checked on every request."""


class MalformedRequest(ValueError):
    """The header block breaks an RFC 9113 rule; the message says which."""


def _text(raw: bytes) -> str:
    """Header text round-trips through utf-8 with surrogateescape, so odd bytes survive unchanged."""
    return raw.decode("utf-8", "surrogateescape")


def parse_request(block: Iterable[tuple[bytes, bytes]]) -> tuple[str, str, Headers]:
    """``(method, target, headers)`` from the codec's decoded block, or :class:`MalformedRequest`."""
    pseudo: dict[bytes, bytes] = {}
    headers: Headers = []
    cookies: list[str] = []
    has_host = False
    host = b""
    fields = _checked_fields
    for field in block:
        known = fields.get(field)
        if known is not None:  # the same bytes passed every check below before (see _checked_fields)
            headers.append(known)
            continue
        name, value = bytes(field[0]), bytes(field[1])
        if value and _bad_value(value):
            raise MalformedRequest(f"header {_text(name)!r} has a value with a control character or surrounding "
                                   "whitespace")
        if name[:1] == b":":
            if name not in REQUEST_PSEUDO:
                raise MalformedRequest(f"unknown or response pseudo-header {_text(name)!r}")
            if headers or cookies or has_host:
                raise MalformedRequest(f"pseudo-header {_text(name)!r} after a regular header")
            if name in pseudo:
                raise MalformedRequest(f"pseudo-header {_text(name)!r} given twice")
            pseudo[name] = value
            continue
        if not name or _BAD_NAME.search(name):
            raise MalformedRequest(f"invalid header name {_text(name)!r} (HTTP/2 names are lower-case tokens)")
        if name in CONNECTION_SPECIFIC:
            raise MalformedRequest(f"connection-specific header {_text(name)!r} is not allowed in HTTP/2")
        if name == b"te" and value.lower() != b"trailers":
            raise MalformedRequest("te header other than 'trailers' is not allowed in HTTP/2")
        if name == b"cookie":
            cookies.append(_text(value))
            continue
        if name == b"host":
            has_host, host = True, value
            headers.append((_text(name), _text(value)))
            continue
        text = (_text(name), _text(value))
        if len(name) + len(value) <= FIELD_MEMO_MAX_BYTES and name not in CREDENTIALS:
            if len(fields) >= FIELD_MEMO_ENTRIES:
                fields.clear()
            fields[(name, value)] = text
        headers.append(text)
    for required in (b":method", b":scheme", b":path"):
        if not pseudo.get(required):
            raise MalformedRequest(f"missing or empty {_text(required)} pseudo-header")
    authority = pseudo.get(b":authority")
    if authority is not None and has_host and authority != host:
        raise MalformedRequest("host header and :authority disagree")
    if cookies:
        headers.append(("cookie", "; ".join(cookies)))
    if authority is not None and not has_host:
        headers.insert(0, ("host", _text(authority)))
    return _text(pseudo[b":method"]), _text(pseudo[b":path"]), headers


VOLATILE_RESPONSE_HEADERS = frozenset({"audit-id", "date"})
"""New value on nearly every response: HPACK-indexing them would only evict useful entries."""


RESPONSE_MEMO_ENTRIES = 512
RESPONSE_MEMO_MAX_CHARS = 1024
_response_fields: dict[tuple[str, str], tuple[bytes, ...]] = {}
"""Response fields as HEADERS entries (``()``: dropped, hop-by-hop), memoized: apiservers repeat the same few.

Keyed by the exact text; bounded (``RESPONSE_MEMO_MAX_CHARS``, ``RESPONSE_MEMO_ENTRIES``, cleared when full);
volatile fields are never kept.

Typed ``tuple[bytes, ...]``, not ``tuple[bytes, bytes]``, on the way of a :class:`NeverIndexed`: compiled by mypyc, a
fixed-length tuple is unboxed into a C struct and comes back a plain tuple, without its never-indexed mark."""
_STATUS_LINES: dict[int, bytes] = {}


def _response_field(name: str, value: str) -> tuple[bytes, ...]:
    name = name.lower()
    if name in HOP_BY_HOP:
        return ()
    if name in VOLATILE_RESPONSE_HEADERS:
        return NeverIndexed((encode_header(name), encode_header(value.strip())))
    return (encode_header(name), encode_header(value.strip()))


def malformed_trailer(field: tuple[bytes, bytes]) -> bool:
    """A trailer field a request's headers could not carry either: a pseudo-header, a connection-specific field,
    ``te`` other than ``trailers``, or an upper-case name (RFC 9113 8.1, 8.2.1, 8.2.2)."""
    name, value = field
    return (name[:1] == b":" or name in CONNECTION_SPECIFIC or name != name.lower()
            or (name == b"te" and value.lower() != b"trailers"))


def response_block(status: int, headers: Headers) -> list[tuple[bytes, ...]]:
    """The HEADERS block for a response, normalized here (the encoder does none): names lower-cased,
    connection-specific headers dropped, values trimmed."""
    code = _STATUS_LINES.get(status)
    if code is None:
        code = str(status).encode()
        if 100 <= status <= 999:
            _STATUS_LINES[status] = code
    block: list[tuple[bytes, ...]] = [(b":status", code)]
    memo = _response_fields
    for name, value in headers:
        key = (name, value)
        entry = memo.get(key)
        if entry is None:
            entry = _response_field(name, value)
            if (len(name) + len(value) <= RESPONSE_MEMO_MAX_CHARS
                    and name.lower() not in VOLATILE_RESPONSE_HEADERS):
                if len(memo) >= RESPONSE_MEMO_ENTRIES:
                    memo.clear()
                memo[key] = entry
        if entry:
            block.append(entry)
    return block
