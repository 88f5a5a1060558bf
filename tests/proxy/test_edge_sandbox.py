"""The attacks of issue 8, tried as an attacker would (curl, raw sockets, httpx) against a proxy in front
of the sandbox's real kube-apiservers.

Each test module of this kind runs its own ``gatekeeper proxy`` process, so
the shared sandbox is never disturbed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import ssl
import struct
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

pytestmark = pytest.mark.sandbox

EDGE_CONFIG = {
    "protocol": {"h1HeaderTimeoutSeconds": 1.0},
    # One short-request connection per apiserver: watches must not need them.
    "upstream": {"maxConnectionsPerBackend": 1, "poolAcquireTimeoutSeconds": 5.0},
}


@pytest.fixture(scope="module")
def sbx(request: pytest.FixtureRequest) -> SandboxState:
    if os.environ.get("GATEKEEPER_SANDBOX_DIR"):  # reuse a sandbox already up (local iteration)
        return SandboxState.load(os.environ["GATEKEEPER_SANDBOX_DIR"])
    value = request.getfixturevalue("sandbox")
    return value if isinstance(value, SandboxState) else SandboxState.load(getattr(value, "dir", value))


@pytest.fixture(scope="module")
def proxy(sbx: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(sbx, tmp_path_factory.mktemp("edge-proxy"), user_config=EDGE_CONFIG, health_interval=0.5)
    p.start()
    yield p
    rc = p.stop()
    assert rc == 0, f"proxy exit code {rc} after SIGTERM: {processes.tail(p.log)}"


def curl(proxy: ProxyProcess, *args: str, cert: bool = True) -> tuple[int, str]:
    cmd = ["curl", "-s", "--max-time", "20", "--cacert", proxy.ca, "-o", "-", "-w", "\n%{http_code}"]
    if cert:
        cmd += ["--cert", proxy.admin_cert[0], "--key", proxy.admin_cert[1]]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30).stdout
    body, _, code = out.rpartition("\n")
    return int(code or 0), body


def h1_exchange(proxy: ProxyProcess, ctx: ssl.SSLContext, raw: bytes) -> bytes:
    """Send ``raw`` on a fresh TLS connection; everything the proxy sends back until it closes."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s, \
            ctx.wrap_socket(s, server_hostname="127.0.0.1") as tls:
        tls.sendall(raw)
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    return data


def rejected(proxy: ProxyProcess, reason: str) -> float:
    return proxy.metric("gatekeeper_proxy_rejected_total", reason=reason)


@pytest.mark.parametrize("http", ["--http1.1", "--http2"])
def test_at_sign_request_target_reaches_no_socket(proxy: ProxyProcess, http: str) -> None:
    """``curl --request-target '@127.0.0.1:PORT/x'``: a 400 Status, and PORT sees no connection."""
    canary = socket.socket()
    canary.bind(("127.0.0.1", 0))
    canary.listen(8)
    canary.setblocking(False)
    port = canary.getsockname()[1]
    try:
        before = rejected(proxy, "target_form")
        code, body = curl(proxy, http, "--request-target", f"@127.0.0.1:{port}/x", f"{proxy.url}/")
        assert code == 400, body
        status = json.loads(body)
        assert (status["kind"], status["reason"]) == ("Status", "BadRequest")
        assert "SSLContext" not in body
        with pytest.raises(BlockingIOError):
            canary.accept()  # nobody connected to the port the client named
        assert rejected(proxy, "target_form") == before + 1
        ejections = proxy.metric("gatekeeper_proxy_backend_ejections_total")
        assert ejections == 0
    finally:
        canary.close()


