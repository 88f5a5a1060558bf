"""What the webhook memory benches share: a webhook process per run, a flooding client process, /proc figures.

``bench webhook-worstcase`` differs from a plain run in its scenarios and in what they print, not in how a run is made:
a fresh ``gatekeeper webhook`` (one worker, default settings), a client process that opens its connections 50
handshakes at a time, each bounded to 30 s, and the worker's RSS read from /proc before and after.
"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gatekeeper.certs.pki import PKI


def status(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` figure in bytes (``VmRSS``, ``VmHWM``); 0 when absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def run_one(server_cmd: list[str], client_script: str, scenario: str, n: int, tmp: Path, pki: PKI, *,
            settle: float, cwd: Path | None = None, server: dict[str, Any] | None = None,
            probe: Callable[[int, int, str], None] | None = None, said: list[str] | None = None
            ) -> tuple[int, int, int]:
    """(RSS before, peak RSS, RSS ``settle`` s after the client said "sent") of a webhook started as
    ``server_cmd + ["webhook", ...]`` while ``client_script --client PORT CA SCENARIO N`` floods it.
    ``server``: settings of ``webhook.server`` besides the defaults. ``probe(pid, port, when)`` is called with
    ``when`` "before" (as the RSS before is read) and "during" (as the RSS at the end is read); ``said`` gets the
    client's "sent" line."""
    cfg = tmp / "config.yaml"
    extra = "".join(f"    {key}: {value}\n" for key, value in (server or {}).items())
    cfg.write_text("webhook:\n  server:\n    port: 0\n    certCheckIntervalSeconds: 0\n"
                   f"    certFile: {pki.cert_path('webhook')}\n    keyFile: {pki.key_path('webhook')}\n{extra}"
                   "  gpu:\n    enabled: false\n")
    port_file = tmp / "port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([*server_cmd, "webhook", "--config", str(cfg), "--port-file", str(port_file)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    client = None
    try:
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the webhook ({' '.join(server_cmd[1:])}) did not start")
            time.sleep(0.05)
        time.sleep(0.5)
        port = port_file.read_text().strip()
        if probe is not None:
            probe(proc.pid, int(port), "before")
        base = status(proc.pid, "VmRSS")
        client = subprocess.Popen([sys.executable, client_script, "--client", port,
                                   str(pki.cert_path("ca")), scenario, str(n)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        assert client.stdout is not None
        line = client.stdout.readline()  # "sent" (or EOF if it died)
        if said is not None:
            said.append(line.strip())
        time.sleep(settle)
        if probe is not None:
            probe(proc.pid, int(port), "during")
        return base, status(proc.pid, "VmHWM"), status(proc.pid, "VmRSS")
    finally:
        if client is not None:
            client.kill()
            client.wait()
        proc.terminate()
        proc.wait(10)


async def flood(n: int, one: Callable[[], Awaitable[None]], cut: tuple[type[BaseException], ...]) -> None:
    """``one()`` ``n`` times, 50 at a time, each bounded to 30 s; ``cut`` (the server closing on us, the
    point of a budget) and timeouts end that connection's part quietly."""
    limit = asyncio.Semaphore(50)
    quiet: tuple[type[BaseException], ...] = (TimeoutError, ssl.SSLError, *cut)

    async def bounded() -> None:
        async with limit:
            try:
                await asyncio.wait_for(one(), 30)
            except quiet:
                pass

    await asyncio.gather(*(bounded() for _ in range(n)))
