"""Where a watch-list's initial events end, read from the response bytes the apiserver sends (pure, no I/O).

A reflector's watch-list (KEP-3157: ``watch=1&sendInitialEvents=true``) streams every object of the collection as an
ADDED event, then one BOOKMARK annotated ``k8s.io/initial-events-end: "true"``. Up to that bookmark the apiserver
does a LIST's work; after it the request is an ordinary watch. Flow control holds the LIST's seats until then, so the
end must be found in the stream, and a tenant must not be able to fake it with an object's content:

* JSON (``application/json``): one event per line. Go's encoder escapes every control byte inside a string, so a raw
  newline only ever ends an event, and the event's ``type`` is its first key: an event that starts with
  ``{"type":"BOOKMARK"`` was written by the apiserver. An object may hold the same text nested in its own fields,
  never at the start of a line. A bookmark's object is the apiserver's too (a resourceVersion and the annotation;
  a Table, asked with ``as=Table``, has no annotations, so its first bookmark ends the initial events).
* Protobuf (``application/vnd.kubernetes.protobuf;stream=watch``): frames of a 4-byte big-endian length and a
  ``WatchEvent`` whose field 1 is the type; the same reasoning holds per frame.
* ``Content-Encoding: gzip`` (WatchListCompression, beta and on in v1.37 for clients that accept gzip, as Go's
  transport does by default): inflated on the fly, at most ``INFLATE_STEP`` bytes of output per step.

Anything else (CBOR, another encoding, a corrupt gzip stream) is unsupported: the caller falls back to a time bound.
Only the start of each event and a bookmark's few bytes are kept, whatever the collection's size.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

JSON_BOOKMARK = b'{"type":"BOOKMARK"'
JSON_END = b'"k8s.io/initial-events-end":"true"'
JSON_TABLE_BOOKMARK = b'{"type":"BOOKMARK","object":{"kind":"Table",'
"""A watch-list asked as a Table (``Accept: application/json;as=Table``): the apiserver's bookmark is a Table, whose
metadata has no annotations, so its first bookmark (sent after the initial events) is the end."""
PROTO_BOOKMARK = b"\x0a\x08BOOKMARK"
"""Field 1 (type, length-delimited), 8 bytes, ``BOOKMARK``: how a protobuf WatchEvent of that type starts."""
PROTO_END = b"\x0a\x19k8s.io/initial-events-end\x12\x04true"
"""The annotations map entry (key field 1, value field 2) as a bookmark's ObjectMeta carries it."""
BOOKMARK_MAX = 64 << 10
"""A bookmark event longer than this is not the end marker (the apiserver's are about 200 bytes)."""
INFLATE_STEP = 256 << 10


class Inflater:
    """gzip as the apiserver writes it: members one after another (one per flush), inflated in bounded steps."""

    __slots__ = ("_z",)

    def __init__(self) -> None:
        self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)

    def pieces(self, chunk: bytes) -> Iterator[bytes]:
        """The decoded bytes of ``chunk``, at most ``INFLATE_STEP`` at a time; raises ``zlib.error`` when corrupt."""
        pending = chunk
        while pending:
            z = self._z
            out = z.decompress(pending, INFLATE_STEP)
            pending = z.unconsumed_tail
            if z.eof:
                pending = z.unused_data
                self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            if out:
                yield out


class DecodedSize:
    """A response's size as the apiserver holds it: gzip decoded (a client picks the encoding, so a size learned as
    sent would let it pull a shared estimate down), and its first decoded bytes (a LIST's continue token)."""

    __slots__ = ("_inflate", "decoded", "failed", "head")

    def __init__(self, content_encoding: str) -> None:
        gzip = content_encoding.strip().lower() == "gzip"
        self._inflate = Inflater() if gzip else None
        self.decoded = 0
        self.head = b""
        self.failed = not gzip and content_encoding.strip().lower() not in ("", "identity")
        """An encoding it cannot read, or a corrupt stream: the size as sent is all there is."""

    def feed(self, chunk: bytes) -> bool:
        """Count ``chunk``; always False (the shape of a read-ahead ``until``: a LIST has no end to find)."""
        if self.failed:
            return False
        if self._inflate is None:
            self._count(chunk)
            return False
        try:
            for piece in self._inflate.pieces(chunk):
                self._count(piece)
        except zlib.error:
            self.failed = True
        return False

    def _count(self, data: bytes) -> None:
        if len(self.head) < 4096:
            self.head += data[: 4096 - len(self.head)]
        self.decoded += len(data)


