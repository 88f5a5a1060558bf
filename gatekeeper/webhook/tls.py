"""The webhook's serving context: :class:`gatekeeper.serving.tls.ReloadingTLS` over its cert/key pair.

cert-manager (or ``gatekeeper certs issue``) rewrites the pair in place; the
listener's ``sni_callback`` switches every new handshake to the current
context, so reviews keep flowing through a rotation (see gatekeeper/serving/tls.py).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable

from gatekeeper.serving.tls import ReloadingTLS, server_context


def load_server_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """A TLS server context for the pair; raises OSError/ssl.SSLError when they cannot be loaded.

    With ``client_ca_file`` a client certificate is asked for and, if sent, must chain to that CA
    (CERT_OPTIONAL: the kubelet's probes send none; the app refuses reviews without one).
    """
    ctx = server_context(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(cafile=client_ca_file)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


class ReloadingContext(ReloadingTLS[ssl.SSLContext]):
    """The webhook's reloading serving context; ``base`` is what the listener is created with."""

    def __init__(self, cert_file: str, key_file: str, check_interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, client_ca_file: str = "") -> None:
        super().__init__(lambda: load_server_context(cert_file, key_file, client_ca_file),
                         [cert_file, key_file, client_ca_file],
                         what="webhook serving certificate and client CA", check_interval=check_interval, clock=clock)
        self.cert_file, self.key_file = cert_file, key_file
        self.client_ca_file = client_ca_file
        self.base = self.server_base()
