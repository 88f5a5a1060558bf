"""Differential fuzzing of the proxy's classification against kube-apiserver's own APF (test helpers).

The proxy stamps its FlowSchema pick on every answer it classified (``x-gatekeeper-pf-flowschema``); the
apiserver stamps its own (``X-Kubernetes-PF-FlowSchema-UID``). With the same APF objects on both sides the
two must agree for every request, or a tenant can make the proxy classify one thing while the apiserver
executes another. This module holds the parts that need no sandbox:

* :func:`world_policy`: FlowSchemas that split on verb, resource, subresource, API group, namespace vs
  cluster scope, non-resource URLs, and User / Group / ServiceAccount subjects;
* :func:`generate`: seeded request variants (methods, path spellings, queries, headers, HTTP/1.1 and h2);
* :class:`H1Lane` / :class:`H2Lane`: clients that send method and target byte for byte;
* :func:`judge`: what one answer says (agreement, a disagreement, or which side answered without a pick).

Which answers carry no apiserver pick, from ``DefaultBuildHandlerChain`` (outermost filter first:
RequestInfo, ..., RequestDeadline, ..., Authentication, Audit, Impersonation, PriorityAndFairness,
Authorization, handler): a RequestInfo error (``/api/v1/watch`` with nothing after it: 500), a bad
``timeout`` parameter (400 from the deadline filter), a failed authentication (401), an impersonation the
caller may not do (403 from the impersonation filter); and requests APF lets through untracked, the
long-running ones that are not watches (the ``proxy`` verb; ``attach``, ``exec``, ``log``, ``portforward``,
``proxy`` subresources; ``/debug/pprof/`` paths). Everything else is classified before authorization, so
even the 403 a tenant without RBAC rights gets carries the apiserver's pick.
"""

from __future__ import annotations

import http.client
import random
import socket
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events

from gatekeeper.kube import requestinfo

V1 = "flowcontrol.apiserver.k8s.io/v1"


# --- the policy ----------------------------------------------------------------------------------


def _rr(verbs: list[str], resources: list[str], *, groups: list[str] | None = None,
        namespaces: list[str] | None = None, cluster: bool = True) -> dict[str, Any]:
    rule: dict[str, Any] = {"verbs": verbs, "apiGroups": groups if groups is not None else ["*"],
                            "resources": resources, "clusterScope": cluster}
    rule["namespaces"] = namespaces if namespaces is not None else ["*"]
    return rule


