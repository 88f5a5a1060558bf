"""A client connection's input before and after the ALPN decision (the listener's asyncio protocol)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

EARLY_PAUSE_BYTES = 128 * 1024
"""Bytes held between the TLS handshake and the ALPN decision before reading pauses (a StreamReader's 2 x 64 KiB)."""


def _ended(data: bytes) -> None:
    """The sink of an h2 connection that has ended: nothing is fed after the end."""


class ClientProtocol(asyncio.StreamReaderProtocol):
    """A StreamReaderProtocol whose bytes go straight to the h2 protocol once ALPN picked h2.

    Saves a StreamReader's copy, future and task wake-up per read on the hot path. Bytes, EOF or loss seen before the
    ALPN decision are held and replayed in order. In h2 mode, reading pauses while our output is over the high-water
    mark, and a client that leaves it there for ``stall`` seconds is cut."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        super().__init__(reader)
        self._early: list[bytes] | None = []
        self._early_end: tuple[bool, Exception | None] | None = None
        """(eof, error) seen before a side was attached."""
        self._sink: Callable[[bytes], None] | None = None
        self._on_end: Callable[[], None] | None = None
        self._on_stall: Callable[[], None] | None = None
        self._stall = 0.0
        self._stall_handle: asyncio.TimerHandle | None = None
        self._raw: asyncio.Transport | None = None
        self._early_bytes = 0
        self._early_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._raw = transport  # type: ignore[assignment]
        super().connection_made(transport)

    def attach_reader(self) -> None:
        """HTTP/1.1 (or shutting down): bytes go to the StreamReader from now on."""
        early = self._take_early()
        for chunk in early:
            super().data_received(chunk)
        end, self._early_end = self._early_end, None
        if end is not None:
            eof, exc = end
            if eof:
                super().eof_received()
            else:
                super().connection_lost(exc)

    def attach_sink(self, sink: Callable[[bytes], None], on_end: Callable[[], None],
                    on_stall: Callable[[], None], stall: float) -> None:
        """h2: every read goes to ``sink``; ``on_end`` runs once, at EOF, loss or a stall."""
        self._sink, self._on_end, self._on_stall, self._stall = sink, on_end, on_stall, stall
        early = self._take_early()
        for chunk in early:
            self.data_received(chunk)
        end, self._early_end = self._early_end, None
        if end is not None:
            self._end()
            if not end[0]:
                super().connection_lost(end[1])

    def _take_early(self) -> list[bytes]:
        """The bytes held before the ALPN decision; reading resumes if holding them had paused it."""
        early, self._early = self._early or [], None
        if self._early_paused and self._raw is not None and not self._raw.is_closing():
            self._early_paused = False
            self._raw.resume_reading()
        return early

    def _end(self) -> None:
        self._cancel_stall()
        on_end, self._on_end = self._on_end, None
        self._on_stall = None
        if self._sink is not None:
            # Still h2 mode (not None), but the protocol goes: it holds the writer, which holds us, a cycle that kept
            # each closed connection's TLS buffers until a full garbage collection.
            self._sink = _ended
        if on_end is not None:
            on_end()

    def data_received(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None:
            if self._on_end is not None:  # nothing is fed after the end
                try:
                    sink(data)
                except (ConnectionError, OSError):  # ClientGone included: the connection is over
                    self._end()
        elif self._early is not None:
            self._early.append(data)
            self._early_bytes += len(data)
            if self._early_bytes > EARLY_PAUSE_BYTES and self._raw is not None and not self._early_paused:
                self._early_paused = True  # as a StreamReader pauses past twice its limit
                self._raw.pause_reading()
        else:
            super().data_received(data)

    def eof_received(self) -> bool:
        if self._sink is not None:
            self._end()
        elif self._early is not None:
            self._early_end = (True, None)
            return False
        return bool(super().eof_received())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._sink is not None:
            self._end()
        elif self._early is not None:
            self._early_end = (False, exc)  # replayed by attach_*: the reader must not see EOF before the data
            return
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._sink is not None and self._raw is not None and self._on_end is not None:
            self._raw.pause_reading()
            if self._stall_handle is None:
                self._stall_handle = asyncio.get_running_loop().call_later(self._stall, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._sink is not None and self._raw is not None and self._on_end is not None:
            self._cancel_stall()
            if not self._raw.is_closing():
                self._raw.resume_reading()

    def _stalled(self) -> None:
        self._stall_handle = None
        if self._on_stall is not None:
            self._on_stall()
        self._end()

    def _cancel_stall(self) -> None:
        if self._stall_handle is not None:
            self._stall_handle.cancel()
            self._stall_handle = None
