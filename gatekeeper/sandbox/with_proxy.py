"""``sandbox up --with-proxy``: run ``gatekeeper proxy`` in front of every sandbox apiserver.

Called by ``sandbox up`` once the control plane is healthy. It

* issues a serving certificate for 127.0.0.1/::1/localhost from the cluster CA
  (so the sandbox kubeconfigs' CA verifies the proxy too),
* writes ``DIR/proxy/config.yaml``: every apiserver as a backend, client
  certificates verified against the cluster CA, the sandbox's front-proxy
  client certificate (CN ``front-proxy-client``, which the apiservers accept via
  ``--requestheader-allowed-names``) for upstream calls,
* starts ``python -m gatekeeper proxy`` in its own session (log in
  ``DIR/logs/proxy.log``), waits for its ``/readyz``, records it in
  ``sandbox.json`` (``sandbox down`` stops it like any other process), and
* writes ``DIR/proxy.kubeconfig``: the admin client certificate, server = the proxy.

``--proxies N`` runs the deployed topology (docs/install/index.md): N proxies, one per "control-plane node", sharing one
budget through Leases and publishing the ``default/kubernetes`` Service's endpoints (``flowControl.fleet``); each
advertises a node address of its own (:func:`node_address`, port = its listener's). ``sandbox up`` then starts
them before the scheduler, controller manager, KWOK and the webhook, which call through them (``cluster_url``).

``--proxy-workers N`` sets ``workers`` (N processes on the port, ``proxy/workers.py``).
``--proxy-goaway-chance P`` sets ``protocol.goawayChance`` (values above
kube-apiserver's 0.02 cap turn on the test-only override). ``--proxy-config
FILE`` is a gatekeeper config whose ``proxy:`` section is merged over the
generated one, except the keys the sandbox must own (listener address, ports
and certificates, backends, upstream certificates). Without it, flow control
gets the sandbox default (the seeds' policy) from :func:`default_flow_control`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.resources
import sys
from pathlib import Path
from typing import Any

import yaml

from gatekeeper.base.errors import UsageError
from gatekeeper.base.yamlfiles import load_yaml
from gatekeeper.certs.pki import CLUSTER_CA, PKI
from gatekeeper.proxy.flowcontrol.edge.defaults import sandbox_flow_control
from gatekeeper.proxy.settings import MAX_GOAWAY_CHANCE
from gatekeeper.sandbox import client_lb, kubectl, processes
from gatekeeper.sandbox.pki import (
    APISERVER_DNS,
    FRONT_PROXY_CLIENT,
    KUBERNETES_SERVICE_IP,
    SandboxPKI,
    write_kubeconfig,
)
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.waiting import wait_until

NAME = "proxy"
CLIENT_LB = "client-lb"
SERVING = "proxy-serving"
READY_TIMEOUT = 60.0


def default_flow_control() -> dict[str, Any]:
    """The ``flowControl:`` section used when ``--proxy-config`` is not given: the seeds' policy
    (LIST of secrets cluster-wide, 2 concurrent, queued), shipped by flow control as package data."""
    return sandbox_flow_control()


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def build_config(
    state: SandboxState, *, port: int, metrics_port: int, serving_cert: Path, serving_key: Path,
    goaway_chance: float | None = None, user_config: dict[str, Any] | None = None, workers: int | None = None,
) -> dict[str, Any]:
    """The whole config file (``{"proxy": {...}}``) for the sandbox proxy; pure, unit-testable."""
    certs = SandboxPKI(Path(state.certs_dir))
    owned: dict[str, Any] = {
        "listener": {
            "address": "127.0.0.1", "port": port, "certFile": str(serving_cert), "keyFile": str(serving_key),
            "clientCaFile": str(certs.ca), "metricsAddress": "127.0.0.1", "metricsPort": metrics_port,
        },
        "backends": [{"url": url, "name": f"apiserver-{i}"} for i, url in enumerate(state.apiserver_urls, 1)],
        "upstream": {
            "caFile": str(certs.ca), "clientCertFile": str(certs.crt(FRONT_PROXY_CLIENT)),
            "clientKeyFile": str(certs.key(FRONT_PROXY_CLIENT)),
        },
    }
    proxy: dict[str, Any] = {}
    if user_config is None:
        proxy["flowControl"] = default_flow_control()
    else:
        proxy = dict(user_config)
    proxy = _merge(proxy, owned)
    if goaway_chance is not None:
        protocol = dict(proxy.get("protocol") or {})
        protocol["goawayChance"] = goaway_chance
        if goaway_chance > MAX_GOAWAY_CHANCE:
            protocol["allowUnsafeGoawayChance"] = True
        proxy["protocol"] = protocol
    if workers is not None:
        proxy["workers"] = workers
    return {"proxy": proxy}


def _user_config(path: str | None) -> dict[str, Any] | None:
    if not path:
        return None
    data = load_yaml(path) or {}
    if not isinstance(data, dict) or not isinstance(data.get("proxy", {}), dict):
        raise UsageError(f"--proxy-config {path}: expected a gatekeeper config with a proxy: mapping")
    return dict(data.get("proxy") or {})


IDENTITY_RBAC = importlib.resources.files("gatekeeper.proxy.identity.tokens").joinpath("rbac.yaml")
"""What the proxy's own identity needs to verify ServiceAccount tokens (issuer discovery) and to ask
TokenReviews; the same file is ``deploy/examples/proxy-identity-rbac.yaml`` for real clusters."""


FLEET = "sandbox"
"""The fleet name of the sandbox's proxies (``--proxies N``): their Leases in gatekeeper-system carry it."""


def deployed(args: argparse.Namespace) -> bool:
    """``--proxies N`` given: the deployed topology (a fleet owning the kubernetes Service's endpoints)."""
    return getattr(args, "proxies", None) is not None


