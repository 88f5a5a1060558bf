"""Who may call the webhook, how much it reads, and when it says it is ready (real TLS, real sockets)."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import ClientError, ClientSession, TCPConnector, web
from review_fixtures import b64, container, pod, review, secret

from gatekeeper.certs.pki import PKI
from gatekeeper.webhook.app import build_app, metrics
from gatekeeper.webhook.server import serve
from gatekeeper.webhook.settings import GpuSettings, ServerSettings, WebhookSettings
from gatekeeper.webhook.templates import TemplateKeeper
from gatekeeper.webhook.tls import ReloadingContext

APISERVER = "kube-apiserver-webhook-client"


class Recorder:
    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    async def __call__(self, obj: dict[str, Any]) -> None:
        self.created.append(obj)


@dataclass
class Served:
    url: str
    pki: PKI
    created: list[dict[str, Any]]

    def client_ctx(self, name: str | None, pki: PKI | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.cert_path("ca")))
        if name:
            issuer = pki or self.pki
            issued = issuer.issue_client(name, user=name)
            ctx.load_cert_chain(str(issued.cert), str(issued.key))
        return ctx

    async def post(self, path: str, doc: Any, name: str | None = APISERVER, pki: PKI | None = None,
                   raw: bytes | None = None) -> tuple[int, Any]:
        async with ClientSession(connector=TCPConnector(ssl=self.client_ctx(name, pki))) as s:
            async with s.post(self.url + path, data=raw if raw is not None else orjson.dumps(doc)) as r:
                body = await r.read()
                try:
                    return r.status, orjson.loads(body)
                except orjson.JSONDecodeError:
                    return r.status, body.decode()


def _pki(tmp_path: Path, name: str = "pki") -> PKI:
    pki = PKI(tmp_path / name)
    pki.init()
    return pki


async def _serve(tmp_path: Path, *, client_ca: bool, max_body: int = 6 * 1024 * 1024) -> AsyncIterator[Served]:
    pki = _pki(tmp_path)
    issued = pki.issue_serving("webhook", ips=["127.0.0.1"])
    server = ServerSettings(port=0, cert_file=str(issued.cert), key_file=str(issued.key),
                            max_body_bytes=max_body,
                            client_ca_file=str(pki.cert_path("ca")) if client_ca else "",
                            allowed_client_names=[APISERVER] if client_ca else [])
    settings = WebhookSettings(server=server, gpu=GpuSettings(default_mode="dra"))
    recorder = Recorder()
    tls = ReloadingContext(server.cert_file, server.key_file, client_ca_file=server.client_ca_file)
    runner = web.AppRunner(build_app(settings, TemplateKeeper(recorder, 60)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.base)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield Served(f"https://127.0.0.1:{port}", pki, recorder.created)
    finally:
        await runner.cleanup()


@pytest.fixture
async def open_webhook(tmp_path: Path) -> AsyncIterator[Served]:
    async for s in _serve(tmp_path, client_ca=False):
        yield s


@pytest.fixture
async def authn_webhook(tmp_path: Path) -> AsyncIterator[Served]:
    async for s in _serve(tmp_path, client_ca=True):
        yield s


def _refused(route: str, reason: str) -> float:
    return metrics().refused.labels(route, reason)._value.get()


async def test_forged_review_without_client_ca_creates_nothing(open_webhook: Served) -> None:
    before = _refused("mutate", "unauthenticated-create")
    status, r = await open_webhook.post("/mutate", review(pod(container("m", 1))), name=None)
    assert status == 200 and r["response"]["allowed"] is False
    assert r["response"]["status"]["code"] == 403 and "clientCaFile" in r["response"]["status"]["message"]
    assert open_webhook.created == []
    assert _refused("mutate", "unauthenticated-create") == before + 1
    # What the unauthenticated mode still does: validation, and dry-run rewrites (no side effects).
    status, r = await open_webhook.post("/validate", review(secret(data={"a": b64(300 * 1024)})), name=None)
    assert status == 200 and r["response"]["allowed"] is False
    status, r = await open_webhook.post("/mutate", review(pod(container("m", 1)), dry_run=True), name=None)
    assert r["response"]["allowed"] is True and "patch" in r["response"] and open_webhook.created == []


async def test_caller_without_certificate_gets_403(authn_webhook: Served) -> None:
    before = _refused("mutate", "unauthenticated")
    status, body = await authn_webhook.post("/mutate", review(pod(container("m", 1))), name=None)
    assert status == 403 and "only the kube-apiserver" in body
    assert authn_webhook.created == [] and _refused("mutate", "unauthenticated") == before + 1


async def test_certificate_from_the_ca_with_another_name_gets_403(authn_webhook: Served) -> None:
    status, _ = await authn_webhook.post("/mutate", review(pod(container("m", 1))), name="some-pod")
    assert status == 403 and authn_webhook.created == []


async def test_kept_connections_of_the_apiserver_and_another_name_keep_their_own_verdicts(
        authn_webhook: Served) -> None:
    """The caller's name is matched once per connection (app.verified_caller): reviews alternating over a kept
    connection of the apiserver and one of another certificate from the same CA (each session keeps its
    connection alive) never borrow each other's name. Matching on the settings alone failed here."""
    doc = orjson.dumps(review(pod(container("m", 1))))
    async with ClientSession(connector=TCPConnector(ssl=authn_webhook.client_ctx(APISERVER))) as ours, \
            ClientSession(connector=TCPConnector(ssl=authn_webhook.client_ctx("some-pod"))) as theirs:
        for _ in range(3):
            for session, expected in ((ours, 200), (theirs, 403), (theirs, 403), (ours, 200)):
                async with session.post(authn_webhook.url + "/mutate", data=doc) as r:
                    await r.read()
                    assert r.status == expected


