"""What can go wrong upstream, sorted by whether bytes may have reached the backend. Only :class:`ConnectFailed` lets
the caller try another backend; the others decide the client's status and whether the backend is blamed (ejection)."""

from __future__ import annotations

import ssl


class ConnectFailed(ConnectionError):
    """No byte of the request reached the backend; ``str()`` is a short cause safe to show a client."""


class PoolTimeout(ConnectionError):
    """No pooled connection to the backend freed up in time: nothing was sent, the backend is not at fault."""


class UpstreamTimeout(ConnectionError):
    """The backend sent no response headers within the response-header timeout."""


class ClientBodyFailed(ConnectionError):
    """The client's request body failed while being forwarded: the backend is not blamed."""


class NoFrontProxyCert(RuntimeError):
    """A verified client-certificate user arrived but no front-proxy certificate is configured."""


class BackendFailed(ConnectionError):
    """The backend failed after the request may have reached it: never retried."""


class RequestResetByBackend(BackendFailed):
    """The backend reset this request's HTTP/2 stream before answering it; never retried.

    Go's server resets requests it finds malformed, so any client could cause one: counted as a 5xx answer (the storm
    detector), never an immediate ejection."""


AFTER_CONNECT = (PoolTimeout, UpstreamTimeout, ClientBodyFailed, NoFrontProxyCert, BackendFailed)
"""The failures of an exchange the dispatcher answers with a Status of its own (``stages.Dispatcher._failed``)."""


def connect_cause(exc: BaseException) -> str:
    """A short, client-safe cause of a failed connect (never an exception repr: no addresses, no objects)."""
    if isinstance(exc, TimeoutError):
        return "connect timed out"
    if isinstance(exc, ssl.SSLError):
        return "TLS handshake failed"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    return "connect failed"
