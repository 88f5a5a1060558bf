"""A server SSLContext whose certificate follows the files on disk.

cert-manager (or ``gatekeeper certs issue``) rewrites the serving cert/key in
place; the webhook must pick them up without a restart or dropped reviews.
The listener is created with a *base* context whose ``sni_callback`` runs at
every TLS handshake (OpenSSL calls it with or without SNI). The callback checks
the files' mtimes at most every ``check_interval`` seconds -- two ``stat``
calls, nothing on the hot path otherwise -- and, if they changed, builds a new
context and switches the handshaking connection to it. Connections already
established keep the certificate they negotiated. A half-written pair (cert
updated, key not yet) fails to load; the old context stays in use and the
next check tries again.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def _mtimes(*paths: str) -> tuple[int, ...]:
    return tuple(os.stat(p).st_mtime_ns for p in paths)


def load_server_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """A TLS server context for the pair; raises OSError/ssl.SSLError when they cannot be loaded.

    With ``client_ca_file`` a client certificate is asked for and, if sent, must chain to that CA
    (CERT_OPTIONAL: the kubelet's probes send none; the app refuses reviews without one).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(cafile=client_ca_file)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


class ReloadingContext:
    """Holds the current context and swaps it in for new handshakes when the files change."""

    def __init__(self, cert_file: str, key_file: str, check_interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, client_ca_file: str = "") -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self.client_ca_file = client_ca_file
        self.check_interval = check_interval
        self._clock = clock
        self._stamp = _mtimes(cert_file, key_file)
        self.current = load_server_context(cert_file, key_file, client_ca_file)
        self.base = load_server_context(cert_file, key_file, client_ca_file)
        self.base.sni_callback = self._on_handshake
        self._next_check = clock() + check_interval
        self.reloads = 0

    def maybe_reload(self) -> bool:
        """Reload if the files changed since the last successful load; True if reloaded."""
        try:
            stamp = _mtimes(self.cert_file, self.key_file)
        except OSError:
            return False
        if stamp == self._stamp:
            return False
        try:
            ctx = load_server_context(self.cert_file, self.key_file, self.client_ca_file)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("serving certificate changed but cannot be loaded yet (%s); keeping the old one",
                        exc)
            return False
        self.current, self._stamp = ctx, stamp
        self.reloads += 1
        log.info("reloaded serving certificate from %s", self.cert_file)
        return True

    def _on_handshake(self, sslobj: ssl.SSLObject | ssl.SSLSocket, server_name: str | None,
                      ctx: ssl.SSLContext) -> None:
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self.check_interval
            self.maybe_reload()
        sslobj.context = self.current
