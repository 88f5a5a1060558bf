"""HTTP/2 attacks on a ``gatekeeper proxy`` process in front of the real sandbox apiservers.

Each attack involves the backend (a stalled response pins an upstream
connection, a reset stream would start an upstream request), so each runs
against the real thing: window-0 client, never-reading PING flooder, rapid
reset (CVE-2023-44487), H2.CL smuggling, a request body that goes quiet.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from h2.errors import ErrorCodes
from h2.events import ResponseReceived, StreamEnded, StreamReset
from h2_raw import RawH2, tls_context
from hyperframe.frame import PingFrame

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

pytestmark = pytest.mark.sandbox

STALL = 2.0
"""responseStallTimeoutSeconds of the proxy under attack."""
BODY_IDLE = 2.0
"""h2BodyIdleTimeoutSeconds of the proxy under attack."""


@pytest.fixture(scope="module")
def proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(sandbox, tmp_path_factory.mktemp("h2-abuse-proxy"), name="h2-abuse-proxy",
                     user_config={"protocol": {"responseStallTimeoutSeconds": STALL,
                                               "h2BodyIdleTimeoutSeconds": BODY_IDLE}})
    try:
        p.start()
        yield p
    finally:
        rc = p.stop(timeout=60)
    assert rc == 0, f"proxy exit code {rc}: {processes.tail(p.log)}"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _version(proxy: ProxyProcess) -> int:
    with httpx.Client(http2=True, verify=proxy.tls(), timeout=10) as client:
        r = client.get(f"{proxy.url}/version")
        assert r.http_version == "HTTP/2"
        return r.status_code


def test_window_zero_client_is_cut_within_the_stall_timeout_while_others_are_served(proxy: ProxyProcess) -> None:
    stalls0 = proxy.metric("gatekeeper_proxy_rejected_total", reason="response_stall")
    client = RawH2(proxy.port, ca=proxy.ca, cert=proxy.admin_cert, window=0)
    try:
        start = time.monotonic()
        sid = client.request("/api/v1/namespaces")
        assert client.read_until(lambda ev: any(isinstance(e, ResponseReceived) for e in ev), 10), \
            "the response head should arrive (HEADERS are not flow-controlled)"
        # While the stalled stream holds its seat and upstream connection, others are served.
        assert _version(proxy) == 200
        assert client.read_until(lambda ev: any(isinstance(e, StreamReset) and e.stream_id == sid for e in ev),
                                 STALL + 10)
        took = time.monotonic() - start
        reset = next(e for e in client.events if isinstance(e, StreamReset))
        assert reset.error_code == ErrorCodes.CANCEL
        assert STALL - 0.5 <= took <= STALL + 5, f"cut after {took:.1f}s, stall timeout is {STALL}s"
    finally:
        client.close()
    assert proxy.metric("gatekeeper_proxy_rejected_total", reason="response_stall") >= stalls0 + 1
    assert _version(proxy) == 200


def _flood_pings(port: int, ca: str, seconds: float, peak: list[int], pid: int) -> bool:
    """Flood PINGs, never read; True when the proxy cut us. Samples the proxy's RSS meanwhile."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock = tls_context(ca).wrap_socket(raw, server_hostname="localhost")
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    chunk = b"".join(PingFrame(0, opaque_data=i.to_bytes(8, "big")).serialize() for i in range(1000))
    deadline = time.monotonic() + seconds
    sock.settimeout(0.5)
    try:
        while time.monotonic() < deadline:
            peak[0] = max(peak[0], _rss_bytes(pid))
            try:
                sock.sendall(chunk)
            except TimeoutError:
                continue
    except (ConnectionError, ssl.SSLError, OSError):
        return True
    finally:
        sock.close()
    return False


