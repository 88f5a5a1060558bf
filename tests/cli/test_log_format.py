"""`--log-format json`: one valid JSON object per record, whatever the message holds, in every proxy worker too."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from gatekeeper.certs.pki import PKI
from gatekeeper.runtime.logs import JsonFormatter


def record(msg: str, *args: object, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    return logging.LogRecord("gatekeeper.proxy", logging.WARNING, __file__, 1, msg, args, info)


def test_a_traceback_stays_inside_its_one_line_entry() -> None:
    line = JsonFormatter().format(record("failed %s", "GET /api", exc=True))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "WARNING" and entry["logger"] == "gatekeeper.proxy" and entry["msg"] == "failed GET /api"
    assert "ValueError: boom" in entry["exc"] and entry["ts"].endswith("Z")


def test_a_client_path_with_a_line_break_cannot_forge_a_second_entry() -> None:
    forged = '/api\n{"level":"ERROR","msg":"forged"}'
    line = JsonFormatter().format(record("refused target %s", forged))
    assert "\n" not in line and json.loads(line)["msg"] == f"refused target {forged}"


def test_client_bytes_that_are_not_utf8_still_make_a_valid_entry() -> None:
    """Header text is decoded with surrogateescape; orjson refuses lone surrogates, and the record was lost."""
    value = b"agent-\xff\xfe".decode("utf-8", "surrogateescape")
    line = JsonFormatter().format(record("user-agent %s", value))
    assert json.loads(line)["msg"] == "user-agent agent-\\udcff\\udcfe"


def test_proxy_workers_log_json_at_the_level_the_supervisor_was_given(tmp_path: Path) -> None:
    """Workers are exec'ed: without the environment hand-over they logged text at INFO whatever the flags."""
    pki = PKI(tmp_path / "pki")
    pki.init()
    pki.issue_serving("proxy", ips=["127.0.0.1"])
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(
        "proxy:\n  listener:\n    port: 0\n    metricsPort: 0\n"
        f"    certFile: {pki.cert_path('proxy')}\n    keyFile: {pki.key_path('proxy')}\n"
        f"  backends:\n  - url: https://127.0.0.1:1\n  upstream:\n    caFile: {tmp_path / 'pki' / 'ca.crt'}\n"
        "  flowControl:\n    enabled: false\n")

    def run(level: str) -> list[dict]:  # type: ignore[type-arg]
        """The proxy's stderr from start until both workers have served 3 s (each logs INFO lines at start)."""
        err = tmp_path / f"{level}.log"
        with err.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "gatekeeper", "--log-format", "json", "--log-level", level,
                                     "proxy", "--config", str(cfg), "--workers", "2"], stderr=out)
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            deadline = time.monotonic() + 60
            while len(children.read_text().split()) < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(3)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        return [json.loads(line) for line in err.read_text().splitlines()]  # every line is one JSON entry

    entries = run("INFO")
    parent = entries[0]["pid"]
    workers = {e["pid"] for e in entries if e["pid"] != parent and e["level"] == "INFO"}
    assert len(workers) == 2, entries  # both workers logged, as JSON
    quiet = run("WARNING")
    assert not [e for e in quiet if e["level"] == "INFO"], quiet
