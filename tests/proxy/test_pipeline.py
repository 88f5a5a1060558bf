"""Pipeline shape: stage order, the flow-control seam and the proxy's own /metrics."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from edge_kit import fronted

from gatekeeper.kube import requestinfo
from gatekeeper.proxy.identity.auth import identity_headers, strip_remote
from gatekeeper.proxy.identity.tokens.classify import source_host
from gatekeeper.proxy.messages import Handler, Headers, ProxyRequest, ProxyResponse, UserInfo
from gatekeeper.proxy.pipeline.balancer import Balancer
from gatekeeper.proxy.pipeline.stages import (
    Dispatcher,
    build,
    chain,
    front_for,
    upstream_headers,
)
from gatekeeper.proxy.settings import BackendSettings, ProxySettings, UpstreamSettings


def req(method: str, target: str, headers: list[tuple[str, str]] | None = None, **kw: Any) -> ProxyRequest:
    return ProxyRequest(method=method, target=target, headers=headers or [], body=None, protocol="h2", **kw)


async def test_flow_control_sees_identity_and_requestinfo_before_dispatch() -> None:
    seen: dict[str, Any] = {}

    async def flow_control(request: ProxyRequest, next_handler: Handler) -> ProxyResponse:
        seen["user"] = request.user
        seen["info"] = request.info
        seen["headers"] = list(request.headers)
        return ProxyResponse(status=429, headers=[("retry-after", "1")])

    settings = ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1")])
    pipeline = build(settings, flow_control=flow_control)
    try:
        resp = await pipeline.handler(req("GET", "/api/v1/namespaces/a/secrets",
                                          [("authorization", "Bearer t"), ("x-remote-user", "admin")]))
    finally:
        await pipeline.close()
    assert resp.status == 429
    assert seen["user"].source == "token"
    assert (seen["info"].verb, seen["info"].resource, seen["info"].namespace) == ("list", "secrets", "a")
    assert ("x-remote-user", "admin") not in seen["headers"]


async def test_chain_runs_middlewares_in_order() -> None:
    order: list[str] = []

    def mw(name: str) -> Any:
        async def run(request: ProxyRequest, next_handler: Handler) -> ProxyResponse:
            order.append(name)
            return await next_handler(request)

        return run

    async def final(request: ProxyRequest) -> ProxyResponse:
        order.append("final")
        return ProxyResponse(status=200, headers=[])

    handler = chain([mw("a"), mw("b"), front_for(["system:masters"])], final)
    request = req("DELETE", "/api/v1/namespaces/a/pods")
    await handler(request)
    assert order == ["a", "b", "final"]
    assert request.info is not None and request.info.verb == "deletecollection"
    assert request.user is not None and request.user.source == "anonymous"


def _cert(cn: str, *orgs: str) -> dict[str, Any]:
    """A ``getpeercert()``-shaped verified certificate."""
    return {"subject": ((("commonName", cn),), *((("organizationName", o),) for o in orgs))}


async def test_proxy_answers_metrics_itself_to_masters() -> None:
    async def never(request: ProxyRequest) -> ProxyResponse:
        raise AssertionError("/metrics must not be forwarded")

    settings = ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1", name="b1")])
    pipeline = build(settings)
    from gatekeeper.proxy.pipeline import stages

    stages._sources.add(pipeline)  # what Pipeline.start does, without probing the backends
    resp = await front_for(["system:masters"])(req("GET", "/metrics", peer_cert=_cert("admin", "system:masters")),
                                               never)
    body = b"".join([c async for c in resp.body]).decode()
    await pipeline.close()
    assert resp.status == 200
    assert 'gatekeeper_proxy_backend_up{backend="b1"}' in body
    assert "gatekeeper_proxy_skew_in_flight_ratio" in body


@pytest.mark.parametrize("request_kw", [
    {},  # anonymous
    {"headers": [("authorization", "Bearer some-token")]},  # the proxy cannot check a token
    {"peer_cert": _cert("alice", "developers")},  # verified, but not an admin
    {"headers": [("x-remote-group", "system:masters")], "peer_cert": _cert("bob")},  # spoofed group
])
async def test_metrics_on_main_port_is_forbidden_to_non_admins(request_kw: dict[str, Any]) -> None:
    async def never(request: ProxyRequest) -> ProxyResponse:
        raise AssertionError("/metrics must not be forwarded")

    settings = ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1", name="b1")])
    pipeline = build(settings, flow_control=None)
    try:
        headers = request_kw.get("headers", [])
        resp = await pipeline.handler(req("GET", "/metrics", headers, peer_cert=request_kw.get("peer_cert")))
    finally:
        await pipeline.close()
    body = orjson.loads(b"".join([c async for c in resp.body]))
    assert resp.status == 403
    assert (body["kind"], body["reason"], body["code"]) == ("Status", "Forbidden", 403)
    assert "system:masters" in body["message"] and "gatekeeper_proxy" not in body["message"]


async def test_metrics_groups_are_configurable() -> None:
    async def never(request: ProxyRequest) -> ProxyResponse:
        raise AssertionError("/metrics must not be forwarded")

    mw = front_for(["monitoring"])
    ok = await mw(req("GET", "/metrics", peer_cert=_cert("prom", "monitoring")), never)
    no = await mw(req("GET", "/metrics", peer_cert=_cert("admin", "system:masters")), never)
    assert (ok.status, no.status) == (200, 403)


async def test_pipeline_errors_are_status_bodies_with_retry_after() -> None:
    settings = ProxySettings(backends=[BackendSettings(url="https://127.0.0.1:1", name="b1")],
                             upstream=UpstreamSettings(connect_timeout_seconds=1))
    pipeline = build(settings)
    try:
        resp = await pipeline.handler(req("POST", "/api/v1/namespaces/a/configmaps"))
    finally:
        await pipeline.close()
    body = orjson.loads(b"".join([c async for c in resp.body]))
    assert resp.status == 503 and ("retry-after", "1") in resp.headers
    assert (body["kind"], body["reason"], body["details"]) == ("Status", "ServiceUnavailable",
                                                               {"retryAfterSeconds": 1})


async def test_other_paths_pass_local_endpoints() -> None:
    async def nxt(request: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(status=204, headers=[])

    front = front_for(["system:masters"])
    assert (await front(req("GET", "/metricsx"), nxt)).status == 204
    assert (await front(req("POST", "/metrics"), nxt)).status == 204


def upstream_identity_headers(headers: Headers, user: UserInfo) -> Headers:
    """The oracle's first pass: client headers with spoofable identity removed and the proxy's assertion added."""
    return strip_remote(headers) + identity_headers(user)


def _forwarded_for(headers: Headers, peer: str) -> Headers:
    """The oracle's second pass: the client address appended to X-Forwarded-For."""
    if not peer:
        return headers
    host = source_host(peer)
    prior = [v for k, v in headers if k == "x-forwarded-for"]
    rest = [(k, v) for k, v in headers if k != "x-forwarded-for"]
    return [*rest, ("x-forwarded-for", ", ".join([*prior, host]))]


