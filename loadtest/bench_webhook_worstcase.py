"""Peak RSS of one webhook worker under what maxBufferedRequestBytes does not count, against idle connections.

    .venv/bin/python loadtest/bench_webhook_worstcase.py [--connections 1000] [--scenario NAME ...]

Each scenario starts a fresh ``gatekeeper webhook`` (one worker, uvloop, this tree, the default settings) and one
client process that opens ``--connections`` TLS connections on 127.0.0.1 (50 handshakes at a time) and then:

* ``idle``: nothing (the reference: what a connection costs by itself);
* ``fat-then-idle``: one complete GET /healthz with a 254 KB head (31 fields of 8 KB) sent in one write, its answer
  read, then idle: what TLS and parser buffers keep once the request is gone;
* ``read-then-idle``: POST /validate with a review whose ``uid`` is 1 MiB, its answer read whole, then idle: what
  the last exchange leaves behind (8 reviews in flight at a time);
* ``fast-sender``: GET /healthz declaring a 1 GB body and writing it as fast as the webhook takes it, never reading:
  bytes arriving faster than the webhook parses them (the handler never reads the body);
* ``slow-records``: an unfinished head sent as 1-byte TLS records (4000 of them), never ended;
* ``unsent-responses``: POST /validate with a review whose ``uid`` is 1 MiB (echoed in the answer), receive buffer
  of 4 KiB, never read: the answer waits in the webhook's write buffer (8 reviews in flight at a time, under the
  caller's body share).

Reported: the worker's RSS before, its VmHWM (peak RSS) and VmRSS 5 s after the last connection was served, the
peak's growth per connection, its growth over the ``idle`` reference, and the peak against the README's derived
worst case of a worker (:func:`derived_bound`, with the RSS before as the process at rest). Connections are bounded
in count and time; the client is killed at the end of each run. The machine's other work makes the figures noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import ssl
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gatekeeper.certs import PKI  # noqa: E402
from loadtest.webhook_flood import flood, run_one  # noqa: E402

CONNECTION_BYTES = 30 * 1024
"""An open idle connection (TLS session, aiohttp handler), measured by the ``idle`` scenario."""
TLS_READ_BYTES = 130 * 1024
"""A connection's TLS read buffers at socketReceiveBufferBytes 16 KiB, measured by ``fast-sender``."""
DECODE_FACTOR = 5
"""The review being decoded, in maxBodyBytes: an estimate (JSON objects take a few times their bytes)."""


def derived_bound(rest: int) -> int:
    """The README's worst case of one worker at the default settings (kernel socket buffers aside: not in RSS)."""
    from gatekeeper.webhook.settings import ServerSettings

    srv = ServerSettings(cert_file="c", key_file="k")
    return (rest + srv.max_connections * (CONNECTION_BYTES + TLS_READ_BYTES) + 3 * srv.max_buffered_request_bytes
            + srv.max_buffered_body_bytes + DECODE_FACTOR * srv.max_body_bytes)


SCENARIOS = ("idle", "fat-then-idle", "read-then-idle", "fast-sender", "slow-records", "unsent-responses")


def _review(uid_bytes: int) -> bytes:
    return (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"' + b"u" * uid_bytes +
            b'","kind":{"group":"","version":"v1","kind":"Secret"},"resource":{"group":"","version":"v1",'
            b'"resource":"secrets"},"operation":"CREATE","namespace":"ns","name":"s",'
            b'"object":{"apiVersion":"v1","kind":"Secret","metadata":{"name":"s"},"data":{}}}}')


async def _client(port: int, ca: str, scenario: str, n: int) -> None:
    ctx = ssl.create_default_context(cafile=ca)
    fields = b"".join(b"X-F%02d: %s\r\n" % (i, b"a" * 8180) for i in range(31))
    held = []
    body = _review(1 << 20)
    posting = asyncio.Semaphore(8)

    async def one() -> None:
        small_rcvbuf = scenario == "unsent-responses"
        if small_rcvbuf:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            reader, writer = await asyncio.open_connection(sock=sock, ssl=ctx, server_hostname="127.0.0.1")
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        held.append(writer)
        if scenario == "fat-then-idle":
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
            await writer.drain()
            await reader.readuntil(b"\r\n\r\n")
        elif scenario == "read-then-idle":
            async with posting:
                writer.write(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
        elif scenario == "fast-sender":
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
            chunk = b"b" * 65536
            with _quiet():
                async with asyncio.timeout(5):
                    for _ in range(64):  # 4 MiB at most
                        writer.write(chunk)
                        await writer.drain()
        elif scenario == "slow-records":
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            for _ in range(4000):
                writer.write(b"s")  # one TLS record each
            await writer.drain()
        elif scenario == "unsent-responses":
            async with posting:
                writer.write(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                await asyncio.sleep(0.2)  # reviewed, its answer queued

    await flood(n, one, (OSError, asyncio.IncompleteReadError))  # cut by the server
    print("sent", len(held), flush=True)
    await asyncio.sleep(120)  # killed by the parent long before


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], (TimeoutError, OSError))  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=1000, help="connections per scenario (maxConnections: 1000)")
    ap.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only these (idle always runs)")
    ap.add_argument("--client", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        port, ca, scenario, n = args.client
        asyncio.run(_client(int(port), ca, scenario, int(n)))
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-worst-"))
    try:
        pki = PKI(tmp / "pki")
        pki.init()
        pki.issue_serving("webhook", ips=["127.0.0.1"])
        mib = 1024 * 1024
        n = args.connections
        chosen = ["idle", *[s for s in SCENARIOS if s != "idle" and (not args.scenario or s in args.scenario)]]
        print(f"{'scenario':18} {'conns':>5} {'RSS before':>10} {'peak':>8} {'at end':>8} {'KiB/conn':>8} "
              f"{'over idle':>10} {'of bound':>8}")
        idle = 0
        for scenario in chosen:
            base, peak, now = run_one([sys.executable, "-m", "gatekeeper"], __file__, scenario, n, tmp, pki,
                                      settle=5, cwd=ROOT)
            grown = peak - base
            if scenario == "idle":
                idle = grown
            print(f"{scenario:18} {n:5d} {base / mib:7.0f} MiB {peak / mib:4.0f} MiB {now / mib:4.0f} MiB "
                  f"{grown / 1024 / n:8.0f} {(grown - idle) / mib:6.0f} MiB {peak / derived_bound(base):8.0%}",
                  flush=True)
        print(f"derived worst case of a worker at the defaults: {derived_bound(54 * mib) / mib:.0f} MiB (README)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
