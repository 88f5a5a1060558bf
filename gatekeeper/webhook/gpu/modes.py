"""Which GPU mode a pod gets, and who may choose it (pure).

The pod annotation, ``namespaceModes``, the namespace's ``gatekeeper.dev/gpu-mode``
label and ``defaultMode`` decide in that order, except in ``enforcedNamespaces``: there the namespace's mode holds, and
an annotation asking for another is denied, not ignored, unless the user is in
``optOutGroups``. Installing the webhook must make the policy hold, not merely
suggest it.
"""

from __future__ import annotations

from typing import Any

from gatekeeper.kube.admission import quoted
from gatekeeper.webhook.settings import FALLBACKS_ANNOTATION, MODE_ANNOTATION, MODES, GpuSettings


class PolicyError(ValueError):
    """The pod cannot be admitted as written; the message goes to the user."""


class PolicyForbidden(PolicyError):
    """The pod asks for something its namespace's policy does not let this user choose."""


def resolve_mode(annotations: dict[str, Any], namespace: str, settings: GpuSettings) -> str:
    return decide_mode(annotations, namespace, settings, groups=())[0]


def _namespace_mode(namespace: str, settings: GpuSettings, label_mode: str | None) -> tuple[str, str] | None:
    """The config's namespaceModes first (the operator's file), then the namespace's label."""
    ns_mode = settings.namespace_modes.get(namespace)
    if ns_mode:
        return ns_mode, "namespace"
    if label_mode is None:
        return None
    if label_mode not in MODES:
        raise PolicyError(f"namespace {namespace} has label {MODE_ANNOTATION}={label_mode!r}, which is not a mode "
                          f"(one of {', '.join(MODES)}): fix the namespace's label")
    return label_mode, "namespace-label"


def decide_mode(annotations: dict[str, Any], namespace: str, settings: GpuSettings,
                groups: Any, label_mode: str | None = None) -> tuple[str, str]:
    """(mode, source): source is annotation, namespace, namespace-label, default, enforced or opt-out.

    ``label_mode``: the namespace's ``gatekeeper.dev/gpu-mode`` label, used where namespaceModes
    says nothing.

    In an ``enforcedNamespaces`` namespace the annotation may only repeat the namespace's mode,
    unless the user is in ``optOutGroups``; anything else is denied rather than silently ignored,
    so the user learns why their pod is not what they asked for.
    """
    value = annotations.get(MODE_ANNOTATION)
    if value is None and FALLBACKS_ANNOTATION in annotations:
        value = "first-available"  # a pod that lists its ways asks for them
    if value is not None and value not in MODES:
        raise PolicyError(f"annotation {MODE_ANNOTATION} must be one of {', '.join(MODES)}, got {quoted(value)}")
    base, base_source = _namespace_mode(namespace, settings, label_mode) or (settings.default_mode, "default")
    if namespace in settings.enforced_namespaces:
        if value is None or value == base:
            return base, "enforced"
        allowed = set(settings.opt_out_groups)
        mine = {g for g in groups if isinstance(g, str)} if isinstance(groups, list | tuple) else set()
        if allowed & mine:
            return str(value), "opt-out"
        who = f"members of {', '.join(sorted(allowed))}" if allowed else "nobody"
        raise PolicyForbidden(
            f"namespace {namespace} enforces gpu-mode {base}; the pod's annotation {MODE_ANNOTATION}: {value} "
            f"is not allowed here (only {who} may opt out): remove the annotation or set it to {base}")
    if value is not None:
        return str(value), "annotation"
    return base, base_source
