"""Helpers for pytest suites that drive a sandbox (used by ``tests/conftest.py``).

They live in the package, not in a conftest, so any test module can import them
without relying on how pytest puts conftest files on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.events
import httpx
import yaml

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import processes
from gatekeeper.sandbox.pki import SandboxPKI, write_kubeconfig
from gatekeeper.sandbox.state import STATE_FILE, SandboxState
from gatekeeper.sandbox.with_proxy import build_config

Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]
"""``kubectl(*args, kubeconfig=None, input=None, timeout=60, check=False)`` as the fixture provides it."""
UP_TIMEOUT = 900
"""Upper bound for a whole ``up`` (a loaded 2-core machine is slow; a healthy up takes ~15 s)."""


class SandboxUpFailed(Exception):
    """``sandbox up`` exited non-zero; the message holds its output and what ``down`` stopped."""


def kubectl_binary(state: SandboxState) -> str:
    """``GATEKEEPER_TEST_KUBECTL`` (e.g. ``kubectl`` from PATH), else the sandbox's own v1.37 build."""
    return os.environ.get("GATEKEEPER_TEST_KUBECTL") or str(state.extra.get("kubectl") or "kubectl")


def gatekeeper_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess (the way operators and CI do)."""
    return subprocess.run([sys.executable, "-m", "gatekeeper", *args], capture_output=True, text=True,
                          timeout=timeout)


def run_down(state_dir: Path) -> subprocess.CompletedProcess[str] | None:
    if not (state_dir / STATE_FILE).exists():
        return None
    return gatekeeper_cli("sandbox", "down", "--state-dir", str(state_dir))


def sandbox_up(state_dir: Path, *extra: str) -> SandboxState:
    """Run ``sandbox up``; on failure (or interrupt) run ``down`` and raise with the output."""
    argv = ["sandbox", "up", "--state-dir", str(state_dir), *extra]
    try:
        proc = gatekeeper_cli(*argv, timeout=UP_TIMEOUT)
    except BaseException:
        run_down(state_dir)
        raise
    if proc.returncode != 0:
        down = run_down(state_dir)
        raise SandboxUpFailed(
            f"`gatekeeper {' '.join(argv)}` exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
            f"--- stderr\n{proc.stderr}\n--- down\n{down.stdout if down else '(nothing to stop)'}"
        )
    return SandboxState.load(state_dir)


@contextlib.contextmanager
def webhook_sandbox(state_dir: Path, webhook_config: str, up: Callable[..., SandboxState],
                    *flags: str) -> Iterator[SandboxState]:
    """A module's own sandbox whose webhook runs ``webhook_config`` (YAML with a ``webhook:`` section):
    ``up(state_dir, *flags, --with-webhook, --webhook-config FILE)``, and ``down`` afterwards whatever happened.

    ``up`` is the ``own_sandbox`` fixture (tests/conftest.py), which fails the test if the sandbox cannot start."""
    config = state_dir.parent / f"{state_dir.name}-webhook.yaml"
    config.write_text(webhook_config)
    try:
        yield up(state_dir, *flags, "--with-webhook", "--webhook-config", str(config))
    finally:
        run_down(state_dir)


def admin_client(state: SandboxState, url: str | None = None, timeout: float = 120) -> httpx.AsyncClient:
    """An async HTTP client to apiserver ``url`` (default the first) as the sandbox admin (system:masters)."""

    certs = SandboxPKI(Path(state.certs_dir))
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    ctx.load_cert_chain(str(certs.crt("admin")), str(certs.key("admin")))
    return httpx.AsyncClient(base_url=url or state.apiserver_urls[0], verify=ctx, timeout=timeout)


def processes_mentioning(directory: Path) -> list[int]:
    """Every live process whose command line mentions ``directory``: what ``down`` must leave at zero."""
    needle = str(directory).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() and processes.is_alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


class ProxyProcess:
    """A private ``gatekeeper proxy`` subprocess in front of a sandbox's apiservers.

    Configured by the same :func:`gatekeeper.sandbox.with_proxy.build_config` as
    ``sandbox up --with-proxy`` (``user_config`` merged under the keys the sandbox
    owns), so a test module can run a proxy with its own settings without
    disturbing the shared sandbox. ``kubeconfig`` is the admin's, pointed at it.
    """

    def __init__(self, state: SandboxState, workdir: Path, *, name: str = "proxy-test",
                 backends: list[str] | None = None, user_config: dict[str, Any] | None = None,
                 goaway_chance: float | None = None, health_interval: float | None = None,
                 workers: int | None = None) -> None:
        serving = PKI(state.certs_dir).issue_serving(f"{name}-{uuid.uuid4().hex[:6]}", dns=["localhost"],
                                                     ips=["127.0.0.1"])
        self.port, self.metrics_port = processes.free_port(), processes.free_port()
        view = SandboxState(dir=state.dir, certs_dir=state.certs_dir,
                            apiserver_urls=backends or list(state.apiserver_urls))
        config = build_config(view, port=self.port, metrics_port=self.metrics_port, serving_cert=serving.cert,
                              serving_key=serving.key, goaway_chance=goaway_chance, user_config=user_config or {},
                              workers=workers)
        if health_interval is not None:
            config["proxy"]["upstream"]["healthIntervalSeconds"] = health_interval
        self.config_path = workdir / "proxy.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log = workdir / "proxy.log"
        self.url = f"https://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        certs = SandboxPKI(Path(state.certs_dir))
        self.kubeconfig = write_kubeconfig(workdir / "proxy.kubeconfig", certs, "admin", self.url)
        self.ca = str(certs.ca)
        self.admin_cert = (str(certs.crt("admin")), str(certs.key("admin")))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60, env: Mapping[str, str] | None = None) -> None:
        """Start it and wait for ``/readyz``; fails with the log's tail if it exits or is not ready in time.

        ``env`` is added to this process's environment for the proxy alone (a benchmark's other tree on
        ``PYTHONPATH``, an allocator setting), so callers need not change their own environment around it."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gatekeeper", "proxy", "--config",
                                          str(self.config_path)], stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={**os.environ, **env} if env else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"proxy exited: {processes.tail(self.log)}"
            ok, _ = processes.probe(f"{self.metrics_url}/readyz")
            if ok:
                return
            time.sleep(0.2)
        raise AssertionError(f"proxy not ready: {processes.tail(self.log)}")

    def stop(self, timeout: float = 40) -> int | None:
        """SIGTERM (drain), SIGKILL after ``timeout`` seconds; the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def tls(self, *, cert: bool = False) -> ssl.SSLContext:
        """Client TLS context (httpx ignores ``cert=`` when ``verify`` is a path, so build it here)."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if cert:
            ctx.load_cert_chain(*self.admin_cert)
        return ctx

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        return metric_sum(self.metrics(), name, **labels)


