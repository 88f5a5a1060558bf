"""The Helm chart: lint, rendering per values set, safe defaults, and deploy/manifests kept in sync."""

from __future__ import annotations

import base64
import copy
import functools
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from gatekeeper.base.config import from_mapping, load_config
from gatekeeper.sandbox import chart
from gatekeeper.webhook import registration
from gatekeeper.webhook.secrets import limits_for
from gatekeeper.webhook.settings import WebhookSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
VALUES_SETS = DEPLOY / "helm" / "values-tests"


def render(*sets: str, values: tuple[Path, ...] = (), hooks: bool = True) -> list[dict[str, Any]]:
    return copy.deepcopy(_render(sets, values, hooks))


@functools.cache
def _render(sets: tuple[str, ...], values: tuple[Path, ...], hooks: bool) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(chart.template(values, sets, hooks=hooks)) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def webhook_settings(docs: list[dict[str, Any]]) -> WebhookSettings:
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    raw = yaml.safe_load(cm["data"]["config.yaml"])["webhook"]
    settings: WebhookSettings = from_mapping(WebhookSettings, raw, "chart ConfigMap", "webhook")
    return settings


@pytest.fixture(autouse=True)
def _helm(helm_bin: Path) -> None:
    """Every test here needs helm."""


def test_helm_lint_is_clean_for_every_values_set(helm_bin: Path) -> None:
    for values in [None, *sorted(VALUES_SETS.glob("*.yaml"))]:
        argv = [str(helm_bin), "lint", "--strict", str(chart.CHART), "--kube-version", chart.KUBE_VERSION]
        if values:
            argv += ["--values", str(values)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (values, out.stdout + out.stderr)


def test_rendered_manifests_are_in_sync_with_the_chart() -> None:
    assert chart.RENDERED.read_text() == chart.default_manifests(), (
        "deploy/manifests/gatekeeper.yaml is stale: run `python -m gatekeeper.sandbox.chart`")
    assert not any("helm.sh/hook" in str(d["metadata"].get("annotations", {}))
                   for d in yaml.safe_load_all(chart.RENDERED.read_text()) if d)


def test_webhooks_match_the_registration_module_the_sandbox_uses() -> None:
    docs = render("config.secrets.configMaps=true")
    ns = chart.NAMESPACE
    svc = {"service": {"name": "gatekeeper-webhook", "namespace": ns, "port": 443}}
    for want in (registration.validating_configuration(svc, "", own_namespace=ns),
                 registration.mutating_configuration(svc, "", own_namespace=ns)):
        (got,) = by_kind(docs, want["kind"])
        assert got["metadata"]["name"] == want["metadata"]["name"]
        for g, w in zip(got["webhooks"], want["webhooks"], strict=True):
            assert {k: v for k, v in g.items() if k != "clientConfig"} == \
                   {k: v for k, v in w.items() if k != "clientConfig"}
            assert g["clientConfig"]["service"] == w["clientConfig"]["service"]


def test_config_maps_are_registered_only_when_their_policy_is_on() -> None:
    (off,) = by_kind(render(), "ValidatingWebhookConfiguration")
    assert off["webhooks"][0]["rules"][0]["resources"] == ["secrets"]
    assert "matchConditions" not in off["webhooks"][0]
    docs = render("config.secrets.configMaps=true")
    (on,) = by_kind(docs, "ValidatingWebhookConfiguration")
    assert on["webhooks"][0]["rules"][0]["resources"] == ["secrets", "configmaps"]
    assert "kube-root-ca.crt" in on["webhooks"][0]["matchConditions"][0]["expression"]
    assert webhook_settings(docs).secrets.config_maps is True


def test_emergency_label_exempts_namespaces_from_both_webhooks_and_objects_only_when_asked() -> None:
    """Any creator can label its own object: by default an object's label exempts nothing."""
    docs = render("exemptions.namespaces={legacy}")
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        (w,) = by_kind(docs, kind)[0]["webhooks"]
        exprs = w["namespaceSelector"]["matchExpressions"]
        assert {"key": "gatekeeper.dev/exempt", "operator": "NotIn", "values": ["true"]} in exprs
        assert set(exprs[0]["values"]) == {"gatekeeper-system", "kube-system", "legacy"}
        assert "objectSelector" not in w
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        (w,) = by_kind(render("exemptions.objectLabel=true"), kind)[0]["webhooks"]
        assert w["objectSelector"]["matchExpressions"][0]["key"] == "gatekeeper.dev/exempt"


def test_failure_policy_and_timeouts_are_per_webhook_values() -> None:
    docs = render("webhooks.gpu.failurePolicy=Ignore", "webhooks.secrets.timeoutSeconds=3")
    (m,) = by_kind(docs, "MutatingWebhookConfiguration")[0]["webhooks"]
    (v,) = by_kind(docs, "ValidatingWebhookConfiguration")[0]["webhooks"]
    assert (m["failurePolicy"], v["failurePolicy"], v["timeoutSeconds"]) == ("Ignore", "Fail", 3)


def test_deployment_defaults_are_safe_for_a_critical_webhook() -> None:
    docs = render(*chart.MANIFEST_SETS)
    (dep,) = by_kind(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert spec["priorityClassName"] == "system-cluster-critical"
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] >= 10  # > endpoints propagation (a few s)
    assert spec["terminationGracePeriodSeconds"] > c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert c["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    (ns,) = by_kind(docs, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    settings = webhook_settings(docs)
    assert settings.server.port == 8443 and settings.gpu.default_mode == "off"
    assert settings.server.max_body_bytes < 32 * 1024 * 1024


def test_image_digest_and_scheduling_values_reach_the_pod() -> None:
    docs = render("image.digest=sha256:" + "a" * 64, "nodeSelector.role=infra", "replicas=3",
                  "tolerations[0].operator=Exists", "priorityClassName=")
    (dep,) = by_kind(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    assert spec["containers"][0]["image"].endswith("@sha256:" + "a" * 64)
    assert spec["nodeSelector"] == {"role": "infra"} and dep["spec"]["replicas"] == 3
    assert spec["tolerations"] == [{"operator": "Exists"}] and "priorityClassName" not in spec


def test_log_format_and_level_values_reach_the_webhook_command_line() -> None:
    (dep,) = by_kind(render(), "Deployment")
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][:5] == [
        "--log-format", "text", "--log-level", "INFO", "webhook"]
    (dep,) = by_kind(render("logFormat=json", "logLevel=DEBUG"), "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["--log-format", "json", "--log-level", "DEBUG"]
    from gatekeeper.cli import build_parser

    parsed = build_parser().parse_args([*args[:4], "webhook", "--config", "x"])  # the CLI accepts what it renders
    assert (parsed.log_format, parsed.log_level, parsed.command) == ("json", "DEBUG", "webhook")


def test_client_certificate_authentication_values_make_a_valid_config() -> None:
    docs = render("config.server.clientCaSecret=apiserver-webhook-ca",
                  "config.server.allowedClientNames={kube-apiserver-webhook-client}")
    s = webhook_settings(docs)
    assert s.server.client_ca_file == "/etc/gatekeeper/client-ca/ca.crt"
    assert s.server.allowed_client_names == ["kube-apiserver-webhook-client"]
    (dep,) = by_kind(docs, "Deployment")
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["client-ca"]["secret"]["secretName"] == "apiserver-webhook-ca"


def test_listener_bounds_reach_the_webhook_config_and_default_to_the_webhooks_own() -> None:
    """Any pod can connect to the webhook: the chart must carry every listener bound, defaults unchanged."""
    defaults = WebhookSettings().server
    s = webhook_settings(render()).server
    for name in ("max_buffered_body_bytes", "max_buffered_body_caller_share", "max_buffered_request_bytes",
                 "max_connections",
                 "tls_handshake_timeout_seconds",
                 "idle_timeout_seconds", "body_timeout_seconds", "write_timeout_seconds"):
        assert getattr(s, name) == getattr(defaults, name), name
    s = webhook_settings(render("config.server.maxConnections=50", "config.server.idleTimeoutSeconds=95",
                                "config.server.maxBufferedBodyBytes=12582912",
                                "config.server.maxBufferedBodyCallerShare=0.5",
                                "config.server.maxBufferedRequestBytes=4194304")).server
    assert (s.max_connections, s.idle_timeout_seconds, s.max_buffered_body_bytes) == (50, 95, 12582912)
    assert s.max_buffered_request_bytes == 4194304
    assert s.max_buffered_body_caller_share == 0.5


def test_cert_manager_chain_gives_a_ca_bundle_not_the_serving_certificate() -> None:
    docs = render()
    certs = {c["metadata"]["name"]: c for c in by_kind(docs, "Certificate")}
    issuers = {i["metadata"]["name"]: i for i in by_kind(docs, "Issuer")}
    ca, serving = certs["gatekeeper-webhook-ca"], certs["gatekeeper-webhook"]
    assert ca["spec"]["isCA"] is True and "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    assert ca_issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        (w,) = by_kind(docs, kind)
        assert w["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
            "gatekeeper-system/gatekeeper-webhook"


def test_generated_certificates_chain_to_the_ca_bundle() -> None:
    docs = render("certificates.mode=generated")
    assert not by_kind(docs, "Certificate")
    (secret,) = by_kind(docs, "Secret")
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    leaf = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    leaf.verify_directly_issued_by(ca)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "gatekeeper-webhook.gatekeeper-system.svc" in sans.get_values_for_type(x509.DNSName)
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        (w,) = by_kind(docs, kind)[0]["webhooks"]
        assert w["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]


def test_optional_objects_follow_their_switches() -> None:
    off = {d["kind"] for d in render(values=(VALUES_SETS / "everything-off.yaml",))}
    assert not off & {"NetworkPolicy", "ServiceMonitor", "PodMonitor", "PrometheusRule", "Job",
                      "Namespace", "PodDisruptionBudget", "MutatingWebhookConfiguration"}
    on = {d["kind"] for d in render(values=(VALUES_SETS / "monitoring.yaml",))}
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "NetworkPolicy"} <= on


def test_pre_delete_hook_removes_both_webhook_configurations() -> None:
    (job,) = by_kind(render(), "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "validatingwebhookconfiguration/gatekeeper-secrets" in args
    assert "mutatingwebhookconfiguration/gatekeeper-gpu" in args


def test_gpu_match_conditions_file_matches_the_registration_module() -> None:
    shipped = yaml.safe_load((chart.CHART / "files" / "gpu-match-conditions.yaml").read_text())
    assert shipped == registration.MATCH_CONDITIONS


def test_example_config_loads_and_lets_helm_releases_through() -> None:
    cfg = load_config(DEPLOY / "examples" / "webhook-config.yaml", need="webhook")
    s: WebhookSettings = cfg.webhook
    helm = limits_for(s.secrets, "Secret", "team-a", "helm.sh/release.v1")
    opaque = limits_for(s.secrets, "Secret", "team-a", "Opaque")
    assert helm.hard == 1536 * 1024 and opaque.hard == 128 * 1024
    assert s.gpu.namespace_modes["batch-legacy"] == "off"


def test_webhook_cluster_role_has_exactly_the_registration_module_rules() -> None:
    """The sandbox grants RBAC_RULES; the chart must grant the same, or a feature works only in the sandbox."""
    roles = [r for r in by_kind(render(), "ClusterRole") if r["metadata"]["name"].endswith("webhook")
             or any("resourceclaimtemplates" in rule.get("resources", []) for rule in r.get("rules", []))]
    assert len(roles) == 1, [r["metadata"]["name"] for r in by_kind(render(), "ClusterRole")]

    def norm(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
        return {(g, res, v) for rule in rules for g in rule.get("apiGroups", [""]) for res in rule["resources"]
                for v in rule["verbs"]}

    assert norm(roles[0]["rules"]) == norm(registration.RBAC_RULES)


def test_runbook_urls_follow_the_docs_site_values() -> None:
    """By default the alerts link to their Markdown pages in the repository; a published docs site moves them all
    (MkDocs serves docs/operations/runbooks/X.md at operations/runbooks/X/)."""
    def runbooks(docs: list[dict[str, Any]]) -> dict[str, str]:
        (rule,) = by_kind(docs, "PrometheusRule")
        return {r["alert"]: r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]}

    default = runbooks(render(values=(VALUES_SETS / "monitoring.yaml",)))
    assert default["GatekeeperProxyBackendDown"] == ("https://github.com/gatekeeper/gatekeeper/blob/main/docs/"
                                                     "operations/runbooks/GatekeeperProxyBackendDown.md"
                                                     "#gatekeeperproxybackenddown")
    site = runbooks(render("monitoring.prometheusRule.runbookBaseUrl=https://docs.example/gatekeeper/",
                           "monitoring.prometheusRule.runbookPageSuffix=/",
                           values=(VALUES_SETS / "monitoring.yaml",)))
    assert site.keys() == default.keys()
    for alert, url in site.items():
        assert url == f"https://docs.example/gatekeeper/operations/runbooks/{alert}/#{alert.lower()}"


def _writable(pod_spec: dict[str, Any], container: dict[str, Any]) -> set[str]:
    """Mount paths of the container backed by a writable volume (an emptyDir, not mounted read-only)."""
    empty = {v["name"] for v in pod_spec.get("volumes", []) if "emptyDir" in v}
    return {m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in empty and not m.get("readOnly")}


def test_the_chart_the_manifests_and_the_static_pod_run_the_image_the_containerfile_builds() -> None:
    """One image and tag scheme (repository + the chart's appVersion) everywhere, run as the Containerfile's
    USER on a read-only root whose one writable path, /tmp, is an emptyDir that holds the metrics directory."""
    chart_meta = yaml.safe_load((DEPLOY / "helm" / "gatekeeper" / "Chart.yaml").read_text())
    values = yaml.safe_load((DEPLOY / "helm" / "gatekeeper" / "values.yaml").read_text())
    image = f"{values['image']['repository']}:{chart_meta['appVersion']}"
    containerfile = (DEPLOY.parent / "Containerfile").read_text()
    assert "USER 65532:65532" in containerfile
    assert chart_meta["appVersion"] == __import__("gatekeeper").__version__
    (dep,) = by_kind(render(*chart.MANIFEST_SETS), "Deployment")
    (manifest_dep,) = by_kind([d for d in yaml.safe_load_all((DEPLOY / "manifests" / "gatekeeper.yaml").read_text())
                               if d], "Deployment")
    static = yaml.safe_load((DEPLOY / "proxy" / "static-pod.yaml").read_text())
    pods = {"chart": dep["spec"]["template"]["spec"], "manifests": manifest_dep["spec"]["template"]["spec"],
            "static pod": static["spec"]}
    for where, spec in pods.items():
        (c,) = spec["containers"]
        assert c["image"] == image, where
        assert spec["securityContext"]["runAsUser"] == 65532 and spec["securityContext"]["runAsNonRoot"], where
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, where
        assert _writable(spec, c) == {"/tmp"}, where
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env.get("PROMETHEUS_MULTIPROC_DIR", "").startswith("/tmp/"), where


def test_the_charts_proxy_rbac_is_the_example_files_and_grants_only_fleet_leases_in_one_namespace() -> None:
    """The static pods' identity gets the same objects from the chart as from
    deploy/examples/proxy-identity-rbac.yaml; in the fleet namespace only Leases, never delete; in default only
    the kubernetes Service's endpoints."""
    assert not [d for d in render() if d["metadata"]["name"].startswith("gatekeeper-proxy:")]  # off by default
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in render(values=(VALUES_SETS / "monitoring.yaml",))
                if d["metadata"]["name"].startswith("gatekeeper-proxy:")}
    example = {(d["kind"], d["metadata"]["name"]): d
               for d in yaml.safe_load_all((DEPLOY / "examples" / "proxy-identity-rbac.yaml").read_text())
               if d and d["kind"] != "Namespace"}
    assert rendered.keys() == example.keys()
    for key, want in example.items():
        got = rendered[key]
        assert got.get("rules") == want.get("rules") and got.get("subjects") == want.get("subjects"), key
        assert got.get("roleRef") == want.get("roleRef"), key
        assert got["metadata"].get("namespace") == want["metadata"].get("namespace"), key
    role = rendered[("Role", "gatekeeper-proxy:fleet")]
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "list", "watch", "create", "patch"]}]
    endpoints = rendered[("Role", "gatekeeper-proxy:kubernetes-endpoints")]
    assert endpoints["metadata"]["namespace"] == "default"
    assert {r["resources"][0] for r in endpoints["rules"]} == {"endpointslices", "endpoints"}
    assert all(r.get("resourceNames") == ["kubernetes"] for r in endpoints["rules"]
               if r["resources"] == ["endpoints"] and r["verbs"] != ["create"])
