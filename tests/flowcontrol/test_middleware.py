"""The asyncio middleware against an in-process upstream: limits, 429s, coalescing fan-out, watches, reloads.

These are fast and deterministic; the same behaviours are checked against real
apiservers in test_sandbox_storm.py.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import yaml
from fc_helpers import flow_schema, group, queued_level, rr, secrets_list_schema

from gatekeeper.base.config import ConfigError, load_config
from gatekeeper.kube import requestinfo
from gatekeeper.proxy.flowcontrol.edge.loading import load_policy
from gatekeeper.proxy.flowcontrol.edge.middleware import FlowControl
from gatekeeper.proxy.flowcontrol.edge.readahead import ReadAheadBudget
from gatekeeper.proxy.flowcontrol.settings import FlowControlSettings
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse, UserInfo

SECRETS = "/api/v1/secrets?limit=500"


def seeds_settings(**kw) -> FlowControlSettings:
    objs = {
        "priority_level_configurations": [
            queued_level("secrets-list", 2, queues=16, hand=4),
            queued_level("catch-all", 98),
        ],
        "flow_schemas": [secrets_list_schema(by="ByUser")],
    }
    objs.update(kw)
    return FlowControlSettings(server_concurrency_limit=100, **objs)


def req(target=SECRETS, user="alice", headers=None, method="GET") -> ProxyRequest:
    r = ProxyRequest(
        method=method,
        target=target,
        headers=headers or [("accept", "application/json")],
        body=None,
        protocol="h2",
    )
    r.user = UserInfo(name=user, groups=["system:authenticated"], source="x509")
    r.info = requestinfo.parse(method, target)
    return r


class Upstream:
    """A fake apiserver: counts calls and concurrency, answers after ``gate`` opens, body in chunks."""

    def __init__(self, body: bytes = b'{"kind":"SecretList","items":[]}', chunks: int = 4):
        self.body, self.chunks = body, chunks
        self.calls = 0
        self.running = 0
        self.peak = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, request: ProxyRequest) -> ProxyResponse:
        self.calls += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        await self.gate.wait()
        size = max(1, len(self.body) // self.chunks)
        parts = [self.body[i : i + size] for i in range(0, len(self.body), size)]

        async def body():
            try:
                for p in parts:
                    await asyncio.sleep(0)
                    yield p
            finally:
                self.running -= 1

        return ProxyResponse(status=200, headers=[("content-type", "application/json")], body=body())


async def until(cond, what: str, limit: float = 5.0) -> None:
    """Yield to the event loop until ``cond()`` holds; fail naming ``what`` after ``limit`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {limit}s waiting for {what}")
        await asyncio.sleep(0)


async def read(resp: ProxyResponse) -> bytes:
    return b"".join([c async for c in resp.body])


async def call(fc, r, up) -> tuple[int, bytes, dict]:
    resp = await fc(r, up)
    data = await read(resp)
    resp.finish(None)
    return resp.status, data, dict(resp.headers)


async def test_seeds_policy_never_runs_more_than_two_secret_lists():
    fc = FlowControl(seeds_settings(coalesce=False))
    up = Upstream(body=b"x" * 10000)
    results = await asyncio.gather(*(call(fc, req(user=f"u{i % 5}"), up) for i in range(20)))
    assert [s for s, _, _ in results] == [200] * 20
    assert all(d == up.body for _, d, _ in results)
    assert up.peak == 2 and up.calls == 20
    assert fc.peak_executing["secrets-list"] == 2
    assert fc.controller.levels["secrets-list"].executing_requests == 0


async def test_rejection_is_a_kubernetes_429_naming_schema_and_level():
    reject = queued_level("secrets-list", 1)
    reject["spec"]["limited"]["limitResponse"] = {"type": "Reject"}
    fc = FlowControl(seeds_settings(priority_level_configurations=[reject, queued_level("catch-all", 99)]))
    up = Upstream()
    up.gate.clear()
    first = asyncio.create_task(call(fc, req(), up))
    await until(lambda: up.calls == 1, "the first LIST to hold the only seat")
    status, data, headers = await call(fc, req(user="bob"), up)
    assert status == 429
    assert headers["retry-after"] == "1"
    body = json.loads(data)
    assert (body["kind"], body["apiVersion"], body["status"], body["reason"], body["code"]) == (
        "Status",
        "v1",
        "Failure",
        "TooManyRequests",
        429,
    )
    assert "secrets-list" in body["message"] and body["details"]["retryAfterSeconds"] == 1
    assert headers["x-gatekeeper-pf-flowschema"] == "secrets-list"
    assert headers["x-gatekeeper-pf-prioritylevel"] == "secrets-list"
    uid = fc.controller.policy.levels["secrets-list"].uid
    assert headers["x-kubernetes-pf-prioritylevel-uid"] == uid and headers["x-kubernetes-pf-flowschema-uid"]
    up.gate.set()
    assert (await first)[0] == 200


async def test_queued_request_times_out_with_429():
    fc = FlowControl(seeds_settings(queue_wait_seconds=0.2, coalesce=False))
    up = Upstream()
    up.gate.clear()
    running = [asyncio.create_task(call(fc, req(user=f"u{i}"), up)) for i in range(2)]
    await until(lambda: up.calls == 2, "two LISTs to hold both seats")
    status, data, _ = await call(fc, req(user="late"), up)
    assert status == 429 and b"waited in the queue" in data
    up.gate.set()
    assert [(await t)[0] for t in running] == [200, 200]


async def test_identical_queued_lists_share_one_upstream_call():
    fc = FlowControl(seeds_settings())
    up = Upstream(body=b"y" * 50000, chunks=10)
    up.gate.clear()
    blockers = [asyncio.create_task(call(fc, req(target=f"/api/v1/namespaces/n{i}/secrets"), up)) for i in range(2)]
    await until(lambda: up.calls == 2, "two blockers to hold both seats")
    same = [asyncio.create_task(call(fc, req(user="alice"), up)) for _ in range(8)]
    other = [asyncio.create_task(call(fc, req(user="bob"), up)) for _ in range(3)]
    level = fc.controller.levels["secrets-list"]
    await until(lambda: level.waiting == 11, "all 11 LISTs to queue")
    assert up.calls == 2
    up.gate.set()
    results = await asyncio.gather(*blockers, *same, *other)
    assert all(s == 200 and d == up.body for s, d, _ in results)
    # 2 blockers + one call for alice's 8 + one for bob's 3: identities are never merged
    assert up.calls == 4


async def _coalesced_trio(fc, up):
    """Two blockers occupy the level, then three identical LISTs queue and share one upstream call."""
    up.gate.clear()
    blockers = [asyncio.create_task(call(fc, req(target=f"/api/v1/namespaces/n{i}/secrets"), up)) for i in range(2)]
    await until(lambda: up.calls == 2, "two blockers to hold both seats")
    waiting = [asyncio.create_task(fc(req(), up)) for _ in range(3)]
    level = fc.controller.levels["secrets-list"]
    await until(lambda: level.waiting == 3, "three identical LISTs to queue")
    up.gate.set()
    await asyncio.gather(*blockers)
    return await asyncio.gather(*waiting)


async def test_stuck_coalesced_reader_is_cut_off_and_others_finish():
    fc = FlowControl(seeds_settings(fanout_buffer_bytes=4096, fanout_stall_seconds=0.3))
    up = Upstream(body=b"z" * 200_000, chunks=100)
    responses = await _coalesced_trio(fc, up)
    assert up.calls == 3  # 2 blockers + 1 shared call
    stuck = responses[0].body.__aiter__()
    await stuck.__anext__()  # reads one chunk, then stops reading
    t0 = asyncio.get_running_loop().time()
    bodies = await asyncio.wait_for(asyncio.gather(*(read(r) for r in responses[1:])), 5)
    assert all(b == up.body for b in bodies)
    assert asyncio.get_running_loop().time() - t0 >= 0.3  # the others waited for the stuck one, boundedly
    with pytest.raises(ConnectionError, match="too slowly"):
        while True:
            await stuck.__anext__()
    assert fc.controller.levels["secrets-list"].executing_seats == 0


async def test_slower_coalesced_reader_is_paced_not_cut_off():
    fc = FlowControl(seeds_settings(fanout_buffer_bytes=4096, fanout_stall_seconds=2))
    up = Upstream(body=b"q" * 100_000, chunks=50)
    responses = await _coalesced_trio(fc, up)

    async def slow(resp):
        out = []
        async for c in resp.body:
            out.append(c)
            await asyncio.sleep(0.002)
        return b"".join(out)

    bodies = await asyncio.wait_for(asyncio.gather(slow(responses[0]), *(read(r) for r in responses[1:])), 10)
    assert all(b == up.body for b in bodies)


async def test_list_seats_grow_from_observed_response_size():
    fc = FlowControl(seeds_settings(bytes_per_seat=1000, max_seats=10))
    up = Upstream(body=b"s" * 4500)
    await call(fc, req(), up)
    est = fc.controller.estimator.estimate("list", "secrets", "")
    assert (est.list_bytes, est.seats) == (4500, 5)


def _watch_setup(**kw):
    level = {
        "priority_level_configurations": [queued_level("w", 1), queued_level("catch-all", 99)],
        "flow_schemas": [
            flow_schema("w", "w", [{"subjects": [group("*")], "resourceRules": [rr(["watch", "list"], ["secrets"])]}])
        ],
    }
    fc = FlowControl(seeds_settings(**level, **kw))
    up = Upstream()
    stream = asyncio.Event()

    async def handler(r: ProxyRequest) -> ProxyResponse:
        if r.info and r.info.verb == "watch":

            async def events():
                await stream.wait()
                yield b'{"type":"ADDED"}\n'

            return ProxyResponse(status=200, headers=[], body=events())
        return await up(r)

    return fc, handler, stream


async def test_silent_watch_holds_its_seat_at_most_watch_init_seconds():
    fc, handler, _stream = _watch_setup(watch_init_seconds=0.2)
    watch = await fc(req(target="/api/v1/secrets?watch=true"), handler)
    t0 = asyncio.get_running_loop().time()
    status, _, _ = await asyncio.wait_for(call(fc, req(user="bob"), handler), 5)
    assert status == 200 and asyncio.get_running_loop().time() - t0 >= 0.15
    assert fc.controller.levels["w"].executing_seats == 0
    await watch.body.aclose()


async def test_policy_file_reload_applies_good_and_keeps_running_on_bad(tmp_path, caplog):
    path = tmp_path / "flows.yaml"
    path.write_text(
        yaml.safe_dump_all(
            [
                queued_level("secrets-list", 2),
                secrets_list_schema(),
            ]
        )
    )
    fc = FlowControl(FlowControlSettings(server_concurrency_limit=100, files=[str(path)]))
    assert fc.controller.policy.limits["secrets-list"] == 29  # ceil(100 * 2 / 7)
    path.write_text(
        yaml.safe_dump_all(
            [
                queued_level("secrets-list", 95),
                secrets_list_schema(),
            ]
        )
    )
    assert fc.reloader.check()
    assert fc.controller.levels["secrets-list"].limit == 95
    path.write_text(
        "kind: FlowSchema\napiVersion: flowcontrol.apiserver.k8s.io/v1\nmetadata: {name: x}\n"
        "spec: {matchingPrecedence: 0, priorityLevelConfiguration: {name: catch-all}}\n"
    )
    with caplog.at_level(logging.ERROR):
        assert not fc.reloader.reload()
    assert "keeping the running policy" in caplog.text and "FlowSchema/x: spec.matchingPrecedence" in caplog.text
    assert str(path) in caplog.text
    assert fc.controller.levels["secrets-list"].limit == 95


async def test_sighup_rereads_policy_files(tmp_path):
    import os
    import signal

    path = tmp_path / "flows.yaml"
    path.write_text(yaml.safe_dump_all([queued_level("secrets-list", 2)]))
    fc = FlowControl(FlowControlSettings(server_concurrency_limit=100, files=[str(path)], reload_interval_seconds=0))
    await fc.start()
    try:
        assert fc.controller.levels["secrets-list"].limit == 29
        path.write_text(yaml.safe_dump_all([queued_level("secrets-list", 45)]))
        # A real SIGHUP with no handler installed would end the whole pytest process.
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN, None), (
            "FlowControl.start() installed no SIGHUP handler"
        )
        os.kill(os.getpid(), signal.SIGHUP)
        # ceil(100 * 45 / 50); a reload replaces the levels, so look them up afresh each time
        await until(lambda: fc.controller.levels["secrets-list"].limit == 90, "the SIGHUP reload")
    finally:
        await fc.close()


async def test_client_leaving_mid_body_or_while_queued_frees_everything():
    fc = FlowControl(seeds_settings(coalesce=False))
    level = fc.controller.levels["secrets-list"]
    up = Upstream(body=b"x" * 1000, chunks=10)
    resp = await fc(req(), up)
    it = resp.body.__aiter__()
    await it.__anext__()
    up.gate.clear()
    blocker = asyncio.create_task(fc(req(user="b"), up))
    await until(lambda: up.calls == 2, "the blocker to hold the second seat")
    queued = asyncio.create_task(fc(req(user="c"), up))
    await until(lambda: level.waiting == 1, "the third LIST to queue")
    assert level.waiting == 1 and level.executing_requests == 2
    queued.cancel()  # the client went away while waiting
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert level.waiting == 0
    await it.aclose()  # the client reset the stream mid-body
    resp.finish(ConnectionError("client gone"))
    assert level.executing_requests == 1
    up.gate.set()
    await read(await blocker)
    assert level.executing_requests == 0 and level.executing_seats == 0


async def test_plain_get_holds_its_seat_until_the_response_is_finished():
    one_seat = queued_level("secrets-list", 1, queues=4, hand=1)
    getter = flow_schema("gets", "secrets-list", [{"subjects": [group("*")], "resourceRules": [rr(["get"], ["*"])]}])
    fc = FlowControl(
        seeds_settings(
            priority_level_configurations=[one_seat, queued_level("catch-all", 99)],  # ceil(100 * 1 / 100) = 1
            flow_schemas=[getter],
        )
    )
    level = fc.controller.levels["secrets-list"]
    up = Upstream(body=b"{}")
    first = await fc(req("/api/v1/namespaces/a/secrets/x"), up)
    assert await read(first) == b"{}"  # body read to its end, response not yet written out
    second = asyncio.create_task(fc(req("/api/v1/namespaces/a/secrets/y", user="bob"), up))
    await until(lambda: level.waiting == 1, "the second GET to queue")
    assert level.waiting == 1 and not second.done()
    first.finish(None)  # the adapter wrote it out: the seat is free
    resp = await asyncio.wait_for(second, 5)
    assert await read(resp) == b"{}"
    resp.finish(None)
    assert level.idle and level.executing_seats == 0


class _LastChunkMarked:
    """An upstream body that, like upstream.exchange.StreamedBody, marks its final chunk and is never read past it."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts, self.exhausted = parts, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if not self.parts:
            raise StopAsyncIteration
        chunk = self.parts.pop(0)
        self.exhausted = not self.parts
        return chunk


async def test_list_size_is_learnt_when_h2_stops_at_the_marked_last_chunk():
    fc = FlowControl(seeds_settings())

    async def handler(r: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(status=200, headers=[], body=_LastChunkMarked([b"a" * 300, b"b" * 200]))

    resp = await fc(req(), handler)
    got = []
    async for chunk in resp.body:  # what the h2 adapter does: stop after the marked chunk
        got.append(chunk)
        if getattr(resp.body, "exhausted", False) is True:
            break
    assert b"".join(got) == b"a" * 300 + b"b" * 200
    assert getattr(resp.body, "exhausted", None) is True  # the mark reaches the adapter through flow control
    resp.finish(None)
    assert fc.controller.estimator.list_bytes("secrets", "") == 500


def test_reload_reclassifies_requests_the_old_policy_remembered():
    fc = FlowControl(seeds_settings())
    alice = UserInfo(name="alice", groups=["system:authenticated"], source="x509")
    info = requestinfo.parse("GET", SECRETS)
    assert fc.controller.classify(alice, info)[0].name == "secrets-list"
    assert fc.controller.classify(alice, info)[0].name == "secrets-list"  # from the memo
    fc.apply(load_policy(seeds_settings(flow_schemas=[])))
    assert fc.controller.classify(alice, info)[0].name == "catch-all"


async def test_a_slow_readers_list_gives_its_seats_back_once_the_apiserver_has_sent_it_all():
    """An HTTP/2 client can open its window a byte at a time (never stalled long enough to be cut): its LIST
    held the level's seats for as long as it kept reading. The seat protects the apiserver, which is done once
    it has sent the last byte: the proxy reads the LIST ahead and gives the seats back then."""
    fc = FlowControl(seeds_settings(coalesce=False))
    up = Upstream(body=b"s" * 4000, chunks=4)
    slow = await fc(req(), up)
    level = fc.controller.levels["secrets-list"]
    first = await slow.body.__anext__()  # reads a little, then nothing for a while
    await until(lambda: level.executing_seats == 0, "the slow reader's seats to be given back")
    assert fc.read_ahead.held == 3000  # the rest waits in the proxy, not in the apiserver
    # others run meanwhile, and the slow client still gets all of its response
    assert (await asyncio.wait_for(call(fc, req(user="bob"), up), 5))[0] == 200
    rest = await read(slow)
    slow.finish(None)
    assert first + rest == up.body
    assert fc.read_ahead.held == 0 and fc.read_ahead.by_connection == {}
    assert level.executing_seats == 0 and fc.executing_by_schema[("secrets-list", "secrets-list")] == 0
    assert fc.controller.estimator.list_bytes("secrets", "") == 4000  # the size still feeds the estimate


async def test_past_its_read_ahead_budget_a_list_keeps_its_seats_until_its_client_catches_up():
    """The proxy's memory has its own bound: past readAheadBytesPerConnection it stops reading upstream, so
    the apiserver (still writing) keeps the request's seats."""
    fc = FlowControl(seeds_settings(coalesce=False, read_ahead_bytes_per_connection=1500))
    up = Upstream(body=b"s" * 4000, chunks=4)
    slow = await fc(req(), up)
    level = fc.controller.levels["secrets-list"]
    first = await slow.body.__anext__()
    for _ in range(50):
        await asyncio.sleep(0)
    assert fc.read_ahead.held <= 1500 and level.executing_seats >= 1
    rest = await read(slow)
    slow.finish(None)
    assert first + rest == up.body and level.executing_seats == 0 and fc.read_ahead.held == 0


async def test_without_read_ahead_a_slow_reader_holds_its_seats_until_it_has_taken_its_response():
    """``readAheadBytesPerConnection: 0`` is the other design, measured beside the read ahead
    (docs/proxy/deadline.md): the seats stay until the response is written out, or the deadline."""
    fc = FlowControl(seeds_settings(coalesce=False, read_ahead_bytes_per_connection=0))
    up = Upstream(body=b"s" * 4000, chunks=4)
    slow = await fc(req(), up)
    level = fc.controller.levels["secrets-list"]
    await slow.body.__anext__()
    for _ in range(50):
        await asyncio.sleep(0)
    assert level.executing_seats >= 1 and fc.read_ahead.held == 0
    await read(slow)
    slow.finish(None)
    assert level.executing_seats == 0


async def test_a_client_gone_mid_read_ahead_gives_the_buffered_bytes_back_and_stops_the_upstream_read():
    fc = FlowControl(seeds_settings(coalesce=False))
    up = Upstream(body=b"s" * 4000, chunks=4)
    resp = await fc(req(), up)
    await resp.body.__anext__()
    await until(lambda: fc.read_ahead.held == 3000, "the read ahead")
    await resp.body.aclose()  # what an adapter does when its client resets the stream
    resp.finish(ConnectionResetError("client gone"))
    assert fc.read_ahead.held == 0 and fc.controller.levels["secrets-list"].executing_seats == 0


def test_read_ahead_budget_lets_an_empty_connection_take_one_chunk_then_holds_each_limit():
    budget = ReadAheadBudget(total=1000, per_connection=600)
    assert budget.refusal(1, 5000) == ""  # nothing held: one chunk always, so every response moves
    budget.take(1, 500)
    assert budget.refusal(1, 200) == "connection"
    assert budget.refusal(1, 100) == ""
    budget.take(2, 450)
    assert budget.refusal(2, 100) == "process"  # 950 + 100 over the process's 1000
    budget.give(1, 500)
    assert budget.refusal(2, 100) == "" and budget.by_connection == {2: 450}


def test_removed_seat_timeout_key_says_what_replaced_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("proxy:\n  flowControl:\n    seatTimeoutSeconds: 60\n")
    with pytest.raises(ConfigError, match="requestTimeoutSeconds"):
        load_config(path)


async def test_a_follower_cancelled_as_the_shared_answer_arrives_does_not_fail_the_leader():
    """A follower's client can go away in the same loop turn in which the leader's answer arrives: its task is
    cancelled (so is the future it awaits), but its own cleanup has not run yet. The leader and the other follower
    still get the answer; the cancelled one's share is closed."""
    fc = FlowControl(seeds_settings())
    waiting: list[asyncio.Task] = []

    class CancelsAFollower(Upstream):
        async def __call__(self, request):
            response = await super().__call__(request)
            if request.target == SECRETS:
                for _ in range(3):
                    await asyncio.sleep(0)  # the followers reach their await of the shared answer
                follower = next(w for w in waiting if w is not asyncio.current_task())
                follower.cancel()  # no await between this and the leader handing out shares
            return response

    up = CancelsAFollower()
    up.gate.clear()
    blockers = [asyncio.create_task(call(fc, req(target=f"/api/v1/namespaces/n{i}/secrets"), up)) for i in range(2)]
    await until(lambda: up.calls == 2, "two blockers to hold both seats")
    waiting.extend(asyncio.create_task(fc(req(), up)) for _ in range(3))
    level = fc.controller.levels["secrets-list"]
    await until(lambda: level.waiting == 3, "three identical LISTs to queue")
    up.gate.set()
    await asyncio.gather(*blockers)
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert sum(isinstance(r, asyncio.CancelledError) for r in results) == 1, results
    served = [r for r in results if isinstance(r, ProxyResponse)]
    assert [await read(r) for r in served] == [up.body, up.body]
    assert up.calls == 3
    for r in served:
        r.finish(None)
    await until(lambda: level.executing_seats == 0, "the shared call's seat to be released")
