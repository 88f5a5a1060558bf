"""Identity from client certificates and tokens, and X-Remote-* hygiene."""

from __future__ import annotations

from urllib.parse import unquote

from gatekeeper.proxy.identity.auth import (
    escape_extra_key,
    identify,
    identity_headers,
    strip_remote,
    token_user,
    wants_front_proxy_cert,
)
from gatekeeper.proxy.messages import UserInfo

ADMIN_CERT = {
    "subject": (
        (("organizationName", "system:masters"),),
        (("organizationName", "team-a"),),
        (("commonName", "alice"),),
    ),
    "issuer": ((("commonName", "gatekeeper-cluster-ca"),),),
}


def test_verified_certificate_gives_cn_user_and_o_groups() -> None:
    user = identify(ADMIN_CERT, [])
    assert (user.name, user.groups, user.source) == ("alice", ["system:masters", "team-a"], "x509")


def test_certificate_wins_over_bearer_token_like_apiserver_chain() -> None:
    user = identify(ADMIN_CERT, [("authorization", "Bearer abc")])
    assert user.source == "x509" and user.name == "alice"


def test_bearer_token_identity_is_a_hash_not_the_token() -> None:
    user = identify(None, [("authorization", "Bearer s3cret")])
    assert user.source == "token"
    assert user.name == token_user("Bearer s3cret")
    assert "s3cret" not in user.name
    assert identify(None, [("authorization", "Bearer other")]).name != user.name


def test_no_credentials_is_anonymous() -> None:
    user = identify(None, [("accept", "application/json")])
    assert (user.name, user.groups) == ("system:anonymous", ["system:unauthenticated"])
    assert user.source == "anonymous"


def test_certificate_without_cn_is_not_an_identity() -> None:
    assert identify({"subject": ((("organizationName", "x"),),)}, []).source == "anonymous"


def test_client_sent_x_remote_headers_are_stripped_case_insensitively() -> None:
    headers = [
        ("X-Remote-User", "admin"),
        ("x-remote-group", "system:masters"),
        ("X-REMOTE-EXTRA-scopes", "all"),
        ("x-remote-anything", "x"),
        ("impersonate-user", "bob"),
        ("impersonate-group", "g"),
        ("authorization", "Bearer t"),
        ("x-remotely", "kept"),
    ]
    assert strip_remote(headers) == [
        ("impersonate-user", "bob"),
        ("impersonate-group", "g"),
        ("authorization", "Bearer t"),
        ("x-remotely", "kept"),
    ]


def test_token_request_gets_no_identity_headers_even_if_spoofed() -> None:
    headers = [("authorization", "Bearer t"), ("x-remote-user", "admin"),
               ("x-remote-group", "system:masters")]
    user = identify(None, headers)
    out = strip_remote(headers) + identity_headers(user)
    assert out == [("authorization", "Bearer t")]
    assert not wants_front_proxy_cert(user)


def test_certificate_identity_is_stamped_replacing_spoofed_headers() -> None:
    headers = [("x-remote-user", "admin"), ("x-remote-group", "system:masters"), ("accept", "*/*")]
    user = UserInfo(name="bob", groups=["dev", "ops"], extra={"Scopes": ["a", "b"], "acme.com/team": ["x"]},
                    source="x509")
    out = strip_remote(headers) + identity_headers(user)
    assert out == [
        ("accept", "*/*"),
        ("x-remote-user", "bob"),
        ("x-remote-group", "dev"),
        ("x-remote-group", "ops"),
        ("x-remote-extra-scopes", "a"),
        ("x-remote-extra-scopes", "b"),
        ("x-remote-extra-acme.com%2Fteam", "x"),
    ]
    assert wants_front_proxy_cert(user)


def test_extra_key_escaping_round_trips_through_unescape() -> None:
    for key in ("plain", "acme.com/team", "100%", "with space", "ünï", "a:b=c"):
        escaped = escape_extra_key(key)
        assert all(c.isalnum() or c in "!#$&'*+-.^_`|~%" for c in escaped), escaped
        assert unquote(escaped) == key


def test_stamped_values_cannot_inject_headers() -> None:
    user = UserInfo(name="bob\r\nx-remote-group: system:masters", source="x509")
    (name, value), = identity_headers(user)
    assert name == "x-remote-user" and "\n" not in value and "\r" not in value


