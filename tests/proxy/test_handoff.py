"""The supervisor's connection hand-off (``proxy/handoff/``): least-loaded choice, real sockets; in-test workers,
then a real ``ProxyServer`` as the receiving worker."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from edge_kit import chunks, make_pki, rejected
from prometheus_client import REGISTRY

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy.handoff import dispatcher as dispatcher_module
from gatekeeper.proxy.handoff.dispatcher import PASS_OVER_SECONDS, HandoffDispatcher
from gatekeeper.proxy.handoff.inbox import Inbox
from gatekeeper.proxy.handoff.protocol import ClosedCounts, least_loaded
from gatekeeper.proxy.listen import server as server_module
from gatekeeper.proxy.listen.server import ProxyServer, serve
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ListenerSettings, ProxySettings


def test_least_loaded_picks_the_smallest_load_and_skips_workers_not_serving() -> None:
    assert least_loaded([3, 1, 2], after=0) == 1
    assert least_loaded([None, 5, None], after=1) == 1
    assert least_loaded([None, None], after=0) is None
    assert least_loaded([], after=0) is None


def test_least_loaded_rotates_among_equal_loads() -> None:
    picks = []
    last = 2
    for _ in range(6):
        last = least_loaded([0, 0, 0], after=last)  # type: ignore[assignment]
        picks.append(last)
    assert picks == [0, 1, 2, 0, 1, 2]


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


class Rig:
    """A dispatcher on a real loopback listener, with in-test 'workers' reading their inboxes."""

    def __init__(self, tmp_path: Path, workers: int, extra_listeners: Sequence[socket.socket] = (),
                 max_connections: int = 0) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.handed: list[int] = []
        self.waits = 0
        self.stalls: list[int] = []
        self.taken_back: list[int] = []
        self.refused: list[int] = []
        self.dispatcher = HandoffDispatcher([self.listener, *extra_listeners],
                                     ClosedCounts.create(tmp_path / "closed", workers), workers,
                                     on_handoff=self.handed.append, on_wait=self._wait, on_stall=self.stalls.append,
                                     on_take_back=self.taken_back.append, max_connections=max_connections,
                                     on_refused=self.refused.append)
        self.counts = ClosedCounts(tmp_path / "closed")
        self.inboxes: list[Inbox | None] = [None] * workers
        self.held: list[list[socket.socket]] = [[] for _ in range(workers)]
        self.clients: list[socket.socket] = []
        self.dispatcher.start()

    def _wait(self) -> None:
        self.waits += 1

    def start_worker(self, index: int, announce: bool = True) -> Inbox:
        inbox = Inbox(self.dispatcher.channel(index).detach(), self.counts, index)
        self.inboxes[index] = inbox
        self.held[index] = []
        if announce:
            inbox.announce()
        return inbox

    def start_all(self) -> list[Inbox]:
        """Every worker started and seen serving by the dispatcher, none holding a connection yet."""
        inboxes = [self.start_worker(i) for i in range(len(self.inboxes))]
        wait_for(lambda: self.dispatcher.loads() == [0] * len(inboxes), "every worker to serve")
        return inboxes

    def collect_all(self, total: int) -> None:
        """Read every worker's inbox until the workers hold ``total`` connections between them."""
        def done() -> bool:
            for i in range(len(self.inboxes)):
                self.collect(i)
            return sum(len(h) for h in self.held) == total

        wait_for(done, f"the workers to receive {total} sockets")

    def connect(self, n: int = 1) -> None:
        for _ in range(n):
            before = len(self.handed) + self.waits
            self.clients.append(socket.create_connection(("127.0.0.1", self.port)))
            wait_for(lambda before=before: len(self.handed) + self.waits > before,  # type: ignore[misc]
                     "the dispatcher to hand the connection over or hold it")

    def collect(self, index: int) -> int:
        inbox = self.inboxes[index]
        assert inbox is not None
        got = inbox.receive()
        self.held[index] += got
        return len(got)

    def close_on_worker(self, index: int, k: int) -> None:
        inbox = self.inboxes[index]
        assert inbox is not None
        for _ in range(k):
            self.held[index].pop().close()
            inbox.closed()

    def stop(self) -> None:
        self.dispatcher.stop()
        for conns in self.held:
            for c in conns:
                c.close()
        for c in self.clients:
            c.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Callable[[int], Rig]]:
    made: list[Rig] = []

    def make(workers: int) -> Rig:
        made.append(Rig(tmp_path, workers))
        return made[-1]

    yield make
    for r in made:
        r.stop()


