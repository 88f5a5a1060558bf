"""Three proxies in front of the same real apiservers hold one budget through Leases (flowControl.fleet).

Each proxy renews ``gatekeeper-proxy-<identity>`` in gatekeeper-system as its own identity
(system:gatekeeper-proxy, front-proxy certificate) and divides every level by the live fleet: the seeds'
catch-all level (10 seats) becomes 4 + 3 + 3, the 2 secret-LIST seats (fewer than the proxies) become seat
Leases taken on demand, and each apiserver's 4 expensive-LIST slots are dealt out among them. A proxy
killed with SIGKILL stops renewing; the survivors take its share once its Lease has expired. A proxy whose
Leases the apiserver forbids runs on the conservative share (``fallbackMembers``) and counts the failures;
a tenant can neither forge nor delete a fleet Lease.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import storm_kit as kit

from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

RBAC = kit.REPO / "deploy" / "examples" / "proxy-identity-rbac.yaml"
TTL = 6


def fleet(identity: str, **more: object) -> dict[str, object]:
    return {"files": [str(kit.SEEDS)], "expensiveLists": {"maxInFlightPerBackend": 4},
            "fleet": {"enabled": True, "name": f"t-{RUN}", "identity": identity, "leaseDurationSeconds": TTL,
                      "renewIntervalSeconds": 2, **more}}


RUN = uuid.uuid4().hex[:6]


def metric(proxy: kit.ProxyProcess, name: str, **labels: str) -> float:
    return kit.metric_sum(proxy.metrics(), name, **labels)


def slots_per_apiserver(sandbox: SandboxState, proxies: list[kit.ProxyProcess]) -> list[float]:
    names = [f"apiserver-{i}" for i in range(1, len(sandbox.apiserver_urls) + 1)]
    return [sum(metric(p, "gatekeeper_flowcontrol_expensive_lists_cap", backend=n) for p in proxies) for n in names]


def until(predicate: Callable[[], bool], limit: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > limit:
            raise AssertionError(f"{what}: not within {limit}s")
        time.sleep(0.25)
    return time.monotonic() - started


def test_three_proxies_divide_the_budget_and_survivors_take_a_killed_ones_share(
        sandbox: SandboxState, tmp_path: Path) -> None:
    applied = kit.kubectl(sandbox, "apply", "-f", str(RBAC))
    assert applied.returncode == 0, applied.stderr
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(kit.run_proxy(sandbox, tmp_path / f"p{i}", fleet(f"node-{i}-{RUN}")))
                   for i in range(3)]
        # Until its first renewal and listing a proxy assumes fallbackMembers (3) with itself first, so "3 members"
        # alone does not say the ranks are settled: wait for the division itself (it fails if it never comes).
        until(lambda: all(metric(p, "gatekeeper_fleet_members") == 3 for p in proxies)
              and sorted(metric(p, "gatekeeper_fleet_share_seats", priority_level="catch-all") for p in proxies)
              == [3, 3, 4], 4 * TTL, "3 members dividing catch-all's 10 seats as 3 + 3 + 4")
        # 2 secret-LIST seats behind 3 proxies are seat Leases (exactly 2 fleet-wide): idle, nobody holds one
        assert [metric(p, "gatekeeper_fleet_share_seats", priority_level="secrets-list") for p in proxies] == [0] * 3
        # 4 expensive LISTs per apiserver across the fleet: each apiserver's 4 slots are dealt out among them
        until(lambda: slots_per_apiserver(sandbox, proxies) == [4, 4, 4], 2 * TTL, "4 slots on each apiserver")
        leases = kit.kubectl(sandbox, "get", "leases", "-n", "gatekeeper-system", "-l",
                             f"gatekeeper.dev/fleet=t-{RUN}", "-o", "name")
        assert sorted(leases.stdout.split()) == [f"lease.coordination.k8s.io/gatekeeper-proxy-node-{i}-{RUN}"
                                                 for i in range(3)]

        os.killpg(proxies[2].proc.pid, signal.SIGKILL)  # no goodbye: its Lease just stops being renewed
        proxies[2].proc.wait(10)
        survivors = proxies[:2]
        took = until(lambda: all(metric(p, "gatekeeper_fleet_members") == 2 for p in survivors), 4 * TTL,
                     "the survivors to count 2")
        # Not before its Lease expired (a TTL after its last renewal, which was up to one interval before the kill)
        assert took >= TTL - 2 - 0.5, f"the survivors took more {took:.1f}s after the kill, before the Lease expired"
        assert took <= 2 * TTL, f"the survivors took {took:.1f}s: more than the Lease's TTL plus a renewal"
        # the shares follow the member count in the same decision (a scrape may land between the two)
        until(lambda: sorted(metric(p, "gatekeeper_fleet_share_seats", priority_level="catch-all")
                             for p in survivors) == [5, 5], 2.0, "the survivors' catch-all shares 5 + 5")
        until(lambda: slots_per_apiserver(sandbox, survivors) == [4, 4, 4], 2.0, "4 slots on each apiserver")


def test_a_proxy_the_apiserver_refuses_runs_on_the_conservative_share(sandbox: SandboxState, tmp_path: Path) -> None:
    """No RBAC in its fleet namespace: it counts the refusals and divides as if fallbackMembers were alive."""
    kit.kubectl(sandbox, "create", "namespace", f"gk-norbac-{RUN}")
    flow = fleet(f"lonely-{RUN}", namespace=f"gk-norbac-{RUN}", fallbackMembers=5)
    try:
        with kit.run_proxy(sandbox, tmp_path / "p", flow) as proxy:
            until(lambda: metric(proxy, "gatekeeper_fleet_lease_renew_failures_total", reason="forbidden") >= 1,
                  3 * TTL, "a counted refusal")
            until(lambda: metric(proxy, "gatekeeper_fleet_partitioned") == 1, 3 * TTL, "the partition fallback")
            assert metric(proxy, "gatekeeper_fleet_members") == 5
            assert metric(proxy, "gatekeeper_fleet_share_seats", priority_level="catch-all") == 2  # 10 / 5
    finally:
        kit.kubectl(sandbox, "delete", "namespace", f"gk-norbac-{RUN}", "--wait=false")


def test_a_tenant_can_neither_forge_nor_delete_a_fleet_lease(sandbox: SandboxState, tmp_path: Path) -> None:
    applied = kit.kubectl(sandbox, "apply", "-f", str(RBAC))
    assert applied.returncode == 0, applied.stderr
    tenant = str(kit.storm_kubeconfig(sandbox, tmp_path, f"tenant-{RUN}", sandbox.apiserver_urls[0]))
    forged = kit.kubectl(sandbox, "create", "-n", "gatekeeper-system", "-f", "-", kubeconfig_path=tenant, input=(
        "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata:\n  name: gatekeeper-proxy-forged\n"
        f"  labels: {{gatekeeper.dev/fleet: t-{RUN}}}\nspec:\n  holderIdentity: forged\n"))
    assert forged.returncode != 0 and "forbidden" in forged.stderr.lower(), forged.stderr
    gone = kit.kubectl(sandbox, "delete", "lease", "-n", "gatekeeper-system", "--all", kubeconfig_path=tenant)
    assert gone.returncode != 0 and "forbidden" in gone.stderr.lower(), gone.stderr
