"""Errors a user can act on, and the argparse types that produce them (base layer).

Command modules and the data modules below them raise these; ``gatekeeper.cli``
catches them and prints one line. They live here, not in ``cli.py``, so that
nothing below the CLI imports the CLI (the layer contract in
tests/architecture/test_layers.py).
"""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """An error the user can fix from the message alone; printed without a traceback."""


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts and durations that must be at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse ``type=`` for counts that may be 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class ConfigError(ValueError):
    """A configuration problem, already phrased for the operator."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source = source
        self.key = key
        self.message = message
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(where + message)


class NotRegularFile(ConfigError):
    """A file that must be a regular file is something else (a FIFO, a device, a socket, a directory)."""
