"""CPU per request of the client-facing HTTP/2 codec alone, both ``http2Engine`` values in one run.

Not a test: it prints figures. Per request it does what the proxy does for a
small kubectl GET: receive one HEADERS frame (with a ~1 KB bearer token, never
indexed, as client-go sends it), then send the response HEADERS and one DATA
frame with END_STREAM, take the bytes to send, release the stream. No event
loop, no adapter: only the codec (``h2_conn.ProxyH2Connection`` for ``h2``,
``h2_codec.LeanH2Connection`` for ``lean``), with the Huffman memo installed
for both. Client frames are encoded beforehand by an ``h2`` client; with
``--path literal`` its ``:path`` goes out as nghttp2 (h2load) sends it, a
Huffman-coded literal without indexing on every request, instead of an index
into the dynamic table (Go's encoder, kubectl).

Run: ``.venv/bin/python loadtest/bench_h2_codec.py [--requests 20000 --rounds 3 --path literal]``.
The figure is the best of the rounds (process CPU time), less sensitive to a busy machine.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from h2.config import H2Configuration
from h2.connection import H2Connection
from hpack import NeverIndexedHeaderTuple
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from gatekeeper.proxy.listen.h2_codec import LeanH2Connection
from gatekeeper.proxy.listen.h2_conn import ProxyH2Connection, install_huffman_memo
from gatekeeper.proxy.listen.h2_headers import response_block

REQUEST = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"127.0.0.1:6443"),
           (b":path", b"/api/v1/namespaces/default"),
           NeverIndexedHeaderTuple(b"authorization", b"Bearer " + b"x" * 900),
           (b"accept", b"application/json"), (b"user-agent", b"kubectl/v1.37.2 (linux/amd64)")]
RESPONSE = [("audit-id", "0b0b3f1c-1111-2222-3333-444455556666"), ("cache-control", "no-cache, private"),
            ("content-type", "application/json"), ("x-kubernetes-pf-flowschema-uid", "abc"),
            ("x-kubernetes-pf-prioritylevel-uid", "def"), ("date", "Tue, 01 Dec 2026 02:00:00 GMT"),
            ("content-length", "400")]
BODY = b"{" + b"a" * 398 + b"}"


def server(engine: str) -> ProxyH2Connection | LeanH2Connection:
    if engine == "lean":
        return LeanH2Connection(max_concurrent_streams=250, stream_window=1 << 20, max_header_list=1 << 20,
                                connection_window=4 << 20)
    return ProxyH2Connection()


def literal_path(cli: H2Connection) -> None:
    """Make ``cli`` send ``:path`` as nghttp2 does: literal without indexing (static name 4), Huffman-coded."""
    encode = cli.encoder.encode
    huffman = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode

    def encode_block(headers: Any, huffman_flag: bool = True) -> bytes:
        headers = list(headers)
        i = next(k for k, h in enumerate(headers) if h[0] == b":path")
        path = huffman(headers[i][1])
        assert len(path) < 127
        literal = bytes([0x04, 0x80 | len(path)]) + path
        return encode(headers[:i], huffman_flag) + literal + encode(headers[i + 1:], huffman_flag)

    cli.encoder.encode = encode_block  # type: ignore[method-assign,assignment]


def run(engine: str, n: int, path: str = "indexed") -> tuple[float, float]:
    """(us of CPU per request, bytes sent per request)."""
    srv = server(engine)
    srv.initiate_connection()
    srv.data_to_send()
    cli = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    if path == "literal":
        literal_path(cli)
    cli.initiate_connection()
    cli.update_settings({4: 2**31 - 1})
    cli.increment_flow_control_window(2**31 - 1 - 65535)
    srv.receive_data(cli.data_to_send())
    cli.receive_data(srv.data_to_send())
    frames = []
    for _ in range(n):
        sid = cli.get_next_available_stream_id()
        cli.send_headers(sid, REQUEST, end_stream=True)
        frames.append((sid, cli.data_to_send()))
        cli.streams.pop(sid, None)
    receive = srv.receive_data
    out = 0
    t0 = time.process_time()
    for sid, data in frames:
        receive(data)
        srv.send_headers(sid, response_block(200, RESPONSE))
        srv.send_data(sid, BODY, end_stream=True)
        out += len(srv.data_to_send())
        srv.release_stream(sid)
    return (time.process_time() - t0) / n * 1e6, out / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--path", choices=("indexed", "literal"), default="indexed",
                    help="literal: :path Huffman-coded on every request, as h2load/nghttp2 sends it")
    args = ap.parse_args()
    install_huffman_memo()
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for engine in ("h2", "lean"):
            us, _ = run(engine, args.requests, args.path)
            best[engine] = min(best.get(engine, us), us)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{args.requests} requests x {args.rounds} rounds, :path {args.path}, best round; load average {load}")
    for engine in ("h2", "lean"):
        print(f"  {engine:4}: {best[engine]:6.1f} us CPU per request")
    print(f"  lean / h2: x{best['lean'] / best['h2']:.2f}")


if __name__ == "__main__":
    main()
