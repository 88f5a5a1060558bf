"""Namespaces' ``gatekeeper.dev/gpu-mode`` labels, kept by a LIST+WATCH (kubernetes-asyncio).

Reviews are answered synchronously, so the labels must already be in memory: a
LIST of labelled namespaces, then a WATCH from its resourceVersion. Only
namespaces carrying the label are listed or watched (label selector), and a
namespace whose label is removed arrives as DELETED, so the cache follows a
change within the watch's latency. A broken or expired watch (410 Gone) LISTs
again; until the first LIST succeeds the cache is empty (config's
namespaceModes and defaultMode still apply).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from gatekeeper.webhook.settings import MODE_ANNOTATION

log = logging.getLogger(__name__)

LABEL = MODE_ANNOTATION
"""The namespace label (same key as the pod annotation)."""

ListNamespaces = Callable[[], Awaitable[tuple[list[dict[str, Any]], str]]]
WatchNamespaces = Callable[[str], AsyncIterator[tuple[str, dict[str, Any]]]]


def label_of(ns: dict[str, Any]) -> tuple[str, str | None]:
    meta = ns.get("metadata") or {}
    labels = meta.get("labels") or {}
    value = labels.get(LABEL) if isinstance(labels, dict) else None
    return str(meta.get("name", "")), (str(value) if value is not None else None)


class NamespaceModes:
    """``modes`` maps namespace name to its label value; :meth:`run` keeps it current."""

    def __init__(self, list_ns: ListNamespaces, watch_ns: WatchNamespaces, retry_seconds: float = 1.0) -> None:
        self._list, self._watch, self._retry = list_ns, watch_ns, retry_seconds
        self.modes: dict[str, str] = {}
        self.synced = asyncio.Event()

    def apply(self, event: str, ns: dict[str, Any]) -> None:
        name, value = label_of(ns)
        if event == "DELETED" or value is None:
            self.modes.pop(name, None)
        else:
            self.modes[name] = value

    async def relist(self) -> str:
        items, rv = await self._list()
        self.modes = {n: v for n, v in map(label_of, items) if v is not None}
        self.synced.set()
        return rv

    async def run(self) -> None:
        while True:
            try:
                rv = await self.relist()
                async for event, obj in self._watch(rv):
                    if event == "ERROR":  # 410 Gone and friends: start over from a fresh LIST
                        break
                    self.apply(event, obj)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("namespace gpu-mode watch failed (%s: %s); listing again", type(exc).__name__, exc)
            await asyncio.sleep(self._retry)


def kube_namespace_source(api_client: Any, watch_seconds: int = 300) -> tuple[ListNamespaces, WatchNamespaces]:
    """LIST and WATCH namespaces carrying the label, through kubernetes-asyncio."""
    from kubernetes_asyncio import watch
    from kubernetes_asyncio.client import CoreV1Api

    core = CoreV1Api(api_client)

    async def list_ns() -> tuple[list[dict[str, Any]], str]:
        result: Any = await core.list_namespace(label_selector=LABEL, _request_timeout=10)
        items = [api_client.sanitize_for_serialization(i) for i in result.items]
        return items, str(result.metadata.resource_version or "")

    async def watch_ns(rv: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        w = watch.Watch()
        try:
            async for ev in w.stream(core.list_namespace, label_selector=LABEL, resource_version=rv,
                                     timeout_seconds=watch_seconds, allow_watch_bookmarks=False):
                obj = ev.get("raw_object") or {}
                yield str(ev.get("type", "")), obj if isinstance(obj, dict) else {}
        finally:
            w.stop()

    return list_ns, watch_ns
