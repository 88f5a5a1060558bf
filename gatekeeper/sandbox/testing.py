"""Helpers for pytest suites that drive a sandbox (used by ``tests/conftest.py``).

They live in the package, not in a conftest, so any test module can import them
without relying on how pytest puts conftest files on ``sys.path``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gatekeeper.sandbox import processes
from gatekeeper.sandbox.state import STATE_FILE, SandboxState

Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]
"""``kubectl(*args, kubeconfig=None, input=None, timeout=60, check=False)`` as the fixture provides it."""
UP_TIMEOUT = 900
"""Upper bound for a whole ``up`` (a loaded 2-core machine is slow; a healthy up takes ~15 s)."""


class SandboxUpFailed(Exception):
    """``sandbox up`` exited non-zero; the message holds its output and what ``down`` stopped."""


def gatekeeper_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a subprocess (the way operators and CI do)."""
    return subprocess.run([sys.executable, "-m", "gatekeeper", *args], capture_output=True, text=True,
                          timeout=timeout)


def run_down(state_dir: Path) -> subprocess.CompletedProcess[str] | None:
    if not (state_dir / STATE_FILE).exists():
        return None
    return gatekeeper_cli("sandbox", "down", "--state-dir", str(state_dir))


def sandbox_up(state_dir: Path, *extra: str) -> SandboxState:
    """Run ``sandbox up``; on failure (or interrupt) run ``down`` and raise with the output."""
    argv = ["sandbox", "up", "--state-dir", str(state_dir), *extra]
    try:
        proc = gatekeeper_cli(*argv, timeout=UP_TIMEOUT)
    except BaseException:
        run_down(state_dir)
        raise
    if proc.returncode != 0:
        down = run_down(state_dir)
        raise SandboxUpFailed(
            f"`gatekeeper {' '.join(argv)}` exited {proc.returncode}\n--- stdout\n{proc.stdout}\n"
            f"--- stderr\n{proc.stderr}\n--- down\n{down.stdout if down else '(nothing to stop)'}"
        )
    return SandboxState.load(state_dir)


def processes_mentioning(directory: Path) -> list[int]:
    """Every live process whose command line mentions ``directory``: what ``down`` must leave at zero."""
    needle = str(directory).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() and processes.is_alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found