def test_forwarded_for_appends_client_address() -> None:
    assert _forwarded_for([("a", "1")], "127.0.0.1:4000") == [("a", "1"), ("x-forwarded-for", "127.0.0.1")]
    assert _forwarded_for([("x-forwarded-for", "10.0.0.1")], "[::1]:4000") == [
        ("x-forwarded-for", "10.0.0.1, ::1")]
    assert _forwarded_for([], "") == []


@pytest.mark.parametrize("peer", ["127.0.0.1:4000", "[::1]:4000", "", "unix"])
@pytest.mark.parametrize("user", [
    UserInfo(name="alice", groups=["dev", "system:masters"], extra={"Scopes": ["a b"]}, source="x509"),
    UserInfo(name="token:abc", source="token"),
    UserInfo(name="system:anonymous", groups=["system:unauthenticated"], source="anonymous"),
], ids=["x509", "token", "anonymous"])
def test_upstream_headers_in_one_pass_equal_the_identity_then_forwarded_for_passes(peer: str, user: UserInfo) -> None:
    headers = [("accept", "application/json"), ("X-Remote-User", "mallory"), ("x-forwarded-for", "10.0.0.1"),
               ("x-remote-group", "system:masters"), ("X-Forwarded-For", "10.0.0.2"), ("authorization", "Bearer t"),
               ("x-forwarded-for", "10.0.0.3"), ("x-remote-extra-scopes", "all")]
    expected = _forwarded_for(upstream_identity_headers(headers, user), peer)
    assert upstream_headers(headers, user, peer) == expected
    assert not any(k.lower().startswith("x-remote-") for k, _ in expected) or user.source == "x509"


