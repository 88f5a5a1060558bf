"""The request budget's core: who is closed over the limit, and the unfinished-head bound against aiohttp's parser.

The bound must never be below what the parser holds (else a client holds memory uncounted) and must come back to
exactly 0 between requests (else a long-lived apiserver connection drifts up until it looks like the largest
holder). Both are checked by feeding aiohttp's real parser, through the real connection protocol, random cuts of
pipelined requests of every framing, with no sockets.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from aiohttp import web

from gatekeeper.webhook.listen import MeteredRequestHandler
from gatekeeper.webhook.request_budget import RequestBudget, UnfinishedHead, head_size


def test_over_the_limit_the_largest_holder_is_closed_even_if_it_is_not_the_one_growing() -> None:
    budget: RequestBudget[str] = RequestBudget(100)
    assert budget.hold("attacker", 70) == [] and budget.hold("apiserver", 20) == []
    assert budget.hold("newcomer", 15) == ["attacker"]  # 105 > 100: the one holding the most goes
    assert budget.used == 35 and set(budget.held) == {"apiserver", "newcomer"}


def test_a_holder_growing_past_everyone_is_itself_closed_and_releases_nothing_twice() -> None:
    budget: RequestBudget[str] = RequestBudget(100)
    budget.hold("a", 30)
    assert budget.hold("b", 90) == ["b"]
    assert budget.used == 30
    budget.drop("b")  # its connection_lost comes later: already released
    assert budget.used == 30


def test_holding_less_or_nothing_releases_and_never_closes_anyone() -> None:
    budget: RequestBudget[str] = RequestBudget(100)
    budget.hold("a", 60)
    budget.hold("b", 40)
    assert budget.hold("a", 10) == [] and budget.hold("b", 0) == []
    assert budget.used == 10 and budget.held == {"a": 10}
    budget.drop("a")
    assert budget.used == 0 and budget.held == {}


def test_head_size_is_never_more_than_the_bytes_on_the_wire() -> None:
    wire = b"POST /validate?timeout=10s HTTP/1.1\r\nHost: webhook\r\nX-Pad:   spaced   \r\n\r\n"
    size = head_size("POST", "/validate?timeout=10s", [(b"Host", b"webhook"), (b"X-Pad", b"spaced")])
    assert size == len(wire) - 7  # the whitespace around values is not kept


def test_inside_a_body_no_head_is_held() -> None:
    meter = UnfinishedHead()
    meter.fed(b"GET / HTTP/1.1\r\nHost: x\r\n", 0, [], in_body=False, whole_next=True)
    assert meter.held == 25
    assert meter.fed(b"...", 0, [], in_body=True, whole_next=True) == 0


class _Transport(asyncio.Transport):
    """Just enough of a transport for aiohttp's protocol: nothing written is read back."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def write(self, data: Any) -> None:
        pass

    def writelines(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def _requests(rng: random.Random, framings: tuple[str, ...], most: int = 12) -> list[tuple[bytes, int]]:
    """Pipelined requests: each as its bytes and where its head ends. Bodies contain CRLFCRLF."""
    out = []
    for _ in range(rng.randint(1, most)):
        fields = b"".join(b"X-F%d:%s%s\r\n" % (i, b" " * rng.randint(0, 3), b"v" * rng.randint(0, 300))
                          for i in range(rng.randint(0, 8)))
        kind = rng.choice(framings)
        body = b"{\r\n\r\n}" * rng.randint(0, 40)
        if kind == "get":
            head, raw = b"GET /healthz HTTP/1.1\r\nHost: w\r\n" + fields + b"\r\n", b""
        elif kind == "length":
            head = b"POST /x HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n" % len(body) + fields + b"\r\n"
            raw = body
        else:
            head = b"POST /x HTTP/1.1\r\nHost: w\r\nTransfer-Encoding: chunked\r\n" + fields + b"\r\n"
            cut = rng.randint(0, len(body))
            raw = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:cut], body[cut:]) if part)
            raw += b"0\r\n\r\n"
        out.append((head + raw, len(head)))
    return out


