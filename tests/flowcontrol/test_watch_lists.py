"""A watch-list (``sendInitialEvents=true``) is costed and held like the LIST it replaces, against an in-process
apiserver; tests/flowcontrol/test_sandbox_watch_lists.py runs the same against real ones and real informers."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest
from fc_helpers import User, flow_schema, group, queued_level, rr
from prometheus_client import REGISTRY
from test_middleware import Upstream, call, req, until

from gatekeeper.kube import requestinfo
from gatekeeper.proxy.flowcontrol.core.controller import FlowController, LevelLimits
from gatekeeper.proxy.flowcontrol.core.listcost import list_shape
from gatekeeper.proxy.flowcontrol.core.watchstarts import WatchStarts, retry_after
from gatekeeper.proxy.flowcontrol.edge.loading import load_policy
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings, WatchStartSettings
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse

WATCH_LIST = ("/api/v1/secrets?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan"
              "&allowWatchBookmarks=true")
END = {"k8s.io/initial-events-end": "true"}
LEVEL = "secrets"


def event(kind: str, name: str = "", annotations: dict | None = None, size: int = 100) -> bytes:
    meta: dict = {"resourceVersion": "5"}
    if name:
        meta["name"] = name
    if annotations:
        meta["annotations"] = annotations
    obj = {"kind": "Secret", "apiVersion": "v1", "metadata": meta, "data": {"a": "x" * size}}
    return json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n"


INITIAL = [event("ADDED", f"s{i}", size=2000) for i in range(4)]
BOOKMARK = event("BOOKMARK", annotations=END, size=0)


def settings(**kw) -> FlowControlSettings:
    """The seeds' budget of 2, for LISTs and watches of Secrets, as the seeds' policy now says."""
    rules = [{"subjects": [group("*")], "resourceRules": [rr(["list", "watch"], ["secrets"])]}]
    return FlowControlSettings(
        server_concurrency_limit=100,
        priority_level_configurations=[queued_level(LEVEL, 2, queues=16, hand=4), queued_level("catch-all", 98)],
        flow_schemas=[flow_schema(LEVEL, LEVEL, rules, 500, by="ByUser")],
        **kw,
    )


class Apiserver:
    """Watch-lists: the initial events, then the bookmark once ``synced`` is set, then ``later`` events until
    ``closed``. Anything else: a SecretList of ``list_body``."""

    def __init__(self, encoding: str = "", list_body: bytes = b"") -> None:
        self.synced = asyncio.Event()
        self.closed = asyncio.Event()
        self.encoding = encoding
        self.later: asyncio.Queue[bytes] = asyncio.Queue()
        self.sent_bookmark = 0
        self.lists = Upstream(body=list_body or b'{"kind":"SecretList","items":[]}')

    def wire(self, data: bytes) -> bytes:
        return gzip.compress(data) if self.encoding == "gzip" else data

    async def __call__(self, r: ProxyRequest) -> ProxyResponse:
        if r.info is None or r.info.verb != "watch":
            return await self.lists(r)

        async def body():
            for e in INITIAL:
                yield self.wire(e)
            await self.synced.wait()
            yield self.wire(BOOKMARK)
            self.sent_bookmark += 1
            while not self.closed.is_set():
                yield self.wire(await self.later.get())

        headers = [("content-type", "application/json")]
        if self.encoding:
            headers.append(("content-encoding", self.encoding))
        return ProxyResponse(status=200, headers=headers, body=body())


def level(fc: FlowControl):
    return fc.controller.levels[LEVEL]


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_watch_list_costs_what_the_list_of_the_same_collection_costs():
    fc = FlowController(load_policy(settings()), LevelLimits(bytes_per_seat=1000, max_seats=10))
    fc.estimator.observe("secrets", "", 4500)
    listing, _, _ = fc.admit(_user("a"), _info("/api/v1/secrets"), 0.0, shape=list_shape("/api/v1/secrets"))
    watch_list, _, _ = fc.admit(_user("b"), _info(WATCH_LIST), 0.0, shape=list_shape(WATCH_LIST))
    plain = "/api/v1/secrets?watch=1&resourceVersion=5&allowWatchBookmarks=true"
    watch, _, _ = fc.admit(_user("c"), _info(plain), 0.0, shape=None)
    assert watch_list.list_bytes == listing.list_bytes == 4500
    assert watch.list_bytes == 0 and watch.seats == 1


async def test_a_storage_only_watch_list_of_unknown_size_counts_as_expensive():
    fc = FlowController(load_policy(settings()), LevelLimits(storage_only_resources=frozenset({"secrets"})))
    t, _, _ = fc.admit(_user("a"), _info(WATCH_LIST), 0.0, shape=list_shape(WATCH_LIST))
    assert t.unsized


async def test_a_watch_list_holds_its_seats_until_the_bookmark_not_its_first_bytes():
    fc = FlowControl(settings(coalesce=False))
    api = Apiserver()
    resp = await fc(req(target=WATCH_LIST), api)
    it = resp.body.__aiter__()
    assert await it.__anext__() == INITIAL[0]
    await until(lambda: resp.body.buffered == sum(map(len, INITIAL[1:])), "the read ahead to take every ADDED")
    assert level(fc).executing_seats == 1  # events flow, the apiserver is still listing: the seat stays
    api.synced.set()
    await until(lambda: level(fc).executing_seats == 0, "the seat to go back at the bookmark")
    assert level(fc).executing_requests == 1  # still a watch, running without a seat
    rest = [await it.__anext__() for _ in range(len(INITIAL))]
    assert rest[-1] == BOOKMARK  # passed through untouched
    await it.aclose()
    resp.finish(None)
    assert level(fc).executing_requests == 0


async def test_a_slow_readers_watch_list_gives_its_seats_back_once_the_apiserver_sent_the_bookmark():
    fc = FlowControl(settings(coalesce=False))
    api = Apiserver()
    api.synced.set()
    slow = await fc(req(target=WATCH_LIST), api)  # its client reads nothing at all
    await until(lambda: level(fc).executing_seats == 0, "the seats to go back while the client reads nothing")
    others = await asyncio.gather(*(call(fc, req(target="/api/v1/secrets", user=f"u{i}"), api) for i in range(4)))
    assert [s for s, _, _ in others] == [200] * 4
    assert await read_until(slow, BOOKMARK) == b"".join(INITIAL) + BOOKMARK
    await slow.body.aclose()


async def read_until(resp: ProxyResponse, last: bytes) -> bytes:
    out = b""
    async for chunk in resp.body:
        out += chunk
        if out.endswith(last):
            return out
    return out


async def test_the_watch_goes_on_after_the_sync_and_its_end_finishes_the_request():
    fc = FlowControl(settings(coalesce=False))
    api = Apiserver()
    api.synced.set()
    resp = await fc(req(target=WATCH_LIST), api)
    assert await read_until(resp, BOOKMARK) == b"".join(INITIAL) + BOOKMARK
    assert resp.body.handed_over and resp.body.buffered == 0  # no read ahead for the rest of the watch
    later = event("MODIFIED", "s1")
    api.later.put_nowait(later)
    assert await resp.body.__anext__() == later
    await resp.body.aclose()
    resp.finish(None)
    assert level(fc).executing_requests == 0 and level(fc).executing_seats == 0


async def test_a_gzip_watch_list_is_read_inside_its_gzip_and_teaches_the_collection_size_decoded():
    fc = FlowControl(settings(coalesce=False))
    api = Apiserver(encoding="gzip")
    api.synced.set()
    before = value("gatekeeper_flowcontrol_watch_list_syncs_total", priority_level=LEVEL, outcome="bookmark")
    resp = await fc(req(target=WATCH_LIST), api)
    await until(lambda: level(fc).executing_seats == 0, "the bookmark inside gzip to end the sync")
    # decoded: a client that takes gzip must not pull the shared estimate down
    assert fc.controller.estimator.list_bytes("secrets", "") == sum(map(len, INITIAL)) + len(BOOKMARK)
    assert value("gatekeeper_flowcontrol_watch_list_syncs_total", priority_level=LEVEL, outcome="bookmark") == \
        before + 1
    await resp.body.aclose()


async def test_a_watch_list_whose_bookmark_never_comes_holds_its_seats_at_most_watch_list_sync_seconds():
    fc = FlowControl(settings(coalesce=False, watch_list_sync_seconds=0.3))
    api = Apiserver()  # never syncs
    resp = await fc(req(target=WATCH_LIST), api)
    await until(lambda: resp.body.buffered > 0, "the initial events")
    assert level(fc).executing_seats == 1
    t0 = asyncio.get_running_loop().time()
    await until(lambda: level(fc).executing_seats == 0, "watchListSyncSeconds to end the hold")
    assert asyncio.get_running_loop().time() - t0 >= 0.2
    assert fc.controller.estimator.list_bytes("secrets", "") == 0  # nothing learnt from a sync that did not end
    await resp.body.aclose()


async def test_a_watch_list_in_a_format_it_cannot_read_is_held_until_the_apiserver_goes_quiet():
    fc = FlowControl(settings(coalesce=False, watch_list_sync_seconds=30, watch_init_seconds=0.3))
    before = value("gatekeeper_flowcontrol_watch_list_syncs_total", priority_level=LEVEL, outcome="quiet")
    more = asyncio.Event()

    async def cbor(r: ProxyRequest) -> ProxyResponse:
        async def body():
            yield b"\xd9\xd9\xf7" + BOOKMARK  # whatever it says, it is not parsed
            await more.wait()
            yield b"\xa1" * 100  # more of the state, 0.2 s later
            await asyncio.sleep(30)
            yield b""

        return ProxyResponse(status=200, headers=[("content-type", "application/cbor-seq")], body=body())

    resp = await fc(req(target=WATCH_LIST), cbor)
    await asyncio.sleep(0.2)
    more.set()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await until(lambda: level(fc).executing_seats == 0, "0.3 s of quiet to end the hold", limit=3)
    assert loop.time() - t0 >= 0.25  # counted from the last bytes, not from the head
    assert value("gatekeeper_flowcontrol_watch_list_syncs_total", priority_level=LEVEL, outcome="quiet") == \
        before + 1
    await resp.body.aclose()


async def test_a_watch_without_a_resource_version_is_costed_and_held_as_the_state_it_sends():
    """No sendInitialEvents and no resourceVersion (or one the apiserver reads as 0, like "00"): it streams every
    existing object first, as a LIST would, and marks no end, so it holds the LIST's seats until quiet."""
    fc = FlowControl(settings(coalesce=False, watch_init_seconds=0.3, bytes_per_seat=1000, max_seats=10))
    fc.controller.estimator.observe("secrets", "", 4500)
    api = Apiserver()
    for target in ("/api/v1/secrets?watch=1", "/api/v1/secrets?watch=1&resourceVersion=00&limit=1"):
        resp = await fc(req(target=target), api)
        assert fc.controller.levels[LEVEL].executing_seats == 1  # the level's cap of 1 seat per request
        assert fc.controller.budget.used == 4500  # the LIST's bytes, limit=1 notwithstanding
        await until(lambda r=resp: r.body.buffered == sum(map(len, INITIAL)), "the state read ahead")
        await until(lambda: level(fc).executing_seats == 0, "the quiet after the state to end the hold")
        await resp.body.aclose()
        resp.finish(None)


