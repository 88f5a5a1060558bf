"""The HTTP/1.1 upstream pool (lean.py) against the real sandbox apiservers.

The in-process tests (test_lean_upstream.py) pin the framing rules byte by byte;
these show the same client keeping connections alive with kube-apiserver and
forwarding every body shape it meets from real clients: an HTTP/1.1 chunked
upload becomes a chunked upstream request, a sized one goes with its
Content-Length, HEAD and DELETE come back right.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import ProxyProcess

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def sbx(request: pytest.FixtureRequest) -> SandboxState:
    value = request.getfixturevalue("sandbox")
    assert isinstance(value, SandboxState)
    return value


@pytest.fixture(scope="module")
def proxy(sbx: SandboxState, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    p = ProxyProcess(sbx, tmp_path_factory.mktemp("lean-proxy"), name="lean-proxy", health_interval=0.5)
    p.start()
    yield p
    assert p.stop() == 0


def upstream_connections(proxy: ProxyProcess) -> float:
    text = httpx.get(f"{proxy.metrics_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("gatekeeper_proxy_upstream_connections{"))


async def test_small_gets_keep_their_upstream_connections_alive(proxy: ProxyProcess) -> None:
    async with httpx.AsyncClient(verify=proxy.tls(cert=True), http2=True) as client:
        async def calls(n: int) -> list[int]:
            return [(await client.get(f"{proxy.url}/api/v1/namespaces/default")).status_code for _ in range(n)]

        statuses = [s for batch in await asyncio.gather(*(calls(40) for _ in range(8))) for s in batch]
    assert statuses == [200] * 320
    open_now = upstream_connections(proxy)
    # The health probes keep one connection per apiserver. The request path keeps more alive (a
    # client closing after each response would add none), at most the peak concurrency each apiserver
    # saw (8 callers), never one per request (320: a pool that neither reuses nor closes).
    assert 3 + 1 <= open_now <= 3 + 3 * 8, open_now


async def test_chunked_and_sized_uploads_head_and_delete_reach_the_apiserver(proxy: ProxyProcess) -> None:
    name = f"lean-{uuid.uuid4().hex[:6]}"
    base = f"{proxy.url}/api/v1/namespaces/default/configmaps"
    doc = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": "v" * 5000}}

    async def pieces() -> AsyncIterator[bytes]:  # no length known: chunked to the proxy and upstream
        raw = json.dumps(doc).encode()
        for i in range(0, len(raw), 1000):
            yield raw[i:i + 1000]

    async with httpx.AsyncClient(verify=proxy.tls(cert=True), http1=True, http2=False) as client:
        created = await client.post(base, content=pieces(), headers={"content-type": "application/json"})
        assert created.status_code == 201, created.text
        assert created.json()["data"]["k"] == "v" * 5000
        doc["data"] = {"k": "sized"}
        doc["metadata"]["resourceVersion"] = created.json()["metadata"]["resourceVersion"]
        replaced = await client.put(f"{base}/{name}", content=json.dumps(doc).encode(),
                                    headers={"content-type": "application/json"})
        assert replaced.status_code == 200 and replaced.json()["data"] == {"k": "sized"}
        head = await client.head(f"{proxy.url}/livez")  # resources answer HEAD with 405; health endpoints do not
        assert head.status_code == 200 and head.content == b""
        after_head = await client.get(f"{base}/{name}")  # the connection after a HEAD still works
        assert after_head.status_code == 200 and after_head.json()["data"] == {"k": "sized"}
        deleted = await client.delete(f"{base}/{name}")
        assert deleted.status_code == 200
        gone = await client.get(f"{base}/{name}")
        assert gone.status_code == 404
