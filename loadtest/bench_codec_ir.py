"""The pure hot path of one small proxied GET over HTTP/2, in process, for instruction counts (callgrind).

Not a test, and not a timing: run under ``valgrind --tool=callgrind`` and read the instruction count, which does not
move with the load of a shared machine. One request is what the proxy's own pure modules do for a kubectl GET that
reaches a multiplexed upstream: the client's HEADERS frame through the server codec (frames, HPACK decode and its
Huffman memo), the RFC 9113 header checks (``h2_headers.parse_request``), ``requestinfo.parse``, the upstream request
block (``mux_wire``), the apiserver's response head decoded and checked (HPACK decode, ``client_codec.response_head``,
``hop_by_hop.response_headers``), and the response's HEADERS and DATA back through the codec (``h2_headers``
``response_block``, HPACK encode). The asyncio, TLS, pipeline, flow-control and metrics work of a request is not in it.

The frames are made before the loop (with ``hpack``, as a client with a dynamic table sends them), so the count is the
server side only. ``--setup-only`` makes the same frames and skips the loop: subtract it, divide by ``--n``::

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python loadtest/bench_codec_ir.py --n 2000
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python loadtest/bench_codec_ir.py --n 2000 --setup-only

Which modules are compiled shows in ``--which`` (a module loaded from a ``.so`` is compiled).
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="requests")
    parser.add_argument("--setup-only", action="store_true", help="make the frames, skip the loop")
    parser.add_argument("--which", action="store_true", help="print where each hot module was loaded from")
    args = parser.parse_args()

    from hpack import Encoder

    from gatekeeper.kube import requestinfo
    from gatekeeper.proxy.h2wire import client_codec
    from gatekeeper.proxy.h2wire import frames as f
    from gatekeeper.proxy.h2wire.hpack_decode import BlockDecoder
    from gatekeeper.proxy.listen import h2_codec, h2_headers
    from gatekeeper.proxy.upstream import hop_by_hop, mux_wire

    if args.which:
        for mod in ("gatekeeper.proxy.h2wire.frames", "gatekeeper.proxy.h2wire.hpack_decode",
                    "gatekeeper.proxy.h2wire.hpack_encode", "gatekeeper.proxy.h2wire.huffman",
                    "gatekeeper.proxy.h2wire.hpack_tables", "gatekeeper.proxy.listen.h2_codec",
                    "gatekeeper.proxy.listen.h2_headers", "gatekeeper.proxy.upstream.mux_wire",
                    "gatekeeper.kube.requestinfo"):
            __import__(mod)
            print(mod, sys.modules[mod].__file__)

    token = b"eyJhbGciOiJSUzI1NiIsImtpZCI6IjEyMyJ9." + b"A" * 900 + b".sig"
    paths = [b"/api/v1/namespaces/default/pods/web-%d" % (i % 16) for i in range(16)]
    client = Encoder()
    requests = []
    for i in range(args.n):
        sid = 2 * i + 1
        block = client.encode([
            (b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"10.0.0.1:6443"),
            (b":path", paths[i % len(paths)]), (b"accept", b"application/json, */*"),
            (b"user-agent", b"kubectl/v1.37.2 (linux/amd64) kubernetes/abcdef0"),
            (b"kubectl-command", b"kubectl get"), (b"kubectl-session", b"0f3c9a8e-1111-2222-3333-444455556666"),
            (b"authorization", b"Bearer " + token), (b"accept-encoding", b"gzip"),
        ])
        requests.append((sid, f.header(f.HEADERS, f.END_STREAM | f.END_HEADERS, sid, len(block)) + block))
    apiserver = Encoder()
    responses = [apiserver.encode([
        (b":status", b"200"), (b"audit-id", b"5d4c3b2a-%04d-4e5f-8a9b-0c1d2e3f4a5b" % i),
        (b"cache-control", b"no-cache, private"), (b"content-type", b"application/json"),
        (b"x-kubernetes-pf-flowschema-uid", b"7e0f3a4b-aaaa-bbbb-cccc-ddddeeeeffff"),
        (b"x-kubernetes-pf-prioritylevel-uid", b"1a2b3c4d-aaaa-bbbb-cccc-ddddeeeeffff"),
        (b"date", b"Mon, 07 Dec 2026 06:%02d:%02d GMT" % (i // 60 % 60, i % 60)), (b"content-length", b"812"),
    ]) for i in range(args.n)]
    body = b"{" + b"x" * 810 + b"}"

    codec = h2_codec.H2ServerCodec(max_concurrent_streams=100)
    codec.initiate_connection()
    codec.receive_data(f.PREFACE + f.settings_frame({f.INITIAL_WINDOW_SIZE: 1 << 20}))
    codec.data_to_send()
    upstream = BlockDecoder(1 << 16)
    authority = mux_wire.authority_field("10.0.0.2:6443")
    removed = hop_by_hop.REQUEST_REMOVED
    parse_request, parse_info = h2_headers.parse_request, requestinfo.parse
    request_block, headers_frames = mux_wire.request_block, f.headers_frames
    response_head, response_headers = client_codec.response_head, hop_by_hop.response_headers
    response_block = h2_headers.response_block
    out = 0
    for i in range(0 if args.setup_only else args.n):
        sid, frame = requests[i]
        (_, _, fields, _), = codec.receive_data(frame)
        method, target, headers = parse_request(fields)
        info = parse_info(method, target)
        up = headers_frames(sid, request_block(method, target, authority, headers, removed), 16384, f.END_STREAM)
        status, raw = response_head(upstream.decode(responses[i]))
        codec.send_headers(sid, response_block(status, response_headers(raw)))
        codec.send_data(sid, body, end_stream=True)
        codec.release_stream(sid)
        if i % 64 == 63:
            codec.receive_data(f.window_update(0, 64 * len(body)))
        out += len(codec.data_to_send()) + len(up) + len(info.verb)
    print(args.n, out)


if __name__ == "__main__":
    main()