def world_policy(ns: str, group: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(objects to apply to the cluster, the FlowSchema names they define).

    Precedences sit between the cluster's system schemas (<= 900) and ``service-accounts`` (9000) /
    ``global-default`` (9900), so what none of them matches falls to the cluster's own defaults, which
    the fuzz checks too.
    """
    tenants = {"kind": "Group", "group": {"name": group}}
    schemas: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [
        ("user-bob", 1000, {"kind": "User", "user": {"name": f"{ns}-bob"}},
         {"resourceRules": [_rr(["*"], ["pods"], groups=[""])]}),
        ("sa-builder", 1010, {"kind": "ServiceAccount", "serviceAccount": {"namespace": ns, "name": "builder"}},
         {"resourceRules": [_rr(["*"], ["secrets"], groups=[""])]}),
        ("sa-group", 1020, {"kind": "Group", "group": {"name": f"system:serviceaccounts:{ns}"}},
         {"resourceRules": [_rr(["*"], ["configmaps"])]}),
        ("secrets-list", 2000, tenants, {"resourceRules": [_rr(["list"], ["secrets"], groups=[""])]}),
        ("secrets-watch", 2010, tenants, {"resourceRules": [_rr(["watch"], ["secrets"], groups=[""])]}),
        ("secrets-get", 2020, tenants, {"resourceRules": [_rr(["get"], ["secrets"], groups=[""])]}),
        ("secrets-write", 2030, tenants, {"resourceRules": [
            _rr(["create", "update", "patch", "delete", "deletecollection"], ["secrets"], groups=[""])]}),
        ("secrets-any", 2040, tenants, {"resourceRules": [_rr(["*"], ["secrets"])]}),
        ("cm-namespaced", 2100, tenants, {"resourceRules": [
            _rr(["get", "list", "watch"], ["configmaps"], cluster=False)]}),
        ("cm-cluster", 2110, tenants, {"resourceRules": [_rr(["*"], ["configmaps"], namespaces=[])]}),
        ("pods-log", 2200, tenants, {"resourceRules": [_rr(["*"], ["pods/log"])]}),
        ("pods-tunnel", 2210, tenants, {"resourceRules": [
            _rr(["*"], ["pods/exec", "pods/attach", "pods/portforward"])]}),
        ("status", 2220, tenants, {"resourceRules": [
            _rr(["*"], ["pods/status", "deployments/status", "namespaces/status", "namespaces/finalize"])]}),
        ("pods", 2230, tenants, {"resourceRules": [_rr(["*"], ["pods"])]}),
        ("proxy-verb", 2240, tenants, {"resourceRules": [_rr(["proxy"], ["*"])]}),
        ("apps-own-ns", 2300, tenants, {"resourceRules": [
            _rr(["*"], ["*"], groups=["apps"], namespaces=[ns], cluster=False)]}),
        ("apps", 2310, tenants, {"resourceRules": [_rr(["*"], ["*"], groups=["apps"])]}),
        ("namespaces", 2320, tenants, {"resourceRules": [_rr(["*"], ["namespaces"], groups=[""])]}),
        ("nonres-get", 2400, tenants, {"nonResourceRules": [
            {"verbs": ["get"], "nonResourceURLs": ["/version", "/healthz/*", "/apis/*", "/api"]}]}),
        ("nonres-any", 2410, tenants, {"nonResourceRules": [
            {"verbs": ["*"], "nonResourceURLs": ["/openapi/*", "/api/*", "/.well-known/*", "/metrics"]}]}),
        ("authenticated-events", 2500, {"kind": "Group", "group": {"name": "system:authenticated"}},
         {"resourceRules": [_rr(["*"], ["events"])]}),
    ]
    objects: list[dict[str, Any]] = [
        {"apiVersion": V1, "kind": "PriorityLevelConfiguration", "metadata": {"name": ns},
         "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": 40, "limitResponse": {
             "type": "Queue", "queuing": {"queues": 16, "handSize": 4, "queueLengthLimit": 100}}}}},
    ]
    names = []
    for short, precedence, subject, rules in schemas:
        name = f"{ns}-{short}"
        names.append(name)
        objects.append({"apiVersion": V1, "kind": "FlowSchema", "metadata": {"name": name},
                        "spec": {"matchingPrecedence": precedence, "priorityLevelConfiguration": {"name": ns},
                                 "distinguisherMethod": {"type": "ByUser"},
                                 "rules": [{"subjects": [subject], **rules}]}})
    return objects, names


# --- the requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One request as sent: who, over which protocol, the method and target byte for byte, extra headers."""

    who: str
    proto: str
    method: str
    target: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def show(self) -> str:
        extra = "".join(f" [{k}: {v[:40]}]" for k, v in self.headers)
        return f"{self.who}/{self.proto} {self.method} {self.target}{extra}"


METHODS = ["GET"] * 12 + ["HEAD", "POST", "POST", "PUT", "PATCH", "DELETE", "DELETE", "OPTIONS",
                          "get", "Get", "head", "post", "delete", "patch", "WATCH", "watch", "PROXY", "LIST", "FOO"]
RESOURCES = [("", "v1", "secrets"), ("", "v1", "secrets"), ("", "v1", "configmaps"), ("", "v1", "configmaps"),
             ("", "v1", "configmaps"), ("", "v1", "pods"),
             ("", "v1", "pods"), ("", "v1", "events"), ("", "v1", "services"), ("", "v1", "nodes"),
             ("apps", "v1", "deployments"), ("apps", "v1", "deployments"), ("batch", "v1", "jobs"),
             ("nosuch.example.com", "v1", "widgets"), ("events.k8s.io", "v1", "events"), ("", "v1", "namespaces"),
             ("", "v2", "secrets"), ("apps", "v1beta9", "deployments")]
SUBRESOURCES = ["", "", "", "", "", "status", "log", "exec", "attach", "portforward", "proxy", "scale", "binding",
                "eviction", "finalize", "token"]
NON_RESOURCE = ["/healthz", "/healthz/etcd", "/livez", "/readyz", "/version", "/version/", "/api", "/api/",
                "/apis", "/apis/apps", "/apis/apps/v1", "/api/v1", "/api/v1/", "/openapi/v3", "/metrics",
                "/.well-known/openid-configuration", "/debug/pprof/", "/logs", "/", "/apis/nosuch.example.com",
                "/apis/apps/", "/healthz/", "/api/v1/watch", "/api/v1/proxy", "/apis/apps/v1/watch"]
QUERIES = ["", "", "", "", "watch", "watch=", "watch=true", "watch=1", "watch=0", "watch=false", "watch=FALSE",
           "watch=TRUE", "watch=fal%C5%BFe", "watch=1;", "watch=1%zz", "watch=0&watch=1", "watch=1&watch=0",
           "w%61tch=1", "WATCH=1", "watch=1;&timeoutSeconds=1", "labelSelector=a%3Db", "labelSelector=a%3D%3D%3D",
           "fieldSelector=metadata.name%3Ds1", "fieldSelector=metadata.name%3D%3Ds1",
           "fieldSelector=metadata.name%21%3Ds1", "fieldSelector=bogus", "limit=5", "limit=abc", "limit=",
           "resourceVersion=0", "resourceVersionMatch=NotOlderThan&resourceVersion=0", "timeoutSeconds=1",
           "timeoutSeconds=x", "timeout=1s", "timeout=bogus", "follow=true", "follow=fal%C5%BFe", "%zz",
           ";", "allowWatchBookmarks=true", "sendInitialEvents=true&watch=1", "dryRun=All", "pretty=1",
           # options the apiserver cannot decode, beside a watch value only EqualFold reads as false
           "watch=fal%C5%BFe&limit=x", "labelSelector=%21%21&watch=fal%C5%BFe", "watch=fal%C5%BFe&timeoutSeconds=",
           "fieldSelector=a%3D%3D%3D&watch=fal%C5%BFe", "fieldSelector=metadata.name%3Ds1&limit=abc"]
HEADERS: list[tuple[tuple[str, str], ...]] = [
    (), (), (), (), (),
    (("impersonate-user", "system:admin"),),
    (("impersonate-group", "system:masters"), ("impersonate-user", "someone")),
    (("x-remote-user", "admin"), ("x-remote-group", "system:masters")),
    (("content-type", "application/json"),),
    (("content-type", "application/apply-patch+yaml"),),
    (("accept", "application/json;as=Table;v=v1;g=meta.k8s.io"),),
    (("accept", "application/vnd.kubernetes.protobuf"),),
]
IDENTITIES = ("alice", "bob", "carol", "builder", "ci", "anon")
"""alice, bob: certificates in the tenants' group (bob also has a User schema); carol: a certificate with no
groups at all; builder, ci: ServiceAccount tokens (builder has its own schema, ci only its namespace's); anon:
neither (some of its requests carry the builder's token in a WebSocket subprotocol instead)."""
TOKEN_OF_BUILDER = "Bearer @builder"
"""Stands for the builder ServiceAccount's real token (the lanes put it in when they send)."""
WEBSOCKET_OF_BUILDER = "base64url.bearer.authorization.k8s.io.@builder, v5.channel.k8s.io"
"""The builder's token as a WebSocket subprotocol (unpadded base64url, put in when sent)."""
WEBSOCKET_HEADERS = [(("connection", "Upgrade"), ("upgrade", "websocket"), ("sec-websocket-version", "13"),
                      ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
                      ("sec-websocket-protocol", WEBSOCKET_OF_BUILDER)),
                     (("sec-websocket-protocol", WEBSOCKET_OF_BUILDER),)]
"""A WebSocket request carrying the token (the apiserver reads it there), and the same subprotocol on a plain
request (read by nobody)."""
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "post", "patch"})


