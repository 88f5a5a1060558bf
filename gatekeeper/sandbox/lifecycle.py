"""``sandbox up | status | down``: start the control plane in order, wait for health, stop by pid.

Order matters and each step waits for the previous one: etcd, then every
apiserver (they share etcd and keys), then scheduler and controller manager,
then KWOK and the GPU objects, then the add-ons (webhook, proxy). The state
file is saved after every process start, so ``down`` knows every pid even if
``up`` dies half way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from gatekeeper.base.errors import UsageError
from gatekeeper.sandbox import components as comp
from gatekeeper.sandbox import (
    fleet,
    gpu,
    kubectl,
    memlimit,
    mig,
    pki,
    processes,
    supervisor,
    webhook_client,
    with_proxy,
    with_webhook,
)
from gatekeeper.sandbox.build import Binaries, installed
from gatekeeper.sandbox.state import STATE_FILE, ProcessRecord, SandboxState
from gatekeeper.sandbox.waiting import ComponentFailed, wait_until

# ComponentFailed and wait_until live in waiting.py so that add-ons can use them without importing
# this module (which imports the add-ons); they stay importable from here.
__all__ = ["ADDONS", "ComponentFailed", "SandboxError", "UpOptions", "down", "status", "up", "wait_until"]

Say = Callable[[str], None]


class SandboxError(Exception):
    """``up`` could not bring the sandbox to health; everything it started has been stopped."""


@dataclass(frozen=True)
class UpOptions:
    """What ``sandbox up`` was asked for."""

    state_dir: Path
    """Directory for certs, kubeconfigs, logs, etcd data and sandbox.json."""
    apiservers: int = 3
    """Number of kube-apiservers sharing one etcd."""
    gpu_nodes: int = 0
    """KWOK-simulated GPU nodes (each with a ResourceSlice)."""
    gpus_per_node: int = 8
    """``nvidia.com/gpu`` capacity and DRA devices per node."""
    with_scheduler: bool = False
    """Also run kube-scheduler and kube-controller-manager."""
    gogc: int | None = None
    """GOGC for etcd, apiservers, scheduler and controller manager (None: Go's default)."""
    timeout: float = 300.0
    """Seconds each component may take to become healthy."""
    gpu_sharing: str = "none"
    """How the fake GPUs are published: ``none`` (exclusive) or ``memory`` (consumable shares)."""
    gpu_extended_resource_mapping: bool = False
    """DeviceClass maps ``nvidia.com/gpu`` (KEP-5004) and nodes do not advertise it (DRA serves it)."""
    mig_nodes: tuple[str, ...] = ()
    """One device-plugin MIG node (all-balanced, ``nvidia.com/mig-*`` capacity) per GPU model listed."""
    mig_dra_nodes: int = 0
    """Nodes whose GPUs are DRA partitionable devices (dynamic MIG: shared counters + partitions)."""
    gpu_pools: tuple[fleet.GpuPool, ...] = ()
    """Further GPU node pools, each of one model and sharing setting (``--gpu-pool``, ``--mixed-fleet``)."""
    addons: tuple[str, ...] = ()
    """Add-ons (keys of :data:`ADDONS`) to start after the control plane."""
    apiserver_args: tuple[str, ...] = ()
    """Extra kube-apiserver flags, appended last (e.g. ``--watch-cache-sizes=secrets#0`` for storage LISTs)."""
    controller_manager_args: tuple[str, ...] = ()
    """Extra kube-controller-manager flags, appended last (e.g. ``--kube-api-qps=200``)."""
    scheduler_args: tuple[str, ...] = ()
    """Extra kube-scheduler flags, appended last."""
    etcd_args: tuple[str, ...] = ()
    """Extra etcd flags, appended last (e.g. ``--quota-backend-bytes=8589934592``)."""
    apiserver_memory_limit: int = 0
    """Bytes: each apiserver in a memory cgroup of its own with this limit, OOM kills counted and restarted
    with kubelet's back-off (``memlimit.py``, ``supervisor.py``). 0: no limit."""


def _tls(layout: comp.Layout) -> processes.TLSFiles:
    p = layout.pki
    return processes.TLSFiles(ca=p.ca, cert=p.crt("admin"), key=p.key("admin"))


def _refuse_if_running(directory: Path) -> None:
    if not (directory / STATE_FILE).exists():
        return
    old = SandboxState.load(directory)
    live = [p.name for p in old.processes if processes.is_ours(p)]
    if live:
        raise UsageError(
            f"a sandbox is already running in {directory} ({', '.join(live)}); "
            f"run `gatekeeper sandbox down --state-dir {directory}` first"
        )


def _fresh_dirs(layout: comp.Layout) -> None:
    """Every ``up`` is a new cluster: old etcd data, run dirs and logs would only confuse."""
    for d in (layout.etcd_data, layout.dir / "run", layout.dir / "logs"):
        shutil.rmtree(d, ignore_errors=True)
    (layout.dir / "logs").mkdir(parents=True)


class _Starter:
    """Starts processes into ``state`` and saves it after each one."""

    def __init__(self, state: SandboxState, layout: comp.Layout, env: dict[str, str], say: Say,
                 opts: UpOptions) -> None:
        self.state, self.layout, self.env, self.say, self.opts = state, layout, env, say, opts

    def start(self, name: str, argv: list[str], *, ports: dict[str, int], urls: dict[str, str],
              health: str = "", go_env: bool = True, cgroup: str = "") -> ProcessRecord:
        rec = processes.start(
            name, argv, self.layout.log(name), env=self.env if go_env else {}, ports=ports, urls=urls,
            health=health, cwd=self.layout.dir, cgroup=cgroup,
        )
        self.state.processes.append(rec)
        self.state.save()
        self.say(f"  started {name} (pid {rec.pid})")
        return rec


def _start_etcd(s: _Starter, bins: Binaries, timeout: float) -> str:
    client, peer = processes.free_port(), processes.free_port()
    url = f"http://127.0.0.1:{client}"
    rec = s.start("etcd", comp.etcd_argv(bins.etcd, s.layout, client, peer, extra=s.opts.etcd_args),
                  ports={"client": client, "peer": peer}, urls={"client": url}, health=f"{url}/health")
    wait_until(rec, "etcd", lambda: processes.probe(rec.health), timeout)
    s.state.extra["etcd_url"] = url
    return url


def _start_apiservers(s: _Starter, bins: Binaries, opts: UpOptions, etcd_url: str) -> None:
    layout = s.layout
    recs = []
    admission_config = webhook_client.write(layout.pki.dir, layout.dir)
    for i in range(1, opts.apiservers + 1):
        port = processes.free_port()
        url = f"https://127.0.0.1:{port}"
        argv = comp.apiserver_argv(bins.kube_apiserver, layout, index=i, port=port, etcd_url=etcd_url,
                                   node_lifecycle=opts.with_scheduler, admission_config=admission_config,
                                   extra=opts.apiserver_args)
        name = f"kube-apiserver-{i}"
        cgroup = ""
        if opts.apiserver_memory_limit:
            group = memlimit.create(s.state.extra["sandbox_id"], name, opts.apiserver_memory_limit)
            s.state.extra["memory_cgroup_version"] = group.version
            cgroup = str(group.path)
        recs.append(s.start(name, argv, ports={"secure": port}, urls={"server": url}, health=f"{url}/readyz",
                            cgroup=cgroup))
        s.state.apiserver_urls.append(url)
        pki.write_kubeconfig(layout.dir / f"apiserver-{i}.kubeconfig", layout.pki, "admin", url)
    first = s.state.apiserver_urls[0]
    pki.write_kubeconfig(layout.kubeconfig("admin"), layout.pki, "admin", first)
    for client in ("kube-scheduler", "kube-controller-manager", "kwok"):
        pki.write_kubeconfig(layout.kubeconfig(client), layout.pki, client, first)
    s.state.save()
    tls = _tls(layout)
    for rec in recs:
        wait_until(rec, rec.name, lambda r=rec: processes.probe(r.health, tls), opts.timeout)  # type: ignore[misc]


def _point_components_at(layout: comp.Layout, url: str) -> None:
    """The scheduler's, controller manager's and KWOK's kubeconfigs call ``url`` (the proxies) instead of
    apiserver 1; written before they start."""
    for client in ("kube-scheduler", "kube-controller-manager", "kwok"):
        pki.write_kubeconfig(layout.kubeconfig(client), layout.pki, client, url)


def _start_scheduler_and_kcm(s: _Starter, bins: Binaries, opts: UpOptions) -> None:
    tls = _tls(s.layout)
    started = []
    for name, builder, binary, extra in (
        ("kube-scheduler", comp.scheduler_argv, bins.kube_scheduler, opts.scheduler_args),
        ("kube-controller-manager", comp.controller_manager_argv, bins.kube_controller_manager,
         opts.controller_manager_args),
    ):
        port = processes.free_port()
        url = f"https://127.0.0.1:{port}"
        started.append(s.start(name, builder(binary, s.layout, port, extra), ports={"secure": port},
                               urls={"server": url}, health=f"{url}/healthz"))
    for rec in started:
        wait_until(rec, rec.name, lambda r=rec: processes.probe(r.health, tls), opts.timeout)  # type: ignore[misc]
    kcm = started[1]
    kc, kb = s.layout.kubeconfig("admin"), bins.kubectl

    def default_sa() -> tuple[bool, str]:
        # Pods cannot be created before the serviceaccount controller made `default`.
        p = kubectl.run(kc, "get", "serviceaccount", "default", "-n", "default", "-o", "name", binary=kb)
        return p.returncode == 0, (p.stdout + p.stderr).strip()

    wait_until(kcm, "kube-controller-manager (default ServiceAccount)", default_sa, opts.timeout)


def _start_kwok(s: _Starter, bins: Binaries, opts: UpOptions) -> None:
    port = processes.free_port()
    url = f"http://127.0.0.1:{port}"
    s.layout.kwok_exec_config.write_text(yaml.safe_dump(comp.kwok_exec_config()))
    s.state.extra["exec_namespace"] = comp.EXEC_NAMESPACE
    rec = s.start("kwok", comp.kwok_argv(bins.kwok, s.layout, bins.kwok_stages, port), ports={"server": port},
                  urls={"server": url}, health=f"{url}/healthz", go_env=False)
    wait_until(rec, "kwok", lambda: processes.probe(rec.health), opts.timeout)


def _publish_gpus(s: _Starter, bins: Binaries, opts: UpOptions) -> None:
    kc, kb = s.layout.kubeconfig("admin"), bins.kubectl
    dc = gpu.device_class(opts.gpu_extended_resource_mapping)
    kubectl.run(kc, "create", "-f", "-", input=json.dumps(dc), binary=kb, check=True)
    pool_nodes = [n for p in opts.gpu_pools for n in p.node_names()]
    names = gpu.node_names(opts.gpu_nodes) + pool_nodes
    s.state.extra.update({"gpu_nodes": names, "gpu_pools": [p.record() for p in opts.gpu_pools],
                          "gpus_per_node": opts.gpus_per_node,
                          "device_class": gpu.DEVICE_CLASS, "dra_driver": gpu.DRIVER,
                          "gpu_sharing": opts.gpu_sharing,
                          "gpu_extended_resource_mapping": opts.gpu_extended_resource_mapping})
    mig_names = [mig.mig_node_name(m, i) for i, m in enumerate(opts.mig_nodes)]
    dra_names = [f"mig-dra-{i}" for i in range(opts.mig_dra_nodes)]
    s.state.extra.update({"mig_nodes": mig_names, "mig_models": list(opts.mig_nodes), "mig_dra_nodes": dra_names})
    if dra_names:
        kubectl.run(kc, "create", "-f", "-", input=json.dumps(mig.mig_device_class()), binary=kb, check=True)
    s.state.save()
    nodes = [gpu.node(n, opts.gpus_per_node, not opts.gpu_extended_resource_mapping)
             for n in gpu.node_names(opts.gpu_nodes)]
    nodes += [n for p in opts.gpu_pools for n in fleet.manifests(p)[0]]
    nodes += [mig.mig_node(n, m, opts.gpus_per_node) for n, m in zip(mig_names, opts.mig_nodes, strict=True)]
    dra_gpus = mig.mig_dra_gpus(opts.gpus_per_node)
    nodes += [mig.mig_dra_node(n, dra_gpus) for n in dra_names]
    if not nodes:
        return
    names = names + mig_names + dra_names
    kubectl.run(kc, "create", "-f", "-", input=json.dumps(gpu.as_list(nodes)), binary=kb, check=True)
    created = kubectl.get_json(kc, "nodes", "-l", comp.KWOK_NODE_SELECTOR, binary=kb)
    uids = {i["metadata"]["name"]: i["metadata"]["uid"] for i in created["items"]}
    slices = [gpu.resource_slice(n, opts.gpus_per_node, uids.get(n, ""), opts.gpu_sharing)
              for n in gpu.node_names(opts.gpu_nodes)]
    slices += [sl for p in opts.gpu_pools for sl in fleet.manifests(p, uids)[1]]
    slices += [sl for n in dra_names for sl in mig.mig_dra_slices(n, dra_gpus, uids.get(n, ""))]
    kubectl.run(kc, "create", "-f", "-", input=json.dumps(gpu.as_list(slices)), binary=kb, check=True)
    kwok_rec = s.state.process("kwok")

    def all_ready() -> tuple[bool, str]:
        p = kubectl.run(kc, "get", "nodes", "-l", comp.KWOK_NODE_SELECTOR, "-o", "json", binary=kb)
        if p.returncode != 0:
            return False, p.stderr.strip()
        items = json.loads(p.stdout).get("items", [])
        ready = [i["metadata"]["name"] for i in items
                 if gpu.node_ready(i, require_untainted=opts.with_scheduler)]
        return len(ready) == len(names), f"{len(ready)}/{len(names)} GPU nodes Ready: {sorted(ready)}"

    wait_until(kwok_rec, "kwok (GPU nodes Ready)", all_ready, opts.timeout)


AddonStart = Callable[[SandboxState, argparse.Namespace], None]

ADDONS: dict[str, AddonStart] = {"webhook": with_webhook.start, "proxy": with_proxy.start}
"""``sandbox up --with-<name>``: each add-on's ``start(state, args)``, run after the control plane."""


def _start_addons(state: SandboxState, args: argparse.Namespace, addons: tuple[str, ...], say: Say) -> None:
    for name in addons:
        start = ADDONS.get(name)
        if start is None:
            raise UsageError(f"--with-{name}: unknown add-on; expected one of: {', '.join(sorted(ADDONS))}")
        say(f"starting add-on {name}")
        state.save()
        try:
            start(state, args)
        except (UsageError, ComponentFailed, KeyboardInterrupt, SystemExit):
            raise  # a ComponentFailed from wait_until already names the add-on and the step
        except Exception as exc:
            # The add-on's own error type says what it saw; report it like any other component.
            raise ComponentFailed(name, f"{type(exc).__name__}: {exc}") from exc
        finally:
            state.save()


def up(opts: UpOptions, args: argparse.Namespace | None = None, say: Say = print) -> SandboxState:
    """Bring the sandbox to health or stop everything and raise SandboxError."""
    bins = installed()
    directory = opts.state_dir.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    _refuse_if_running(directory)
    layout = comp.Layout(directory)
    _fresh_dirs(layout)
    t0 = time.monotonic()
    say(f"sandbox in {directory}: certificates")
    sandbox_pki = pki.create(layout.pki.dir)
    state = SandboxState(dir=str(directory), certs_dir=str(sandbox_pki.dir),
                         kubeconfig=str(layout.kubeconfig("admin")))
    state.extra.update({"kubectl": str(bins.kubectl), "with_scheduler": opts.with_scheduler,
                        "sandbox_id": hashlib.sha256(str(directory).encode()).hexdigest()[:12],
                        "front_proxy_client": {"cert": str(sandbox_pki.crt(pki.FRONT_PROXY_CLIENT)),
                                               "key": str(sandbox_pki.key(pki.FRONT_PROXY_CLIENT))},
                        "apiserver_kubeconfigs": [str(directory / f"apiserver-{i}.kubeconfig")
                                                  for i in range(1, opts.apiservers + 1)]})
    state.save()
    env = {"GOGC": str(opts.gogc)} if opts.gogc is not None else {}
    s = _Starter(state, layout, env, say, opts)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        etcd_url = _start_etcd(s, bins, opts.timeout)
        _start_apiservers(s, bins, opts, etcd_url)
        say(f"  {opts.apiservers} apiserver(s) ready after {time.monotonic() - t0:.1f}s")
        addons = opts.addons
        if with_proxy.NAME in addons and with_proxy.deployed(args or argparse.Namespace()):
            # The deployed topology: the proxies first, and every component after them calls through them.
            _start_addons(state, args or argparse.Namespace(), (with_proxy.NAME,), say)
            _point_components_at(layout, state.extra["cluster_url"])
            addons = tuple(a for a in addons if a != with_proxy.NAME)
        if opts.apiserver_memory_limit:
            s.start(supervisor.NAME, [sys.executable, "-m", "gatekeeper.sandbox.supervisor", str(directory)],
                    ports={}, urls={}, go_env=False)
        if opts.with_scheduler:
            _start_scheduler_and_kcm(s, bins, opts)
        if opts.gpu_nodes or opts.mig_nodes or opts.mig_dra_nodes or opts.gpu_pools:
            _start_kwok(s, bins, opts)
        _publish_gpus(s, bins, opts)
        state.extra["control_plane_seconds"] = round(time.monotonic() - t0, 2)
        _start_addons(state, args or argparse.Namespace(), addons, say)
    except BaseException as exc:
        _report_failure(state, exc)
        results = stop_all(state.processes)
        memlimit.remove_all(state.extra["sandbox_id"])
        state.save()
        sys.stderr.write("stopped: " + ", ".join(f"{r.name} {r.outcome}" for r in results) + "\n")
        if isinstance(exc, ComponentFailed | kubectl.KubectlError):
            raise SandboxError(f"sandbox did not come up: {exc}") from exc
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    state.extra["startup_seconds"] = round(time.monotonic() - t0, 2)
    state.save()
    say(f"sandbox up in {state.extra['startup_seconds']:.1f}s; "
        f"export KUBECONFIG={state.kubeconfig}")
    return state


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM during ``up`` unwinds like Ctrl-C, so what was started gets stopped."""
    raise SystemExit(128 + signum)


def _report_failure(state: SandboxState, exc: BaseException) -> None:
    name = exc.name if isinstance(exc, ComponentFailed) else ""
    sys.stderr.write(f"sandbox up failed: {exc}\n")
    for rec in state.processes:
        if name and not name.startswith(rec.name):
            continue
        if not name and processes.is_alive(rec.pid):
            continue
        sys.stderr.write(f"--- last lines of {rec.log} ({rec.name}) ---\n{processes.tail(rec.log)}\n")


def stop_all(records: list[ProcessRecord]) -> list[processes.StopResult]:
    """Everything else first (newest first), etcd last.

    An apiserver whose etcd is already gone hangs in shutdown until SIGKILL; with
    etcd still up it exits cleanly in about a second.
    """
    first = [r for r in reversed(records) if r.name != "etcd"]
    last = [r for r in records if r.name == "etcd"]
    return processes.stop(first) + processes.stop(last)


def status(directory: Path, say: Say = print) -> int:
    """One line per process: pid, alive, health, RSS. Non-zero if any is down or unhealthy."""
    state = SandboxState.load(directory)
    layout = comp.Layout(Path(state.dir))
    tls = _tls(layout)
    bad = 0
    say(f"{'NAME':28} {'PID':>7} {'ALIVE':5} {'RSS MiB':>8}  HEALTH")
    for rec in state.processes:
        alive = processes.is_ours(rec)
        health = "-"
        if alive and rec.health:
            ok, detail = processes.probe(rec.health, tls if rec.health.startswith("https") else None)
            health = ("ok " if ok else "FAIL ") + detail[:60]
            bad += not ok
        bad += not alive
        rss = processes.rss_kib(rec.pid) if alive else None
        say(f"{rec.name:28} {rec.pid:>7} {'yes' if alive else 'NO':5} "
            f"{(f'{rss / 1024:.0f}' if rss else '-'):>8}  {health}")
    return 1 if bad else 0


def down(directory: Path, say: Say = print) -> int:
    """Stop every recorded process (whole group, TERM then KILL); safe to run again."""
    state = SandboxState.load(directory)
    results = stop_all(state.processes)
    if "sandbox_id" in state.extra:
        memlimit.remove_all(state.extra["sandbox_id"])
    for r in results:
        say(f"{r.name:28} pid {r.pid:>7}  {r.outcome}")
    survivors = [r for r in results if r.outcome == "SURVIVED"]
    if survivors:
        say("some processes survived SIGKILL: " + ", ".join(f"{r.name} ({r.pid})" for r in survivors))
        return 1
    return 0
