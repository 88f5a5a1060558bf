"""Log output for every command: text for a terminal, JSON lines for a log pipeline.

Why JSON: on Kubernetes the proxy's and webhook's stderr go to a collector (Loki,
Elasticsearch, Cloud Logging) that indexes fields. One JSON object per line keeps
level, logger, process and a traceback in one entry, where text splits a
traceback into one entry per line; and a message quoting client bytes (a path, a
header value) cannot forge a second entry, because JSON escapes its line breaks.

The level and the format travel to exec'ed proxy workers through the environment
(``GATEKEEPER_LOG_LEVEL``, ``GATEKEEPER_LOG_FORMAT``), which is also where the
CLI reads its defaults: a worker logs like the supervisor that started it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import orjson

from gatekeeper.base.errors import UsageError

LEVEL_ENV = "GATEKEEPER_LOG_LEVEL"
FORMAT_ENV = "GATEKEEPER_LOG_FORMAT"
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _printable(text: str) -> str:
    """Text orjson accepts: lone surrogates (client bytes decoded with surrogateescape) as backslash escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ms), level, logger, pid, msg, and exc / stack when present."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        try:
            return orjson.dumps(entry).decode()
        except TypeError:  # "str is not valid UTF-8": a lone surrogate somewhere in the text
            return orjson.dumps({k: _printable(v) if isinstance(v, str) else v for k, v in entry.items()}).decode()


def configure(level: str, fmt: str) -> None:
    """Set the root logger up and export the choice to child processes."""
    if fmt not in FORMATS:
        raise UsageError(f"--log-format (or ${FORMAT_ENV}): {fmt!r} is not one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)
    os.environ[LEVEL_ENV] = level
    os.environ[FORMAT_ENV] = fmt