def _pct(ch: str, rng: random.Random) -> str:
    code = f"{ord(ch):02X}"
    return "%" + (code if rng.random() < 0.5 else code.lower())


def _mutate_path(path: str, rng: random.Random) -> str:
    """One spelling change of a path (several may be stacked)."""
    kind = rng.randrange(17)
    slashes = [i for i, c in enumerate(path) if c == "/"]
    letters = [i for i, c in enumerate(path) if c.isalpha()]
    if kind == 0 and len(slashes) > 2:  # an encoded slash inside the path
        i = rng.choice(slashes[2:])
        return path[:i] + _pct("/", rng) + path[i + 1:]
    if kind == 1 and letters:  # an encoded letter
        i = rng.choice(letters)
        return path[:i] + _pct(path[i], rng) + path[i + 1:]
    if kind == 2 and slashes:  # an empty segment
        i = rng.choice(slashes)
        return path[:i] + "/" + path[i:]
    if kind == 3:
        return path.rstrip("/") + "/"
    if kind == 4 and slashes:  # a dot segment
        i = rng.choice(slashes)
        return path[:i] + rng.choice(["/.", "/..", "/%2e", "/%2E%2e", "/.%2E/x"]) + path[i:]
    if kind == 5:  # a ';' parameter on some segment
        i = rng.choice([*slashes[1:], len(path)]) if len(slashes) > 1 else len(path)
        return path[:i] + rng.choice([";", ";x", ";watch=1"]) + path[i:]
    if kind == 6 and "s" in path:  # U+017F long s for an s, in UTF-8
        i = rng.choice([j for j, c in enumerate(path) if c == "s"])
        return path[:i] + "%C5%BF" + path[i + 1:]
    if kind == 7 and slashes:  # fullwidth solidus, overlong '/', an encoded NUL, a raw non-ASCII letter
        i = rng.choice(slashes)
        return path[:i] + rng.choice(["%EF%BC%8F", "%C0%AF", "%00", "\u017f", "%FF"]) + path[i:]
    if kind == 8:
        return path + rng.choice(["%zz", "%", "%4"])
    if kind == 9 and letters:  # upper-case a segment
        seg = rng.choice([s for s in path.split("/") if s] or [""])
        return path.replace(seg, seg.upper(), 1) if seg else path
    if kind == 10:
        return "/" + path
    if kind == 11:
        return path + "#frag"
    if kind == 12:
        return rng.choice(["https://127.0.0.1", "http://x", "//evil"]) + path
    if kind == 13 and letters:
        i = rng.choice(letters)
        return path[:i] + rng.choice(["+", "%20", "%2B"]) + path[i:]
    if kind == 14:
        return path.replace("/namespaces/", "/namespaces//", 1)
    return path


