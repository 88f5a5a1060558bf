"""The constants of HPACK (RFC 7541): its static table and its Huffman code (pure; the encoder codes with them).

Written from the RFC (the tests check them against ``hpack``'s). The Huffman code is canonical, so its 257 code lengths
determine every code: the table is those lengths, one letter each (``A`` = 5 bits)."""

from __future__ import annotations

_WITH_VALUES = [
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"), (":path", "/index.html"),
    (":scheme", "http"), (":scheme", "https"), (":status", "200"), (":status", "204"), (":status", "206"),
    (":status", "304"), (":status", "400"), (":status", "404"), (":status", "500"), ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
]
_NAMES_ONLY = (
    "accept-language accept-ranges accept access-control-allow-origin age allow authorization cache-control "
    "content-disposition content-encoding content-language content-length content-location content-range "
    "content-type cookie date etag expect expires from host if-match if-modified-since if-none-match if-range "
    "if-unmodified-since last-modified link location max-forwards proxy-authenticate proxy-authorization range "
    "referer refresh retry-after server set-cookie strict-transport-security transfer-encoding user-agent vary "
    "via www-authenticate"
).split()
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = tuple(
    (name.encode(), value.encode()) for name, value in [*_WITH_VALUES, *((n, "") for n in _NAMES_ONLY)])
"""Appendix A: index 1 is ``STATIC_TABLE[0]``."""

_LENGTH_LETTERS = (
    "ISXXXXXXXTZXXZXXXXXXXXZXXXXXXXXXBFFHIBDGFFDGDBBBAAABBBBBBBCDKBHFIBCCCCCCCCCCCCCCCCCCCCCCDCDIOIJBKABABABBBACCBBBA"
    "BCBAABCCCCCKGJIXPRPPRRRSRSSSSSTSTTRSTSSSSQRSRSSTRQPRRSSQSRRTQRSSQQRQSRSSPRRRSRRSVVPORSRUVVVWWVTUOQVWWVWTQQVVXWWW"
    "PTPQRQQSRRUUTTVSVWVVWWWWWXWWWWWVZ"
)
HUFFMAN_LENGTHS: tuple[int, ...] = tuple(ord(c) - ord("A") + 5 for c in _LENGTH_LETTERS)
"""Bits of the code of each symbol 0..255, then EOS (256)."""


def _canonical_codes(lengths: tuple[int, ...]) -> tuple[int, ...]:
    codes = [0] * len(lengths)
    code, previous = -1, min(lengths)
    for symbol in sorted(range(len(lengths)), key=lambda s: (lengths[s], s)):
        code = (code + 1) << (lengths[symbol] - previous)
        previous = lengths[symbol]
        codes[symbol] = code
    return tuple(codes)


HUFFMAN_CODES = _canonical_codes(HUFFMAN_LENGTHS)
"""The code of each symbol, right-aligned in ``HUFFMAN_LENGTHS[symbol]`` bits."""
