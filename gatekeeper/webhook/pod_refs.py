"""Which ResourceClaimTemplates pods reference, kept by a pod LIST+WATCH instead of a LIST per pass.

The template lifecycle loop needs "is (namespace, template) referenced by any
pod?" every ``templateReconcileSeconds``. Listing every pod in the cluster that
often costs the apiserver a full serialization of all pods per pass per webhook
worker; here one LIST at start, then only changes. Only pods that reference a
template are remembered, and only their template keys, so memory follows the
GPU pods, not the cluster's size. Finished pods count until deleted: their
claims exist until then.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from gatekeeper.webhook.listwatch import ListFn, ListWatch, WatchFn

Key = tuple[str, str]
"""(namespace, name) of a template."""
REFERENCE = b'"resourceClaimTemplateName"'
"""In the JSON of every pod this index keeps: the watch decodes no other pod's event."""


def template_refs(pod: dict[str, Any]) -> frozenset[Key]:
    """Templates named in one pod's ``spec.resourceClaims``."""
    ns = str((pod.get("metadata") or {}).get("namespace", ""))
    claims = (pod.get("spec") or {}).get("resourceClaims") or []
    return frozenset((ns, str(rc["resourceClaimTemplateName"])) for rc in claims
                     if isinstance(rc, dict) and rc.get("resourceClaimTemplateName"))


def _pod_key(pod: dict[str, Any]) -> Key:
    meta = pod.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


class PodTemplateRefs(ListWatch):
    """``referenced()``: the templates at least one pod names; None until the first LIST is in."""

    what = "pod template-reference"

    def __init__(self, list_fn: ListFn, watch_fn: WatchFn, retry_seconds: float = 1.0) -> None:
        super().__init__(list_fn, watch_fn, retry_seconds)
        self._pods: dict[Key, frozenset[Key]] = {}
        self._counts: Counter[Key] = Counter()

    def _set(self, pod: Key, refs: frozenset[Key]) -> None:
        old = self._pods.pop(pod, frozenset())
        self._counts.subtract(old)
        if refs:
            self._pods[pod] = refs
            self._counts.update(refs)
        for k in old - refs:
            if self._counts[k] <= 0:
                del self._counts[k]

    def apply(self, event: str, obj: dict[str, Any]) -> None:
        # A pod's resourceClaims are immutable, but a MODIFIED is handled as a replacement anyway.
        self._set(_pod_key(obj), frozenset() if event == "DELETED" else template_refs(obj))

    def replace(self, items: list[dict[str, Any]]) -> None:
        self._pods, self._counts = {}, Counter()
        for pod in items:
            self._set(_pod_key(pod), template_refs(pod))

    def referenced(self) -> set[Key] | None:
        return set(self._counts) if self.synced.is_set() else None
