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
