"""Validating/Mutating webhook configurations and RBAC, as data (pure).

One definition serves the sandbox (``clientConfig.url`` to 127.0.0.1) and the
Helm chart in ``deploy/helm/gatekeeper/`` (``clientConfig.service``); tests/deploy
keeps the YAML in step with this module.

Choices:

* ``admissionReviewVersions: [v1]`` only; the server answers anything else 400.
* Validating webhook ``secrets.gatekeeper.dev``: Secrets and ConfigMaps,
  CREATE and UPDATE (DELETE is never blocked, so it is not even sent).
  ``sideEffects: None``.
* Mutating webhook ``gpu.gatekeeper.dev``: Pod CREATE, ``sideEffects:
  NoneOnDryRun`` (it creates ResourceClaimTemplates, never on dryRun),
  ``reinvocationPolicy: IfNeeded`` (the rewrite is idempotent, and a later
  webhook may inject a GPU container), and ``matchConditions`` so the
  apiserver calls it only for pods that ask for ``nvidia.com/gpu``. Pods that
  say ``gatekeeper.dev/gpu-mode: off`` are sent too: in an enforced namespace
  that annotation must be denied, so the apiserver may not skip them.
* ``namespaceSelector`` excludes kube-system and the webhook's own namespace,
  so a broken webhook can never block its own recovery.
* Emergency exemption: a namespace labelled ``gatekeeper.dev/exempt: "true"``
  is never sent to either webhook (namespaceSelector), so an operator can take
  a namespace out of the webhook's path while it is broken, without deleting
  the configurations. Labelling a namespace needs namespace patch rights.
  Single objects carrying the label are exempt only with ``object_label=True``
  (objectSelector; the chart's ``exemptions.objectLabel``, off by default):
  anyone who may create a Secret or a Pod sets any label on it, so with the
  objectSelector one label took an oversized Secret past the size policy and
  a whole-GPU pod past an enforced namespace's mode, unseen by the webhook.
  ``kube-root-ca.crt`` (which kube-controller-manager writes
  into every new namespace) is excluded by a matchCondition when
  kube-controller-manager writes it, so new namespaces never depend on the
  webhook; anyone else's write of that name is checked like any ConfigMap.
* ``failurePolicy: Fail``: an oversized Secret or a whole-GPU pod slipping
  through while the webhook is down is exactly what it exists to prevent;
  the namespace exclusions keep the control plane itself writable.
"""

from __future__ import annotations

from typing import Any

WEBHOOK_NAMESPACE = "gatekeeper-system"
VALIDATING_NAME = "gatekeeper-secrets"
MUTATING_NAME = "gatekeeper-gpu"
SECRETS_WEBHOOK = "secrets.gatekeeper.dev"
GPU_WEBHOOK = "gpu.gatekeeper.dev"
RBAC_NAME = "gatekeeper-webhook"
EXEMPT_LABEL = "gatekeeper.dev/exempt"
"""Label (value ``"true"``) on a namespace or object that takes it out of both webhooks' path."""
ROOT_CA_PUBLISHERS = ("system:kube-controller-manager", "system:serviceaccount:kube-system:root-ca-cert-publisher")
"""Who writes ``kube-root-ca.crt``: kube-controller-manager's root-ca-cert-publisher, under its own ServiceAccount
(``--use-service-account-credentials``, kubeadm's default) or under the manager's identity."""
NOT_ROOT_CA = {
    "name": "not-kube-root-ca",
    "expression": ("request.resource.resource != 'configmaps' || object.metadata.name != 'kube-root-ca.crt' || "
                   "!(request.userInfo.username in [" + ", ".join(f"'{u}'" for u in ROOT_CA_PUBLISHERS) + "])"),
}
"""kube-controller-manager publishes this ConfigMap into every namespace; its writes must never wait on us.

Only its writes: the name alone exempted anyone who may update ConfigMaps in a namespace, and the publisher
resets ``data`` but leaves ``binaryData`` and labels as they are, so 300 KiB of ``binaryData`` added to a
namespace's ``kube-root-ca.crt`` by a tenant was stored and stayed (found by the admission fuzz,
tests/webhook/test_admission_fuzz_sandbox.py)."""