def _media_type(content_type: str) -> str:
    return content_type.partition(";")[0].strip().lower()


class InitialEventsEnd:
    """Feed a watch-list response's body, chunk by chunk; :meth:`feed` says when the initial events have ended."""

    __slots__ = ("_event", "_frame_left", "_header", "_inflate", "_kind", "_proto", "decoded", "ended", "supported")

    def __init__(self, content_type: str, content_encoding: str = "") -> None:
        media = _media_type(content_type)
        encoding = content_encoding.strip().lower()
        self._proto = media == "application/vnd.kubernetes.protobuf"
        self.supported = (media == "application/json" or self._proto) and encoding in ("", "identity", "gzip")
        """False for a format this cannot read: the caller's time bound decides instead."""
        self._inflate = Inflater() if encoding == "gzip" else None
        self.decoded = 0
        """Bytes of events seen (after gzip); at the end, the initial events' size: what the LIST would have been."""
        self.ended = False
        self._event = bytearray()
        """The start of the current event (enough to know its type), or a whole bookmark."""
        self._kind = 0
        """0: not known yet; 1: a bookmark, kept whole; 2: anything else, skipped."""
        self._header = bytearray()
        self._frame_left = -1
        """Protobuf: bytes of the current frame still to come (-1: reading the next frame's length)."""

    def feed(self, chunk: bytes) -> bool:
        """Whether the initial-events-end bookmark has been seen, up to and including ``chunk``."""
        if self.ended or not self.supported or not chunk:
            return self.ended
        if self._inflate is None:
            self._scan(chunk)
            return self.ended
        try:
            for piece in self._inflate.pieces(chunk):
                self._scan(piece)
                if self.ended:
                    break
        except zlib.error:
            self.supported = False
        return self.ended

    def _scan(self, data: bytes) -> None:
        if data:
            self.decoded += len(data)
            if self._proto:
                self._frames(data)
            else:
                self._lines(data)

    def _take(self, part: bytes | memoryview, marker: bytes) -> None:
        """Add to the current event as much as deciding its type (and reading a bookmark) needs."""
        if self._kind == 0:
            need = len(marker) - len(self._event)
            self._event += part[:need]
            if len(self._event) < len(marker):
                return
            if not self._event.startswith(marker):
                self._kind = 2
                self._event.clear()
                return
            self._kind = 1
            part = part[need:]
        if len(self._event) + len(part) > BOOKMARK_MAX:
            self._kind = 2  # too long to be the apiserver's marker: skip the rest of it
            self._event.clear()
            return
        self._event += part

    def _event_done(self, end_marker: bytes) -> None:
        if self._kind == 1 and (end_marker in self._event or self._event.startswith(JSON_TABLE_BOOKMARK)):
            self.ended = True
        self._event.clear()
        self._kind = 0

    def _lines(self, data: bytes) -> None:
        view = memoryview(data)
        start, n = 0, len(data)
        while start < n:
            nl = data.find(b"\n", start)
            stop = n if nl < 0 else nl
            if self._kind != 2 and stop > start:
                self._take(view[start:stop], JSON_BOOKMARK)
            if nl < 0:
                return
            self._event_done(JSON_END)
            if self.ended:
                return
            start = nl + 1

    def _frames(self, data: bytes) -> None:
        view = memoryview(data)
        pos, n = 0, len(data)
        while pos < n:
            if self._frame_left < 0:
                need = 4 - len(self._header)
                self._header += view[pos : pos + need]
                pos += min(need, n - pos)
                if len(self._header) < 4:
                    return
                self._frame_left = int.from_bytes(self._header, "big")
                self._header.clear()
            take = min(self._frame_left, n - pos)
            if self._kind != 2 and take:
                self._take(view[pos : pos + take], PROTO_BOOKMARK)
            pos += take
            self._frame_left -= take
            if self._frame_left == 0:
                self._frame_left = -1
                self._event_done(PROTO_END)
                if self.ended:
                    return
