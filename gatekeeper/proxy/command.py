"""`gatekeeper proxy`: CLI entry point (owned by the proxy component)."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("proxy", help="(not implemented yet)", description="not implemented yet")
    p.add_argument("--config", help="YAML config file")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gatekeeper.cli import UsageError

    raise UsageError("`gatekeeper proxy` is not implemented yet")
