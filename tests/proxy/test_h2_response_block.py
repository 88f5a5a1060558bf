"""The response HEADERS block: normalization is the same whether a field is converted or found in the memo."""

from __future__ import annotations

import pytest

from gatekeeper.proxy.h2wire.hpack_encode import NeverIndexed
from gatekeeper.proxy.listen import h2_headers
from gatekeeper.proxy.listen.h2_headers import response_block

APISERVER_ANSWER = [
    ("Audit-Id", "0b0b3f1c-1111-2222-3333-444455556666"),
    ("Cache-Control", "no-cache, private"),
    ("Content-Type", " application/json "),
    ("Connection", "keep-alive"),
    ("Transfer-Encoding", "chunked"),
    ("X-Kubernetes-Pf-Flowschema-Uid", "abc"),
    ("Date", "Tue, 01 Dec 2026 02:00:00 GMT"),
    ("retry-after", "1"),
]
EXPECTED = [
    (b":status", b"429"),
    (b"audit-id", b"0b0b3f1c-1111-2222-3333-444455556666"),
    (b"cache-control", b"no-cache, private"),
    (b"content-type", b"application/json"),
    (b"x-kubernetes-pf-flowschema-uid", b"abc"),
    (b"date", b"Tue, 01 Dec 2026 02:00:00 GMT"),
    (b"retry-after", b"1"),
]


@pytest.fixture(autouse=True)
def empty_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(h2_headers, "_response_fields", {})


def test_fields_are_lowercased_trimmed_and_hop_by_hop_dropped_first_time_and_from_the_memo():
    first = response_block(429, APISERVER_ANSWER)
    again = response_block(429, APISERVER_ANSWER)
    assert first == EXPECTED
    assert again == EXPECTED
    assert ("Connection", "keep-alive") in h2_headers._response_fields, "a dropped field is remembered as dropped"


def test_volatile_fields_go_out_never_indexed_and_are_never_memoized():
    for _ in range(2):
        block = response_block(200, APISERVER_ANSWER)
        volatile = [f for f in block if f[0] in (b"audit-id", b"date")]
        assert len(volatile) == 2 and all(isinstance(f, NeverIndexed) for f in volatile)
        assert not any(isinstance(f, NeverIndexed) for f in block if f[0] not in (b"audit-id", b"date"))
    assert not any(name.lower() in ("audit-id", "date") for name, _ in h2_headers._response_fields)


def test_response_memo_is_bounded_and_skips_long_fields():
    for i in range(3 * h2_headers.RESPONSE_MEMO_ENTRIES):
        response_block(200, [("x-n", str(i))])
        assert len(h2_headers._response_fields) <= h2_headers.RESPONSE_MEMO_ENTRIES
    long = ("x-long", "v" * h2_headers.RESPONSE_MEMO_MAX_CHARS)
    assert response_block(200, [long])[1] == (b"x-long", b"v" * h2_headers.RESPONSE_MEMO_MAX_CHARS)
    assert long not in h2_headers._response_fields


def test_status_codes_are_encoded_as_digits():
    assert [response_block(s, [])[0] for s in (200, 404, 599)] == [(b":status", b"200"), (b":status", b"404"),
                                                                    (b":status", b"599")]
