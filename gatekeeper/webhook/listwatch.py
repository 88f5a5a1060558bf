"""An in-memory view kept by LIST then WATCH (kubernetes-asyncio), the shape client-go's reflector has.

Reviews are answered synchronously and loops must not LIST the cluster every few
seconds, so the state lives in memory: one LIST, then a WATCH from its
resourceVersion. A watch that ends normally (its ``timeoutSeconds``) is resumed
from the last resourceVersion seen (bookmarks keep it fresh), so a quiet cluster
costs no LIST; an ERROR event (410 Gone: the version is too old) or a broken
stream LISTs again. Subclasses say what an event or a LIST does to their view.

A watch's lines are decoded here too (:func:`watch_event`), and a view may name the bytes an event must hold
to change anything in it: the pod index watches every pod of the cluster but keeps only those that name a
ResourceClaimTemplate, and decoding every other pod's event was most of the webhook's CPU while it reviewed
nothing (1.2 ms per pod created by anyone, measured on the sandbox).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from gatekeeper.webhook.kube_errors import describe

log = logging.getLogger(__name__)

ListFn = Callable[[], Awaitable[tuple[list[dict[str, Any]], str]]]
"""Items and the list's resourceVersion."""
WatchFn = Callable[[str], AsyncIterator[tuple[str, dict[str, Any]]]]
"""(event type, raw object) from a resourceVersion."""


def resource_version(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


_CHANGES = (b'{"type":"ADDED"', b'{"type":"MODIFIED"', b'{"type":"DELETED"')
_FIRST_RV = re.compile(rb'"resourceVersion":"([0-9]+)"')
"""The object's own resourceVersion: the apiserver writes ``metadata`` first and its ``uid`` and
``resourceVersion`` before labels, annotations or anything a user chose (whose quotes would be escaped anyway)."""


def watch_event(line: bytes, relevant: bytes | None = None) -> tuple[str, dict[str, Any]]:
    """(type, object) of one line of a watch; an ADDED/MODIFIED/DELETED line without ``relevant`` in its
    bytes comes back as a BOOKMARK at its resourceVersion, undecoded: it cannot change the view, and the
    watch still resumes after it. ERROR lines, bookmarks and anything unexpected are decoded whole."""
    if relevant is not None and relevant not in line and line.startswith(_CHANGES):
        m = _FIRST_RV.search(line)
        if m is not None:
            return "BOOKMARK", {"metadata": {"resourceVersion": m.group(1).decode()}}
    doc = orjson.loads(line)
    obj = doc.get("object") if isinstance(doc, dict) else None
    return str(doc.get("type", "")) if isinstance(doc, dict) else "ERROR", obj if isinstance(obj, dict) else {}


class ListWatch:
    """Subclasses implement :meth:`replace` (a LIST's items) and :meth:`apply` (one ADDED/MODIFIED/DELETED)."""

    what = "objects"
    """For log lines."""

    def __init__(self, list_fn: ListFn, watch_fn: WatchFn, retry_seconds: float = 1.0) -> None:
        self._list, self._watch, self._retry = list_fn, watch_fn, retry_seconds
        self.synced = asyncio.Event()
        self.lists = 0
        """LISTs done so far (a test and a metric of how often the view had to start over)."""

    def replace(self, items: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def apply(self, event: str, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    async def relist(self) -> str:
        items, rv = await self._list()
        self.replace(items)
        self.lists += 1
        self.synced.set()
        return rv

    async def _follow(self, rv: str) -> str | None:
        """Watch from ``rv``; the last version seen when the watch ended normally, None to LIST again."""
        async for event, obj in self._watch(rv):
            if event == "ERROR":  # 410 Gone and friends: start over from a fresh LIST
                return None
            rv = resource_version(obj) or rv
            if event != "BOOKMARK":
                self.apply(event, obj)
        return rv

    async def run(self) -> None:
        rv: str | None = None
        while True:
            try:
                if rv is None:
                    rv = await self.relist()
                rv = await self._follow(rv)
                if rv is not None:
                    continue  # ended at its timeout: resume where it stopped, no LIST
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("%s watch failed (%s); listing again", self.what, describe(exc))
                rv = None
            await asyncio.sleep(self._retry)
