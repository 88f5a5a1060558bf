"""The upstream request head (pure): what it refuses to put on a pooled HTTP/1.1 connection."""

from __future__ import annotations

import pytest

from gatekeeper.proxy.upstream.exchange import encode_request_head


def test_content_length_without_a_body_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match="without a body"):
        encode_request_head("POST", "/api/v1/namespaces", "a:6443", [("content-length", "5")], set(), has_body=False)


@pytest.mark.parametrize("value", ["0", "00"])
def test_a_zero_content_length_without_a_body_passes(value: str) -> None:
    head, declared = encode_request_head("GET", "/api", "a:6443", [("content-length", value)], set(), has_body=False)
    assert f"content-length: {value}\r\n".encode() in head and declared is None


def test_a_declared_body_keeps_its_length() -> None:
    head, declared = encode_request_head("POST", "/api", "a:6443", [("content-length", "5")], set(), has_body=True)
    assert declared == 5 and b"transfer-encoding" not in head


@pytest.mark.parametrize("connection", [["x-secret"], ["keep-alive", "x-secret"], ["keep-alive, X-Secret"]])
def test_both_encoders_send_nothing_while_connection_names_a_field_still_present(connection: list[str]) -> None:
    from gatekeeper.proxy.upstream.hop_by_hop import REQUEST_REMOVED
    from gatekeeper.proxy.upstream.mux_wire import request_block

    headers = [*(("connection", c) for c in connection), ("x-secret", "1")]
    with pytest.raises(ValueError, match="Connection names fields still present"):
        encode_request_head("GET", "/api", "apiserver", headers, REQUEST_REMOVED, has_body=False)
    with pytest.raises(ValueError, match="Connection names fields still present"):
        request_block("GET", "/api", b"", headers, REQUEST_REMOVED)


def test_a_connection_that_names_only_hop_by_hop_fields_goes_out_without_them() -> None:
    from gatekeeper.proxy.upstream.hop_by_hop import REQUEST_REMOVED
    from gatekeeper.proxy.upstream.mux_wire import request_block

    headers = [("connection", "keep-alive"), ("connection", "te"), ("accept", "application/json")]
    head, _ = encode_request_head("GET", "/api", "apiserver", headers, REQUEST_REMOVED, has_body=False)
    assert b"connection" not in head.lower() and b"accept: application/json" in head
    assert request_block("GET", "/api", b"", headers, REQUEST_REMOVED)
