"""The admission fuzz's variants through the sans-IO policies, with no apiserver: the same oracles as the
sandbox fuzz (test_admission_fuzz_sandbox.py), so a policy bug shows here in a second, and there against the
real apiserver's defaulting, validation and storage."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from admission_fuzz import (
    GPU,
    NAMESPACES,
    WEBHOOK_CONFIG,
    asks_whole_gpus,
    containers,
    expected_denial,
    pod_cases,
    whole_gpus_allowed,
)
from review_fixtures import apply, request, review

from gatekeeper.kube.admission import response
from gatekeeper.webhook import registration
from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.settings import GpuSettings

SEED = 20261202


def _settings() -> GpuSettings:
    section = yaml.safe_load(WEBHOOK_CONFIG)["webhook"]["gpu"]
    return GpuSettings(namespace_modes=section["namespaceModes"], enforced_namespaces=section["enforcedNamespaces"],
                       namespace_gpu_memory=section["namespaceGpuMemory"], opt_out_groups=section["optOutGroups"],
                       default_mode="dra")


def _defaulted(pod: dict[str, Any]) -> dict[str, Any]:
    """What the apiserver hands a mutating webhook: requests defaulted from limits (v1 SetDefaults_Pod)."""
    pod = copy.deepcopy(pod)
    for c in containers(pod):
        res = c.get("resources") or {}
        for name, value in (res.get("limits") or {}).items():
            res.setdefault("requests", {}).setdefault(name, value)
    return pod


def test_no_variant_keeps_whole_gpus_where_the_policy_rewrites_them() -> None:
    settings = _settings()
    problems = []
    reviewed = 0
    for case in pod_cases(SEED, 600, NAMESPACES):
        if case.namespace.exempt:
            continue  # never sent to the webhook
        pod = _defaulted(case.pod)
        doc = review(pod, namespace=case.namespace.name)
        doc["request"]["userInfo"] = {"username": "u", "groups": ["gpu-admins"] if case.opt_out else ["tenants"]}
        req = request(doc)
        decision = gpu.review(req, settings) if gpu.handles(req, settings) else None
        if decision is None:
            continue
        reviewed += 1
        if not decision.allowed:
            assert decision.message and "internal error" not in decision.message
            continue
        out = apply(pod, response(req.uid, decision))
        if asks_whole_gpus(out) and not whole_gpus_allowed(case.namespace, case.pod, case.opt_out):
            problems.append(f"BYPASS {case.describe()}")
        elif expected_denial(case.namespace, case.pod, case.opt_out) and asks_whole_gpus(case.pod):
            problems.append(f"admitted a pod the policy denies: {case.describe()}")
    assert reviewed > 300
    assert not problems, "\n".join(problems[:5])


def test_kube_root_ca_is_exempt_only_for_the_controller_that_publishes_it() -> None:
    """The regression of the fuzz's finding, at the registration: the name alone no longer exempts a write.

    (The CEL itself runs in the apiserver: the sandbox test proves a tenant's write is checked and the
    controller's is not.)"""
    expression = registration.NOT_ROOT_CA["expression"]
    name_test, _, identity_test = expression.partition("object.metadata.name != 'kube-root-ca.crt' || ")
    assert name_test and identity_test.startswith("!(request.userInfo.username in [")
    for user in ("system:kube-controller-manager", "system:serviceaccount:kube-system:root-ca-cert-publisher"):
        assert f"'{user}'" in identity_test
    assert GPU not in expression
