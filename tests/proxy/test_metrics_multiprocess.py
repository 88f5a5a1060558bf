"""The proxy's /metrics page is the one multiprocess-aware renderer (gatekeeper.metrics.render)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def python(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_proxy_page_sums_the_samples_of_other_worker_processes(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):  # two "workers" that each retried once, then exited
        python("from gatekeeper.proxy import metrics; metrics.UPSTREAM_RETRIES.inc()", env)
    page = python("from gatekeeper.proxy import metrics; print(metrics.render()[0].decode())", env)
    line = next(x for x in page.splitlines() if x.startswith("gatekeeper_proxy_upstream_retries_total"))
    assert float(line.split()[-1]) == 2.0
