"""A client whose TLS handshake was held up by the proxy itself is not cut at tlsHandshakeTimeoutSeconds.

The real proxy process (uvloop) in front of the sandbox. SIGSTOP stands in for
a worker starved of CPU (the seeds' LIST storm on a small node): the client
connects, the proxy arms its handshake deadline, stops, and the client's
ClientHello waits in the proxy's socket buffer past the deadline. The loop's
own timer, which runs before the loop reads sockets, cut such clients (the
storm test's probe lost its connection that way); ``gatekeeper/serving/tlshandshake.py``
gives them a fresh period instead. A client that sends nothing is still cut.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator

import pytest

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess, handshake_held_up, is_cut, metric_sum

pytestmark = pytest.mark.sandbox

PERIOD = 0.5


@pytest.fixture(scope="module")
def proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    proc = ProxyProcess(sandbox, tmp_path_factory.mktemp("handshake-lag"), name="handshake-lag", workers=1,
                        user_config={"listener": {"tlsHandshakeTimeoutSeconds": PERIOD}})
    try:
        proc.start()
        yield proc
    finally:
        rc = proc.stop(timeout=60)
    assert rc == 0, f"proxy exit code {rc}: {processes.tail(proc.log)}"


def test_a_handshake_the_stalled_proxy_held_up_completes(proxy: ProxyProcess) -> None:
    assert proxy.proc is not None
    late = "gatekeeper_proxy_tls_handshakes_late_total"
    late_before = metric_sum(proxy.metrics(), late)
    try:
        status = handshake_held_up(proxy.proc.pid, proxy.port, proxy.ca, server_hostname="localhost",
                                   request=b"GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n", stall=3 * PERIOD)
    except (OSError, ssl.SSLError) as exc:
        pytest.fail(f"the proxy cut a client it had held up itself: {exc!r}")
    assert status.startswith("HTTP/1.1 "), status
    assert metric_sum(proxy.metrics(), late) >= late_before + 1


def test_a_silent_client_is_still_cut_at_the_handshake_timeout(proxy: ProxyProcess) -> None:
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as raw:
        assert is_cut(raw, 4 * PERIOD + 3), "a client that never sends its ClientHello must be cut"
    assert time.monotonic() - start < 4 * PERIOD + 2
