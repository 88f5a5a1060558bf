"""The webhook's serving context: :class:`gatekeeper.tls.ReloadingTLS` over its cert/key pair.

cert-manager (or ``gatekeeper certs issue``) rewrites the pair in place; the
listener's ``sni_callback`` switches every new handshake to the current
context, so reviews keep flowing through a rotation (see gatekeeper/tls.py).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable

from gatekeeper.tls import ReloadingTLS, server_context


def load_server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A TLS server context for the pair; raises OSError/ssl.SSLError when they cannot be loaded."""
    return server_context(cert_file, key_file)


class ReloadingContext(ReloadingTLS):
    """The webhook's reloading serving context; ``base`` is what the listener is created with."""

    def __init__(self, cert_file: str, key_file: str, check_interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(lambda: server_context(cert_file, key_file), [cert_file, key_file],
                         what="webhook serving certificate", check_interval=check_interval, clock=clock)
        self.cert_file, self.key_file = cert_file, key_file
        self.base = self.server_base()
