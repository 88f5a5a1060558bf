"""``gatekeeper proxy --workers 2`` in front of the real apiservers: one port, one /metrics, clean drains."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import h2.events
import httpx
import pytest
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import SandboxState
from gatekeeper.sandbox.testing import HalfHandshake, ProxyProcess, WireH2
from gatekeeper.sandbox.testing import metric_sum as sample_sum

pytestmark = pytest.mark.sandbox

WORKERS = 2


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def workers_of(p: ProxyProcess) -> list[dict]:
    return list(json.loads(get(f"{p.metrics_url}/workers")))


def per_worker(p: ProxyProcess, name: str, **labels: str) -> dict[int, float]:
    return {w["index"]: sample_sum(get(f"{w['metricsUrl']}/metrics/worker"), name, **labels)
            for w in workers_of(p) if w["metricsUrl"]}


def wait_for(cond, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def connect_to_every_worker(p: ProxyProcess, limit: int = 40) -> list[WireH2]:
    """Open h2 connections (one GET each) until every worker holds at least one (the parent picks)."""
    conns: list[WireH2] = []
    while len(conns) < limit:
        c = WireH2(p.url, p.tls(cert=True))
        sid = c.request("/api/v1/namespaces/default")
        assert c.read_until(lambda c=c, sid=sid: sid in c.ended), "no answer"
        conns.append(c)
        if len(conns) >= WORKERS and all(v >= 1 for v in per_worker(
                p, "gatekeeper_proxy_client_connections", protocol="h2").values()):
            return conns
    pytest.fail(f"{limit} connections never reached all {WORKERS} workers")


@pytest.fixture
def proxy(sandbox: SandboxState, tmp_path: Path) -> Iterator[ProxyProcess]:
    p = ProxyProcess(sandbox, tmp_path, name="proxy-workers", workers=WORKERS)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def test_metrics_add_up_across_workers(proxy: ProxyProcess) -> None:
    name, labels = "gatekeeper_proxy_requests_total", {"verb": "get", "resource": "namespaces"}
    before = sample_sum(proxy.metrics(), name, **labels)
    conns = connect_to_every_worker(proxy)
    try:
        watches = []
        for c in conns[:6]:
            sid = c.request("/api/v1/namespaces/default/configmaps?watch=1&allowWatchBookmarks=true")
            assert c.read_until(lambda c=c, sid=sid: sid in c.status)
            watches.append(sid)
        page = proxy.metrics()
        counted = sample_sum(page, name, **labels) - before
        by_worker = per_worker(proxy, name, **labels)
        assert counted == len(conns), f"{counted} GETs counted at the parent for {len(conns)} sent"
        assert sum(by_worker.values()) == counted and all(v >= 1 for v in by_worker.values()), by_worker
        # live gauges: the parent's figure is the sum of every worker's
        open_watches = sample_sum(page, "gatekeeper_proxy_backend_watches")
        assert open_watches == len(watches) == sum(per_worker(proxy, "gatekeeper_proxy_backend_watches").values())
        assert sample_sum(page, "gatekeeper_proxy_client_connections", protocol="h2") == len(conns)
        assert sample_sum(page, "gatekeeper_proxy_workers", state="serving") == WORKERS
        # the admin-only /metrics on the TLS port, answered by whichever worker, shows the whole proxy too
        for _ in range(3):  # new connections: each may land on either worker
            tls_page = httpx.get(f"{proxy.url}/metrics", verify=proxy.tls(cert=True)).text
            assert sample_sum(tls_page, name, **labels) - before == counted
        # the skew over the summed per-backend watches: 6 watches over 3 backends, whatever the split
        flights = [sample_sum(page, "gatekeeper_proxy_backend_in_flight", backend=f"apiserver-{i}") for i in (1, 2, 3)]
        skew = sample_sum(page, "gatekeeper_proxy_skew_in_flight_ratio")
        assert sum(flights) == len(watches)
        assert skew == pytest.approx((max(flights) + 1) / (min(flights) + 1))
        print(f"\n{len(conns)} connections over {WORKERS} workers: GETs per worker {by_worker}, "
              f"in flight per backend {flights}, skew {skew:.2f}")
    finally:
        for c in conns:
            c.close()


def open_h2(p: ProxyProcess, n: int) -> list[WireH2]:
    conns = []
    for _ in range(n):
        c = WireH2(p.url, p.tls(cert=True))
        sid = c.request("/api/v1/namespaces/default")
        assert c.read_until(lambda c=c, sid=sid: sid in c.ended), "no answer"
        conns.append(c)
    return conns


def test_connections_go_to_the_least_loaded_worker(proxy: ProxyProcess) -> None:
    """Each connection goes to the worker with fewer (SO_REUSEPORT, the kernel's model, hashed h2load's 8
    connections 6/2 in one round of 5), read from the workers' own
    gauges, and a worker whose clients left gets the next connections."""
    gauge = "gatekeeper_proxy_client_connections"
    by_worker: dict[int, list[WireH2]] = {0: [], 1: []}

    def connect(n: int) -> list[int]:
        """Open ``n`` connections one by one; which worker took each (the one whose gauge rose)."""
        took = []
        for _ in range(n):
            before = per_worker(proxy, gauge, protocol="h2")
            c = open_h2(proxy, 1)[0]  # answered, so the worker counted it
            after = per_worker(proxy, gauge, protocol="h2")
            rose = [i for i in after if after[i] > before.get(i, 0)]
            assert len(rose) == 1, (before, after)
            by_worker[rose[0]].append(c)
            took.append(rose[0])
        return took

    try:
        took = connect(12)
        assert sorted(took) == [0] * 6 + [1] * 6, took
        assert sample_sum(proxy.metrics(), "gatekeeper_proxy_connections_handed_off_total") >= 12
        for c in by_worker[0]:
            c.close()
        by_worker[0] = []
        wait_for(lambda: [w.get("connections") for w in workers_of(proxy)] == [0, 6], timeout=10,
                 what="the supervisor to see worker 0's connections closed")
        assert connect(4) == [0, 0, 0, 0]
    finally:
        for conns in by_worker.values():
            for c in conns:
                c.close()


@pytest.fixture
def drain_proxy(sandbox: SandboxState, tmp_path: Path) -> Iterator[ProxyProcess]:
    """Workers with drains of 5 s: a watch is served until then, then ended."""
    p = ProxyProcess(sandbox, tmp_path, name="proxy-drain", workers=WORKERS,
                     user_config={"protocol": {"shutdownTimeoutSeconds": 5}})
    p.start()
    try:
        yield p
    finally:
        p.stop()


def watch_on_each(conns: list[WireH2]) -> dict[WireH2, int]:
    """A configmaps watch on every connection, its response head received: streams that keep a drain going."""
    watches = {}
    for c in conns:
        sid = c.request("/api/v1/namespaces/default/configmaps?watch=1")
        assert c.read_until(lambda c=c, sid=sid: sid in c.status), "the watch was not answered"
        watches[c] = sid
    return watches


class RawTail:
    """What a :class:`WireH2` connection receives from the moment its server may drain, read frame by frame.

    python-h2's client closes its state machine on a GOAWAY and raises on the frames the server still owes (the
    answers to the streams the GOAWAY promised to finish), so those are read here instead: ``c.goaway`` is set as
    before, header blocks are decoded with the connection's own HPACK decoder, PINGs are acknowledged."""

    def __init__(self, c: WireH2) -> None:
        self.c = c
        self.status: dict[int, int] = {}
        self.ended: set[int] = set()
        self.eof = False
        self._buf = b""

    def read(self, done: Callable[[], bool], timeout: float = 20) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self.eof:
                return False
            self.c.sock.settimeout(min(left, 1.0))
            try:
                data = self.c.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                self.eof = True
                return done()
            self._buf += data
            while len(self._buf) >= 9:
                frame, length = Frame.parse_frame_header(memoryview(self._buf[:9]))
                if len(self._buf) < 9 + length:
                    break
                frame.parse_body(memoryview(self._buf[9:9 + length]))
                self._buf = self._buf[9 + length:]
                self._on(frame)
        return True

    def _on(self, frame: Frame) -> None:
        sid = frame.stream_id
        if isinstance(frame, GoAwayFrame):
            self.c.goaway = (frame.error_code, frame.last_stream_id)
        elif isinstance(frame, HeadersFrame):
            headers = dict(self.c.conn.decoder.decode(frame.data))
            self.status[sid] = int(headers[":status"])
        elif isinstance(frame, RstStreamFrame):
            self.ended.add(sid)
        elif isinstance(frame, PingFrame) and "ACK" not in frame.flags:
            with contextlib.suppress(OSError):
                self.c.sock.sendall(PingFrame(0, frame.opaque_data, flags=["ACK"]).serialize())
        if isinstance(frame, HeadersFrame | DataFrame) and "END_STREAM" in frame.flags:
            self.ended.add(sid)


