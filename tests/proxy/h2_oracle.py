"""The h2 library's server, adapted to the codec's event tuples: the differential oracle of the codec tests.

The proxy ran on this adapter before its own codec (``gatekeeper/proxy/listen/h2_codec.py``) replaced it;
it stays here, in the tests only, so that random and hostile frame sequences can be fed to both and the
requests each delivers compared. What it changes of a stock ``H2Connection`` (REFUSED_STREAM over the
stream limit, flood accounting, a content-length mismatch as a stream error, header blocks counted in the
request budget, header checks by ``h2_headers``) is what the codec does too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import InvalidBodyLengthError
from hyperframe.frame import ContinuationFrame, DataFrame, Frame, HeadersFrame, PingFrame, RstStreamFrame, SettingsFrame

from gatekeeper.proxy.h2wire.hpack_encode import ResponseEncoder
from gatekeeper.proxy.listen import h2_codec
from gatekeeper.proxy.listen.body_budget import Share
from gatekeeper.proxy.listen.h2_codec import HeaderBudgetExceeded
from gatekeeper.proxy.listen.h2_limits import CLOSED_STREAM, EMPTY_FRAME, PING, RST_STREAM, SETTINGS, FloodGuard


class _QuietLog:
    """``hpack``'s module logger minus ``debug``: hpack calls it ~36 times per request."""

    def __init__(self, real: logging.Logger) -> None:
        self.real = real

    def debug(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _raw_passthrough(convert: Callable[[Any, bool], Any]) -> Callable[[Any, bool], Any]:
    """``hpack``'s per-field post-processing, minus the copy when there is nothing to convert.

    With ``raw=True`` (our ``header_encoding=None``) hpack rebuilds every decoded field as a
    new ``HeaderTuple`` of ``bytes(name), bytes(value)``; a field already made of bytes is
    returned as it is (same class, same values: tuples are immutable).
    """
    @functools.wraps(convert)
    def unicode_if_needed(header: Any, raw: bool) -> Any:
        if raw and type(header[0]) is bytes and type(header[1]) is bytes:
            return header
        return convert(header, raw)

    unicode_if_needed.original = convert  # type: ignore[attr-defined]
    return unicode_if_needed



def config() -> H2Configuration:
    """Server side, bytes headers, validation done by h2_headers (inbound) or not needed (outbound)."""
    return H2Configuration(
        client_side=False,
        header_encoding=None,
        validate_inbound_headers=False,
        normalize_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_outbound_headers=False,
    )


class ProxyH2Connection(H2Connection):
    """An ``H2Connection`` that refuses streams over MAX_CONCURRENT_STREAMS instead of failing the connection."""

    def __init__(
        self,
        on_refused: Callable[[int], None] | None = None,
        *,
        guard: FloodGuard | None = None,
        on_bad_length: Callable[[int], None] | None = None,
        header_budget: Share | None = None,
    ) -> None:
        super().__init__(config())
        self._header_budget = header_budget
        self._header_bytes = 0
        """Bytes of header blocks in progress counted in ``header_budget`` at the last settle."""
        self.encoder = ResponseEncoder()  # type: ignore[assignment]  # duck-typed: encode() + header_table_size
        self._on_refused = on_refused
        self._on_bad_length = on_bad_length
        self._guard = guard
        self._lift_limit = False
        self._held: set[int] = set()
        """Streams accepted and not yet released by the adapter (its handler may still run)."""

    @property
    def open_inbound_streams(self) -> int:
        count = super().open_inbound_streams
        return 0 if self._lift_limit else count

    @property
    def held_streams(self) -> int:
        return len(self._held)

    def release_stream(self, stream_id: int) -> None:
        """The adapter is done with a stream: it stops counting against MAX_CONCURRENT_STREAMS.

        A stream the client reset is closed for h2 at once, but its handler may still be
        unwinding (closing an upstream connection, releasing a seat); until it is done the
        stream keeps its slot, so HEADERS+RST_STREAM pairs cannot run unbounded handlers.
        """
        self._held.discard(stream_id)

    def receive_events(self, data: bytes) -> list[h2_codec.Event]:
        """:meth:`receive_data` as the codec's event tuples (``h2_codec.EV_*``)."""
        out: list[h2_codec.Event] = []
        received = self.receive_data(data)
        if self._header_budget is not None:
            self._settle_header_bytes(self._header_budget)
        for e in received:
            if isinstance(e, RequestReceived):
                out.append((h2_codec.EV_REQUEST, e.stream_id, e.headers or [], e.stream_ended is not None))
            elif isinstance(e, DataReceived):
                out.append((h2_codec.EV_DATA, e.stream_id, e.data or b"", e.flow_controlled_length or 0))
            elif isinstance(e, StreamEnded):
                out.append((h2_codec.EV_ENDED, e.stream_id))
            elif isinstance(e, StreamReset):
                out.append((h2_codec.EV_RESET, e.stream_id, e.error_code))
            elif isinstance(e, WindowUpdated):
                out.append((h2_codec.EV_WINDOW, e.stream_id or 0))
            elif isinstance(e, RemoteSettingsChanged):
                out.append((h2_codec.EV_WINDOW, 0))  # INITIAL_WINDOW_SIZE may have opened every stream
            elif isinstance(e, ConnectionTerminated):
                out.append((h2_codec.EV_GOAWAY, 0, e.error_code or 0))
        return out

    def _settle_header_bytes(self, budget: Share) -> None:
        """Count what h2's frame buffer holds of unfinished header blocks, as the codec counts its own."""
        pending = self.incoming_buffer._headers_buffer
        held = sum(len(f.data) for f in pending) if pending else 0
        more = held - self._header_bytes
        if more > 0 and not budget.take(more):
            self.close_connection(ErrorCodes.ENHANCE_YOUR_CALM)
            raise HeaderBudgetExceeded(ErrorCodes.ENHANCE_YOUR_CALM,
                                       "a header block in progress would pass the proxy's request buffer budget")
        if more < 0:
            budget.give(-more)
        self._header_bytes = held

    def release_pending(self) -> None:
        """Give back what header blocks in progress hold (the connection ended)."""
        if self._header_bytes and self._header_budget is not None:
            self._header_budget.give(self._header_bytes)
        self._header_bytes = 0

    def _receive_frame(self, frame: Frame) -> list[Event]:
        if self._guard is not None:
            sid = frame.stream_id
            # Cheap for the common frames: a new stream's HEADERS is above the highest id,
            # DATA on an open stream is found open at once.
            closed = 0 < sid <= self.highest_inbound_stream_id and (
                (stream := self.streams.get(sid)) is None or stream.closed)
            for kind in frame_kinds(frame, on_closed_stream=closed):
                self._guard.count(kind)
        return super()._receive_frame(frame)

    def _receive_data_frame(self, frame: DataFrame) -> tuple[list[Frame], list[Event]]:
        try:
            return super()._receive_data_frame(frame)
        except InvalidBodyLengthError:
            # h2 makes a content-length mismatch a connection error; RFC 9113 8.1.1 makes it a
            # malformed request, a stream error (Go's server resets only that stream).
            sid = frame.stream_id
            self.reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
            self.acknowledge_received_data(frame.flow_controlled_length, sid)
            if self._on_bad_length is not None:
                self._on_bad_length(sid)
            return [], []

    def _receive_headers_frame(self, frame: HeadersFrame) -> tuple[list[Frame], list[Event]]:
        sid = frame.stream_id
        new = sid not in self.streams
        over = new and max(super().open_inbound_streams, len(self._held)) >= self.local_settings.max_concurrent_streams
        if not over:
            frames, events = super()._receive_headers_frame(frame)
            request = next((e for e in events if isinstance(e, RequestReceived) and e.stream_id == sid), None)
            if new and request is not None:
                if request.stream_ended is not None and any(
                        n == b"content-length" and v.lstrip(b"0") for n, v in request.headers or ()):
                    # A body announced on a request its HEADERS ended: malformed (RFC 9113 8.1.1), and
                    # forwarded, the HTTP/1.1 backend would read the next request as that body.
                    self._prepare_for_sending(frames)
                    self.reset_stream(sid, ErrorCodes.PROTOCOL_ERROR)
                    if self._on_bad_length is not None:
                        self._on_bad_length(sid)
                    return [], [e for e in events if getattr(e, "stream_id", None) != sid]
                self._held.add(sid)
            return frames, events
        self._lift_limit = True
        try:
            frames, events = super()._receive_headers_frame(frame)
        finally:
            self._lift_limit = False
        self._prepare_for_sending(frames)
        self.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
        if self._on_refused is not None:
            self._on_refused(sid)
        # The request never reaches the proxy: drop its events (RequestReceived, StreamEnded, ...).
        return [], [e for e in events if getattr(e, "stream_id", None) != sid]


_ON_CLOSED_COUNTED = (DataFrame, HeadersFrame, ContinuationFrame, RstStreamFrame)
"""Frames that make no sense on a closed stream (WINDOW_UPDATE and PRIORITY may arrive there)."""


def frame_kinds(frame: Frame, *, on_closed_stream: bool) -> list[str]:
    """The counters a received frame adds to (usually none)."""
    kinds: list[str] = []
    if isinstance(frame, RstStreamFrame):
        kinds.append(RST_STREAM)
    elif isinstance(frame, PingFrame):
        if "ACK" not in frame.flags:
            kinds.append(PING)
    elif isinstance(frame, SettingsFrame):
        if "ACK" not in frame.flags:
            kinds.append(SETTINGS)
    elif isinstance(frame, DataFrame):
        if not frame.data and "END_STREAM" not in frame.flags:
            kinds.append(EMPTY_FRAME)
    elif isinstance(frame, ContinuationFrame) and not frame.data:
        kinds.append(EMPTY_FRAME)
    if on_closed_stream and isinstance(frame, _ON_CLOSED_COUNTED):
        kinds.append(CLOSED_STREAM)
    return kinds
