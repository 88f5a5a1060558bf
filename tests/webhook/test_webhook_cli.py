"""`gatekeeper webhook` as a real process: uvloop, certificate rotation, --workers 2, config errors."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from prometheus_client.multiprocess import MultiProcessCollector
from review_fixtures import container, pod, review

from gatekeeper.certs.pki import PKI, load_cert
from gatekeeper.sandbox.testing import handshake_held_up, is_cut


def listening_sockets(port: int) -> int:
    """TCP sockets in LISTEN state on ``port`` (each SO_REUSEPORT worker has its own)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for row in f.readlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                count += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return count


@pytest.fixture
def pki(tmp_path: Path) -> PKI:
    p = PKI(tmp_path / "pki")
    p.init()
    p.issue_serving("webhook", ips=["127.0.0.1"])
    return p


def write_config(tmp_path: Path, pki: PKI, extra: str = "") -> Path:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "webhook:\n  server:\n    port: 0\n    certCheckIntervalSeconds: 0\n"
        f"    certFile: {pki.cert_path('webhook')}\n    keyFile: {pki.key_path('webhook')}\n"
        "  gpu:\n    defaultMode: time-slicing\n" + extra
    )
    return cfg


@pytest.fixture
def start(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    procs: list[subprocess.Popen[bytes]] = []

    def run(cfg: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
        port_file = tmp_path / f"port-{len(procs)}"
        proc = subprocess.Popen([sys.executable, "-m", "gatekeeper", "webhook", "--config", str(cfg),
                                 "--port-file", str(port_file), *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                env=env)
        procs.append(proc)
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"webhook did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.05)
        port = int(port_file.read_text())
        workers = int(args[args.index("--workers") + 1]) if "--workers" in args else 1
        while listening_sockets(port) < workers:  # the first worker wrote the file; wait for the others
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{workers} webhook workers did not all listen on {port}")
            time.sleep(0.05)
        return proc, port

    yield run
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)


def tls_get_serial(port: int, ca: Path) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def post(port: int, ca: Path, path: str, body: bytes) -> tuple[int, bytes]:
    import http.client

    ctx = ssl.create_default_context(cafile=str(ca))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    conn.request("POST" if body else "GET", path, body=body or None,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def test_rotated_certificate_is_served_to_new_connections(tmp_path: Path, pki: PKI, start) -> None:
    _, port = start(write_config(tmp_path, pki))
    ca = pki.cert_path("ca")
    first = tls_get_serial(port, ca)
    assert first == load_cert(pki.cert_path("webhook")).serial_number
    time.sleep(0.05)
    rotated = pki.issue_serving("webhook", ips=["127.0.0.1"])
    st = os.stat(rotated.cert)
    os.utime(rotated.cert, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = tls_get_serial(port, ca)
    assert second == load_cert(rotated.cert).serial_number != first
    status, _ = post(port, ca, "/healthz", b"")
    assert status == 200


def test_two_workers_share_the_port_and_report_all_reviews(tmp_path: Path, pki: PKI, start) -> None:
    samples = tmp_path / "multiproc"
    samples.mkdir()
    proc, port = start(write_config(tmp_path, pki), "--workers", "2",
                       env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(samples)})
    children = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(set(children) - {str(proc.pid)}) == 2
    ca = pki.cert_path("ca")
    n = 40
    for _ in range(n):  # a new connection each time: the kernel spreads them over both workers
        status, body = post(port, ca, "/mutate", orjson.dumps(review(pod(container("m", 1)), kind="Pod")))
        assert status == 200 and orjson.loads(body)["response"]["patchType"] == "JSONPatch"
    totals = []
    for _ in range(4):  # whichever worker answers /metrics, it reports both workers' counts
        _, text = post(port, ca, "/metrics", b"")
        line = next(x for x in text.decode().splitlines()
                    if x.startswith('gatekeeper_webhook_gpu_rewrites_total{mode="time-slicing"}'))
        totals.append(float(line.split()[-1]))
    assert totals == [n] * 4
    # ...and the sum is really of two workers: each one's own sample file holds part of the reviews.
    per_worker = {}
    for path in samples.glob("counter_*.db"):
        for metric in MultiProcessCollector.merge([str(path)]):
            per_worker[path.stem] = per_worker.get(path.stem, 0.0) + sum(
                s.value for s in metric.samples
                if s.name == "gatekeeper_webhook_gpu_rewrites_total" and s.labels.get("mode") == "time-slicing")
    served = {k: v for k, v in per_worker.items() if v}
    assert len(served) == 2 and sum(served.values()) == n, per_worker


def test_missing_certificate_config_is_a_one_line_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("webhook:\n  gpu:\n    defaultMode: dra\n")
    p = subprocess.run([sys.executable, "-m", "gatekeeper", "webhook", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "certFile and keyFile are required" in p.stderr
    assert "Traceback" not in p.stderr
    cfg.write_text("webhook:\n  gpu:\n    defaultMode: fast\n")
    p = subprocess.run([sys.executable, "-m", "gatekeeper", "webhook", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "webhook.gpu.defaultMode" in p.stderr


def run_webhook(cfg: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gatekeeper", "webhook", "--config", str(cfg), *args],
                          capture_output=True, text=True, timeout=60)


def test_unloadable_certificate_is_a_one_line_error_naming_the_setting(tmp_path: Path, pki: PKI) -> None:
    bad = tmp_path / "bad.crt"
    bad.write_text("not a certificate\n")
    cfg = write_config(tmp_path, pki)
    cfg.write_text(cfg.read_text().replace(str(pki.cert_path("webhook")), str(bad)))
    p = run_webhook(cfg)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "webhook.server.certFile/keyFile" in p.stderr and str(bad) in p.stderr


def test_check_exits_without_listening_and_reports_what_start_would_refuse(tmp_path: Path, pki: PKI) -> None:
    """``--check`` on a good config: exit 0 with the limits in force, and no socket ever bound; on a serving key
    that is not its certificate's (both files exist): the start-up error, exit 2."""
    cfg = write_config(tmp_path, pki)
    p = run_webhook(cfg, "--check")  # a webhook that served instead would not exit: run_webhook's timeout
    assert p.returncode == 0, p.stderr
    assert "secrets: hardLimit 128Ki" in p.stdout and "gpu: defaultMode time-slicing" in p.stdout
    pki.issue_serving("other", ips=["127.0.0.1"])
    cfg.write_text(cfg.read_text().replace(str(pki.key_path("webhook")), str(pki.key_path("other"))))
    p = run_webhook(cfg, "--check")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "webhook.server.certFile/keyFile" in p.stderr


def test_out_of_range_port_is_refused_not_wrapped_around(tmp_path: Path, pki: PKI) -> None:
    cfg = write_config(tmp_path, pki)
    cfg.write_text(cfg.read_text().replace("port: 0", "port: 70000"))
    p = run_webhook(cfg)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "webhook.server: port must be 0..65535" in p.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_port_already_taken_is_a_one_line_error(tmp_path: Path, pki: PKI, workers: str) -> None:
    with socket.socket() as taken:  # a plain listener without SO_REUSEPORT: nobody may share it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path, pki)
        cfg.write_text(cfg.read_text().replace("port: 0", f"port: {port}"))
        p = run_webhook(cfg, "--workers", workers)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"webhook.server: cannot listen on 127.0.0.1:{port}" in p.stderr


def test_missing_kubeconfig_is_named(tmp_path: Path, pki: PKI) -> None:
    cfg = write_config(tmp_path, pki, f"  kubeconfig: {tmp_path / 'nope'}\n")
    p = run_webhook(cfg)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert f"webhook.kubeconfig: {tmp_path / 'nope'} does not exist" in p.stderr


def test_bad_size_names_the_key(tmp_path: Path, pki: PKI) -> None:
    cfg = write_config(tmp_path, pki, "  secrets:\n    softLimit: lots\n")
    p = run_webhook(cfg)
    assert p.returncode == 2 and "webhook.secrets: softLimit: expected a size" in p.stderr, p.stderr


def _metric(port: int, ca: Path, line_prefix: str) -> float:
    _, text = post(port, ca, "/metrics", b"")
    return next((float(x.split()[-1]) for x in text.decode().splitlines() if x.startswith(line_prefix)), 0.0)


def test_the_process_closes_unfinished_heads_past_its_request_budget_and_keeps_answering(
        tmp_path: Path, pki: PKI, start) -> None:
    """The real process (uvloop, the CLI's config): unfinished heads, each within maxHeaderFields and
    maxHeaderFieldBytes, past maxBufferedRequestBytes are closed and counted, and a review is still answered.
    Bounded: 8 connections of 96 KB on 127.0.0.1."""
    cfg = write_config(tmp_path, pki).read_text().replace(
        "    certCheckIntervalSeconds: 0\n", "    certCheckIntervalSeconds: 0\n    maxBufferedRequestBytes: 300000\n")
    (tmp_path / "config.yaml").write_text(cfg)
    _, port = start(tmp_path / "config.yaml")
    ca = pki.cert_path("ca")
    counter = 'gatekeeper_webhook_refused_connections_total{reason="request-budget"}'
    ctx = ssl.create_default_context(cafile=str(ca))
    head = b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n" + b"".join(
        b"X-Pad-%02d: %s\r\n" % (i, b"p" * 8000) for i in range(12))
    held = []
    try:
        for _ in range(8):
            raw = socket.create_connection(("127.0.0.1", port), timeout=10)
            tls = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            with contextlib.suppress(OSError):  # an earlier one may be cut while this one is sent
                tls.sendall(head)
            held.append(tls)
        deadline = time.monotonic() + 20
        while _metric(port, ca, counter) < 5:  # 8 x 96 KB against 300 KB: at most 3 may stay
            assert time.monotonic() < deadline, "unfinished heads past maxBufferedRequestBytes were not closed"
            time.sleep(0.1)
        status, body = post(port, ca, "/mutate", orjson.dumps(review(pod(container("m", 1)), kind="Pod")))
        assert status == 200 and orjson.loads(body)["response"]["allowed"]
    finally:
        for tls in held:
            tls.close()


def test_a_handshake_the_stalled_worker_held_up_completes_and_a_silent_one_is_cut(
        tmp_path: Path, pki: PKI, start) -> None:
    """SIGSTOP stands in for a worker starved of CPU: the client's ClientHello waits, unread, past
    tlsHandshakeTimeoutSeconds. The loop's own handshake timer (it runs before sockets are read) cut such a
    client, an apiserver connection among them; accept.py gives it another period. A client that sends
    nothing is still cut and counted."""
    period = 0.5
    cfg = write_config(tmp_path, pki).read_text().replace(
        "    certCheckIntervalSeconds: 0\n",
        f"    certCheckIntervalSeconds: 0\n    tlsHandshakeTimeoutSeconds: {period}\n")
    (tmp_path / "config.yaml").write_text(cfg)
    proc, port = start(tmp_path / "config.yaml")
    ca = pki.cert_path("ca")
    try:
        status = handshake_held_up(proc.pid, port, str(ca), server_hostname="127.0.0.1",
                                   request=b"GET /healthz HTTP/1.1\r\nHost: webhook\r\n\r\n", stall=3 * period)
    except (OSError, ssl.SSLError) as exc:
        pytest.fail(f"the webhook cut a client it had held up itself: {exc!r}")
    assert status.startswith("HTTP/1.1 200"), status
    assert _metric(port, ca, "gatekeeper_webhook_tls_handshakes_late_total") >= 1

    with socket.create_connection(("127.0.0.1", port), timeout=5) as silent:
        assert is_cut(silent, 4 * period + 3), "a client that never sends its ClientHello must be cut"
    counter = 'gatekeeper_webhook_refused_connections_total{reason="handshake-timeout"}'
    deadline = time.monotonic() + 5
    while _metric(port, ca, counter) < 1:
        assert time.monotonic() < deadline, "the handshake timeout was not counted"
        time.sleep(0.1)