def finished_or_sent_away(t: RawTail, sid: int, timeout: float = 20) -> None:
    """A request sent before the GOAWAY's last stream id is answered; a later one is the client's to retry."""
    assert t.c.goaway is not None
    if sid <= t.c.goaway[1]:
        assert t.read(lambda: sid in t.ended, timeout=timeout), "an in-flight request was not answered"
        assert t.status.get(sid) == 200, t.status


def test_sigterm_drains_requests_and_watches_and_exits_0(drain_proxy: ProxyProcess) -> None:
    """The proxy SIGTERMed: each worker (told by the parent closing its hand-off socket) sends a graceful
    GOAWAY, answers the requests in flight, serves the open watch until shutdownTimeoutSeconds and ends it,
    and exits 0; so does the proxy."""
    p = drain_proxy
    conns = connect_to_every_worker(p)
    pids = [w["pid"] for w in workers_of(p)]
    assert p.proc is not None
    try:
        watches = watch_on_each(conns)
        in_flight = {c: c.request("/api/v1/namespaces/default") for c in conns}
        p.proc.send_signal(signal.SIGTERM)
        tails = [RawTail(c) for c in conns]
        for t in tails:
            assert t.read(lambda t=t: t.c.goaway is not None), "a connection got no GOAWAY"
            assert t.c.goaway is not None and t.c.goaway[0] == 0  # NO_ERROR: graceful
            finished_or_sent_away(t, in_flight[t.c])
            assert t.c.goaway[1] >= watches[t.c]  # the watch is one of the streams the drain serves
        for t in tails:  # the watch is served until the drain's deadline, then its connection closed
            assert t.read(lambda t=t: t.eof, timeout=30), "a watch's connection outlived the drain"
            t.c.close()  # as a client does when its connection ends: the worker waits for it no longer
        assert p.proc.wait(40) == 0
    finally:
        for c in conns:
            c.close()
    log = p.log.read_text()
    drains = log.count("signal received: draining") + log.count("the hand-off socket closed: draining")
    assert drains == WORKERS, log[-3000:]
    assert "drain deadline: cut" not in log, log[-3000:]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_worker_sigtermed_on_its_own_drains_exits_0_and_is_replaced(drain_proxy: ProxyProcess) -> None:
    """One worker SIGTERMed by itself (as when it is replaced): its connections get a graceful GOAWAY and their
    requests in flight are answered, new connections meanwhile are all served (the parent hands them to the
    other worker), it exits 0 after its drain and is restarted; the other worker's connections carry on
    untouched."""
    p = drain_proxy
    conns = connect_to_every_worker(p)
    try:
        watches = watch_on_each(conns)
        held = per_worker(p, "gatekeeper_proxy_client_connections", protocol="h2")
        victim = workers_of(p)[0]
        in_flight = {c: c.request("/api/v1/namespaces/default") for c in conns}
        os.kill(victim["pid"], signal.SIGTERM)
        wait_for(lambda: p.log.read_text().count("signal received: draining") >= 1, timeout=10,
                 what="the worker to drain")
        tails = [RawTail(c) for c in conns]
        sent_away = [t for t in tails if t.read(lambda t=t: t.c.goaway is not None, timeout=3)]
        assert len(sent_away) == held[victim["index"]], (held, len(sent_away))
        for t in sent_away:
            assert t.c.goaway is not None and t.c.goaway[0] == 0
            finished_or_sent_away(t, in_flight[t.c])
        stayed = [t for t in tails if t not in sent_away]
        for t in stayed:
            sid = in_flight[t.c]
            assert t.read(lambda t=t, sid=sid: sid in t.ended) and t.status.get(sid) == 200
        conns += open_h2(p, 6)  # while it drains: every new connection is served
        for t in sent_away:  # the watch is served until the drain's deadline, then its connection closed
            assert t.read(lambda t=t: t.eof, timeout=30), "a watch's connection outlived the drain"
            t.c.close()
        wait_for(lambda: f"worker {victim['index']} (pid {victim['pid']}) exited with 0" in p.log.read_text(),
                 timeout=30, what="the drained worker to exit 0")
        wait_for(lambda: replaced(p, victim["index"], victim["pid"]), timeout=40,
                 what="the drained worker to be replaced")
        for t in stayed:  # the other worker's watches were not touched, and their connections still serve
            assert t.c.goaway is None and watches[t.c] not in t.ended
            sid = t.c.request("/api/v1/namespaces/default")
            assert t.read(lambda t=t, sid=sid: sid in t.ended) and t.status.get(sid) == 200
    finally:
        for c in conns:
            c.close()
    assert p.stop() == 0
    assert "drain deadline: cut" not in p.log.read_text()


