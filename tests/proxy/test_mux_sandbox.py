"""The multiplexed HTTP/2 upstream against the real sandbox apiservers, with a tenant ServiceAccount token.

kube-apiserver answers an anonymous or unauthenticated request on HTTP/2 with
GOAWAY (its HTTP/2 DoS mitigation). These tests show both halves of how the
multiplexed upstream lives with that: the proxy never sends such a request on a
shared connection (a bad token and an anonymous call take the HTTP/1.1 pool),
and when a GOAWAY comes anyway, the streams the apiserver did not process are
sent again and every caller gets its answer.

A token the proxy verifies can still be refused there: one minted for a
ServiceAccount deleted since verifies locally (signature, expiry), so its first
request goes as a stream and gets 401 with a GOAWAY before the head. The first
such 401 pauses multiplexing for token callers
(``upstream.http2UnauthorizedPauseSeconds``), so many revoked tokens cost one
GOAWAY per apiserver, not one each.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.messages import ProxyRequest
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream import mux_pool
from gatekeeper.proxy.upstream.client import H2_ALPN, make_ssl_context
from gatekeeper.proxy.upstream.hop_by_hop import response_headers
from gatekeeper.proxy.upstream.mux_wire import authority_field, request_block
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess, metric_sum
from gatekeeper.sandbox.with_proxy import IDENTITY_RBAC, default_flow_control

pytestmark = pytest.mark.sandbox


def kubectl(state: SandboxState, *args: str, stdin: str | None = None) -> str:
    import subprocess

    kc = str(state.extra.get("kubectl") or "kubectl")
    out = subprocess.run([kc, "--kubeconfig", state.kubeconfig, *args], input=stdin, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def tenant(sandbox: SandboxState) -> Iterator[tuple[str, str]]:
    """A namespace with a ServiceAccount that may read it, and that ServiceAccount's token."""
    ns = f"mux-{secrets.token_hex(3)}"
    kubectl(sandbox, "apply", "-f", "-", stdin=IDENTITY_RBAC.read_text())
    kubectl(sandbox, "create", "namespace", ns)
    kubectl(sandbox, "-n", ns, "create", "serviceaccount", "reader")
    kubectl(sandbox, "-n", ns, "create", "rolebinding", "reader", "--clusterrole=view", f"--serviceaccount={ns}:reader")
    token = kubectl(sandbox, "-n", ns, "create", "token", "reader", "--duration=1h").strip()
    try:
        yield ns, token
    finally:
        kubectl(sandbox, "delete", "namespace", ns, "--wait=false")


def running_proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory, name: str,
                  workers: int | None = None) -> Iterator[ProxyProcess]:
    p = ProxyProcess(sandbox, tmp_path_factory.mktemp(name), name=name, health_interval=0.5, workers=workers,
                     user_config={"flowControl": default_flow_control()})
    p.start()
    yield p
    assert p.stop() == 0


@pytest.fixture(scope="module")
def proxy(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    yield from running_proxy(sandbox, tmp_path_factory, "mux-proxy")


async def until_allowed(client: httpx.AsyncClient, path: str, headers: dict[str, str] | None = None) -> None:
    """The RoleBinding reaches the apiservers' RBAC caches within moments."""
    for _ in range(100):
        if (await client.get(path, headers=headers)).status_code == 200:
            return
        await asyncio.sleep(0.1)


def upstream_calls(metrics: str) -> float:
    """Streams sent, plus requests coalesced onto another's stream: the seeds' policy holds namespaced
    configmap LISTs too, so identical concurrent LISTs of one caller share a single upstream stream."""
    return (metric_sum(metrics, "gatekeeper_proxy_upstream_http2_streams_total")
            + metric_sum(metrics, "gatekeeper_flowcontrol_coalesced_requests_total"))


def ca_context(state: SandboxState) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(SandboxPKI(Path(state.certs_dir)).ca))


