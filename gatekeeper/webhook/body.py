"""A review body held once while it is read, and the heap given back after a large one is decoded.

Why not aiohttp's ``request.read()``: it raises the stream's pause threshold to twice ``client_max_size`` (12 MiB
at the defaults, so a fast sender's body piles up in the stream), appends every chunk to a growing ``bytearray``
(each growth may copy it) and then copies that into ``bytes``: a body of ``maxBodyBytes`` was about twice its
size at once, which is why the worst case (docs/webhook/hardening.md) carried 2 x ``maxBufferedBodyBytes``
for bodies being read.

Here the body is copied, chunk by chunk as it arrives, into one buffer of its final size (the ``Content-Length``
the apiserver always sends; ``maxBodyBytes`` for a chunked body, which is what the body budget reserves for one),
and the stream keeps its default pause threshold (128 KiB). A body still arriving goes into an anonymous private
mapping: its pages are memory only once written, so while the handler waits for the rest, the buffer and the
bytes the stream holds between two turns of the loop add up to at most the body's size, which is what the budget
reserved (a ``bytearray`` is zeroed, all of it resident, at once); and it is unmapped, given back to the kernel,
when the last view of it goes. A body received whole before the handler runs (the usual small review) is copied
into a ``bytearray`` without waiting: nothing arrives meanwhile. orjson decodes the view itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Callable

from aiohttp import StreamReader


class BodyTooLarge(Exception):
    """The body is longer than the limit (``maxBodyBytes``): answered 413, like aiohttp's own refusal."""


async def read_body(content: StreamReader, length: int | None, limit: int) -> memoryview:
    """The whole body of a request, in one buffer of ``length`` bytes (``None``: chunked, ``limit``).

    Raises :class:`BodyTooLarge` as soon as the body is known to exceed ``limit`` (a declared length at once,
    a chunked body when its bytes pass it), and whatever the stream raises (a malformed chunked body). The view
    keeps the buffer: a mapping is unmapped when the view and every slice of it are gone."""
    if length is not None and length > limit:
        raise BodyTooLarge(length)
    size = limit if length is None else length
    buf: bytearray | mmap.mmap = (bytearray(size) if content.is_eof() or not size else
                                  mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE))
    pos = 0
    with memoryview(buf) as view:  # assigning into a bytearray's slice would copy a bytes chunk first
        while True:
            # readchunk, not readany: readany joins every chunk the stream holds into one more copy
            chunk, chunk_end = await content.readchunk()
            if not chunk:
                # (b"", True) is a chunked body's chunk boundary, not its end, except from aiohttp's shared empty
                # payload, which answers it for ever once read (taken for a boundary, a bodiless review spins)
                if chunk_end and not content.at_eof():
                    continue
                break
            end = pos + len(chunk)
            if end > size:  # more than declared cannot arrive (the parser stops there): a chunked body past limit
                raise BodyTooLarge(end)
            view[pos:end] = chunk
            pos = end
    return memoryview(buf)[:pos]


def heap_trimmer() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library is not glibc (musl, others: no such call).

    Why: decoding a large review makes millions of small objects; freed, they leave the heap fragmented and a
    worker kept 33-89 MiB more RSS than at rest after hostile reviews, until another review reused it.
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
