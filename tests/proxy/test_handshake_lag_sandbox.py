"""A client whose TLS handshake was held up by the proxy itself is not cut at tlsHandshakeTimeoutSeconds.

The real proxy process (uvloop) in front of the sandbox. SIGSTOP stands in for
a worker starved of CPU (the seeds' LIST storm on a small node): the client
connects, the proxy arms its handshake deadline, stops, and the client's
ClientHello waits in the proxy's socket buffer past the deadline. The loop's
own timer, which runs before the loop reads sockets, cut such clients (the
storm test's probe lost its connection that way); ``gatekeeper/tlshandshake.py``
gives them a fresh period instead. A client that sends nothing is still cut.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

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


def metric(proxy: ProxyProcess, name: str) -> float:
    return sum(float(line.split()[-1]) for line in proxy.metrics().splitlines()
               if line.startswith(name) and not line.startswith("#"))


def handshake_then_get(raw: socket.socket, ca: str, out: dict[str, object]) -> None:
    """TLS (http/1.1) on an already connected socket, then one request; the status line, or the error."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        raw.settimeout(20)
        tls = ctx.wrap_socket(raw, server_hostname="localhost")
        tls.sendall(b"GET /version HTTP/1.1\r\nHost: localhost\r\n\r\n")
        out["status"] = tls.recv(64).split(b"\r\n", 1)[0].decode()
        tls.close()
    except (OSError, ssl.SSLError) as exc:
        out["error"] = repr(exc)


def test_a_handshake_the_stalled_proxy_held_up_completes(proxy: ProxyProcess) -> None:
    assert proxy.proc is not None
    pid = proxy.proc.pid
    late_before = metric(proxy, "gatekeeper_proxy_tls_handshakes_late_total")
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    time.sleep(0.3)  # accepted, handshake deadline armed, waiting for the ClientHello
    os.kill(pid, signal.SIGSTOP)
    out: dict[str, object] = {}
    try:
        client = threading.Thread(target=handshake_then_get, args=(raw, proxy.ca, out))
        client.start()  # the ClientHello goes out now and waits, unread, in the stopped proxy's buffer
        time.sleep(3 * PERIOD)  # past the deadline, under the 4 x PERIOD cap
    finally:
        os.kill(pid, signal.SIGCONT)
    client.join(30)
    assert "error" not in out, f"the proxy cut a client it had held up itself: {out['error']}"
    assert str(out.get("status", "")).startswith("HTTP/1.1 "), out
    assert metric(proxy, "gatekeeper_proxy_tls_handshakes_late_total") >= late_before + 1


def test_a_silent_client_is_still_cut_at_the_handshake_timeout(proxy: ProxyProcess) -> None:
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    raw.settimeout(4 * PERIOD + 3)
    start = time.monotonic()
    try:
        cut = raw.recv(1) == b""
    except ConnectionError:
        cut = True
    except TimeoutError:
        cut = False
    finally:
        raw.close()
    assert cut, "a client that never sends its ClientHello must be cut"
    assert time.monotonic() - start < 4 * PERIOD + 2
