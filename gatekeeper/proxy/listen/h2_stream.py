"""Serving one HTTP/2 stream of a client connection: its request body, its response, its windows and deadline.

Per stream, response DATA waits for window before the next chunk is pulled, and request DATA is acknowledged only as the
pipeline takes it, so neither a slow reader nor a fast uploader grows proxy memory beyond one window.
:class:`StreamServing` is the per-stream half of ``h2.H2Protocol`` (the connection's life is there): a base class, so
the request path calls its methods as directly as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from gatekeeper.proxy import rejections
from gatekeeper.proxy.adapter import (
    ClientGone,
    DeadlinePassed,
    call_handler,
    close_body,
    describe_seconds,
    response_has_body,
    timeout_response,
)
from gatekeeper.proxy.h2wire.errors import ErrorCodes, StreamClosedError
from gatekeeper.proxy.listen.body_budget import Share
from gatekeeper.proxy.listen.h2_codec import H2ServerCodec
from gatekeeper.proxy.listen.h2_headers import response_block
from gatekeeper.proxy.listen.settings import ProtocolSettings
from gatekeeper.proxy.messages import Handler, ProxyRequest, ProxyResponse, is_exhausted

log = logging.getLogger("gatekeeper.proxy.listen.h2")


def _cleared(event: asyncio.Event | None) -> asyncio.Event:
    """``event`` cleared, or a new one the first time a stream waits."""
    if event is None:
        return asyncio.Event()
    event.clear()
    return event


class Stream:
    """One client stream. Its two events are made on first wait: most requests never wait, and two Events per request
    were measurable. Waking an unmade event is a no-op, safe because every waiter checks the state first."""

    __slots__ = ("_inbox_changed", "_window_open", "ended", "error", "id", "inbox", "request", "responded", "task")

    def __init__(self, sid: int, request: ProxyRequest, *, ended: bool = False) -> None:
        self.id = sid
        self.request = request
        self.task: asyncio.Task[bool] | None = None
        self.inbox: deque[tuple[bytes, int]] = deque()
        """Received request DATA not yet taken by the pipeline: (data, flow-controlled length)."""
        self.ended = ended
        """The client sent END_STREAM."""
        self.error: BaseException | None = None
        """Why the stream was cut (client reset, connection lost, drain deadline)."""
        self.responded = False
        """The response head went out (past the deadline the stream is then reset, not answered 504)."""
        self._inbox_changed: asyncio.Event | None = None
        self._window_open: asyncio.Event | None = None

    def inbox_changed(self) -> asyncio.Event:
        """The event a body reader waits on (cleared, ready to wait)."""
        self._inbox_changed = _cleared(self._inbox_changed)
        return self._inbox_changed

    def window_open(self) -> asyncio.Event:
        """The event a response sender waits on (cleared, ready to wait)."""
        self._window_open = _cleared(self._window_open)
        return self._window_open

    def wake_reader(self) -> None:
        if self._inbox_changed is not None:
            self._inbox_changed.set()

    def wake_sender(self) -> None:
        if self._window_open is not None:
            self._window_open.set()


class StreamServing:
    """Per-stream serving of an HTTP/2 connection; ``h2.H2Protocol`` sets the state below and supplies the
    connection-level helpers it calls (declared for the type checker only)."""

    _handler: Handler
    _settings: ProtocolSettings
    _conn: H2ServerCodec
    _loop: asyncio.AbstractEventLoop
    _budget: Share
    _drain: Callable[[], Awaitable[None]]
    _peer: str
    _h2_closed: bool
    _window_reopened_at: float
    connection_id: int

    if TYPE_CHECKING:
        def _reset(self, stream_id: int, code: ErrorCodes) -> bool: ...
        def _cut(self, stream: Stream, error: BaseException) -> None: ...
        def _flush(self) -> None: ...
        def _flush_soon(self) -> None: ...
        def _stream_done(self, stream: Stream, *, completed: bool) -> None: ...

    # ------------------------------------------------------------------ request bodies

    async def _request_body(self, stream: Stream) -> AsyncIterator[bytes]:
        """Yield request DATA, reopening the client's window only for what the pipeline took.

        A body quiet for ``h2BodyIdleTimeoutSeconds`` while the client may send is cut, else it holds a seat and
        upstream connection at will; time with the connection window shut is ours, so it does not count."""
        idle = self._settings.h2_body_idle_timeout_seconds
        while True:
            if stream.inbox:
                data, flow = stream.inbox.popleft()
                self._budget.give(len(data))
                self._ack(stream.id, flow)
                if data:
                    yield data
                continue
            if stream.error is not None:
                raise stream.error
            if stream.ended:
                return
            changed = stream.inbox_changed()
            since = self._loop.time()
            try:
                async with asyncio.timeout(idle):
                    await changed.wait()
            except TimeoutError:
                if stream.inbox or stream.ended or stream.error is not None or self._h2_closed:
                    continue
                if self._conn.inbound_flow_control_window <= 0 or self._window_reopened_at >= since:
                    continue  # the client could not send for some of that time: a new full period
                self._body_idle(stream, idle)

    def _body_idle(self, stream: Stream, idle: float) -> None:
        self._reset(stream.id, ErrorCodes.CANCEL)
        rejections.reject("body_timeout", "h2 connection %d from %s, stream %d: request body idle for %gs",
                          self.connection_id, self._peer, stream.id, idle)
        error = ClientGone(f"HTTP/2 stream {stream.id}: request body idle for {idle:g}s")
        self._cut(stream, error)
        raise error

    def _ack(self, stream_id: int, flow: int) -> None:
        if flow <= 0 or self._h2_closed:
            return
        if self._conn.inbound_flow_control_window <= 0:
            self._window_reopened_at = self._loop.time()  # see _request_body's idle clock
        self._conn.acknowledge_received_data(flow, stream_id)  # a closed stream's: only the connection window
        self._flush_soon()

    # ------------------------------------------------------------------ responses

    async def _serve(self, stream: Stream) -> bool:
        """Run the handler and stream its response; True when the response went out complete."""
        response: ProxyResponse | None = None
        error: BaseException | None = None
        try:
            response = await call_handler(self._handler, stream.request)
            await self._send_response(stream, response)
            if not stream.ended:
                # Answered before the body ended (e.g. a 429): ask the client to stop uploading (RFC 9113 8.1).
                self._reset(stream.id, ErrorCodes.NO_ERROR)
        except asyncio.CancelledError:
            if stream.request.timed_out and stream.error is None and not self._h2_closed:
                error = await self._past_deadline(stream)
            else:
                error = stream.error or ClientGone("HTTP/2 connection closed")
        except ClientGone as exc:  # the socket went away mid-write: nothing to reset
            error = stream.error or exc
        except Exception as exc:
            error = stream.error or exc
            if stream.error is None:
                log.warning("h2 stream %d on connection %d failed: %s", stream.id, self.connection_id, exc)
                self._reset(stream.id, ErrorCodes.INTERNAL_ERROR)
        finally:
            if response is not None:
                await close_body(response.body)
                response.finish(error)
        return error is None

    async def _past_deadline(self, stream: Stream) -> BaseException:
        """The deadline passed: a 504 if nothing was answered yet, else RST_STREAM CANCEL; returns the error."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        error = DeadlinePassed(f"HTTP/2 stream {stream.id}: not done within "
                               f"{describe_seconds(stream.request.deadline_seconds)}")
        if stream.responded:
            self._reset(stream.id, ErrorCodes.CANCEL)
            stream.error = error
            return error
        try:
            await self._send_response(stream, timeout_response(stream.request.deadline_seconds))
            if not stream.ended:
                self._reset(stream.id, ErrorCodes.NO_ERROR)
        except (ClientGone, asyncio.CancelledError):
            pass  # the client went too: nothing more to tell it
        return error

    def _task_done(self, stream: Stream, task: asyncio.Task[bool]) -> None:
        completed = not task.cancelled() and task.exception() is None and task.result()
        self._stream_done(stream, completed=completed)

    async def _send_response(self, stream: Stream, response: ProxyResponse) -> None:
        sid = stream.id
        if response.upgraded is not None:
            # An upgrade can only answer an HTTP/1.1 request; never reached through a sane pipeline.
            response.upgraded.writer.close()
            raise RuntimeError("pipeline returned a protocol upgrade on an HTTP/2 stream")
        has_body = response_has_body(stream.request.method, response.status)
        stream.responded = True
        self._conn.send_headers(sid, response_block(response.status, response.headers), end_stream=not has_body)
        self._flush_soon()
        if not has_body:
            return
        body = response.body
        while True:
            await self._wait_window(stream)  # pull the next chunk only when it can go out
            try:
                chunk = await body.__anext__()
            except StopAsyncIteration:
                break
            # A body that knows its last chunk ends the stream on that DATA frame, not an extra empty one.
            last = is_exhausted(body)
            await self._send_data(stream, chunk, end_stream=last)
            if last:
                return
        self._conn.end_stream(sid)
        self._flush_soon()

    async def _send_data(self, stream: Stream, chunk: bytes, *, end_stream: bool = False) -> None:
        if not chunk:
            if end_stream:  # an exhausted body whose last chunk is empty still ends the stream
                self._conn.end_stream(stream.id)
                self._flush_soon()
            return
        if len(chunk) <= self._conn.max_outbound_frame_size and len(chunk) <= await self._wait_window(stream):
            # The common small response: one frame, no slicing or copy.
            self._conn.send_data(stream.id, chunk, end_stream=end_stream)
            if end_stream:
                self._flush_soon()
            else:
                self._flush()
                await self._drain()
            return
        view = memoryview(chunk)
        while view:
            window = await self._wait_window(stream)
            n = min(len(view), window, self._conn.max_outbound_frame_size)
            view, piece = view[n:], bytes(view[:n])
            if end_stream and not view:
                # The last frame joins this iteration's one write with the other streams' frames.
                self._conn.send_data(stream.id, piece, end_stream=True)
                self._flush_soon()
                return
            self._conn.send_data(stream.id, piece)
            self._flush()
            await self._drain()

    async def _wait_window(self, stream: Stream) -> int:
        """Wait until the connection and stream windows both have room; return it.

        A client keeping the window shut would pin the seat and upstream connection forever, so after
        ``responseStallTimeoutSeconds`` the stream is reset (CANCEL)."""
        deadline: float | None = None
        while True:
            if stream.error is not None:
                raise stream.error
            if self._h2_closed:
                raise ClientGone("HTTP/2 connection closed")
            try:
                window = self._conn.local_flow_control_window(stream.id)
            except StreamClosedError:
                raise ClientGone(f"HTTP/2 stream {stream.id} closed") from None
            if window > 0:
                return window
            now = self._loop.time()
            if deadline is None:
                deadline = now + self._settings.response_stall_timeout_seconds
            elif now >= deadline:
                self._reset(stream.id, ErrorCodes.CANCEL)
                rejections.reject("response_stall", "h2 connection %d from %s, stream %d: flow-control window "
                                    "shut for %gs", self.connection_id, self._peer, stream.id,
                                    self._settings.response_stall_timeout_seconds)
                stream.error = ClientGone(f"HTTP/2 stream {stream.id}: client window stayed at 0")
                raise stream.error
            opened = stream.window_open()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(deadline - now):
                    await opened.wait()
