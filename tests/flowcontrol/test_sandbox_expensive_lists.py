"""What lands on one apiserver: a cap on expensive LISTs per apiserver, held across two worker processes.

Against the 3 real apiservers, 60 Secrets of 200 KiB (a 12 MB LIST), a level with seats for all of them. Six
tenants LIST the Secrets and read the answer a trickle at a time, with no read ahead, so each LIST stays
executing inside its apiserver (the apiserver's handler is blocked writing it) until the deadline cuts it.
The apiservers' own APF table (an observe-only FlowSchema for the tenants' group) says how many run on each:

* with ``expensiveLists.maxInFlightPerBackend: 1``, never more than one per apiserver, all three in use, and
  the other three LISTs wait (counted);
* without it, the balancer puts two of the six on one apiserver (six over three: it cannot do otherwise);
* three proxies of one fleet (Leases, as deployed) with a cap of 1 per apiserver across the fleet: each owns
  one apiserver's slot, and again no apiserver runs more than one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import storm_kit as kit
from fc_helpers import flow_schema, group, queued_level, rr

from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

SECRETS = 60
SIZE = 200 * 1024
READERS = 6
DEADLINE = 6.0


@pytest.fixture(scope="module")
def big_namespace(sandbox: SandboxState) -> Iterator[str]:
    with kit.big_namespace(sandbox, "fc-expensive", SECRETS, SIZE) as ns:
        yield ns


def _flow_control(cap: int, fleet: dict[str, Any] | None = None) -> dict[str, Any]:
    rules = [{"subjects": [group(kit.STORM_GROUP)], "resourceRules": [rr(["list"], ["secrets"])]}]
    return {
        "serverConcurrencyLimit": 40,
        "bytesPerSeat": 1 << 30,  # one seat per LIST: seats are not what this test limits
        "readAheadBytesPerConnection": 0,  # each LIST stays executing in its apiserver while its reader trickles
        "coalesce": False,
        "expensiveLists": {"maxInFlightPerBackend": cap, "minBytes": 1 << 20},
        "priorityLevelConfigurations": [queued_level("tenant-lists", 30)],
        "flowSchemas": [flow_schema("tenant-lists", "tenant-lists", rules, 400, by="ByUser")],
        **({"fleet": fleet} if fleet else {}),
    }


async def _scenario(state: SandboxState, proxies: list[kit.ProxyProcess], ns: str) -> dict[str, Any]:
    path = f"/api/v1/namespaces/{ns}/secrets"

    async def warm(proxy: kit.ProxyProcess, i: int) -> None:  # each worker learns the LIST's size by reading it
        async with httpx.AsyncClient(base_url=proxy.url, verify=kit.tenant_ctx(state, f"warm-{i}"),
                                     timeout=60) as c:
            r = await c.get(path)
            assert r.status_code == 200, r.text[:300]

    await asyncio.gather(*(warm(p, i) for p in proxies for i in range(4 if len(proxies) == 1 else 1)))
    ports = [int(p.url.rsplit(":", 1)[1]) for p in proxies]
    readers = [asyncio.create_task(kit.slow_reader(ports[i % len(ports)], kit.tenant_ctx(state, f"slow-{i}"), path,
                                                   8192, DEADLINE + 20)) for i in range(READERS)]
    await asyncio.sleep(1.5)
    clients = [kit.admin_client(state, u, timeout=20) for u in state.apiserver_urls]
    per_apiserver = [0] * len(clients)
    busiest_moment = samples = 0
    try:
        for _ in range(30):
            dumps = await asyncio.gather(*(c.get(kit.APF_DUMP) for c in clients))
            now = [kit.apf_executing(d.text, kit.OBSERVE) or 0 for d in dumps]
            per_apiserver = [max(a, b) for a, b in zip(per_apiserver, now, strict=True)]
            busiest_moment = max(busiest_moment, sum(1 for n in now if n))
            samples += 1
            await asyncio.sleep(0.1)
    finally:
        for c in clients:
            await c.aclose()
    held = sum(kit.metric_sum(p.metrics(), "gatekeeper_flowcontrol_expensive_lists_held_total") for p in proxies)
    for r in readers:
        r.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    return {"per_apiserver": per_apiserver, "apiservers_busy": busiest_moment, "held": held, "samples": samples}


def _run(sandbox: SandboxState, tmp_path: Path, ns: str, cap: int) -> dict[str, Any]:
    extra = {"protocol": {"requestTimeoutSeconds": DEADLINE}}
    with kit.run_proxy(sandbox, tmp_path / "proxy", _flow_control(cap), workers=2, extra=extra) as proxy:
        return asyncio.run(_scenario(sandbox, [proxy], ns))


def test_no_apiserver_runs_more_expensive_lists_than_the_cap_across_workers(
        sandbox: SandboxState, big_namespace: str, tmp_path: Path) -> None:
    out = _run(sandbox, tmp_path, big_namespace, cap=1)
    print(f"\nexpensive LISTs per apiserver, cap 1: {out}")
    assert max(out["per_apiserver"]) == 1, out
    assert out["apiservers_busy"] == 3, "every apiserver takes one: the cap spreads, it does not only refuse"
    assert out["held"] >= READERS - 3, out


def test_without_the_cap_the_balancer_lands_two_expensive_lists_on_one_apiserver(
        sandbox: SandboxState, big_namespace: str, tmp_path: Path) -> None:
    out = _run(sandbox, tmp_path, big_namespace, cap=0)
    print(f"\nexpensive LISTs per apiserver, no cap: {out}")
    assert max(out["per_apiserver"]) >= 2, out
    assert out["held"] == 0


def test_a_fleet_of_three_proxies_holds_the_cap_on_every_apiserver(
        sandbox: SandboxState, big_namespace: str, tmp_path: Path) -> None:
    applied = kit.kubectl(sandbox, "apply", "-f", str(kit.REPO / "deploy" / "examples" / "proxy-identity-rbac.yaml"))
    assert applied.returncode == 0, applied.stderr
    run = uuid.uuid4().hex[:6]
    extra = {"protocol": {"requestTimeoutSeconds": DEADLINE}}
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(kit.run_proxy(
            sandbox, tmp_path / f"p{i}", _flow_control(1, {
                "enabled": True, "name": f"x-{run}", "identity": f"x-{i}-{run}", "leaseDurationSeconds": 6,
                "renewIntervalSeconds": 2}), workers=1, extra=extra)) for i in range(3)]
        def slots() -> list[list[float]]:
            return [[kit.metric_sum(p.metrics(), "gatekeeper_flowcontrol_expensive_lists_cap",
                                    backend=f"apiserver-{b}") for b in (1, 2, 3)] for p in proxies]

        # Until a proxy has renewed its Lease and listed the fleet it assumes fallbackMembers (3) and rank 1:
        # all of them own the same slot for that moment. Settled, each owns one apiserver's slot.
        for _ in range(60):
            now = slots()
            if [sum(col) for col in zip(*now, strict=True)] == [1, 1, 1] and all(sum(p) == 1 for p in now):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the fleet never dealt one slot per apiserver: {now}")
        out = asyncio.run(_scenario(sandbox, proxies, big_namespace))
    print(f"\nexpensive LISTs per apiserver, fleet of 3, cap 1: {out}")
    assert max(out["per_apiserver"]) == 1, out
    assert out["apiservers_busy"] == 3, out