def test_deploy_example_config_is_valid() -> None:
    from pathlib import Path

    from gatekeeper.base.config import from_mapping
    from gatekeeper.base.yamlfiles import load_yaml

    path = Path(__file__).resolve().parents[2] / "deploy" / "proxy" / "config.yaml"
    data = load_yaml(path)["proxy"]
    data["flowControl"] = {"enabled": False}  # its policy file lives on the node, not in the checkout
    settings = from_mapping(ProxySettings, data, str(path), "proxy")
    assert len(settings.backends) == 3 and settings.upstream.client_cert_file.endswith("front-proxy-client.crt")
    assert settings.listener.client_ca_file


def test_resource_label_is_bounded_against_invented_paths() -> None:
    from gatekeeper.proxy.metrics import resource_label

    assert resource_label("madeup-things-x1", 404) == "<unknown>"
    assert resource_label("configmaps-lbl-test", 200) == "configmaps-lbl-test"
    assert resource_label("configmaps-lbl-test", 404) == "configmaps-lbl-test"
    assert resource_label("", 404) == ""


def test_sandbox_proxy_config_merges_user_file_but_owns_ports_certs_and_backends(tmp_path: Any) -> None:
    from gatekeeper.base.config import from_mapping
    from gatekeeper.sandbox.state import SandboxState
    from gatekeeper.sandbox.with_proxy import build_config

    state = SandboxState(dir=str(tmp_path), certs_dir=str(tmp_path / "certs"),
                         apiserver_urls=["https://127.0.0.1:1001", "https://127.0.0.1:1002"])
    user = {"listener": {"port": 9}, "backends": [{"url": "https://elsewhere:1"}],
            "protocol": {"drainTimeoutSeconds": 5}, "upstream": {"maxConnectionsPerBackend": 7},
            "flowControl": {"enabled": False}}
    config = build_config(state, port=4443, metrics_port=4444, serving_cert=tmp_path / "s.crt",
                          serving_key=tmp_path / "s.key", goaway_chance=0.5, user_config=user)
    settings = from_mapping(ProxySettings, config["proxy"], "<generated>", "proxy")
    assert settings.listener.port == 4443 and settings.listener.metrics_port == 4444
    assert [b.url for b in settings.backends] == state.apiserver_urls
    assert settings.listener.client_ca_file.endswith("certs/ca.crt")
    assert settings.upstream.client_cert_file.endswith("front-proxy-client.crt")
    assert settings.upstream.max_connections_per_backend == 7
    assert settings.protocol.drain_timeout_seconds == 5
    assert settings.protocol.goaway_chance == 0.5 and settings.protocol.allow_unsafe_goaway_chance