def _resource_path(rng: random.Random, ns: str) -> str:
    group, version, resource = rng.choice(RESOURCES)
    base = f"/api/{version}" if not group else f"/apis/{group}/{version}"
    special = rng.random()
    if special < 0.08:
        base += "/watch"
    elif special < 0.12:
        base += "/proxy"
    scope = rng.random()
    if resource in ("nodes", "namespaces") or scope < 0.25:
        where = ""
    elif scope < 0.75:
        where = f"/namespaces/{ns}"
    elif scope < 0.9:
        where = "/namespaces/default"
    else:
        where = "/namespaces/kube-system"
    path = f"{base}{where}/{resource}"
    if resource == "namespaces" and rng.random() < 0.6:
        path = f"{base}/namespaces/{ns}" + rng.choice(["", "/status", "/finalize", "/pods", "/secrets/s1"])
    if rng.random() < 0.45:
        path += "/" + rng.choice(["s1", "x", "pod-0", "a.b", "n%3Ax"])
        sub = rng.choice(SUBRESOURCES)
        if sub:
            path += "/" + sub
            if rng.random() < 0.2:
                path += "/more/parts"
    return path


PLACEHOLDER_NS = "fc-df-nsnsns"
"""The namespace the variants are made with, then replaced by the run's: the mutations pick characters of the
path, so variants made with the run's random namespace differed from run to run (only ~550 of 4,000 alike), and a
failure could not be replayed from the seed. A mutation that percent-encoded part of it leaves that case on the
placeholder's (absent) namespace, which both sides classify alike all the same."""


def generate(seed: int, count: int, ns: str) -> list[Case]:
    """``count`` request variants, the same for the same seed whatever the run's namespace."""
    rng = random.Random(seed)
    cases: list[Case] = []
    for _ in range(count):
        path = rng.choice(NON_RESOURCE) if rng.random() < 0.15 else _resource_path(rng, PLACEHOLDER_NS)
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
            path = _mutate_path(path, rng)
        query = "&".join(rng.choice(QUERIES) for _ in range(rng.choice([1, 1, 1, 2, 3])))
        query = query.strip("&")
        target = f"{path}?{query}" if query or rng.random() < 0.03 else path
        method = rng.choice(METHODS)
        headers = rng.choice(HEADERS)
        if rng.random() < 0.06:  # a token beside a certificate: the certificate decides on both sides
            headers += (("authorization", rng.choice(["Bearer bogus", TOKEN_OF_BUILDER])),)
        who = rng.choice(IDENTITIES)
        proto = "h2" if rng.random() < 0.35 else "h1"
        if who == "anon" and proto == "h1" and rng.random() < 0.3:
            headers += rng.choice(WEBSOCKET_HEADERS)
        cases.append(Case(who, proto, method, target.replace(PLACEHOLDER_NS, ns), headers,
                          b"{}" if method in BODY_METHODS else b""))
    return cases


