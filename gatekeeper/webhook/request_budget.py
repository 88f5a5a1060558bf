"""A per-worker ceiling on request bytes the HTTP layer holds before a review reads them (maxBufferedRequestBytes).

Why: aiohttp keeps a request head whole, as parsed Python objects (~3x its bytes), from its first byte until the
request is answered, and keeps up to 32 parsed requests per connection queued behind the one being answered
(pipelining), each with its body. The per-head limits (``maxHeaderFields`` x ``maxHeaderFieldBytes``) bound one
head, not a connection or the worker. Measured on one worker (peak RSS; the run is in
loadtest/reports/2026-12-03-readme-history.md): 1000 connections of unfinished 254 KiB heads took it from 53 to 794
MiB (111 MiB with this budget), and 25 that pipeline 40 requests with such heads and never read their answers to 412
MiB (146); the chart's pod limit is 512 MiB for two workers then (1280 MiB since the worst case was re-derived and
its decoding term measured: docs/webhook/hardening.md).

What a connection is counted for, in bytes as received:

* the head it is in the middle of (:class:`UnfinishedHead`, an upper bound the parser's own progress keeps exact
  at every completed head);
* the head of every request parsed and not answered yet: queued behind a pipelined one, or being answered
  (:func:`head_size`), and the head of the request last answered, which aiohttp's request loop keeps until the
  next one arrives (measured: 750 KiB per idle connection after one 254 KB head);
* the body bytes of requests parsed and not yet handed to a handler (pipelined, queued);
* the bytes of the answers the client's kernel has not acknowledged (``TCP_INFO``): uvloop's TLS transport hands
  a whole answer to its TCP buffer at once, so no drain ever waited for a client that does not read
  (``listen.MeteredRequestHandler.will_write``; measured: 3.8 GiB for 1000 of them asking for 1 MiB answers).

A body a handler is reading is not counted here: a review reserves it in the ``BodyBudget``
(``maxBufferedBodyBytes``) before reading, and counting it twice would let a crowd of small holders make a large
review the biggest holder (see :class:`RequestBudget`).

Sans-IO: no asyncio, no sockets; ``listen.MeteredRequestHandler`` feeds it what aiohttp's parser did.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain
from typing import Generic, TypeVar

H = TypeVar("H")

TERMINATOR = b"\r\n\r\n"
"""Ends every request head: aiohttp's request parser (llhttp, strict) requires CRLF line ends, and a blank line ends
the head. (Only its response parser is lenient.)"""


class RequestBudget(Generic[H]):
    """Bytes held by the connections (holders) of one worker, against ``limit``.

    Over the limit, the connection holding the most is closed, repeatedly, until the total is back under it; that
    may be the connection whose bytes just arrived. Why the largest and not the newcomer: refusing the newcomer lets
    whoever filled the budget first keep it, so a pod holding unfinished heads would have every later apiserver
    request refused until ``idleTimeoutSeconds``. The largest holder is the one costing the most memory, and it is
    never an apiserver connection while ``limit / maxConnections`` exceeds an apiserver's request head (~1 KiB; 8 KiB
    at the defaults): with the total over the limit, some connection holds more than that average. Ties go to the
    connection that started holding first.
    """

    __slots__ = ("held", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.held: dict[H, int] = {}
        """Bytes per holder that holds any (insertion order: first holder first)."""

    def hold(self, holder: H, size: int) -> list[H]:
        """``holder`` now holds ``size`` bytes; returns the holders to close, their bytes already released."""
        old = self.held.get(holder, 0)
        self.used += size - old
        if size:
            self.held[holder] = size
        elif old:
            del self.held[holder]
        victims: list[H] = []
        while self.used > self.limit:
            victim = max(self.held, key=self.held.__getitem__)
            self.used -= self.held.pop(victim)
            victims.append(victim)
        return victims

    def drop(self, holder: H) -> None:
        """``holder`` is gone: release what it held."""
        self.used -= self.held.pop(holder, 0)


def head_size(method: str, path: str, raw_headers: Iterable[tuple[bytes, bytes]]) -> int:
    """At most the bytes a parsed head took on the wire: request line, fields, CRLFs (not the whitespace around
    values, which the parser drops, nor leading blank lines). A lower bound is what :class:`UnfinishedHead` needs to
    never count less than the parser holds; it is also about what the parsed head keeps."""
    fields = tuple(raw_headers)
    return len(method) + len(path) + 14 + 3 * len(fields) + sum(map(len, chain.from_iterable(fields)))


def _first_end(carry: bytes, data: bytes, start: int) -> int | None:
    """Offset into ``data`` where the first CRLFCRLF starting at or after ``start`` ends; from 0 one may straddle
    ``carry``, the end of the previous chunk."""
    if start == 0:
        i = (carry + data[:3]).find(TERMINATOR)
        if i >= 0:
            return i + 4 - len(carry)
    i = data.find(TERMINATOR, start)
    return None if i < 0 else i + 4


class UnfinishedHead:
    """An upper bound of the bytes of the head a connection's parser holds unfinished, chunk after chunk.

    The parser does not say where in a chunk a head ended, so three bounds are kept and the least is taken; each
    one is never below the truth (a count below it would let a client hold memory uncounted). The usual chunk, one
    whole request starting it, is measured exactly and cheaply instead (:meth:`head_end`).

    * conservation: what was held before, plus the chunk, minus what left as completed heads (:func:`head_size`, a
      lower bound of their bytes) and as body bytes. Always valid, but it drifts up by the whitespace and chunked
      framing of every request, so alone it would make a long-lived apiserver connection look bigger and bigger;
    * walking the chunk: the first new head ends at or after the first CRLFCRLF past the previous request's body
      bytes, its body follows, the next head ends at or after the next CRLFCRLF past that, and so on; the bytes
      after the last body are the most the unfinished head can be. Exact for any mix of Content-Length and bodiless
      requests, whatever their bodies contain (the apiserver's reviews). Needs every byte before the chunk parsed;
    * after the last CRLFCRLF of the chunk: an unfinished head contains none (a blank line would have ended it),
      so it lies after that point. Exact after a chunked body (which ends with one) or a request without a body.
      Needs every byte before and in the chunk parsed.

    Not every byte is parsed after aiohttp paused the parser (32 requests queued, a full body buffer: the rest of
    the chunk waits in it) or took the rest of a chunk aside (an upgrade); the caller says so with ``whole_next``.
    While the parser is inside a body it holds no head: 0, exactly.
    """

    __slots__ = ("_carry", "_in_body", "_whole", "held")

    def __init__(self) -> None:
        self.held = 0
        self._carry = b""
        self._whole = True
        self._in_body = False

    @property
    def whole(self) -> bool:
        """Every byte fed so far was parsed (aiohttp holds none aside)."""
        return self._whole

    def head_end(self, data: bytes) -> int | None:
        """Where in ``data`` a head ends when the chunk starts one: nothing held, no body under way, every byte
        before parsed, and a request line (not a blank line) first. Then the bytes up to the first CRLFCRLF are
        that head, exactly, whitespace and all; a cheaper and exact :func:`head_size` for the usual chunk."""
        if self.held or self._in_body or not self._whole or not data or data[0] in b"\r\n":
            return None
        i = data.find(TERMINATOR)
        return None if i < 0 else i + 4

    def fed(self, data: bytes, body_before: int, heads: Sequence[tuple[int, int]], *,
            in_body: bool, whole_next: bool, exact: bool = False) -> int:
        """The parser took ``data``: ``body_before`` raw body bytes of the request it was in, then ``heads``, each as
        (:func:`head_size`, raw body bytes that followed it here); it is ``in_body`` now. Returns the new bound.
        ``exact``: the head sizes are the heads' bytes (:meth:`head_end`), so conservation alone is exact."""
        self._in_body = in_body
        if in_body:
            held = 0
        elif exact:  # the usual chunk: one whole request, its head measured by head_end (nothing held before)
            held = max(len(data) - body_before - sum(head + body for head, body in heads), 0)
            if held and whole_next:
                held = self._after_last_terminator(data, held)
        else:
            held = self.held + len(data) - body_before - sum(head + body for head, body in heads)
            if self._whole and data:
                if heads:
                    pos = body_before
                    for _, body in heads:
                        end = _first_end(self._carry, data, pos)
                        if end is None:
                            break
                        pos = end + body
                    else:
                        held = min(held, len(data) - pos)
                if held > 0 and whole_next:
                    held = self._after_last_terminator(data, held)
            held = max(held, 0)
        self.held = held
        self._carry = data[-3:] if len(data) >= 3 else (self._carry + data)[-3:]
        self._whole = whole_next
        return held

    def _after_last_terminator(self, data: bytes, held: int) -> int:
        i = data.rfind(TERMINATOR)
        last = i + 4 if i >= 0 else _first_end(self._carry, data[:3], 0)
        return held if last is None else min(held, len(data) - last)