async def test_certificate_from_another_ca_fails_the_handshake(authn_webhook: Served, tmp_path: Path) -> None:
    rogue = _pki(tmp_path, "rogue")
    # TLS 1.3: the server's alert arrives on the first read, so aiohttp reports it as a client error.
    with pytest.raises((ClientError, ssl.SSLError)):
        await authn_webhook.post("/mutate", review(pod(container("m", 1))), name=APISERVER, pki=rogue)
    assert authn_webhook.created == []


async def test_the_apiserver_certificate_gets_templates_created(authn_webhook: Served) -> None:
    status, r = await authn_webhook.post("/mutate", review(pod(container("m", 1))))
    assert status == 200 and r["response"]["allowed"] is True, r
    assert len(authn_webhook.created) == 1
    # Probes carry no client certificate and still work.
    async with ClientSession(connector=TCPConnector(ssl=authn_webhook.client_ctx(None))) as s:
        async with s.get(authn_webhook.url + "/readyz") as resp:
            assert resp.status == 200


async def test_body_above_the_limit_is_refused_with_413(tmp_path: Path) -> None:
    async for served in _serve(tmp_path, client_ca=False, max_body=256 * 1024):
        before = _refused("validate", "too-large")
        status, body = await served.post("/validate", None, name=None, raw=b"x" * (300 * 1024))
        assert status == 413 and "maxBodyBytes" in body
        assert _refused("validate", "too-large") == before + 1
        status, r = await served.post("/validate", review(secret(data={"a": b64(10 * 1024)})), name=None)
        assert status == 200 and r["response"]["allowed"] is True


def test_default_body_limit_fits_an_update_of_two_largest_objects() -> None:
    limit = ServerSettings().max_body_bytes
    assert 2 * 3 * 1024 * 1024 < limit <= 7 * 1024 * 1024  # was 32 MiB


async def test_readyz_is_false_until_started_and_again_after_sigterm(tmp_path: Path) -> None:
    app = build_app(WebhookSettings(gpu=GpuSettings(enabled=False)), ready=False)
    from aiohttp.test_utils import TestClient, TestServer
    async with TestClient(TestServer(app)) as c:
        resp = await c.get("/readyz")
        assert resp.status == 503 and "starting" in await resp.text()

    pki = _pki(tmp_path)
    issued = pki.issue_serving("webhook", ips=["127.0.0.1"])
    port_file = tmp_path / "port"
    server = ServerSettings(port=0, cert_file=str(issued.cert), key_file=str(issued.key),
                            port_file=str(port_file), shutdown_delay_seconds=3.0)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(WebhookSettings(server=server, gpu=GpuSettings(enabled=False)), stop))
    ctx = ssl.create_default_context(cafile=str(pki.cert_path("ca")))
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert not task.done() and time.monotonic() < deadline
            await asyncio.sleep(0.02)
        url = f"https://127.0.0.1:{int(port_file.read_text())}"
        async with ClientSession(connector=TCPConnector(ssl=ctx, force_close=True)) as s:
            async with s.get(url + "/readyz") as resp:
                assert resp.status == 200
            stop.set()  # what the SIGTERM handler does
            async with s.get(url + "/readyz") as resp:
                assert resp.status == 503 and "shutting down" in await resp.text()
            async with s.post(url + "/validate", data=orjson.dumps(review(secret(data={"a": b64(1024)})))) as resp:
                assert resp.status == 200  # reviews still answered while endpoints propagate
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
