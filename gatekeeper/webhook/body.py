"""A review body held once while it is read, and the heap given back after a large one is decoded.

Why not aiohttp's ``request.read()``: it raises the stream's pause threshold to twice ``client_max_size`` (12 MiB
at the defaults, so a fast sender's whole body piles up in the stream), appends every chunk to a growing
``bytearray`` (each growth may copy it) and then copies that into ``bytes``: a body of ``maxBodyBytes`` was about
twice its size at once, which is why the README's worst case carried 2 x ``maxBufferedBodyBytes`` for bodies
being read. Here the buffer is allocated once at its final size (the ``Content-Length`` the apiserver always
sends; ``maxBodyBytes`` for a chunked body, which is what the body budget reserves for one) and chunks are copied
into it as they arrive, while the stream keeps its default pause threshold (128 KiB): one copy of the body, plus
at most that much not yet taken. orjson decodes the ``bytearray`` itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

from aiohttp import StreamReader


class BodyTooLarge(Exception):
    """The body is longer than the limit (``maxBodyBytes``): answered 413, like aiohttp's own refusal."""


async def read_body(content: StreamReader, length: int | None, limit: int) -> bytearray:
    """The whole body of a request, held in one buffer of ``length`` bytes (``None``: chunked, ``limit``).

    Raises :class:`BodyTooLarge` as soon as the body is known to exceed ``limit`` (a declared length at once,
    a chunked body when its bytes pass it), and whatever the stream raises (a malformed chunked body)."""
    if length is not None and length > limit:
        raise BodyTooLarge(length)
    size = limit if length is None else length
    buf = bytearray(size)
    pos = 0
    with memoryview(buf) as view:  # assigning into a bytearray's slice would copy a bytes chunk first
        while True:
            # readchunk, not readany: readany joins every chunk the stream holds into one more copy
            chunk, chunk_end = await content.readchunk()
            if not chunk:
                if chunk_end:  # a chunked body's chunk boundary, not its end
                    continue
                break
            end = pos + len(chunk)
            if end > size:  # more than declared cannot arrive (the parser stops there): a chunked body past limit
                raise BodyTooLarge(end)
            view[pos:end] = chunk
            pos = end
    if pos < size:
        del buf[pos:]  # a chunked body (shrunk in place), or a declared length the stream ended short of
    return buf


def heap_trimmer() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library is not glibc (musl, others: no such call).

    Why: decoding a large review makes millions of small objects; freed, they leave the heap fragmented and a
    worker kept 47-89 MiB more RSS than at rest after one hostile review, until another review reused it.
    ``malloc_trim`` gives the free pages back (1-3 ms after such a decode, ~10 us when there is nothing to give);
    it is called only after a review past ``TRIM_AFTER_BYTES``, never per small review."""
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")  # only glibc answers it
    except (ValueError, OSError):
        glibc = None
    if not glibc:
        return None
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


TRIM_AFTER_BYTES = 1 << 20
"""Bodies at least this large are followed by :func:`heap_trimmer`'s call. The apiserver's reviews are a few KiB;
a review of 1 MiB already decodes to up to ~25 MiB of objects, so a trim's 1-3 ms is small beside its decoding."""
