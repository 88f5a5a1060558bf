"""`gatekeeper webhook`: CLI entry point (owned by the webhook component)."""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import replace

from gatekeeper.base.config import load_config
from gatekeeper.base.errors import UsageError
from gatekeeper.runtime.multiproc import multiprocess_mode
from gatekeeper.webhook.settings import WebhookSettings  # also registers the webhook: config section

NAME = "webhook"
HELP = "run the admission webhook (oversized Secrets, GPU pod rewrite)"
DESCRIPTION = (
    "Serve AdmissionReview v1 over TLS: POST /validate rejects oversized Secrets (and ConfigMaps), "
    "POST /mutate rewrites nvidia.com/gpu pods to DRA claims or shared GPUs; "
    "GET /healthz, /readyz, /metrics."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's options and handler (``set_defaults(func=...)``); the CLI makes the parser."""
    p.add_argument("--config", required=True, help="YAML config file with a webhook: section")
    p.add_argument("--workers", type=int, default=None,
                   help="processes sharing the port via SO_REUSEPORT (default: webhook.server.workers)")
    p.add_argument("--port", type=int, default=None, help="override webhook.server.port (0 = any free port)")
    p.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    p.add_argument("--check", action="store_true",
                   help="validate the config, load the serving certificate, key and client CA, print a summary "
                        "and exit without listening (0: the webhook would start on it; 2: the error, on stderr)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, need="webhook")
    settings: WebhookSettings = cfg.webhook
    srv = settings.server
    if args.port is not None:
        srv = replace(srv, port=args.port)
    if args.port_file is not None:
        srv = replace(srv, port_file=args.port_file)
    try:
        srv.validate()
    except ValueError as exc:
        raise UsageError(f"{args.config}: webhook.server: {exc}") from None
    workers = args.workers if args.workers is not None else srv.workers
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    settings = replace(settings, server=srv)
    with multiprocess_mode() if workers > 1 and not args.check else contextlib.nullcontext():
        # Here, not at the top: the server pulls in aiohttp, uvloop and kubernetes-asyncio (~0.7 s), which every
        # other subcommand and `gatekeeper --help` would otherwise pay; and prometheus_client, whose import fixes
        # the metrics mode that the `with` has just set.
        from gatekeeper.webhook.server import StartupError, preflight, run

        try:
            preflight(settings)
            if args.check:
                print(_summary(settings, workers))
                return 0
            return run(settings, workers)
        except StartupError as exc:
            raise UsageError(f"{args.config}: {exc}") from None


def _summary(settings: WebhookSettings, workers: int) -> str:
    """What an operator checks before a rollout: the limits and modes this config puts in force."""
    sec, gpu = settings.secrets, settings.gpu
    secrets = (f"secrets: hardLimit {sec.hard_limit}, softLimit {sec.soft_limit}, {len(sec.overrides)} override(s)"
               f"{', ConfigMaps too' if sec.config_maps else ''}" if sec.enabled else "secrets: off")
    pods = (f"gpu: defaultMode {gpu.default_mode}, {len(gpu.namespace_modes)} namespace mode(s), "
            f"{len(gpu.enforced_namespaces)} enforced namespace(s)" if gpu.enabled else "gpu: off")
    port = settings.server.port or "0 (any free port)"
    return "\n".join([f"would listen on port {port} with {workers} worker(s)", secrets, pods])
