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
in :func:`kube_ops`. Pods are LISTed with ``resourceVersion=0`` (served from the
apiserver's watch cache). Known limit: a template deleted while no webhook was
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

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(namespace, name) of a template."""


def referenced(pods: list[dict[str, Any]]) -> set[Key]:
    """Templates named in pods' ``spec.resourceClaims`` (finished pods included: they hold claims until deleted)."""
    out: set[Key] = set()
    for p in pods:
        ns = str((p.get("metadata") or {}).get("namespace", ""))
        for rc in (p.get("spec") or {}).get("resourceClaims") or []:
            if isinstance(rc, dict) and rc.get("resourceClaimTemplateName"):
                out.add((ns, str(rc["resourceClaimTemplateName"])))
    return out


def ours(template: dict[str, Any]) -> bool:
    labels = (template.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in MANAGED_BY.items())


@dataclass
class Plan:
    recreate: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[Key, str]] = field(default_factory=list)
    """(key, uid) of templates to delete."""


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


def plan(state: LifecycleState, templates: list[dict[str, Any]], pods: list[dict[str, Any]],
         now: float, grace: float) -> Plan:
    """Decide one pass and update ``state`` (pure apart from ``state``)."""
    refs = referenced(pods)
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
    return out


@dataclass
class KubeOps:
    list_templates: Callable[[], Awaitable[list[dict[str, Any]]]]
    list_pods: Callable[[], Awaitable[list[dict[str, Any]]]]
    create: Callable[[dict[str, Any]], Awaitable[None]]
    delete: Callable[[Key, str], Awaitable[None]]


class TemplateLifecycle:
    """The loop: one :func:`plan` per interval; ``forget`` drops a key from the admission cache."""

    def __init__(self, ops: KubeOps, interval: float, grace: float,
                 forget: Callable[[str, str], None] = lambda ns, name: None,
                 clock: Callable[[], float] = time.monotonic,
                 on_result: Callable[[str], None] = lambda result: None) -> None:
        self.ops, self.interval, self.grace = ops, interval, grace
        self.state = LifecycleState()
        self._forget, self._clock, self._on_result = forget, clock, on_result

    def ensured(self, objects: list[dict[str, Any]]) -> None:
        """Admission made sure of these templates: remember their spec, and keep GC off them for a grace period."""
        now = self._clock()
        for o in objects:
            key = (o["metadata"]["namespace"], o["metadata"]["name"])
            self.state.specs[key] = _clean(o)
            self.state.ensured_at[key] = now

    async def once(self) -> Plan:
        templates, pods = await asyncio.gather(self.ops.list_templates(), self.ops.list_pods())
        p = plan(self.state, templates, pods, self._clock(), self.grace)
        for obj in p.recreate:
            meta = obj["metadata"]
            self._forget(meta["namespace"], meta["name"])
            try:
                await self.ops.create(obj)
                log.warning("re-created deleted ResourceClaimTemplate %s/%s that pods still reference",
                            meta["namespace"], meta["name"])
                self._on_result("recreated")
            except Exception as exc:
                log.warning("could not re-create %s/%s: %s", meta["namespace"], meta["name"], exc)
                self._on_result("error")
        for key, uid in p.delete:
            self._forget(*key)
            try:
                await self.ops.delete(key, uid)
                log.info("deleted ResourceClaimTemplate %s/%s: no pod referenced it for %ss", *key, self.grace)
                self._on_result("collected")
            except Exception as exc:
                log.warning("could not delete %s/%s: %s", *key, exc)
                self._on_result("error")
        return p

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception as exc:  # a failed LIST: try again next interval
                log.warning("template reconciliation failed: %s: %s", type(exc).__name__, exc)
                self._on_result("error")
            await asyncio.sleep(self.interval)


def kube_ops(api_client: Any, request_timeout: float = 10.0) -> KubeOps:
    """The reconciler's API calls through kubernetes-asyncio."""
    from kubernetes_asyncio.client import CoreV1Api, CustomObjectsApi, V1DeleteOptions, V1Preconditions
    from kubernetes_asyncio.client.exceptions import ApiException

    custom, core = CustomObjectsApi(api_client), CoreV1Api(api_client)
    selector = ",".join(f"{k}={v}" for k, v in MANAGED_BY.items())

    async def list_templates() -> list[dict[str, Any]]:
        doc = await custom.list_cluster_custom_object("resource.k8s.io", "v1", "resourceclaimtemplates",
                                                      label_selector=selector, _request_timeout=request_timeout)
        return list(doc.get("items") or [])

    async def list_pods() -> list[dict[str, Any]]:
        import orjson

        resp: Any = await core.list_pod_for_all_namespaces(resource_version="0", _preload_content=False,
                                                           _request_timeout=request_timeout)
        return list(orjson.loads(await resp.read()).get("items") or [])

    async def create(obj: dict[str, Any]) -> None:
        try:
            await custom.create_namespaced_custom_object("resource.k8s.io", "v1", obj["metadata"]["namespace"],
                                                         "resourceclaimtemplates", obj,
                                                         _request_timeout=request_timeout)
        except ApiException as exc:
            if exc.status != 409:
                raise

    async def delete(key: Key, uid: str) -> None:
        body = V1DeleteOptions(preconditions=V1Preconditions(uid=uid) if uid else None)
        try:
            await custom.delete_namespaced_custom_object("resource.k8s.io", "v1", key[0], "resourceclaimtemplates",
                                                         key[1], body=body, _request_timeout=request_timeout)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    return KubeOps(list_templates, list_pods, create, delete)
