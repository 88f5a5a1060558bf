"""The sandbox a scenario needs: bring it up (or adopt ``--state-dir``), restart apiservers, tenants, HAProxy.

Every compared arm starts on freshly started apiservers (design.md §4): a Go heap
grown by one arm is kept mapped and would hide the next arm's growth in RSS.
Restarting re-launches each recorded command line with the scenario's flags
swapped in, so an adopted sandbox gets the same conditions as one made here.
"""

from __future__ import annotations

import argparse
import contextlib
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import client_lb, memlimit, processes, supervisor
from gatekeeper.sandbox.lifecycle import UpOptions, down, up
from gatekeeper.sandbox.pki import SandboxPKI
from gatekeeper.sandbox.state import ProcessRecord, SandboxState

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "flowcontrol"))
import storm_kit as kit

TENANT_ROLE = "loadtest-tenant"


class ScenarioError(Exception):
    """A scenario could not set up what it measures; the message says what to fix."""


def bring_up(directory: Path, log: Any, *, apiservers: int = 3, apiserver_args: Sequence[str] = (),
             gogc: int | None = None, with_scheduler: bool = False, gpu_nodes: int = 0,
             addons: tuple[str, ...] = (), gpus_per_node: int = 8,
             gpu_extended_resource_mapping: bool = False, apiserver_memory_limit: int = 0,
             etcd_args: Sequence[str] = (), controller_manager_args: Sequence[str] = (),
             scheduler_args: Sequence[str] = ()) -> SandboxState:
    """A new sandbox in ``directory`` (in-process ``sandbox up``), its progress lines in ``log``."""
    opts = UpOptions(state_dir=directory, apiservers=apiservers, gpu_nodes=gpu_nodes, gogc=gogc,
                     with_scheduler=with_scheduler, addons=addons, apiserver_args=tuple(apiserver_args),
                     gpus_per_node=gpus_per_node, gpu_extended_resource_mapping=gpu_extended_resource_mapping,
                     apiserver_memory_limit=apiserver_memory_limit, etcd_args=tuple(etcd_args),
                     controller_manager_args=tuple(controller_manager_args), scheduler_args=tuple(scheduler_args))
    return up(opts, argparse.Namespace(timeout=300.0), say=lambda s: print(s, file=log, flush=True))


@contextlib.contextmanager
def sandbox(directory: Path, adopt: Path | None, log: Any, **opts: Any) -> Iterator[SandboxState]:
    """Adopt ``adopt`` (left running afterwards) or bring a sandbox up in ``directory`` (torn down after)."""
    if adopt is not None:
        yield SandboxState.load(adopt)
        return
    state = bring_up(directory, log, **opts)
    try:
        yield state
    finally:
        down(directory, say=lambda s: print(s, file=log, flush=True))


def with_flags(cmd: list[str], flags: Sequence[str]) -> list[str]:
    """``cmd`` with each ``--name=value`` in ``flags`` replacing any earlier ``--name``."""
    names = {f.split("=", 1)[0] for f in flags}
    return [a for a in cmd if a.split("=", 1)[0] not in names] + list(flags)


def apiserver_records(state: SandboxState) -> list[ProcessRecord]:
    return [r for r in state.processes if r.name.startswith("kube-apiserver")]


def restart_apiservers(state: SandboxState, *, which: Sequence[str] = (), flags: Sequence[str] = (),
                       env: dict[str, str] | None = None, timeout: float = 180, memory_limit: int = 0) -> float:
    """Restart the named apiservers (all by default) with ``flags``; returns seconds until all are ready.
    ``memory_limit`` (bytes) is written to their memory cgroups between the stop and the start."""
    recs = [r for r in apiserver_records(state) if not which or r.name in which]
    t0 = time.monotonic()
    processes.stop(recs)
    if memory_limit:
        version = int(state.extra.get("memory_cgroup_version", 0))
        if not version or not all(r.cgroup for r in recs):
            raise ScenarioError("a memory limit needs apiservers in memory cgroups "
                                "(sandbox up --apiserver-memory-limit)")
        for r in recs:
            try:
                memlimit.MemoryCgroup(Path(r.cgroup), version).set_limit(memory_limit)
            except OSError as exc:
                raise ScenarioError(f"cannot set {r.name}'s memory limit to {memory_limit} bytes: {exc}") from None
    fresh = [processes.start(r.name, with_flags(r.cmd, flags), Path(r.log), env={**r.env, **(env or {})},
                             ports=r.ports, urls=r.urls, health=r.health, cgroup=r.cgroup) for r in recs]
    by_name = {f.name: f for f in fresh}
    state.processes = [by_name.get(p.name, p) for p in state.processes]
    state.save()
    kills = {r.name: _oom_kills(state, r) for r in recs} if memory_limit else {}
    try:
        wait_ready(state, [f.health for f in fresh], timeout)
    except processes.WaitFailed:
        starved = [r.name for r in recs if kills and _oom_kills(state, r) > kills[r.name]]
        if starved:
            raise ScenarioError(
                f"{', '.join(starved)} OOM-killed while starting under a {memory_limit >> 20} MiB limit: "
                "kube-apiserver reads every Secret from etcd as it starts (etcd's log shows the range), so the limit "
                "must hold that read too; choose larger --memory-limits") from None
        raise
    return time.monotonic() - t0