async def test_a_watch_from_a_resource_version_frees_its_seat_at_the_response_head():
    """It sends no existing objects, so the apiserver's work is done once the watch is set up."""
    fc = FlowControl(settings(coalesce=False, watch_init_seconds=30))

    async def silent(r: ProxyRequest) -> ProxyResponse:
        async def body():
            await asyncio.sleep(30)
            yield b""

        return ProxyResponse(status=200, headers=[("content-type", "application/json")], body=body())

    resp = await fc(req(target="/api/v1/secrets?watch=1&resourceVersion=42&allowWatchBookmarks=true"), silent)
    assert level(fc).executing_seats == 0 and level(fc).executing_requests == 1
    await resp.body.aclose()
    resp.finish(None)


async def test_a_queued_watch_list_times_out_with_a_429_and_retry_after():
    fc = FlowControl(settings(coalesce=False, queue_wait_seconds=0.2))
    api = Apiserver()  # holds both seats: never syncs
    held = [await fc(req(target=WATCH_LIST, user=f"u{i}"), api) for i in range(2)]
    status, data, headers = await call(fc, req(target=WATCH_LIST, user="late"), api)
    assert status == 429 and headers["retry-after"] == "1" and b"waited in the queue" in data
    for r in held:
        await r.body.aclose()