@pytest.fixture
def unhurried(monkeypatch: pytest.MonkeyPatch) -> None:
    """For tests whose in-test workers read their inboxes only after several connects: on a busy machine those
    connects can outlast LAG_SECONDS, and the take-back (tested on its own below) would hand connections twice."""
    monkeypatch.setattr(dispatcher_module, "LAG_SECONDS", 5.0)


@pytest.mark.usefixtures("unhurried")
def test_connections_split_evenly_over_serving_workers(rig: Callable[[int], Rig]) -> None:
    r = rig(2)
    r.start_all()
    r.connect(8)
    assert sorted(r.handed.count(w) for w in (0, 1)) == [4, 4]
    r.collect_all(8)
    assert len(r.held[0]) == len(r.held[1]) == 4
    # what a worker receives is the client's own connection
    r.clients[0].sendall(b"hello")
    got = {c.recv(5, socket.MSG_DONTWAIT) if _readable(c) else b"" for c in r.held[0] + r.held[1]}
    assert b"hello" in got


def _readable(c: socket.socket) -> bool:
    c.settimeout(1.0)
    try:
        return bool(c.recv(5, socket.MSG_PEEK))
    except TimeoutError:
        return False


@pytest.mark.usefixtures("unhurried")
def test_the_connection_cap_holds_for_all_workers_together(tmp_path: Path) -> None:
    """listener.maxClientConnections is the proxy's: with each worker holding its own cap, N workers let N times
    as many connections in. The parent closes the one past it at accept (counted), and takes new ones again as
    the workers' connections close."""
    r = Rig(tmp_path, 2, max_connections=3)
    try:
        r.start_all()
        r.connect(3)
        r.collect_all(3)
        r.clients.append(socket.create_connection(("127.0.0.1", r.port)))
        wait_for(lambda: r.refused == [3], "the fourth connection to be refused")
        r.clients[-1].settimeout(5)
        assert r.clients[-1].recv(1) == b""  # closed by the parent, never handed to a worker
        assert len(r.handed) == 3
        worker = 0 if r.held[0] else 1
        r.close_on_worker(worker, 1)
        wait_for(lambda: sum(load or 0 for load in r.dispatcher.loads()) == 2, "the close to be counted")
        r.connect(1)
        assert len(r.handed) == 4 and r.refused == [3]
    finally:
        r.stop()


@pytest.mark.usefixtures("unhurried")
def test_a_worker_whose_connections_closed_gets_the_next_ones(rig: Callable[[int], Rig]) -> None:
    r = rig(2)
    r.start_all()
    r.connect(6)
    r.collect_all(6)
    r.close_on_worker(0, 3)  # worker 0's clients left; worker 1 still holds 3
    assert r.dispatcher.loads() == [0, 3]
    r.handed.clear()
    for _ in range(3):
        r.connect()
        r.collect(0)  # as a serving worker does: it reads its socket at once
    assert r.handed == [0, 0, 0]


def test_connections_wait_in_the_backlog_until_a_worker_serves(rig: Callable[[int], Rig]) -> None:
    r = rig(2)
    r.start_worker(0, announce=False)
    client = socket.create_connection(("127.0.0.1", r.port))  # accepted by the kernel, not by us
    r.clients.append(client)
    time.sleep(0.2)
    assert r.handed == []
    inbox = r.inboxes[0]
    assert inbox is not None
    inbox.announce()
    wait_for(lambda: r.handed == [0], "the waiting connection to go to worker 0")


