"""HPACK decoding (RFC 7541) for the HTTP/2 codec: one loop over the block, plain tuples out.

``hpack.Decoder`` was about half the codec's time per request; a flat loop does the same work. Same semantics and limits
as ``hpack.Decoder`` (the tests' oracle), see docs/proxy/limits.md. The short-string Huffman memo is never used for
never-indexed fields or credentials (``SECRET_NAMES``), so no short secret is a cache key."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from gatekeeper.proxy.h2wire.hpack_tables import STATIC_TABLE as STATIC
from gatekeeper.proxy.h2wire.huffman import HuffmanDecodingError, decode_memo, decode_memo_short

STATIC_LEN = len(STATIC)
ENTRY_OVERHEAD = 32
MAX_INT_BYTES = 5
"""Continuation bytes accepted in one integer: 2^35, far above any sane length or index."""
CREDENTIALS = frozenset({b"authorization", b"proxy-authorization"})
"""Header names that carry a credential (never memoized as plain fields)."""
SECRET_NAMES = CREDENTIALS | {b"cookie"}
"""Fields whose short values stay out of the short Huffman memo (long ones are memoized as before: tokens)."""


class HeaderBlockError(ValueError):
    """The block breaks RFC 7541 (bad index, truncated, bad Huffman, misplaced size update)."""


class HeaderListTooLarge(HeaderBlockError):
    """The decoded fields exceed ``max_header_list_size``."""


class BlockDecoder:
    """One connection's HPACK decoding context (its dynamic table)."""

    def __init__(self, max_header_list_size: int, max_table_size: int = 4096) -> None:
        self.max_header_list_size = max_header_list_size
        self.max_table_size = max_table_size
        """Upper bound for the encoder's size updates: the HEADER_TABLE_SIZE we advertise (default)."""
        self.table_size = max_table_size
        self._table: deque[tuple[bytes, bytes]] = deque()
        """Newest first: dynamic index 62 is ``_table[0]``."""
        self._used = 0

    def decode(self, data: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        table = self._table
        end = len(data)
        pos = 0
        total = 0
        limit = self.max_header_list_size
        while pos < end:
            b = data[pos]
            if b & 0x80:  # indexed field (6.1)
                index = b & 0x7F
                pos += 1
                if index == 0x7F:
                    index, pos = self._int(data, pos, 0x7F)
                if 0 < index <= STATIC_LEN:
                    field = STATIC[index - 1]
                elif STATIC_LEN < index <= STATIC_LEN + len(table):
                    field = table[index - STATIC_LEN - 1]
                else:
                    raise HeaderBlockError(f"index {index} outside the tables")
            elif b & 0xE0 == 0x20:  # dynamic table size update (6.3)
                if headers:
                    raise HeaderBlockError("table size update after a field")
                size, pos = self._int(data, pos + 1, 0x1F) if b & 0x1F == 0x1F else (b & 0x1F, pos + 1)
                if size > self.max_table_size:
                    raise HeaderBlockError(f"table size update to {size} above {self.max_table_size}")
                self.table_size = size
                self._evict(0)
                continue
            else:  # literal (6.2): with indexing (01), without (0000) or never indexed (0001)
                indexing = b & 0x40
                mask = 0x3F if indexing else 0x0F
                index = b & mask
                pos += 1
                if index == mask:
                    index, pos = self._int(data, pos, mask)
                if index:
                    if index <= STATIC_LEN:
                        name = STATIC[index - 1][0]
                    elif index <= STATIC_LEN + len(table):
                        name = table[index - STATIC_LEN - 1][0]
                    else:
                        raise HeaderBlockError(f"name index {index} outside the tables")
                else:
                    name, pos = self._string(data, pos, end, decode_memo_short)
                # 0001xxxx: sensitive (RFC 7541 7.1.3). Lower-cased now: an upper-case name is refused later,
                # but its value would already be in the memo.
                secret = (not indexing and b & 0x10) or name.lower() in SECRET_NAMES
                value, pos = self._string(data, pos, end, decode_memo if secret else decode_memo_short)
                field = (name, value)
                if indexing:
                    self._add(field)
            total += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            if total > limit:
                raise HeaderListTooLarge(f"header list larger than {limit} bytes")
            headers.append(field)
        return headers

    @staticmethod
    def _int(data: bytes, pos: int, prefix: int) -> tuple[int, int]:
        """The rest of an integer whose prefix bits were all ones (5.1); returns (value, next position)."""
        value = prefix
        shift = 0
        for i in range(pos, min(pos + MAX_INT_BYTES, len(data))):
            b = data[i]
            value += (b & 0x7F) << shift
            if not b & 0x80:
                return value, i + 1
            shift += 7
        raise HeaderBlockError("truncated or oversized integer")

    def _string(self, data: bytes, pos: int, end: int, huffman: Callable[[bytes], bytes]) -> tuple[bytes, int]:
        if pos >= end:
            raise HeaderBlockError("truncated string")
        b = data[pos]
        length = b & 0x7F
        pos += 1
        if length == 0x7F:
            length, pos = self._int(data, pos, 0x7F)
        stop = pos + length
        if stop > end:
            raise HeaderBlockError("string runs past the block")
        raw = data[pos:stop]
        if b & 0x80:
            try:
                return huffman(raw), stop
            except HuffmanDecodingError as exc:
                raise HeaderBlockError(f"bad Huffman string: {exc}") from None
        return raw, stop

    def _add(self, field: tuple[bytes, bytes]) -> None:
        size = len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
        if size > self.table_size:  # 4.4: an entry larger than the table empties it
            self._table.clear()
            self._used = 0
            return
        self._evict(size)
        self._table.appendleft(field)
        self._used += size

    def _evict(self, room: int) -> None:
        table = self._table
        while table and self._used + room > self.table_size:
            name, value = table.pop()
            self._used -= len(name) + len(value) + ENTRY_OVERHEAD
