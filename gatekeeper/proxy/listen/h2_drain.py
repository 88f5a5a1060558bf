"""How an HTTP/2 client connection ends: graceful GOAWAY, drain, idle timeout, abort, close.

Graceful GOAWAY as Go's server does it: our GOAWAY names the highest stream seen, later streams are refused, in-flight
ones finish (long-running until the drain deadline), then the socket closes ``close_delay`` later so the client reads
the final frame first; client-go then reconnects and quietly re-watches."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gatekeeper.proxy.adapter import ClientGone
from gatekeeper.proxy.h2wire import frames
from gatekeeper.proxy.listen import conn_metrics
from gatekeeper.proxy.listen.goaway import Reason

if TYPE_CHECKING:
    from gatekeeper.proxy.listen.h2_codec import H2ServerCodec
    from gatekeeper.proxy.listen.h2_stream import Stream
    from gatekeeper.proxy.listen.settings import ProtocolSettings

log = logging.getLogger("gatekeeper.proxy.listen.h2")  # the adapter logs under one name, whichever part logs


class Draining:
    """The closing methods of :class:`h2.H2Protocol`, which provides the state declared below."""

    if TYPE_CHECKING:
        _settings: ProtocolSettings
        _write: Callable[[bytes], None]
        _close: Callable[[], None]
        connection_id: int
        _close_delay: float
        _conn: H2ServerCodec
        _streams: dict[int, Stream]
        _streams_changed: asyncio.Event
        _loop: asyncio.AbstractEventLoop
        _idle_handle: asyncio.TimerHandle | None
        _drain_task: asyncio.Task[None] | None
        goaway_last_stream_id: int | None
        _deadline: float
        _h2_closed: bool
        closed: asyncio.Event

        def _cut(self, stream: Stream, error: BaseException) -> None: ...
        def _flush(self) -> None: ...

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
        while self._streams:
            remaining = self._deadline - self._loop.time()
            if remaining <= 0:
                break
            self._streams_changed.clear()
            try:
                await asyncio.wait_for(self._streams_changed.wait(), remaining)
            except TimeoutError:
                pass
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
        if not self.closed.is_set():
            self.closed.set()
            self._close()


    def _arm_idle(self) -> None:
        self._cancel_idle()
        if self.goaway_last_stream_id is None and not self._h2_closed:
            self._idle_handle = self._loop.call_later(self._settings.idle_timeout_seconds, self._on_idle)

    def _cancel_idle(self) -> None:
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None

    def _on_idle(self) -> None:
        self._idle_handle = None
        if not self._streams:
            self.goaway("idle")