def test_a_worker_that_stops_reading_is_passed_over(rig: Callable[[int], Rig]) -> None:
    r = rig(2)
    r.start_worker(1)
    wait_for(lambda: r.dispatcher.loads() == [None, 0], "worker 1 to serve")
    for _ in range(50):
        r.connect()
        r.collect(1)
    r.start_worker(0)  # the least loaded, but it never reads: its socket fills
    wait_for(lambda: r.dispatcher.loads() == [0, 50], "worker 0 to serve")
    r.handed.clear()
    for _ in range(80):
        r.connect()
        r.collect(1)
    assert r.waits == 0
    stuck_share = r.handed.count(0)
    assert 0 < stuck_share < 50, r.handed  # without the pass-over it would take all 50 first (or hold)
    # and what it was handed is taken back for the worker that reads: every client is served
    wait_for(lambda: len(r.taken_back) == stuck_share, "worker 0's connections to be taken back")
    r.collect_all(50 + 80)
    assert len(r.held[1]) == 50 + 80 and r.handed.count(1) == 80


def test_a_stopped_worker_gets_one_connection_while_another_keeps_up(rig: Callable[[int], Rig]) -> None:
    """A worker that does not read its socket (SIGSTOP, a blocked loop) is not the least loaded: before, its
    unread connections counted as its load and it got every other one (15 of 30 here), each hanging."""
    r = rig(2)
    r.start_all()
    started = time.monotonic()
    for _ in range(30):
        r.connect()
        r.collect(1)  # worker 1 keeps up; worker 0 reads nothing
        time.sleep(0.06)  # connections a little apart (past LAG_SECONDS), as clients arrive
    tries = 1 + int((time.monotonic() - started) / PASS_OVER_SECONDS)
    assert r.waits == 0
    assert 1 <= r.handed.count(0) <= tries, r.handed  # one per pass-over period, never every other one
    r.collect_all(30)
    assert len(r.held[1]) == 30  # the ones handed to worker 0 were taken back
    assert r.taken_back == [0] * r.handed.count(0) and r.stalls == [0]


def test_the_connection_handed_to_a_worker_just_before_it_stopped_is_served_by_another(
        rig: Callable[[int], Rig]) -> None:
    """A descriptor that was sent could not be taken back: the first connection handed to a worker that had
    just stopped (SIGSTOP, a blocked loop) waited unread in its socket until the worker was killed as hung
    (workerHangSeconds, 30 s). The supervisor now reads it back from its own duplicate of the worker's end
    after LAG_SECONDS and hands it to a worker that reads, unread: the client sees a short delay, not a hang."""
    r = rig(2)
    r.start_all()
    r.connect()  # ties rotate: worker 0 gets it, and reads nothing
    assert r.handed == [0]
    started = time.monotonic()
    wait_for(lambda: r.collect(1) == 1, "the connection to reach worker 1", timeout=3)
    assert time.monotonic() - started < 3
    assert r.taken_back == [0] and r.stalls == [0]
    assert r.dispatcher.loads() == [0, 1]  # worker 0's count no longer holds it
    [conn] = r.held[1]
    r.clients[0].sendall(b"hello")  # the client's own connection, not one byte read before
    conn.settimeout(2)
    assert conn.recv(5) == b"hello"
    inbox = r.inboxes[0]
    assert inbox is not None and inbox.receive() == []  # never served twice


def test_a_worker_that_reads_again_is_chosen_again(rig: Callable[[int], Rig]) -> None:
    r = rig(2)
    r.start_all()
    for _ in range(4):
        r.connect()
        r.collect(1)
        time.sleep(0.06)
    assert r.handed.count(0) == 1
    wait_for(lambda: r.taken_back == [0], "worker 0's connection to be taken back")
    time.sleep(PASS_OVER_SECONDS)  # then it is tried again
    r.collect_all(4)
    r.handed.clear()
    r.connect()
    assert r.handed == [0]
    r.collect(0)  # worker 0 reads again: the least loaded (1 against 4), it gets the next ones
    r.handed.clear()
    for _ in range(3):
        r.connect()
        r.collect(0)
        r.collect(1)
    assert r.handed == [0, 0, 0], r.handed


