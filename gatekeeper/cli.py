"""`gatekeeper` command line.

Each subcommand's arguments and entry point live with the component that owns
them (``gatekeeper.<component>.command``: ``NAME``, ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)``
and the handler set via ``set_defaults(func=...)``), so this module only wires them up
and turns expected failures into one readable line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from gatekeeper import __version__
from gatekeeper.base.config import ConfigError
from gatekeeper.base.errors import UsageError, non_negative_int, positive_int
from gatekeeper.certs import command as certs_command
from gatekeeper.proxy import command as proxy_command
from gatekeeper.runtime import compiled
from gatekeeper.runtime.logs import FORMAT_ENV, FORMATS, LEVEL_ENV, configure
from gatekeeper.sandbox import command as sandbox_command
from gatekeeper.webhook import command as webhook_command

# The command modules keep their imports light: prometheus_client must not be imported before a
# command has set PROMETHEUS_MULTIPROC_DIR (tests/cli/test_cli.py checks this).
# Re-exported for callers written before gatekeeper.base.errors existed; new code imports gatekeeper.base.errors.
__all__ = ["UsageError", "build_parser", "main", "non_negative_int", "positive_int"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gatekeeper",
        description=(
            "Keep a GPU cluster's Kubernetes control plane alive: an admission webhook that rejects "
            "oversized Secrets and rewrites GPU pods to DRA or shared GPUs, and an API-aware front proxy "
            "that balances every request across apiservers, limits expensive LISTs and sends GOAWAY."
        ),
    )
    parser.add_argument("--version", action="version",
                        version=f"gatekeeper {__version__} (compiled modules: {compiled.summary()})")
    parser.add_argument("--log-level", default=os.environ.get(LEVEL_ENV, "INFO"),
                        help=f"logging level (DEBUG, INFO, WARNING); default ${LEVEL_ENV} or INFO")
    parser.add_argument("--log-format", default=os.environ.get(FORMAT_ENV, "text"), choices=FORMATS,
                        help=f"text, or json (one object per line, for a log pipeline); default ${FORMAT_ENV} "
                             "or text. Proxy workers inherit both")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in (webhook_command, proxy_command, certs_command, sandbox_command):
        command.add_arguments(sub.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION))
    _register_loadtest(sub)
    return parser


def _register_loadtest(sub: argparse._SubParsersAction) -> None:
    """``gatekeeper loadtest ...`` = ``python -m loadtest ...`` (the package sits beside ``gatekeeper/`` in a
    checkout; it needs the ``loadtest`` extra)."""
    # prefix_chars "+": every argument, --help and --out included, belongs to loadtest's own parser
    p = sub.add_parser("loadtest", add_help=False, prefix_chars="+",
                       help="run a seed scenario end to end and write its report (python -m loadtest; "
                            "see `gatekeeper loadtest --help`)")
    p.add_argument("loadtest_args", nargs=argparse.REMAINDER)

    def run(args: argparse.Namespace) -> int:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        try:  # loadtest/ is not part of the installed package: only a source checkout has it
            from loadtest.cli import main as loadtest_main
        except ModuleNotFoundError as exc:
            raise UsageError(f"loadtest needs a source checkout and `pip install -e '.[loadtest]'` ({exc})") from None
        return loadtest_main(args.loadtest_args)

    p.set_defaults(func=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure(str(args.log_level), args.log_format)
        rc = args.func(args)
    except (UsageError, ConfigError, FileNotFoundError, FileExistsError) as exc:
        print(f"gatekeeper {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)
