"""When each pod of a namespace appeared and when it was bound, as one watch saw it (sub-second).

The apiserver's own timestamps (``creationTimestamp``, the PodScheduled
condition's ``lastTransitionTime``) have one-second resolution, too coarse for
scheduling latencies of tens of milliseconds. One watch on the namespace gives
both instants from the same stream: the first event of a pod (its creation)
and the first event carrying ``spec.nodeName`` (the binding). A lagging
watcher delays both alike, so their difference is the latency; the
timestamps from a final LIST are kept beside it as a coarse cross-check.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import httpx

from gatekeeper.sandbox.state import SandboxState
from loadtest.harness.cluster import admin


class PodWatch:
    """A background watch on ``namespace``'s pods; offsets are seconds since ``t0`` (``time.monotonic``)."""

    def __init__(self, state: SandboxState, namespace: str, t0: float) -> None:
        self.state, self.namespace, self.t0 = state, namespace, t0
        self.created: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.node: dict[str, str] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"podwatch-{namespace}", daemon=True)

    def __enter__(self) -> PodWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(90)

    def wait_bound(self, count: int, timeout: float) -> bool:
        """True once ``count`` pods were seen bound; False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self.bound) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 1.0))
        return True

    def _see(self, pod: dict[str, Any]) -> None:
        now = round(time.monotonic() - self.t0, 4)
        name = pod["metadata"]["name"]
        with self._changed:
            self.created.setdefault(name, now)
            node = pod.get("spec", {}).get("nodeName")
            if node and name not in self.bound:
                self.bound[name] = now
                self.node[name] = node
                self._changed.notify_all()

    def _loop(self) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        with admin(self.state, timeout=90) as client:
            rv = ""
            while not self._stop.is_set():
                try:
                    if not rv:  # (re)list: pods created while no watch ran are seen here
                        r = client.get(path)
                        r.raise_for_status()
                        body = r.json()
                        for pod in body.get("items", []):
                            self._see(pod)
                        rv = body["metadata"]["resourceVersion"]
                    params = {"watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "true",
                              "timeoutSeconds": "30"}
                    with client.stream("GET", path, params=params) as resp:
                        resp.raise_for_status()
                        for line in resp.iter_lines():
                            if self._stop.is_set():
                                return
                            if not line:
                                continue
                            event = json.loads(line)
                            obj = event.get("object") or {}
                            if event.get("type") == "ERROR":  # e.g. 410 Gone: list again
                                self.errors.append(str(obj.get("message", obj))[:200])
                                rv = ""
                                break
                            rv = obj.get("metadata", {}).get("resourceVersion", rv)
                            if event.get("type") in ("ADDED", "MODIFIED"):
                                self._see(obj)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    rv = ""
                    with contextlib.suppress(Exception):
                        self._stop.wait(0.5)
