"""The one request/response shape both protocol adapters speak; everything after them sees only these types.

Bodies are async iterators pulled by the consumer: that is the backpressure contract, so a slow client slows the backend
read instead of growing a buffer. A body may also have ``aclose()`` (its producer holds an upstream connection until
closed or drained) and ``exhausted`` (True right after it returned its last chunk); :func:`close_body` and
:func:`is_exhausted` are the only places that look for them, by attribute: ``isinstance`` on a protocol is slow, and
these run per response chunk."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from gatekeeper.kube.requestinfo import RequestInfo

log = logging.getLogger(__name__)

Headers = list[tuple[str, str]]
"""Header list with lower-case names, order and duplicates preserved."""

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "http2-settings",
})
"""Fields that stay on their hop (RFC 9110 7.6.1; HTTP/2 forbids them outright, RFC 9113 8.2.2): one set for the
upstream paths both ways and the adapters' answers, so what a hop is cannot drift apart between them."""


def is_exhausted(body: object) -> bool:
    """True once a body with ``exhausted`` has returned its last chunk (always False for others)."""
    return getattr(body, "exhausted", None) is True


async def close_body(body: object) -> None:
    """Close a body iterator we stopped pulling, so its producer releases the upstream connection."""
    aclose = getattr(body, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # a producer failing at close must not mask the real outcome
            log.debug("closing a body failed", exc_info=True)


async def empty_body() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover - makes this an async generator


class OneChunk:
    """A body that is ``data`` in one piece (a Status, a /metrics page). It knows its last chunk (``exhausted``), so
    the adapters end the response with that chunk: an HTTP/2 answer leaves in one write (HEADERS, DATA with
    END_STREAM), not a second one for an empty END_STREAM frame (tests/proxy/test_h2_wakeups.py)."""

    __slots__ = ("_data", "exhausted")

    def __init__(self, data: bytes) -> None:
        self._data = data
        self.exhausted = False

    def __aiter__(self) -> OneChunk:
        return self

    async def __anext__(self) -> bytes:
        if self.exhausted:
            raise StopAsyncIteration
        self.exhausted = True
        return self._data


def one_chunk(data: bytes) -> AsyncIterator[bytes]:
    """A body that is ``data`` in one piece (:class:`OneChunk`)."""
    return OneChunk(data)


@dataclass
class UserInfo:
    """Who the client is, as far as the proxy can tell before the apiserver does."""

    name: str
    groups: list[str] = field(default_factory=list)
    extra: dict[str, list[str]] = field(default_factory=dict)
    source: Literal["x509", "token", "anonymous"] = "anonymous"
    """x509: verified client cert (proxy stamps X-Remote-*); token: bearer passed through untouched."""


class CallerFacts(Protocol):
    """Who flow control classifies a request as: a verified token's identity, or a certificate caller as the
    apiserver sees it (``identity/tokens``, ``identity/auth``)."""

    @property
    def name(self) -> str: ...

    @property
    def groups(self) -> list[str]: ...


@dataclass
class ProxyRequest:
    """A client request, already parsed by a protocol adapter."""

    method: str
    target: str
    """Raw request target: path plus optional ``?query``, exactly as the client sent it."""
    headers: Headers
    body: AsyncIterator[bytes] | None
    """None when the request has no body (h2 END_STREAM on HEADERS, h1 no length)."""
    protocol: Literal["h2", "http/1.1"]
    peer: str = ""
    peer_cert: dict[str, Any] | None = None
    """``ssl.SSLObject.getpeercert()`` of a verified client certificate, if any."""
    connection_id: int = 0
    stream_id: int = 0
    user: UserInfo | None = None
    """Filled by the identity stage."""
    info: RequestInfo | None = None
    """Filled by the RequestInfo stage."""
    caller: str = ""
    """Who the request counts against (token identity, unverified token's per-address flow, or whom an
    impersonator acts for); long-running requests are capped per caller. Empty: the user's name."""
    flow_schema: str = ""
    priority_level: str = ""
    """Flow control's decision: the FlowSchema and the priority level the request was classified into."""
    reserved_backend: str = ""
    """The apiserver flow control reserved for an expensive LIST (``expensiveLists``): sent there, nowhere else."""
    connection_memo: dict[str, Any] | None = None
    """One dict per client connection, shared by its requests (``auth.identify``'s memo). None: no memo."""
    token_verified: bool = False
    """The front stage verified the bearer token's signature and claims (the apiserver will authenticate it)."""
    identity: CallerFacts | None = None
    """A token caller's identity as the front stage resolved it; None for certificate and anonymous callers."""
    deadline_seconds: float = 0.0
    """How long the request may run (``pipeline/deadline.py``); 0: no deadline (long-running)."""
    timed_out: bool = False
    """The deadline passed: the adapter answers 504, or cuts a response already under way."""

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None


@dataclass
class Upgraded:
    """A backend connection that switched protocols (WebSocket, SPDY): the h1 adapter splices bytes both ways,
    then awaits ``on_close`` so in-flight accounting ends."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    on_close: Callable[[], Awaitable[None]] | None = None


@dataclass
class ProxyResponse:
    """A response to stream back; the adapter drives ``body`` to the end or until the client goes away."""

    status: int
    headers: Headers
    body: AsyncIterator[bytes] = field(default_factory=empty_body)
    upgraded: Upgraded | None = None
    """Set on a 101 to an HTTP/1.1 upgrade request; body is then unused."""
    on_complete: list[Callable[[BaseException | None], None]] = field(default_factory=list)
    """Called once when the response ends: None on success, else the error (client reset, backend died)."""

    def finish(self, error: BaseException | None = None) -> None:
        callbacks, self.on_complete = self.on_complete, []
        for cb in callbacks:
            cb(error)


Handler = Callable[[ProxyRequest], Awaitable[ProxyResponse]]
"""One stage of the pipeline; a middleware is ``(request, next_handler) -> response``."""


class Middleware(Protocol):
    """A pipeline stage around the rest: ``await mw(request, next_handler)``."""

    def __call__(self, request: ProxyRequest, next_handler: Handler, /) -> Awaitable[ProxyResponse]: ...
