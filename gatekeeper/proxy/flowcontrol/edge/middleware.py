"""The asyncio edge of flow control: a pipeline middleware ``(request, next) -> response``.

Decisions are the pure :class:`FlowController`'s; this layer parks queued requests, arms queue-wait timers and
says when a request stops costing seats (docs/flowcontrol/index.md#seats). Only LIST bodies are wrapped, so small
GETs pay nothing per chunk; 429s carry an integer ``Retry-After`` since client-go retries only when it is present.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gatekeeper.kube.requestinfo import RequestInfo
from gatekeeper.kube.watchlist import DecodedSize
from gatekeeper.proxy.adapter import error_response
from gatekeeper.proxy.flowcontrol.core.coalesce import coalesce_key, identity_key
from gatekeeper.proxy.flowcontrol.core.controller import FlowController
from gatekeeper.proxy.flowcontrol.core.fleet import FleetShare
from gatekeeper.proxy.flowcontrol.core.listcost import ListShape, continued_response, list_shape, without_timeout
from gatekeeper.proxy.flowcontrol.core.objects import FlowSchema, PriorityLevel
from gatekeeper.proxy.flowcontrol.core.policy import Policy
from gatekeeper.proxy.flowcontrol.core.queueset import Ticket
from gatekeeper.proxy.flowcontrol.core.watchstarts import retry_after
from gatekeeper.proxy.flowcontrol.edge import metrics
from gatekeeper.proxy.flowcontrol.edge.bodies import Metered
from gatekeeper.proxy.flowcontrol.edge.fanout import FanOut, Subscriber
from gatekeeper.proxy.flowcontrol.edge.fleet import FleetMember
from gatekeeper.proxy.flowcontrol.edge.loading import Reloader, limits_of, load_policy
from gatekeeper.proxy.flowcontrol.edge.readahead import ReadAhead, ReadAheadBudget
from gatekeeper.proxy.flowcontrol.edge.watchlist import WatchListSync
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.identity.auth import as_apiserver_sees
from gatekeeper.proxy.identity.impersonation import impersonated
from gatekeeper.proxy.identity.tokens.classify import unverified_flow
from gatekeeper.proxy.identity.tokens.fetch import Upstream
from gatekeeper.proxy.messages import Handler, ProxyRequest, ProxyResponse, UserInfo
from gatekeeper.runtime.tasks import stop_task

log = logging.getLogger("gatekeeper.proxy.flowcontrol")

ANONYMOUS = UserInfo(name="system:anonymous", groups=["system:unauthenticated"])

_REASON_TEXT = {
    "queue-full": "its queue is full",
    "time-out": "it waited in the queue for the longest allowed time",
    "concurrency-limit": "the priority level has no free seats and rejects rather than queues",
    "leader-failed": "the identical request it was merged with failed before answering",
    "watch-rate": "its flow started new watches faster than watchStarts allows",
}


def too_many_requests(fs: FlowSchema, pl: PriorityLevel, reason: str, retry_after: int) -> ProxyResponse:
    """The 429 a client-go client understands and retries after ``retry_after`` seconds."""
    message = (
        f"Too many requests, please try again later: gatekeeper flow control rejected the request "
        f"because {_REASON_TEXT.get(reason, reason)} (FlowSchema {fs.name}, priority level {pl.name})."
    )
    response = error_response(429, "TooManyRequests", message, retry_after=retry_after)
    response.headers += [
        ("x-kubernetes-pf-flowschema-uid", fs.uid),
        ("x-kubernetes-pf-prioritylevel-uid", pl.uid),
        ("x-gatekeeper-pf-flowschema", fs.name),
        ("x-gatekeeper-pf-prioritylevel", pl.name),
    ]
    return response


@dataclass(eq=False, slots=True)
class _Waiter:
    """Per-request state the async layer hangs on a ticket."""

    fs: FlowSchema
    pl: PriorityLevel
    info: RequestInfo
    m: metrics.PairMetrics
    shape: ListShape | None
    """A LIST's or watch-list's options (limit, selectors, resourceVersion): its cost, and what its response
    teaches."""
    resumes: bool = False
    """A watch from a resourceVersion: it is set up once its response head is out."""
    future: asyncio.Future[None] | None = None
    """Only a request that has to queue waits on one (created when it is queued)."""
    abandoned: bool = False
    shared: asyncio.Future[ProxyResponse] | None = None
    """For a follower: resolved by the leader with this follower's own view of the shared response."""
    started: float = 0.0
    seats_released: bool = False
    counted: bool = False
    """Counted in executing_by_schema (the current_executing_requests gauge)."""
    outcome: str = ""
    """State at wake-up (executing, joined, rejected): the ticket may move on before this task resumes."""
    finished: bool = False
    content_type: str = ""
    """A LIST response's Content-Type (a continue token can only be seen in JSON)."""
    sync: WatchListSync | None = None
    """A watch-list's initial sync, while its response is read."""
    sizer: DecodedSize | None = None
    """A gzip LIST's decoded size and first bytes: what the apiserver holds, whatever encoding the client took."""


