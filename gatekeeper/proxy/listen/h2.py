"""HTTP/2 server connection with graceful GOAWAY, on the proxy's own sans-IO codec (``h2_codec``).

:class:`H2Protocol` never touches a socket: it is fed bytes and given ``write`` (synchronous, so frames keep the codec's
order), ``drain`` and ``close``, so tests wire it to an in-memory h2 client. The limits are in docs/proxy/limits.md.

This module holds the connection's life (events in, GOAWAY and drain, idle timer, flush); serving each stream
(request body, response, windows, deadline) is ``h2_stream``.

Graceful GOAWAY as Go's server does it: our GOAWAY names the highest stream seen, later streams are refused, in-flight
ones finish (long-running until the drain deadline), then the socket closes ``close_delay`` later so the client reads
the final frame first; client-go then reconnects and quietly re-watches."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any, cast

from gatekeeper.proxy import rejections
from gatekeeper.proxy.adapter import (
    ClientGone,
)
from gatekeeper.proxy.h2wire import frames
from gatekeeper.proxy.h2wire.errors import ErrorCodes, ProtocolError, StreamClosedError
from gatekeeper.proxy.listen import conn_metrics
from gatekeeper.proxy.listen import h2_codec as ev
from gatekeeper.proxy.listen.body_budget import RequestBodyBudget
from gatekeeper.proxy.listen.goaway import GoawayDecider, Reason
from gatekeeper.proxy.listen.h2_codec import Event, H2ServerCodec, HeaderBudgetExceeded
from gatekeeper.proxy.listen.h2_headers import MalformedRequest, parse_request
from gatekeeper.proxy.listen.h2_limits import FloodError, FloodGuard, limits_of
from gatekeeper.proxy.listen.h2_stream import Stream, StreamServing
from gatekeeper.proxy.listen.settings import ProtocolSettings
from gatekeeper.proxy.messages import Handler, ProxyRequest

log = logging.getLogger("gatekeeper.proxy.listen.h2")


CONNECTION_WINDOW_FACTOR = 4
"""Connection receive window = this many stream windows: bounds request-body memory per connection."""


def connection_window(settings: ProtocolSettings) -> int:
    """CONNECTION_WINDOW_FACTOR stream windows, capped at 2^31-1: a larger increment is an invalid WINDOW_UPDATE."""
    return min(settings.stream_window_bytes * CONNECTION_WINDOW_FACTOR, frames.MAX_WINDOW)


def _refusal_counter(connection_id: int, streams: dict[int, Any]) -> Callable[[int], None]:
    """The codec's callback for a stream refused over MAX_CONCURRENT_STREAMS (the client may retry it).

    Not a bound method: the codec would hold the protocol that holds the codec, a cycle that kept every closed
    connection (and its transport's TLS buffers) until a full garbage collection."""

    def refused(stream_id: int) -> None:
        conn_metrics.REFUSED_STREAMS.inc()
        log.debug("h2 connection %d: stream %d refused, %d streams open", connection_id, stream_id, len(streams))

    return refused


class H2Protocol(StreamServing):
    """One HTTP/2 client connection; see the module docstring for the I/O contract."""

    def __init__(
        self,
        handler: Handler,
        settings: ProtocolSettings,
        *,
        write: Callable[[bytes], None],
        drain: Callable[[], Awaitable[None]],
        close: Callable[[], None],
        peer: str = "",
        peer_cert: dict[str, Any] | None = None,
        connection_id: int = 0,
        rng: Callable[[], float] = random.random,
        close_delay: float = 1.0,
        body_budget: RequestBodyBudget | None = None,
    ) -> None:
        self._handler = handler
        self._settings = settings
        self._write, self._drain, self._close = write, drain, close
        self._peer, self._peer_cert = peer, peer_cert
        self.connection_id = connection_id
        self._decider = GoawayDecider(settings.goaway_chance, rng)
        self._goaway_chance = settings.goaway_chance > 0.0
        """No coin to toss per stream when the chance is 0 (the default)."""
        self._close_delay = close_delay
        self._budget = (body_budget or RequestBodyBudget(settings.max_buffered_request_bytes, gauge=None)).share()
        self._window_reopened_at = -math.inf
        """When an acknowledgement last reopened a shut connection receive window (request-body idle clock)."""
        guard = FloodGuard(limits_of(settings), settings.h2_abuse_interval_seconds)
        self._streams: dict[int, Stream] = {}
        self._conn = H2ServerCodec(
            on_refused=_refusal_counter(connection_id, self._streams), guard=guard,
            max_concurrent_streams=settings.max_concurrent_streams,
            stream_window=settings.stream_window_bytes,
            max_header_list=settings.max_header_list_bytes,
            connection_window=connection_window(settings),
            header_budget=self._budget,
        )
        self._receive: Callable[[bytes], list[Event]] = self._conn.receive_data
        self._memo: dict[str, Any] = {}
        """ProxyRequest.connection_memo of every request on this connection."""
        self._streams_changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._idle_handle: asyncio.TimerHandle | None = None
        self._idle_since = 0.0
        """When the connection last became idle (no stream open); the idle timer's due time counts from it."""
        self._drain_task: asyncio.Task[None] | None = None
        self._peer_goaway = False
        self.goaway_last_stream_id: int | None = None
        """Set once our graceful GOAWAY is written: streams above it are refused."""
        self._deadline = math.inf
        self._h2_closed = False
        self._flush_scheduled = False
        self.closed = asyncio.Event()
        """Set once the transport was asked to close (by us or because the peer went away)."""
        self._transport_closed = False
        """``closed`` as a plain flag, for the per-flush check (``Event.is_set`` is a Python call)."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Send our preface (SETTINGS, connection WINDOW_UPDATE) and arm the idle timer."""
        self._conn.initiate_connection()  # the codec was built with the settings
        self._flush()
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        """Feed bytes read from the client; never blocks (DATA is bounded by our windows)."""
        if self._h2_closed:
            return
        try:
            events = self._receive(data)
        except ProtocolError as exc:
            reason: rejections.RejectReason = "h2_protocol_error"
            if isinstance(exc, HeaderBudgetExceeded):
                reason = "body_budget"
            elif isinstance(exc, FloodError):
                reason = cast(rejections.RejectReason, f"h2_flood_{exc.kind}")  # h2_limits kinds
            calm = ", GOAWAY ENHANCE_YOUR_CALM" if reason != "h2_protocol_error" else ""
            rejections.reject(reason, "h2 connection %d from %s: %s%s", self.connection_id, self._peer, exc, calm)
            self._flush()  # h2 queued a GOAWAY with the right error code
            self._abort(ClientGone(f"HTTP/2 protocol error: {exc}"))
            return
        for event in events:
            try:
                self._dispatch(event)
            except Exception:  # one odd event must not take the other streams down with it
                log.exception("h2 connection %d: handling %r failed", self.connection_id, event)
        self._flush()

    def _dispatch(self, event: Event) -> None:
        kind, sid = event[0], event[1]
        if kind == ev.EV_REQUEST:
            self._on_request(sid, event[2], event[3])
        elif kind == ev.EV_DATA:
            self._on_data(sid, event[2], event[3])
        elif kind == ev.EV_ENDED:
            stream = self._streams.get(sid)
            if stream is not None:
                stream.ended = True
                stream.wake_reader()
        elif kind == ev.EV_RESET:
            self._on_reset(sid, event[2])
        elif kind == ev.EV_WINDOW:
            self._wake_senders(sid)  # 0: SETTINGS (INITIAL_WINDOW_SIZE) or the connection window
        elif kind == ev.EV_GOAWAY:
            self._on_peer_goaway(event[2])
        elif kind == ev.EV_BAD_LENGTH:
            self._on_bad_length(sid)

    def connection_lost(self) -> None:
        """The socket is gone: cut every stream (their responses get finish(ClientGone))."""
        self._abort(ClientGone("client closed the connection"))

    async def wait_closed(self) -> None:
        await self.closed.wait()

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ inbound events

    def _on_request(self, sid: int, block: list[tuple[bytes, bytes]], ended: bool) -> None:
        if self.goaway_last_stream_id is not None and sid > self.goaway_last_stream_id:
            # The client may already have reset it (Go cancels streams above a GOAWAY's last id).
            self._conn.release_stream(sid)
            if self._reset(sid, ErrorCodes.REFUSED_STREAM):
                conn_metrics.REFUSED_STREAMS.inc()
            return
        try:
            method, target, headers = parse_request(block)
        except MalformedRequest as exc:
            # RFC 9113 8.1.1: a stream error PROTOCOL_ERROR, as Go's server does; nothing reaches the pipeline.
            self._conn.release_stream(sid)
            self._reset(sid, ErrorCodes.PROTOCOL_ERROR)
            rejections.reject("h2_malformed", "h2 connection %d from %s, stream %d: %s",
                                self.connection_id, self._peer, sid, exc)
            return
        request = ProxyRequest(
            method=method,
            target=target,
            headers=headers,
            body=None,
            protocol="h2",
            peer=self._peer,
            peer_cert=self._peer_cert,
            connection_id=self.connection_id,
            stream_id=sid,
            connection_memo=self._memo,
        )
        stream = Stream(sid, request, ended=ended)
        if not stream.ended:
            request.body = self._request_body(stream)
        self._streams[sid] = stream  # a pending idle timer stays: it finds the stream when it fires (_on_idle)
        stream.task = self._loop.create_task(self._serve(stream))
        # Cleanup hangs off the task, not a finally in _serve: a task cancelled before its first step never runs.
        stream.task.add_done_callback(functools.partial(self._task_done, stream))

    def _on_bad_length(self, stream_id: int) -> None:
        """The codec reset a stream whose DATA disagreed with its content-length (RFC 9113 8.1.1)."""
        rejections.reject("h2_malformed", "h2 connection %d from %s, stream %d: body length differs from "
                            "content-length", self.connection_id, self._peer, stream_id)
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._cut(stream, ClientGone(f"HTTP/2 stream {stream_id}: body length differs from content-length"))
        else:
            self._conn.release_stream(stream_id)

    def _on_data(self, sid: int, data: bytes, flow: int) -> None:
        stream = self._streams.get(sid)
        if stream is None or stream.error is not None or not data:
            # Nobody will read it, or nothing to read (an empty frame must not take an inbox place): window back now.
            self._ack(sid, flow)
            return
        if not self._budget.take(len(data)):
            self._ack(sid, flow)
            self._over_budget(stream)
            return
        stream.inbox.append((data, flow))
        stream.wake_reader()

    def _on_reset(self, sid: int, error_code: int) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            return
        try:
            code: object = ErrorCodes(error_code).name
        except ValueError:
            code = error_code
        self._cut(stream, ClientGone(f"client reset HTTP/2 stream {stream.id} ({code})"))

    def _on_peer_goaway(self, error_code: int) -> None:
        """The client is closing: no new streams will come; finish ours, then close."""
        self._peer_goaway = True
        if error_code != 0:
            self._abort(ClientGone(f"client sent GOAWAY with {error_code}"))
        elif not self._streams:
            self._h2_closed = True
            self._close_transport()

    def _wake_senders(self, stream_id: int | None) -> None:
        if not stream_id:
            for stream in self._streams.values():
                stream.wake_sender()
        elif (one := self._streams.get(stream_id)) is not None:
            one.wake_sender()

    def _reset(self, stream_id: int, code: ErrorCodes) -> bool:
        """RST_STREAM unless the stream is already closed; True if a reset went out."""
        if self._h2_closed:
            return False
        try:
            self._conn.reset_stream(stream_id, code)
        except StreamClosedError:
            return False
        self._flush()
        return True

    def _stream_done(self, stream: Stream, *, completed: bool) -> None:
        self._streams.pop(stream.id, None)
        if stream.inbox:
            self._drop_inbox(stream)  # answered before its body was read (a 429): that DATA is never taken
        self._conn.release_stream(stream.id)
        if self.goaway_last_stream_id is not None:
            self._streams_changed.set()  # only a drain (_drain_then_close) waits on it
        if self._h2_closed:
            return
        if completed and self._goaway_chance and self.goaway_last_stream_id is None and self._decider.decide():
            self.goaway("chance")
        if self._peer_goaway and not self._streams:
            self._h2_closed = True
            self._close_transport()
        elif not self._streams:
            self._arm_idle()

    def _drop_inbox(self, stream: Stream) -> None:
        """Nobody will read it: give its window back, or the connection's stays shut for good."""
        while stream.inbox:
            data, flow = stream.inbox.popleft()
            self._budget.give(len(data))
            self._ack(stream.id, flow)

    def _over_budget(self, stream: Stream) -> None:
        self._reset(stream.id, ErrorCodes.ENHANCE_YOUR_CALM)
        rejections.reject("body_budget", "h2 connection %d from %s, stream %d: request bodies held by the "
                          "proxy would pass maxBufferedRequestBytes (%d)", self.connection_id, self._peer,
                          stream.id, self._budget.budget.limit)
        self._cut(stream, ClientGone(f"HTTP/2 stream {stream.id}: request bodies over the proxy's buffer"))

    def _cut(self, stream: Stream, error: BaseException) -> None:
        if stream.error is None:
            stream.error = error
        self._drop_inbox(stream)
        stream.wake_reader()
        stream.wake_sender()
        if stream.task is not None:
            stream.task.cancel()

    def _flush(self) -> None:
        data = self._conn.data_to_send()
        if data:
            self._write(data)

    def _flush_soon(self) -> None:
        """Flush at the end of this loop iteration: frames of many streams go out in one TLS write. Order is kept;
        anything that needs its bytes out now calls _flush()."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._deferred_flush)

    def _deferred_flush(self) -> None:
        self._flush_scheduled = False
        if not self._transport_closed:
            self._flush()

    def goaway(self, reason: Reason, drain_timeout: float | None = None) -> None:
        """Start (or, if already started, only shorten) a graceful GOAWAY and drain."""
        if self._h2_closed:
            return
        timeout = self._settings.drain_timeout_seconds if drain_timeout is None else drain_timeout
        deadline = self._loop.time() + timeout
        if self.goaway_last_stream_id is not None:
            if deadline < self._deadline:
                self._deadline = deadline
                self._streams_changed.set()
            return
        self._flush()
        self.goaway_last_stream_id = self._conn.highest_inbound_stream_id
        self._write(frames.goaway(self.goaway_last_stream_id, 0))
        conn_metrics.GOAWAY_SENT.labels(reason=reason).inc()
        log.debug("h2 connection %d: GOAWAY (%s), last stream %d, %d in flight",
                  self.connection_id, reason, self.goaway_last_stream_id, len(self._streams))
        self._deadline = deadline
        self._cancel_idle()
        self._drain_task = self._loop.create_task(self._drain_then_close())

    async def _drain_then_close(self) -> None:
        while self._streams and (remaining := self._deadline - self._loop.time()) > 0:
            self._streams_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._streams_changed.wait(), remaining)
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        for stream in list(self._streams.values()):
            self._cut(stream, ClientGone("HTTP/2 drain deadline passed after GOAWAY"))
        # Final GOAWAY before the cut streams' tasks run, so nothing more goes out for them.
        self._close_h2()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(self._close_delay)
        self._close_transport()

    def _close_h2(self) -> None:
        if self._h2_closed:
            return
        self._conn.close_connection(last_stream_id=self.goaway_last_stream_id)
        self._flush()
        self._h2_closed = True

    def _abort(self, error: BaseException) -> None:
        self._h2_closed = True
        for stream in list(self._streams.values()):
            self._cut(stream, error)
        if self._drain_task is not None and self._drain_task is not asyncio.current_task():
            self._drain_task.cancel()
        self._close_transport()

    def _close_transport(self) -> None:
        self._conn.release_pending()  # a header block cut short gives its budget back
        self._cancel_idle()
        if not self._transport_closed:
            self._transport_closed = True
            self.closed.set()
            self._close()

    def _arm_idle(self) -> None:
        """The connection just became idle: the idle GOAWAY is due ``idleTimeoutSeconds`` from now.

        Lazy: a timer already pending is kept, and :meth:`_on_idle` moves it on to the new due time when it fires.
        A connection serving a request every few milliseconds thus arms one timer per idle timeout, not a
        TimerHandle made and cancelled per request (tests/proxy/test_h2_wakeups.py)."""
        if self.goaway_last_stream_id is None and not self._h2_closed:
            self._idle_since = self._loop.time()
            if self._idle_handle is None:
                self._idle_handle = self._loop.call_at(self._idle_since + self._settings.idle_timeout_seconds,
                                                       self._on_idle)

    def _cancel_idle(self) -> None:
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None

    def _on_idle(self) -> None:
        self._idle_handle = None
        if self._streams or self.goaway_last_stream_id is not None or self._h2_closed:
            return  # busy (re-armed when its last stream ends), or already going away
        due = self._idle_since + self._settings.idle_timeout_seconds
        if due > self._loop.time():  # streams came and went since it was armed: idle for less than the timeout
            self._idle_handle = self._loop.call_at(due, self._on_idle)
            return
        self.goaway("idle")
