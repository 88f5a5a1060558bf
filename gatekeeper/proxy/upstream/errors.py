"""What can go wrong upstream, sorted by whether bytes may have reached the backend.

Only :class:`ConnectFailed` lets the caller try another backend; the others
decide the client's status and whether the backend is blamed (ejection).
"""

from __future__ import annotations

import ssl


class ConnectFailed(ConnectionError):
    """No byte of the request reached the backend (TCP/TLS connect failed or timed out).

    ``str()`` is a short cause safe to show a client (``connection refused``,
    ``TLS handshake failed``...); the exception chain keeps the details for the log.
    """


class PoolTimeout(ConnectionError):
    """No pooled connection to the backend freed up in time: nothing was sent, the backend is not at fault."""


class UpstreamTimeout(ConnectionError):
    """The backend sent no response headers within the response-header timeout."""


class ClientBodyFailed(ConnectionError):
    """The client's request body failed while it was being forwarded (client gone, body idle).

    The backend did nothing wrong: no ejection, no 5xx count against it.
    """


class NoFrontProxyCert(RuntimeError):
    """A verified client-certificate user arrived but no front-proxy certificate is configured."""


class BackendFailed(ConnectionError):
    """The backend failed after the request may have reached it: never retried."""


class RequestResetByBackend(BackendFailed):
    """The backend reset this request's HTTP/2 stream before answering it; never retried.

    Not a sign the backend is down: its connection and other streams carry on, and Go's server
    resets a request it finds malformed (a bad ``:path`` escape, a control byte in a header), so any
    client could cause one. The dispatcher answers 502 and counts it as a 5xx answer (the storm
    detector, which needs most of a backend's answers to be bad) instead of ejecting the backend
    at once as it does for a connect failure or a dead connection.
    """


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
