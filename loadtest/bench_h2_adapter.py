"""Memory and throughput of the HTTP/2 adapter alone, in memory (no sockets, no backends).

Streams a response body of SIZE MiB through ``gatekeeper.proxy.listen.h2.H2Protocol``
to a client-side ``h2`` connection that reads and acknowledges everything, and
reports, in one run:

* peak RSS growth while streaming SIZE MiB, as a ratio to the growth while
  streaming a reference of REF MiB (flat memory means a ratio near 1, not
  SIZE/REF), and
* adapter+client throughput in MiB/s for both runs (both sides are pure
  Python in this process, so this is a floor, not a network figure).

Run: ``.venv/bin/python loadtest/bench_h2_adapter.py [--size-mib 256 --ref-mib 16 --chunk-kib 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from collections.abc import AsyncIterator

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, StreamEnded

from gatekeeper.proxy.listen.h2 import H2Protocol
from gatekeeper.proxy.messages import ProxyRequest, ProxyResponse
from gatekeeper.proxy.settings import ProtocolSettings


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def stream(total: int, chunk: int) -> tuple[float, int]:
    """Stream ``total`` bytes; return (seconds, peak RSS growth in KiB sampled per frame batch)."""
    payload = b"x" * chunk

    async def body() -> AsyncIterator[bytes]:
        sent = 0
        while sent < total:
            yield payload
            sent += len(payload)

    async def handler(req: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(200, [], body())

    client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    done = asyncio.Event()
    received = 0
    base = rss_kib()
    peak = base

    def from_server(data: bytes) -> None:
        nonlocal received, peak
        for ev in client.receive_data(data):
            if isinstance(ev, DataReceived):
                received += len(ev.data)
                client.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, StreamEnded):
                done.set()
        out = client.data_to_send()
        if out:
            asyncio.get_running_loop().call_soon(server.data_received, out)
        peak = max(peak, rss_kib())

    async def drain() -> None:
        await asyncio.sleep(0)

    server = H2Protocol(handler, ProtocolSettings(), write=from_server, drain=drain, close=lambda: None)
    client.initiate_connection()
    preface = client.data_to_send()
    server.start()
    server.data_received(preface)
    t0 = time.perf_counter()
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "GET"), (":path", "/api/v1/secrets"), (":scheme", "https"),
                              (":authority", "bench")], end_stream=True)
    # after anything from_server already queued, to keep the client's byte order
    asyncio.get_running_loop().call_soon(server.data_received, client.data_to_send())
    await done.wait()
    elapsed = time.perf_counter() - t0
    assert received == total, (received, total)
    return elapsed, peak - base


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--ref-mib", type=int, default=16)
    ap.add_argument("--chunk-kib", type=int, default=64)
    args = ap.parse_args()
    chunk = args.chunk_kib * 1024
    await stream(1 << 20, chunk)  # warm-up: imports, allocator pools
    ref_s, ref_growth = await stream(args.ref_mib << 20, chunk)
    big_s, big_growth = await stream(args.size_mib << 20, chunk)
    print(f"reference {args.ref_mib} MiB: {ref_s:.2f}s ({args.ref_mib / ref_s:.1f} MiB/s), "
          f"peak RSS growth {ref_growth} KiB")
    print(f"large     {args.size_mib} MiB: {big_s:.2f}s ({args.size_mib / big_s:.1f} MiB/s), "
          f"peak RSS growth {big_growth} KiB")
    ratio = (big_growth + 1) / (ref_growth + 1)
    print(f"RSS growth ratio large/reference: {ratio:.2f} (body ratio {args.size_mib / args.ref_mib:.0f}); "
          f"throughput ratio: {(args.size_mib / big_s) / (args.ref_mib / ref_s):.2f}; "
          f"max RSS of the process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} KiB")


if __name__ == "__main__":
    asyncio.run(main())
