"""The shipped manifests and example config stay in step with the code that the sandbox exercises."""

from __future__ import annotations

from pathlib import Path

import yaml

from gatekeeper.config import from_mapping, load_config
from gatekeeper.webhook import registration
from gatekeeper.webhook.secrets import limits_for
from gatekeeper.webhook.settings import WebhookSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "webhook" / name).read_text()) if d]


def test_webhook_configurations_match_registration_module() -> None:
    ns = registration.WEBHOOK_NAMESPACE
    svc = {"service": {"name": "gatekeeper-webhook", "namespace": ns, "port": 443}}
    shipped = {d["kind"]: d for d in docs("webhooks.yaml")}
    wanted = (registration.validating_configuration(svc, ""), registration.mutating_configuration(svc, ""))
    for want in wanted:
        got = shipped[want["kind"]]
        assert got["webhooks"] == want["webhooks"]
    mutating = shipped["MutatingWebhookConfiguration"]["webhooks"][0]
    assert mutating["sideEffects"] == "NoneOnDryRun" and mutating["matchConditions"]
    excluded = mutating["namespaceSelector"]["matchExpressions"][0]["values"]
    assert {"kube-system", "gatekeeper-system"} <= set(excluded)


def test_rbac_grants_only_template_lifecycle_and_listing() -> None:
    (role,) = [d for d in docs("rbac.yaml") if d["kind"] == "ClusterRole"]
    assert role["rules"] == registration.RBAC_RULES == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"],
         "verbs": ["create", "list", "delete"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["deviceclasses"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}]
    (binding,) = [d for d in docs("rbac.yaml") if d["kind"] == "ClusterRoleBinding"]
    assert binding["subjects"][0]["kind"] == "ServiceAccount"


def test_deployment_config_map_is_a_valid_webhook_config() -> None:
    cm = next(d for d in docs("deployment.yaml") if d["kind"] == "ConfigMap")
    raw = yaml.safe_load(cm["data"]["config.yaml"])["webhook"]
    settings = from_mapping(WebhookSettings, raw, "deployment.yaml", "webhook")
    assert settings.server.port == 8443 and settings.gpu.default_mode == "off"
    deploy = next(d for d in docs("deployment.yaml") if d["kind"] == "Deployment")
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "gatekeeper-webhook"


def test_example_config_loads_and_lets_helm_releases_through() -> None:
    cfg = load_config(DEPLOY / "examples" / "webhook-config.yaml", need="webhook")
    s: WebhookSettings = cfg.webhook
    helm = limits_for(s.secrets, "Secret", "team-a", "helm.sh/release.v1")
    opaque = limits_for(s.secrets, "Secret", "team-a", "Opaque")
    assert helm.hard == 1536 * 1024 and opaque.hard == 128 * 1024
    assert s.gpu.namespace_modes["batch-legacy"] == "off"