def test_a_stall_is_counted_once_and_a_stalled_worker_still_serves_alone(rig: Callable[[int], Rig]) -> None:
    """Every worker stalled: connections still go out by load (the stall is a preference, never a refusal)."""
    r = rig(1)
    r.start_all()
    r.connect()
    time.sleep(0.6)  # past STALL_SECONDS with the connection unread
    r.connect(3)
    assert r.handed == [0, 0, 0, 0] and r.waits == 0
    assert r.stalls == [0]  # once per stall, not once per connection
    r.collect_all(4)
    r.connect()
    time.sleep(0.6)
    r.connect()
    assert r.stalls == [0, 0]  # it read in between: a new stall


def test_when_every_worker_is_full_the_connection_waits_and_nothing_is_dropped(rig: Callable[[int], Rig]) -> None:
    r = rig(1)
    slow = r.start_worker(0)
    wait_for(lambda: r.dispatcher.loads() == [0], "the worker to serve")
    for _ in range(100):
        r.connect()  # the worker reads nothing yet
        if r.waits:
            break
    assert r.waits == 1, "the worker's socket never filled"
    queued = len(r.handed)
    more = [socket.create_connection(("127.0.0.1", r.port)) for _ in range(5)]  # wait in the backlog
    r.clients += more
    time.sleep(0.2)
    assert len(r.handed) == queued and r.waits == 1  # accepting paused
    received = 0
    deadline = time.monotonic() + 5
    while received < queued + 6 and time.monotonic() < deadline:
        received += r.collect(0)
        time.sleep(0.01)
    assert received == queued + 6  # the held one and the backlog's five, once the worker read
    assert slow.ended is False


def test_a_dead_worker_gets_nothing_and_its_successor_starts_from_zero(rig: Callable[[int], Rig]) -> None:
    r = rig(2)
    first, _ = r.start_all()
    r.connect(4)
    first.close()  # worker 0 died with 2 connections unread
    r.dispatcher.retire(0)  # as the supervisor does once it reaps the process
    wait_for(lambda: r.dispatcher.loads()[0] is None, "worker 0 to be dropped")
    assert r.taken_back == [0, 0]  # and served by worker 1 (before: reset with the dead worker's socket)
    r.collect_all(4)
    assert len(r.held[1]) == 4
    r.handed.clear()
    r.connect(2)
    assert r.handed == [1, 1]
    r.start_worker(0)  # restarted: a fresh socket and count; it is the least loaded now
    wait_for(lambda: r.dispatcher.loads()[0] == 0, "worker 0's successor to serve")
    r.handed.clear()
    r.connect(4)
    assert r.handed == [0, 0, 0, 0]


class _FailingListener(socket.socket):
    """A real listening socket whose accept() fails as when the process is out of descriptors."""

    calls = 0

    def accept(self):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        raise OSError(24, "Too many open files")


