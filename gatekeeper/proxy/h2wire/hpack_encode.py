"""HPACK encoder for the proxy's response headers: the same compression as ``hpack``'s, a fraction of the CPU.

Apiservers repeat nearly the same header list on every answer, so the repeated work becomes dict lookups: the dynamic
table is indexed by a dict, literal encodings are memoized (bounded, cleared when full), and long or never-indexed
fields (``audit-id``, ``date``) go out raw, without Huffman, and never enter table or memo. The table follows the peer's
SETTINGS_HEADER_TABLE_SIZE capped at ``MAX_TABLE_SIZE`` (RFC 7541 4.2)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from mypy_extensions import mypyc_attr

from gatekeeper.proxy.h2wire.hpack_tables import HUFFMAN_CODES, HUFFMAN_LENGTHS, STATIC_TABLE

DEFAULT_TABLE_SIZE = 4096
"""The table size both ends start with (RFC 7541 6.5.2 / RFC 9113 6.5.2)."""
MAX_TABLE_SIZE = 4096
"""Largest dynamic table we keep per connection, whatever the peer allows (bounds memory)."""
MEMO_ENTRIES = 1024
"""Fields whose literal encoding is memoized per process."""
MEMO_MAX_BYTES = 512
"""Longest field (name + value) that is memoized; longer ones are encoded each time."""
ENTRY_OVERHEAD = 32
"""RFC 7541 4.1: a table entry's size is name + value + 32."""

