"""Loaded by every Python process the reload test starts (its directory is put on ``PYTHONPATH``): the proxy's
parent and its workers. A policy file containing ``HOLD_MARK`` is parsed, then the parse waits, blocking its
thread, until the file ``$GATEKEEPER_TEST_HOLD_DIR/release`` exists; ``parsing-<pid>`` says it is waiting.
Nothing happens unless ``GATEKEEPER_TEST_HOLD_DIR`` is set."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

HOLD_MARK = "# gatekeeper-test: hold this parse"

_dir = os.environ.get("GATEKEEPER_TEST_HOLD_DIR")
if _dir:
    from gatekeeper.base import yamlfiles as config

    _real = config._documents
    _hold = Path(_dir)

    def _held(text: str, source: str, limits: Any, single: bool) -> list[Any]:
        docs = _real(text, source, limits, single)
        if HOLD_MARK in text:
            (_hold / f"parsing-{os.getpid()}").touch()
            deadline = time.monotonic() + 120
            while not (_hold / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # blocks whichever thread parses: the serving loop's, before the fix
        return docs

    config._documents = _held
