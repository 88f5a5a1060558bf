"""Namespaces' ``gatekeeper.dev/gpu-mode`` labels, kept by a LIST+WATCH (kubernetes-asyncio).

Reviews are answered synchronously, so the labels must already be in memory.
Only namespaces carrying the label are listed or watched (label selector), and a
namespace whose label is removed arrives as DELETED, so the cache follows a
change within the watch's latency (listwatch.py: resumed watches, a LIST again
after 410 Gone). Until the first LIST succeeds the cache is empty (config's
namespaceModes and defaultMode still apply).
"""

from __future__ import annotations

from typing import Any

from gatekeeper.webhook.listwatch import ListFn, ListWatch, WatchFn
from gatekeeper.webhook.settings import MODE_ANNOTATION

LABEL = MODE_ANNOTATION
"""The namespace label (same key as the pod annotation)."""

ListNamespaces = ListFn
WatchNamespaces = WatchFn


def label_of(ns: dict[str, Any]) -> tuple[str, str | None]:
    meta = ns.get("metadata") or {}
    labels = meta.get("labels") or {}
    value = labels.get(LABEL) if isinstance(labels, dict) else None
    return str(meta.get("name", "")), (str(value) if value is not None else None)


class NamespaceModes(ListWatch):
    """``modes`` maps namespace name to its label value; :meth:`run` keeps it current."""

    what = "namespace gpu-mode"

    def __init__(self, list_ns: ListNamespaces, watch_ns: WatchNamespaces, retry_seconds: float = 1.0) -> None:
        super().__init__(list_ns, watch_ns, retry_seconds)
        self.modes: dict[str, str] = {}

    def apply(self, event: str, ns: dict[str, Any]) -> None:
        name, value = label_of(ns)
        if event == "DELETED" or value is None:
            self.modes.pop(name, None)
        else:
            self.modes[name] = value

    def replace(self, items: list[dict[str, Any]]) -> None:
        self.modes = {n: v for n, v in map(label_of, items) if v is not None}
