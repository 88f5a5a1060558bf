"""A granted retry of HTTP/2 (``upstream.http2RetrySeconds``) that ends before the backend's ALPN answer.

A backend once found to answer HTTP/1.1 is asked for ``h2`` again by one eligible
request per interval. A request granted that attempt can fail before it connects
(no stream slot in time, its caller gone, no front-proxy certificate) or while it
connects; the grant used to be spent all the same, so a backend that had turned
HTTP/2 on waited another interval (5 minutes by default). It now goes to the next
eligible request, which asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from edge_kit import make_pki
from test_mux_upstream import Switching, fetch, interval_passes

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.settings import UpstreamSettings
from gatekeeper.proxy.upstream.client import BackendClient, ConnectFailed, NoFrontProxyCert, PoolTimeout


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def no_stream_slot_in_time(client: BackendClient, monkeypatch: pytest.MonkeyPatch) -> None:
    assert client.mux is not None and client.mux.slots.try_take()
    try:
        with pytest.raises(PoolTimeout):
            await fetch(client, "/granted")
    finally:
        client.mux.slots.release()


async def caller_gone_while_waiting_for_a_slot(client: BackendClient, monkeypatch: pytest.MonkeyPatch) -> None:
    assert client.mux is not None and client.mux.slots.try_take()
    task = asyncio.create_task(fetch(client, "/granted"))
    for _ in range(500):
        if client.mux.slots.waiters:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    client.mux.slots.release()


async def connect_refused(client: BackendClient, monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    create_connection = loop.create_connection

    async def refused_once(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(loop, "create_connection", create_connection)
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(loop, "create_connection", refused_once)
    with pytest.raises(ConnectFailed):
        await fetch(client, "/granted")


async def no_front_proxy_certificate(client: BackendClient, monkeypatch: pytest.MonkeyPatch) -> None:
    client.tls_identity = None
    with pytest.raises(NoFrontProxyCert):
        await fetch(client, "/granted", identity=True)


Failure = Callable[[BackendClient, pytest.MonkeyPatch], Awaitable[None]]


@pytest.mark.parametrize("fail", [no_stream_slot_in_time, caller_gone_while_waiting_for_a_slot, connect_refused,
                                  no_front_proxy_certificate])
async def test_a_granted_retry_that_never_got_the_alpn_answer_goes_to_the_next_request(
        pki: PKI, monkeypatch: pytest.MonkeyPatch, fail: Failure) -> None:
    b = Switching(pki)
    url = await b.start()
    client = BackendClient("granted", url, UpstreamSettings(
        ca_file=str(pki.cert_path("ca")), pool_acquire_timeout_seconds=0.1, max_connections_per_backend=1,
        client_cert_file=str(pki.cert_path("front-proxy-client")),
        client_key_file=str(pki.key_path("front-proxy-client"))))
    try:
        assert await fetch(client, "/a") == b"h1 /a"
        b.answer("h2")
        interval_passes(client)
        await fail(client, monkeypatch)
        assert b.connections == 0  # the granted attempt never reached the backend's HTTP/2 side
        assert await fetch(client, "/b") == b"ok /b"  # the next request asked, and the backend said h2
        assert client.mux is not None and client.mux.h2
    finally:
        await client.close()
        await b.stop()


async def test_an_attempt_that_got_the_answer_still_waits_out_the_interval(pki: PKI) -> None:
    """Only an attempt that never got the answer gives the grant back: one told HTTP/1.1 used it up."""
    b = Switching(pki)
    url = await b.start()
    client = BackendClient("answered", url, UpstreamSettings(ca_file=str(pki.cert_path("ca"))))
    try:
        assert await fetch(client, "/a") == b"h1 /a"
        interval_passes(client)
        assert await fetch(client, "/b") == b"h1 /b"  # asked again, told HTTP/1.1 again
        b.answer("h2")
        assert await fetch(client, "/c") == b"h1 /c"  # within the interval: not asked
        assert b.h1_connections == 2 and b.connections == 0
    finally:
        await client.close()
        await b.stop()
