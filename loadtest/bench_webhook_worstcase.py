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
  caller's body share);
* ``decode-containers``, ``decode-keys``, ``decode-value``: ``--decoders`` connections at once (not
  ``--connections``), each posting ``--decode-rounds`` reviews of exactly ``maxBodyBytes`` one after the other
  (a new connection after a refusal) and reading the answers, with ``maxBufferedBodyCallerShare: 1`` so that this
  one client stands for the several pods that together can fill ``maxBufferedBodyBytes``. The review's object
  holds, in 6 MiB: ``[{},{},...]`` (the JSON that decodes largest: ~2 million empty objects), a Secret's ``data``
  of ~580,000 distinct short keys with empty values (the policy walks and measures every one), or one 6 MiB base64
  value (the largest legitimate Secret). What the body budget, the body read and orjson's tree take at once.

Reported: the worker's RSS before, its VmHWM (peak RSS) and VmRSS 5 s after the last connection was served, the
peak's growth per connection, its growth over the ``idle`` reference, the peak against the README's derived
worst case of a worker (:func:`derived_bound`, with the RSS before as the process at rest), and the kernel's socket
memory, the largest of samples taken every second from the RSS before to the RSS at the end (``ss -tm``, the
webhook's own sockets: ``send`` sums ``wmem_queued``, ``recv`` sums ``rmem_alloc``; ``sockstat`` is the growth of
``/proc/net/sockstat``'s ``TCP: mem``, every TCP socket of the machine, the client's receive queues included).
The decode scenarios also print the answers' statuses. Connections are bounded in count and time; the client is
killed at the end of each run. The machine's other work makes the figures noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gatekeeper.certs.pki import PKI  # noqa: E402
from loadtest.webhook_flood import flood, run_one  # noqa: E402

CONNECTION_BYTES = 30 * 1024
"""An open idle connection (TLS session, aiohttp handler), measured by the ``idle`` scenario."""
TLS_READ_BYTES = 130 * 1024
"""A connection's TLS read buffers at socketReceiveBufferBytes 16 KiB, measured by ``fast-sender``."""
BODY_READ_FACTOR = 1
"""Review bodies being read, in maxBufferedBodyBytes: one buffer each, resident only where written
(``gatekeeper/webhook/body.py``). It was 2 while aiohttp's ``read()`` copied each body into a growing bytearray and
then into bytes (the ``decode-*`` scenarios: 302-305 MiB peaks against 327-368 before)."""
DECODE_FACTOR = 25
"""The review being decoded, in maxBodyBytes: 6 MiB of ``[{},{},...]`` decode to 146 MiB of Python objects (~24x,
``decode-containers``). One at a time per worker: parsing and the policy run without an await."""


def derived_bound(rest: int) -> int:
    """The README's worst case of one worker at the default settings (kernel socket buffers aside: not in RSS)."""
    from gatekeeper.webhook.settings import ServerSettings

    srv = ServerSettings(cert_file="c", key_file="k")
    return (rest + srv.max_connections * (CONNECTION_BYTES + TLS_READ_BYTES) + 3 * srv.max_buffered_request_bytes
            + BODY_READ_FACTOR * srv.max_buffered_body_bytes + DECODE_FACTOR * srv.max_body_bytes)


DECODE = ("decode-containers", "decode-keys", "decode-value")
SCENARIOS = ("idle", "fat-then-idle", "read-then-idle", "fast-sender", "slow-records", "unsent-responses", *DECODE)
DECODE_SERVER = {"maxBufferedBodyCallerShare": 1}
"""The decode scenarios' settings: one client on 127.0.0.1 stands for the pods that fill the body budget."""


def _review(uid_bytes: int, data: bytes = b"{}", extra: bytes = b"") -> bytes:
    return (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"' + b"u" * uid_bytes +
            b'","kind":{"group":"","version":"v1","kind":"Secret"},"resource":{"group":"","version":"v1",'
            b'"resource":"secrets"},"operation":"CREATE","namespace":"ns","name":"s",'
            b'"object":{"apiVersion":"v1","kind":"Secret","metadata":{"name":"s"},' + extra + b'"data":' + data +
            b'}}}')