def test_never_reading_ping_flooder_is_cut_and_proxy_memory_stays_bounded(proxy: ProxyProcess) -> None:
    assert proxy.proc is not None
    pid = proxy.proc.pid
    before = _rss_bytes(pid)
    floods0 = proxy.metric("gatekeeper_proxy_rejected_total", reason="h2_flood_ping")
    peak = [before]
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(_flood_pings(proxy.port, proxy.ca, 20, peak, pid)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert results == [True] * 4, "every flooder must be cut"
    print(f"proxy RSS {before >> 20} MiB before, peak {peak[0] >> 20} MiB during 4 PING floods")
    assert peak[0] - before < 64 * 1024 * 1024, f"proxy RSS grew by {(peak[0] - before) >> 20} MiB"
    assert proxy.metric("gatekeeper_proxy_rejected_total", reason="h2_flood_ping") >= floods0 + 4
    assert _version(proxy) == 200


def _upstream_requests(proxy: ProxyProcess) -> float:
    return (proxy.metric("gatekeeper_proxy_requests_total")
            + proxy.metric("gatekeeper_proxy_upstream_errors_total"))


def test_rapid_reset_gets_goaway_and_far_fewer_upstream_requests(proxy: ProxyProcess) -> None:
    """CVE-2023-44487: 10,000 HEADERS+RST_STREAM pairs."""
    pairs = 10_000
    before = _upstream_requests(proxy)
    client = RawH2(proxy.port, ca=proxy.ca, cert=proxy.admin_cert)
    sent = 0
    try:
        try:
            for _ in range(pairs // 100):
                for _ in range(100):
                    sid = client.conn.get_next_available_stream_id()
                    client.conn.send_headers(sid, [(":method", "GET"), (":scheme", "https"),
                                                   (":path", "/api/v1/namespaces/default/configmaps"),
                                                   (":authority", "localhost")], end_stream=True)
                    client.conn.reset_stream(sid, ErrorCodes.CANCEL)
                    sent += 1
                client.flush()
                # Take what the proxy answered so far (REFUSED_STREAMs, maybe the GOAWAY): an attacker
                # that never reads is the PING test's case; here the reset accounting is under test.
                if client.read_until(lambda ev: client.goaway_code() is not None, 0.001) or client.closed:
                    break
        except (ConnectionError, ssl.SSLError, OSError):
            pass  # cut mid-flood: expected
        client.read_until(lambda ev: client.goaway_code() is not None, 10)
        assert client.goaway_code() == ErrorCodes.ENHANCE_YOUR_CALM, f"no GOAWAY after {sent} pairs"
    finally:
        client.close()
    # Let any handler that did start finish and be counted.
    deadline = time.monotonic() + 10
    while proxy.metric("gatekeeper_proxy_backend_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    upstream = _upstream_requests(proxy) - before
    print(f"{sent} HEADERS+RST pairs sent, {upstream:.0f} upstream requests, GOAWAY ENHANCE_YOUR_CALM")
    assert upstream < pairs / 5, f"{upstream:.0f} upstream requests for {sent} reset streams"
    assert _version(proxy) == 200


def test_ended_request_announcing_a_body_is_reset_and_the_connection_keeps_serving(proxy: ProxyProcess) -> None:
    """H2.CL smuggling: HEADERS that end the stream but announce ``content-length: 5``.

    Forwarded, the HTTP/1.1 backend connection waits for 5 bytes that never come (the
    upstream connection and the client's seat stay pinned), and a backend that answers
    first would read the next request's first bytes as that body. RFC 9113 8.1.1: reset
    that stream, keep serving the connection.
    """
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


def test_request_body_gone_quiet_is_reset_and_nothing_is_created(proxy: ProxyProcess) -> None:
    """A POST that sends part of its body and then nothing would hold an upstream connection (and a
    flow-control seat) for as long as the client likes; after h2BodyIdleTimeoutSeconds it is cut."""
    idle0 = proxy.metric("gatekeeper_proxy_rejected_total", reason="body_timeout")
    name = f"quiet-body-{int(time.time() * 1000)}"
    body = (b'{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"%s"},"data":{"k":"v"}}'
            % name.encode())
    client = RawH2(proxy.port, ca=proxy.ca, cert=proxy.admin_cert)
    try:
        sid = client.conn.get_next_available_stream_id()
        client.conn.send_headers(sid, [(":method", "POST"), (":scheme", "https"), (":authority", "localhost"),
                                       (":path", "/api/v1/namespaces/default/configmaps"),
                                       ("content-type", "application/json"),
                                       ("content-length", str(len(body)))], end_stream=False)
        client.conn.send_data(sid, body[:20])
        client.flush()
        start = time.monotonic()
        assert client.read_until(lambda ev: any(isinstance(e, StreamReset) and e.stream_id == sid for e in ev),
                                 BODY_IDLE + 10)
        took = time.monotonic() - start
        reset = next(e for e in client.events if isinstance(e, StreamReset) and e.stream_id == sid)
        assert reset.error_code == ErrorCodes.CANCEL
        assert BODY_IDLE - 0.5 <= took <= BODY_IDLE + 5, f"cut after {took:.1f}s, idle timeout is {BODY_IDLE}s"
        good = client.request("/version")  # the connection keeps serving
        assert client.read_until(lambda ev: any(isinstance(e, StreamEnded) and e.stream_id == good for e in ev), 10)
    finally:
        client.close()
    assert proxy.metric("gatekeeper_proxy_rejected_total", reason="body_timeout") >= idle0 + 1
    with httpx.Client(http2=True, verify=proxy.tls(cert=True), timeout=10) as api:
        r = api.get(f"{proxy.url}/api/v1/namespaces/default/configmaps/{name}")
    assert r.status_code == 404, "a half-sent body must never become an object"
