"""One line that says why a Kubernetes API call failed, fit for a log line or a user's kubectl output.

kubernetes-asyncio's ``ApiException`` has two faces, both wrong for us: ``reason`` is only the HTTP reason
phrase ("Forbidden"), which hides what the apiserver said ("exceeded quota: gpu-templates, requested: ..."),
and ``str(exc)`` is the status, the reason, every response header and the whole body, over several lines.
The apiserver's ``Status.message`` is remote text: it is kept to one bounded, printable line
(:func:`gatekeeper.kube.status.one_line`) before it reaches a log or an admission response.
"""

from __future__ import annotations

from kubernetes_asyncio.client.exceptions import ApiException

from gatekeeper.kube.status import one_line, status_message

MAX_REASON_CHARS = 60
"""An HTTP reason phrase is a word or two; a longer one is cut."""


def describe(exc: BaseException) -> str:
    """``HTTP 403 Forbidden: <the Status message>`` for an API error, ``TypeName: text`` for anything else."""
    if isinstance(exc, ApiException):
        reason = one_line(str(exc.reason or ""), MAX_REASON_CHARS)
        message = status_message(exc.body)
        return f"HTTP {exc.status} {reason}" + (f": {message}" if message else "")
    return one_line(f"{type(exc).__name__}: {exc}")