async def test_tenant_gets_are_multiplexed_and_bad_tokens_never_cost_a_goaway(
        sandbox: SandboxState, proxy: ProxyProcess, tenant: tuple[str, str]) -> None:
    ns, token = tenant
    path = f"{proxy.url}/api/v1/namespaces/{ns}/configmaps"
    good = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(verify=ca_context(sandbox), timeout=30) as client:
        await until_allowed(client, path, good)
        before = (await client.get(f"{proxy.metrics_url}/metrics")).text

        async def mixed(k: int) -> list[int]:
            statuses = []
            for i in range(10):
                statuses.append((await client.get(path, headers=good)).status_code)
                bad = await client.get(path, headers={"authorization": f"Bearer made-up-{k}-{i}"})
                anonymous = await client.get(f"{proxy.url}/version")
                statuses += [bad.status_code, anonymous.status_code]
            return statuses

        results = await asyncio.gather(*(mixed(k) for k in range(6)))
        after = (await client.get(f"{proxy.metrics_url}/metrics")).text
    statuses = [s for r in results for s in r]
    assert statuses.count(200) >= 60 and statuses.count(401) == 60, statuses
    streams = upstream_calls(after) - upstream_calls(before)
    assert streams == 60  # every tenant GET, and nothing else, went as a stream (or rode one, coalesced)
    assert metric_sum(after, "gatekeeper_proxy_upstream_goaways_total") == 0
    assert metric_sum(after, "gatekeeper_proxy_upstream_errors_total") == 0


def test_kubectl_reads_through_the_multiplexed_upstream(sandbox: SandboxState, proxy: ProxyProcess,
                                                        tenant: tuple[str, str]) -> None:
    ns, token = tenant
    kubectl(sandbox, "-n", ns, "create", "configmap", "seen-through-h2", "--from-literal=k=v")
    before = metric_sum(httpx.get(f"{proxy.metrics_url}/metrics", timeout=10).text,
                        "gatekeeper_proxy_upstream_http2_streams_total")
    out = kubectl(sandbox, "--server", proxy.url, "--token", token, "--certificate-authority",
                  str(SandboxPKI(Path(sandbox.certs_dir)).ca), "--kubeconfig", "/dev/null",
                  "-n", ns, "get", "configmap", "seen-through-h2", "-o", "jsonpath={.data.k}")
    assert out == "v"
    after = metric_sum(httpx.get(f"{proxy.metrics_url}/metrics", timeout=10).text,
                       "gatekeeper_proxy_upstream_http2_streams_total")
    assert after > before


async def test_streams_in_flight_when_the_apiserver_sends_goaway_all_get_their_answer(
        sandbox: SandboxState, tenant: tuple[str, str]) -> None:
    """An anonymous request forced onto the shared connection (the proxy itself never does this) makes the
    real apiserver send GOAWAY; every tenant stream in flight around it still gets its answer.

    Go's server names the highest stream it has read as the last one, so here the streams all arrived
    before its GOAWAY; the re-send of streams above it is proven against the scripted backend
    (``test_mux_upstream.py::test_streams_above_a_goaway_are_sent_again_and_those_below_finish``)."""
    ns, token = tenant
    url = urlsplit(sandbox.apiserver_urls[0])
    settings = UpstreamSettings(ca_file=str(SandboxPKI(Path(sandbox.certs_dir)).ca))
    ctx = make_ssl_context(settings, client_cert=False, alpn=H2_ALPN)
    goaways: list[int] = []
    pool = mux_pool.MuxPool(url.hostname or "", url.port or 443, limit=256, max_streams=100, connect_timeout=5,
                            on_goaway=lambda: goaways.append(1))
    authority = authority_field(url.netloc)
    tenant_fields = request_block("GET", f"/api/v1/namespaces/{ns}/configmaps", authority,
                                   [("authorization", f"Bearer {token}"), ("accept", "application/json")],
                                   frozenset())
    anonymous_fields = request_block("GET", "/version", authority, [], frozenset())

    async def call(fields: bytes) -> tuple[int, bytes]:
        status, raw, body = await mux_pool.exchange(pool, "apiserver-1", ctx, lambda: (ctx,), fields,
                                                    head_only=False, header_timeout=30, acquire_timeout=10,
                                                    on_done=lambda e: None)
        response_headers(raw)
        return status, b"".join([chunk async for chunk in body])

    try:
        calls = [call(tenant_fields) for _ in range(15)] + [call(anonymous_fields)]
        calls += [call(tenant_fields) for _ in range(15)]
        results = await asyncio.gather(*calls)
    finally:
        pool.close()
    assert [status for status, _ in results] == [200] * 31
    assert all(b'"kind":"ConfigMapList"' in body for _, body in results[:15] + results[16:])
    assert goaways, "the apiserver did not send GOAWAY for the anonymous HTTP/2 request"


