"""`sandbox up --with-proxy --proxies N --client-lb haproxy-tcp`: the deployed topology on one machine.

N proxy processes, each in front of every apiserver as the static pods are, sharing one budget through Leases,
behind an HAProxy TCP front as a VIP or cloud LB would be; ``proxy.kubeconfig`` points at the front and
``sandbox.json`` lists every proxy. ``sandbox down`` stops them all, the front included.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.testing import (
    gatekeeper_cli,
    kubectl_binary,
    metric_sum,
    processes_mentioning,
    sandbox_up,
)

pytestmark = [pytest.mark.sandbox,
              pytest.mark.skipif(shutil.which("haproxy", path="/usr/sbin:/usr/bin:/usr/local/sbin") is None,
                                 reason="haproxy is not installed (apt-get install -y haproxy)")]


def members(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        return metric_sum(r.read().decode(), "gatekeeper_fleet_members")


def test_proxies_behind_a_tcp_front_share_one_budget_and_go_down_together(own_sandbox_dir: Path) -> None:
    state = sandbox_up(own_sandbox_dir, "--apiservers", "2", "--gpu-nodes", "0", "--with-proxy", "--proxies", "2",
                       "--client-lb", "haproxy-tcp", "--timeout", "180")
    proxies = state.extra["proxies"]
    assert [p["name"] for p in proxies] == ["proxy-1", "proxy-2"]
    front = state.extra["proxy"]
    assert front["name"] == "client-lb" and front["targets"] == [p["url"] for p in proxies]
    got = subprocess.run([kubectl_binary(state), "--kubeconfig", str(own_sandbox_dir / "proxy.kubeconfig"), "get",
                          "--raw", "/api/v1/namespaces/default"], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and '"name":"default"' in got.stdout, got.stderr  # through the front, a proxy
    deadline = time.monotonic() + 30
    while not all(members(p["metricsUrl"]) == 2 for p in proxies):
        assert time.monotonic() < deadline, "the two proxies never counted each other"
        time.sleep(0.5)

    down = gatekeeper_cli("sandbox", "down", "--state-dir", str(own_sandbox_dir))
    assert down.returncode == 0, down.stdout + down.stderr
    assert processes_mentioning(own_sandbox_dir) == []
    assert not any(processes.is_alive(p["pid"]) for p in [*proxies, front])


def test_a_front_without_proxies_is_refused(own_sandbox_dir: Path) -> None:
    up = gatekeeper_cli("sandbox", "up", "--state-dir", str(own_sandbox_dir), "--client-lb", "haproxy-tcp")
    assert up.returncode != 0 and "--with-proxy" in up.stderr