def huffman_encode(data: bytes) -> bytes:
    """``data`` Huffman-coded (5.2), padded to a byte with the most significant bits of EOS (all ones)."""
    bits = acc = 0
    for byte in data:
        length = HUFFMAN_LENGTHS[byte]
        acc = acc << length | HUFFMAN_CODES[byte]
        bits += length
    pad = -bits % 8
    return (acc << pad | (1 << pad) - 1).to_bytes((bits + pad) // 8, "big")


def encode_integer(value: int, prefix_bits: int) -> bytearray:
    """An HPACK integer (5.1) in a ``prefix_bits``-bit prefix; the caller ORs its flags into the first byte."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytearray([value])
    out = bytearray([limit])
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return out


_STATIC_FULL: dict[tuple[bytes, bytes], int] = {}
STATIC_NAME: dict[bytes, int] = {}
for _i, (_n, _v) in enumerate(STATIC_TABLE, start=1):
    _STATIC_FULL.setdefault((_n, _v), _i)
    STATIC_NAME.setdefault(_n, _i)
_STATIC_LEN = len(STATIC_TABLE)

_memo: dict[tuple[bytes, bytes], bytes] = {}


_BYTES = [bytes([i]) for i in range(256)]


def _int(value: int, prefix_bits: int, flags: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with ``flags`` in the first byte's high bits."""
    if value < (1 << prefix_bits) - 1:
        return _BYTES[flags | value]
    out = encode_integer(value, prefix_bits)
    out[0] |= flags
    return bytes(out)


_SMALL_INDEXED = [bytes([0x80 | i]) for i in range(127)]


def _indexed(index: int) -> bytes:
    """An indexed field (RFC 7541 6.1); one byte for the first 126 indices."""
    return _SMALL_INDEXED[index] if index < 127 else _int(index, 7, 0x80)


def _string(data: bytes, huffman: bool) -> bytes:
    if huffman:
        coded = huffman_encode(data)
        if len(coded) < len(data):
            return _int(len(coded), 7, 0x80) + coded
    return _int(len(data), 7, 0) + data


INCREMENTAL, WITHOUT, NEVER = (0x40, 6), (0x00, 4), (0x10, 4)
"""Literal representations (RFC 7541 6.2): first-byte flags and the name index's prefix bits."""


def literal(name: bytes, value: bytes, kind: tuple[int, int], *, huffman: bool = False) -> bytes:
    """A literal field, its name indexed from the static table when it is there (also the multiplexed upstream's
    request fields: ``upstream/mux_wire``)."""
    flags, bits = kind
    index = STATIC_NAME.get(name)
    if index is not None:
        return _int(index, bits, flags) + _string(value, huffman)
    return _int(0, bits, flags) + _string(name, huffman) + _string(value, huffman)


def indexed_literal(name: bytes, value: bytes) -> bytes:
    """The memoized encoding of ``name: value`` as a Huffman-coded literal with incremental indexing."""
    key = (name, value)
    hit = _memo.get(key)
    if hit is not None:
        return hit
    if len(name) + len(value) > MEMO_MAX_BYTES:
        return literal(name, value, INCREMENTAL)  # paid on every use: no Huffman pass
    encoded = literal(name, value, INCREMENTAL, huffman=True)
    if len(_memo) >= MEMO_ENTRIES:
        _memo.clear()
    _memo[key] = encoded
    return encoded


def memo_size() -> int:
    return len(_memo)


@mypyc_attr(native_class=False)  # a tuple subclass: a plain Python class when compiled (mypyc)
class NeverIndexed(tuple[bytes, bytes]):
    """A field sent as a never-indexed literal (RFC 7541 6.2.3): changes on every response, or must not be kept."""

    __slots__ = ()


class ResponseEncoder:
    """``hpack.Encoder``'s wire format and table semantics for a server connection (see the module docstring)."""

    def __init__(self) -> None:
        self._max = DEFAULT_TABLE_SIZE
        self._size = 0
        self._inserted = 0
        self._entries: deque[tuple[tuple[bytes, bytes], int, int]] = deque()
        """(field, insertion number, entry size), oldest first."""
        self._where: dict[tuple[bytes, bytes], int] = {}
        """field -> insertion number of its newest copy in the table."""
        self._pending: list[int] = []
        """Table sizes to signal at the start of the next block."""

    @property
    def header_table_size(self) -> int:
        return self._max

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        size = min(value, MAX_TABLE_SIZE)
        if size == self._max:
            return
        self._max = size
        self._evict(0)
        self._pending.append(size)

    @property
    def table_entries(self) -> int:
        return len(self._entries)

    def _evict(self, room: int) -> None:
        while self._entries and self._size + room > self._max:
            field, number, size = self._entries.popleft()
            self._size -= size
            if self._where.get(field) == number:
                del self._where[field]

    def _size_updates(self) -> bytes:
        pending, self._pending = self._pending, []
        smallest, final = min(pending), pending[-1]
        sizes = [smallest] if smallest == final else [smallest, final]
        return b"".join(_int(s, 5, 0x20) for s in sizes)

    def encode(self, headers: Iterable[Any]) -> bytes:
        """One header block; ``headers`` are ``(name, value)`` bytes pairs, :class:`NeverIndexed` ones included."""
        out: list[bytes] = []
        if self._pending:
            out.append(self._size_updates())
        for header in headers:
            name, value = header[0], header[1]
            if type(name) is not bytes or type(value) is not bytes:
                name, value = bytes(name), bytes(value)
            field = (name, value)
            static = _STATIC_FULL.get(field)
            if static is not None:
                out.append(_indexed(static))
                continue
            if type(header) is NeverIndexed:
                out.append(literal(name, value, NEVER))
                continue
            number = self._where.get(field)
            if number is not None:
                out.append(_indexed(_STATIC_LEN + 1 + self._inserted - number))
                continue
            size = ENTRY_OVERHEAD + len(name) + len(value)
            if size > self._max:
                # Would empty the table and still not fit (RFC 7541 4.4): send it without indexing.
                out.append(literal(name, value, WITHOUT))
                continue
            out.append(indexed_literal(name, value))
            self._evict(size)
            self._inserted += 1
            self._entries.append((field, self._inserted, size))
            self._where[field] = self._inserted
            self._size += size
        return b"".join(out)