async def test_a_tenant_certificate_caller_is_asserted_over_the_shared_connection(
        sandbox: SandboxState, proxy: ProxyProcess, tenant: tuple[str, str]) -> None:
    """The front-proxy certificate asserts the caller's identity per stream: RBAC grants this user alone the read."""
    ns, _ = tenant
    user = f"{ns}-cert-reader"
    issued = PKI(sandbox.certs_dir).issue_client(user, user=user)
    kubectl(sandbox, "-n", ns, "create", "rolebinding", "cert-reader", "--clusterrole=view", f"--user={user}")
    ctx = ca_context(sandbox)
    ctx.load_cert_chain(str(issued.cert), str(issued.key))
    path = f"{proxy.url}/api/v1/namespaces/{ns}/configmaps"
    async with httpx.AsyncClient(verify=ctx, timeout=30) as client:
        await until_allowed(client, path)
        before = upstream_calls((await client.get(f"{proxy.metrics_url}/metrics")).text)
        statuses = [r.status_code for r in await asyncio.gather(*(client.get(path) for _ in range(20)))]
        forbidden = await client.get(f"{proxy.url}/api/v1/namespaces/kube-system/secrets")
        after = (await client.get(f"{proxy.metrics_url}/metrics")).text
    assert statuses == [200] * 20
    assert forbidden.status_code == 403 and user in forbidden.text  # the apiserver saw this user, not the proxy
    assert upstream_calls(after) - before == 21
    assert metric_sum(after, "gatekeeper_proxy_upstream_goaways_total") == 0


async def test_a_real_apiserver_answering_http11_is_served_on_the_connection_that_found_out(
        sandbox: SandboxState, tenant: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """kube-apiserver always picks ``h2`` when it is offered, so the contexts here offer ``http/1.1`` alone
    (what an HTTP/1.1-only apiserver answers): the Go server's TLS session, taken over by the HTTP/1.1
    pool mid-flight, carries the tenant's GETs, and no second connection is made to it."""
    from gatekeeper.proxy.upstream import client as client_module

    ns, token = tenant
    headers = [("authorization", f"Bearer {token}"), ("accept", "application/json")]
    request = ProxyRequest(method="GET", target=f"/api/v1/namespaces/{ns}/configmaps", headers=headers, body=None,
                           protocol="h2")
    settings = UpstreamSettings(ca_file=str(SandboxPKI(Path(sandbox.certs_dir)).ca))
    warm = client_module.BackendClient("apiserver-warm", sandbox.apiserver_urls[0], settings)  # sent over HTTP/1.1
    try:
        for _ in range(100):  # the RoleBinding reaches the apiserver's RBAC cache within moments
            response = await warm.send(request, headers, identity=False, swallow_body_errors=False,
                                       on_done=lambda e: None)
            assert response.body is not None
            await response.body.aclose()  # type: ignore[attr-defined]
            if response.status == 200:
                break
            await asyncio.sleep(0.1)
    finally:
        await warm.close()
    monkeypatch.setattr(client_module, "H2_ALPN", ("http/1.1",))
    backend = client_module.BackendClient("apiserver-h1", sandbox.apiserver_urls[0], settings)
    loop = asyncio.get_running_loop()
    connects: list[object] = []
    create_connection = loop.create_connection

    async def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        connects.append(args[1:3])
        return await create_connection(*args, **kwargs)

    monkeypatch.setattr(loop, "create_connection", counted)
    try:
        bodies = []
        for _ in range(3):
            response = await backend.send(request, headers, identity=False, swallow_body_errors=False,
                                          on_done=lambda e: None, multiplex=True)
            assert response.status == 200 and response.body is not None
            bodies.append(b"".join([chunk async for chunk in response.body]))
        assert all(b'"kind":"ConfigMapList"' in body for body in bodies)
        assert backend.mux is not None and backend.mux.h2 is False
        assert len(connects) == 1 and backend.connections() == 1
    finally:
        await backend.close()


REVOKED_TOKENS = 40


def admin_context(state: SandboxState) -> ssl.SSLContext:
    certs = SandboxPKI(Path(state.certs_dir))
    ctx = ca_context(state)
    ctx.load_cert_chain(str(certs.crt("admin")), str(certs.key("admin")))
    return ctx


def mint(state: SandboxState, ns: str, sa: str, count: int) -> list[str]:
    """``count`` tokens of ``ns/sa`` through the TokenRequest API (one kubectl process each would take seconds)."""
    url = f"{state.apiserver_urls[0]}/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token"
    body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}}
    with httpx.Client(verify=admin_context(state), timeout=30) as c:
        return [c.post(url, json=body).raise_for_status().json()["status"]["token"] for _ in range(count)]