_LABEL_VALUE = r'"(?:[^"\\]|\\.)*"'
_SAMPLE = re.compile(
    rf"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{{(?P<labels>(?:[^\"}}]|{_LABEL_VALUE})*)\}})?\s+(?P<value>\S+)", re.M)
"""One sample line; a quoted label value may hold ``}``, ``,`` and escaped quotes."""


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text format).

    The one parser of metric pages for tests and bench scripts (a label value may hold escaped quotes)."""
    total = 0.0
    for m in _SAMPLE.finditer(text):
        if m.group("name") != name:
            continue
        have = {k: v[1:-1] for k, v in re.findall(rf"(\w+)=({_LABEL_VALUE})", m.group("labels") or "")}
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group("value"))
    return total


def is_cut(sock: socket.socket, timeout: float) -> bool:
    """True when the peer closes or resets ``sock`` within ``timeout`` (False if it stays open)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def handshake_held_up(pid: int, port: int, ca: str, *, server_hostname: str, request: bytes,
                      stall: float) -> str:
    """The status line a TLS server answers ``request`` with after it was stopped in the middle of the handshake.

    Stands in for a server starved of CPU: connect, give the server 0.3 s to accept and arm its handshake
    deadline, SIGSTOP it, let the ClientHello go out (it waits unread in the server's buffer) and SIGCONT it
    ``stall`` seconds later. Raises the client's error (OSError, ssl.SSLError) if the server cut the connection.
    """
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    time.sleep(0.3)
    status: list[str] = []
    errors: list[BaseException] = []

    def client() -> None:
        ctx = ssl.create_default_context(cafile=ca)
        ctx.set_alpn_protocols(["http/1.1"])
        try:
            raw.settimeout(20)
            with ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
                tls.sendall(request)
                status.append(tls.recv(64).split(b"\r\n", 1)[0].decode())
        except (OSError, ssl.SSLError) as exc:
            errors.append(exc)

    os.kill(pid, signal.SIGSTOP)
    try:
        thread = threading.Thread(target=client)
        thread.start()
        time.sleep(stall)
    finally:
        os.kill(pid, signal.SIGCONT)
    thread.join(30)
    if errors:
        raise errors[0]
    return status[0] if status else ""


