"""The proxy's HPACK response encoder: what any decoder reads back is exactly what was encoded."""

from __future__ import annotations

import random

import h2.connection
import pytest
from h2.config import H2Configuration
from h2.events import ResponseReceived
from hpack import Decoder, Encoder, NeverIndexedHeaderTuple
from hpack.hpack import encode_integer as hpack_encode_integer
from hpack.table import HeaderTable

from gatekeeper.proxy.h2wire import hpack_encode
from gatekeeper.proxy.h2wire.hpack_encode import NeverIndexed, ResponseEncoder, encode_integer
from gatekeeper.proxy.h2wire.hpack_tables import STATIC_TABLE
from gatekeeper.proxy.listen.h2_codec import H2ServerCodec

APISERVER_HEADERS = [
    (b":status", b"200"),
    (b"cache-control", b"no-cache, private"),
    (b"content-type", b"application/json"),
    (b"x-kubernetes-pf-flowschema-uid", b"3b8f1c2e-6a4d-4f6e-9a55-0d1c2b3a4f5e"),
    (b"x-kubernetes-pf-prioritylevel-uid", b"a1b2c3d4-0000-4e6e-9a55-0d1c2b3a4f5e"),
    (b"content-length", b"412"),
    (b"x-gatekeeper-pf-flowschema", b"service-accounts"),
    (b"x-gatekeeper-pf-prioritylevel", b"workload-low"),
]


def _response(audit: int) -> list[tuple[bytes, bytes]]:
    return [*APISERVER_HEADERS, NeverIndexed((b"audit-id", f"{audit:036d}".encode())),
            NeverIndexed((b"date", b"Mon, 30 Nov 2026 23:00:00 GMT"))]


def _decoded(decoder: Decoder, block: bytes) -> list[tuple[bytes, bytes]]:
    return [(bytes(n), bytes(v)) for n, v in decoder.decode(block, raw=True)]


def test_the_static_table_and_integer_encoding_are_hpacks() -> None:
    assert STATIC_TABLE == HeaderTable.STATIC_TABLE  # RFC 7541 Appendix A, 61 entries
    for value in [*range(300), 4096, 16383, 16384, 2**21, 2**31 - 1, 2**32 - 1]:
        for prefix_bits in range(1, 9):
            assert encode_integer(value, prefix_bits) == hpack_encode_integer(value, prefix_bits), (value, prefix_bits)


def test_repeated_responses_decode_exactly_and_shrink_to_table_references() -> None:
    enc, dec = ResponseEncoder(), Decoder()
    blocks = [enc.encode(_response(i)) for i in range(5)]
    for i, block in enumerate(blocks):
        assert _decoded(dec, block) == [(bytes(n), bytes(v)) for n, v in _response(i)]
    # Stable fields are one-byte table references from the second response on; only the two
    # never-indexed volatile fields are spelled out.
    assert len(blocks[1]) < len(blocks[0]) // 2
    assert len(blocks[1]) == len(blocks[2]) == len(blocks[4])
    # The same table references as hpack's own encoder (which would also Huffman-code the two
    # volatile values: a few bytes for much CPU).
    reference = Encoder()
    reference_blocks = [reference.encode([NeverIndexedHeaderTuple(*f) if type(f) is NeverIndexed else f
                                          for f in _response(i)]) for i in range(5)]
    stable = len(APISERVER_HEADERS)
    assert blocks[4][:stable] == reference_blocks[4][:stable]


def test_never_indexed_fields_stay_out_of_the_table_and_keep_their_flag() -> None:
    enc, dec = ResponseEncoder(), Decoder()
    for i in range(50):
        block = enc.encode([(b":status", b"200"), NeverIndexed((b"audit-id", f"id-{i}".encode()))])
        fields = dec.decode(block, raw=True)
        assert bytes(fields[1][1]) == f"id-{i}".encode()
        assert isinstance(fields[1], NeverIndexedHeaderTuple)  # the decoder sees the never-indexed form
    assert enc.table_entries == 0


