"""Start, probe and stop sandbox processes by pid.

Every process gets its own session (``start_new_session``), so its pid is also
its process-group id and ``stop`` can take down anything it forked. Before
signalling a recorded pid we check that the live process still runs the
recorded binary: pids are reused, and ``down`` must never kill a stranger.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import random
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gatekeeper.sandbox.state import ProcessRecord

_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


@functools.cache
def _below_ephemeral() -> tuple[int, int]:
    """The ports under the kernel's ephemeral range: never a local port of an outgoing connection."""
    try:
        low = int(_PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return (10000, low - 1) if low > 12000 else (1024, max(1025, low - 1))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that binds right now, chosen below the kernel's ephemeral range.

    Why not ``bind(0)``: the kernel hands that a port from the ephemeral range, the range every
    outgoing connection takes its local port from. Under a load test making thousands of
    connections one of them took the port between this check and the server's own bind
    (EADDRINUSE in CI). Below the range only another explicit bind can race, and this process
    never hands the same port out twice.
    """
    low, high = _below_ephemeral()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(500):
        port = random.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    ports: Mapping[str, int] | None = None,
    urls: Mapping[str, str] | None = None,
    health: str = "",
    cgroup: str = "",
) -> ProcessRecord:
    """Start ``argv`` detached in its own session, stdout+stderr appended to ``log``; with ``cgroup``, inside
    that cgroup from before its first instruction (the child moves itself in, then execs)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update(env or {})
    enter = None
    if cgroup:
        procs = Path(cgroup) / "cgroup.procs"

        def enter() -> None:
            procs.write_text(str(os.getpid()))

    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=full_env, cwd=cwd, start_new_session=True, close_fds=True, preexec_fn=enter,
        )
    return ProcessRecord(
        name=name, pid=proc.pid, cmd=list(argv), log=str(log), ports=dict(ports or {}),
        urls=dict(urls or {}), health=health, env=dict(env or {}), cgroup=cgroup,
    )


def _reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our child, so it does not linger as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_alive(pid: int) -> bool:
    """Running and not a zombie."""
    _reap(pid)
    try:
        os.kill(pid, 0)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            return False
    state = _proc_state(pid)
    return state is not None and state not in ("Z", "X")


def is_ours(rec: ProcessRecord, settle: float = 1.0) -> bool:
    """The pid is alive and still runs the binary we started (guards against pid reuse).

    Popen returns (vfork) while the child is still inside execve: for a moment its cmdline is
    empty or still the parent's. A mismatch is therefore re-read for up to ``settle`` seconds
    before the process is declared a stranger; otherwise a ``down`` racing a fresh start
    would report "not running" and leave it behind.
    """
    if not is_alive(rec.pid):
        return False
    if not rec.cmd:
        return True
    want = Path(rec.cmd[0]).name
    deadline = time.monotonic() + settle
    while True:
        try:
            argv0 = Path(f"/proc/{rec.pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
        except OSError:
            return False
        if Path(argv0).name == want:
            return True
        if time.monotonic() >= deadline or not is_alive(rec.pid):
            return False
        time.sleep(0.02)


def _signal(rec: ProcessRecord, sig: signal.Signals) -> None:
    try:
        try:
            leader_group = os.getpgid(rec.pid)
        except ProcessLookupError:  # leader gone: signal what is left of its group (see _orphaned)
            os.killpg(rec.pid, sig)
            return
        if leader_group == rec.pid:
            os.killpg(rec.pid, sig)
        else:
            os.kill(rec.pid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """Any live member of the process group (children a component forked)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == pgid and is_alive(int(entry.name)):
                return True
        except OSError:
            continue
    return False


@dataclass
class StopResult:
    """What happened to one process on ``stop``."""

    name: str
    pid: int
    outcome: str
    """``stopped`` (SIGTERM), ``killed`` (needed SIGKILL), ``not running``, or ``SURVIVED``."""


def _orphaned(rec: ProcessRecord) -> bool:
    """The recorded process is gone but children it forked still run in its group.

    Safe to signal: Linux does not hand out a pid again while a process group of that id exists, so
    members of group ``rec.pid`` whose leader is dead can only be descendants of what we started
    (a crashed ``webhook --workers`` parent leaves its workers exactly like this).
    """
    return not is_alive(rec.pid) and _group_alive(rec.pid)


def stop(records: Iterable[ProcessRecord], *, grace: float = 10.0) -> list[StopResult]:
    """SIGTERM every group, wait up to ``grace`` seconds, then SIGKILL; verify none is left."""
    recs = list(records)
    live = [r for r in recs if is_ours(r) or _orphaned(r)]
    results = {r.name: StopResult(r.name, r.pid, "not running") for r in recs}
    for r in live:
        _signal(r, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(is_alive(r.pid) or _group_alive(r.pid) for r in live):
        time.sleep(0.1)
    for r in live:
        if is_alive(r.pid) or _group_alive(r.pid):
            _signal(r, signal.SIGKILL)
            results[r.name].outcome = "killed"
        else:
            results[r.name].outcome = "stopped"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(is_alive(r.pid) or _group_alive(r.pid) for r in live):
        time.sleep(0.1)
    for r in live:
        if is_alive(r.pid) or _group_alive(r.pid):
            results[r.name].outcome = "SURVIVED"
    return [results[r.name] for r in recs]


class WaitFailed(Exception):
    """:func:`poll_until` gave up: the process exited (``exited``) or time ran out; ``detail`` is the last check."""

    def __init__(self, detail: str, *, exited: bool) -> None:
        super().__init__(detail)
        self.detail = detail
        self.exited = exited


def poll_until(check: Callable[[], tuple[bool, str]], timeout: float, *, pid: int | None = None,
               interval: float = 0.5) -> None:
    """Call ``check`` until it passes; fail fast (``exited``) once ``pid`` is gone, else at ``timeout``."""
    deadline = time.monotonic() + timeout
    detail = "not checked yet"
    while True:
        if pid is not None and not is_alive(pid):
            raise WaitFailed(detail, exited=True)
        ok, detail = check()
        if ok:
            return
        if time.monotonic() > deadline:
            raise WaitFailed(detail, exited=False)
        time.sleep(interval)


@dataclass(frozen=True)
class TLSFiles:
    """CA to verify servers with, and the client certificate to present."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None


def probe(url: str, tls: TLSFiles | None = None, timeout: float = 3.0) -> tuple[bool, str]:
    """GET ``url``; healthy means HTTP 200. Returns (ok, short detail for humans)."""
    ctx = None
    if url.startswith("https://"):
        ctx = ssl.create_default_context(cafile=str(tls.ca) if tls else None)
        if tls and tls.cert and tls.key:
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
            body = resp.read(200).decode(errors="replace").strip()
            return resp.status == 200, f"{resp.status} {body}"
    except urllib.error.HTTPError as exc:
        return False, f"{exc.code} {exc.read(300).decode(errors='replace').strip()}"
    except (OSError, ssl.SSLError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def listening(port: int, host: str = "127.0.0.1") -> tuple[bool, str]:
    """Whether something accepts TCP connections on ``host:port`` (a TCP front has no health page)."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True, f"{host}:{port} accepts connections"
    except OSError as exc:
        return False, f"{host}:{port}: {exc}"


def tail(path: str | Path, lines: int = 30) -> str:
    try:
        data = Path(path).read_bytes()[-20000:]
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def rss_kib(pid: int) -> int | None:
    """Resident set size from /proc/<pid>/status, for the idle-RSS figures."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
