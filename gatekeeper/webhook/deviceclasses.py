"""Whether a DeviceClass maps ``nvidia.com/gpu`` (KEP-5004, DRAExtendedResource), kept fresh.

With ``extendedResourceName: nvidia.com/gpu`` on a DeviceClass the scheduler
serves an unchanged ``nvidia.com/gpu: N`` pod through DRA on nodes that do not
advertise the resource. With ``gpu.kep5004: step-aside`` plain ``dra`` mode then
leaves such pods to it (the default, ``rewrite``, never asks, and this map is
not started: the scheduler-made claims cost the scheduler memory). The
webhook answers reviews synchronously, so the answer is a cached bool, and the
cache is a short-interval LIST (``deviceClassCheckSeconds``, default 10 s):
one small request per interval, and a mapping added or removed never hides for
longer than that. A failed LIST keeps the last answer (logged), so an apiserver
hiccup does not flip every pod's rewrite.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

GPU = "nvidia.com/gpu"

ListClasses = Callable[[], Awaitable[list[dict[str, Any]]]]


def classes_mapping(items: list[dict[str, Any]], resource: str = GPU) -> list[str]:
    """Names of the DeviceClasses whose ``spec.extendedResourceName`` is ``resource``."""
    out = []
    for item in items:
        spec = item.get("spec") if isinstance(item, dict) else None
        if isinstance(spec, dict) and spec.get("extendedResourceName") == resource:
            out.append(str((item.get("metadata") or {}).get("name", "")))
    return sorted(out)


class ExtendedResourceMap:
    """The last known answer, refreshed every ``interval`` seconds by :meth:`run`."""

    def __init__(self, list_classes: ListClasses, interval: float = 10.0) -> None:
        self._list = list_classes
        self.interval = interval
        self.classes: list[str] = []
        self.synced = False

    @property
    def mapped(self) -> bool:
        return bool(self.classes)

    async def refresh(self) -> None:
        try:
            items = await self._list()
        except Exception as exc:  # keep the last answer: a hiccup must not flip every rewrite
            log.warning("listing DeviceClasses failed (%s: %s); keeping KEP-5004 mapping %s",
                        type(exc).__name__, exc, self.classes)
            return
        classes = classes_mapping(items)
        if classes != self.classes or not self.synced:
            log.info("DeviceClasses mapping %s: %s", GPU, classes or "none")
        self.classes, self.synced = classes, True

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)