def largest_review(scenario: str, size: int) -> bytes:
    """A review of exactly ``size`` bytes (``maxBodyBytes``) shaped as the decode ``scenario`` says."""
    room = size - len(_review(1))
    if scenario == "decode-containers":  # "{}," is 3 bytes and decodes to an empty dict (~72 bytes with its slot)
        body = _review(1, extra=b'"x":[' + b"{}," * ((room - 8) // 3) + b'{}],')
    elif scenario == "decode-keys":  # distinct keys: orjson caches short keys, but only 2048 of them
        keys, used, i = [], 2, 0
        while True:
            key = b'"%x":"",' % i
            if used + len(key) > room:
                break
            keys.append(key)
            used += len(key)
            i += 1
        body = _review(1, data=b"{" + b"".join(keys)[:-1] + b"}")
    else:  # one base64 value: the largest legitimate Secret
        body = _review(1, data=b'{"d":"' + b"A" * (room - 8) + b'"}')
    return body + b" " * (size - len(body))  # whitespace after the document pads it to the byte


class Kernel:
    """The kernel's socket memory of one webhook run, sampled every second from the RSS before to the RSS at the
    end; the largest of each figure is kept (:meth:`probe` is ``run_one``'s probe)."""

    def __init__(self) -> None:
        self.send = self.recv = self.sockstat = 0
        self._sockstat_before = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _tcp_mem() -> int:
        with open("/proc/net/sockstat") as f:
            for line in f:
                if line.startswith("TCP:"):
                    fields = line.split()
                    return int(fields[fields.index("mem") + 1]) * os.sysconf("SC_PAGE_SIZE")
        return 0

    def _sample(self, port: int) -> None:
        self.sockstat = max(self.sockstat, self._tcp_mem() - self._sockstat_before)
        out = subprocess.run(["ss", "-tmnH", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, timeout=30).stdout
        send = recv = 0
        for skmem in re.findall(r"skmem:\(([^)]*)\)", out):
            fields = {m.group(1): int(m.group(2)) for m in re.finditer(r"([a-z]+)(\d+)", skmem)}
            send += fields.get("w", 0)
            recv += fields.get("r", 0)
        self.send, self.recv = max(self.send, send), max(self.recv, recv)

    def probe(self, pid: int, port: int, when: str) -> None:
        if when == "before":
            self._sockstat_before = self._tcp_mem()

            def sampling() -> None:
                while not self._stop.wait(1.0):
                    self._sample(port)

            self._thread = threading.Thread(target=sampling, daemon=True)
            self._thread.start()
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample(port)


async def _client(port: int, ca: str, scenario: str, n: int) -> None:
    ctx = ssl.create_default_context(cafile=ca)
    fields = b"".join(b"X-F%02d: %s\r\n" % (i, b"a" * 8180) for i in range(31))
    held = []
    body = _review(1 << 20)
    posting = asyncio.Semaphore(8)
    if scenario in DECODE:
        await _decoders(port, ctx, scenario, n)
        return

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


async def _decoders(port: int, ctx: ssl.SSLContext, scenario: str, n: int) -> None:
    """``n`` connections at once, each posting ``--decode-rounds`` of the largest reviews in turn."""
    from gatekeeper.webhook.settings import ServerSettings

    body = largest_review(scenario, ServerSettings(cert_file="c", key_file="k").max_body_bytes)
    rounds = int(os.environ.get("BENCH_DECODE_ROUNDS", "4"))
    statuses: collections.Counter[str] = collections.Counter()
    head = (b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))

    async def one() -> None:
        writer = None
        try:
            async with asyncio.timeout(120):
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
                for _ in range(rounds):
                    writer.write(head + body)
                    await writer.drain()
                    got = await reader.readuntil(b"\r\n\r\n")
                    statuses[got.split(b" ", 2)[1].decode()] += 1
                    length = int(got.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    await reader.readexactly(length)
                    if b"connection: close" in got.lower():  # a refusal: a new connection for the next
                        writer.close()
                        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        except (OSError, TimeoutError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
            statuses[type(exc).__name__] += 1
        finally:
            if writer is not None:
                writer.close()

    await asyncio.gather(*(one() for _ in range(n)))
    print("sent", " ".join(f"{k}:{v}" for k, v in sorted(statuses.items())), flush=True)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], (TimeoutError, OSError))  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=1000, help="connections per scenario (maxConnections: 1000)")
    ap.add_argument("--scenario", action="append", choices=SCENARIOS, help="run only these (idle always runs)")
    ap.add_argument("--decoders", type=int, default=16, help="connections of the decode scenarios")
    ap.add_argument("--decode-rounds", type=int, default=4, help="largest reviews each decode connection posts")
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
        os.environ["BENCH_DECODE_ROUNDS"] = str(args.decode_rounds)
        chosen = ["idle", *[s for s in SCENARIOS if s != "idle" and (not args.scenario or s in args.scenario)]]
        print(f"{'scenario':18} {'conns':>5} {'RSS before':>10} {'peak':>8} {'at end':>8} {'KiB/conn':>8} "
              f"{'over idle':>10} {'of bound':>8} {'send':>7} {'recv':>7} {'sockstat':>8}")
        idle = 0
        for scenario in chosen:
            n = args.decoders if scenario in DECODE else args.connections
            kernel = Kernel()
            said: list[str] = []
            base, peak, now = run_one([sys.executable, "-m", "gatekeeper"], __file__, scenario, n, tmp, pki,
                                      settle=5, cwd=ROOT, server=DECODE_SERVER if scenario in DECODE else None,
                                      probe=kernel.probe, said=said)
            grown = peak - base
            if scenario == "idle":
                idle = grown // n  # per connection
            print(f"{scenario:18} {n:5d} {base / mib:7.0f} MiB {peak / mib:4.0f} MiB {now / mib:4.0f} MiB "
                  f"{grown / 1024 / n:8.0f} {(grown - idle * n) / mib:6.0f} MiB {peak / derived_bound(base):8.0%} "
                  f"{kernel.send / mib:3.0f} MiB {kernel.recv / mib:3.0f} MiB {kernel.sockstat / mib:4.0f} MiB"
                  + (f"  answers {said[0].removeprefix('sent ')}" if scenario in DECODE and said else ""),
                  flush=True)
        print(f"derived worst case of a worker at the defaults: {derived_bound(54 * mib) / mib:.0f} MiB (README)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
