"""Request-target attacks: steering the proxy to another host, bypassing flow control by dot segments.

The fast half, against the real listener and pipeline with an echoing
backend (it proves byte-for-byte fidelity of the request line, which a real
apiserver cannot show). The same attacks against real kube-apiservers are in
``test_edge_sandbox.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from edge_kit import bench, body_json, make_pki, rejected, status_of

from gatekeeper.certs.pki import PKI
from gatekeeper.kube import requestinfo
from gatekeeper.proxy import target


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize(("method", "tgt", "reason"), [
    ("GET", "@127.0.0.1:1/x", "target_form"),
    ("GET", "http://127.0.0.1:1/x", "target_form"),
    ("CONNECT", "127.0.0.1:1", "target_form"),
    ("GET", "*", "target_form"),
    ("GET", "/healthz/../api/v1/secrets", "dot_segment"),
    ("GET", "/healthz/%2E%2E/api/v1/secrets", "dot_segment"),
    ("GET", "/healthz/%2e./api/v1/secrets", "dot_segment"),
    ("GET", "/api/v1/./secrets", "dot_segment"),
    ("GET", "/api/v1/namespaces/a/..", "dot_segment"),
    ("GET", "/healthz%2F..%2Fapi/v1/secrets", "dot_segment"),
    ("GET", "/api/v1/pods%00", "nul"),
    ("GET", "/api/v1/pods\x00", "nul"),
    ("GET", "/api/v1/pods\r\nx", "bad_byte"),
    ("GET", "/api/v1/pöds", "bad_byte"),
    ("GET", "/api/v1/pods#frag", "fragment"),
    ("GET", "/api/v1/namespaces/a/configmaps/x%zz", "bad_escape"),
    ("GET", "/api/v1/pods%4", "bad_escape"),
    ("GET", "/api/v1/pods/%", "bad_escape"),
    ("GET", "/api/v1/pods/%%41", "bad_escape"),
])
def test_unsafe_targets_are_refused_with_a_reason(method: str, tgt: str, reason: str) -> None:
    bad = target.check(method, tgt)
    assert bad is not None and bad.reason == reason


@pytest.mark.parametrize("tgt", [
    "/api/v1/pods", "/api/v1/namespaces/a%2Fb/pods?x=%20&y=1", "//double//slash", "/api/v1/pods;x",
    "/healthz?x=../y", "/api/v1/namespaces/a.b/pods/c..d", "/apis/x/v1/things/%252E%252E", "/",
    "/api/v1/pods?labelSelector=%zz",  # a bad escape in the query: Go drops that pair, it refuses no request
])
def test_ordinary_targets_pass_unchanged(tgt: str) -> None:
    assert target.check("GET", tgt) is None


def test_options_star_is_the_one_non_path_target() -> None:
    assert target.check("OPTIONS", "*") is None


async def test_at_sign_target_reaches_no_socket(pki: PKI) -> None:
    """``@127.0.0.1:PORT/x`` must not become an authority: the canary sees no connection."""
    accepted: list[int] = []

    async def canary_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        writer.close()

    canary = await asyncio.start_server(canary_conn, "127.0.0.1", 0)
    cport = canary.sockets[0].getsockname()[1]
    try:
        async with bench(pki) as b:
            before = rejected("target_form")
            for tgt in (f"@127.0.0.1:{cport}/x", f"https://127.0.0.1:{cport}/x", f"127.0.0.1:{cport}"):
                method = "CONNECT" if not tgt.startswith(("@", "https")) else "GET"
                raw = await b.raw(f"{method} {tgt} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                assert status_of(raw) == 400, raw[:200]
                status = body_json(raw)
                assert (status["kind"], status["code"], status["reason"]) == ("Status", 400, "BadRequest")
            assert accepted == [], "the proxy opened a connection to a host the client named"
            assert b.backend.paths() == [], "a refused target still reached the backend"
            assert rejected("target_form") - before == 3
            assert all(be.ejections_total == 0 for be in b.pipeline.balancer.backends)
    finally:
        canary.close()


@pytest.mark.parametrize("tgt", [
    "/healthz/../api/v1/secrets", "/healthz/%2E%2E/api/v1/secrets", "/livez/%2e%2E/api/v1/secrets",
])
async def test_dot_segment_bypass_is_a_400_and_never_forwarded(pki: PKI, tgt: str) -> None:
    async with bench(pki) as b:
        raw = await b.raw(f"GET {tgt} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        assert status_of(raw) == 400
        assert "dot segment" in body_json(raw)["message"]
        assert b.backend.paths() == []


@pytest.mark.parametrize("tgt", [
    "/api/v1/namespaces/a%2Fb/pods?x=%20&y=1", "//api//v1/pods", "/api/v1/pods;x=1",
    "/apis/x/v1/things/%252E%252E?labelSelector=a%3Db", "/api/v1/namespaces/x/configmaps/a~b%41",
])
async def test_backend_receives_exactly_the_target_requestinfo_classified(pki: PKI, tgt: str) -> None:
    classified: list[str] = []
    orig = requestinfo.parse

    def spy(method: str, raw_target: str) -> Any:
        classified.append(raw_target)
        return orig(method, raw_target)

    async with bench(pki) as b:
        import gatekeeper.proxy.pipeline.stages as pipeline_module

        pipeline_module.requestinfo.parse = spy  # type: ignore[assignment]
        try:
            raw = await b.raw(f"GET {tgt} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        finally:
            pipeline_module.requestinfo.parse = orig  # type: ignore[assignment]
        assert status_of(raw) == 200, raw[:300]
        assert b.backend.paths() == [tgt.encode()], "the backend got a different request line"
        assert classified == [tgt]
        assert body_json(raw)["target"] == tgt


async def test_options_star_is_answered_locally(pki: PKI) -> None:
    async with bench(pki) as b:
        raw = await b.raw(b"OPTIONS * HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert status_of(raw) == 200
        assert b.backend.paths() == []


async def test_bad_target_never_ejects_a_backend(pki: PKI, tmp_path: Path) -> None:
    async with bench(pki) as b:
        for i in range(20):
            await b.raw(f"GET @127.0.0.1:{i + 1}/x HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        be = b.pipeline.balancer.backends[0]
        assert be.ejections_total == 0 and b.pipeline.balancer.health(be) == "healthy"