async def test_a_flow_that_starts_watches_too_fast_gets_429_with_the_wait_and_others_do_not():
    limit = WatchStartSettings(per_flow_per_second=0.5, burst=3)
    fc = FlowControl(settings(coalesce=False, watch_starts=limit))
    before = value("gatekeeper_flowcontrol_rejected_requests_total", flow_schema=LEVEL, priority_level=LEVEL,
                   reason="watch-rate")
    api = Apiserver()
    api.synced.set()
    plain = "/api/v1/secrets?watch=1&resourceVersion=5&allowWatchBookmarks=true"
    started = [await fc(req(target=plain, user="busy"), api) for _ in range(3)]
    status, data, headers = await call(fc, req(target=plain, user="busy"), api)
    assert status == 429 and b"watchStarts" in data
    assert headers["retry-after"] == "2"  # one token at 0.5/s
    assert value("gatekeeper_flowcontrol_rejected_requests_total", flow_schema=LEVEL, priority_level=LEVEL,
                 reason="watch-rate") == before + 1
    other = await fc(req(target=plain, user="quiet"), api)  # another flow has its own bucket
    assert other.status == 200
    assert (await call(fc, req(target="/api/v1/secrets", user="busy"), api))[0] == 200  # LISTs are not watches
    for r in [*started, other]:
        await r.body.aclose()


