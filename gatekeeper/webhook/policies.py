"""Which policy answers which review (pure).

``/validate`` carries the size policy and ``/mutate`` the GPU policy, so the
two webhook configurations can have different rules, failure policies and
side-effect classes. A review no policy handles is allowed untouched: the
webhook must never be the reason an unrelated object cannot be written.
"""

from __future__ import annotations

from collections.abc import Mapping

from gatekeeper.kube.admission import AdmissionRequest, Decision
from gatekeeper.webhook import secrets
from gatekeeper.webhook.gpu import policy as gpu
from gatekeeper.webhook.settings import WebhookSettings

UNHANDLED = "none"


def validate(req: AdmissionRequest, settings: WebhookSettings) -> tuple[str, Decision]:
    """Answer a /validate review: (policy label for metrics, decision)."""
    if secrets.handles(req, settings.secrets):
        return "secret-size", secrets.review(req, settings.secrets)
    return UNHANDLED, Decision(outcome="skipped")


def mutate(req: AdmissionRequest, settings: WebhookSettings, extended_resource_mapped: bool = False,
           namespace_modes: Mapping[str, str] | None = None) -> tuple[str, Decision]:
    """Answer a /mutate review: (policy label for metrics, decision).

    ``namespace_modes``: namespaces' ``gatekeeper.dev/gpu-mode`` labels (from the watch-backed cache).
    """
    if gpu.handles(req, settings.gpu):
        label = (namespace_modes or {}).get(req.namespace)
        return "gpu", gpu.review(req, settings.gpu, extended_resource_mapped, label)
    return UNHANDLED, Decision(outcome="skipped")
