"""Every request that is not long-running ends by a deadline: ``proxy.protocol.requestTimeoutSeconds``.

kube-apiserver cuts such a request at ``--request-timeout`` and its APF seat goes with it; without the same bound
here two slow readers held the seeds' 2-seat secret-LIST level for as long as they kept reading. Semantics
(exemptions, ``?timeout=``, what the client gets): docs/proxy/deadline.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gatekeeper.kube.duration import go_duration
from gatekeeper.kube.requestinfo import RequestInfo, query_values
from gatekeeper.proxy import rejections
from gatekeeper.proxy.adapter import describe_seconds
from gatekeeper.proxy.messages import ProxyRequest

INVALID_TIMEOUT = "invalid timeout specified in the request URL"
"""kube-apiserver's words for a ``timeout`` it cannot parse (the 400's message starts with them)."""

SWEEP_SECONDS = 0.25
"""How late a deadline may be met: one timer for all requests is far cheaper than one per request."""


def request_timeout(info: RequestInfo, target: str, maximum: float) -> float | None:
    """Seconds this request may run (None: long-running); :class:`DurationError` for a ``timeout`` Go refuses."""
    if info.long_running:
        return None
    _, _, query = target.partition("?")
    if not query or ("timeout" not in query and "%" not in query):
        return maximum  # the common case: no query to parse (an escaped key needs the full parse)
    values = query_values(query).get("timeout")
    if not values:
        return maximum
    asked = go_duration(values[0])  # Go's Query().Get: the first value
    return asked if 0 < asked < maximum else maximum


class Deadlines:
    """Requests with a deadline, and one sweeper that cancels the adapter's task of each past it (504 or a cut
    stream); the sweeper also drops finished ones, so the hot path pays one dict insert."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._armed: dict[int, tuple[float, ProxyRequest, asyncio.Task[object]]] = {}
        """By ``id(request)`` (a request is a mutable dataclass, so not hashable)."""
        self._sweeper: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        """Requests still running under a deadline (a finished one leaves at the next sweep)."""
        return sum(1 for _, _, task in self._armed.values() if not task.done())

    def arm(self, request: ProxyRequest, seconds: float) -> None:
        task = asyncio.current_task()
        if task is None:
            return
        request.deadline_seconds = seconds
        self._armed[id(request)] = (self.clock() + seconds, request, task)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_SECONDS, self._sweep)

    def disarm(self, request: ProxyRequest) -> None:
        """The request became something else (a 101 starts a tunnel): no deadline from now on."""
        self._armed.pop(id(request), None)

    def _sweep(self) -> None:
        self._sweeper = None
        now = self.clock()
        for key, (deadline, request, task) in list(self._armed.items()):
            if task.done():
                del self._armed[key]
            elif deadline <= now:
                del self._armed[key]
                request.timed_out = True  # the adapter answers 504, or cuts a response under way
                rejections.reject("deadline", f"{request.peer} {request.method} {request.target[:200]}: not done "
                                  f"within {describe_seconds(request.deadline_seconds)}")
                task.cancel()
        if self._armed:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_SECONDS, self._sweep)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._armed.clear()

