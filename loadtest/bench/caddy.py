"""Caddy v2 in front of the sandbox's apiservers, configured as its users configure a Go L7 reverse proxy.

The proxy benchmark's reference for CPU per request and latency (issue 42): a mainstream Go proxy on the same
cores, TLS on both sides, HTTP/2 both ways, least-connections balancing per request. ``GOMAXPROCS`` is the
number of gatekeeper workers it is compared with, as HAProxy gets ``nbthread``. The binary is built from the
``gomod/caddy`` consumer module and cached like the sandbox's (:func:`gatekeeper.sandbox.build.caddy_binary`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gatekeeper.certs.pki import PKI
from gatekeeper.sandbox import processes
from gatekeeper.sandbox.build import BuildError, caddy_binary


@dataclass(frozen=True)
class CaddyFiles:
    """What one Caddy instance reads: its serving pair, the CA it trusts both ways, the front-proxy pair."""

    cert: Path
    """Serving certificate for 127.0.0.1."""
    key: Path
    """Its key."""
    ca: Path
    """The sandbox CA: it signed the apiservers' serving certificates and the clients' certificates."""
    client_cert: Path
    """The front-proxy client certificate Caddy presents to the apiservers (as HAProxy and gatekeeper do)."""
    client_key: Path
    """Its key."""


def caddyfile(port: int, backends: Sequence[str], files: CaddyFiles, data_dir: Path) -> str:
    """The Caddyfile: one HTTPS site on ``port`` whose only handler is ``reverse_proxy`` to ``backends``.

    No admin endpoint (several instances run at once, and it would be one more listener), no automatic HTTPS
    (the certificates are given), client certificates verified when sent (HAProxy's ``verify optional``;
    Caddy then refuses a Host that differs from the SNI unless told not to, and clients that dial an IP send
    no SNI), and the ``X-Remote-*`` headers a client sends stripped, as the other two proxies strip them: with the
    front-proxy certificate the apiserver would believe them."""
    upstreams = " ".join(backends)
    return f"""{{
\tadmin off
\tauto_https off
\tpersist_config off
\tstorage file_system {data_dir}
\tservers {{
\t\tprotocols h1 h2
\t\tstrict_sni_host insecure_off
\t}}
}}

https://127.0.0.1:{port} {{
\ttls {files.cert} {files.key} {{
\t\tclient_auth {{
\t\t\tmode verify_if_given
\t\t\ttrust_pool file {files.ca}
\t\t}}
\t}}
\treverse_proxy {upstreams} {{
\t\tlb_policy least_conn
\t\theader_up -X-Remote-*
\t\ttransport http {{
\t\t\ttls
\t\t\ttls_trust_pool file {files.ca}
\t\t\ttls_client_auth {files.client_cert} {files.client_key}
\t\t\tversions 2 1.1
\t\t}}
\t}}
}}
"""


def start_caddy(certs: Path, work: Path, backends: Sequence[str], procs: int, name: str,
                started: list[subprocess.Popen[bytes]]) -> tuple[str, int]:
    """Start Caddy with ``GOMAXPROCS=procs`` in front of ``backends``; returns (URL, pid) once it answers TLS.

    The process is appended to ``started`` before it is waited for, so the caller stops it even when it never
    came up."""
    try:
        binary = caddy_binary(say=lambda line: print(line, file=sys.stderr, flush=True))
    except BuildError as exc:
        raise SystemExit(f"caddy: {exc}") from None
    serving = PKI(certs).issue_serving(f"bench-{name}", dns=["localhost"], ips=["127.0.0.1"])
    files = CaddyFiles(serving.cert, serving.key, certs / "ca.crt", certs / "front-proxy-client.crt",
                       certs / "front-proxy-client.key")
    port = processes.free_port()
    home = work / name
    home.mkdir(parents=True, exist_ok=True)
    config = home / "Caddyfile"
    config.write_text(caddyfile(port, backends, files, home / "data"))
    env = {**os.environ, "GOMAXPROCS": str(procs), "HOME": str(home), "XDG_DATA_HOME": str(home / "data"),
           "XDG_CONFIG_HOME": str(home / "config")}
    log = (home / "caddy.log").open("ab")
    proc = subprocess.Popen([str(binary), "run", "--config", str(config), "--adapter", "caddyfile"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started.append(proc)
    deadline = time.monotonic() + 30
    while not processes.listening(port)[0]:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"caddy {name} did not start: {(home / 'caddy.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return f"https://127.0.0.1:{port}", proc.pid