def test_a_worker_draining_on_its_own_is_handed_no_new_connections(proxy: ProxyProcess) -> None:
    """A worker SIGTERMed by itself (not through the parent) drains for up to shutdownTimeoutSeconds. The
    parent used to count it serving all that time: as the least loaded it was handed new connections that
    nobody read, and their clients hung until it exited."""
    conns = connect_to_every_worker(proxy)
    try:
        for c in conns:  # a watch on every connection keeps a drain going
            sid = c.request("/api/v1/namespaces/default/configmaps?watch=1")
            assert c.read_until(lambda c=c, sid=sid: sid in c.status)
        victim = workers_of(proxy)[0]
        os.kill(victim["pid"], signal.SIGTERM)
        wait_for(lambda: workers_of(proxy)[0]["connections"] is None, timeout=10,
                 what="the parent to stop handing the draining worker connections")
        assert workers_of(proxy)[0]["pid"] == victim["pid"], "drained and replaced already: no drain to test"
        before = per_worker(proxy, "gatekeeper_proxy_client_connections", protocol="h2")
        conns += open_h2(proxy, 4)  # each one answered
        after = per_worker(proxy, "gatekeeper_proxy_client_connections", protocol="h2")
        assert after[1] == before[1] + 4, (before, after)
    finally:
        for c in conns:
            c.close()


