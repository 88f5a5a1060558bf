"""TLS contexts that follow their files on disk (base layer: used by the webhook and the proxy).

cert-manager, kubeadm's renewal or ``gatekeeper certs issue`` rewrite
certificates, keys and CA bundles in place; a server must pick them up
without a restart and without cutting a connection.

:class:`ReloadingTLS` holds the context built from a set of files and
rebuilds it when any file's mtime changes, checking at most every
``check_interval`` seconds (a few ``stat`` calls; nothing on the hot path
otherwise):

* a *server* uses :meth:`ReloadingTLS.server_base` as the listener's context:
  its ``sni_callback`` runs at every handshake (OpenSSL calls it with or
  without SNI) and switches the handshaking connection to the current
  context, so the certificate *and* the trust store for client certificates
  are the new ones;
* a *client* calls :meth:`ReloadingTLS.get` per connection it opens (the
  proxy's upstream pool keys connections by context, so pooled connections
  made with the old material live on until they close by themselves). A
  client that needs several contexts from the same files builds them all in
  one ``build`` (``ReloadingTLS[T]`` holds any ``T``): the proxy's upstream
  keeps an HTTP/1.1 and an HTTP/2 context per kind of caller and hands
  connections from one pool to the other, so both must come from one read.

Connections already established keep what they negotiated. A half-written
rotation (cert updated, key not yet) fails to load; the old context stays in
use and the next check tries again.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Clock = Callable[[], float]
T = TypeVar("T")


def _mtimes(paths: Sequence[str]) -> tuple[int, ...]:
    return tuple(os.stat(p).st_mtime_ns for p in paths)


def server_context(cert_file: str, key_file: str, *, alpn: Sequence[str] = ("http/1.1",)) -> ssl.SSLContext:
    """A TLS >= 1.2 server context for the pair; raises OSError/ssl.SSLError when they cannot be loaded."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(list(alpn))
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


class ReloadingTLS(Generic[T]):
    """The current context (or contexts) built from ``files``; rebuilt by ``build`` when one of them changes."""

    def __init__(self, build: Callable[[], T], files: Sequence[str], *, what: str,
                 check_interval: float = 2.0, clock: Clock = time.monotonic) -> None:
        self.build = build
        self.files = [f for f in files if f]
        self.what = what
        self.check_interval = check_interval
        self._clock = clock
        self._stamp = _mtimes(self.files)
        self.current = build()
        self._next_check = clock() + check_interval
        self.reloads = 0

    def maybe_reload(self) -> bool:
        """Rebuild if the files changed since the last successful load; True if rebuilt."""
        try:
            stamp = _mtimes(self.files)
        except OSError:
            return False
        if stamp == self._stamp:
            return False
        try:
            ctx = self.build()
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("%s changed but cannot be loaded yet (%s); keeping the old one", self.what, exc)
            return False
        self.current, self._stamp = ctx, stamp
        self.reloads += 1
        log.info("reloaded %s from %s", self.what, ", ".join(self.files))
        return True

    def get(self) -> T:
        """The current context, after a change check if the last one is ``check_interval`` old."""
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self.check_interval
            self.maybe_reload()
        return self.current

    def server_base(self: ReloadingTLS[ssl.SSLContext]) -> ssl.SSLContext:
        """A listener context that hands every new handshake the current context."""
        base = self.build()
        base.sni_callback = self._on_handshake
        return base

    def _on_handshake(self: ReloadingTLS[ssl.SSLContext], sslobj: ssl.SSLObject | ssl.SSLSocket,
                      server_name: str | None, ctx: ssl.SSLContext) -> None:
        sslobj.context = self.get()
