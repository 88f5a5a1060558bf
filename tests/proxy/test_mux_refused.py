"""A request whose HTTP/2 streams the backend refused twice goes over HTTP/1.1, never as a connect failure.

kube-apiserver with ``--goaway-chance`` (the seeds recommend up to 0.02) ends a
random share of its HTTP/2 responses with a graceful GOAWAY naming the highest
stream it has read; streams sent after that were not processed and are sent
again on a fresh connection, where under load the next GOAWAY can catch them
too. A stream refused twice used to fail as a connect failure, which ejects the
backend at once: measured against the real sandbox apiserver with this pool
alone (``--goaway-chance=0.02``, 256 concurrent GETs, the default pool limits),
51 of 5000 requests. Now that request goes once over HTTP/1.1, where the
filter never applies (it sets ``Connection: close`` only on ``HTTP/2.0``
requests), and a backend really going away still fails that connect and is
ejected. The same against the real apiservers: ``test_goaway_chance_sandbox.py``.
"""

from __future__ import annotations

import asyncio

import pytest
from edge_kit import fronted, make_pki
from prometheus_client import REGISTRY
from test_mux_upstream import Peer, Switching, read_all

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.messages import ProxyRequest
from gatekeeper.proxy.pipeline.balancer import Balancer
from gatekeeper.proxy.pipeline.stages import Dispatcher
from gatekeeper.proxy.settings import BackendSettings, UpstreamSettings
from gatekeeper.proxy.upstream.client import BackendClient

REFUSED = "gatekeeper_proxy_upstream_http2_refused_total"


class GoawayEveryStream(Switching):
    """``h2`` when offered, HTTP/1.1 otherwise; on HTTP/2 every connection's first stream is answered with a
    graceful GOAWAY naming the stream before it (so that stream was not processed), as kube-apiserver's
    ``--goaway-chance`` does when it fires before the server read the stream. ``down_after`` refusals, the
    backend stops listening (an apiserver shutting down: GOAWAY, then connections refused)."""

    def __init__(self, pki: PKI, down_after: int | None = None) -> None:
        super().__init__(pki)
        self.refusals = 0
        self.down_after = down_after
        self.h1_paths: list[str] = []
        self.script = self.refuse

    async def start(self) -> str:
        url = await super().start()
        self.ctx.set_alpn_protocols(["h2", "http/1.1"])
        return url

    @staticmethod
    async def refuse(backend: GoawayEveryStream, peer: Peer, sid: int,  # type: ignore[override]
                     headers: dict[str, str]) -> None:
        backend.refusals += 1
        if backend.down_after is not None and backend.refusals >= backend.down_after and backend.server:
            backend.server.close()  # no new connection from now on; this one still sends its GOAWAY
        peer.raw(f.goaway(max(sid - 2, 0), 0))

    def h1_answer(self, head: bytes) -> bytes:
        self.h1_paths.append(head.split(b" ")[1].decode())
        return super().h1_answer(head)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def refused(name: str) -> float:
    return REGISTRY.get_sample_value(REFUSED, {"backend": name}) or 0.0


def tenant(target: str) -> ProxyRequest:
    return fronted(ProxyRequest(method="GET", target=target, headers=[("authorization", "Bearer t")], body=None,
                                protocol="h2", token_verified=True))


async def dispatcher(b: GoawayEveryStream, name: str) -> tuple[Dispatcher, Balancer, BackendClient]:
    url = await b.start()
    client = BackendClient(name, url, UpstreamSettings(ca_file=str(b.pki.cert_path("ca")),
                                                       response_header_timeout_seconds=5))
    balancer = Balancer([BackendSettings(url=url, name=name)])
    return Dispatcher(balancer, {name: client}), balancer, client


async def test_a_request_refused_on_both_streams_goes_over_http11_and_never_ejects_the_backend(pki: PKI) -> None:
    b = GoawayEveryStream(pki)
    name = "goaway-every-stream"
    dispatch, balancer, client = await dispatcher(b, name)
    before = refused(name)
    try:
        for i in range(3):
            response = await dispatch(tenant(f"/api/v1/namespaces/n/configmaps/c{i}"))
            assert response.status == 200
            assert await read_all(response) == f"h1 /api/v1/namespaces/n/configmaps/c{i}".encode()
            response.finish(None)
        (state,) = balancer.backends
        assert state.ejections_total == 0 and state.connect_failures_total == 0
        assert balancer.health(state) == "healthy"
        assert b.refusals == 6 and b.connections == 6  # two streams each, on fresh connections: bounded
        assert b.h1_paths == [f"/api/v1/namespaces/n/configmaps/c{i}" for i in range(3)]
        assert refused(name) - before == 3
        assert client.mux is not None and client.mux.slots.free == client.settings.max_connections_per_backend
    finally:
        await client.close()
        await b.stop()


async def test_a_backend_going_away_is_still_ejected_by_the_http11_connect_that_follows(pki: PKI) -> None:
    """GOAWAY on both streams, and the backend stops listening: the HTTP/1.1 connect fails, which ejects it."""
    b = GoawayEveryStream(pki, down_after=2)
    name = "goaway-then-down"
    dispatch, balancer, client = await dispatcher(b, name)
    try:
        response = await dispatch(tenant("/api/v1/namespaces/n/configmaps"))
        assert response.status == 503
        await read_all(response)
        (state,) = balancer.backends
        assert state.connect_failures_total == 1 and state.ejections_total == 1
        assert balancer.health(state) == "ejected"
        assert b.refusals == 2 and b.h1_paths == []
        assert refused(name) == 1
    finally:
        await client.close()
        await b.stop()


async def test_a_backend_gone_before_the_second_stream_is_ejected_by_that_connect(pki: PKI) -> None:
    """GOAWAY, then no listener: the second stream's connect fails (no HTTP/1.1 attempt), as before."""
    b = GoawayEveryStream(pki, down_after=1)
    name = "goaway-then-gone"
    dispatch, balancer, client = await dispatcher(b, name)
    try:
        response = await dispatch(tenant("/api/v1/namespaces/n/configmaps"))
        assert response.status == 503
        await read_all(response)
        (state,) = balancer.backends
        assert state.ejections_total == 1
        assert b.refusals == 1 and b.h1_paths == [] and refused(name) == 0
    finally:
        await client.close()
        await b.stop()


async def test_concurrent_requests_refused_together_each_go_over_http11_once(pki: PKI) -> None:
    """Many streams refused by one GOAWAY, then again on the next connection: every request gets its answer,
    each crossed HTTP/1.1 once, and nothing loops."""
    b = GoawayEveryStream(pki)
    name = "goaway-concurrent"
    dispatch, balancer, client = await dispatcher(b, name)
    try:
        responses = await asyncio.gather(*(dispatch(tenant(f"/r{i}")) for i in range(20)))
        bodies = sorted([(await read_all(r)).decode() for r in responses])
        assert bodies == sorted(f"h1 /r{i}" for i in range(20))
        assert sorted(b.h1_paths) == sorted(f"/r{i}" for i in range(20))
        assert balancer.backends[0].ejections_total == 0
        assert b.refusals <= 2 * 20
    finally:
        await client.close()
        await b.stop()