def node_address(index: int) -> str:
    """The address proxy ``index`` advertises in the kubernetes Service's endpoints. The API refuses loopback
    there, and the sandbox binds only loopback, so each proxy plays a node of TEST-NET-1 (RFC 5737, never routed)
    that ``service_network.py`` maps back to 127.0.0.1, as a node network and kube-proxy would."""
    return f"192.0.2.{index}"


def fleet_section(index: int) -> dict[str, Any]:
    """Proxy ``index`` of a sandbox fleet: one budget shared through Leases, publishing its node address."""
    return {"enabled": True, "name": FLEET, "identity": f"sandbox-proxy-{index}",
            "publishEndpoints": {"enabled": True, "advertiseAddress": node_address(index)}}


def start(state: SandboxState, args: argparse.Namespace) -> None:
    """One proxy, or ``--proxies N`` sharing one budget; with ``--client-lb haproxy-tcp`` an HAProxy TCP front
    that ``proxy.kubeconfig`` points at, as a VIP or cloud load balancer would be."""
    directory = Path(state.dir)
    count = max(1, getattr(args, "proxies", 1) or 1)
    fleet = deployed(args)
    client_lb_kind = getattr(args, "client_lb", "none") or "none"
    haproxy = client_lb.haproxy_binary() if client_lb_kind == "haproxy-tcp" else ""
    # Before the proxy starts, so its first fetch of the issuer's keys is allowed: without them every
    # token caller would be classified as unverified (one flow per address) instead of by who it is.
    kubectl.run(state.kubeconfig, "apply", "-f", "-", input=IDENTITY_RBAC.read_text(), check=True)
    pki = PKI(state.certs_dir)
    # The names and ClusterIP in-cluster callers verify, as on the apiservers' certificate.
    serving = pki.issue_serving(SERVING, dns=list(APISERVER_DNS), ips=["127.0.0.1", "::1", KUBERNETES_SERVICE_IP],
                                ca=CLUSTER_CA)
    user = _user_config(getattr(args, "proxy_config", None))
    started: list[dict[str, Any]] = []
    for index in range(1, count + 1):
        name = NAME if count == 1 else f"{NAME}-{index}"
        port, metrics_port = processes.free_port(), processes.free_port()
        config = build_config(
            state, port=port, metrics_port=metrics_port, serving_cert=serving.cert, serving_key=serving.key,
            goaway_chance=getattr(args, "proxy_goaway_chance", None), user_config=user,
            workers=getattr(args, "proxy_workers", None),
        )
        if fleet:  # a copy: the user's section is shared by every proxy's config
            flow = dict(config["proxy"].get("flowControl") or {})
            flow["fleet"] = _merge(fleet_section(index), flow.get("fleet") or {})
            config["proxy"]["flowControl"] = flow
        config_path = directory / name / "config.yaml"
        config_path.parent.mkdir(parents=True, exist_ok=True)
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        url, metrics_url = f"https://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}"
        argv = [sys.executable, "-m", "gatekeeper", "proxy", "--config", str(config_path)]
        rec = processes.start(
            name, argv, directory / "logs" / f"{name}.log", cwd=directory,
            ports={"secure": port, "metrics": metrics_port}, urls={"server": url, "metrics": metrics_url},
            health=f"{metrics_url}/readyz",
        )
        state.processes.append(rec)
        started.append({"name": name, "url": url, "metricsUrl": f"{metrics_url}/metrics", "pid": rec.pid,
                        "config": str(config_path)})
        state.save()
        print(f"  started {name} (pid {rec.pid})")
    for rec in [r for r in state.processes if any(r.pid == p["pid"] for p in started)]:
        wait_until(rec, rec.name, functools.partial(processes.probe, rec.urls["metrics"] + "/readyz"), READY_TIMEOUT)
    front = dict(started[0])
    if haproxy:
        # The first proxy's metrics page stands for the front's (sandbox.json lists every proxy's).
        front = {**_start_client_lb(state, haproxy, [p["url"] for p in started]), "metricsUrl": front["metricsUrl"]}
    state.extra[NAME] = front
    state.extra["proxies"] = started
    if fleet:
        state.extra["node_addresses"] = {node_address(i): "127.0.0.1" for i in range(1, count + 1)}
        state.extra["cluster_url"] = front["url"]
    kubeconfig = write_kubeconfig(directory / "proxy.kubeconfig", SandboxPKI(Path(state.certs_dir)), "admin",
                                  front["url"])
    state.extra[NAME]["kubeconfig"] = str(kubeconfig)
    state.save()
    print(f"  proxy ready at {front['url']}; export KUBECONFIG={kubeconfig}")


def _start_client_lb(state: SandboxState, binary: str, targets: list[str]) -> dict[str, Any]:
    """HAProxy TCP in front of the proxies; its URL becomes the sandbox's proxy address."""
    directory = Path(state.dir)
    port = processes.free_port()
    config = directory / "client-lb" / "haproxy.cfg"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(client_lb.haproxy_config(port, targets))
    rec = processes.start(CLIENT_LB, [binary, "-db", "-f", str(config)], directory / "logs" / f"{CLIENT_LB}.log",
                          cwd=directory, ports={"secure": port}, urls={"server": f"https://127.0.0.1:{port}"})
    state.processes.append(rec)
    state.save()
    wait_until(rec, CLIENT_LB, lambda: processes.listening(port), READY_TIMEOUT)
    print(f"  started {CLIENT_LB} (HAProxy TCP, pid {rec.pid}) in front of {len(targets)} proxies")
    return {"name": CLIENT_LB, "url": f"https://127.0.0.1:{port}", "pid": rec.pid, "targets": targets}
