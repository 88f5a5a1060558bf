"""The proxy's static pod, its config and the chart's PodMonitor describe one deployment: the PodMonitor selects the
static pod and scrapes a port it has, the kubelet's probes reach the metrics listener where the config binds it,
and the pod gives the proxy what its fleet settings read from the environment."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from gatekeeper.base.config import from_mapping
from gatekeeper.proxy.settings import ProxySettings
from gatekeeper.sandbox import chart

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def pod_monitors() -> list[dict[str, Any]]:
    docs = yaml.safe_load_all(chart.template([DEPLOY / "helm" / "values-tests" / "monitoring.yaml"]))
    return [d for d in docs if d and d["kind"] == "PodMonitor"]


def static_pod() -> dict[str, Any]:
    pod: dict[str, Any] = yaml.safe_load((DEPLOY / "proxy" / "static-pod.yaml").read_text())
    return pod


def proxy_config() -> ProxySettings:
    raw = yaml.safe_load((DEPLOY / "proxy" / "config.yaml").read_text())["proxy"]
    settings: ProxySettings = from_mapping(ProxySettings, raw, "config.yaml", "proxy")
    return settings


def test_the_charts_pod_monitor_selects_the_static_pod_and_a_port_it_has(helm_bin: Path) -> None:
    (monitor,) = pod_monitors()
    pod = static_pod()
    assert pod["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p for p in container["ports"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"
    assert ports[endpoint["port"]]["containerPort"] == proxy_config().listener.metrics_port


def test_the_static_pods_ports_and_probes_reach_the_listeners_the_config_binds() -> None:
    pod, listener = static_pod(), proxy_config().listener
    (container,) = pod["spec"]["containers"]
    assert pod["spec"]["hostNetwork"] is True
    ports = {p["name"]: p for p in container["ports"]}
    assert ports["https"]["containerPort"] == ports["https"]["hostPort"] == listener.port
    assert ports["metrics"]["containerPort"] == ports["metrics"]["hostPort"] == listener.metrics_port
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] in ("metrics", listener.metrics_port)
        host = get.get("host")  # none: the pod's IP, the node's with hostNetwork
        bound = ipaddress.ip_address(listener.metrics_address)
        assert bound.is_unspecified or (host is not None and ipaddress.ip_address(host) == bound), (
            f"{probe} checks {host or 'the node IP'} but the metrics listener binds {listener.metrics_address}")
    assert not ipaddress.ip_address(listener.address).is_loopback, "the proxy must serve the node's address"


def test_the_static_pod_gives_the_fleet_its_identity_and_advertised_address() -> None:
    (container,) = static_pod()["spec"]["containers"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    fleet = proxy_config().flow_control.fleet
    assert fleet.enabled and not fleet.identity and env["NODE_NAME"] == "spec.nodeName"
    assert fleet.publish_endpoints.enabled and not fleet.publish_endpoints.advertise_address
    assert env["HOST_IP"] == "status.hostIP"


def documented_commands(page: str, needle: str) -> list[str]:
    """The shell commands of ``page``'s code blocks that mention ``needle`` (continuation lines joined)."""
    text = (DEPLOY.parent / "docs" / "install" / page).read_text()
    blocks = re.findall(r"^```\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    commands = [c for b in blocks for c in re.sub(r"\\\n\s*", " ", b).splitlines()]
    return [c for c in commands if needle in c]


def test_topology_as_documented_edits_give_a_proxy_on_8443_in_front_of_the_apiservers_on_6443(
        tmp_path: Path) -> None:
    """The sed lines of docs/install/topology-a.md, run as written on the shipped files."""
    (config_cmd,) = documented_commands("topology-a.md", "deploy/proxy/config.yaml")
    (pod_cmd,) = documented_commands("topology-a.md", "deploy/proxy/static-pod.yaml")
    config_cmd = config_cmd.replace("/etc/gatekeeper/proxy.yaml", str(tmp_path / "proxy.yaml"))
    pod_cmd = pod_cmd.replace("/etc/kubernetes/manifests/gatekeeper-proxy.yaml", str(tmp_path / "pod.yaml"))
    env = {"PATH": os.environ["PATH"], "REGISTRY": "registry.example.com/gk", "VERSION": "9.9.9"}
    for cmd in (config_cmd, pod_cmd):
        subprocess.run(["bash", "-ec", cmd], cwd=DEPLOY.parent, env=env, check=True, timeout=30)
    raw = yaml.safe_load((tmp_path / "proxy.yaml").read_text())["proxy"]
    settings: ProxySettings = from_mapping(ProxySettings, raw, "proxy.yaml", "proxy")
    assert settings.listener.port == 8443
    assert [b.url.rsplit(":", 1)[1] for b in settings.backends] == ["6443"] * 3
    pod = yaml.safe_load((tmp_path / "pod.yaml").read_text())
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example.com/gk:9.9.9"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"https": 8443, "metrics": 9443}
