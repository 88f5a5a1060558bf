"""Uploads queued for a flow-control seat cannot make the proxy hold unbounded request bodies.

A request waiting in a queue has not been forwarded, so the proxy holds the DATA its
client sends (up to the stream and connection windows) until a seat frees. Many such
connections add up; ``protocol.maxBufferedRequestBytes`` bounds the process. Here,
against the real apiservers: a tenant's upload takes the only seat of its level and
keeps its body open, three more of the same tenant queue behind it and send a window
each, and the one that would pass the budget is reset (ENHANCE_YOUR_CALM) while the
others keep waiting. Tenant identities only (system:masters is exempt from APF).
"""

from __future__ import annotations

import asyncio
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import storm_kit as kit
import yaml

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

WINDOW = 65536
BUDGET = 150_000
"""Room for two queued streams' windows (131072), not three."""


def _policy() -> str:
    level = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
             "metadata": {"name": "uploads"},
             "spec": {"type": "Limited", "limited": {
                 "nominalConcurrencyShares": 1, "lendablePercent": 0,
                 "limitResponse": {"type": "Queue",
                                   "queuing": {"queues": 4, "handSize": 1, "queueLengthLimit": 10}}}}}
    schema = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
              "metadata": {"name": "uploads"},
              "spec": {"matchingPrecedence": 500, "priorityLevelConfiguration": {"name": "uploads"},
                       "distinguisherMethod": {"type": "ByUser"},
                       "rules": [{"subjects": [{"kind": "Group", "group": {"name": kit.STORM_GROUP}}],
                                  "resourceRules": [{"verbs": ["create"], "apiGroups": [""],
                                                     "resources": ["configmaps"], "namespaces": ["*"]}]}]}}
    return yaml.safe_dump_all([level, schema])


async def _held_body(head: bytes, go: asyncio.Event) -> AsyncIterator[bytes]:
    """``head``, then (once ``go`` is set) the 10 bytes that complete it: the upload holds its seat till then."""
    yield head
    await go.wait()
    yield b" " * 10  # JSON allows trailing whitespace


def test_queued_uploads_past_the_process_budget_are_reset_and_the_rest_wait(
        sandbox: SandboxState, tmp_path: Path) -> None:
    ns = f"fc-budget-{uuid.uuid4().hex[:6]}"
    assert kit.kubectl(sandbox, "create", "namespace", ns).returncode == 0
    applied = kit.kubectl(sandbox, "apply", "-f", "-", input=kit.storm_rbac_and_observer())
    assert applied.returncode == 0, applied.stderr
    policy = tmp_path / "uploads.yaml"
    policy.write_text(_policy())
    # 6 seats in all: 1 for "uploads" (1 share) and 5 for the built-in catch-all (5 shares).
    flow = {"files": [str(policy)], "serverConcurrencyLimit": 6}
    extra = {"protocol": {"streamWindowBytes": WINDOW, "maxBufferedRequestBytes": BUDGET}}
    issued = PKI(sandbox.certs_dir).issue_client("fc-uploader", user="uploader", groups=[kit.STORM_GROUP])
    try:
        with kit.run_proxy(sandbox, tmp_path / "proxy", flow, extra=extra) as proxy:
            asyncio.run(_scenario(sandbox, proxy, ns, issued.cert, issued.key))
    finally:
        kit.kubectl(sandbox, "delete", "namespace", ns, "--wait=false")
        kit.kubectl(sandbox, "delete", "-f", "-", "--ignore-not-found", input=kit.storm_rbac_and_observer())


async def _scenario(state: SandboxState, proxy: kit.ProxyProcess, ns: str, cert: Path, key: Path) -> None:
    ctx = ssl.create_default_context(cafile=str(SandboxPKI(Path(state.certs_dir)).ca))
    ctx.load_cert_chain(str(cert), str(key))
    url = f"/api/v1/namespaces/{ns}/configmaps"
    go = asyncio.Event()
    async with httpx.AsyncClient(base_url=proxy.url, verify=ctx, http2=True, timeout=60) as client:
        for _ in range(50):  # the apiservers' RBAC informers pick the new binding up within moments
            r = await client.get(url)
            if r.status_code != 403:
                break
            await asyncio.sleep(0.2)
        assert r.status_code == 200, r.text

        def upload(name: str, *, held: bool) -> asyncio.Task[httpx.Response]:
            head = b'{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"%s"}}' % name.encode()
            # A queued upload is one stream window of JSON (padded with whitespace), all sent at once:
            # the client never waits on flow control, the proxy holds it until a seat frees.
            body: bytes | AsyncIterator[bytes] = _held_body(head, go) if held else head.ljust(WINDOW)
            size = len(head) + 10 if held else WINDOW
            return asyncio.create_task(client.post(url, content=body, headers={
                "content-type": "application/json", "content-length": str(size)}))

        holder = upload("holder", held=True)  # takes the level's only seat; its body waits for `go`
        await _until(lambda: _metric(proxy, "gatekeeper_flowcontrol_current_executing_seats",
                                     priority_level="uploads") == 1)
        rejected0 = _metric(proxy, "gatekeeper_proxy_rejected_total", reason="body_budget")
        queued = [upload(f"queued-{i}", held=False) for i in range(3)]
        await _until(lambda: _metric(proxy, "gatekeeper_proxy_rejected_total", reason="body_budget") > rejected0)
        done, waiting = await asyncio.wait(queued, timeout=2)
        assert len(done) == 1 and len(waiting) == 2, "exactly the stream that would pass the budget is refused"
        with pytest.raises(httpx.ProtocolError):  # the reset stream (httpx names it local or remote)
            done.pop().result()
        held = _metric(proxy, "gatekeeper_proxy_buffered_request_bytes")
        assert 0 < held <= BUDGET, held
        assert _metric(proxy, "gatekeeper_flowcontrol_current_inqueue_requests", priority_level="uploads") == 2
        go.set()  # the holder finishes, the seat frees, the queued two are forwarded in turn
        responses = await asyncio.gather(holder, *waiting)
        assert [r.status_code for r in responses] == [201, 201, 201], [r.text[:200] for r in responses]
    await _until(lambda: _metric(proxy, "gatekeeper_proxy_buffered_request_bytes") == 0)


def _metric(proxy: kit.ProxyProcess, name: str, **labels: str) -> float:
    return kit.metric_sum(proxy.metrics(), name, **labels)


async def _until(predicate: object, limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)
