"""A blocking HTTP/2-over-TLS client that can misbehave: raw frames, window 0, never reading.

For the adversarial tests against a real listener (in-process ``ProxyServer``
or a ``gatekeeper proxy`` process). Every wait is bounded by a deadline.
"""

from __future__ import annotations

import socket
import ssl
import time

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, Event
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings


def tls_context(ca: str | None = None, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    if cert is not None:
        ctx.load_cert_chain(*cert)
    if ca is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    return ctx


class RawH2:
    """One TLS connection speaking h2 through a client ``H2Connection`` (or raw bytes)."""

    def __init__(self, port: int, *, ca: str | None = None, cert: tuple[str, str] | None = None,
                 window: int | None = None, timeout: float = 10.0) -> None:
        self._timeout = timeout
        raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock = tls_context(ca, cert).wrap_socket(raw, server_hostname="localhost")
        assert self.sock.selected_alpn_protocol() == "h2"
        self.conn = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        if window is not None:
            self.conn.local_settings = Settings(client=True,
                                                initial_values={SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.conn.initiate_connection()
        self.events: list[Event] = []
        self.closed = False
        self.flush()

    def flush(self) -> None:
        """Send what h2 queued; after a failed write (TLS cannot resume it) nothing more is sent."""
        data = self.conn.data_to_send()
        if data and not self.closed:
            try:
                self.sock.sendall(data)
            except (OSError, ssl.SSLError):
                self.closed = True
                raise

    def request(self, path: str, method: str = "GET", headers: list[tuple[str, str]] | None = None) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", method), (":scheme", "https"), (":path", path),
                                     (":authority", "localhost"), *(headers or [])], end_stream=True)
        self.flush()
        return sid

    def read_until(self, predicate: object, timeout: float) -> bool:
        """Read and process frames until ``predicate(events)`` or the peer closes; False on timeout."""
        try:
            return self._read_until(predicate, timeout)
        finally:
            self.sock.settimeout(self._timeout)

    def _read_until(self, predicate: object, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate(self.events):  # type: ignore[operator]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return False
            except (ConnectionError, ssl.SSLError, OSError):
                data = b""
            if not data:
                self.closed = True
                return bool(predicate(self.events))  # type: ignore[operator]
            try:
                self.events.extend(self.conn.receive_data(data))
            except ProtocolError:
                self.closed = True
                return bool(predicate(self.events))  # type: ignore[operator]
            try:
                self.flush()
            except (OSError, ssl.SSLError):
                return bool(predicate(self.events))  # type: ignore[operator]
        return True

    def goaway_code(self) -> int | None:
        for e in self.events:
            if isinstance(e, ConnectionTerminated):
                return int(e.error_code)
        return None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