def test_sigterm_drains_every_worker_with_goaway_and_exits_0(proxy: ProxyProcess) -> None:
    conns = connect_to_every_worker(proxy)
    pids = [w["pid"] for w in workers_of(proxy)]
    assert proxy.proc is not None
    proxy.proc.send_signal(signal.SIGTERM)
    try:
        for c in conns:
            assert c.read_until(lambda c=c: c.goaway is not None, timeout=20), "a connection got no GOAWAY"
            assert c.goaway is not None and c.goaway[0] == 0  # NO_ERROR: graceful
        assert proxy.proc.wait(40) == 0
    finally:
        for c in conns:
            c.close()
    log = proxy.log.read_text()
    # the supervisor closes the hand-off sockets, then sends SIGTERM: a worker drains on whichever it sees first
    drains = log.count("signal received: draining") + log.count("the hand-off socket closed: draining")
    assert drains == WORKERS, log[-2000:]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_handshakes_begun_before_sigterm_finish_and_are_answered_or_sent_away(proxy: ProxyProcess) -> None:
    """Two clients send their ClientHello and have the worker's ServerHello (the worker is in their handshake)
    when the proxy gets SIGTERM; they finish their handshakes after the drain began. Before, the worker cancelled
    both handshakes as it began to drain: each client read an EOF in the middle of its TLS handshake. Now the
    HTTP/1.1 client's request is answered with ``Connection: close`` and the h2 client gets a graceful GOAWAY."""
    h1 = HalfHandshake(proxy.port, proxy.tls(cert=True), alpn="http/1.1")
    h2c = HalfHandshake(proxy.port, proxy.tls(cert=True), alpn="h2")
    assert proxy.proc is not None
    try:
        h1.begin()
        h2c.begin()
        proxy.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: proxy.log.read_text().count("draining") >= WORKERS, timeout=10, what="the workers to drain")
        h1.finish()
        got = h1.exchange(b"GET /api/v1/namespaces/default HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head = got.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 200") and b"connection: close" in head, got[:300]
        h2c.finish()
        events = h2c.h2_events()
        ended = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert ended and ended[0].error_code == 0, events  # a graceful GOAWAY, NO_ERROR
        assert proxy.proc.wait(40) == 0
    finally:
        h1.close()
        h2c.close()
    assert "drain deadline: cut" not in proxy.log.read_text()


def test_a_handshake_in_a_worker_sigtermed_on_its_own_finishes_and_is_answered(proxy: ProxyProcess) -> None:
    """One worker drains (SIGTERMed by itself, as when it is replaced) with a client in its TLS handshake: the
    client finishes it and is answered, while the parent takes back only what the worker had not read."""
    c = HalfHandshake(proxy.port, proxy.tls(cert=True), alpn="http/1.1")
    try:
        c.begin()
        holder = [w for w in workers_of(proxy) if w["connections"] == 1]
        assert len(holder) == 1, workers_of(proxy)
        os.kill(holder[0]["pid"], signal.SIGTERM)
        wait_for(lambda: workers_of(proxy)[holder[0]["index"]]["connections"] is None, timeout=10,
                 what="the worker to drain")
        c.finish()
        got = c.exchange(b"GET /api/v1/namespaces/default HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head = got.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 200") and b"connection: close" in head, got[:300]
    finally:
        c.close()
    wait_for(lambda: replaced(proxy, holder[0]["index"], holder[0]["pid"]), timeout=40,
             what="the drained worker to be replaced")