def test_watch_start_buckets_refill_and_stay_bounded():
    ws = WatchStarts(rate=2.0, burst=2, max_flows=100)
    assert [ws.take(1, 0.0) for _ in range(3)] == [0.0, 0.0, 0.5]
    assert ws.take(1, 0.5) == 0.0  # refilled one token at 2/s (the refused start took none)
    for flow in range(1000):
        ws.take(1000 + flow, 1.0)
    assert len(ws) <= 100
    assert retry_after(0.01) == 1 and retry_after(2.2) == 3
    off = WatchStarts(rate=0.0, burst=1, max_flows=1)
    assert all(off.take(7, 0.0) == 0.0 for _ in range(100)) and len(off) == 0


def _user(name: str) -> User:
    return User(name, ["system:authenticated"])


def _info(target: str) -> requestinfo.RequestInfo:
    return requestinfo.parse("GET", target)


def test_a_watch_list_and_a_list_read_the_same_rules_of_the_seeds_policy():
    """deploy/examples/flowcontrol-seeds.yaml covers list and watch of Secrets and ConfigMaps, as upstream matches."""
    seeds = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "flowcontrol-seeds.yaml"
    fc = FlowControl(FlowControlSettings(files=[str(seeds)]))
    for target in ("/api/v1/secrets", WATCH_LIST, "/api/v1/namespaces/a/configmaps",
                   "/api/v1/namespaces/a/configmaps?watch=1&sendInitialEvents=true"):
        schema, lvl = fc.controller.classify(_user("t"), _info(target))
        assert (schema.name, lvl.name) == ("secrets-list", "secrets-list"), target


async def test_identical_queued_watch_lists_of_one_identity_share_one_upstream_stream():
    fc = FlowControl(settings())
    api = Apiserver()
    blockers = [await fc(req(target=WATCH_LIST, user=f"b{i}"), api) for i in range(2)]  # both seats, never synced
    same = [asyncio.create_task(fc(req(target=WATCH_LIST, user="alice"), api)) for _ in range(4)]
    await until(lambda: level(fc).waiting == 4, "alice's four watch-lists to queue")
    for b in blockers:
        await b.body.aclose()
        b.finish(None)
    responses = await asyncio.gather(*same)
    assert api.lists.calls == 0 and level(fc).executing_requests == 1  # one upstream watch-list for the four
    api.synced.set()
    bodies = await asyncio.gather(*(read_until(r, BOOKMARK) for r in responses))
    assert bodies == [b"".join(INITIAL) + BOOKMARK] * 4
    await until(lambda: level(fc).executing_seats == 0, "the shared sync to give the seat back at the bookmark")
    later = event("MODIFIED", "s2")
    api.later.put_nowait(later)
    assert [await r.body.__anext__() for r in responses] == [later] * 4  # the watch goes on for every client
    for r in responses:
        await r.body.aclose()
        r.finish(None)
    await until(lambda: level(fc).executing_requests == 0, "the shared watch to end with its last client")