@pytest.mark.parametrize(("method", "target", "kw"), [
    ("GET", "/api/v1/namespaces/a/pods", {"headers": [("authorization", "Bearer t"), ("x-remote-user", "root"),
                                                      ("connection", "x-remote-group")]}),
    ("GET", "/healthz/../api/v1/secrets", {}),  # refused target, before identity
    ("OPTIONS", "*", {}),
    ("GET", "/api", {"peer_cert": _cert("sys\ntem:masters")}),  # refused certificate name
    ("GET", "/metrics", {"peer_cert": _cert("admin", "system:masters")}),
    ("GET", "/metrics?x=1", {"headers": [("authorization", "Bearer t")]}),  # 403
    ("POST", "/metrics", {"peer_cert": _cert("alice")}),  # forwarded: only GET/HEAD are local
])
async def test_the_fused_front_stage_answers_exactly_like_the_four_stages(
        method: str, target: str, kw: dict[str, Any]) -> None:
    async def final(request: ProxyRequest) -> ProxyResponse:
        return ProxyResponse(status=299, headers=[("x-seen", repr((request.user, request.info, request.headers)))])

    async def outcome(handler: Handler) -> tuple[int, Any, Any, Any]:
        request = req(method, target, list(kw.get("headers", [])), peer_cert=kw.get("peer_cert"))
        resp = await handler(request)
        body = b"".join([c async for c in resp.body]) if resp.status != 200 else b"(metrics page)"
        return resp.status, [h for h in resp.headers if h[0] != "content-length"], body, (request.user, request.info)

    from gatekeeper.proxy.pipeline import stages

    # The four stages as separate middlewares (how the pipeline ran them before they were fused): the oracle.
    async def request_target(request: ProxyRequest, nxt: Handler) -> ProxyResponse:
        return stages._refuse_target(request) or await nxt(request)

    async def identity(request: ProxyRequest, nxt: Handler) -> ProxyResponse:
        return stages._establish_identity(request) or await nxt(request)

    async def request_info(request: ProxyRequest, nxt: Handler) -> ProxyResponse:
        request.info = requestinfo.parse(request.method, request.target)
        return await nxt(request)

    own_page = stages._metrics_page_for(["system:masters"])

    async def local_endpoints(request: ProxyRequest, nxt: Handler) -> ProxyResponse:
        return await own_page(request) if stages._is_local(request) else await nxt(request)

    fused = await outcome(chain([front_for(["system:masters"])], final))
    separate = await outcome(chain([request_target, identity, request_info, local_endpoints], final))
    assert fused == separate


class _Answers503:
    """A backend client stub: every request gets a 503 (what a Service without endpoints is answered)."""

    async def send(self, request: ProxyRequest, headers: Any, **_: Any) -> ProxyResponse:
        return ProxyResponse(status=503, headers=[])


@pytest.mark.parametrize("target", [
    "/api/v1/namespaces/a/services/empty:80/proxy/",
    "/api/v1/namespaces/a/pods/p/proxy/x",
    "/api/v1/nodes/n/proxy/metrics",
    "/api/v1/proxy/namespaces/a/services/empty/",
    "/api/v1/namespaces/a/pods/p/log",
    "/apis/metrics.k8s.io/v1beta1",
    "/apis/metrics.k8s.io/v1beta1/namespaces/a/pods",
    "/apis/example.com/v1/namespaces/a/widgets",
    "/openapi/v3/apis/metrics.k8s.io/v1beta1",
])
async def test_statuses_of_other_servers_behind_the_apiserver_never_make_a_5xx_storm(target: str) -> None:
    balancer = Balancer([BackendSettings(url="https://a:1", name="a"), BackendSettings(url="https://b:1", name="b")])
    dispatch = Dispatcher(balancer, {"a": _Answers503(), "b": _Answers503()})  # type: ignore[dict-item]
    for _ in range(40):
        assert (await dispatch(fronted(req("GET", target, [("authorization", "Bearer t")])))).status == 503
    assert sum(b.ejections_total for b in balancer.backends) == 0


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
async def test_5xx_answers_to_writes_never_make_a_storm(method: str) -> None:
    """Writes go through admission: a webhook that cannot be called (failurePolicy Fail) is a 500 from every
    apiserver, as often as a tenant writes into its own namespace."""
    balancer = Balancer([BackendSettings(url="https://a:1", name="a"), BackendSettings(url="https://b:1", name="b")])
    dispatch = Dispatcher(balancer, {"a": _Answers503(), "b": _Answers503()})  # type: ignore[dict-item]
    for _ in range(40):
        await dispatch(fronted(req(method, "/api/v1/namespaces/a/configmaps/c", [("authorization", "Bearer t")])))
    assert sum(b.ejections_total for b in balancer.backends) == 0


@pytest.mark.parametrize("target", [
    "/api/v1/namespaces/a/configmaps", "/apis/apps/v1/namespaces/a/deployments", "/apis", "/apis/apps/v1",
    "/api/v1/namespaces/a/pods/p/status", "/readyz", "/openapi/v2", "/openapi/v3/apis/apps/v1",
    "/openapi/v3/api/v1",
])
async def test_the_apiservers_own_5xx_still_make_a_storm(target: str) -> None:
    balancer = Balancer([BackendSettings(url="https://a:1", name="a"), BackendSettings(url="https://b:1", name="b")])
    dispatch = Dispatcher(balancer, {"a": _Answers503(), "b": _Answers503()})  # type: ignore[dict-item]
    for _ in range(40):
        await dispatch(fronted(req("GET", target, [("authorization", "Bearer t")])))
    assert sum(b.ejections_total for b in balancer.backends) == 1


