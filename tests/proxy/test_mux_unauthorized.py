"""A 401 on the multiplexed HTTP/2 upstream (``upstream.http2UnauthorizedPauseSeconds``).

kube-apiserver answers a 401 on HTTP/2 with GOAWAY (checked against the sandbox:
``GOAWAY error=0 last_stream=<that stream>`` arrives before the 401's head). A
token the proxy verified can still be refused there (revoked, its bound object
deleted), so a tenant holding many of them could make the shared connection
reconnect once per token, and the other tenants' streams that raced each GOAWAY
were re-sent, a second refusal failing them as a connect failure (which ejects
the backend). The backend here behaves as kube-apiserver does; the same is proven
against the real apiservers in ``test_mux_revoked_sandbox.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from edge_kit import make_pki
from prometheus_client import REGISTRY
from test_mux_upstream import Peer, Switching, fetch, get, read_all, send

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.h2wire import frames as f
from gatekeeper.proxy.messages import ProxyRequest
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream.client import BackendClient

REVOKED = "Bearer revoked"


class Apiserver(Switching):
    """``h2`` when offered, HTTP/1.1 otherwise; a token starting ``revoked`` gets 401, on HTTP/2 after a GOAWAY
    naming the highest stream read so far (``last`` overrides it: streams read after it were not processed)."""

    def __init__(self, pki: PKI) -> None:
        super().__init__(pki)
        self.h1_requests: list[str] = []
        self.hold: asyncio.Event | None = None
        """Set by a test: every answer waits for it (the test sends other streams in between)."""
        self.last: int | None = None
        self.script = self.apiserver

    async def start(self) -> str:
        url = await super().start()
        self.ctx.set_alpn_protocols(["h2", "http/1.1"])
        return url

    @staticmethod
    async def apiserver(backend: Apiserver, peer: Peer, sid: int, headers: dict[str, str]) -> None:  # type: ignore[override]
        if backend.hold is not None:
            await backend.hold.wait()  # waiters wake in order: the 401 first
        refused = getattr(peer, "goaway_last", None)
        if refused is not None and sid > refused:
            return  # read after the GOAWAY: not processed (the client must send it again)
        if not headers.get("authorization", "").startswith(REVOKED):
            peer.respond(sid, 200, b"ok " + headers[":path"].encode())
            return
        last = backend.last if backend.last is not None else peer.conn.highest_inbound_stream_id
        peer.goaway_last = last  # type: ignore[attr-defined]
        peer.conn.send_headers(sid, [(":status", "401"), ("content-type", "application/json")], end_stream=True)
        peer.writer.write(f.goaway(last, 0) + peer.conn.data_to_send())  # as Go: the GOAWAY, then the head

    def h1_answer(self, head: bytes) -> bytes:
        self.h1_requests.append(head.split(b" ")[1].decode())
        if f"authorization: {REVOKED}".lower().encode() in head.lower():
            return b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n"
        return super().h1_answer(head)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached in 5 s")


def sample(metric: str, backend: str) -> float:
    return REGISTRY.get_sample_value(metric, {"backend": backend}) or 0.0


@pytest.fixture
async def apiserver(pki: PKI, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    b = Apiserver(pki)
    url = await b.start()
    name = request.node.name[:40]
    client = BackendClient(name, url, UpstreamSettings(
        ca_file=str(pki.cert_path("ca")), response_header_timeout_seconds=5,
        client_cert_file=str(pki.cert_path("front-proxy-client")),
        client_key_file=str(pki.key_path("front-proxy-client"))))
    yield b, client, name
    await client.close()
    await b.stop()


def tenant(path: str, token: str = "Bearer good") -> ProxyRequest:
    return get(path, [("authorization", token), ("accept", "application/json")])


async def test_revoked_tokens_cost_one_goaway_between_them_not_one_each(apiserver) -> None:
    b, client, name = apiserver
    goaways, pauses = (sample(m, name) for m in ("gatekeeper_proxy_upstream_goaways_total",
                                                 "gatekeeper_proxy_upstream_http2_pauses_total"))
    statuses = []
    for i in range(6):  # six distinct tokens, each verified by the proxy, each refused by the apiserver
        assert await read_all(await send(client, tenant(f"/good{i}"))) in (b"ok /good%d" % i, b"h1 /good%d" % i)
        revoked = await send(client, tenant(f"/revoked{i}", f"{REVOKED}-{i}"))
        await read_all(revoked)
        statuses.append(revoked.status)
    assert statuses == [401] * 6
    assert b.connections == 1  # HTTP/2: the first 401's connection only
    assert sample("gatekeeper_proxy_upstream_goaways_total", name) - goaways == 1
    assert sample("gatekeeper_proxy_upstream_http2_pauses_total", name) - pauses == 1
    assert [p for p in b.h1_requests if p.startswith("/revoked")] == [f"/revoked{i}" for i in range(1, 6)]
    # A certificate caller is not paused: its context has its own connection.
    assert await fetch(client, "/asserted", identity=True) == b"ok /asserted"
    assert b.connections == 2
    # When the pause ends, token callers are multiplexed again.
    assert client.mux is not None
    client.mux.paused = {ctx: time.monotonic() for ctx in client.mux.paused}
    assert await read_all(await send(client, tenant("/later"))) == b"ok /later"


async def test_streams_refused_by_the_goaway_of_a_401_go_over_http11_never_as_second_streams(apiserver) -> None:
    b, client, _ = apiserver
    b.hold = asyncio.Event()
    revoked = asyncio.create_task(send(client, tenant("/revoked", f"{REVOKED}-1")))
    await until(lambda: len(b.requests) == 1)
    b.last = 1  # the other tenants' streams, read after it, were never processed
    others = [asyncio.create_task(fetch(client, f"/v{i}")) for i in range(4)]
    await until(lambda: len(b.requests) == 5)
    b.hold.set()
    refused = await revoked
    assert refused.status == 401 and await read_all(refused) == b""
    assert sorted(await asyncio.gather(*others)) == [b"h1 /v%d" % i for i in range(4)]
    assert [r[":path"] for r in b.requests] == ["/revoked", "/v0", "/v1", "/v2", "/v3"]  # one stream each
    assert sorted(b.h1_requests) == [f"/v{i}" for i in range(4)]
    assert b.connections == 1
    assert client.mux is not None and client.mux.slots.free == client.settings.max_connections_per_backend


async def test_a_request_that_waited_for_a_stream_slot_through_a_401_opens_no_connection(pki: PKI) -> None:
    """One stream slot: the tenant's GET waits behind the revoked one. The 401 (and its GOAWAY) starts the pause
    and frees the slot; the waiting GET must take HTTP/1.1 at once, not open an HTTP/2 connection first."""
    b = Apiserver(pki)
    url = await b.start()
    client = BackendClient("slot-wait", url, UpstreamSettings(
        ca_file=str(pki.cert_path("ca")), response_header_timeout_seconds=5,
        max_connections_per_backend=1))
    try:
        b.hold = asyncio.Event()
        revoked = asyncio.create_task(send(client, tenant("/revoked", f"{REVOKED}-1")))
        await until(lambda: len(b.requests) == 1)
        waiting = asyncio.create_task(fetch(client, "/waited"))
        await asyncio.sleep(0.1)  # it is parked on the one slot, not on the wire
        assert len(b.requests) == 1 and not waiting.done()
        b.hold.set()
        refused = await revoked
        assert refused.status == 401 and await read_all(refused) == b""  # its body read: the slot is free
        assert await waiting == b"h1 /waited"
        assert b.connections == 1, b.connections  # the revoked stream's only
    finally:
        await client.close()
        await b.stop()