async def test_watch_lists_differing_only_in_timeout_seconds_share_and_each_ends_at_its_own():
    """client-go picks a random timeoutSeconds per watch: the share ignores it, and ends each client's at its own."""
    fc = FlowControl(settings())
    api, stuck = Apiserver(), Apiserver()
    api.synced.set()
    blockers = [await fc(req(target=WATCH_LIST, user=f"b{i}"), stuck) for i in range(2)]  # hold both seats
    targets = [f"{WATCH_LIST}&timeout={t // 60}m{t % 60}s&timeoutSeconds={t}" for t in (600, 1, 450)]
    shared = [asyncio.create_task(fc(req(target=t, user="alice"), api)) for t in targets]
    await until(lambda: level(fc).waiting == 3, "alice's three watch-lists to queue")
    for b in blockers:
        await b.body.aclose()
        b.finish(None)
    responses = await asyncio.gather(*shared)
    assert level(fc).executing_requests == 1  # one upstream watch for the three
    bodies = await asyncio.wait_for(asyncio.gather(*(read_until(r, BOOKMARK) for r in responses)), 5)
    assert bodies == [b"".join(INITIAL) + BOOKMARK] * 3
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(responses[1].body.__anext__(), 3)  # the 1 s one ends first, cleanly
    assert loop.time() - t0 < 2
    later = event("MODIFIED", "s3")
    api.later.put_nowait(later)
    assert [await responses[i].body.__anext__() for i in (0, 2)] == [later, later]  # the others go on
    for r in responses:
        await r.body.aclose()
        r.finish(None)


def test_a_watch_list_with_a_limit_is_costed_as_the_whole_collection_it_streams():
    """The apiserver streams every object of a watch whatever ``limit`` says: ``&limit=1`` must not make a
    watch-list a one-object page (one seat, below expensiveLists.minBytes, outside listBytesCap)."""
    fc = FlowController(load_policy(settings()), LevelLimits(bytes_per_seat=1000, max_seats=10))
    fc.estimator.observe("secrets", "", 45_000)
    fc.estimator.observe("secrets", "", 1000, list_shape("/api/v1/secrets?limit=10"), True)  # 100 B per object
    full, _, _ = fc.admit(_user("a"), _info(WATCH_LIST), 0.0, shape=list_shape(WATCH_LIST).watched())
    target = WATCH_LIST + "&limit=1"
    limited, _, _ = fc.admit(_user("b"), _info(target), 0.0, shape=list_shape(target).watched())
    assert (limited.seats, limited.list_bytes) == (full.seats, full.list_bytes)
    assert full.list_bytes == 45_000  # the collection, not one 100-byte object


async def _two_shared(fc: FlowControl, target: str, api: Apiserver) -> list:
    stuck = Apiserver()
    blockers = [await fc(req(target=WATCH_LIST, user=f"b{i}"), stuck) for i in range(2)]
    shared = [asyncio.create_task(fc(req(target=target, user="mallory"), api)) for _ in range(2)]
    await until(lambda: level(fc).waiting == 2, "the two watch-lists to queue")
    for b in blockers:
        await b.body.aclose()
        b.finish(None)
    return await asyncio.gather(*shared, return_exceptions=True)


