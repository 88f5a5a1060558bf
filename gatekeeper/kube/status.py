"""The Kubernetes ``Status`` failure body (``metav1.Status``), built in one place.

kubectl and client-go print ``message`` from this shape, and client-go reads
``details.retryAfterSeconds`` next to the ``Retry-After`` header. Every error
the proxy answers itself (a 400 for a malformed request, a 502/503 when no
apiserver can serve, flow control's 429) is one of these, so clients show a
readable error instead of an unparsable body.
"""

from __future__ import annotations

from typing import Literal, TypedDict

import orjson


class StatusDetails(TypedDict, total=False):
    retryAfterSeconds: int


class _StatusRequired(TypedDict):
    kind: Literal["Status"]
    apiVersion: Literal["v1"]
    metadata: dict[str, str]
    status: Literal["Failure"]
    message: str
    reason: str
    code: int


class Status(_StatusRequired, total=False):
    details: StatusDetails


def failure(code: int, reason: str, message: str, *, retry_after: int | None = None) -> Status:
    """A failure Status; ``retry_after`` adds ``details.retryAfterSeconds`` as the apiserver does."""
    status: Status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": reason, "code": code}
    if retry_after is not None:
        status["details"] = {"retryAfterSeconds": retry_after}
    return status


def failure_json(code: int, reason: str, message: str, *, retry_after: int | None = None) -> bytes:
    """:func:`failure` serialized, ready to be a response body."""
    return orjson.dumps(failure(code, reason, message, retry_after=retry_after))


MAX_REMOTE_MESSAGE_CHARS = 300
"""How much of an apiserver's ``Status.message`` gatekeeper repeats (a quota or RBAC refusal is 150-250 chars)."""
MAX_STATUS_BODY_BYTES = 64 * 1024
"""Larger error bodies are not parsed for a message: a Status is a few hundred bytes; a larger body is some
other server's page (a proxy in between), not worth the CPU of parsing it."""


def one_line(text: str, limit: int = MAX_REMOTE_MESSAGE_CHARS) -> str:
    """Remote text made fit for a log line or a message shown to a user: whitespace runs (newlines included)
    become one space, other non-printable characters (controls, terminal escapes, bidi and zero-width marks)
    become ``\\uXXXX``, and the result is cut at ``limit`` characters, marked with ``...``.

    A line break in a log message forges the next log line; an ESC sequence repaints the terminal of whoever
    tails the log or reads the kubectl error; a megabyte message fills both."""
    head = text[: 4 * limit]  # enough for ``limit`` characters once whitespace runs are collapsed
    out: list[str] = []
    size = 0
    for word in head.split():
        piece = "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in word[: limit + 1])
        out.append(piece)
        size += len(piece) + 1
        if size > limit:
            break
    joined = " ".join(out)
    if len(joined) > limit or (len(head) < len(text) and text[len(head):].strip()):
        return joined[: limit - 3] + "..."
    return joined


def status_message(body: bytes | str | None, limit: int = MAX_REMOTE_MESSAGE_CHARS) -> str:
    """The ``message`` of a ``Status`` error body, made one bounded line (:func:`one_line`); "" when the body is
    no Status with a message (empty, not JSON, too large, another server's error page)."""
    if not body or len(body) > MAX_STATUS_BODY_BYTES:
        return ""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    message = doc.get("message") if isinstance(doc, dict) else None
    return one_line(message, limit) if isinstance(message, str) else ""
