"""Run kubectl against a sandbox: the one client every component and test shares.

The sandbox's own kubectl (built from the same Kubernetes release) is preferred;
the machine's kubectl works too, the tests are written for either.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class KubectlError(Exception):
    """kubectl exited non-zero; the message carries its argv and stderr."""


def kubectl_binary(preferred: Path | str | None = None) -> str:
    if preferred and Path(preferred).is_file():
        return str(preferred)
    found = shutil.which("kubectl")
    if not found:
        raise KubectlError("no kubectl: run `gatekeeper sandbox build` (it builds one) "
                           "or put kubectl on PATH")
    return found


def run(
    kubeconfig: Path | str, *args: str, binary: Path | str | None = None, input: str | None = None,
    timeout: float = 60, check: bool = False,
) -> subprocess.CompletedProcess[str]:
    argv: Sequence[str] = [kubectl_binary(binary), f"--kubeconfig={kubeconfig}", *args]
    proc = subprocess.run(list(argv), input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise KubectlError(f"`kubectl {' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def get_json(
    kubeconfig: Path | str, *args: str, binary: Path | str | None = None, timeout: float = 60,
) -> Any:
    proc = run(kubeconfig, "get", *args, "-o", "json", binary=binary, timeout=timeout, check=True)
    return json.loads(proc.stdout)