_SIGTERM_IN_THE_SWAP = """
# sitecustomize for the proxy's processes (test only): a SIGTERM lands the instant a draining worker changes its
# SIGTERM disposition (the loop's handler removed: the default action back; or SIG_IGN set), the window a SIGTERM
# sent to the whole process group (systemd's default KillMode, Ctrl-C's SIGINT, or the supervisor's own SIGTERM
# when it is how a worker is told to drain) could hit. Once per worker; the parent is left alone.
import os, signal, sys
_real = signal.signal
_fired = []

def _signal(sig, handler):
    if (sig == signal.SIGTERM and handler in (signal.SIG_IGN, signal.SIG_DFL) and not _fired
            and "--worker-index" in sys.argv):
        _fired.append(handler)
        old = _real(sig, handler)
        threads = len(os.listdir("/proc/self/task"))
        with open(os.environ["GK_TEST_SWAP_LOG"], "a") as f:
            f.write(f"SIGTERM sent to {os.getpid()} ({threads} threads, handler {handler!r})\\n")
        os.kill(os.getpid(), signal.SIGTERM)
        return old
    return _real(sig, handler)

signal.signal = _signal
"""


def test_a_sigterm_landing_as_a_draining_worker_gives_up_its_handler_does_not_kill_it(
        sandbox: SandboxState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker draining because the parent closed its hand-off socket keeps its SIGTERM handler through the
    drain, then ignores the signal; between removing the loop's handler (the default action back) and SIG_IGN,
    a SIGTERM killed it: exit -15, the proxy 15. Blocking the signal in the main thread across that swap (the
    last fix) did not help: the signal went to one of uvloop's libuv-worker threads (5 threads in all), and the
    default action ended the process. The loop's handler is no longer removed: SIG_IGN replaces it in place."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SIGTERM_IN_THE_SWAP)
    swaps = tmp_path / "swaps.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("GK_TEST_SWAP_LOG", str(swaps))
    p = ProxyProcess(sandbox, tmp_path, name="proxy-swap", workers=WORKERS)
    p.start()
    code = p.stop()
    fired = swaps.read_text() if swaps.exists() else ""
    assert fired.count("SIGTERM sent") == WORKERS, fired  # the hook ran in every worker's swap
    assert code == 0, (fired, processes.tail(p.log))  # before: 15 (each worker died of the signal)


def test_sighup_reaches_every_worker_and_none_dies(proxy: ProxyProcess) -> None:
    before = workers_of(proxy)
    assert proxy.proc is not None
    proxy.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: proxy.log.read_text().count("policy reloaded (SIGHUP)") == WORKERS, timeout=15,
             what="every worker to reload its flow-control policy")
    after = workers_of(proxy)
    assert [w["pid"] for w in after] == [w["pid"] for w in before] and all(w["restarts"] == 0 for w in after)


# ------------------------------------------------------------------ bad configuration, churn and hangs

def workers_serving(p: ProxyProcess) -> dict[int, dict]:
    return {w["index"]: w for w in workers_of(p) if w["metricsUrl"]}


def replaced(p: ProxyProcess, index: int, old_pid: int) -> bool:
    w = workers_serving(p).get(index)
    return w is not None and w["pid"] != old_pid


@pytest.fixture
def churn_proxy(sandbox: SandboxState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ProxyProcess]:
    """Two workers, the seeds' policy in a file of its own (reloaded on SIGHUP only), a metrics directory
    the test can look into, and a short hang timeout."""
    from gatekeeper.proxy.flowcontrol.edge.defaults import SEEDS_POLICY

    policy = tmp_path / "policy.yaml"
    policy.write_text(Path(str(SEEDS_POLICY)).read_text())
    metrics_dir = tmp_path / "metrics"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    p = ProxyProcess(sandbox, tmp_path, name="proxy-churn", workers=WORKERS, user_config={
        "flowControl": {"files": [str(policy)], "reloadIntervalSeconds": 0}, "workerHangSeconds": 3})
    p.start()
    try:
        yield p
    finally:
        p.stop()