def test_a_failing_accept_backs_off_instead_of_spinning(tmp_path: Path) -> None:
    listener = _FailingListener(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    dispatcher = HandoffDispatcher([listener], ClosedCounts.create(tmp_path / "closed", 1), 1)
    counts = ClosedCounts(tmp_path / "closed")
    dispatcher.start()
    inbox = Inbox(dispatcher.channel(0).detach(), counts, 0)
    client = None
    try:
        inbox.announce()
        wait_for(lambda: dispatcher.loads() == [0], "the worker to serve")
        client = socket.create_connection(listener.getsockname())  # stays in the backlog: readable forever
        time.sleep(1.0)
        # one try per ACCEPT_BACKOFF (0.1 s), not thousands a second
        assert 3 <= _FailingListener.calls <= 15, _FailingListener.calls
    finally:
        dispatcher.stop()
        inbox.close()
        if client is not None:
            client.close()


# ------------------------------------------------------------------ a real worker (ProxyServer) on the receiving end


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _ok(req: ProxyRequest) -> ProxyResponse:
    return ProxyResponse(200, [], chunks(b"ok"))


def _worker(pki: PKI, inbox: Inbox) -> ProxyServer:
    lst = ListenerSettings(address="127.0.0.1", port=0, cert_file=str(pki.cert_path("proxy")),
                           key_file=str(pki.key_path("proxy")))
    return ProxyServer(ProxySettings(listener=lst), _ok, close_delay=0.1, handoff=inbox)


async def _until(cond: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(5):
            while not cond():  # noqa: ASYNC110 - the dispatcher's thread, no event to wait on
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_a_draining_worker_is_handed_nothing_more(rig: Callable[[int], Rig], pki: PKI) -> None:
    """A worker SIGTERMed on its own (an operator, the OOM-killer's sibling, a test) drains for up to
    shutdownTimeoutSeconds. Its inbox stayed open and unread: the supervisor still counted it serving, and
    as its clients left it became the least loaded, so new connections queued in it until it exited."""
    r = rig(2)
    server = _worker(pki, r.start_worker(0, announce=False))
    await server.start()
    r.start_worker(1)
    await _until(lambda: r.dispatcher.loads() == [0, 0], "both workers to serve")
    await server.shutdown(1)
    await _until(lambda: r.dispatcher.loads()[0] is None, "the supervisor to stop handing worker 0 connections")
    r.handed.clear()
    await asyncio.to_thread(r.connect, 4)
    assert r.handed == [1, 1, 1, 1]


async def test_a_connection_handed_to_a_worker_as_it_begins_to_drain_is_served_by_another(
        rig: Callable[[int], Rig], pki: PKI) -> None:
    """Handed over in the same moment the worker began to drain (its loop had not read it yet): the worker's
    close of its end reset it (the client's TLS handshake failed with a reset, a retry at best). The worker now
    says it drains and the supervisor takes the connection back, unread, for another worker."""
    r = rig(2)
    server = _worker(pki, r.start_worker(0, announce=False))
    await server.start()
    r.start_worker(1)
    await _until(lambda: r.dispatcher.loads() == [0, 0], "both workers to serve")
    r.connect()  # blocks this loop: worker 0 has not read it when its drain begins
    assert r.handed == [0]
    await server.shutdown(1)
    await asyncio.to_thread(wait_for, lambda: r.collect(1) == 1, "the connection to reach worker 1")
    assert r.taken_back == [0]
    [conn] = r.held[1]
    r.clients[0].sendall(b"hello")  # alive, and not one byte read by worker 0
    conn.settimeout(2)
    assert conn.recv(5) == b"hello"


@contextlib.contextmanager
def _no_free_descriptors() -> Iterator[None]:
    """This process at its RLIMIT_NOFILE: every new descriptor fails with EMFILE until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 16, hard))
    fillers = []
    try:
        while True:
            try:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_worker_out_of_descriptors_counts_the_lost_connection_and_backs_off(
        rig: Callable[[int], Rig], pki: PKI, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel closes a passed descriptor the receiver cannot install (MSG_CTRUNC). That connection was
    never counted closed: the supervisor saw the worker one connection busier for the rest of its life (15
    lost at a prlimit of 60 kept ``GET /workers`` at 15 with no client). And a worker that read on would stay
    the least loaded and lose every connection handed to it; it backs off so its socket fills and the other
    workers get them."""
    monkeypatch.setattr(server_module, "ACCEPT_BACKOFF", 60.0)  # no timing in the test: paused throughout
    r = rig(2)
    server = _worker(pki, r.start_worker(0, announce=False))
    await server.start()
    r.start_worker(1)
    await _until(lambda: r.dispatcher.loads() == [0, 0], "both workers to serve")
    before = rejected("no_descriptors")
    try:
        r.connect(2)  # blocks this loop, so the worker has not read its connection yet
        assert sorted(r.handed) == [0, 1]
        with _no_free_descriptors():
            server._take_handoffs()  # what the loop's reader callback does
        assert r.dispatcher.loads()[0] == 0, "the lost connection still counts as open on worker 0"
        assert rejected("no_descriptors") == before + 1

        def flood() -> None:
            for _ in range(60):
                r.connect()
                r.collect(1)

        await asyncio.to_thread(flood)
        assert server._open == 0, "worker 0 kept reading while out of descriptors"
        assert 0 < r.handed.count(0) < 60 and r.waits == 0, r.handed
    finally:
        await server.shutdown(1)


def test_with_two_listeners_a_held_connection_is_not_replaced_by_the_next(tmp_path: Path) -> None:
    """listener.address resolving to two addresses (localhost, a dual-stack name) gives the dispatcher two
    listeners, readable in the same round. When the first one's accepts filled every worker's socket, the
    second one's accept replaced the connection held for later, which was then closed: a client cut right
    after its connect, against "nothing is dropped"."""
    second = socket.create_server(("127.0.0.1", 0))
    second.setblocking(False)
    r = Rig(tmp_path, 1, extra_listeners=[second])
    try:
        # no worker serves yet: these wait in the backlogs, more on the first listener than a socket takes
        r.clients += [socket.create_connection(("127.0.0.1", r.port)) for _ in range(60)]
        r.clients.append(socket.create_connection(second.getsockname()))
        r.start_worker(0)  # serves, reads nothing yet: both listeners are readable in the next round
        wait_for(lambda: r.waits >= 1, "the worker's socket to fill and a connection to be held")
        time.sleep(0.2)
        assert r.waits == 1, "the held connection was replaced by another"
        deadline = time.monotonic() + 10
        while len(r.held[0]) < len(r.clients) and time.monotonic() < deadline:
            r.collect(0)
            time.sleep(0.01)
        assert len(r.held[0]) == len(r.clients), "a connection was dropped"
    finally:
        r.stop()
        second.close()


def test_the_port_refuses_connections_until_a_worker_first_serves(tmp_path: Path) -> None:
    """The supervisor binds without listening: before any worker serves, a connect is refused (as with
    kernel balancing), so a TCP health check does not pass while nothing can answer."""
    from gatekeeper.serving.netbind import bind_listeners

    [listener] = bind_listeners("127.0.0.1", 0)
    port = listener.getsockname()[1]
    dispatcher = HandoffDispatcher([listener], ClosedCounts.create(tmp_path / "closed", 1), 1)
    counts = ClosedCounts(tmp_path / "closed")
    dispatcher.start()
    inbox = Inbox(dispatcher.channel(0).detach(), counts, 0)
    client = None
    try:
        time.sleep(0.2)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        inbox.announce()
        wait_for(lambda: dispatcher.loads() == [0], "the worker to serve")
        client = socket.create_connection(("127.0.0.1", port), timeout=2)
        wait_for(lambda: dispatcher.loads() == [1], "the connection to be handed over")
    finally:
        dispatcher.stop()
        inbox.close()
        if client is not None:
            client.close()


class _FailingReceive:
    """``socket.recv_fds`` failing with ``error`` while ``failing``, counting its calls; then the real one."""

    def __init__(self, error: int) -> None:
        self.real = socket.recv_fds
        self.error = error
        self.failing = True
        self.calls = 0

    def __call__(self, sock: socket.socket, bufsize: int, maxfds: int,
                 flags: int = 0) -> tuple[bytes, list[int], int, object]:
        if not self.failing:
            return self.real(sock, bufsize, maxfds, flags)
        self.calls += 1
        raise OSError(self.error, os.strerror(self.error))


def _receive_errors(name: str) -> float:
    return REGISTRY.get_sample_value("gatekeeper_proxy_handoff_receive_errors_total", {"error": name}) or 0.0


@pytest.mark.parametrize("code", [errno.ENOBUFS, errno.ENOMEM])
def test_a_receive_error_that_passes_is_not_taken_for_the_end(
        rig: Callable[[int], Rig], monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Every error of the worker's receive used to read as the supervisor's end: the worker took no
    connection again, yet served on, answered /readyz and was never replaced (a silent loss of capacity)."""
    r = rig(1)
    [inbox] = r.start_all()
    r.connect()
    failing = _FailingReceive(code)
    monkeypatch.setattr(socket, "recv_fds", failing)
    assert inbox.receive() == []
    assert inbox.error is not None and inbox.error.errno == code
    assert inbox.ended is False
    failing.failing = False
    r.collect_all(1)
    assert inbox.error is None and inbox.ended is False


async def test_a_worker_whose_receives_fail_backs_off_counts_them_and_reads_on(
        rig: Callable[[int], Rig], pki: PKI, monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket that stays readable while its reads fail must not spin the worker's event loop: it pauses
    (0.1 s, doubling up to 1 s), counts each failure, and serves the waiting connection once reads work."""
    r = rig(1)
    server = _worker(pki, r.start_worker(0, announce=False))
    await server.start()
    await _until(lambda: r.dispatcher.loads() == [0], "the worker to serve")
    before = _receive_errors("ENOBUFS")
    failing = _FailingReceive(errno.ENOBUFS)
    monkeypatch.setattr(socket, "recv_fds", failing)
    try:
        await asyncio.to_thread(r.connect)  # queued in the worker's socket: readable from now on
        await _until(lambda: failing.calls >= 2, "a second read after the first pause")
        await asyncio.sleep(0.5)
        # a loop reading on would have failed thousands of times by now
        assert failing.calls <= 8, failing.calls
        assert _receive_errors("ENOBUFS") == before + failing.calls
        assert not server.handoff_ended.is_set()
        failing.failing = False
        await _until(lambda: server._open == 1, "the waiting connection to be served once reads work")
    finally:
        await server.shutdown(1)


@pytest.mark.parametrize("unread", [False, True], ids=["end-of-stream", "connection-reset"])
async def test_a_worker_whose_hand_off_socket_closes_drains_and_exits(
        tmp_path: Path, pki: PKI, unread: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor closed its end while the worker lives: it will hand that worker nothing more. The worker
    used to stop reading and serve on, ready and never replaced; it now drains and exits (its /readyz turns 503
    first), so the supervisor starts a successor with a fresh socket. ``connection-reset``: closed with the
    worker's message unread, the worker's read fails with ECONNRESET instead of reading the end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    inbox = Inbox(theirs.detach(), ClosedCounts.create(tmp_path / "closed", 1), 0)
    server = _worker(pki, inbox)
    drained: list[bool] = []
    on_sigterm: list[object] = []
    real_shutdown = ProxyServer.shutdown

    async def shutdown(self: ProxyServer, drain_seconds: float | None = None) -> None:
        on_sigterm.append(signal.getsignal(signal.SIGTERM))
        await real_shutdown(self, drain_seconds)

    monkeypatch.setattr(ProxyServer, "shutdown", shutdown)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    task = asyncio.get_running_loop().create_task(
        serve(server._settings, _ok, handoff=inbox, stopping=lambda: drained.append(True)))
    try:
        await _until(lambda: _pending(ours), "the worker to announce it serves")
        if not unread:
            assert ours.recv(16) == b"R"
        ours.close()
        await asyncio.wait_for(task, 10)  # before: serve() never returned
        assert drained == [True]
        # the supervisor's SIGTERM, when it is the one exiting, comes next: it must not kill the drain, nor the
        # clean-up after it (exit code -15)
        assert len(on_sigterm) == 1 and on_sigterm[0] != signal.SIG_DFL, on_sigterm
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        ours.close()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _pending(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(16, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return False


def test_a_worker_announcing_after_the_supervisor_closed_its_end_drains_instead_of_crashing(tmp_path: Path) -> None:
    """A SIGTERM early in the supervisor's life closes the hand-off before a slow worker announces: the announce
    used to raise BrokenPipeError, and the worker exited 1 with a traceback instead of draining."""
    ClosedCounts.create(tmp_path / "closed", 1)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.close()
    inbox = Inbox(ours.detach(), ClosedCounts(tmp_path / "closed"), 0)
    try:
        inbox.announce()  # no exception
        assert inbox.receive() == [] and inbox.ended  # the end of stream: the worker drains and exits
    finally:
        inbox.close()
