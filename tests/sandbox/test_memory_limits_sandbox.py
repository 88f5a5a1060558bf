"""A memory-limited apiserver is OOM-killed by a LIST storm, counted from its cgroup and restarted after
kubelet's back-off; ``sandbox down`` leaves no cgroup behind.

Storage reads (``--watch-cache-sizes=secrets#0``) so every LIST decodes the Secrets from etcd, and a limit
between the apiserver's idle footprint and what a burst of such LISTs needs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from gatekeeper.base.errors import UsageError
from gatekeeper.sandbox import memlimit, processes
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.supervisor import EVENTS
from gatekeeper.sandbox.testing import admin_client, gatekeeper_cli, sandbox_up


def _writable_cgroups() -> bool:
    try:
        base, _ = memlimit.controller()
    except UsageError:
        return False
    return os.access(base, os.W_OK)


pytestmark = [pytest.mark.sandbox,
              pytest.mark.skipif(not _writable_cgroups(), reason="no writable memory cgroup controller here")]

SECRETS, SIZE = 100, 200 * 1024


async def _fill(state: SandboxState) -> None:
    async with admin_client(state) as c:
        await c.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "oom"}})
        blob = base64.b64encode(os.urandom(SIZE)).decode()
        sem = asyncio.Semaphore(6)

        async def one(i: int) -> None:
            async with sem:
                r = await c.post("/api/v1/namespaces/oom/secrets", json={
                    "apiVersion": "v1", "kind": "Secret", "type": "helm.sh/release.v1",
                    "metadata": {"name": f"s{i}"}, "data": {"release": blob}})
                assert r.status_code in (201, 409), r.text[:200]

        await asyncio.gather(*(one(i) for i in range(SECRETS)))


def _killed(events: Path) -> bool:
    return events.exists() and "oom_kill" in events.read_text()


async def _storm(state: SandboxState, events: Path, limit_s: float) -> None:
    """Bursts of 16 concurrent LISTs at apiserver 1 until its cgroup counts a kill (or the time is up)."""
    deadline = time.monotonic() + limit_s
    async with admin_client(state, timeout=60) as c:
        while time.monotonic() < deadline and not await asyncio.to_thread(_killed, events):
            async def one() -> None:
                try:
                    async with c.stream("GET", "/api/v1/namespaces/oom/secrets") as r:
                        async for _ in r.aiter_raw():
                            pass
                except httpx.HTTPError:
                    pass  # the apiserver died under it: the point

            await asyncio.gather(*(one() for _ in range(16)))


def test_an_oom_killed_apiserver_is_counted_and_restarted_after_the_back_off(own_sandbox_dir: Path) -> None:
    state = sandbox_up(own_sandbox_dir, "--apiservers", "2", "--gpu-nodes", "0", "--apiserver-memory-limit", "700Mi",
                       "--apiserver-arg=--watch-cache-sizes=secrets#0", "--timeout", "180")
    first = next(p for p in state.processes if p.name == "kube-apiserver-1")
    assert first.cgroup and (Path(first.cgroup) / "cgroup.procs").read_text().split() == [str(first.pid)]
    assert any(p.name == "apiserver-supervisor" for p in state.processes)
    asyncio.run(_fill(state))
    events = own_sandbox_dir / EVENTS
    asyncio.run(_storm(state, events, 120))
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    kills = [e for e in lines if e["event"] == "oom_kill"]
    assert kills and kills[0]["component"] == "kube-apiserver-1" and kills[0]["restart_in_seconds"] == 10, lines
    deadline = time.monotonic() + 60
    while not any(e["event"] == "restart" for e in lines):
        assert time.monotonic() < deadline, f"no restart after the back-off: {lines}"
        time.sleep(1)
        lines = [json.loads(x) for x in events.read_text().splitlines()]
    restart = next(e for e in lines if e["event"] == "restart")
    assert restart["time"] - kills[0]["time"] >= 9.5, "kubelet's first back-off is 10 s"
    after = SandboxState.load(own_sandbox_dir)
    again = next(p for p in after.processes if p.name == "kube-apiserver-1")
    assert again.pid == restart["pid"] != first.pid and again.cgroup == first.cgroup
    assert after.extra["apiserver_oom_kills"]["kube-apiserver-1"] >= 1
    assert after.extra["apiserver_restarts"]["kube-apiserver-1"] >= 1
    certs = SandboxPKI(Path(after.certs_dir))
    tls = processes.TLSFiles(ca=certs.ca, cert=certs.crt("admin"), key=certs.key("admin"))
    deadline = time.monotonic() + 120
    while not processes.probe(again.health, tls)[0]:
        assert time.monotonic() < deadline, "the restarted apiserver never became ready"
        time.sleep(1)

    down = gatekeeper_cli("sandbox", "down", "--state-dir", str(own_sandbox_dir))
    assert down.returncode == 0, down.stdout + down.stderr
    assert not Path(first.cgroup).exists(), "sandbox down must remove the cgroups it made"
