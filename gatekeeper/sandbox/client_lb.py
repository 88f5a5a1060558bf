"""``sandbox up --client-lb haproxy-tcp``: an L4 load balancer in front of the proxies, as a VIP or cloud LB is.

HAProxy in TCP mode (TLS passes through, so client certificates reach the proxies), ``leastconn`` across the
proxies, a TCP health check every second: a killed proxy leaves the rotation and its clients reconnect to the
others. The benchmarks' HAProxy arm (in front of the apiservers) uses the same configuration.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

from gatekeeper.base.errors import UsageError

CONFIG = """global
    maxconn 8192
defaults
    mode tcp
    timeout connect 5s
    timeout client 900s
    timeout server 900s
    retries 3
    option redispatch
frontend fe
    bind 127.0.0.1:{port}
    default_backend targets
backend targets
    balance {balance}
{servers}
"""


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if not found:
        raise UsageError("haproxy not found (needed for --client-lb haproxy-tcp): apt-get install -y haproxy")
    return found


def haproxy_config(port: int, targets: Sequence[str], balance: str = "leastconn") -> str:
    """HAProxy's configuration: listen on 127.0.0.1:``port``, balance TCP connections over ``targets``
    (``https://host:port`` URLs)."""
    servers = "\n".join(f"    server t{i} {url.removeprefix('https://')} check inter 1s"
                        for i, url in enumerate(targets, 1))
    return CONFIG.format(port=port, balance=balance, servers=servers)
