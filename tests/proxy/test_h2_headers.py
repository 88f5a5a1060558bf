"""RFC 9113 request header rules, checked by h2_headers instead of h2's per-byte validation."""

from __future__ import annotations

import random

import hpack.huffman_table
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from gatekeeper.proxy.h2wire import huffman
from gatekeeper.proxy.listen import h2_headers
from gatekeeper.proxy.listen.h2_headers import MalformedRequest, parse_request

PSEUDO = [(b":method", b"GET"), (b":scheme", b"https"), (b":path", b"/api/v1/pods?watch=1"),
          (b":authority", b"proxy.test")]


def test_pseudo_headers_become_method_target_and_host():
    method, target, headers = parse_request([*PSEUDO, (b"accept", b"application/json")])
    assert (method, target) == ("GET", "/api/v1/pods?watch=1")
    assert headers == [("host", "proxy.test"), ("accept", "application/json")]


def test_cookie_crumbs_are_joined_and_host_header_wins_when_equal():
    _, _, headers = parse_request([*PSEUDO, (b"host", b"proxy.test"), (b"cookie", b"a=1"), (b"cookie", b"b=2")])
    assert headers == [("host", "proxy.test"), ("cookie", "a=1; b=2")]


def test_non_utf8_bytes_survive_round_trip():
    _, _, headers = parse_request([*PSEUDO, (b"x-raw", b"\xff\xfe")])
    assert headers[-1][1].encode("utf-8", "surrogateescape") == b"\xff\xfe"


@pytest.mark.parametrize(("extra", "why"), [
    ([(b"X-Upper", b"1")], "invalid header name"),
    ([(b"bad name", b"1")], "invalid header name"),
    ([(b"", b"1")], "invalid header name"),
    ([(b"x-a", b"v\r\nx-remote-user: admin")], "control character"),
    ([(b"x-a", b"nul\x00")], "control character"),
    # Go's HTTP/2 server (the apiserver) refuses every control byte but HTAB, and DEL: RST_STREAM
    # before any answer, which blamed the backend on the multiplexed upstream.
    ([(b"x-a", b"a\x01b")], "control character"),
    ([(b"x-a", b"a\x1fb")], "control character"),
    ([(b"x-a", b"a\x7fb")], "control character"),
    ([(b"authorization", b"Bearer a\x0bb")], "control character"),
    ([(b"x-a", b" leading")], "surrounding whitespace"),
    ([(b"x-a", b"trailing\t")], "surrounding whitespace"),
    ([(b"connection", b"close")], "connection-specific"),
    ([(b"transfer-encoding", b"chunked")], "connection-specific"),
    ([(b"te", b"gzip")], "te header"),
    ([(b"x-a", b"1"), (b":path", b"/late")], "after a regular header"),
    ([(b":status", b"200")], "pseudo-header"),
    ([(b":method", b"POST")], "given twice"),
    ([(b"host", b"elsewhere.test")], "disagree"),
])
def test_malformed_blocks_are_rejected_with_a_reason(extra, why):
    with pytest.raises(MalformedRequest, match=why):
        parse_request([*PSEUDO, *extra])


def test_tabs_inside_and_obs_text_are_values_go_accepts_too():
    _, _, headers = parse_request([*PSEUDO, (b"x-a", b"a\tb"), (b"x-b", b"\x80\xff")])
    assert headers[-2:] == [("x-a", "a\tb"), ("x-b", "\x80\xff".encode("latin-1").decode("utf-8", "surrogateescape"))]


def test_te_trailers_is_allowed_and_passed_on():
    method, target, headers = parse_request([*PSEUDO, (b"te", b"trailers")])
    assert (method, target) == ("GET", "/api/v1/pods?watch=1")
    assert ("te", "trailers") in headers


@pytest.mark.parametrize("missing", [b":method", b":scheme", b":path"])
def test_required_pseudo_headers(missing):
    with pytest.raises(MalformedRequest, match="missing"):
        parse_request([h for h in PSEUDO if h[0] != missing])


def _huffman(data: bytes) -> bytes:
    return HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(data)


def test_huffman_memo_returns_what_decoding_returns_and_still_rejects_garbage():
    memo = huffman.decode_memo
    original = hpack.huffman_table.decode_huffman
    rng = random.Random(7)
    for size in (1, 10, 100, 1000, 5000, 20000):
        raw = bytes(rng.randrange(256) for _ in range(size))
        enc = _huffman(raw)
        assert memo(enc) == original(enc) == raw
        assert memo(enc) == raw  # second call, from the memo when in range
    # An EOS symbol inside the string is invalid: raised every time, never cached as a value.
    bad = b"\xff\xff\xff\xff" * 20
    for _ in range(2):
        with pytest.raises(huffman.HuffmanDecodingError):
            memo(bad)


def test_huffman_memo_is_bounded():
    memo = huffman.decode_memo
    cache = huffman._memo
    for i in range(huffman.MEMO_ENTRIES + 50):
        memo(_huffman(b"token-%06d-" % i + b"x" * 100))
    assert cache.cache_info().currsize <= huffman.MEMO_ENTRIES
    before = cache.cache_info()
    memo(_huffman(b"y" * (huffman.MEMO_MAX_BYTES * 2)))  # too big to keep
    memo(_huffman(b"short"))  # too small to bother
    after = cache.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses)


def test_a_field_that_passed_once_is_memoized_and_order_rules_still_hold(monkeypatch):
    monkeypatch.setattr(h2_headers, "_checked_fields", {})
    token = (b"authorization", b"Bearer " + b"t" * 1000)
    for _ in range(2):
        _, _, headers = parse_request([*PSEUDO, token, (b"accept", b"*/*")])
        assert headers == [("host", "proxy.test"), ("authorization", "Bearer " + "t" * 1000), ("accept", "*/*")]
    assert set(h2_headers._checked_fields) == {(b"accept", b"*/*")}  # never a credential
    # A memoized field is still a regular header: a pseudo-header after it is refused.
    with pytest.raises(MalformedRequest, match="after a regular header"):
        parse_request([*PSEUDO[:2], (b"accept", b"*/*"), PSEUDO[2]])
    # Refused fields, pseudo-headers, host and cookie never enter the memo.
    for bad in [(b"x-bad", b"a\r\nb"), (b"Upper", b"x"), (b"connection", b"close"), (b"te", b"gzip")]:
        with pytest.raises(MalformedRequest):
            parse_request([*PSEUDO, bad])
        with pytest.raises(MalformedRequest):  # and again: refused every time
            parse_request([*PSEUDO, bad])
    parse_request([*PSEUDO, (b"host", b"proxy.test"), (b"cookie", b"a=1")])
    assert set(h2_headers._checked_fields) == {(b"accept", b"*/*")}


def test_field_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(h2_headers, "_checked_fields", {})
    for i in range(h2_headers.FIELD_MEMO_ENTRIES + 10):
        parse_request([*PSEUDO, (b"x-n", b"%d" % i)])
        assert len(h2_headers._checked_fields) <= h2_headers.FIELD_MEMO_ENTRIES
    parse_request([*PSEUDO, (b"x-long", b"v" * h2_headers.FIELD_MEMO_MAX_BYTES)])
    assert (b"x-long", b"v" * h2_headers.FIELD_MEMO_MAX_BYTES) not in h2_headers._checked_fields