def test_a_bad_policy_reload_keeps_every_worker_on_the_old_policy_and_a_good_one_reaches_all(
        churn_proxy: ProxyProcess, tmp_path: Path) -> None:
    p, policy = churn_proxy, tmp_path / "policy.yaml"
    good = policy.read_text()
    assert p.proc is not None
    for broken in ("kind: [\n", good.replace("nominalConcurrencyShares: 1\n", "nominalConcurrencyShares: -1\n")):
        failed = p.metric("gatekeeper_flowcontrol_policy_reloads_total", result="failed")
        policy.write_text(broken)
        p.proc.send_signal(signal.SIGHUP)
        wait_for(lambda failed=failed: p.metric("gatekeeper_flowcontrol_policy_reloads_total", result="failed")
                 == failed + WORKERS, what="every worker to count its failed reload")
        assert p.metric("gatekeeper_flowcontrol_policy_reload_failing") == WORKERS
        assert p.metric("gatekeeper_flowcontrol_nominal_limit_seats", priority_level="secrets-list") == 2
        # still serving, on the old policy, in every worker
        assert httpx.get(f"{p.url}/api/v1/namespaces/default", verify=p.tls(cert=True)).status_code == 200
        assert all(w["restarts"] == 0 for w in workers_of(p))
    assert p.log.read_text().count("keeping the running policy") == 2 * WORKERS
    policy.write_text(good.replace("nominalConcurrencyShares: 1\n", "nominalConcurrencyShares: 3\n"))
    p.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: p.metric("gatekeeper_flowcontrol_policy_reloads_total", result="applied") == WORKERS,
             what="every worker to apply the fixed policy")
    assert p.metric("gatekeeper_flowcontrol_policy_reload_failing") == 0
    levels = per_worker(p, "gatekeeper_flowcontrol_nominal_limit_seats", priority_level="secrets-list")
    assert len(set(levels.values())) == 1 and set(levels.values()) != {2.0}, levels


def test_a_fifo_policy_file_is_refused_by_every_worker_and_a_valid_one_then_applies(
        churn_proxy: ProxyProcess, tmp_path: Path) -> None:
    """The policy path becomes a FIFO nobody writes. Before, each worker's reload thread blocked in open() for
    ever, and the SIGHUP after the file was fixed was queued behind it: no worker ever applied the fix."""
    p, policy = churn_proxy, tmp_path / "policy.yaml"
    good = policy.read_text()
    assert p.proc is not None
    policy.unlink()
    os.mkfifo(policy)
    p.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: p.metric("gatekeeper_flowcontrol_policy_reload_failures_total", reason="not_regular_file")
             == WORKERS, what="every worker to refuse the FIFO")
    assert p.log.read_text().count(f"{policy}: flow-control policy file is a FIFO (named pipe)") == WORKERS
    policy.unlink()
    policy.write_text(good.replace("nominalConcurrencyShares: 1\n", "nominalConcurrencyShares: 3\n"))
    p.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: p.metric("gatekeeper_flowcontrol_policy_reloads_total", result="applied") == WORKERS,
             what="every worker to apply the valid file")
    assert p.metric("gatekeeper_flowcontrol_policy_reload_failing") == 0
    levels = per_worker(p, "gatekeeper_flowcontrol_nominal_limit_seats", priority_level="secrets-list")
    assert len(set(levels.values())) == 1 and set(levels.values()) != {2.0}, levels


ROUNDS = 6


def test_replaced_workers_run_the_started_config_keep_counters_and_leave_bounded_files(
        churn_proxy: ProxyProcess, tmp_path: Path) -> None:
    """The config file is broken after start; each SIGKILLed worker must come back serving (it used to
    re-read the file: exit 2 at every restart), counters never go down, the dead worker's live gauges
    go, and the metrics directory does not grow by two files per restart."""
    p = churn_proxy
    name, labels = "gatekeeper_proxy_requests_total", {"verb": "get", "resource": "namespaces"}
    conns = connect_to_every_worker(p)
    try:
        p.config_path.write_text("proxy: [\n")
        last = p.metric(name, **labels)
        assert last >= len(conns)
        for round_ in range(ROUNDS):
            victim = workers_serving(p)[0]
            others = sum(v for i, v in per_worker(p, "gatekeeper_proxy_client_connections", protocol="h2").items()
                         if i != 0)
            os.kill(victim["pid"], signal.SIGKILL)
            wait_for(lambda victim=victim: replaced(p, 0, victim["pid"]), timeout=30,
                     what=f"worker 0 to serve again after SIGKILL {round_ + 1} (config broken on disk)")
            now = p.metric(name, **labels)
            assert now >= last, f"{name} went back from {last} to {now} after worker 0 was replaced"
            last = now
            if round_ == 0:  # the dead worker's open connections are no longer counted
                assert p.metric("gatekeeper_proxy_client_connections", protocol="h2") == others
            if round_ == 0:
                assert p.proc is not None
                fds = len(os.listdir(f"/proc/{p.proc.pid}/fd"))
        assert workers_of(p)[0]["restarts"] == ROUNDS
        # the parent's descriptors do not grow with restarts (slack for a scrape or heartbeat socket in flight)
        held = [os.readlink(f"/proc/{p.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{p.proc.pid}/fd")]
        assert len(held) <= fds + 2, held
        files = sorted(f.name for f in (tmp_path / "metrics").glob("*.db"))
        # per live worker at most a counter, a histogram and live-gauge files; the two archives; the
        # parent's own counter file (connections it handed over)
        assert len([f for f in files if f.startswith(("counter_", "histogram_"))]) <= 2 * WORKERS + 2 + 1, files
    finally:
        for c in conns:
            c.close()


