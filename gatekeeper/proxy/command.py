"""`gatekeeper proxy --config FILE`: the command line of the front proxy.

It parses and checks the configuration, then runs one process (``proxy/process.py``) or a supervisor
and its workers (``proxy/workers.py``). It stays light: the CLI imports it in every process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gatekeeper.base.config import load_config
from gatekeeper.base.errors import UsageError
from gatekeeper.proxy.settings import ProxySettings  # also registers the proxy: config section
from gatekeeper.runtime.multiproc import multiprocess_mode

NAME = "proxy"
HELP = "run the API-aware front proxy in front of several kube-apiservers"
DESCRIPTION = (
    "Serve h2 and HTTP/1.1 over TLS, balance every request across the configured apiservers "
    "(least in-flight, power of two choices), assert client-certificate identities with the "
    "front-proxy certificate, apply flow control, and send graceful GOAWAYs. /metrics, /healthz "
    "and /readyz are served on listener.metricsPort (plain HTTP)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's options and handler (``set_defaults(func=...)``); the CLI makes the parser."""
    p.add_argument("--config", required=True, type=Path, help="YAML config file with a proxy: section")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes sharing the port (default proxy.workers; 0 = one per usable core)")
    p.add_argument("--check", action="store_true",
                   help="validate the config, its certificate and key files and its flow-control policy, print a "
                        "summary and exit (0: the proxy would start on it; 2: the problems, on stderr)")
    for hidden in ("--worker-index", "--worker-port", "--handoff-fd"):  # set by the supervisor (proxy/workers.py)
        p.add_argument(hidden, type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--runtime-dir", type=Path, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_run)


def _check_files(settings: ProxySettings) -> None:
    files = {
        "proxy.listener.certFile": settings.listener.cert_file,
        "proxy.listener.keyFile": settings.listener.key_file,
        "proxy.listener.clientCaFile": settings.listener.client_ca_file,
        "proxy.upstream.caFile": settings.upstream.ca_file,
        "proxy.upstream.clientCertFile": settings.upstream.client_cert_file,
        "proxy.upstream.clientKeyFile": settings.upstream.client_key_file,
    }
    for key, path in files.items():
        if path and not Path(path).is_file():
            raise UsageError(f"{key}: {path} does not exist or is not a file")
    publish = settings.flow_control.fleet.publish_endpoints
    if publish.enabled:
        try:
            publish.resolve(settings.listener.port)
        except ValueError as exc:
            raise UsageError(f"proxy.flowControl.{exc}") from None
    if settings.listener.client_ca_file and not settings.upstream.client_cert_file:
        raise UsageError(
            "proxy.listener.clientCaFile is set (client certificates are accepted) but "
            "proxy.upstream.clientCertFile is not: the proxy needs a front-proxy client certificate "
            "to tell the apiservers who a certificate user is"
        )


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def worker_count(settings: ProxySettings, flag: int | None) -> int:
    """``--workers`` wins; else ``proxy.workers``; 0 means one per usable core, capped by ``maxWorkers``."""
    n = flag if flag is not None else settings.workers
    return n if n > 0 else min(usable_cores(), settings.max_workers)


# The proxy's modules are imported inside _run, once the metrics mode is known: prometheus_client picks single-
# or multiprocess values on first import, and the CLI imports this module in every process.

def _run(args: argparse.Namespace) -> int:
    settings: ProxySettings = load_config(args.config, need="proxy").proxy
    if args.check:
        return _run_check(settings)
    _check_files(settings)
    if args.worker_index is not None and args.runtime_dir is not None and args.worker_port is not None:
        if args.handoff_fd is None:
            raise UsageError("--worker-index needs --handoff-fd: workers take their connections from the parent")
        from gatekeeper.proxy import process  # a worker inherits PROMETHEUS_MULTIPROC_DIR from its parent

        process.run_worker(settings, args.worker_index, args.runtime_dir, args.worker_port, args.handoff_fd)
        return 0
    if args.workers is not None and args.workers < 0:
        raise UsageError("--workers: must be >= 0 (0 = one per usable core)")
    n = worker_count(settings, args.workers)
    if n > 1:
        with multiprocess_mode("gatekeeper-proxy-metrics-"):
            from gatekeeper.proxy import workers  # after the mode is set (see above)

            return workers.supervise(settings, args.config, n)
    from gatekeeper.proxy import process  # one process: prometheus_client in its single-process mode

    process.run_single(settings)
    return 0


def _run_check(settings: ProxySettings) -> int:
    from gatekeeper.proxy.check import check  # loads the listener and the clients: see above

    summary, problems = check(settings, _check_files)
    print("\n".join(summary))
    for problem in problems:
        print(f"gatekeeper proxy --check: error: {problem}", file=sys.stderr)
    return 2 if problems else 0


