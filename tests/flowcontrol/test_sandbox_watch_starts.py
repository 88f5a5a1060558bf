"""One flow may start only so many watches at once (``flowControl.watchStarts``), against the real apiservers.

kubernetes#98423: neither max-inflight nor APF limits new watches upstream, so a tenant that opens hundreds at once
gets them all. Through the proxy a flow (here a tenant's certificate, the seeds' ByUser schema) gets ``burst`` at
once, then 429 with a Retry-After of the time until its bucket refills; another tenant is not affected. Watches from
a resourceVersion hold their seat only until their response head, so three open watches leave the 2-seat level free.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest
import storm_kit as kit

from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox


def test_a_flow_starting_watches_too_fast_gets_429s_and_another_flow_does_not(
        sandbox: SandboxState, tmp_path: Path) -> None:
    applied = kit.kubectl(sandbox, "apply", "-f", "-", input=kit.storm_rbac_and_observer())
    assert applied.returncode == 0, applied.stderr
    flow = {"files": [str(kit.SEEDS)], "watchStarts": {"perFlowPerSecond": 0.5, "burst": 3}}
    # One worker: each worker process keeps its own buckets (docs/flowcontrol/index.md#new-watches-per-flow).
    with kit.run_proxy(sandbox, tmp_path / "proxy", flow, workers=1) as proxy:
        base = f"{proxy.url}/api/v1/namespaces/default/secrets"

        async def run() -> tuple[list[httpx.Response], httpx.Response, float]:
            async with contextlib.AsyncExitStack() as stack:
                busy = await stack.enter_async_context(
                    httpx.AsyncClient(verify=kit.tenant_ctx(sandbox, "ws-busy"), timeout=30))
                quiet = await stack.enter_async_context(
                    httpx.AsyncClient(verify=kit.tenant_ctx(sandbox, "ws-quiet"), timeout=30))
                listed = await busy.get(base)
                assert listed.status_code == 200, listed.text
                rv = listed.json()["metadata"]["resourceVersion"]
                url = f"{base}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=60"
                opened = [await stack.enter_async_context(busy.stream("GET", url)) for _ in range(5)]
                executing = kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_current_executing_seats",
                                           priority_level="secrets-list")
                other = await stack.enter_async_context(quiet.stream("GET", url))
                for r in opened:
                    if r.status_code == 429:
                        await r.aread()
                return opened, other, executing

        opened, other, executing = asyncio.run(run())
        statuses = [r.status_code for r in opened]
        assert statuses == [200, 200, 200, 429, 429], statuses
        refused = opened[3]
        assert refused.headers["retry-after"] == "2"  # one watch at 0.5 per second
        assert refused.json()["reason"] == "TooManyRequests" and "watchStarts" in refused.json()["message"]
        assert other.status_code == 200  # the other tenant's flow has its own bucket
        assert executing == 0  # open watches from a resourceVersion hold no seat of the 2-seat level
        rejected = kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_rejected_requests_total",
                                  flow_schema="secrets-list", reason="watch-rate")
        assert rejected == 2