def test_connection_memo_gives_the_same_identities_as_fresh_reads() -> None:
    memo: dict = {}
    token_headers = [("authorization", "Bearer one")]
    for _ in range(2):
        assert identify(None, token_headers, memo) == identify(None, token_headers)
    # Another credential on the same connection is named for itself, not as the last one.
    assert identify(None, [("authorization", "Bearer two")], memo) == identify(None, [("authorization", "Bearer two")])
    assert identify(None, token_headers, memo).name == token_user("Bearer one")
    assert identify(None, [], memo).source == "anonymous"
    cert_memo: dict = {}
    first = identify(ADMIN_CERT, [], cert_memo)
    first.groups.append("mutated-by-a-later-stage")
    second = identify(ADMIN_CERT, [("authorization", "Bearer x")], cert_memo)
    assert second == identify(ADMIN_CERT, []) and second is not first  # fresh object every call
    assert "mutated-by-a-later-stage" not in second.groups


def test_a_refused_certificate_name_is_refused_on_every_request_of_the_connection() -> None:
    from gatekeeper.proxy.identity.auth import bad_certificate_names

    bad_cert = {"subject": ((("commonName", "system:mas\nters"),),)}
    memo: dict = {}
    for _ in range(3):
        assert "non-printable" in bad_certificate_names(bad_cert, memo)
    good_memo: dict = {}
    assert bad_certificate_names(ADMIN_CERT, good_memo) == bad_certificate_names(ADMIN_CERT, good_memo) == ""


def _ws(*protocols: str, upgrade: str = "websocket", connection: str = "Upgrade") -> list[tuple[str, str]]:
    return [("connection", connection), ("upgrade", upgrade), *(("sec-websocket-protocol", p) for p in protocols)]


def _b64(token: str) -> str:
    import base64

    return base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")


def test_a_websocket_request_is_a_token_caller_when_the_apiserver_would_read_its_protocol_token() -> None:
    """kube-apiserver authenticates a WebSocket request by ``base64url.bearer.authorization.k8s.io.<token>``
    (v1.37.2 answers a LIST sent that way as the token's ServiceAccount): it is not anonymous."""
    from gatekeeper.proxy.identity.auth import bearer_credential, websocket_token

    good = _ws(f"base64url.bearer.authorization.k8s.io.{_b64('tok.en-1')}, v4.channel.k8s.io")
    assert websocket_token(good) == "tok.en-1"
    assert bearer_credential(good) == "Bearer tok.en-1"
    user = identify(None, good)
    assert user.source == "token" and user.name == token_user("Bearer tok.en-1")
    # split over two header lines, any case of Upgrade, Connection listing more tokens
    assert websocket_token(_ws(f"base64url.bearer.authorization.k8s.io.{_b64('t')}", "v4.channel.k8s.io",
                               upgrade="WebSocket", connection="keep-alive, Upgrade")) == "t"
    # an Authorization header is read first (upstream's bearer authenticator comes first)
    assert bearer_credential([("authorization", "Bearer a"), *good]) == "Bearer a"


def test_protocol_tokens_the_apiserver_refuses_are_not_tokens() -> None:
    from gatekeeper.proxy.identity.auth import websocket_token

    tok = f"base64url.bearer.authorization.k8s.io.{_b64('tok')}"
    assert websocket_token(_ws(tok)) is None  # no other subprotocol: "missing additional subprotocol"
    assert websocket_token(_ws(tok, tok, "v4.channel.k8s.io")) is None  # two tokens
    assert websocket_token(_ws(tok + "=", "v4.channel.k8s.io")) is None  # padded: not RawURLEncoding
    assert websocket_token(_ws("base64url.bearer.authorization.k8s.io.a+b/", "v4.channel.k8s.io")) is None
    assert websocket_token(_ws("base64url.bearer.authorization.k8s.io._w", "v4.channel.k8s.io")) is None  # not UTF-8
    assert websocket_token(_ws(tok, "v4.channel.k8s.io", upgrade="h2c")) is None  # not a WebSocket request
    assert websocket_token(_ws(tok, "v4.channel.k8s.io", connection="keep-alive")) is None
    assert websocket_token([("sec-websocket-protocol", f"{tok}, v4.channel.k8s.io")]) is None
    assert identify(None, _ws(tok)).source == "anonymous"