class _OpenWatch:
    """A backend client stub: every request is answered 200 and stays open until its response is finished."""

    async def send(self, request: ProxyRequest, headers: Any, **_: Any) -> ProxyResponse:
        return ProxyResponse(status=200, headers=[])


async def test_one_caller_holds_at_most_its_share_of_long_running_requests() -> None:
    """Watches run outside every seat once set up and each holds a long-running pool connection: without a
    per-caller bound one tenant's streams could hold the whole pool (every other watch then got a 503)."""
    balancer = Balancer([BackendSettings(url="https://a:1", name="a"), BackendSettings(url="https://b:1", name="b")])
    dispatch = Dispatcher(balancer, {"a": _OpenWatch(), "b": _OpenWatch()},  # type: ignore[dict-item]
                          max_long_running_per_caller=2)
    watch = "/api/v1/namespaces/a/configmaps?watch=1"
    mine = [("authorization", "Bearer mine")]
    held = [await dispatch(fronted(req("GET", watch, mine))) for _ in range(2)]
    assert [r.status for r in held] == [200, 200]
    refused = await dispatch(fronted(req("GET", "/api/v1/namespaces/a/pods/p/log?follow=true", mine)))
    assert refused.status == 429 and dict(refused.headers)["retry-after"] == "1"
    assert orjson.loads(b"".join([c async for c in refused.body]))["reason"] == "TooManyRequests"
    assert (await dispatch(fronted(req("GET", watch, [("authorization", "Bearer other")])))).status == 200
    assert (await dispatch(fronted(req("GET", "/api/v1/namespaces/a/configmaps", mine)))).status == 200  # short: no cap
    # the front stage's verified identity is the caller, whichever of its tokens it sends
    same_sa = [fronted(req("GET", watch, [("authorization", f"Bearer token-{i}")], caller="system:sa"))
               for i in range(3)]
    assert [(await dispatch(r)).status for r in same_sa] == [200, 200, 429]
    held[0].finish(None)
    assert (await dispatch(fronted(req("GET", watch, mine)))).status == 200
    assert balancer.long_running_of("system:sa") == 2


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_long_running_cap_below_one_is_refused(tmp_path: Any, value: str) -> None:
    from gatekeeper.base.config import ConfigError, load_config

    p = tmp_path / "c.yaml"
    p.write_text("proxy:\n  backends: [{url: 'https://127.0.0.1:1'}]\n  listener: {certFile: a, keyFile: b}\n"
                 f"  upstream: {{caFile: ca, maxLongRunningPerCaller: {value}}}\n")
    with pytest.raises(ConfigError, match=r"proxy.upstream: maxLongRunningPerCaller must be at least 1"):
        load_config(p)


class _Answers504:
    """A backend client stub: kube-apiserver's answer to a read with ``?timeout=1ns`` (its timeout filter)."""

    async def send(self, request: ProxyRequest, headers: Any, **_: Any) -> ProxyResponse:
        return ProxyResponse(status=504, headers=[])


@pytest.mark.parametrize("target", [
    "/api/v1/namespaces/a/configmaps?timeout=1ns",
    "/api/v1/namespaces/a/configmaps?%74imeout=1ns",
    "/api/v1/namespaces/a/pods?resourceVersion=99999999999&resourceVersionMatch=NotOlderThan",
    "/version?timeout=1ns",
])
async def test_a_deadline_the_client_picked_never_makes_a_5xx_storm(target: str) -> None:
    """kube-apiserver answers 504 when the client's ``timeout`` passes (before authentication: any caller) or
    its watch cache has not reached the client's ``resourceVersion``: 40 such GETs ejected an apiserver."""
    balancer = Balancer([BackendSettings(url="https://a:1", name="a"), BackendSettings(url="https://b:1", name="b")])
    dispatch = Dispatcher(balancer, {"a": _Answers504(), "b": _Answers504()})  # type: ignore[dict-item]
    for _ in range(40):
        assert (await dispatch(fronted(req("GET", target)))).status == 504
    assert sum(b.ejections_total for b in balancer.backends) == 0