async def test_a_shared_watch_leaves_no_timer_behind_and_an_absurd_timeout_is_no_error():
    """A tenant's shared watch-lists asking timeoutSeconds=10**9 (or 400 digits): once the shared watch ends,
    none of its timers stays in the event loop, and a huge value is not an OverflowError out of the middleware."""
    fc = FlowControl(settings())
    loop = asyncio.get_running_loop()
    for timeout in (10**9, int("9" * 400)):
        api = Apiserver()
        api.synced.set()
        responses = await _two_shared(fc, f"{WATCH_LIST}&timeoutSeconds={timeout}", api)
        assert not any(isinstance(r, BaseException) for r in responses), responses
        assert level(fc).executing_requests == 1  # shared
        await asyncio.gather(*(read_until(r, BOOKMARK) for r in responses))
        for r in responses:
            await r.body.aclose()
            r.finish(None)
        await until(lambda: level(fc).executing_requests == 0, "the shared watch to end with its clients")
        pending = [h for h in loop._scheduled if not h.cancelled()  # type: ignore[attr-defined]
                   and "Subscriber" in repr(getattr(h, "_callback", ""))]
        assert not pending, pending


async def test_idle_watch_list_clients_do_not_hold_the_read_ahead_budget_for_their_whole_life():
    """The initial events read ahead for a client that never reads them are let go (and its stream cut) after
    watchListSyncSeconds: a watch has no deadline, and the worker's budget serves every tenant's LISTs."""
    fc = FlowControl(settings(coalesce=False, read_ahead_bytes=18_000, read_ahead_bytes_per_connection=10_000,
                              watch_list_sync_seconds=0.5))
    api = Apiserver()
    api.synced.set()
    idle = []
    for i in range(2):
        r = req(target=WATCH_LIST, user="mallory")
        r.connection_id = 100 + i
        idle.append(await fc(r, api))
    await until(lambda: level(fc).executing_seats == 0, "the idle watch-lists' syncs to end")
    assert fc.read_ahead.held > 0
    await until(lambda: fc.read_ahead.held == 0, "the unread initial events to be let go", limit=3)
    with pytest.raises(ConnectionError, match="did not read"):
        await idle[0].body.__anext__()
    r = req(target="/api/v1/secrets", user="victim")
    r.connection_id = 200
    big = Apiserver(list_body=b"y" * 8000)
    slow_list = await fc(r, big.lists)  # its client reads nothing yet: the read ahead takes it
    await until(lambda: level(fc).executing_seats == 0, "the LIST's seat to go back once the apiserver sent it")
    await slow_list.body.aclose()
    for resp in idle:
        await resp.body.aclose()


async def test_a_gzip_list_teaches_its_decoded_size_whatever_encoding_the_client_took():
    fc = FlowControl(settings(coalesce=False))
    plain = b'{"kind":"SecretList","metadata":{},"items":[' + b'{"a":"aaaa"},' * 2000 + b'{}]}'

    async def gzipped(r: ProxyRequest) -> ProxyResponse:
        data = gzip.compress(plain)

        async def body():
            for i in range(0, len(data), 512):
                yield data[i:i + 512]

        return ProxyResponse(status=200, headers=[("content-type", "application/json"),
                                                  ("content-encoding", "gzip")], body=body())

    status, data, _ = await call(fc, req(target="/api/v1/secrets"), gzipped)
    assert status == 200 and gzip.decompress(data) == plain  # the client gets the gzip bytes, untouched
    assert fc.controller.estimator.list_bytes("secrets", "") == len(plain)


async def test_watch_starts_are_limited_per_caller_even_where_the_schema_has_no_distinguisher():
    """One flow for everyone (no distinguisher): one caller's burst must not 429 the others' watches."""
    shared = flow_schema(LEVEL, LEVEL, [{"subjects": [group("*")], "resourceRules": [rr(["watch"], ["secrets"])]}],
                         500)
    fc = FlowControl(FlowControlSettings(
        server_concurrency_limit=100, flow_schemas=[shared],
        priority_level_configurations=[queued_level(LEVEL, 2), queued_level("catch-all", 98)],
        watch_starts=WatchStartSettings(per_flow_per_second=0.1, burst=2)))
    api = Apiserver()
    plain = "/api/v1/secrets?watch=1&resourceVersion=5"
    mine = [await fc(req(target=plain, user="greedy"), api) for _ in range(3)]
    assert [r.status for r in mine] == [200, 200, 429]
    theirs = await fc(req(target=plain, user="other"), api)
    assert theirs.status == 200
    for r in [*mine[:2], theirs]:
        await r.body.aclose()
