"""Pieces both protocol adapters (h2.py, h1.py) share: error answers, header hygiene, handler calls.

A handler that raises gets a 502 with a Kubernetes ``Status``, never a traceback, which client-go prints readably.
"""

from __future__ import annotations

import logging

from gatekeeper.kube import status
from gatekeeper.proxy.messages import HOP_BY_HOP as HOP_BY_HOP  # the adapters' imports; defined with the contract
from gatekeeper.proxy.messages import Handler, Headers, ProxyRequest, ProxyResponse, one_chunk
from gatekeeper.proxy.messages import close_body as close_body

log = logging.getLogger("gatekeeper.proxy")

NO_BODY_STATUSES = frozenset({204, 304})


class ClientGone(ConnectionError):
    """The client reset the stream or closed the connection before the response ended."""


class DeadlinePassed(TimeoutError):
    """The request was not done by its deadline (``pipeline/deadline.py``); the adapter answered 504 or cut it."""


def describe_seconds(seconds: float) -> str:
    """A deadline as Go prints it for whole minutes (``1m0s``, what kube-apiserver's 504 says), else ``2.5s``."""
    if seconds >= 60 and seconds == int(seconds):
        m, s = divmod(int(seconds), 60)
        return f"{m}m{s}s"
    return f"{seconds:g}s"


def timeout_response(seconds: float) -> ProxyResponse:
    """The 504 of a request past its deadline before its head, worded as kube-apiserver's timeout filter."""
    return error_response(504, "Timeout", f"Timeout: request did not complete within {describe_seconds(seconds)} "
                          "(gatekeeper proxy: protocol.requestTimeoutSeconds, or the request's timeout parameter)")


def response_has_body(method: str, status: int) -> bool:
    """HEAD, 1xx, 204 and 304 responses carry no body whatever their headers say (RFC 9110 6.4.1)."""
    return method != "HEAD" and status >= 200 and status not in NO_BODY_STATUSES


def status_json(code: int, reason: str, message: str) -> bytes:
    """A ``metav1.Status`` failure body, the error shape every Kubernetes client understands."""
    return status.failure_json(code, reason, message)


def error_response(code: int, reason: str, message: str, *, retry_after: int | None = None) -> ProxyResponse:
    """A Kubernetes ``Status`` failure; ``retry_after`` sets ``Retry-After`` (client-go retries 429/5xx only when
    it is present) and ``details.retryAfterSeconds``."""
    body = status.failure_json(code, reason, message, retry_after=retry_after)
    headers: Headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    if retry_after is not None:
        headers.append(("retry-after", str(retry_after)))
    return ProxyResponse(status=code, headers=headers, body=one_chunk(body))


async def call_handler(handler: Handler, request: ProxyRequest) -> ProxyResponse:
    """Run the pipeline; any exception becomes a 502 Status (cancellation still propagates)."""
    try:
        return await handler(request)
    except Exception:
        log.exception("handler failed for %s %s", request.method, request.target)
        # The client gets no exception text: it can carry addresses and object reprs.
        return error_response(502, "InternalError", "gatekeeper proxy could not serve the request")


def encode_header(value: str) -> bytes:
    """Header text round-trips through utf-8 with surrogateescape, so odd bytes survive unchanged."""
    return value.encode("utf-8", "surrogateescape")


def decode_header(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")
