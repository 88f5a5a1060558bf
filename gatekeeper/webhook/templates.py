"""Keep the GPU ResourceClaimTemplates present in the namespaces that need them.

A rewritten DRA pod references a ResourceClaimTemplate by name; if the template
is missing, the resourceclaim controller cannot create the pod's claim and the
pod stays Pending. So before answering a non-dryRun review whose patch points
at templates, the webhook makes sure they exist:

* create-if-missing as a single POST: ``409 AlreadyExists`` is success, so the
  RBAC needed is just ``create`` on ``resourceclaimtemplates`` (no get/list);
* a per-(namespace, name) cache with a TTL, so steady state costs nothing; the
  lifecycle loop (template_lifecycle.py) drops a template from it as soon as it
  sees the template deleted, so the cache never hides a deletion for longer than
  ``templateReconcileSeconds`` (and ``templateCacheSeconds`` bounds it anyway);
* concurrent reviews for the same template share one in-flight POST;
* never on dryRun (the webhook declares ``sideEffects: NoneOnDryRun``).

The kubernetes-asyncio part is one small adapter (:func:`gatekeeper.webhook.kube_api.template_creator`); the
cache logic takes any async ``create(obj)`` so it is unit-testable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

Create = Callable[[dict[str, Any]], Awaitable[None]]
"""Create one object; raise AlreadyExists if it exists, TemplateError on any other failure."""


class AlreadyExists(Exception):
    """The object is already there (HTTP 409): for create-if-missing that is success."""


class TemplateError(Exception):
    """A template could not be ensured; the message is shown to the user who created the pod."""


class TemplateKeeper:
    """Create-if-missing with a TTL cache and in-flight de-duplication."""

    def __init__(self, create: Create, cache_seconds: float = 300.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_result: Callable[[str], None] | None = None) -> None:
        self._create = create
        self._ttl = cache_seconds
        self._clock = clock
        self._known: dict[tuple[str, str], float] = {}
        self._inflight: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._on_result = on_result or (lambda result: None)
        self.on_ensured: Callable[[list[dict[str, Any]]], None] = lambda objects: None
        """Told of every batch made sure of (the lifecycle loop keeps their specs and spares them from GC)."""

    def forget(self, namespace: str, name: str) -> None:
        """Drop a template from the cache (it was deleted): the next pod that needs it creates it."""
        self._known.pop((namespace, name), None)

    def seen(self, keys: list[tuple[str, str]]) -> None:
        """The lifecycle loop's LIST showed these templates: the next pods that name them need no POST (a miss
        still POSTs, 409 meaning it exists; a deletion seen by the loop is forgotten at once)."""
        until = self._clock() + self._ttl
        for key in keys:
            self._known[key] = until

    def known(self, namespace: str, name: str) -> bool:
        exp = self._known.get((namespace, name))
        return exp is not None and exp > self._clock()

    async def ensure(self, objects: list[dict[str, Any]]) -> None:
        missing = [o for o in objects if not self._cached(o)]
        if missing:  # the steady state has none: no task, no loop turn, no API call
            await asyncio.gather(*(self._ensure_one(o) for o in missing))
        self.on_ensured(objects)

    def _cached(self, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        if not self.known(meta["namespace"], meta["name"]):
            return False
        self._on_result("cached")
        return True

    async def _ensure_one(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        if self._cached(obj):  # made sure of by another review since ensure() looked
            return
        fut = self._inflight.get(key)
        if fut is not None:
            await asyncio.shield(fut)
            return
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            try:
                await self._create(obj)
                result = "created"
                log.info("created ResourceClaimTemplate %s/%s", *key)
            except AlreadyExists:
                result = "exists"
            self._known[key] = self._clock() + self._ttl
            self._on_result(result)
            fut.set_result(None)
        except BaseException as exc:
            self._on_result("error")
            fut.set_exception(exc)
            fut.exception()  # mark retrieved: waiters re-raise it themselves
            raise
        finally:
            del self._inflight[key]


REQUEST_TIMEOUT = 5.0
"""Seconds for one POST: under the mutating webhook's 10 s timeoutSeconds, so a hung apiserver gets the
user our message instead of the apiserver's bare 'context deadline exceeded'."""