def test_random_header_lists_with_evictions_and_table_size_changes_round_trip() -> None:
    rng = random.Random(7)
    names = [b"content-type", b"cache-control", b"x-a", b"content-length", b"warning", b"set-cookie"]
    for _trial in range(40):
        enc, dec = ResponseEncoder(), Decoder()
        for _block in range(60):
            if rng.random() < 0.08:
                size = rng.choice([0, 64, 256, 4096, 65536])
                enc.header_table_size = size
                dec.max_allowed_table_size = size
            fields: list[tuple[bytes, bytes]] = [(b":status", rng.choice([b"200", b"404", b"429"]))]
            for _ in range(rng.randint(0, 10)):
                value = rng.choice([b"application/json", b"v" * rng.randint(0, 700), str(rng.randint(0, 99)).encode(),
                                    b"x" * 4100])
                name = rng.choice(names) + (str(rng.randint(0, 30)).encode() if rng.random() < 0.3 else b"")
                fields.append(NeverIndexed((name, value)) if rng.random() < 0.15 else (name, value))
            assert _decoded(dec, enc.encode(fields)) == [(bytes(n), bytes(v)) for n, v in fields]


def test_a_smaller_peer_table_is_signalled_before_the_next_block_and_old_entries_are_not_referenced() -> None:
    enc, dec = ResponseEncoder(), Decoder()
    _decoded(dec, enc.encode(APISERVER_HEADERS))
    assert enc.table_entries > 0
    enc.header_table_size = 0  # the client sent SETTINGS_HEADER_TABLE_SIZE = 0
    dec.max_allowed_table_size = 0
    block = enc.encode(APISERVER_HEADERS)
    assert block[0] == 0x20  # dynamic table size update to 0, first thing in the block
    assert enc.table_entries == 0
    assert _decoded(dec, block) == APISERVER_HEADERS
    # Shrunk and grown again between two blocks: the smallest size first, then the final one.
    enc.header_table_size = 100
    enc.header_table_size = 4096
    dec.max_allowed_table_size = 4096
    block = enc.encode(APISERVER_HEADERS)
    assert block[:3] == b"\x3f\x45\x3f"  # size update 100 (0x20|31, 69), then 4096 (0x20|31, ...)
    assert _decoded(dec, block) == APISERVER_HEADERS


def test_table_never_grows_past_its_cap_whatever_the_peer_allows() -> None:
    enc = ResponseEncoder()
    enc.header_table_size = 1 << 20
    assert enc.header_table_size == hpack_encode.MAX_TABLE_SIZE
    for i in range(500):
        enc.encode([(b"x-field", f"{i:0100d}".encode())])
    assert enc.table_entries <= hpack_encode.MAX_TABLE_SIZE // (32 + 7 + 100)


def test_literal_memo_is_bounded_and_skips_long_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hpack_encode, "_memo", {})
    monkeypatch.setattr(hpack_encode, "MEMO_ENTRIES", 16)
    enc, dec = ResponseEncoder(), Decoder()
    for i in range(100):
        fields = [(b"x-distinct", str(i).encode())]
        assert _decoded(dec, enc.encode(fields)) == fields
        assert hpack_encode.memo_size() <= 16
    hpack_encode._memo.clear()
    enc.encode([(b"x-long", b"v" * (hpack_encode.MEMO_MAX_BYTES + 1))])
    assert hpack_encode.memo_size() == 0
    # A memoized encoding is the same bytes as a fresh one.
    first = hpack_encode.indexed_literal(b"content-type", b"application/yaml")
    hpack_encode._memo.clear()
    assert hpack_encode.indexed_literal(b"content-type", b"application/yaml") == first


def test_the_codec_encodes_its_responses_with_it() -> None:
    server = H2ServerCodec()
    assert isinstance(server.encoder, ResponseEncoder)
    client = h2.connection.H2Connection(H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    got = []
    for _ in range(3):
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"x"),
                                  (b":path", b"/api")], end_stream=True)
        server.receive_data(client.data_to_send())
        server.send_headers(sid, _response(sid), end_stream=True)
        got += [e for e in client.receive_data(server.data_to_send()) if isinstance(e, ResponseReceived)]
    assert [[(bytes(n), bytes(v)) for n, v in e.headers] for e in got] == [
        [(bytes(n), bytes(v)) for n, v in _response(sid)] for sid in (1, 3, 5)]