def _oom_kills(state: SandboxState, rec: ProcessRecord) -> int:
    version = int(state.extra.get("memory_cgroup_version", 0))
    return memlimit.MemoryCgroup(Path(rec.cgroup), version).oom_kills() if version and rec.cgroup else 0


def restart_limited_apiservers(state: SandboxState, flags: Sequence[str] = (), *, memory_limit: int = 0
                               ) -> tuple[SandboxState, float]:
    """Fresh apiservers in their memory cgroups, with a fresh supervisor (kubelet's back-off starts over);
    ``memory_limit`` (bytes) changes their cgroups' limit while they are stopped.

    The supervisor restarts OOM-killed apiservers and records their new pids in ``sandbox.json``, so the state
    is read again from disk; it is stopped first, or a restart it still had pending would start a second
    apiserver on a port this one has just taken. Returns the state as now saved and the seconds until ready."""
    fresh = SandboxState.load(Path(state.dir))
    watcher = [p for p in fresh.processes if p.name == supervisor.NAME]
    processes.stop(watcher)
    ready = restart_apiservers(fresh, flags=flags, memory_limit=memory_limit)
    started = [processes.start(r.name, r.cmd, Path(r.log), env=r.env, cwd=Path(state.dir)) for r in watcher]
    by_name = {p.name: p for p in started}
    fresh.processes = [by_name.get(p.name, p) for p in fresh.processes]
    fresh.save()
    return fresh, ready


def wait_ready(state: SandboxState, health_urls: Sequence[str], timeout: float = 180) -> None:
    certs = SandboxPKI(Path(state.certs_dir))
    tls = processes.TLSFiles(ca=certs.ca, cert=certs.crt("admin"), key=certs.key("admin"))
    for url in health_urls:
        processes.poll_until(lambda u=url: processes.probe(u, tls), timeout)  # type: ignore[misc]


def tls(ca: str | Path, cert: str | Path | None = None, key: str | Path | None = None) -> ssl.SSLContext:
    """Trust only ``ca``; present ``cert``/``key`` if given (httpx 0.28 wants a context, not paths)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert and key:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def admin(state: SandboxState, url: str | None = None, timeout: float = 60) -> httpx.Client:
    certs = SandboxPKI(Path(state.certs_dir))
    return httpx.Client(base_url=url or state.apiserver_urls[0], timeout=timeout,
                        verify=tls(certs.ca, certs.crt("admin"), certs.key("admin")))


def tenant_rbac(namespace: str) -> str:
    """storm_kit's RBAC + apiserver-side observer FlowSchema, widened to this namespace's ServiceAccounts
    and to updates, so token tenants get the same treatment inside the apiserver as certificate ones."""
    docs = list(yaml.safe_load_all(kit.storm_rbac_and_observer()))
    sa_group = {"kind": "Group", "name": f"system:serviceaccounts:{namespace}",
                "apiGroup": "rbac.authorization.k8s.io"}
    for d in docs:
        if d["kind"] == "ClusterRole":
            d["metadata"]["name"] = TENANT_ROLE
            d["rules"][0]["verbs"] = ["get", "list", "watch", "create", "update", "patch", "delete"]
        elif d["kind"] == "ClusterRoleBinding":
            d["metadata"]["name"] = TENANT_ROLE
            d["roleRef"]["name"] = TENANT_ROLE
            d["subjects"].append(sa_group)
        elif d["kind"] == "FlowSchema":
            d["spec"]["rules"][0]["subjects"].append(
                {"kind": "Group", "group": {"name": f"system:serviceaccounts:{namespace}"}})
            d["spec"]["rules"][0]["resourceRules"][0]["resources"] = ["secrets", "configmaps", "pods"]
            d["spec"]["rules"][0]["resourceRules"][0]["verbs"] = ["*"]
    return yaml.safe_dump_all(docs)


@contextlib.contextmanager
def seeds_apf(state: SandboxState, namespace: str) -> Iterator[None]:
    """The seeds' fix as they deployed it, for one arm: their FlowSchemas and PriorityLevelConfigurations
    (``deploy/examples/flowcontrol-seeds.yaml``, 2 concurrent secret LISTs) in the apiservers' own APF.

    The observer FlowSchema (precedence 100) would catch the tenants before the seeds' (400-500): it goes for the
    arm and comes back afterwards with the tenants' RBAC of ``namespace``."""
    try:
        kit.kubectl(state, "delete", "flowschema", "--ignore-not-found", kit.OBSERVE)
        applied = kit.kubectl(state, "apply", "-f", str(kit.SEEDS))
        if applied.returncode != 0:
            raise ScenarioError(f"the seeds' APF objects: {applied.stderr.strip()}")
        yield
    finally:
        kit.kubectl(state, "delete", "--ignore-not-found", "-f", str(kit.SEEDS))
        kit.kubectl(state, "apply", "-f", "-", input=tenant_rbac(namespace))


