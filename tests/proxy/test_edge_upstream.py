"""Upstream behaviour under attack or failure: no silent re-sends, no ejection for client faults,
bounded waits for a connection and for response headers, watches in their own pool, clean errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from edge_kit import bench, make_pki, proxy_settings

from gatekeeper.base.config import ConfigError, load_config
from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.adapter import ClientGone
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.pipeline.stages import build
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream.client import make_ssl_context
from gatekeeper.sandbox.processes import free_port

ADMIN = {"subject": ((("organizationName", "system:masters"),), (("commonName", "admin"),))}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def req(method: str, target: str, body: AsyncIterator[bytes] | None = None) -> ProxyRequest:
    return ProxyRequest(method=method, target=target, headers=[], body=body, protocol="h2",
                        peer="127.0.0.1:5555", peer_cert=ADMIN)


async def drain(resp: ProxyResponse) -> bytes:
    out = b"".join([c async for c in resp.body])
    resp.finish(None)
    return out


async def test_request_on_a_reused_connection_is_never_resent(pki: PKI) -> None:
    """A client library re-sends PUT/DELETE once when a reused connection was closed; the proxy must not."""
    async with bench(pki) as b:
        await drain(await b.pipeline.handler(req("GET", "/api/v1/namespaces/a/configmaps/warm")))
        resp = await b.pipeline.handler(req("DELETE", "/die/api/v1/namespaces/a/configmaps/c"))
        await drain(resp)
        assert resp.status == 502
        assert [p for p in b.backend.paths() if p.startswith(b"/die")] == [b"/die/api/v1/namespaces/a/configmaps/c"]


async def test_client_closing_mid_body_does_not_eject_the_backend(pki: PKI) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"kind":"ConfigMap",'
        await asyncio.sleep(0.05)
        raise ClientGone("client reset the stream")

    async with bench(pki) as b:
        resp = await b.pipeline.handler(req("POST", "/api/v1/namespaces/a/configmaps", body()))
        await drain(resp)
        be = b.pipeline.balancer.backends[0]
        assert resp.status == 400
        assert be.ejections_total == 0 and b.pipeline.balancer.health(be) == "healthy"
        assert be.in_flight == 0


async def test_connect_error_body_names_the_backend_not_the_exception(pki: PKI) -> None:
    dead = f"https://127.0.0.1:{free_port()}"
    settings = proxy_settings(pki, [dead])
    pipeline = build(settings)
    try:
        resp = await pipeline.handler(req("POST", "/api/v1/namespaces/a/configmaps", None))
        status = orjson.loads(await drain(resp))
    finally:
        await pipeline.close()
    assert resp.status == 503
    assert status["message"] == "gatekeeper proxy: apiserver backend-0 unreachable (connection refused)"
    for leak in ("SSLContext", "ssl:", "0x", "127.0.0.1", "Errno"):
        assert leak not in status["message"]


async def test_pool_acquire_times_out_with_503_and_no_ejection(pki: PKI) -> None:
    async with bench(pki, upstream={"max_connections_per_backend": 1, "pool_acquire_timeout_seconds": 0.3}) as b:
        b.backend.slow_seconds = 3.0
        slow = asyncio.create_task(b.pipeline.handler(req("GET", "/slow/api/v1/pods")))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        resp = await b.pipeline.handler(req("GET", "/api/v1/namespaces/a/configmaps"))
        status = orjson.loads(await drain(resp))
        assert resp.status == 503 and time.monotonic() - started < 2.0
        assert dict(resp.headers)["retry-after"] == "1"
        assert "busy" in status["message"]
        assert b.pipeline.balancer.backends[0].ejections_total == 0
        await drain(await slow)


async def test_watches_do_not_take_the_short_request_pool(pki: PKI) -> None:
    async with bench(pki, upstream={"max_connections_per_backend": 1, "pool_acquire_timeout_seconds": 2}) as b:
        watches = [await b.pipeline.handler(req("GET", f"/api/v1/namespaces/n{i}/pods?watch=1")) for i in range(5)]
        for w in watches:
            assert w.status == 200
            assert await w.body.__anext__()  # the first event: the watch is open upstream
        async with asyncio.timeout(1.5):
            resp = await b.pipeline.handler(req("GET", "/api/v1/namespaces/a/configmaps"))
            await drain(resp)
        assert resp.status == 200
        assert b.pipeline.balancer.backends[0].watches == 5
        for w in watches:
            await w.body.aclose()  # type: ignore[attr-defined]
            w.finish(None)


async def test_response_header_timeout_gives_504_but_spares_watches(pki: PKI) -> None:
    async with bench(pki, upstream={"response_header_timeout_seconds": 0.3}) as b:
        b.backend.slow_seconds = 3.0
        started = time.monotonic()
        resp = await b.pipeline.handler(req("GET", "/slow/api/v1/namespaces/a/configmaps"))
        await drain(resp)
        assert resp.status == 504 and time.monotonic() - started < 2.0
        assert b.pipeline.balancer.backends[0].ejections_total == 0
        watch = await b.pipeline.handler(req("GET", "/api/v1/pods?watch=1"))
        assert watch.status == 200
        await asyncio.sleep(0.5)  # longer than the header timeout: the watch is still open
        assert b.pipeline.balancer.backends[0].watches == 1
        await watch.body.aclose()  # type: ignore[attr-defined]
        watch.finish(None)


def test_upstream_trusts_only_the_configured_ca(pki: PKI) -> None:
    ctx = make_ssl_context(UpstreamSettings(ca_file=str(pki.cert_path("ca"))), client_cert=False)
    assert ctx.cert_store_stats()["x509_ca"] == 1
    empty = make_ssl_context(UpstreamSettings(), client_cert=False)
    assert empty.cert_store_stats()["x509_ca"] == 0, "system roots were loaded for the apiservers"


def test_config_without_upstream_ca_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text("proxy:\n  backends: [{url: 'https://127.0.0.1:6443'}]\n"
                    "  listener: {certFile: a, keyFile: b}\n  upstream: {}\n")
    with pytest.raises(ConfigError, match="caFile is required"):
        load_config(path, need="proxy")



async def test_client_failing_its_upgrade_does_not_eject_the_backend(pki: PKI) -> None:
    async def early_bytes() -> AsyncIterator[bytes]:
        raise ClientGone("client closed before the upgrade")
        yield b""  # pragma: no cover - makes this an async generator

    async with bench(pki) as b:
        request = req("GET", "/api/v1/namespaces/a/pods/p/exec?command=sh", early_bytes())
        request.protocol = "http/1.1"
        request.headers = [("connection", "Upgrade"), ("upgrade", "websocket")]
        resp = await b.pipeline.handler(request)
        await drain(resp)
        be = b.pipeline.balancer.backends[0]
        assert resp.status == 400
        assert be.ejections_total == 0 and b.pipeline.balancer.health(be) == "healthy" and be.in_flight == 0
