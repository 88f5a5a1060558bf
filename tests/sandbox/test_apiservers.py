"""Several kube-apiservers on one etcd behave as one cluster."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import Kubectl

pytestmark = pytest.mark.sandbox


def test_every_apiserver_serves_namespaces(sandbox: SandboxState, kubectl: Kubectl) -> None:
    kubeconfigs = sandbox.extra["apiserver_kubeconfigs"]
    assert len(kubeconfigs) == len(sandbox.apiserver_urls) == 3
    for kc in kubeconfigs:
        p = kubectl("get", "ns", "-o", "name", kubeconfig=kc)
        assert p.returncode == 0, f"{kc}: {p.stderr}"
        assert "namespace/kube-system" in p.stdout.split()


def test_each_apiserver_kubeconfig_points_at_its_own_apiserver(sandbox: SandboxState) -> None:
    import yaml

    servers = [yaml.safe_load(Path(kc).read_text())["clusters"][0]["cluster"]["server"]
               for kc in sandbox.extra["apiserver_kubeconfigs"]]
    assert servers == sandbox.apiserver_urls
    assert len(set(servers)) == 3


def test_object_created_through_apiserver_1_is_read_through_apiserver_3(
    sandbox: SandboxState, kubectl: Kubectl, namespace: str,
) -> None:
    first, _, third = sandbox.extra["apiserver_kubeconfigs"]
    name = f"cm-{uuid.uuid4().hex[:8]}"
    value = uuid.uuid4().hex
    kubectl("create", "configmap", name, "-n", namespace, f"--from-literal=k={value}", kubeconfig=first,
            check=True)
    p = kubectl("get", "configmap", name, "-n", namespace, "-o", "json", kubeconfig=third, check=True)
    assert json.loads(p.stdout)["data"] == {"k": value}


def test_server_reports_the_built_kubernetes_version(kubectl: Kubectl) -> None:
    from gatekeeper.sandbox.build import K8S

    p = kubectl("get", "--raw", "/version", check=True)
    assert json.loads(p.stdout)["gitVersion"] == K8S.version()