def ensure_namespace(client: httpx.Client, namespace: str) -> None:
    r = client.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": namespace}})
    if r.status_code not in (201, 409):
        raise ScenarioError(f"create namespace {namespace}: {r.status_code} {r.text[:300]}")


def tenants(state: SandboxState, namespace: str, count: int, work: Path, *, distinct: bool = True,
            token_seconds: int = 7200) -> list[dict[str, str]]:
    """``count`` tenant identities, alternating client certificate and ServiceAccount token.

    Never system:masters: APF exempts it, and so does the seeds' policy. With
    ``distinct=False`` there are just two identities (one of each kind), shared.
    """
    proc = kit.kubectl(state, "apply", "-f", "-", input=tenant_rbac(namespace))
    if proc.returncode != 0:
        raise ScenarioError(f"tenant RBAC: {proc.stderr.strip()}")
    pki = PKI(state.certs_dir)
    out: list[dict[str, str]] = []
    with admin(state) as c:
        ensure_namespace(c, namespace)
        for i in range(count if distinct else min(count, 2)):
            if i % 2 == 0:
                issued = pki.issue_client(f"loadtest-tenant-{i}", user=f"tenant-{i}", groups=[kit.STORM_GROUP])
                out.append({"kind": "cert", "user": f"tenant-{i}", "cert": str(issued.cert),
                            "key": str(issued.key)})
                continue
            sa = f"tenant-{i}"
            r = c.post(f"/api/v1/namespaces/{namespace}/serviceaccounts",
                       json={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})
            if r.status_code not in (201, 409):
                raise ScenarioError(f"create serviceaccount {sa}: {r.status_code} {r.text[:300]}")
            r = c.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
                       json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                             "spec": {"expirationSeconds": token_seconds}})
            if r.status_code != 201:
                raise ScenarioError(f"token for {sa}: {r.status_code} {r.text[:300]}")
            out.append({"kind": "token", "user": f"system:serviceaccount:{namespace}:{sa}",
                        "token": r.json()["status"]["token"]})
    return out


@contextlib.contextmanager
def haproxy(state: SandboxState, work: Path, balance: str = "roundrobin",
            targets: Sequence[str] = ()) -> Iterator[str]:
    """HAProxy in TCP mode (TLS passthrough), the seeds' load balancer: it balances connections over
    ``targets`` (default: the apiservers)."""
    port = processes.free_port()
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / "haproxy.cfg"
    cfg.write_text(client_lb.haproxy_config(port, list(targets or state.apiserver_urls), balance))
    log = (work / "haproxy.log").open("ab")
    proc = subprocess.Popen([client_lb.haproxy_binary(), "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        processes.poll_until(lambda: processes.listening(port), 20, pid=proc.pid)
        yield f"https://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def proxy(state: SandboxState, work: Path, flow_control: dict[str, Any] | None,
          protocol: dict[str, Any] | None = None) -> contextlib.AbstractContextManager[kit.ProxyProcess]:
    """A private gatekeeper proxy (storm_kit's); ``protocol`` adds e.g. ``goawayChance``."""
    return kit.run_proxy(state, work, flow_control, extra={"protocol": protocol} if protocol else None)
