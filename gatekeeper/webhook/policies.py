"""Which policy answers which review (pure).

``/validate`` carries the size policy and ``/mutate`` the GPU policy, so the
two webhook configurations can have different rules, failure policies and
side-effect classes. A review no policy handles is allowed untouched: the
webhook must never be the reason an unrelated object cannot be written.
"""

from __future__ import annotations

from gatekeeper.kube.admission import AdmissionRequest, Decision
from gatekeeper.webhook import gpu, secrets
from gatekeeper.webhook.settings import WebhookSettings

UNHANDLED = "none"


def validate(req: AdmissionRequest, settings: WebhookSettings) -> tuple[str, Decision]:
    """Answer a /validate review: (policy label for metrics, decision)."""
    if secrets.handles(req, settings.secrets):
        return "secret-size", secrets.review(req, settings.secrets)
    return UNHANDLED, Decision(outcome="skipped")


def mutate(req: AdmissionRequest, settings: WebhookSettings,
           extended_resource_mapped: bool = False) -> tuple[str, Decision]:
    """Answer a /mutate review: (policy label for metrics, decision)."""
    if gpu.handles(req, settings.gpu):
        return "gpu", gpu.review(req, settings.gpu, extended_resource_mapped)
    return UNHANDLED, Decision(outcome="skipped")