@pytest.fixture(scope="module")
def revoked(sandbox: SandboxState, tenant: tuple[str, str]) -> list[str]:
    """Tokens of a ServiceAccount of the tenant's namespace deleted since: every apiserver refuses them."""
    ns, _ = tenant
    kubectl(sandbox, "-n", ns, "create", "serviceaccount", "gone")
    revoked = mint(sandbox, ns, "gone", REVOKED_TOKENS + 1)
    kubectl(sandbox, "-n", ns, "delete", "serviceaccount", "gone")
    probe, revoked = revoked[0], revoked[1:]  # the others are never used before the test
    with httpx.Client(verify=ca_context(sandbox), timeout=30) as c:  # HTTP/1.1: no GOAWAY either way
        for url in sandbox.apiserver_urls:
            for _ in range(100):  # each apiserver's informer sees the deletion within moments
                if c.get(f"{url}/api/v1/namespaces/{ns}/configmaps",
                         headers={"authorization": f"Bearer {probe}"}).status_code == 401:
                    break
                time.sleep(0.1)
            else:
                pytest.fail(f"{url} still accepts a token of the deleted ServiceAccount")
    return revoked


@pytest.fixture(scope="module")
def one_worker(sandbox: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """A proxy of its own: a pause must not change what the other tests here count, one worker bounds it."""
    yield from running_proxy(sandbox, tmp_path_factory, "revoked-proxy", workers=1)


async def test_revoked_tokens_cost_one_goaway_per_apiserver_and_fail_no_other_tenants_request(
        sandbox: SandboxState, one_worker: ProxyProcess, tenant: tuple[str, str], revoked: list[str]) -> None:
    ns, good = tenant
    proxy = one_worker
    path = f"{proxy.url}/api/v1/namespaces/{ns}/configmaps"
    reader = {"authorization": f"Bearer {good}"}
    async with httpx.AsyncClient(verify=ca_context(sandbox), timeout=30) as client:
        await until_allowed(client, path, reader)
        before = (await client.get(f"{proxy.metrics_url}/metrics")).text
        done = asyncio.Event()

        async def other_tenant() -> list[int]:
            statuses = []
            while not done.is_set():
                statuses.append((await client.get(path, headers=reader)).status_code)
            return statuses

        async def hostile(tokens: list[str]) -> list[int]:
            statuses = []
            for token in tokens:  # each token's first request: verified here, refused there
                statuses.append((await client.get(path, headers={"authorization": f"Bearer {token}"})).status_code)
            return statuses

        others = [asyncio.create_task(other_tenant()) for _ in range(8)]
        refused = await asyncio.gather(*(hostile(revoked[i::4]) for i in range(4)))
        done.set()
        served = await asyncio.gather(*others)
        after = (await client.get(f"{proxy.metrics_url}/metrics")).text

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert sorted(s for r in refused for s in r) == [401] * REVOKED_TOKENS
    statuses = [s for r in served for s in r]
    assert statuses and set(statuses) == {200}, statuses
    backends = len(sandbox.apiserver_urls)
    # One worker: at most one GOAWAY per apiserver (the first 401 each), not one per token.
    assert 1 <= delta("gatekeeper_proxy_upstream_goaways_total") <= backends
    assert 1 <= delta("gatekeeper_proxy_upstream_http2_pauses_total") <= backends
    assert delta("gatekeeper_proxy_upstream_errors_total") == 0  # no connect failure, no ejection
    assert delta("gatekeeper_identity_tokens_total", outcome="refused-upstream") == REVOKED_TOKENS