class FlowControl:
    """API Priority and Fairness as a pipeline middleware; pass the instance as ``flow_control``."""

    def __init__(
        self,
        settings: FlowControlSettings,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.controller = FlowController(policy or load_policy(settings), limits_of(settings))
        self.peak_executing: dict[str, int] = {}
        self.executing_by_schema: dict[tuple[str, str], int] = {}
        self.reloader = Reloader(settings, self.apply)
        self._poll: asyncio.Task[None] | None = None
        self._borrow: asyncio.Task[None] | None = None
        self._sighup = False
        self.read_ahead = ReadAheadBudget(settings.read_ahead_bytes, settings.read_ahead_bytes_per_connection)
        own = UserInfo(name=settings.tokens.proxy_user, groups=list(settings.tokens.proxy_groups))
        self.fleet: FleetMember | None = None
        if settings.fleet.enabled:
            self.fleet = FleetMember(settings.fleet, self.share_seats, user=own, demand=self._demand,
                                     seats_changed=self._seats_changed)
            self.controller.seat_leases = self.fleet.seats_for
        metrics.register_source(self)

    # -- lifecycle ----------------------------------------------------------------------------
    def apply(self, policy: Policy) -> None:
        """Swap in a new policy (reload); requests it lets run are woken."""
        self._wake(self.controller.update(policy, limits_of(self.settings)))
        if self.fleet is not None:
            self.fleet.seats.settle(set(self.controller.ceilings))

    def use_upstream(self, upstreams: list[Upstream]) -> None:
        """The pipeline's backend clients, for the fleet's Leases (``process.run`` wires it)."""
        if self.fleet is not None:
            self.fleet.use_upstream(upstreams)

    def _seats_changed(self) -> None:
        """Seat Leases taken or given back, or the fleet re-divided: limits follow, queued requests may run."""
        self._wake(self.controller.update(self.controller.policy))
        if self.fleet is not None:
            self.fleet.seats.settle(set(self.controller.ceilings))

    def _demand(self, level: str) -> tuple[int, int]:
        lv = self.controller.levels.get(level)
        return (lv.executing_seats, lv.waiting_seats) if lv is not None else (0, 0)

    def use_backends(self, names: Sequence[str], candidates: Callable[[], Sequence[str]]) -> None:
        """The balancer's apiservers, for the per-apiserver cap on expensive LISTs (``process`` wires it)."""
        caps = self.controller.budget.backends
        caps.candidates = candidates
        caps.configure(caps.nominal, caps.min_bytes, caps.fleet, names)

    def share_seats(self, share_of: FleetShare) -> dict[str, tuple[int, int]]:
        """Every Limited level gets ``share_of(level, nominal)`` seats here (its seat Leases where it is leased);
        returns (seats here, fleet's) per level."""
        self.controller.share_of = share_of
        self._seats_changed()
        limits = self.controller.policy.limits
        return {name: (lv.nominal, limits.get(name, 0))
                for name, lv in self.controller.levels.items() if not lv.spec.exempt}

    async def start(self) -> None:
        """Watch policy files and SIGHUP for reloads; join the fleet."""
        if self.fleet is not None:
            self.fleet.start()
        loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(signal.SIGHUP, self.reloader.request)  # parses on a thread
                self._sighup = True
        if self.settings.files and self.settings.reload_interval_seconds > 0:
            self._poll = loop.create_task(self._poll_files(), name="gatekeeper-flowcontrol-reload")
        self._borrow = loop.create_task(self._borrowing(), name="gatekeeper-flowcontrol-borrowing")

    async def _borrowing(self) -> None:
        while True:
            await asyncio.sleep(self.settings.borrowing_adjustment_seconds)
            self.adjust()

    def adjust(self) -> None:
        """One borrowing step (see ``borrowing.py``); requests a grown limit lets run are woken."""
        self._wake(self.controller.adjust(self.clock()))

    async def _poll_files(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reload_interval_seconds)
            try:
                if self.reloader.changed():
                    self.reloader.request("file changed")
            except Exception:
                log.exception("checking flow-control policy files failed")

    async def close(self) -> None:
        self.reloader.cancel()
        if self.fleet is not None:
            await self.fleet.close()
        if self._sighup:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            self._sighup = False
        for task in (self._poll, self._borrow):
            await stop_task(task)
        self._poll = self._borrow = None

    # -- the middleware -----------------------------------------------------------------------
    async def __call__(self, request: ProxyRequest, next_handler: Handler) -> ProxyResponse:
        if not self.settings.enabled:
            return await next_handler(request)
        info = request.info
        assert info is not None, "the front stage parses RequestInfo"
        user = request.user or ANONYMOUS
        shape = list_shape(request.target) if info.verb in ("list", "watch") else None
        resumes = False
        if shape is not None and info.verb == "watch":
            resumes = shape.resumes
            # one that sends the current state first is costed as the LIST of it; one from a version is not
            shape = None if resumes else shape.watched()
        key = None
        if self.settings.coalesce and shape is not None and request.method == "GET" and request.body is None:
            # identical LISTs or watch-lists of one identity queued together share one upstream stream
            ident = identity_key(user.name, user.groups, user.source, request.headers)
            target = without_timeout(request.target) if info.verb == "watch" else request.target
            key = coalesce_key(request.method, target, request.headers, ident)
        # A token's identity (or its per-address stand-in), else the certificate caller.
        facts = request.identity or as_apiserver_sees(user, request.connection_memo)
        verified = user.source != "token" or request.token_verified
        user_key = (request.caller or unverified_flow(request.peer)) if not verified else None
        impersonators = self.settings.impersonators
        if impersonators and verified and impersonators.trusts(facts.name, facts.groups):
            acting_as = impersonated(request.headers)
            if acting_as is not None:  # classified, queued and capped as whom it acts for, as upstream
                facts = acting_as
                request.caller = acting_as.name
        now = self.clock()
        t, fs, dispatched = self.controller.admit(
            facts, info, now, user_key=user_key, key=key, exempt_ok=verified, shape=shape, single=bool(info.name)
        )
        assert t.level is not None
        pl = t.level.spec
        w = _Waiter(fs, pl, info, metrics.for_pair(fs.name, pl.name), shape, resumes)
        t.payload = w
        request.flow_schema, request.priority_level = fs.name, pl.name
        if t.state == "queued":
            w.future = asyncio.get_running_loop().create_future()
            if self.fleet is not None:
                self._poke(t)  # a leased level takes a seat Lease for it
        self._wake(dispatched)
        if w.future is not None:
            timer = asyncio.get_running_loop().call_later(max(0.0, t.deadline - now), self._timeout, t)
            try:
                await w.future
            except asyncio.CancelledError:
                self._abandon(t)
                raise
            finally:
                timer.cancel()
        outcome = w.outcome or t.state
        if outcome == "rejected":
            metrics.REJECTED.labels(fs.name, pl.name, t.reason or "").inc()
            w.m.wait_rejected.observe(self.clock() - now)
            return too_many_requests(fs, pl, t.reason or "", max(self.settings.retry_after_seconds,
                                                                 retry_after(t.retry_in) if t.retry_in else 0))
        w.m.wait_executed.observe(self.clock() - now)
        w.m.seats.observe(t.seats)
        request.reserved_backend = t.backend
        if outcome == "joined":
            return await self._follow(t, w)
        try:
            response = await next_handler(request)
        except BaseException as exc:
            self._end(t, 0, 0, False, exc)
            raise
        return self._respond(t, w, response, request.connection_id)

    # -- queue events -------------------------------------------------------------------------
    def _wake(self, tickets: list[Ticket]) -> None:
        for d in tickets:
            w = d.payload
            if not isinstance(w, _Waiter):
                continue
            if d.state == "executing":
                w.started = self.clock()
                w.m.dispatched.inc()
                key = (w.fs.name, w.pl.name)
                self.executing_by_schema[key] = self.executing_by_schema.get(key, 0) + 1
                w.counted = True
                if d.level is not None:
                    name = d.level.spec.name
                    self.peak_executing[name] = max(self.peak_executing.get(name, 0), d.level.executing_requests)
            elif d.state == "joined":
                w.m.coalesced.inc()
                w.shared = asyncio.get_running_loop().create_future()
            w.outcome = w.outcome or d.state
            if w.future is not None and not w.future.done():
                w.future.set_result(None)

    def _timeout(self, t: Ticket) -> None:
        w = t.payload
        if (self.controller.timeout(t, self.clock()) and isinstance(w, _Waiter) and w.future is not None
                and not w.future.done()):
            w.outcome = "rejected"
            w.future.set_result(None)

    def _abandon(self, t: Ticket) -> None:
        """The client went away (task cancelled) before its request ran."""
        w = t.payload
        assert isinstance(w, _Waiter)
        w.abandoned = True
        if t.state == "queued":
            self.controller.cancel(t, self.clock())
            metrics.REJECTED.labels(w.fs.name, w.pl.name, "cancelled").inc()
        elif t.state == "executing":
            self._end(t, 0, 0, False, None)

    # -- responses ----------------------------------------------------------------------------
    def _respond(self, t: Ticket, w: _Waiter, response: ProxyResponse, connection: int) -> ProxyResponse:
        response.headers.append(("x-gatekeeper-pf-flowschema", w.fs.name))
        response.headers.append(("x-gatekeeper-pf-prioritylevel", w.pl.name))
        on_first: Callable[[], None] | None = None
        if response.upgraded is not None:
            self._release_seats(t)  # the 101 is the start of the exec/attach/port-forward session
            upgraded = response.upgraded
            inner = upgraded.on_close

            async def on_close() -> None:
                self._end(t, 101, 0, False, None)
                if inner is not None:
                    await inner()

            upgraded.on_close = on_close
            return response
        status = response.status
        until: Callable[[bytes], bool] | None = None
        if w.shape is not None and w.info.verb == "watch":
            if status == 200:  # anything else is an error Status: its end gives the seats back
                until = self._sync(t, w, response.headers).feed
        elif w.resumes:
            self._release_seats(t)  # a watch from a resourceVersion is set up when its response head is out
        elif w.info.long_running:
            # proxy, exec and followed logs: set up at their first bytes; a silent one gets watchInitSeconds
            on_first = functools.partial(self._release_seats, t)
            asyncio.get_running_loop().call_later(self.settings.watch_init_seconds, self._release_seats, t)
        elif w.shape is not None and status == 200:
            encoding = next((v for k, v in response.headers if k == "content-encoding"), "")
            if encoding:  # a LIST the apiserver compressed: learned decoded, not as the client chose to take it
                w.sizer = DecodedSize(encoding)
                until = w.sizer.feed
        if not t.followers:
            if w.shape is not None:  # a LIST or a watch-list
                w.content_type = next((v for k, v in response.headers if k == "content-type"), "")
            if w.shape is not None and self.read_ahead.per_connection and status == 200:
                ahead = ReadAhead(response.body, self.read_ahead, connection, functools.partial(self._end, t, status),
                                  until, self.settings.watch_list_sync_seconds)
                if w.sync is not None:
                    w.sync.blocked = ahead.waiting_for_room
                response.body = ahead
            elif on_first is not None or w.shape is not None:
                # a LIST's size feeds the seat estimate; a watch frees its seats at its first bytes
                response.body = Metered(response.body, functools.partial(self._end, t, status), on_first, until)
        # finish() runs once the response is written out or failed: also the backstop for an unread body.
            response.on_complete.append(lambda err: self._end(t, status, 0, False, err))
            return response

        def pumped(total: int, error: BaseException | None) -> None:
            for timer in fan.timers:
                timer.cancel()
            response.finish(error)
            self._end(t, status, total, fan.complete, error)

        fan = FanOut(
            # a shared watch-list's sync reads the upstream stream, so the leader's seats go back at the bookmark
            Metered(response.body, lambda *_: None, None, until) if until is not None else response.body,
            1 + len(t.followers),
            self.settings.fanout_buffer_bytes,
            pumped,
            self.settings.fanout_stall_seconds,
        )
        for i, f in enumerate(t.followers, start=1):
            fw = f.payload
            sub = fan.subs[i]
            # done: cancelled with its task, whose own cleanup (abandoned) has not run yet
            if not isinstance(fw, _Waiter) or fw.abandoned or fw.shared is None or fw.shared.done():
                sub.close()
                continue
            fw.shared.set_result(ProxyResponse(status=status, headers=list(response.headers), body=sub))
            self._end_share_in_time(fw, sub, fan)
        self._end_share_in_time(w, fan.subs[0], fan)
        return ProxyResponse(status=status, headers=list(response.headers), body=fan.subs[0])

    @staticmethod
    def _end_share_in_time(w: _Waiter, sub: Subscriber, fan: FanOut) -> None:
        """A shared watch ends for each client at its own timeoutSeconds (they differ only there); at most a day
        (an apiserver may end a watch sooner), and the timer goes with the shared stream."""
        if w.shape is not None and w.info.verb == "watch" and w.shape.timeout:
            fan.timers.append(asyncio.get_running_loop().call_later(min(w.shape.timeout, 86_400), sub.close))

    async def _follow(self, t: Ticket, w: _Waiter) -> ProxyResponse:
        assert w.shared is not None
        try:
            return await w.shared
        except asyncio.CancelledError:
            w.abandoned = True
            if w.shared.done() and not w.shared.cancelled() and w.shared.exception() is None:
                body = w.shared.result().body
                if isinstance(body, Subscriber):
                    body.close()
            raise

    def _sync(self, t: Ticket, w: _Waiter, headers: Sequence[tuple[str, str]]) -> WatchListSync:
        """Hold a watch-list's seats until its initial events are sent; learn the collection's size from them."""

        def synced(nbytes: int) -> None:
            if nbytes >= 0 and w.shape is not None:
                self.controller.estimator.observe(w.info.resource, w.info.namespace, nbytes, w.shape)
                metrics.LIST_BYTES.labels(w.info.resource_key).observe(nbytes)
            self._release_seats(t)

        head = dict(headers)
        assert w.shape is not None
        w.sync = WatchListSync(head.get("content-type", ""), head.get("content-encoding", ""),
                               self.settings.watch_list_sync_seconds, w.pl.name, synced,
                               bookmark=w.shape.initial_events, quiet_seconds=self.settings.watch_init_seconds)
        return w.sync

    def _uncount(self, w: _Waiter) -> None:
        """The request no longer counts as executing (ended, or a watch got going)."""
        if w.counted:
            w.counted = False
            key = (w.fs.name, w.pl.name)
            self.executing_by_schema[key] = self.executing_by_schema.get(key, 1) - 1

    def _release_seats(self, t: Ticket) -> None:
        """A watch or an upgraded session stops holding seats while its response goes on."""
        w = t.payload
        if isinstance(w, _Waiter) and not w.seats_released:
            w.seats_released = True
            self._uncount(w)
            w.m.exec_watch.observe(self.clock() - w.started)
            self._wake(self.controller.release_seats(t, self.clock()))
            if self.fleet is not None:
                self._poke(t)

    def _end(
        self, t: Ticket, status: int, nbytes: int, complete: bool, error: BaseException | None, head: bytes = b""
    ) -> None:
        """The upstream exchange is over: free seats, learn the LIST size, fail followers still waiting."""
        w = t.payload
        if not isinstance(w, _Waiter) or w.finished:
            return
        w.finished = True
        if w.sync is not None:
            w.sync.ended()
        self._uncount(w)
        if not w.seats_released:
            w.m.exec_regular.observe(self.clock() - w.started)
        if w.info.verb == "list" and status == 200 and complete:
            if w.sizer is not None and not w.sizer.failed:
                nbytes, head = w.sizer.decoded, w.sizer.head
            shape = w.shape
            continued = continued_response(head, w.content_type) if shape is not None and shape.limit else False
            self.controller.estimator.observe(w.info.resource, w.info.namespace, nbytes, shape, continued)
            metrics.LIST_BYTES.labels(w.info.resource_key).observe(nbytes)
        for f in t.followers:
            fw = f.payload
            if isinstance(fw, _Waiter) and fw.shared is not None and not fw.shared.done():
                # the shared call died before its response head: let client-go retry on its own
                fw.shared.set_result(
                    too_many_requests(fw.fs, fw.pl, "leader-failed", self.settings.retry_after_seconds)
                )
        self._wake(self.controller.finish(t, self.clock()))
        if self.fleet is not None:
            self._poke(t)  # a seat Lease may go back

    def _poke(self, t: Ticket) -> None:
        if t.level is not None and t.level.leased and self.fleet is not None:
            self.fleet.seats.poke(t.level.spec.name)


def from_settings(settings: FlowControlSettings) -> FlowControl | None:
    """The middleware for ``gatekeeper proxy`` (None when ``flowControl.enabled`` is false)."""
    return FlowControl(settings) if settings.enabled else None
