"""Who is calling, and how that identity reaches the apiserver (pure), per kube-apiserver's ``--requestheader-*``.

Only a verified certificate becomes stamped ``X-Remote-*`` headers; tokens (including a WebSocket's
``Sec-WebSocket-Protocol`` token) pass untouched, and the rest is anonymous. Client-sent ``X-Remote-*`` are always
removed (else anyone could claim ``system:masters``), ``Connection``-named headers are dropped before stamping (so they
cannot remove what we assert), and unclean certificate names are refused, never cleaned into another name. See
docs/proxy/index.md (Identity)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from gatekeeper.proxy.messages import Headers, UserInfo

REMOTE_PREFIX = "x-remote-"
USER_HEADER = "x-remote-user"
GROUP_HEADER = "x-remote-group"
EXTRA_PREFIX = "x-remote-extra-"
ANONYMOUS_USER = "system:anonymous"
ANONYMOUS_GROUP = "system:unauthenticated"
AUTHENTICATED_GROUP = "system:authenticated"

# RFC 7230 tchar minus '%', which must be escaped so unescaping is unambiguous.
_KEY_SAFE = frozenset(b"!#$&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _subject_attrs(peer_cert: Mapping[str, Any], attr: str) -> list[str]:
    """Values of ``attr`` in a ``getpeercert()`` subject, in certificate order."""
    return [value for rdn in peer_cert.get("subject", ()) for key, value in rdn if key == attr]


def _bad_name(value: str) -> str:
    """Why a certificate name cannot be an identity, or ''. ``isprintable`` is False for every control, format
    (zero-width space) and non-ASCII space character."""
    if value != value.strip():
        return "leading or trailing whitespace"
    if not value.isprintable():
        ch = next(c for c in value if not c.isprintable())
        return f"the non-printable character U+{ord(ch):04X}"
    return ""


def bad_certificate_names(peer_cert: Mapping[str, Any] | None, memo: dict[str, Any] | None = None) -> str:
    """A message if the verified certificate's CN or any O is not a clean name, else '' (once per connection)."""
    if not peer_cert:
        return ""
    if memo is not None:
        verdict = memo.get("cert_names")
        if verdict is None:
            verdict = memo["cert_names"] = bad_certificate_names(peer_cert)
        return str(verdict)
    for attr, label in (("commonName", "CN"), ("organizationName", "O")):
        for value in _subject_attrs(peer_cert, attr):
            why = _bad_name(value)
            if why:
                return f"client certificate {label} {value!r} contains {why}; refusing it rather than guessing"
    return ""


# Connection tokens that mean something to the connection itself, not a header to drop.
_CONNECTION_OPTIONS = frozenset({"close", "keep-alive"})


def drop_connection_named(headers: Headers) -> Headers:
    """Remove the headers the client's ``Connection`` names (RFC 9110 7.6.1), keeping an upgrade.

    ``Connection`` itself is reduced to ``upgrade`` or removed, so no later hop-by-hop pass can remove a header the
    proxy adds after this point."""
    tokens = {t.strip().lower() for k, v in headers if k.lower() == "connection"
              for t in v.split(",") if t.strip()}
    if not tokens:
        return headers
    upgrade = "upgrade" in tokens and any(k.lower() == "upgrade" for k, _ in headers)
    named = tokens - _CONNECTION_OPTIONS - {"upgrade"}
    out = [(k, v) for k, v in headers if k.lower() != "connection" and k.lower() not in named]
    if upgrade:
        out.append(("connection", "upgrade"))
    return out


WEBSOCKET_BEARER_PREFIX = "base64url.bearer.authorization.k8s.io."
_RAW_URL_B64 = re.compile(r"[A-Za-z0-9_-]*")


def websocket_token(headers: Headers) -> str | None:
    """The bearer token kube-apiserver's WebSocket protocol authenticator would read, or None.

    Same rules as ``request/websocket/protocol.go``: two token entries, bad base64, a non-UTF-8 token or no other
    subprotocol is an error (no token; the apiserver refuses the request)."""
    upgrade = next((v for k, v in headers if k == "upgrade"), None)
    if upgrade is None or upgrade.strip(" \t").lower() != "websocket":
        return None
    if "upgrade" not in {t.strip(" \t").lower() for k, v in headers if k == "connection" for t in v.split(",")}:
        return None
    token: str | None = None
    others = 0
    for k, v in headers:
        if k != "sec-websocket-protocol":
            continue
        for entry in v.split(","):
            entry = entry.strip(" \t")
            if not entry.startswith(WEBSOCKET_BEARER_PREFIX):
                others += 1
                continue
            encoded = entry[len(WEBSOCKET_BEARER_PREFIX):]
            if token is not None or not _RAW_URL_B64.fullmatch(encoded) or len(encoded) % 4 == 1:
                return None
            try:
                token = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return None
    if not token or not others:
        return None
    return token


