"""Every rendering of the chart is accepted by the real kube-apiserver (server-side dry run).

The cert-manager and Prometheus-operator CRDs come from those projects' Go modules (copied into the
cache by `gatekeeper sandbox build`), so Certificates, Issuers, ServiceMonitors, PodMonitors and
PrometheusRules are validated against their real OpenAPI schemas, not just parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gatekeeper.sandbox import chart
from gatekeeper.sandbox.build import CRD_MODULES, crd_dir

pytestmark = pytest.mark.sandbox

VALUES_SETS = chart.REPO / "deploy" / "helm" / "values-tests"
CASES = {
    "defaults": (),
    "cert-manager": (VALUES_SETS / "cert-manager.yaml",),
    "monitoring": (VALUES_SETS / "monitoring.yaml",),
    "everything-off": (VALUES_SETS / "everything-off.yaml",),
}


@pytest.fixture(scope="module")
def crds(kubectl: Any, helm_bin: Path) -> None:
    for name in CRD_MODULES:
        directory = crd_dir(name)
        if not any(directory.glob("*.yaml")):
            pytest.skip(f"{directory} is empty; run `gatekeeper sandbox build`")
        # Server-side: the Prometheus CRDs exceed the client-side last-applied annotation limit.
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(directory), timeout=180, check=True)
    kubectl("wait", "--for=condition=Established", "--timeout=120s",
            "crd/certificates.cert-manager.io", "crd/issuers.cert-manager.io",
            "crd/servicemonitors.monitoring.coreos.com", "crd/podmonitors.monitoring.coreos.com",
            "crd/prometheusrules.monitoring.coreos.com", timeout=150, check=True)
    # Namespaced objects need their namespace to exist for a dry run (the chart's own Namespace object
    # is itself only dry-run).
    if kubectl("get", "namespace", chart.NAMESPACE).returncode != 0:
        kubectl("create", "namespace", chart.NAMESPACE, check=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_rendering_is_accepted_by_the_apiserver(crds: None, kubectl: Any, case: str) -> None:
    rendered = chart.template(CASES[case])
    out = kubectl("apply", "--dry-run=server", "-f", "-", input=rendered, timeout=120)
    assert out.returncode == 0, out.stderr
    kinds = {line.split("/")[0] for line in out.stdout.splitlines()}
    assert "deployment.apps" in kinds, out.stdout
    if case == "monitoring":
        assert {"prometheusrule.monitoring.coreos.com", "servicemonitor.monitoring.coreos.com",
                "podmonitor.monitoring.coreos.com"} <= kinds, out.stdout
    if case in ("defaults", "cert-manager"):
        assert {"certificate.cert-manager.io", "issuer.cert-manager.io"} <= kinds, out.stdout


def test_the_dry_run_rejects_a_rendering_the_apiserver_would_refuse(crds: None, kubectl: Any) -> None:
    """Proof the check above is not vacuous: helm renders this, the apiserver refuses it."""
    rendered = chart.template(sets=("webhooks.gpu.failurePolicy=Sometimes",))
    out = kubectl("apply", "--dry-run=server", "-f", "-", input=rendered, timeout=120)
    assert out.returncode != 0 and "failurePolicy" in out.stderr, out.stdout + out.stderr


def test_rendered_manifests_file_is_accepted_as_is(crds: None, kubectl: Any) -> None:
    out = kubectl("apply", "--dry-run=server", "-f", str(chart.RENDERED), timeout=120)
    assert out.returncode == 0, out.stderr