def test_a_hung_worker_is_killed_and_replaced(churn_proxy: ProxyProcess) -> None:
    p = churn_proxy
    victim = workers_serving(p)[1]
    os.kill(victim["pid"], signal.SIGSTOP)  # alive to waitpid, answers nothing
    try:
        wait_for(lambda: replaced(p, 1, victim["pid"]), timeout=40, what="the stopped worker to be replaced")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["pid"], signal.SIGCONT)
    assert p.metric("gatekeeper_proxy_worker_hung_kills_total", worker="1") == 1
    assert "has not answered /healthz" in p.log.read_text()
    assert httpx.get(f"{p.url}/api/v1/namespaces/default", verify=p.tls(cert=True)).status_code == 200


def test_concurrent_scrapes_of_two_workers_each_see_the_whole_proxy(proxy: ProxyProcess) -> None:
    """Each worker's /metrics fetches the other workers' live pages while its own event loop waits; two
    scrapes landing on two workers at once used to wait for each other until the fetch timed out (both
    stalled, serving nothing, for 2 s), and each page then lacked the other worker's live gauges."""
    import threading

    conns = connect_to_every_worker(proxy)
    try:
        for c in conns:
            sid = c.request("/api/v1/namespaces/default/configmaps?watch=1")
            assert c.read_until(lambda c=c, sid=sid: sid in c.status)
        urls = [w["metricsUrl"] for w in workers_of(proxy)]
        assert len(urls) == WORKERS
        for _ in range(6):
            barrier = threading.Barrier(len(urls))
            pages: dict[str, str] = {}

            def scrape(url: str, barrier: threading.Barrier = barrier, pages: dict[str, str] = pages) -> None:
                barrier.wait()
                pages[url] = get(f"{url}/metrics")

            threads = [threading.Thread(target=scrape, args=(u,)) for u in urls]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            seen = {u: sample_sum(page, "gatekeeper_proxy_backend_watches") for u, page in pages.items()}
            assert seen == {u: float(len(conns)) for u in urls}, seen
    finally:
        for c in conns:
            c.close()