def token_user(credential: str) -> str:
    """A stable, non-reversible name for a credential the proxy cannot read."""
    return "token:" + hashlib.sha256(credential.encode()).hexdigest()[:16]


def _certificate_user(peer_cert: Mapping[str, Any]) -> UserInfo | None:
    cns = _subject_attrs(peer_cert, "commonName")
    if cns and cns[-1]:
        return UserInfo(name=cns[-1], groups=_subject_attrs(peer_cert, "organizationName"), source="x509")
    return None


def identify(peer_cert: Mapping[str, Any] | None, headers: Headers, memo: dict[str, Any] | None = None) -> UserInfo:
    """UserInfo from a verified client certificate, else the Authorization header, else anonymous.

    Certificate first, as kube-apiserver's chain does. ``peer_cert`` must be one the TLS layer verified, else it is a
    free identity. ``memo`` is the connection's, so a repeated token is not hashed again; no process-wide cache holds a
    credential. Every call returns a fresh UserInfo."""
    if peer_cert:
        if memo is None:
            cert_user = _certificate_user(peer_cert)
        elif "cert_user" in memo:
            cert_user = memo["cert_user"]
        else:
            cert_user = memo["cert_user"] = _certificate_user(peer_cert)
        if cert_user is not None:
            return UserInfo(name=cert_user.name, groups=list(cert_user.groups), source="x509")
    for name, value in headers:
        if name == "authorization" and value.strip():
            credential = value.strip()
            last = memo.get("token") if memo is not None else None
            if last is not None and last[0] == credential:
                return UserInfo(name=last[1], source="token")
            user = token_user(credential)
            if memo is not None:
                memo["token"] = (credential, user)
            return UserInfo(name=user, source="token")
    ws = websocket_token(headers)
    if ws is not None:
        return UserInfo(name=token_user("Bearer " + ws), source="token")
    return UserInfo(name=ANONYMOUS_USER, groups=[ANONYMOUS_GROUP], source="anonymous")


def as_apiserver_sees(user: UserInfo, memo: dict[str, Any] | None = None) -> UserInfo:
    """A certificate caller as kube-apiserver's APF and authorizer see it once the proxy stamped it.

    The apiserver adds ``system:authenticated`` (AuthenticatedGroupAdder); without it here a FlowSchema naming that
    group matched upstream but not in the proxy. Stamped headers stay the certificate's own."""
    if user.source != "x509" or user.name == ANONYMOUS_USER or AUTHENTICATED_GROUP in user.groups \
            or ANONYMOUS_GROUP in user.groups:
        return user
    if memo is not None:
        seen = memo.get("apiserver_view")
        # A view kept for one user must never be handed to another (the groups pick the FlowSchema).
        if seen is not None and seen.name == user.name and seen.groups[:-1] == user.groups:
            return seen
    view = UserInfo(name=user.name, groups=[*user.groups, AUTHENTICATED_GROUP], extra=user.extra, source="x509")
    if memo is not None:
        memo["apiserver_view"] = view
    return view


def bearer_credential(headers: Headers) -> str:
    """What a token caller's identity is classified from: the first ``Authorization`` value, or for a
    WebSocket request without one, its ``Sec-WebSocket-Protocol`` token as ``Bearer <token>``."""
    for name, value in headers:
        if name == "authorization":
            return value
    ws = websocket_token(headers)
    return f"Bearer {ws}" if ws is not None else ""


def escape_extra_key(key: str) -> str:
    """Percent-encode an extra key so it is a valid header-name suffix (%XX for anything not a tchar)."""
    return "".join(chr(b) if b in _KEY_SAFE else f"%{b:02X}" for b in key.encode())


def _clean_value(value: str) -> str:
    """Header values cannot carry CR/LF/NUL; drop them rather than let them split a header."""
    return "".join(c for c in value if c not in "\r\n\0")


def strip_remote(headers: Iterable[tuple[str, str]]) -> Headers:
    """Every header except client-sent ``X-Remote-*`` (names are compared case-insensitively)."""
    return [(k, v) for k, v in headers if not k.lower().startswith(REMOTE_PREFIX)]


def identity_headers(user: UserInfo) -> Headers:
    """The requestheader headers that assert ``user`` to the apiserver (x509 identities only)."""
    if user.source != "x509":
        return []
    out: Headers = [(USER_HEADER, _clean_value(user.name))]
    out += [(GROUP_HEADER, _clean_value(g)) for g in user.groups]
    for key, values in user.extra.items():
        out += [(EXTRA_PREFIX + escape_extra_key(key.lower()), _clean_value(v)) for v in values]
    return out


def wants_front_proxy_cert(user: UserInfo) -> bool:
    """Present the front-proxy certificate only when asserting an identity.

    kube-apiserver tries x509 on any client certificate; ours is not signed by the client CA, and with anonymous auth
    that error is a final 401. So token and anonymous requests go with no certificate."""
    return user.source == "x509"
