"""Two tenants reading a big secret LIST a trickle at a time cannot lock the seeds' 2-seat level.

Against the real apiservers, with the seeds' policy (2 concurrent secret LISTs) and 60 Secrets of 200 KiB
(a 12 MB LIST): two tenant connections LIST them and take the answer at 32 KiB/s through small socket
buffers. A third tenant's ``kubectl get secrets`` (a real client-go client) then completes with 200:

* with the read ahead (the default) at once, because the slow readers' seats went back when the apiserver
  had sent its last byte;
* without it (``readAheadBytesPerConnection: 0``) the slow readers hold both seats until their deadline,
  so a queue wait shorter than the deadline (the defaults: 15 s and 60 s) ends in 429s; the read ahead is
  kept for that reason (docs/proxy/deadline.md).

Either way each slow reader's connection is closed at ``requestTimeoutSeconds`` with its response unfinished,
counted as ``reason="deadline"``. Tenant identities only: system:masters is exempt from APF.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import storm_kit as kit

from gatekeeper.sandbox.state import SandboxState

pytestmark = pytest.mark.sandbox

SECRETS = 60
SIZE = 200 * 1024
DEADLINE = 8.0
RATE = 32 * 1024
"""Bytes per second a slow reader takes."""


@pytest.fixture(scope="module")
def big_namespace(sandbox: SandboxState) -> Iterator[str]:
    with kit.big_namespace(sandbox, "fc-slow", SECRETS, SIZE) as ns:
        yield ns


def _seats(proxy: kit.ProxyProcess) -> float:
    return kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_current_executing_seats",
                          priority_level="secrets-list")


async def _scenario(state: SandboxState, proxy: kit.ProxyProcess, ns: str, tenant: Path) -> dict[str, object]:
    port = int(proxy.url.rsplit(":", 1)[1])
    path = f"/api/v1/namespaces/{ns}/secrets"
    # A reader notices the close only once it has drained what its TLS layer already holds (up to a few hundred
    # KiB, seconds at RATE): it may read up to 30 s past the deadline, and stops when the connection ends.
    readers = [asyncio.create_task(kit.slow_reader(port, kit.tenant_ctx(state, f"slow-{i}"), path, RATE, DEADLINE + 30))
               for i in range(2)]
    deadline0 = kit.metric_sum(proxy.metrics(), "gatekeeper_proxy_rejected_total", reason="deadline")
    await asyncio.sleep(2.0)  # both LISTs dispatched, their clients trickling
    seats_meanwhile = _seats(proxy)
    code, names, took, err = await kit.kubectl_list(state, tenant, ns, chunk=500, limit_s=120)
    results = await asyncio.gather(*readers)
    deadline1 = kit.metric_sum(proxy.metrics(), "gatekeeper_proxy_rejected_total", reason="deadline")
    return {"code": code, "names": names, "took": took, "err": err, "readers": results,
            "seats_meanwhile": seats_meanwhile, "deadline_cuts": deadline1 - deadline0, "seats_after": _seats(proxy)}


def _run(sandbox: SandboxState, tmp_path: Path, ns: str, flow: dict[str, object]) -> dict[str, object]:
    extra = {"protocol": {"requestTimeoutSeconds": DEADLINE}}
    with kit.run_proxy(sandbox, tmp_path / "proxy", {"files": [str(kit.SEEDS)], **flow}, extra=extra) as proxy:
        tenant = kit.storm_kubeconfig(sandbox, tmp_path, "tenant-c", proxy.url)
        return asyncio.run(_scenario(sandbox, proxy, ns, tenant))


def _readers_cut_at_the_deadline(out: dict[str, object]) -> None:
    for got, closed in out["readers"]:  # type: ignore[attr-defined]
        assert closed, "a slow reader's response must end at the deadline, not run on"
        assert 0 < got < SECRETS * SIZE, got
    assert out["deadline_cuts"] >= 2
    assert out["seats_after"] == 0


def test_two_slow_readers_leave_the_seats_to_another_tenants_list(
        sandbox: SandboxState, big_namespace: str, tmp_path: Path) -> None:
    out = _run(sandbox, tmp_path, big_namespace, {})
    assert out["code"] == 0, out["err"]
    assert len(out["names"]) == SECRETS  # type: ignore[arg-type]
    assert out["seats_meanwhile"] == 0, "the slow readers' seats go back once the apiserver is done"
    assert out["took"] < DEADLINE, f"the third tenant waited {out['took']:.1f}s"
    _readers_cut_at_the_deadline(out)


def test_without_read_ahead_slow_readers_hold_the_seats_until_their_deadline(
        sandbox: SandboxState, big_namespace: str, tmp_path: Path) -> None:
    """The design not kept: the third tenant waits for the deadline to free a seat (its queue wait is
    longer than the deadline here, so it is served after it; with the defaults it would get 429s)."""
    out = _run(sandbox, tmp_path, big_namespace, {"readAheadBytesPerConnection": 0, "queueWaitSeconds": 30})
    assert out["seats_meanwhile"] == 2
    assert out["code"] == 0, out["err"]
    assert DEADLINE - 3 <= out["took"] < DEADLINE + 10, f"the third tenant waited {out['took']:.1f}s"
    _readers_cut_at_the_deadline(out)


def test_slow_readers_of_big_lists_keep_the_proxys_memory_within_the_read_ahead_budget(
        sandbox: SandboxState, big_namespace: str, tmp_path: Path) -> None:
    """Two slow readers of a 16 MB LIST each, with ``readAheadBytes`` at 2 MiB: the proxy stops reading
    upstream at the budget, so its memory grows by about the budget, not by the 32 MB the apiservers send."""
    budget = 2 << 20
    flow = {"files": [str(kit.SEEDS)], "readAheadBytes": budget}
    with kit.run_proxy(sandbox, tmp_path / "proxy", flow, workers=1,
                       extra={"protocol": {"requestTimeoutSeconds": 20}}) as proxy:
        asyncio.run(_budgeted(sandbox, proxy, big_namespace, budget))


async def _budgeted(state: SandboxState, proxy: kit.ProxyProcess, ns: str, budget: int) -> None:
    port = int(proxy.url.rsplit(":", 1)[1])
    before = kit.tree_rss(proxy.proc.pid)
    readers = [asyncio.create_task(kit.slow_reader(port, kit.tenant_ctx(state, f"slow-{i}"), f"/api/v1/namespaces/{ns}"
                                                   "/secrets", RATE, 8)) for i in range(2)]
    peak, held = before, 0.0
    while not all(r.done() for r in readers):
        peak = max(peak, kit.tree_rss(proxy.proc.pid))
        held = max(held, kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_read_ahead_bytes"))
        await asyncio.sleep(0.2)
    await asyncio.gather(*readers)
    assert 0 < held <= budget + 2 * (256 << 10), held  # each connection may pass it by one chunk
    assert kit.metric_sum(proxy.metrics(), "gatekeeper_flowcontrol_read_ahead_full_total", scope="process") >= 1
    grew = peak - before
    assert grew < 12 << 20, f"proxy RSS grew {grew >> 20} MiB with a {budget >> 20} MiB read-ahead budget"