GPU_NAMES = ("nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores")
"""The device plugin's GPU count and HAMi's per-container names (gpu/asks.py): pods asking for any reach the webhook."""
_NAMES = "[" + ", ".join(f"'{n}'" for n in GPU_NAMES) + "]"
_ASKS_GPU = (
    f"has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, k in {_NAMES})) || "
    f"(has(c.resources.requests) && c.resources.requests.exists(k, k in {_NAMES})))"
)
MATCH_CONDITIONS: list[dict[str, str]] = [
    {
        "name": "asks-for-nvidia-gpu",  # or for HAMi's names of a share of one
        "expression": (
            f"object.spec.containers.exists(c, {_ASKS_GPU}) || "
            f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, {_ASKS_GPU}))"
        ),
    },
]

RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"],
     "verbs": ["create", "list", "delete"]},
    {"apiGroups": ["resource.k8s.io"], "resources": ["deviceclasses"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    # the GPU inventory (webhook/inventory/): what is committed on each GPU, and its one leader's Lease
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices", "resourceclaims"], "verbs": ["list", "watch"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
]
"""All the webhook does against the API: POST templates (409 means present), LIST and DELETE them
(lifecycle), LIST+WATCH pods (which templates are referenced) and DeviceClasses (KEP-5004 mapping), LIST+WATCH
namespaces (their gatekeeper.dev/gpu-mode label)."""


def namespace_selector(own_namespace: str = WEBHOOK_NAMESPACE) -> dict[str, Any]:
    return {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn",
         "values": sorted({"kube-system", own_namespace})},
        {"key": EXEMPT_LABEL, "operator": "NotIn", "values": ["true"]},
    ]}


def object_selector(object_label: bool) -> dict[str, Any]:
    """``{"objectSelector": ...}`` when single objects may exempt themselves by label, else nothing."""
    if not object_label:
        return {}
    return {"objectSelector": {"matchExpressions": [{"key": EXEMPT_LABEL, "operator": "NotIn", "values": ["true"]}]}}


def _client_config(base: dict[str, Any], path: str, ca_bundle: str) -> dict[str, Any]:
    cfg: dict[str, Any]
    if "url" in base:
        cfg = {"url": base["url"].rstrip("/") + path}
    else:
        cfg = {"service": {**base["service"], "path": path}}
    if ca_bundle:
        cfg["caBundle"] = ca_bundle
    return cfg


def validating_configuration(client: dict[str, Any], ca_bundle: str, *, config_maps: bool = True,
                             own_namespace: str = WEBHOOK_NAMESPACE,
                             timeout_seconds: int = 5, object_label: bool = False) -> dict[str, Any]:
    """``client`` is ``{"url": "https://127.0.0.1:PORT"}`` or ``{"service": {name, namespace, port}}``.

    ``object_label``: objects labelled ``gatekeeper.dev/exempt: "true"`` are not sent (any creator can set it).
    """
    resources = ["secrets", "configmaps"] if config_maps else ["secrets"]
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": VALIDATING_NAME, "labels": {"app.kubernetes.io/name": "gatekeeper"}},
        "webhooks": [{
            "name": SECRETS_WEBHOOK,
            "admissionReviewVersions": ["v1"],
            "clientConfig": _client_config(client, "/validate", ca_bundle),
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                       "resources": resources, "scope": "Namespaced"}],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "matchPolicy": "Equivalent",
            "timeoutSeconds": timeout_seconds,
            "namespaceSelector": namespace_selector(own_namespace),
            **object_selector(object_label),
            **({"matchConditions": [NOT_ROOT_CA]} if config_maps else {}),
        }],
    }


def mutating_configuration(client: dict[str, Any], ca_bundle: str, *, own_namespace: str = WEBHOOK_NAMESPACE,
                           timeout_seconds: int = 10, object_label: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": MUTATING_NAME, "labels": {"app.kubernetes.io/name": "gatekeeper"}},
        "webhooks": [{
            "name": GPU_WEBHOOK,
            "admissionReviewVersions": ["v1"],
            "clientConfig": _client_config(client, "/mutate", ca_bundle),
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "sideEffects": "NoneOnDryRun",
            "failurePolicy": "Fail",
            "matchPolicy": "Equivalent",
            "reinvocationPolicy": "IfNeeded",
            "timeoutSeconds": timeout_seconds,
            "namespaceSelector": namespace_selector(own_namespace),
            **object_selector(object_label),
            "matchConditions": MATCH_CONDITIONS,
        }],
    }


def rbac(subject: dict[str, Any]) -> list[dict[str, Any]]:
    """ClusterRole + ClusterRoleBinding for ``subject`` (sandbox: a User; in-cluster: a ServiceAccount)."""
    meta = {"name": RBAC_NAME, "labels": {"app.kubernetes.io/name": "gatekeeper"}}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": meta,
         "rules": RBAC_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": RBAC_NAME},
         "subjects": [subject]},
    ]
