"""Label sets stay bounded whatever paths and methods clients invent."""

from __future__ import annotations

import asyncio

import pytest
from edge_kit import bench, make_pki
from prometheus_client import REGISTRY

from gatekeeper.certs.pki import PKI
from gatekeeper.proxy import metrics, rejections
from gatekeeper.proxy.messages import ProxyRequest


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def series(prefix: str) -> int:
    return sum(1 for m in REGISTRY.collect() if m.name.startswith(prefix) for _ in m.samples)


def invented(i: int) -> tuple[str, str]:
    """A made-up method and path: resource paths the backend refuses (403), and non-resource paths."""
    method = f"M{i}X"
    if i % 2:
        return method, f"/api/v1/namespaces/ns{i}/forbidden-{i}/name{i}"
    return method, f"/made/up/{i}"


async def test_ten_thousand_invented_paths_and_methods_add_a_bounded_number_of_series(pki: PKI) -> None:
    async with bench(pki) as b:
        before = series("gatekeeper_proxy_request")
        sem = asyncio.Semaphore(32)

        async def one(i: int) -> int:
            method, path = invented(i)
            async with sem:
                resp = await b.pipeline.handler(ProxyRequest(
                    method=method, target=path, headers=[], body=None, protocol="h2", peer="127.0.0.1:1"))
                async for _ in resp.body:
                    pass
                resp.finish(None)
                return resp.status

        statuses = await asyncio.gather(*(one(i) for i in range(10_000)))
        assert set(statuses) <= {200, 403}
        assert len(b.backend.paths()) == 10_000
        grown = series("gatekeeper_proxy_request") - before
        # requests_total: (verb=other) x (resource: "" or <unknown>) x (code 200/403);
        # duration: one histogram for verb=other (buckets + sum + count + created).
        assert grown <= 40, f"{grown} new series from invented input"


def test_resource_label_learns_only_from_success_and_has_a_hard_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "_known_resources", set())
    monkeypatch.setattr(metrics, "MAX_KNOWN_RESOURCES", 3)
    assert metrics.resource_label("widgets", 403) == "<unknown>"
    assert metrics.resource_label("widgets", 401) == "<unknown>"
    assert metrics.resource_label("widgets", 429) == "<unknown>"
    assert metrics.resource_label("pods", 200) == "pods"
    assert metrics.resource_label("pods", 404) == "pods"
    assert metrics.resource_label("a", 201) == "a"
    assert metrics.resource_label("pods/exec", 400) == "pods/exec"
    assert metrics.resource_label("c", 200) == "<other>"
    assert metrics.resource_label("", 200) == ""


@pytest.mark.parametrize(("verb", "label"), [
    ("list", "list"), ("deletecollection", "deletecollection"), ("head", "head"), ("options", "options"),
    ("", "other"), ("m1x", "other"), ("propfind", "other"),
])
def test_unknown_verbs_are_other(verb: str, label: str) -> None:
    assert metrics.verb_label(verb) == label


def test_rejection_log_is_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = rejections.RateLimitedLog(rejections.reject_log.logger, 10.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="gatekeeper.proxy.rejected"):
        logged = [limited.warning("nul", f"attempt {i}") for i in range(100)]
        now[0] = 11.0
        limited.warning("nul", "later")
    assert logged.count(True) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "nul: attempt 0", "nul: later (99 more nul since the last report)"]


def test_every_h2_flood_kind_is_a_known_rejection_reason() -> None:
    from gatekeeper.proxy.listen import h2_limits

    kinds = {h2_limits.RST_STREAM, h2_limits.PING, h2_limits.SETTINGS, h2_limits.EMPTY_FRAME, h2_limits.CLOSED_STREAM}
    assert {f"h2_flood_{k}" for k in kinds} <= set(rejections.REJECT_REASONS)


def test_a_client_target_with_percent_signs_is_logged_verbatim(caplog: pytest.LogCaptureFixture) -> None:
    limited = rejections.RateLimitedLog(rejections.reject_log.logger, 10.0, clock=lambda: 0.0)
    with caplog.at_level("WARNING", logger="gatekeeper.proxy.rejected"):
        limited.warning("dot_segment", "GET /api/%2e%2e/%s%d: dot segment")
    assert [r.getMessage() for r in caplog.records] == ["dot_segment: GET /api/%2e%2e/%s%d: dot segment"]
