"""HPACK Huffman decoding (RFC 7541 5.2 and Appendix B): one table step per input byte, and its memo.

Huffman strings are the most CPU per byte a client can make the proxy spend, and ``hpack`` walks the tree a nibble at a
time. This is a state machine over the code tree's 256 internal nodes plus an error state: each input byte is one lookup
in flat lists. After the last byte the machine must rest on the all-ones path at depth 0..7 (padding a prefix of EOS);
anything else, EOS included, raises :class:`HuffmanDecodingError`.

The memos are bounded LRUs keyed by the coded bytes; errors are never cached. A hit tells a client only that it sent
identical bytes, and its timing gain is far below network jitter. ``decode_memo`` keeps the ~1 KB bearer token decoded
once; huge strings are not kept (a memory sink). ``decode_memo_short`` is a separate LRU for other fields, so many
distinct paths cannot evict tokens; callers keep credentials and never-indexed fields out."""

from __future__ import annotations

import functools

from gatekeeper.proxy.h2wire.hpack_tables import HUFFMAN_CODES, HUFFMAN_LENGTHS

MEMO_MIN_BYTES = 64
MEMO_MAX_BYTES = 8192
MEMO_ENTRIES = 256
SHORT_MEMO_MIN_BYTES = 4
"""A hit costs ~0.05 us at any length against ~0.33 us to decode 4 bytes: from 4 bytes the memo pays off above
a ~40% hit rate; shorter strings save too little."""
SHORT_MEMO_ENTRIES = 1024
"""Keys under MEMO_MIN_BYTES: at most ~64 coded + ~100 decoded bytes each, ~300 KB in all."""

EOS = 256
ERROR = 256
"""The absorbing error state, after the 256 internal nodes."""
_ROW = 8
"""A state's row starts at ``state << _ROW``: one row of 256 entries per state, indexed by the input byte."""
START = (ERROR + 1) << _ROW
"""The index of an extra entry whose next state is the root: where every string starts."""


class HuffmanDecodingError(ValueError):
    """The string breaks RFC 7541 5.2: EOS inside, or padding that is not 0..7 one bits."""


Tables = tuple[list[int], list[bytes], frozenset[int]]
_tables: Tables | None = None


def _code_tree() -> list[list[int]]:
    """Children of every internal node, ``[zero, one]``: a node number (>= 0) or ``~symbol`` for a leaf."""
    nodes = [[0, 0]]
    for symbol, (code, length) in enumerate(zip(HUFFMAN_CODES, HUFFMAN_LENGTHS, strict=True)):
        node = 0
        for shift in range(length - 1, 0, -1):
            bit = (code >> shift) & 1
            child = nodes[node][bit]
            if child == 0:  # the root is never a child, so 0 means "not made yet"
                nodes.append([0, 0])
                child = nodes[node][bit] = len(nodes) - 1
            node = child
        nodes[node][code & 1] = ~symbol
    if len(nodes) != EOS:
        raise AssertionError(f"{len(nodes)} internal nodes: the code table is not a full prefix code")
    return nodes


def _walk(nodes: list[list[int]], node: int, value: int, bits: int) -> tuple[int, tuple[int, ...]]:
    """(node reached, symbols completed) reading ``bits`` bits of ``value`` from ``node``, MSB first."""
    symbols: tuple[int, ...] = ()
    for shift in range(bits - 1, -1, -1):
        child = nodes[node][(value >> shift) & 1]
        if child >= 0:
            node = child
            continue
        if ~child == EOS:
            return ERROR, ()
        symbols += (~child,)
        node = 0
    return node, symbols


def _build() -> Tables:
    """The byte-step tables, composed from nibble steps (16x fewer tree walks than walking 8 bits per entry)."""
    global _tables
    nodes = _code_tree()
    nibble = [[_walk(nodes, node, v, 4) for v in range(16)] for node in range(EOS)]
    shifted = [state << _ROW for state in range(ERROR + 1)]
    emitted: dict[tuple[int, ...], bytes] = {}
    following = [shifted[ERROR]] * (START + 1)
    output = [b""] * (START + 1)
    for node in range(EOS):
        row = node << _ROW
        for byte in range(256):
            middle, first = nibble[node][byte >> 4]
            if middle == ERROR:
                continue
            end, second = nibble[middle][byte & 15]
            if end == ERROR:
                continue
            symbols = first + second
            following[row | byte] = shifted[end]
            out = emitted.get(symbols)
            if out is None:
                out = emitted[symbols] = bytes(symbols)
            output[row | byte] = out
    following[START] = 0
    accepting = set()
    node = 0
    for _ in range(8):  # padding: 0..7 one bits, the most significant bits of EOS
        accepting.add(node << _ROW)
        node = nodes[node][1]
    _tables = (following, output, frozenset(accepting))
    return _tables


def decode(data: bytes | bytearray | memoryview) -> bytes:
    """The octets a Huffman-coded HPACK string stands for; :class:`HuffmanDecodingError` if it is invalid."""
    following, output, accepting = _tables or _build()
    i = START
    out = b"".join([output[i := following[i] | byte] for byte in data])
    if following[i] not in accepting:
        raise HuffmanDecodingError("invalid Huffman string: EOS inside, or padding that is not 0..7 one bits")
    return out


_memo = functools.lru_cache(maxsize=MEMO_ENTRIES)(decode)
_short_memo = functools.lru_cache(maxsize=SHORT_MEMO_ENTRIES)(decode)


def decode_memo(data: bytes | bytearray | memoryview) -> bytes:
    """:func:`decode`, memoized for strings of MEMO_MIN_BYTES..MEMO_MAX_BYTES (any field, tokens included)."""
    if type(data) is bytes and MEMO_MIN_BYTES <= len(data) <= MEMO_MAX_BYTES:
        return _memo(data)
    return decode(data)


def decode_memo_short(data: bytes) -> bytes:
    """:func:`decode_memo`, and from SHORT_MEMO_MIN_BYTES for fields that are neither credentials nor never-indexed."""
    size = len(data)
    if size < MEMO_MIN_BYTES:
        if size >= SHORT_MEMO_MIN_BYTES and type(data) is bytes:
            return _short_memo(data)
        return decode(data)
    if size <= MEMO_MAX_BYTES and type(data) is bytes:
        return _memo(data)
    return decode(data)

