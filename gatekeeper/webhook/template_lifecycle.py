"""Keep the GPU ResourceClaimTemplates alive while pods use them, and remove them after.

The webhook creates a template when it admits a pod (templates.py); this loop,
in the same process, handles the rest of a template's life every
``templateReconcileSeconds``:

* a template that pods still reference but that is gone (someone deleted it) is
  created again from its last known spec -- otherwise the pod's claim cannot be
  made and it stays Pending; and the keeper's cache forgets it, so the cache
  never answers "exists" for a deleted template;
* a template of ours (label ``app.kubernetes.io/managed-by: gatekeeper``) that no
  pod has referenced for ``templateGcGraceSeconds`` is deleted (with a uid
  precondition, so a re-created one is never hit), unless the webhook ensured it
  within the grace period -- a pod about to be created may need it.

The decisions are a pure function (:func:`plan`); the kubernetes-asyncio calls are
in :func:`gatekeeper.webhook.kube_api.template_ops`. Which templates pods reference comes from a pod LIST+WATCH
index (pod_refs.py), not a LIST of every pod per pass; until that index has its
first LIST no pass runs, so nothing is collected on an empty view. Known limit: a template deleted while no webhook was
running, and never seen by one, cannot be re-created (its spec is unknown);
a new pod of the same shape re-creates it at admission.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gatekeeper.webhook.gpu.claims import MANAGED_BY
from gatekeeper.webhook.kube_errors import describe
from gatekeeper.webhook.pod_refs import Key

log = logging.getLogger(__name__)


def ours(template: dict[str, Any]) -> bool:
    labels = (template.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in MANAGED_BY.items())


@dataclass
class Plan:
    recreate: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[Key, str]] = field(default_factory=list)
    """(key, uid) of templates to delete."""
    kept: list[Key] = field(default_factory=list)
    """Templates of ours the LIST showed and the pass keeps: admission may take them as existing."""


@dataclass
class LifecycleState:
    """What the loop remembers between passes."""

    specs: dict[Key, dict[str, Any]] = field(default_factory=dict)
    """Last known object of each of our templates (from LISTs and from admission)."""
    unreferenced_since: dict[Key, float] = field(default_factory=dict)
    ensured_at: dict[Key, float] = field(default_factory=dict)


def _clean(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    keep = {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta}
    return {"apiVersion": obj.get("apiVersion", "resource.k8s.io/v1"), "kind": "ResourceClaimTemplate",
            "metadata": keep, "spec": obj.get("spec")}


def plan(state: LifecycleState, templates: list[dict[str, Any]], refs: set[Key], now: float, grace: float) -> Plan:
    """Decide one pass and update ``state`` (pure apart from ``state``); ``refs``: templates pods name."""
    present: dict[Key, dict[str, Any]] = {}
    for t in templates:
        if not ours(t):
            continue
        meta = t.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        present[key] = t
        state.specs[key] = _clean(t)
    out = Plan()
    for key in sorted(refs - present.keys()):
        if key in state.specs:
            out.recreate.append(state.specs[key])
    for key, t in sorted(present.items()):
        if key in refs:
            state.unreferenced_since.pop(key, None)
            continue
        since = state.unreferenced_since.setdefault(key, now)
        recently_ensured = now - state.ensured_at.get(key, float("-inf")) < grace
        if now - since >= grace and not recently_ensured:
            out.delete.append((key, str((t.get("metadata") or {}).get("uid", ""))))
    for key in list(state.unreferenced_since):
        if key not in present:
            del state.unreferenced_since[key]
    for key, _ in out.delete:
        state.specs.pop(key, None)
        state.unreferenced_since.pop(key, None)
    gone = {key for key, _ in out.delete}
    out.kept = [key for key in sorted(present) if key not in gone]
    return out


@dataclass
class KubeOps:
    list_templates: Callable[[], Awaitable[list[dict[str, Any]]]]
    create: Callable[[dict[str, Any]], Awaitable[None]]
    delete: Callable[[Key, str], Awaitable[None]]


class TemplateLifecycle:
    """The loop: one :func:`plan` per interval; ``forget`` drops a key from the admission cache.

    ``references``: the templates pods name, or None while that is not known yet (no pass then).
    """

    def __init__(self, ops: KubeOps, interval: float, grace: float,
                 references: Callable[[], set[Key] | None],
                 forget: Callable[[str, str], None] = lambda ns, name: None,
                 clock: Callable[[], float] = time.monotonic,
                 on_result: Callable[[str], None] = lambda result: None,
                 seen: Callable[[list[Key]], None] = lambda keys: None) -> None:
        self.ops, self.interval, self.grace, self._references = ops, interval, grace, references
        self.state = LifecycleState()
        self._forget, self._clock, self._on_result, self._seen = forget, clock, on_result, seen
        self._listed: set[Key] = set()
        """What the last pass's LIST showed (and kept)."""

    def ensured(self, objects: list[dict[str, Any]]) -> None:
        """Admission made sure of these templates: remember their spec, and keep GC off them for a grace period."""
        now = self._clock()
        for o in objects:
            key = (o["metadata"]["namespace"], o["metadata"]["name"])
            self.state.specs[key] = _clean(o)
            self.state.ensured_at[key] = now

    async def once(self) -> Plan:
        if self._references() is None:
            log.info("template reconciliation waits for the pod index's first LIST")
            return Plan()
        templates = await self.ops.list_templates()
        refs = self._references()  # after the LIST: a pod created meanwhile is in it
        if refs is None:
            return Plan()
        p = plan(self.state, templates, refs, self._clock(), self.grace)
        listed = set(p.kept)
        for key in self._listed - listed:  # deleted by someone since the last LIST: the next pod POSTs again
            self._forget(*key)
        self._listed = listed
        self._seen(p.kept)  # another worker's or replica's templates: its pods need no POST here either
        for obj in p.recreate:
            meta = obj["metadata"]
            self._forget(meta["namespace"], meta["name"])
            try:
                await self.ops.create(obj)
                log.warning("re-created deleted ResourceClaimTemplate %s/%s that pods still reference",
                            meta["namespace"], meta["name"])
                self._on_result("recreated")
            except Exception as exc:
                log.warning("could not re-create %s/%s: %s", meta["namespace"], meta["name"], describe(exc))
                self._on_result("error")
        for key, uid in p.delete:
            self._forget(*key)
            try:
                await self.ops.delete(key, uid)
                log.info("deleted ResourceClaimTemplate %s/%s: no pod referenced it for %ss", *key, self.grace)
                self._on_result("collected")
            except Exception as exc:
                log.warning("could not delete %s/%s: %s", *key, describe(exc))
                self._on_result("error")
        return p

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception as exc:  # a failed LIST: try again next interval
                log.warning("template reconciliation failed: %s", describe(exc))
                self._on_result("error")
            await asyncio.sleep(self.interval)
