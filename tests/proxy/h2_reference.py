"""The ``h2`` library as an HTTP/2 server, speaking the codec's event tuples: a differential oracle.

Until 2026-12-03 the proxy could serve HTTP/2 through h2 (``http2Engine: h2``);
the proxy's own codec replaced it (``loadtest/reports/2026-12-03-h2-engine.md``).
Here h2 stays as an independent reading of RFC 9113: the hostile-input tests feed
both the same bytes and compare what would reach the pipeline. Plain h2, with the
header checks turned off as the codec leaves them to ``h2_headers``; where the
proxy deliberately differs (a content-length mismatch is a stream error, not a
connection error), the tests say so.
"""

from __future__ import annotations

import struct
from typing import Any

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamEnded, StreamReset, WindowUpdated
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings

from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.listen.h2_codec import EV_DATA, EV_ENDED, EV_GOAWAY, EV_REQUEST, EV_RESET, EV_WINDOW


class H2Reference:
    """A server-side ``H2Connection`` whose preface is already taken; :meth:`receive` returns event tuples."""

    def __init__(self, max_header_list: int = 1 << 16) -> None:
        self.conn = H2Connection(H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=False,
            normalize_inbound_headers=False, validate_outbound_headers=False, normalize_outbound_headers=False))
        self.conn.local_settings = Settings(client=False,
                                            initial_values={SettingCodes.MAX_HEADER_LIST_SIZE: max_header_list})
        # h2 applies MAX_HEADER_LIST_SIZE to its decoder only once the client ACKs our SETTINGS.
        self.conn.decoder.max_header_list_size = max_header_list
        self.conn.initiate_connection()
        self.conn.data_to_send()

    def receive(self, data: bytes) -> list[tuple[Any, ...]]:
        """h2's events for ``data`` as ``h2_codec.EV_*`` tuples; h2's ``ProtocolError`` on a connection error."""
        out: list[tuple[Any, ...]] = []
        for e in self.conn.receive_data(data):
            if isinstance(e, RequestReceived):
                out.append((EV_REQUEST, e.stream_id, e.headers or [], e.stream_ended is not None))
            elif isinstance(e, DataReceived):
                out.append((EV_DATA, e.stream_id, e.data or b"", e.flow_controlled_length or 0))
            elif isinstance(e, StreamEnded):
                out.append((EV_ENDED, e.stream_id))
            elif isinstance(e, StreamReset):
                out.append((EV_RESET, e.stream_id, e.error_code))
            elif isinstance(e, WindowUpdated):
                out.append((EV_WINDOW, e.stream_id or 0))
            elif isinstance(e, ConnectionTerminated):
                out.append((EV_GOAWAY, 0, e.error_code or 0))
        return out

    def goaway_code(self, data: bytes) -> int | None:
        """Feed ``data``; the code of the GOAWAY h2 answered with (None: no connection error)."""
        try:
            self.receive(data)
        except ProtocolError:
            pass
        return last_goaway_code(self.conn.data_to_send())


def last_goaway_code(data: bytes) -> int | None:
    """The error code of the last GOAWAY in ``data`` (frames as a server wrote them)."""
    code, pos = None, 0
    while pos + 9 <= len(data):
        lt, _, _ = f.FRAME_HEADER.unpack_from(data, pos)
        if lt & 0xFF == f.GOAWAY:
            code = struct.unpack_from(">I", data, pos + 13)[0]
        pos += 9 + (lt >> 8)
    return code
