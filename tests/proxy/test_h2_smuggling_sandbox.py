"""H2.CL request smuggling against a ``gatekeeper proxy`` process in front of the real sandbox apiserver.

A request whose HEADERS end the stream but announce ``content-length: 5`` went
to the HTTP/1.1 backend connection with that header and no body. Against the
sandbox apiserver (before the fix) the stream got no response at all: the
upstream connection and the client's seat stayed pinned waiting for 5 bytes
that never come; a backend that answers first and then reads the "body" would
take the next request's first bytes as it (desync). The proxy must reset such
a stream (RFC 9113 8.1.1) and keep serving the connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from h2.errors import ErrorCodes
from h2.events import ResponseReceived, StreamEnded, StreamReset
from h2_raw import RawH2

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(sandbox, tmp_path_factory.mktemp("h2-smuggling-proxy"), name="h2-smuggling-proxy")
    try:
        p.start()
        yield p
    finally:
        rc = p.stop(timeout=60)
    assert rc == 0, f"proxy exit code {rc}: {processes.tail(p.log)}"


def test_ended_request_announcing_a_body_is_reset_and_the_connection_keeps_serving(proxy: ProxyProcess) -> None:
    malformed0 = proxy.metric("gatekeeper_proxy_rejected_total", reason="h2_malformed")
    client = RawH2(proxy.port, ca=proxy.ca, cert=proxy.admin_cert)
    try:
        bad = client.request("/api/v1/namespaces", headers=[("content-length", "5")])
        assert client.read_until(lambda ev: any(isinstance(e, StreamReset) and e.stream_id == bad for e in ev), 10)
        reset = next(e for e in client.events if isinstance(e, StreamReset) and e.stream_id == bad)
        assert reset.error_code == ErrorCodes.PROTOCOL_ERROR
        assert not any(isinstance(e, ResponseReceived) and e.stream_id == bad for e in client.events)
        good = client.request("/version")
        assert client.read_until(lambda ev: any(isinstance(e, StreamEnded) and e.stream_id == good for e in ev), 10)
        status = next(e for e in client.events if isinstance(e, ResponseReceived) and e.stream_id == good)
        assert dict(status.headers)[b":status"] == b"200"
    finally:
        client.close()
    assert proxy.metric("gatekeeper_proxy_rejected_total", reason="h2_malformed") >= malformed0 + 1