@pytest.mark.parametrize("path", [
    "/healthz/../api/v1/secrets", "/healthz/%2E%2E/api/v1/secrets", "/readyz/%2e%2E/api/v1/secrets",
    "/livez/./../api/v1/secrets",
])
def test_dot_segment_flow_control_bypass_is_rejected(proxy: ProxyProcess, path: str) -> None:
    """Classified as an exempt probe but served as a secrets LIST: refused with a 400 Status instead."""
    before = proxy.metric("gatekeeper_proxy_requests_total")
    code, body = curl(proxy, "--path-as-is", f"{proxy.url}{path}")
    assert code == 400, body[:300]
    assert json.loads(body)["reason"] == "BadRequest"
    assert '"kind":"SecretList"' not in body
    assert proxy.metric("gatekeeper_proxy_requests_total") == before, "the request reached an apiserver"


def test_connection_header_cannot_drop_the_stamped_groups(proxy: ProxyProcess) -> None:
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    with httpx.Client(verify=proxy.tls(cert=True), http2=False, timeout=20) as client:
        resp = client.post(f"{proxy.url}/apis/authentication.k8s.io/v1/selfsubjectreviews", json=review,
                           headers={"Connection": "keep-alive, x-remote-group, x-remote-user"})
    assert resp.status_code == 201, resp.text
    info = resp.json()["status"]["userInfo"]
    assert info["username"] == "sandbox-admin" and "system:masters" in info["groups"], info


@pytest.mark.parametrize(("user", "groups"), [
    ("system:admin", ["system:mas\nters"]), ("admin ", []), ("eve", [" system:masters"]), ("ad\x7fmin", []),
])
def test_unclean_certificate_names_get_401_and_no_upstream_call(
    sbx: SandboxState, proxy: ProxyProcess, tmp_path: Path, user: str, groups: list[str],
) -> None:
    issued = PKI(sbx.certs_dir).issue_client(f"edge-bad-{uuid.uuid4().hex[:8]}", user=user, groups=groups)
    ctx = ssl.create_default_context(cafile=proxy.ca)
    ctx.load_cert_chain(str(issued.cert), str(issued.key))
    before = proxy.metric("gatekeeper_proxy_requests_total")
    with httpx.Client(verify=ctx, http2=True, timeout=20) as client:
        resp = client.get(f"{proxy.url}/api/v1/namespaces/kube-system/secrets")
    assert resp.status_code == 401, resp.text
    assert resp.json()["reason"] == "Unauthorized"
    assert proxy.metric("gatekeeper_proxy_requests_total") == before, "the request reached an apiserver"


