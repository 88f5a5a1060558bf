"""The aiohttp edge: routes, 400s on bad bodies, template reconciliation, metrics, TLS reload."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from review_fixtures import apply, b64, container, pod, review, secret

from gatekeeper.certs.pki import PKI, load_cert
from gatekeeper.webhook.app import build_app
from gatekeeper.webhook.server import serve
from gatekeeper.webhook.settings import GpuSettings, ServerSettings, WebhookSettings
from gatekeeper.webhook.templates import AlreadyExists, TemplateError, TemplateKeeper

SETTINGS = WebhookSettings(gpu=GpuSettings(default_mode="dra"))


def as_apiserver(request: object, settings: object) -> str:
    """In-process clients have no TLS: these tests play the verified apiserver (see test_webhook_authn)."""
    return "kube-apiserver"


class FakeCreate:
    def __init__(self, fail: Exception | None = None) -> None:
        self.created: list[dict[str, Any]] = []
        self.fail = fail

    async def __call__(self, obj: dict[str, Any]) -> None:
        if self.fail:
            raise self.fail
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in self.created}:
            raise AlreadyExists()
        self.created.append(obj)


@pytest.fixture
async def client_and_fake(aiohttp_client):  # type: ignore[no-untyped-def]
    fake = FakeCreate()
    app = build_app(SETTINGS, TemplateKeeper(fake, cache_seconds=60), authenticate=as_apiserver)
    return await aiohttp_client(app), fake


@pytest.mark.parametrize(("body", "needle"), [
    (b"", "empty request body"),
    (b"garbage", "not valid JSON"),
    (b'{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"x"}}',
     "only admission.k8s.io/v1"),
    (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"x"}}',
     "request.kind is missing"),
])
async def test_malformed_review_gets_400_with_message(  # type: ignore[no-untyped-def]
        client_and_fake, body: bytes, needle: str) -> None:
    client, _ = client_and_fake
    for route in ("/validate", "/mutate"):
        resp = await client.post(route, data=body, headers={"Content-Type": "application/json"})
        text = await resp.text()
        assert resp.status == 400 and needle in text and "Traceback" not in text


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "x-unknown"])
async def test_compressed_body_gets_415_not_500(client_and_fake, encoding: str) -> None:  # type: ignore[no-untyped-def]
    """The apiserver never compresses reviews; corrupt deflate data used to surface as a 500 with a traceback."""
    client, _ = client_and_fake
    body = orjson.dumps(review(secret(data={"a": b64(1024)})))
    for route in ("/validate", "/mutate"):
        resp = await client.post(route, data=body, headers={"Content-Encoding": encoding})
        text = await resp.text()
        assert resp.status == 415 and "Content-Encoding" in text and "Traceback" not in text


async def test_unknown_kind_is_allowed_untouched(client_and_fake) -> None:  # type: ignore[no-untyped-def]
    client, _ = client_and_fake
    doc = review({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}}, group="apps")
    for route in ("/validate", "/mutate"):
        r = await (await client.post(route, data=orjson.dumps(doc))).json()
        assert r["response"] == {"uid": doc["request"]["uid"], "allowed": True}


async def test_validate_denies_oversized_secret_over_http(  # type: ignore[no-untyped-def]
        client_and_fake) -> None:
    client, _ = client_and_fake
    doc = review(secret(data={"a": b64(300 * 1024)}))
    r = await (await client.post("/validate", data=orjson.dumps(doc))).json()
    assert r["response"]["allowed"] is False
    assert "over the 128 KiB limit" in r["response"]["status"]["message"]


async def test_mutate_creates_template_once_and_never_on_dry_run(client_and_fake) -> None:  # type: ignore[no-untyped-def]
    client, fake = client_and_fake
    obj = pod(container("main", 2))
    dry = await (await client.post("/mutate", data=orjson.dumps(review(obj, dry_run=True)))).json()
    assert fake.created == [] and "patch" in dry["response"]
    for _ in range(3):
        r = await (await client.post("/mutate", data=orjson.dumps(review(obj)))).json()
    assert len(fake.created) == 1
    out = apply(obj, r)
    tname = fake.created[0]["metadata"]["name"]
    assert out["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == tname
    assert dry["response"]["patch"] == r["response"]["patch"]  # dryRun gets the same answer


async def test_template_failure_is_a_failed_call_with_message_for_the_failure_policy(  # type: ignore[no-untyped-def]
        aiohttp_client) -> None:
    """Answered as allowed: false, a template the webhook could not create refused the pod even under failurePolicy
    Ignore (the documented way, docs/operations/index.md, to take the webhook out of the write path); a failed call
    lets the apiserver apply the configured failurePolicy, and under Fail the user still reads the message."""
    app = build_app(SETTINGS, TemplateKeeper(FakeCreate(TemplateError("HTTP 403 Forbidden")), 60),
                    authenticate=as_apiserver)
    client = await aiohttp_client(app)
    resp = await client.post("/mutate", data=orjson.dumps(review(pod(container("m", 1)))))
    assert resp.status == 503 and resp.content_type == "application/json"
    status = await resp.json()
    assert (status["kind"], status["code"], status["reason"]) == ("Status", 503, "ServiceUnavailable")
    assert "403 Forbidden" in status["message"]
    metrics = await (await client.get("/metrics")).text()
    assert 'gatekeeper_webhook_reviews_total{decision="error",operation="CREATE",policy="gpu"}' in metrics


async def test_a_bug_in_a_policy_is_a_failed_call_without_a_traceback(  # type: ignore[no-untyped-def]
        aiohttp_client, monkeypatch) -> None:
    from gatekeeper.webhook import policies

    def broken(*args: Any) -> Any:
        raise RuntimeError("secret detail of the bug")

    monkeypatch.setattr(policies, "validate", broken)
    client = await aiohttp_client(build_app(SETTINGS, authenticate=as_apiserver))
    resp = await client.post("/validate", data=orjson.dumps(review(secret(data={"a": b64(10)}))))
    assert resp.status == 500
    status = await resp.json()
    assert status["reason"] == "InternalError" and "see the webhook's log" in status["message"]
    assert "secret detail" not in await resp.text() and "Traceback" not in await resp.text()


async def test_health_ready_and_metrics(client_and_fake) -> None:  # type: ignore[no-untyped-def]
    client, _ = client_and_fake
    await client.post("/mutate", data=orjson.dumps(review(pod(container("m", 1)))))
    await client.post("/validate", data=b"nope")
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 200
    text = await (await client.get("/metrics")).text()
    assert 'gatekeeper_webhook_reviews_total{decision="mutated",operation="CREATE",policy="gpu"}' in text
    assert 'gatekeeper_webhook_gpu_rewrites_total{mode="dra"}' in text
    assert 'gatekeeper_webhook_bad_requests_total{route="validate"}' in text
    assert "gatekeeper_webhook_review_duration_seconds_bucket" in text


async def test_template_keeper_shares_one_inflight_create_and_expires_cache() -> None:
    now = [0.0]
    calls = 0

    async def slow_create(obj: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)

    keeper = TemplateKeeper(slow_create, cache_seconds=10, clock=lambda: now[0])
    t = {"metadata": {"namespace": "a", "name": "t"}}
    await asyncio.gather(*(keeper.ensure([t]) for _ in range(5)))
    assert calls == 1
    await keeper.ensure([t])
    assert calls == 1
    now[0] = 11
    await keeper.ensure([t])
    assert calls == 2


def _peer_serial(port: int, ca: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    import socket

    with socket.create_connection(("127.0.0.1", port)) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


async def test_serving_certificate_is_reloaded_for_new_connections(tmp_path: Path) -> None:
    pki = PKI(tmp_path / "pki")
    pki.init()
    issued = pki.issue_serving("webhook", ips=["127.0.0.1"])
    port_file = tmp_path / "port"
    server = ServerSettings(port=0, cert_file=str(issued.cert), key_file=str(issued.key),
                            cert_check_interval_seconds=0.0, port_file=str(port_file))
    settings = WebhookSettings(server=server,
                               gpu=GpuSettings(enabled=False))
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop))
    try:
        deadline = time.monotonic() + 30  # generous: a loaded 2-core CI machine starts slowly
        while not (port_file.exists() and port_file.read_text().strip()):
            assert not task.done(), task.exception() if task.done() else None
            assert time.monotonic() < deadline, "webhook did not write its port file within 30 s"
            await asyncio.sleep(0.02)
        port = int(port_file.read_text())
        first = await asyncio.to_thread(_peer_serial, port, pki.cert_path("ca"))
        assert first == load_cert(issued.cert).serial_number
        before = os.stat(issued.cert).st_mtime_ns
        reissued = pki.issue_serving("webhook", ips=["127.0.0.1"])
        os.utime(reissued.cert, ns=(before + 10**9, before + 10**9))
        second = await asyncio.to_thread(_peer_serial, port, pki.cert_path("ca"))
        assert second == load_cert(reissued.cert).serial_number != first
    finally:
        stop.set()
        await task


async def _creator_against(aiohttp_server, handler, request_timeout: float):  # type: ignore[no-untyped-def]
    from aiohttp import web
    from kubernetes_asyncio import client

    from gatekeeper.webhook.kube_api import template_creator

    app = web.Application()
    app.router.add_post("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaimtemplates", handler)
    server = await aiohttp_server(app)
    cfg = client.Configuration(host=str(server.make_url("")).rstrip("/"))
    api = client.ApiClient(configuration=cfg)
    return api, template_creator(api, request_timeout=request_timeout)


TEMPLATE = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"namespace": "team-a", "name": "t"}, "spec": {}}


async def test_template_creator_maps_409_to_already_exists_and_403_to_a_message(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        code = 409 if request.match_info["ns"] == "team-a" else 403
        return web.json_response({"kind": "Status", "code": code}, status=code)

    api, create = await _creator_against(aiohttp_server, handler, 5)
    try:
        with pytest.raises(AlreadyExists):
            await create(TEMPLATE)
        other = {**TEMPLATE, "metadata": {"namespace": "locked", "name": "t"}}
        with pytest.raises(TemplateError, match="locked/t: HTTP 403"):
            await create(other)
    finally:
        await api.close()


async def test_template_creator_gives_up_on_a_hung_apiserver_with_a_message(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    from aiohttp import web

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.json_response({})

    api, create = await _creator_against(aiohttp_server, hang, 0.5)
    try:
        started = time.monotonic()
        with pytest.raises(TemplateError, match="could not reach the apiserver"):
            await create(TEMPLATE)
        assert time.monotonic() - started < 30  # bounded by the request timeout, not by the 60 s hang
    finally:
        await api.close()