def _truth(requests: list[tuple[bytes, int]], fed: int) -> tuple[int, bool]:
    """Bytes of the head the parser is in the middle of after ``fed`` bytes, and whether ``fed`` ends a request."""
    start = 0
    for data, head in requests:
        if fed < start + head:
            return fed - start, fed == start
        if fed < start + len(data):
            return 0, False
        start += len(data)
    return 0, True


async def _feed_random_cuts(framings: tuple[str, ...], most: int, exact: bool) -> None:
    """Random pipelined requests cut at random, through the real protocol and parser: the bound is never below
    the head the parser is in; with ``exact``, it is 0 wherever a cut falls between two requests."""
    async def ok(request: web.BaseRequest) -> web.Response:
        return web.Response(text="ok")

    server = web.Server(ok)
    rng = random.Random(5)
    for _ in range(300):
        requests = _requests(rng, framings, most)
        stream = b"".join(data for data, _ in requests)
        budget: RequestBudget[MeteredRequestHandler] = RequestBudget(1 << 30)
        handler = MeteredRequestHandler(server, budget=budget, on_evicted=lambda: None,
                                        loop=asyncio.get_running_loop())
        handler.connection_made(_Transport())
        await asyncio.sleep(0)  # its request loop now waits for a first request
        fed = 0
        while fed < len(stream):
            # Fed without yielding to the loop: every request stays queued (at most 12 of aiohttp's 32).
            step = rng.choice([1, 2, 3, 5, 17, 100, 1000, len(stream)])
            chunk = stream[fed:fed + step]
            handler.data_received(chunk)
            fed += len(chunk)
            truth, at_boundary = _truth(requests, fed)
            assert handler.unfinished_head_bytes >= truth, (requests, fed)
            if exact and at_boundary:
                assert handler.unfinished_head_bytes == 0, (requests, fed)
        assert budget.used >= sum(head - 20 for _, head in requests)  # every parsed head still counted
        handler.connection_lost(None)
        await asyncio.sleep(0)
        assert budget.used == 0
    await server.shutdown()


async def test_the_unfinished_head_bound_is_never_below_what_the_parser_holds() -> None:
    await _feed_random_cuts(("get", "length", "chunked"), most=12, exact=False)


async def test_the_bound_is_zero_between_requests_so_a_long_lived_connection_does_not_drift() -> None:
    """Content-Length and bodiless requests, pipelined or not, whatever their bodies hold (the apiserver's)."""
    await _feed_random_cuts(("get", "length"), most=12, exact=True)


async def test_the_bound_is_zero_after_a_chunked_request() -> None:
    await _feed_random_cuts(("chunked",), most=1, exact=True)


async def test_a_closed_connections_queued_requests_are_freed_at_once() -> None:
    """aiohttp keeps the requests queued behind the one being answered until that one ends (up to
    writeTimeoutSeconds for a client that stopped reading): 18 closed connections still held 565 parsed requests,
    heads and bodies. They will never be answered; they go with the connection."""
    stuck = asyncio.Event()

    async def answer(request: web.BaseRequest) -> web.Response:
        await stuck.wait()  # a response the client never takes
        return web.Response(text="ok")

    server = web.Server(answer)
    budget: RequestBudget[MeteredRequestHandler] = RequestBudget(1 << 30)
    handler = MeteredRequestHandler(server, budget=budget, on_evicted=lambda: None, loop=asyncio.get_running_loop())
    handler.connection_made(_Transport())
    await asyncio.sleep(0)
    request = b"GET /healthz HTTP/1.1\r\nHost: w\r\nContent-Length: 5000\r\n\r\n" + b"b" * 5000
    handler.data_received(request)
    for _ in range(3):
        await asyncio.sleep(0)  # the first request is taken and its answer is stuck
    handler.data_received(request * 3)
    assert len(handler._messages) == 3 and budget.used > 15000
    handler.connection_lost(None)
    assert len(handler._messages) == 0 and budget.used == 0
    stuck.set()
    await asyncio.sleep(0)
    await server.shutdown()