def test_content_length_with_transfer_encoding_is_refused(proxy: ProxyProcess) -> None:
    raw = (b"POST /api/v1/namespaces/default/configmaps HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    ctx = proxy.tls(cert=True)
    ctx.set_alpn_protocols(["http/1.1"])
    data = h1_exchange(proxy, ctx, raw)
    assert data.startswith(b"HTTP/1.1 400"), data[:200]


def test_half_sent_request_head_is_cut_at_the_header_timeout(proxy: ProxyProcess) -> None:
    ctx = proxy.tls(cert=True)
    ctx.set_alpn_protocols(["http/1.1"])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s, \
            ctx.wrap_socket(s, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"GET /version HTTP/1.1\r\n")
        started = time.monotonic()
        assert tls.recv(100) == b""  # closed by the proxy
        assert time.monotonic() - started < 5.0


async def test_watches_do_not_starve_short_requests(proxy: ProxyProcess) -> None:
    """3 apiservers x 1 short-request connection; 9 open watches still leave GETs served."""
    async with httpx.AsyncClient(verify=proxy.tls(cert=True), http2=True, timeout=30) as client:
        streams = []
        try:
            for i in range(9):
                cm = client.stream("GET", f"{proxy.url}/api/v1/namespaces/default/configmaps?watch=1&i={i}")
                resp = await cm.__aenter__()
                assert resp.status_code == 200
                streams.append(cm)
            await asyncio.sleep(0.5)
            watches = proxy.metric("gatekeeper_proxy_backend_watches")
            assert watches == 9
            async with asyncio.timeout(4):
                for _ in range(6):
                    got = await client.get(f"{proxy.url}/version")
                    assert got.status_code == 200
        finally:
            for cm in streams:
                await cm.__aexit__(None, None, None)


def _series(text: str) -> int:
    return len(re.findall(r"^gatekeeper_proxy_request\w*\{", text, re.M))


async def test_ten_thousand_invented_paths_and_methods_keep_the_series_bounded(proxy: ProxyProcess) -> None:
    before = _series(proxy.metrics())
    sem = asyncio.Semaphore(48)
    codes: dict[int, int] = {}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        method = f"X{i}Y" if i % 3 else "GET"
        path = f"/apis/made{i}.example/v1/namespaces/n{i}/things{i}/t{i}" if i % 2 else f"/made/up/{i}"
        async with sem:
            resp = await client.request(method, f"{proxy.url}{path}")
        codes[resp.status_code] = codes.get(resp.status_code, 0) + 1

    async with httpx.AsyncClient(verify=proxy.tls(cert=False), http2=True, timeout=60) as client:
        await asyncio.gather(*(one(client, i) for i in range(10_000)))
    grown = _series(proxy.metrics()) - before
    assert sum(codes.values()) == 10_000
    assert grown <= 60, f"{grown} new series from invented input (codes {codes})"


def test_readyz_turns_503_the_moment_sigterm_arrives(sbx: SandboxState, tmp_path: Path) -> None:
    p = ProxyProcess(sbx, tmp_path, user_config={"protocol": {"shutdownTimeoutSeconds": 20}}, health_interval=0.5)
    p.start()
    watch = subprocess.Popen(
        ["curl", "-sN", "--http2", "--cacert", p.ca, "--cert", p.admin_cert[0], "--key", p.admin_cert[1],
         f"{p.url}/api/v1/namespaces/default/configmaps?watch=1"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while p.metric("gatekeeper_proxy_backend_watches") < 1:  # the watch holds the drain open
            assert time.monotonic() < deadline, "the watch never opened"
            time.sleep(0.1)
        assert processes.probe(f"{p.metrics_url}/readyz")[0]
        assert p.proc is not None
        p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while True:
            _, detail = processes.probe(f"{p.metrics_url}/readyz")
            if detail.startswith("503"):
                break
            assert time.monotonic() < deadline, f"/readyz two seconds after SIGTERM: {detail}"
            time.sleep(0.05)
        assert p.proc.poll() is None, "the proxy exited instead of draining"
        watch.terminate()
        watch.wait(10)
        assert p.proc.wait(30) == 0  # drained once the watch left, exit 0
    finally:
        if watch.poll() is None:
            watch.kill()
        p.stop()


def test_chunked_upgrade_body_cannot_smuggle_a_request_with_another_identity(
    sbx: SandboxState, proxy: ProxyProcess,
) -> None:
    """A tenant's upgrade request with a chunked body whose bytes are a second request as system:masters.

    The apiserver refuses the upgrade (403 for the tenant), then, before the fix, read the body as the
    next request on the front-proxy-certificate connection and created the namespace as ``admin``.
    """
    issued = PKI(sbx.certs_dir).issue_client(f"edge-tenant-{uuid.uuid4().hex[:8]}", user="edge-tenant")
    ctx = ssl.create_default_context(cafile=proxy.ca)
    ctx.load_cert_chain(str(issued.cert), str(issued.key))
    ctx.set_alpn_protocols(["http/1.1"])
    name = f"smuggled-{uuid.uuid4().hex[:8]}"
    obj = json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}).encode()
    inner = (b"POST /api/v1/namespaces HTTP/1.1\r\nHost: x\r\nX-Remote-User: admin\r\n"
             b"X-Remote-Group: system:masters\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
             % (len(obj), obj))
    outer = (b"POST /api/v1/namespaces/default/pods HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
             b"Connection: Upgrade\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"%x\r\n%b\r\n0\r\n\r\n" % (len(inner), inner))
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s, \
            ctx.wrap_socket(s, server_hostname="127.0.0.1") as tls:
        tls.sendall(outer)
        data = b""
        while b"\r\n\r\n" not in data and (chunk := tls.recv(65536)):
            data += chunk
    assert data.startswith(b"HTTP/1.1 4"), data[:200]  # the tenant may not create pods; the body was one
    time.sleep(1.0)  # the apiserver reads a smuggled request right after the first one; give it time
    with httpx.Client(verify=proxy.tls(cert=True), timeout=20) as client:
        assert client.get(f"{proxy.url}/api/v1/namespaces/{name}").status_code == 404, "the smuggled create ran"


def test_identity_header_variants_from_an_http1_tenant_do_not_reach_the_apiserver_as_identity(
    sbx: SandboxState, proxy: ProxyProcess,
) -> None:
    """Case, underscore and obs-fold variants of X-Remote-*: the apiserver still sees the tenant.

    Client X-Remote-* are stripped case-insensitively; ``X_Remote_User`` passes but Go canonicalises it
    to ``X_remote_user``, which the requestheader authenticator never reads (checked directly against
    the apiserver too: 401 with the front-proxy certificate); a folded line becomes part of the previous
    value; a name with whitespace before the colon is a 400 (counted h1_malformed).
    """
    issued = PKI(sbx.certs_dir).issue_client(f"edge-tenant-{uuid.uuid4().hex[:8]}", user="edge-tenant")
    ctx = ssl.create_default_context(cafile=proxy.ca)
    ctx.load_cert_chain(str(issued.cert), str(issued.key))
    ctx.set_alpn_protocols(["http/1.1"])
    review = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode()

    def post(extra: bytes) -> bytes:
        raw = (b"POST /apis/authentication.k8s.io/v1/selfsubjectreviews HTTP/1.1\r\nHost: x\r\n" + extra +
               b"Content-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%b"
               % (len(review), review))
        return h1_exchange(proxy, ctx, raw)

    for extra in (b"X-REMOTE-USER: admin\r\nx-remote-group: system:masters\r\n",
                  b"X_Remote_User: admin\r\nX_Remote_Group: system:masters\r\nX-Remote_Extra-scopes: all\r\n",
                  b"X-Foo: a\r\n X-Remote-User: admin\r\n"):
        data = post(extra)
        assert data.startswith(b"HTTP/1.1 201"), data[:300]
        info = json.loads(data.split(b"\r\n\r\n", 1)[1])["status"]["userInfo"]
        assert info["username"] == "edge-tenant" and "system:masters" not in info.get("groups", []), (extra, info)
    before = rejected(proxy, "h1_malformed")
    assert post(b"X-Remote-User : admin\r\n").startswith(b"HTTP/1.1 400"), "whitespace before the colon"
    assert rejected(proxy, "h1_malformed") == before + 1


def test_http1_client_that_pipelines_then_resets_ends_its_watch(proxy: ProxyProcess) -> None:
    """A watch, 256 KiB of pipelined requests behind it (past the proxy's 64 KiB read-ahead), then an RST (a
    killed client with bytes unread): the apiserver watch ends. Before, the proxy had stopped reading the
    client and held the watch open until its next event."""
    before = proxy.metric("gatekeeper_proxy_backend_watches")
    raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    tls = proxy.tls(cert=True).wrap_socket(raw, server_hostname="127.0.0.1")
    try:
        tls.sendall(b"GET /api/v1/namespaces/default/configmaps?watch=1 HTTP/1.1\r\nhost: x\r\n\r\n")
        assert tls.recv(65536).startswith(b"HTTP/1.1 200")
        one = b"GET /version HTTP/1.1\r\nhost: x\r\n\r\n"
        tls.sendall(one * (256 * 1024 // len(one)))
        deadline = time.monotonic() + 10
        while proxy.metric("gatekeeper_proxy_backend_watches") != before + 1:
            assert time.monotonic() < deadline, "the watch never started"
            time.sleep(0.1)
        time.sleep(1.0)  # the proxy read its 64 KiB ahead and stopped reading
        tls.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        tls.close()
    deadline = time.monotonic() + 20
    while proxy.metric("gatekeeper_proxy_backend_watches") != before:
        assert time.monotonic() < deadline, "the watch of a client that reset was still open after 20 s"
        time.sleep(0.2)