# --- the transports ------------------------------------------------------------------------------


@dataclass
class Answer:
    """Status (0: the stream or connection was cut without an answer) and lower-cased headers."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class _RawConnection(http.client.HTTPSConnection):
    """http.client with the request line sent as given (no ASCII-only or character checks): the fuzz
    must be able to send what a hostile client sends."""

    def _validate_path(self, url: str) -> None:
        pass

    def _validate_method(self, method: str) -> None:
        pass

    def _encode_request(self, request: str) -> bytes:
        return request.encode("utf-8")


class H1Lane:
    """One persistent HTTP/1.1 connection, re-opened after the server closes it."""

    def __init__(self, host: str, port: int, ctx: ssl.SSLContext, auth: str = "") -> None:
        self.host, self.port, self.ctx, self.auth = host, port, ctx, auth
        self.conn: _RawConnection | None = None

    def send(self, case: Case) -> Answer:
        if self.conn is None:
            self.conn = _RawConnection(self.host, self.port, context=self.ctx, timeout=30)
        conn = self.conn
        try:
            conn.putrequest(case.method, case.target, skip_accept_encoding=True)
            for k, v in case.headers:
                conn.putheader(k, v)
            if self.auth and not any(k == "authorization" for k, _ in case.headers):
                conn.putheader("authorization", self.auth)
            if case.body:
                conn.putheader("content-length", str(len(case.body)))
            conn.endheaders(case.body or None)
            r = conn.getresponse()
            body = r.read()
            answer = Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, body)
            if r.will_close:
                self.close()
            return answer
        except (OSError, http.client.HTTPException):
            self.close()
            return Answer(0)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class H2Lane:
    """One HTTP/2 connection (h2 state machine over a TLS socket), one stream at a time, pseudo-headers
    sent unvalidated and unnormalised; re-opened after the server ends it."""

    def __init__(self, host: str, port: int, ctx: ssl.SSLContext, auth: str = "") -> None:
        self.host, self.port, self.ctx, self.auth = host, port, ctx, auth
        self.sock: ssl.SSLSocket | None = None
        self.conn: h2.connection.H2Connection | None = None

    def _open(self) -> tuple[ssl.SSLSocket, h2.connection.H2Connection]:
        if self.sock is None or self.conn is None:
            sock = self.ctx.wrap_socket(socket.create_connection((self.host, self.port), timeout=30),
                                        server_hostname=self.host)
            assert sock.selected_alpn_protocol() == "h2", sock.selected_alpn_protocol()
            conn = h2.connection.H2Connection(h2.config.H2Configuration(
                client_side=True, header_encoding="utf-8", validate_outbound_headers=False,
                normalize_outbound_headers=False, validate_inbound_headers=False))
            conn.initiate_connection()
            sock.sendall(conn.data_to_send())
            self.sock, self.conn = sock, conn
        return self.sock, self.conn

    def send(self, case: Case) -> Answer:
        try:
            sock, conn = self._open()
            sid = conn.get_next_available_stream_id()
            headers = [(":method", case.method), (":scheme", "https"), (":authority", self.host),
                       (":path", case.target), *case.headers]
            if self.auth and not any(k == "authorization" for k, _ in case.headers):
                headers.append(("authorization", self.auth))
            conn.send_headers(sid, headers, end_stream=not case.body)
            if case.body:
                conn.send_data(sid, case.body, end_stream=True)
            sock.sendall(conn.data_to_send())
            answer = Answer(0)
            body = bytearray()
            while True:
                data = sock.recv(65536)
                if not data:
                    self.close()
                    return answer
                for ev in conn.receive_data(data):
                    if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                        hdrs = {_s(k).lower(): _s(v) for k, v in ev.headers}
                        answer = Answer(int(hdrs.pop(":status")), hdrs)
                    elif isinstance(ev, h2.events.DataReceived):
                        conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                        if ev.stream_id == sid:
                            body += ev.data
                    elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                        sock.sendall(conn.data_to_send())
                        answer.body = bytes(body)
                        return answer
                    elif isinstance(ev, h2.events.StreamReset) and ev.stream_id == sid:
                        sock.sendall(conn.data_to_send())
                        return Answer(0)
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        self.close()
                        return answer if answer.status and ev.last_stream_id >= sid else Answer(0)
                sock.sendall(conn.data_to_send())
        except (OSError, h2.exceptions.H2Error):
            self.close()
            return Answer(0)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = self.conn = None


def _s(v: bytes | str) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


# --- judging one answer --------------------------------------------------------------------------


UNTRACKED_SUBRESOURCES = frozenset({"attach", "exec", "log", "portforward", "proxy"})


def untracked_by_apiserver_apf(method: str, target: str) -> bool:
    """Whether kube-apiserver's APF filter lets this request through without a pick: long-running
    (``BasicLongRunningRequestCheck`` with kube-apiserver's verb and subresource sets) and not a watch."""
    info = requestinfo.parse(method, target)
    if info.verb == "watch":
        return False
    if info.verb == "proxy":
        return True
    if info.is_resource_request:
        return info.subresource in UNTRACKED_SUBRESOURCES
    return info.path.startswith("/debug/pprof/")


def _special_verb_alone(target: str) -> bool:
    """``/api/v1/watch``, ``/apis/<group>/<version>/proxy`` and the like, with nothing after the special verb:
    kube-apiserver's RequestInfo cannot read them ("unable to determine kind and namespace") and answers 500."""
    parts = unquote(target.partition("?")[0]).strip("/").split("/")
    at = {"api": 2, "apis": 3}.get(parts[0])
    return at is not None and len(parts) == at + 1 and parts[at] in ("watch", "proxy")


def judge(case: Case, answer: Answer, uid_names: dict[str, str]) -> tuple[str, str]:
    """(outcome, detail); ``uid_names`` maps FlowSchema and PriorityLevelConfiguration UIDs to names.
    Outcomes: ``agree`` (same FlowSchema and priority level); ``DISAGREE``; ``proxy-refused`` (the proxy answered or cut
    the request itself, before classifying it); ``apiserver-before-apf`` (authentication, impersonation,
    RequestInfo or deadline refusals: no apiserver pick); ``untracked`` (long-running non-watch: APF passes
    it unclassified); ``NO-STAMP`` (no apiserver pick and none of those reasons: a disagreement about what
    the request is); ``proxy-throttled`` (the proxy's own 429)."""
    h = answer.headers
    ours = h.get("x-gatekeeper-pf-flowschema", "")
    uid = h.get("x-kubernetes-pf-flowschema-uid", "")
    from_apiserver = "audit-id" in h
    if not ours:
        return "proxy-refused", f"{answer.status}"
    if answer.status == 429 and not from_apiserver:
        return "proxy-throttled", ours
    if uid:
        theirs = uid_names.get(uid, f"uid:{uid}")
        if theirs != ours:
            return "DISAGREE", f"proxy {ours}, apiserver {theirs}"
        level = h.get("x-gatekeeper-pf-prioritylevel", "")
        their_level = uid_names.get(h.get("x-kubernetes-pf-prioritylevel-uid", ""), "")
        if level != their_level:
            return "DISAGREE", f"{ours}: proxy level {level}, apiserver level {their_level or 'none'}"
        return "agree", ours
    text = answer.body[:400].decode("utf-8", "replace")
    if answer.status == 401:
        return "apiserver-before-apf", "401 authentication"
    if answer.status == 403 and ("impersonate" in text or (
            case.method == "HEAD" and any(k.startswith("impersonate-") for k, _ in case.headers))):
        return "apiserver-before-apf", "403 impersonation"
    if answer.status == 500 and ("RequestInfo" in text or (case.method == "HEAD" and _special_verb_alone(case.target))):
        # (a HEAD answer has no body to say so: its path is what RequestInfo could not read)
        return "apiserver-before-apf", "500 RequestInfo error"
    if answer.status == 400 and ("timeout" in text or (
            case.method == "HEAD" and "timeout" in requestinfo.query_values(case.target.partition("?")[2]))):
        # (a HEAD answer has no body to say so: its query's ``timeout`` is what the deadline filter refused)
        return "apiserver-before-apf", "400 request deadline"
    if answer.status == 0:
        return "apiserver-before-apf", "no answer (stream reset by the apiserver)"
    if untracked_by_apiserver_apf(case.method, case.target):
        return "untracked", ours
    return "NO-STAMP", f"proxy {ours}, apiserver answered {answer.status} without a pick: {text[:160]}"
