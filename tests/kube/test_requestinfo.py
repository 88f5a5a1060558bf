"""RequestInfo table: the paths kube-apiserver documents, and what it derives from them."""

from __future__ import annotations

import pytest

from gatekeeper.kube import requestinfo
from gatekeeper.kube.requestinfo import parse

# method, target, verb, prefix, group, version, namespace, resource, subresource, name
RESOURCE_CASES = [
    ("GET", "/api/v1/namespaces", "list", "api", "", "v1", "", "namespaces", "", ""),
    ("GET", "/api/v1/namespaces/other", "get", "api", "", "v1", "other", "namespaces", "", "other"),
    ("GET", "/api/v1/namespaces/other/pods", "list", "api", "", "v1", "other", "pods", "", ""),
    ("GET", "/api/v1/namespaces/other/pods/foo", "get", "api", "", "v1", "other", "pods", "", "foo"),
    ("HEAD", "/api/v1/namespaces/other/pods/foo", "get", "api", "", "v1", "other", "pods", "", "foo"),
    ("GET", "/api/v1/pods", "list", "api", "", "v1", "", "pods", "", ""),
    ("HEAD", "/api/v1/pods", "list", "api", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/namespaces/other/pods/foo", "get", "api", "", "v1", "other", "pods", "", "foo"),
    ("GET", "/api/v1/namespaces/other/pods", "list", "api", "", "v1", "other", "pods", "", ""),
    # special verbs
    ("GET", "/api/v1/proxy/namespaces/other/pods/foo", "proxy", "api", "", "v1", "other", "pods", "", "foo"),
    ("GET", "/api/v1/proxy/namespaces/other/pods/foo/subpath/not/a/subresource", "proxy", "api", "", "v1",
     "other", "pods", "", "foo"),
    ("GET", "/api/v1/watch/pods", "watch", "api", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/pods?watch=true", "watch", "api", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/pods?watch=1", "watch", "api", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/pods?watch=false", "list", "api", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/pods?watch=0", "list", "api", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/watch/namespaces/other/pods", "watch", "api", "", "v1", "other", "pods", "", ""),
    # fieldSelector narrows list/watch to one name
    ("GET", "/api/v1/namespaces/other/pods?fieldSelector=metadata.name%3Dfoo", "list", "api", "", "v1",
     "other", "pods", "", "foo"),
    ("GET", "/api/v1/namespaces/other/pods?watch=true&fieldSelector=metadata.name%3D%3Dfoo", "watch", "api",
     "", "v1", "other", "pods", "", "foo"),
    ("GET", "/api/v1/namespaces/other/pods?fieldSelector=metadata.name%21%3Dfoo", "list", "api", "", "v1",
     "other", "pods", "", ""),
    ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1,metadata.name%3Dbar", "list", "api", "", "v1",
     "", "pods", "", "bar"),
    ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dn1", "list", "api", "", "v1", "", "pods", "", ""),
    # subresources
    ("GET", "/api/v1/namespaces/other/pods/foo/status", "get", "api", "", "v1", "other", "pods", "status",
     "foo"),
    ("PUT", "/api/v1/namespaces/other/finalize", "update", "api", "", "v1", "other", "namespaces",
     "finalize", "other"),
    ("PUT", "/api/v1/namespaces/other/status", "update", "api", "", "v1", "other", "namespaces", "status",
     "other"),
    ("POST", "/api/v1/namespaces/other/pods/foo/binding", "create", "api", "", "v1", "other", "pods",
     "binding", "foo"),
    # verbs by method
    ("POST", "/api/v1/namespaces/other/pods", "create", "api", "", "v1", "other", "pods", "", ""),
    ("PUT", "/api/v1/namespaces/other/pods/foo", "update", "api", "", "v1", "other", "pods", "", "foo"),
    ("PATCH", "/api/v1/namespaces/other/pods/foo", "patch", "api", "", "v1", "other", "pods", "", "foo"),
    ("DELETE", "/api/v1/namespaces/other/pods/foo", "delete", "api", "", "v1", "other", "pods", "", "foo"),
    ("DELETE", "/api/v1/namespaces/other/pods", "deletecollection", "api", "", "v1", "other", "pods", "", ""),
    ("OPTIONS", "/api/v1/namespaces/other/pods/foo", "", "api", "", "v1", "other", "pods", "", "foo"),
    # groups
    ("GET", "/apis/extensions/v1beta1/namespaces/other/ingresses", "list", "apis", "extensions", "v1beta1",
     "other", "ingresses", "", ""),
    ("GET", "/apis/apps/v1/namespaces/other/deployments/foo/scale", "get", "apis", "apps", "v1", "other",
     "deployments", "scale", "foo"),
    ("GET", "/apis/apps/v1/watch/namespaces/other/deployments", "watch", "apis", "apps", "v1", "other",
     "deployments", "", ""),
    ("GET", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-scheduler", "get", "apis",
     "coordination.k8s.io", "v1", "kube-system", "leases", "", "kube-scheduler"),
    ("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles", "list", "apis", "rbac.authorization.k8s.io",
     "v1", "", "clusterroles", "", ""),
    ("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", "create", "apis",
     "authorization.k8s.io", "v1", "", "selfsubjectaccessreviews", "", ""),
    # URL-escaped path segments are decoded as Go's URL.Path is
    ("GET", "/api/v1/namespaces/other/secrets/a%2Db", "get", "api", "", "v1", "other", "secrets", "", "a-b"),
]


@pytest.mark.parametrize(
    ("method", "target", "verb", "prefix", "group", "version", "namespace", "resource", "subresource",
     "name"),
    RESOURCE_CASES,
)
def test_resource_request_is_parsed_like_the_apiserver(
    method: str, target: str, verb: str, prefix: str, group: str, version: str, namespace: str,
    resource: str, subresource: str, name: str,
) -> None:
    info = parse(method, target)
    assert info.is_resource_request
    assert (info.verb, info.api_prefix, info.api_group, info.api_version, info.namespace, info.resource,
            info.subresource, info.name) == (verb, prefix, group, version, namespace, resource, subresource,
                                             name)


NON_RESOURCE_CASES = [
    ("GET", "/", "get"),
    ("GET", "/healthz", "get"),
    ("GET", "/livez?verbose", "get"),
    ("GET", "/readyz/etcd", "get"),
    ("GET", "/version", "get"),
    ("GET", "/metrics", "get"),
    ("GET", "/openapi/v2", "get"),
    ("GET", "/openapi/v3/apis/apps/v1?hash=ABC", "get"),
    ("GET", "/api", "get"),
    ("GET", "/api/v1", "get"),
    ("GET", "/apis", "get"),
    ("GET", "/apis/apps", "get"),
    ("GET", "/apis/apps/v1", "get"),
    ("POST", "/apis/apps/v1", "post"),
    ("DELETE", "/healthz", "delete"),
    ("GET", "/other/v1/pods", "get"),
]


@pytest.mark.parametrize(("method", "target", "verb"), NON_RESOURCE_CASES)
def test_non_resource_url_keeps_lowercase_http_method_as_verb(method: str, target: str, verb: str) -> None:
    info = parse(method, target)
    assert not info.is_resource_request
    assert info.verb == verb
    assert (info.resource, info.name, info.namespace) == ("", "", "")
    assert info.path == target.split("?")[0]


@pytest.mark.parametrize(
    ("method", "target", "long_running"),
    [
        ("GET", "/api/v1/pods?watch=true", True),
        ("GET", "/api/v1/watch/namespaces/a/pods", True),
        ("GET", "/api/v1/pods", False),
        ("GET", "/api/v1/namespaces/a/pods/p/log?follow=true", True),
        ("GET", "/api/v1/namespaces/a/pods/p/log", False),
        ("GET", "/api/v1/namespaces/a/pods/p/log?follow=false", False),
        ("POST", "/api/v1/namespaces/a/pods/p/exec?command=ls", True),
        ("GET", "/api/v1/namespaces/a/pods/p/exec?command=ls", True),
        ("POST", "/api/v1/namespaces/a/pods/p/attach", True),
        ("POST", "/api/v1/namespaces/a/pods/p/portforward", True),
        ("GET", "/api/v1/namespaces/a/pods/p/proxy/metrics", True),
        ("GET", "/api/v1/proxy/namespaces/a/pods/p", True),
        ("GET", "/api/v1/namespaces/a/services/s:80/proxy/", True),
        ("PUT", "/api/v1/namespaces/a/pods/p/status", False),
        ("GET", "/healthz", False),
    ],
)
def test_long_running_requests_are_detected(method: str, target: str, long_running: bool) -> None:
    assert parse(method, target).long_running is long_running


def test_resource_key_joins_subresource() -> None:
    assert parse("GET", "/api/v1/namespaces/a/pods/p/log").resource_key == "pods/log"
    assert parse("GET", "/api/v1/secrets").resource_key == "secrets"


def test_legacy_special_verb_without_resource_is_resource_request_without_resource() -> None:
    info = parse("GET", "/api/v1/watch")
    assert info.is_resource_request and info.verb == "watch" and info.resource == ""


def test_parts_start_at_resource() -> None:
    assert parse("GET", "/apis/apps/v1/namespaces/ns/deployments/d/scale").parts == (
        "deployments", "d", "scale")


def test_parse_is_memoized_for_repeated_targets_but_not_for_huge_ones():
    from gatekeeper.kube import requestinfo

    a = parse("GET", "/api/v1/namespaces/memo/pods?watch=1")
    assert parse("GET", "/api/v1/namespaces/memo/pods?watch=1") is a
    # the method is part of the key: upstream reads it case-sensitively, so "get" is another request
    assert parse("get", "/api/v1/namespaces/memo/pods?watch=1").verb == ""
    huge = "/api/v1/namespaces/memo/pods?labelSelector=" + "x" * requestinfo.CACHE_MAX_TARGET
    first, second = parse("GET", huge), parse("GET", huge)
    assert first == second and first is not second and first.verb == "list"


# The query as the apiserver's Go code reads it (url.ParseQuery, strings.EqualFold, fields.ParseSelector).
# Each row was checked against the sandbox's kube-apiserver v1.37.2 (tests/flowcontrol/test_sandbox_query_semantics.py
# proves the LIST rows end to end): what it executed is the verb and name expected here.
GO_QUERY_CASES = [
    # a pair holding ';' is dropped whole: the apiserver serves a LIST, not a watch
    ("/api/v1/namespaces/x/secrets?watch=1;", "list", ""),
    ("/api/v1/namespaces/x/secrets?watch=1;&watch=0", "list", ""),
    # a malformed escape drops the pair
    ("/api/v1/namespaces/x/secrets?watch=1%zz", "list", ""),
    ("/api/v1/namespaces/x/secrets?watch=1%", "list", ""),
    # EqualFold: U+017F (long s) folds to s, so this is watch=false
    ("/api/v1/namespaces/x/secrets?watch=fal%C5%BFe", "list", ""),
    ("/api/v1/namespaces/x/secrets?watch=FaLsE", "list", ""),
    ("/api/v1/namespaces/x/secrets?watch=", "watch", ""),
    ("/api/v1/namespaces/x/secrets?watch", "watch", ""),
    ("/api/v1/namespaces/x/secrets?%77atch=1", "watch", ""),
    ("/api/v1/namespaces/x/secrets?watch=0&watch=1", "list", ""),
    ("/api/v1/namespaces/x/secrets?watch=+1", "watch", ""),
    # fieldSelector dropped (';', bad escape): the whole collection, no name
    ("/api/v1/namespaces/x/secrets?fieldSelector=metadata.name%3Ds1;", "list", ""),
    ("/api/v1/namespaces/x/secrets?fieldSelector=metadata.name%3Ds1%zz", "list", ""),
    # selector escapes: the name is the unescaped value; a bad escape or bare '=' in a value narrows nothing
    ("/api/v1/namespaces/x/secrets?fieldSelector=metadata.name%3Da%5C%2Cb", "list", "a,b"),
    ("/api/v1/namespaces/x/secrets?fieldSelector=type%3Da%5C%2Cmetadata.name%3Ds1", "list", ""),
    ("/api/v1/namespaces/x/secrets?fieldSelector=metadata.name%3Ds1%5C", "list", ""),
    ("/api/v1/namespaces/x/secrets?fieldSelector=metadata.name%3Ds1%3D%3Dx", "list", ""),
    # no whitespace trimming: ' metadata.name' is another field (the apiserver 400s it)
    ("/api/v1/namespaces/x/secrets?fieldSelector=%20metadata.name%3Ds1", "list", ""),
    # terms are sorted before the first metadata.name term is taken
    ("/api/v1/namespaces/x/secrets?fieldSelector=metadata.name%3Db,metadata.name%3Da", "list", "a"),
    ("/api/v1/namespaces/x/secrets?fieldSelector=metadata.name%3D.", "list", ""),
]


@pytest.mark.parametrize(("target", "verb", "name"), GO_QUERY_CASES)
def test_query_is_read_the_way_the_apiserver_reads_it(target: str, verb: str, name: str) -> None:
    info = parse("GET", target)
    assert (info.verb, info.name, info.resource, info.namespace) == (verb, name, "secrets", "x")
    assert info.long_running is (verb == "watch")


def test_a_double_slash_target_is_a_path_not_an_authority() -> None:
    """Go never reads ``//host`` in a request target as an authority; urlsplit did (netloc 'api')."""
    info = parse("GET", "//api/v1/namespaces/x/secrets")
    assert (info.verb, info.resource, info.namespace) == ("list", "secrets", "x")


def test_follow_uses_the_same_bool_rules() -> None:
    assert parse("GET", "/api/v1/namespaces/x/pods/p/log?follow=1").long_running
    assert not parse("GET", "/api/v1/namespaces/x/pods/p/log?follow=1;").long_running
    assert not parse("GET", "/api/v1/namespaces/x/pods/p/log?follow=fal%C5%BFe").long_running


@pytest.mark.parametrize("method", ["get", "Get", "gEt", "head", "post", "delete"])
def test_a_resource_verb_comes_from_the_method_spelled_exactly(method: str) -> None:
    """kube-apiserver switches on the method as sent (HTTP methods are case-sensitive): ``get`` on a
    collection is verb "" there (and a 405), never a LIST; a non-resource verb is the lower-cased method."""
    assert parse(method, "/api/v1/namespaces/a/secrets").verb == ""
    assert parse(method, "/api/v1/namespaces/a/secrets/s1").verb == ""
    assert parse(method, "/healthz").verb == method.lower()


# (query, verb): the watch value U+017F spells "false" only for EqualFold; upstream reads it with ToLower
# (a watch) once any ListOptions field fails to decode, and with EqualFold (a list) otherwise
DECODE_CASES = [
    ("watch=fal%C5%BFe&limit=x", "watch"),
    ("watch=fal%C5%BFe&limit=", "watch"),
    ("watch=fal%C5%BFe&timeoutSeconds=", "watch"),
    ("watch=fal%C5%BFe&timeoutSeconds=1.5", "watch"),
    ("labelSelector=%21%21&watch=fal%C5%BFe", "watch"),
    ("labelSelector=a%3Db%3Dc&watch=fal%C5%BFe", "watch"),
    ("fieldSelector=a%3D%3D%3D&watch=fal%C5%BFe", "watch"),
    ("fieldSelector=bogus&watch=fal%C5%BFe", "watch"),
    ("watch=fal%C5%BFe&limit=9223372036854775808", "watch"),
    ("watch=fal%C5%BFe", "list"),
    ("watch=fal%C5%BFe&limit=-5", "list"),
    ("watch=fal%C5%BFe&limit=%2B5&timeoutSeconds=30", "list"),
    ("watch=fal%C5%BFe&labelSelector=a%3Db%2C%21c%2Cd+in+%28x%2Cy%29", "list"),
    ("watch=fal%C5%BFe&fieldSelector=metadata.name%3Ds1", "list"),
    ("watch=FALSE&limit=x", "list"),
    ("watch=0&labelSelector=%21%21", "list"),
    ("watch=1&limit=x", "watch"),
    ("limit=x", "list"),
]


@pytest.mark.parametrize(("query", "verb"), DECODE_CASES)
def test_a_query_the_apiserver_cannot_decode_reads_watch_as_upstream_does(query: str, verb: str) -> None:
    assert parse("GET", f"/api/v1/namespaces/a/secrets?{query}").verb == verb


def test_a_query_the_apiserver_cannot_decode_narrows_the_list_to_no_name() -> None:
    assert parse("GET", "/api/v1/namespaces/a/secrets?fieldSelector=metadata.name%3Ds1&limit=5").name == "s1"
    assert parse("GET", "/api/v1/namespaces/a/secrets?fieldSelector=metadata.name%3Ds1&limit=abc").name == ""
    assert parse("GET", "/api/v1/namespaces/a/secrets?fieldSelector=metadata.name%3Ds1&labelSelector=%21").name == ""


def test_a_huge_integer_in_limit_or_timeout_seconds_is_a_decoding_error_not_an_exception() -> None:
    """More digits than Python's int() converts (4,300) raised ValueError, a 502 and a traceback per request
    before flow control; ParseInt fails there (a watch for the ToLower reading), unless the digits are
    leading zeros, which ParseInt skips (then the query decodes: a list)."""
    assert parse("GET", "/api/v1/namespaces/a/secrets?watch=fal%C5%BFe&limit=" + "1" * 5000).verb == "watch"
    assert parse("GET", "/api/v1/namespaces/a/secrets?watch=fal%C5%BFe&timeoutSeconds=-" + "9" * 5000).verb == "watch"
    assert parse("GET", "/api/v1/namespaces/a/secrets?watch=fal%C5%BFe&limit=" + "0" * 5000 + "7").verb == "list"


@pytest.mark.parametrize("query", [
    "labelSelector=a%3Db", "watch=1&labelSelector=a%3Db&limit=500", "watch=false&labelSelector=%21%21",
    "labelSelector=app+in+%28a%2Cb%29&fieldSelector=spec.nodeName%3Dn1&timeoutSeconds=30",
])
def test_an_ordinary_list_or_watch_never_parses_its_label_selector(query: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode only decides between readings that differ (a non-ASCII watch value, a metadata.name
    fieldSelector); parsing a hostile 1 MiB label selector took seconds of the worker's thread."""
    def refuse(selector: str) -> bool:
        raise AssertionError(f"label selector parsed: {selector!r}")

    monkeypatch.setattr(requestinfo.labelselector, "valid", refuse)
    assert requestinfo._parse("GET", f"/api/v1/namespaces/a/pods?{query}").verb in ("list", "watch")


# (fieldSelector, the name RequiresExactMatch("metadata.name") gives, '' for none, None where fields.ParseSelector
# fails); validity checked against apimachinery v0.37.2 by the review's differential run
FIELD_SELECTORS = [
    ("metadata.name!=a,metadata.name=b", "b"), ("metadata.name==s1", "s1"), ("x=\\", None), ("a=b\\", None),
    ("metadata.name=a\\,b", "a,b"), ("a!b=c", ""), ("=x", ""), ("metadata.name=b,metadata.name=a", "a"),
    ("a=b,,c=d", ""), (",", ""), ("a", None), ("a=b=c", None), ("a=b\\=c", ""), ("a!==b", None),
    ("metadata.name=\\\\x", "\\x"), ("x=1,metadata.name=s\\=1", "s=1"), ("\\,=1", ""), ("a\\=b=c", None),
    ("a" * 300_000, None), ("a=b," * 100_000 + "metadata.name=x", "x"), ("a=\\," * 100_000, None),
    ("\\" * 300_001, None), ("metadata.name=x," * 50_000, "x"),
]


@pytest.mark.parametrize(("selector", "name"), FIELD_SELECTORS, ids=lambda v: v if isinstance(v, str) and
                         len(v) < 40 else None)
def test_field_selectors_are_read_as_fields_parse_selector_does(selector: str, name: str | None) -> None:
    """Large ones included: finding each term's operator must not slice the rest of the term at every index,
    which would hold the worker's thread for seconds on a 1 MiB term without "="."""
    assert requestinfo._field_selector_name(selector) == name