def test_a_stopped_worker_stalls_no_other_worker_and_its_gauges_show_as_missing(proxy: ProxyProcess) -> None:
    """A worker's /metrics waits for the other workers' live pages. With a sibling SIGSTOPped (or hung, until
    workerHangSeconds kills it) that wait blocked the scraped worker's event loop for the 2 s fetch timeout,
    every client of it stalled; both pages then summed the live gauges without the stopped worker's, unsaid."""
    import threading

    workers = workers_of(proxy)
    scraped, victim = workers[0], workers[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        order: list[str] = []
        pages: dict[str, str] = {}

        def scrape() -> None:
            pages["worker"] = get(f"{scraped['metricsUrl']}/metrics")
            order.append("scrape")

        thread = threading.Thread(target=scrape)
        thread.start()
        time.sleep(1.0)  # the scrape now waits for the stopped worker's page (up to 2 s)
        assert get(f"{scraped['metricsUrl']}/healthz") == "ok"
        order.append("healthz")
        thread.join(30)
        assert order == ["healthz", "scrape"], "the scraped worker's event loop stood still during the scrape"
        pages["parent"] = get(f"{proxy.metrics_url}/metrics")
        for where, page in pages.items():
            assert sample_sum(page, "gatekeeper_proxy_worker_page_missing", worker="1") == 1, where
            assert sample_sum(page, "gatekeeper_proxy_worker_page_missing", worker="0") == 0, where
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
    wait_for(lambda: sample_sum(proxy.metrics(), "gatekeeper_proxy_worker_page_missing") == 0,
             what="the resumed worker's page back in the sums")


def test_new_connections_pass_over_a_stopped_worker(proxy: ProxyProcess) -> None:
    """least-connections took a SIGSTOPped worker for a peer (its unread connections counted as its load) and
    handed it every other new connection, each hanging until workerHangSeconds killed the worker. Then the one
    handed to it before it was seen unread still hung (a descriptor sent could not be taken back): the
    supervisor now takes it back from the worker's socket and another worker serves it."""
    victim = workers_of(proxy)[1]
    os.kill(victim["pid"], signal.SIGSTOP)
    outcomes: list[object] = []
    clients: list[httpx.Client] = []
    try:
        for _ in range(8):
            # A new client, so a new connection, kept open as a controller's is: the running worker's load
            # grows, and before, the stopped worker became the least loaded every other time.
            clients.append(httpx.Client(verify=proxy.tls(cert=True), timeout=3))
            try:
                outcomes.append(clients[-1].get(f"{proxy.url}/api/v1/namespaces/default").status_code)
            except httpx.TimeoutException:
                outcomes.append("timeout")
            time.sleep(0.1)
        stalls = proxy.metric("gatekeeper_proxy_handoff_stalls_total", worker="1")
        taken_back = proxy.metric("gatekeeper_proxy_handoff_taken_back_total", worker="1")
        handed = proxy.metric("gatekeeper_proxy_connections_handed_off_total", worker="1")
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
        for c in clients:
            c.close()
    assert outcomes == [200] * 8, outcomes  # before: one timeout, the connection handed over just as it stopped
    assert handed >= 1 and taken_back == handed, (handed, taken_back)  # each handed to it went to worker 0
    assert stalls == 1, stalls  # one stall: it never read in between


def test_workers_follow_a_sigkilled_parent_and_the_next_start_removes_its_directories(
    sandbox: SandboxState, churn_proxy: ProxyProcess, tmp_path: Path,
) -> None:
    """PR_SET_PDEATHSIG: no worker is left holding the port (and seats) after the parent is SIGKILLed. The
    runtime directory the parent could not remove goes at the next supervisor's start
    (gatekeeper/runtime/tempdirs.py)."""
    pids = [w["pid"] for w in workers_of(churn_proxy)]
    argv = Path(f"/proc/{pids[0]}/cmdline").read_text().split("\0")
    runtime = Path(argv[argv.index("--runtime-dir") + 1])
    assert runtime.is_dir()
    assert churn_proxy.proc is not None
    churn_proxy.proc.kill()
    churn_proxy.proc.wait(10)

    def gone(pid: int) -> bool:
        try:
            return "zombie" in Path(f"/proc/{pid}/status").read_text() or "(Z)" in Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True

    wait_for(lambda: all(gone(pid) for pid in pids), timeout=40, what="the orphaned workers to exit")
    assert runtime.is_dir()  # nobody could remove it
    (tmp_path / "next").mkdir()
    successor = ProxyProcess(sandbox, tmp_path / "next", name="proxy-successor", workers=WORKERS)
    successor.start()
    try:
        assert not runtime.exists(), f"{runtime} left behind by the SIGKILLed supervisor"
    finally:
        assert successor.stop() == 0


def test_the_connection_cap_is_the_whole_proxys_not_each_workers(sandbox: SandboxState, tmp_path: Path) -> None:
    """maxClientConnections 3 with 2 workers: each worker alone would take 3 (6 in all). The parent counts the
    connections open in both and closes the fourth at accept, counted as connection_cap; a slot freed by a
    closed connection is taken again."""
    p = ProxyProcess(sandbox, tmp_path, name="proxy-cap", workers=WORKERS,
                     user_config={"listener": {"maxClientConnections": 3}})
    p.start()
    conns: list[WireH2] = []
    try:
        conns = open_h2(p, 3)
        wait_for(lambda: sum(w.get("connections") or 0 for w in workers_of(p)) == 3, timeout=10,
                 what="the parent to count 3 open connections")
        with pytest.raises((OSError, AssertionError)):  # the TLS handshake meets a socket the parent closed
            conns += open_h2(p, 1)
        wait_for(lambda: p.metric("gatekeeper_proxy_rejected_total", reason="connection_cap") >= 1, timeout=10,
                 what="the refusal to be counted")
        conns.pop().close()
        wait_for(lambda: sum(w.get("connections") or 0 for w in workers_of(p)) == 2, timeout=10,
                 what="the closed connection to be counted")
        conns += open_h2(p, 1)
    finally:
        for c in conns:
            c.close()
        assert p.stop() == 0