class HalfHandshake:
    """A TLS client that stops between its ClientHello and the rest of the handshake, for drain tests.

    :meth:`begin` connects, sends the ClientHello and waits for the server's first flight (ServerHello ...):
    the server has then read the connection and is in the middle of its handshake. :meth:`finish` completes
    the handshake (raising the client's error if the server cut it), :meth:`exchange` sends bytes and reads
    until the server closes. A blocking socket and ``ssl.MemoryBIO``: usable from a thread beside an event loop.
    """

    def __init__(self, port: int, ctx: ssl.SSLContext, *, server_hostname: str = "localhost",
                 alpn: str = "http/1.1", timeout: float = 20.0) -> None:
        ctx.set_alpn_protocols([alpn])
        self.port = port
        self.timeout = timeout
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self._in, self._out, server_hostname=server_hostname)
        self.sock: socket.socket | None = None
        self._held = b""

    def begin(self) -> None:
        self.sock = socket.create_connection(("127.0.0.1", self.port), self.timeout)
        with contextlib.suppress(ssl.SSLWantReadError):
            self.tls.do_handshake()
        self.sock.sendall(self._out.read())
        self._held = self.sock.recv(65536)  # the server's first flight: it is in its handshake now
        if not self._held:
            raise ConnectionResetError("the server closed the connection before answering the ClientHello")

    def finish(self) -> None:
        assert self.sock is not None
        data, self._held = self._held, b""
        while True:
            self._in.write(data)
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                self.sock.sendall(self._out.read())
                data = self.sock.recv(65536)
                if not data:
                    raise ssl.SSLEOFError("EOF in the middle of the TLS handshake") from None
                continue
            self.sock.sendall(self._out.read())
            return

    def exchange(self, request: bytes, until: Callable[[bytes], bool] = lambda got: False) -> bytes:
        """Send ``request``; what the server sends back until ``until(received)``, it closes, or the timeout."""
        assert self.sock is not None
        self.tls.write(request)
        self.sock.sendall(self._out.read())
        got = b""
        deadline = time.monotonic() + self.timeout
        while not until(got) and time.monotonic() < deadline:
            try:
                data = self.tls.read(65536)
                if not data:  # the server's close_notify
                    return got
                got += data
                continue
            except ssl.SSLWantReadError:
                pass
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return got
            out = self._out.read()
            if out:
                self.sock.sendall(out)
            data = self.sock.recv(65536)
            if not data:
                return got
            self._in.write(data)
        return got

    def h2_events(self) -> list[Any]:
        """Send an h2 client preface; the ``h2`` events the server's answer makes, up to its GOAWAY
        (``h2.events.ConnectionTerminated``) if one comes before it closes or the timeout."""

        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        events: list[Any] = []
        seen = 0

        def ended(got: bytes) -> bool:
            nonlocal seen
            events.extend(conn.receive_data(got[seen:]))  # h2 keeps a partial frame for the next call
            seen = len(got)
            return any(isinstance(e, h2.events.ConnectionTerminated) for e in events)

        self.exchange(conn.data_to_send(), ended)
        return events

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


class WireH2:
    """A bare HTTP/2 client on a blocking TLS socket, for tests that must see frames.

    It records every GOAWAY and never grants flow-control window beyond the initial
    64 KiB, so a large response stalls inside the proxy: the request keeps its
    flow-control seats for as long as the test wants.
    """

    def __init__(self, url: str, ctx: ssl.SSLContext, timeout: float = 10.0) -> None:
        parts = urlsplit(url)
        self.host, port = parts.hostname or "127.0.0.1", parts.port or 443
        ctx.set_alpn_protocols(["h2"])
        raw = socket.create_connection((self.host, port), timeout)
        self.sock = ctx.wrap_socket(raw, server_hostname=self.host)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.status: dict[int, int] = {}
        self.ended: set[int] = set()
        self.goaway: tuple[int, int] | None = None
        """(error code, last stream id) of the server's GOAWAY."""
        self.closed = False

    def request(self, path: str, method: str = "GET") -> int:
        sid = int(self.conn.get_next_available_stream_id())
        self.conn.send_headers(sid, [(":method", method), (":path", path), (":scheme", "https"),
                                     (":authority", self.host)], end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        return sid

    def read_until(self, done: Callable[[], bool], timeout: float = 10.0) -> bool:
        """Read frames until ``done()`` or the connection closes; True if ``done()``."""

        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                return False
            self.sock.settimeout(min(left, 1.0))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                self.closed = True
                return done()
            for ev in self.conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    headers: dict[Any, Any] = dict(ev.headers or [])
                    self.status[int(ev.stream_id or 0)] = int(headers[":status"])
                elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                    self.ended.add(int(ev.stream_id or 0))
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    self.goaway = (int(ev.error_code or 0), int(ev.last_stream_id or 0))
            out = self.conn.data_to_send()
            if out:
                with contextlib.suppress(OSError):
                    self.sock.sendall(out)
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        self.closed = True
